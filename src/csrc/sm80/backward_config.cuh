// The compile-time config of the sm80-family backward: the single C++ description of one
// backward kernel. The Python dataclass flash_attention.kernels.bwd_sm80.Sm80BwdConfig holds the
// same fields and rules; the generated per-config .cu files instantiate this template from it.
//
// One CTA owns B_c keys (and values) of one (batch, KV head) and loops over the query blocks of
// B_r rows that see them, for every query head of the KV head's group. Its warps tile three
// products, each its own way (a grid of warp rows x warp columns):
//   phase 1  S^T = K Q^T and dP^T = V dO^T     B_c x B_r, reduced over d_head
//   phase 2  dV += P^T dO (warps of the first half), dK += dS^T Q (the second half)
//                                               B_c x d_head, reduced over B_r (dK or dV resident)
//   phase 3  dQ_i += dS K                      B_r x d_head, reduced over B_c (fp32 atomics)
// P^T and dS^T pass from phase 1 to phases 2 and 3 through shared memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flash::sm80 {

// The warp rows of a grid over a (rows x cols) tile: of the splits into whole 16 x 16 tiles per
// warp, the one whose warp tile has the smallest rows + cols (each warp reads rows + cols
// operand rows from smem per k-step: the squarest tile reads least); on a tie the one with
// more warp rows (fewer m16 tiles, so fewer A fragment registers).
template <int kRows, int kCols, int kWarps>
constexpr int squarest_warp_rows() {
    int best = 0, best_cost = 1 << 30;
    for (int wr = 1; wr <= kWarps; wr *= 2) {
        const int wc = kWarps / wr;
        if (kWarps % wr != 0 || kRows % (16 * wr) != 0 || kCols % (16 * wc) != 0)
            continue;
        const int cost = kRows / wr + kCols / wc;
        if (cost <= best_cost) {
            best = wr;
            best_cost = cost;
        }
    }
    return best;
}

// A warp grid over a (rows x cols) tile: kWarpRows x kWarpCols warps, each owning kMT m16 tiles
// of rows and kNT n8 tiles of columns.
template <int kRows, int kCols, int kWarps>
struct WarpGrid {
    static constexpr int kWarpRows = squarest_warp_rows<kRows, kCols, kWarps>();
    static_assert(kWarpRows > 0, "no split of the tile gives each warp whole 16 x 16 tiles");
    static constexpr int kWarpCols = kWarps / kWarpRows;
    static constexpr int kRowsPerWarp = kRows / kWarpRows;
    static constexpr int kColsPerWarp = kCols / kWarpCols;
    static constexpr int kMT = kRowsPerWarp / 16;
    static constexpr int kNT = kColsPerWarp / 8;

    __device__ __forceinline__ static int row0(int warp) {
        return (warp / kWarpCols) * kRowsPerWarp;
    }
    __device__ __forceinline__ static int col0(int warp) {
        return (warp % kWarpCols) * kColsPerWarp;
    }
};

template <typename Elem_, int kDHead_, int kBr_, int kBc_, int kWarps_, bool kPrefetch_,
          bool kSoftcap_>
struct BwdConfig {
    using Elem = Elem_;

    // d_head of this variant (a multiple of 32); it serves every smaller multiple of 8, the
    // missing columns zero-filled in smem.
    static constexpr int kDHead = kDHead_;
    static constexpr int kSmemDHead = kDHead <= 64 ? 64 : (kDHead <= 128 ? 128 : 256);
    static constexpr int kBr = kBr_;  // B_r: query rows per iteration
    static constexpr int kBc = kBc_;  // B_c: keys per CTA
    static constexpr int kWarps = kWarps_;
    // Double-buffered query blocks: Q, dO, LSE and D of the next block stream into a second
    // buffer while this one is computed (else each block is loaded when it starts).
    static constexpr bool kPrefetch = kPrefetch_;
    static constexpr bool kSoftcap = kSoftcap_;  // scores -> softcap * tanh(scores / softcap)
    static constexpr bool kMask = true;     // masks are run-time arguments of every backward kernel
    static constexpr bool kSwizzle = true;  // the tile copies' XOR swizzle (always on)

    static constexpr int kThreads = kWarps * 32;
    static constexpr int kChunkElems = 16 / sizeof(Elem);
    static constexpr int kChunksPerRow = kSmemDHead / kChunkElems;  // Q, dO, K, V smem rows
    static constexpr int kDataChunks = kDHead / kChunkElems;

    using Phase1 = WarpGrid<kBc, kBr, kWarps>;         // S^T, dP^T: keys x queries
    using Phase2 = WarpGrid<kBc, kDHead, kWarps / 2>;  // dV or dK (a half of the warps each)
    using Phase3 = WarpGrid<kBr, kDHead, kWarps>;      // dQ: queries x d

    // The B_c x B_r tiles of P^T and dS^T: rows of B_r elements, swizzled like the others.
    struct PTile {
        static constexpr int kChunksPerRow = kBr / (16 / sizeof(Elem));
        static constexpr bool kSwizzle = true;
    };

    static constexpr int kQTileBytes = kBr * kSmemDHead * int(sizeof(Elem));
    static constexpr int kKTileBytes = kBc * kSmemDHead * int(sizeof(Elem));
    static constexpr int kPTileBytes = kBc * kBr * int(sizeof(Elem));
    static constexpr int kRowVecBytes = kBr * int(sizeof(float));  // LSE or D of a query block
    static constexpr int kQStages = kPrefetch ? 2 : 1;
    // Per stage: Q, dO, LSE * log2(e), D. Then K, V, P^T, dS^T.
    static constexpr int kStageBytes = 2 * kQTileBytes + 2 * kRowVecBytes;
    static constexpr int kSmemBytes = kQStages * kStageBytes + 2 * kKTileBytes + 2 * kPTileBytes;

    // fp32 accumulator registers of one thread: its dK or dV stays resident; phase 1 adds a chunk
    // of S^T and dP^T (the softcap derivative is used where it is computed), phase 3 a chunk
    // of the dQ tile (when phase 1's are dead).
    static constexpr int kResidentRegs = Phase2::kMT * Phase2::kNT * 4;
    static constexpr int kRegBudget = 200;

    // Phase 1 computes a warp's query columns in chunks of kP1ChunkNT n8 tiles: the widest
    // chunk (the whole warp tile where it fits) whose S^T and dP^T fit the budget beside dK and
    // dV, at least a pair of n8 tiles (each chunk reads the warp's K and V rows again).
    static constexpr int p1_chunk_nt() {
        int nt = Phase1::kNT;
        while (nt > 2 && kResidentRegs + 2 * Phase1::kMT * nt * 4 > kRegBudget)
            nt /= 2;
        return nt;
    }
    static constexpr int kP1ChunkNT = p1_chunk_nt();
    static_assert(Phase1::kNT % kP1ChunkNT == 0 && kP1ChunkNT % 2 == 0,
                  "phase 1 chunks must be whole pairs of n8 tiles");

    // Phase 3 computes a warp's dQ columns in chunks of kP3ChunkNT n8 tiles: the widest pair
    // count that divides the warp's columns with at most 12 m16 x n8 tiles (48 registers) at a
    // time, at least a pair. (Each chunk reads dS again.) d_head 64-128 and 256: 4 n8 tiles.
    static constexpr int p3_chunk_nt() {
        int best = 2;
        for (int nt = 2; nt <= Phase3::kNT; nt += 2)
            if (Phase3::kNT % nt == 0 && Phase3::kMT * nt <= 12)
                best = nt;
        return best;
    }
    static constexpr int kP3ChunkNT = p3_chunk_nt();
    static_assert(Phase3::kNT % kP3ChunkNT == 0 && kP3ChunkNT % 2 == 0,
                  "phase 3 chunks must be whole pairs of n8 tiles");

    static constexpr int kPhase1Regs = 2 * Phase1::kMT * kP1ChunkNT * 4;
    static constexpr int kPhase3Regs = Phase3::kMT * kP3ChunkNT * 4;

    static_assert(sizeof(Elem) == 2, "fp16 or bf16 elements only");
    static_assert(kDHead % 32 == 0 && kDHead >= 32 && kDHead <= 256,
                  "d_head variants are multiples of 32 from 32 to 256");
    static_assert(kBc == 64 || kBc == 128, "B_c must be 64 or 128");
    static_assert(kBr == 64 || kBr == 128, "B_r must be 64 or 128 (whole 8-chunk P^T rows)");
    static_assert(kWarps == 4 || kWarps == 8, "4 or 8 warps");
    static_assert((kThreads / kChunksPerRow) % 8 == 0,
                  "a tile copy pass must cover a multiple of 8 whole smem rows (8 warps for "
                  "d_head > 128)");
    static_assert(kBr % (kThreads / kChunksPerRow) == 0 && kBc % (kThreads / kChunksPerRow) == 0,
                  "tile copies must split evenly over the threads");
    static_assert(kBr / 2 <= kThreads, "one 16-byte copy per thread loads LSE and D");
    static_assert(kResidentRegs + (kPhase1Regs > kPhase3Regs ? kPhase1Regs : kPhase3Regs) <=
                      kRegBudget,
                  "accumulators exceed the register budget: use more warps or a smaller tile");
    // (plus 128 bytes of static smem: the CTA's span)
    static_assert(kSmemBytes + 128 <= 163 * 1024, "shared memory exceeds the sm_80 limit");
};

}  // namespace flash::sm80
