// The decode kernel's compile-time config (flash::sm80::DecConfig): one CTA owns B_r = 16 or
// 32 packed query rows (the query heads of one KV head times the positions of seqlen_q, see
// decode_kernel.cuh) and its warps split the keys: each warp streams its own K/V blocks of B_c
// keys through kStages shared-memory stages, so a warp never waits for another until the end,
// where the warps' partial results are merged. It also provides the names the sm80 forward's
// fragment, GEMM and softmax code read (kMTiles, kNTilesS, kStepsQK, ...), so that code is
// reused unchanged on one or two 16-row MMA tiles per warp.
//
// B_r 32 is for calls of more than 16 packed rows (8 speculative positions of a GQA group of
// 4): one CTA reads the cache once for all 32, where two 16-row CTAs read it twice. Its Q tile
// is sliced (two m16 tiles of Q resident would take 64 more registers beside O's 128).
//
// CacheElem is the element type of K and V: Elem (q's), or an FP8 type (__nv_fp8_e4m3,
// __nv_fp8_e5m2) for an FP8 KV cache, whose tiles stay FP8 in shared memory and become fp16
// fragments as they are loaded (decode_fp8.cuh: both products then run in fp16).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

namespace flash::sm80 {

template <typename Elem_, int kDHead_, int kBr_, int kBc_, int kWarps_, typename CacheElem_ = Elem_>
struct DecConfig {
    using Elem = Elem_;
    using CacheElem = CacheElem_;
    static constexpr bool kFp8Cache = sizeof(CacheElem) == 1;
    static constexpr int kDHead = kDHead_;
    static constexpr int kSmemDHead = kDHead <= 64 ? 64 : (kDHead <= 128 ? 128 : 256);
    static constexpr int kBr = kBr_;  // packed rows: one or two m16 MMA tiles
    static constexpr int kBc = kBc_;  // keys per warp block
    static constexpr int kWarps = kWarps_;
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kStages = 3;  // K/V blocks per warp in shared memory (2 in flight)

    // The forward's technique switches, as the shared fragment/GEMM/softmax code reads them.
    static constexpr bool kSwizzle = true;
    // Q resident in registers: one m16 tile up to d_head 128.
    static constexpr bool kSliceQ = kDHead > 128 || kBr > 16;
    static constexpr bool kSliceK = true;
    static constexpr bool kSliceV = true;
    static constexpr bool kDoubleBuffer = true;
    static constexpr bool kOptSoftmax = false;
    // Masks and the softcap are run-time arguments (a decode step is bound by memory, not by the
    // few instructions they cost): every decode kernel serves every call of its dtype and d_head.
    static constexpr bool kMask = true;
    static constexpr bool kSoftcap = true;
    static constexpr int kRowsPerWarp = kBr;  // every warp holds all rows (its own keys)
    static constexpr int kMTiles = kBr / 16;
    static constexpr int kNTilesS = kBc / 8;
    static constexpr int kStepsQK = kDHead / 16;
    static constexpr int kNTilesO = kDHead / 8;
    static constexpr int kStepsPV = kBc / 16;

    static constexpr int kChunkElems = 16 / sizeof(Elem);
    static constexpr int kChunksPerRow = kSmemDHead / kChunkElems;
    static constexpr int kDataChunks = kDHead / kChunkElems;

    // K and V tiles: rows of kSmemDHead cache elements in 16-byte chunks (swizzled: kv_offset).
    static constexpr int kCacheChunkElems = 16 / int(sizeof(CacheElem));
    static constexpr int kCacheChunksPerRow = kSmemDHead / kCacheChunkElems;
    static constexpr int kKVRowBytes = kSmemDHead * int(sizeof(CacheElem));

    static constexpr int kQTileBytes = kBr * kSmemDHead * int(sizeof(Elem));
    static constexpr int kKVTileBytes = kBc * kKVRowBytes;
    static constexpr int kWarpStageBytes = kStages * 2 * kKVTileBytes;  // K and V per stage
    // The merge of the warps' results reuses the stage buffers: O (16 x d_head fp32), m and l.
    static constexpr int kMergeBytes = kWarps * kBr * (kDHead + 2) * 4;
    static constexpr int kPipeBytes = kWarps * kWarpStageBytes;
    static constexpr int kSmemBytes =
        kQTileBytes + (kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes);

    static_assert(sizeof(Elem) == 2, "fp16 or bf16 queries only");
    static_assert(sizeof(CacheElem) == 2 ? std::is_same_v<CacheElem, Elem>
                                         : (std::is_same_v<CacheElem, __nv_fp8_e4m3> ||
                                            std::is_same_v<CacheElem, __nv_fp8_e5m2>),
                  "a cache of q's dtype, or of e4m3 / e5m2");
    static_assert(kBr == 16 || (kBr == 32 && kDHead <= 128 && !kFp8Cache),
                  "B_r 16, or 32 with d_head <= 128 over a 16-bit cache (O of 32 rows x 256 "
                  "fp32 would not fit a warp's registers)");
    static_assert(kDHead == 64 || kDHead == 128 || kDHead == 256, "d_head variants 64, 128, 256");
    static_assert(kBc == 16 || kBc == 32 || (kFp8Cache && kBc == 64),
                  "B_c must be 16 or 32 (64 with an FP8 cache)");
    static_assert(!kFp8Cache || kBc % 32 == 0,
                  "an FP8 cache's K fragments come in x4 loads of 32 keys: B_c 32 or 64");
    static_assert(kWarps == 2 || kWarps == 4 || kWarps == 8, "2, 4 or 8 warps");
    static_assert((kBc * kCacheChunksPerRow) % 32 == 0,
                  "a warp's K/V block copy must split evenly");
    static_assert((kBr * kChunksPerRow) % kThreads == 0, "the Q tile copy must split evenly");
    // Above sm_80's 163 KB a config launches only where the GPU gives it the shared memory
    // (sm_90: 227 KB; the binding's check_device refuses it elsewhere).
    static_assert(kSmemBytes <= 227 * 1024, "shared memory exceeds the sm_90 limit");
};

}  // namespace flash::sm80
