// The compile-time kernel config: the single C++ description of one kernel. Every tile shape,
// fragment count and buffer size used by the kernel derives from these template arguments, and
// what cannot work is rejected here by static_assert. The Python dataclass
// flash_attention.config.KernelConfig holds the same fields and the same rules; the generated
// per-config .cu files instantiate this template from it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flash::sm80 {

template <typename Elem_, int kDHead_, int kBr_, int kBc_, int kWarps_, bool kSwizzle_,
          bool kEagerKV_, bool kSliceQ_, bool kSliceK_, bool kSliceV_, bool kDoubleBuffer_,
          bool kOptSoftmax_, bool kReverseKV_, bool kMask_, bool kSoftcap_>
struct FwdConfig {
    using Elem = Elem_;

    // d_head of this variant (a multiple of 32); it also serves every smaller d_head that is a
    // multiple of 8 (FwdParams::d_head), with the missing columns zero-filled in smem.
    static constexpr int kDHead = kDHead_;
    // Row width of the smem tiles: d_head rounded up to 64, 128 or 256 so that each row is a
    // whole number of 8-chunk swizzle groups (the XOR swizzle permutes chunks within 8).
    static constexpr int kSmemDHead = kDHead <= 64 ? 64 : (kDHead <= 128 ? 128 : 256);
    static constexpr int kBr = kBr_;  // B_r: query rows per CTA
    static constexpr int kBc = kBc_;  // B_c: key/value rows per iteration
    static constexpr int kWarps = kWarps_;

    static constexpr bool kSwizzle = kSwizzle_;  // XOR-swizzle 16-byte smem chunks by row
    static constexpr bool kEagerKV = kEagerKV_;  // prefetch V_j and K_{j+1} under compute
    static constexpr bool kSliceQ = kSliceQ_;    // Q fragments per d-slice (else resident)
    static constexpr bool kSliceK = kSliceK_;    // K fragments per d-slice (else whole block)
    static constexpr bool kSliceV = kSliceV_;    // V fragments per key-slice (else whole)
    static constexpr bool kDoubleBuffer = kDoubleBuffer_;  // prefetch slice s+1 before MMAs of s
    static constexpr bool kOptSoftmax = kOptSoftmax_;  // peeled first block, scale folded in FMA
    static constexpr bool kReverseKV = kReverseKV_;    // iterate KV blocks last to first
    // Causal / sliding-window masks: only the KV blocks a query block can see are visited, only
    // those on the window's edges are masked, and query blocks run heaviest first. Without it
    // the kernel serves unmasked attention only (and carries none of that code).
    static constexpr bool kMask = kMask_;
    static constexpr bool kSoftcap = kSoftcap_;  // scores -> softcap * tanh(scores / softcap)

    static constexpr int kThreads = kWarps * 32;
    static constexpr int kRowsPerWarp = kBr / kWarps;
    static constexpr int kMTiles = kRowsPerWarp / 16;  // m16 tiles per warp
    static constexpr int kNTilesS = kBc / 8;           // n8 tiles of S = Q K^T per warp
    static constexpr int kStepsQK = kDHead / 16;       // k16 steps of Q K^T (slices of d_head)
    static constexpr int kNTilesO = kDHead / 8;        // n8 tiles of O per warp
    static constexpr int kStepsPV = kBc / 16;          // k16 steps of P V (slices of B_c)

    static constexpr int kChunkElems = 16 / sizeof(Elem);           // elements per 16-byte chunk
    static constexpr int kChunksPerRow = kSmemDHead / kChunkElems;  // smem row stride in chunks
    static constexpr int kDataChunks = kDHead / kChunkElems;        // chunks the MMAs read

    static constexpr int kQTileElems = kBr * kSmemDHead;
    static constexpr int kKVTileElems = kBc * kSmemDHead;
    static constexpr int kSmemBytes = (kQTileElems + 2 * kKVTileElems) * int(sizeof(Elem));

    // 32-bit registers per thread that must be live together: the fp32 accumulators of S and O,
    // plus every operand held as a whole block instead of slices. Above the budget ptxas spills.
    static constexpr int kAccumRegs = kMTiles * (kNTilesO + kNTilesS) * 4;
    static constexpr int kWholeFragRegs = (kSliceQ ? 0 : kMTiles * kStepsQK * 4) +
                                          (kSliceK ? 0 : kNTilesS * kStepsQK * 2) +
                                          (kSliceV ? 0 : kNTilesO * kStepsPV * 2);
    static constexpr int kFragRegBudget = 224;

    static_assert(sizeof(Elem) == 2, "fp16 or bf16 elements only");
    static_assert(kDHead % 32 == 0 && kDHead >= 32 && kDHead <= 256,
                  "d_head variants are multiples of 32 from 32 to 256");
    static_assert(kBr == 64 || kBr == 128, "B_r must be 64 or 128");
    static_assert(kBc == 32 || kBc == 64 || kBc == 128, "B_c must be 32, 64 or 128");
    static_assert(kWarps == 4 || kWarps == 8, "4 or 8 warps");
    static_assert(kRowsPerWarp % 16 == 0, "each warp needs a whole number of 16-row MMA tiles");
    static_assert((kThreads / kChunksPerRow) % 8 == 0,
                  "a tile copy pass must cover a multiple of 8 whole smem rows (8 warps for "
                  "d_head > 128)");
    static_assert((kBc * kChunksPerRow) % kThreads == 0, "K/V tile copy must split evenly");
    static_assert((kBr * kChunksPerRow) % kThreads == 0, "Q tile copy must split evenly");
    static_assert(!kDoubleBuffer || kSliceQ || kSliceK || kSliceV,
                  "double buffering needs at least one sliced operand");
    static_assert(kAccumRegs + kWholeFragRegs <= kFragRegBudget,
                  "accumulators plus whole-block fragments exceed the register budget");
    static_assert(kSmemBytes <= 163 * 1024, "shared memory exceeds the sm_80 limit");
};

}  // namespace flash::sm80
