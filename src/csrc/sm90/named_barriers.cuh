// The named barrier ids of the Hopper kernels (ids 1..15; 0 is __syncthreads), in one place so
// that roles written in different headers never share an id.
#pragma once

namespace flash::sm90 {

enum NamedBarrier : int {
    // Ping-pong (mainloop): consumer warpgroup g waits on kTurnBarrier + g for its turn to issue
    // GEMMs, the other warpgroup arrives on it when it passes the turn (2 x 128 threads).
    kTurnBarrier = 1,  // and 2
    // Epilogue: the 128 threads of consumer warpgroup g around its O staging buffer.
    kEpilogueBarrier = 3,  // and 4 (5 with a third warpgroup)
    // Varlen forward: the 128 threads of consumer warpgroup g have zeroed the V rows past their
    // sequence's last key (ForwardConsumer::clear_v_tail).
    kVTailBarrier = 13,  // and 14 (15 with a third warpgroup)
    // Varlen backward: the 128 threads of consumer warpgroup g have zeroed the rows of a tile
    // past their sequence's end (BackwardConsumer::tail_zeroed). The forward's ids: no kernel
    // has both roles.
    kBwdTailBarrier = 13,  // and 14
    // Backward: both consumer warpgroups (2 x 128 threads) have stored their dS^T of a block
    // (and at the end: are done with every stage).
    kBwdDsBarrier = 6,
    // Backward dQ (per consumer warpgroup g, 128 + 32 threads): kBwdDqFull + g when g has
    // written a block's dQ to shared memory for the writer warp, kBwdDqEmpty + g when the
    // writer's bulk reduction has read it.
    kBwdDqFull = 7,   // and 8
    kBwdDqEmpty = 9,  // and 10
    // Backward with kDqOwnKeys: consumer warpgroup g's 128 threads have stored their dS^T of a
    // block (its own dQ GEMM reads it).
    kBwdDsOwnBarrier = 11,  // and 12
};

}  // namespace flash::sm90
