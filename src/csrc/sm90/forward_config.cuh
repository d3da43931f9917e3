// The compile-time config of a Hopper (sm_90a) forward kernel: the single C++ description of one
// instantiation. flash_attention.kernels.fwd_sm90.Sm90FwdConfig holds the same fields and rules;
// one flag per technique, so each step of the progression is a config and the SASS shows the
// difference.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

namespace flash::sm90 {

template <typename Elem_, int kDHead_, int kBr_, int kBc_, int kStages_, bool kWarpSpec_,
          bool kPingPong_, bool kOverlap_, bool kTmaStore_, bool kPersistent_, bool kDynamic_,
          bool kCluster_, bool kTileOverlap_, bool kQRegs_, bool kLazyRescale_, bool kExp2Fma_,
          bool kVarlen_, bool kMask_, bool kSoftcap_>
struct FwdConfig {
    using Elem = Elem_;  // of Q, K, V: fp16, bf16 or FP8 e4m3
    // FP8 (e4m3) operands: k32 wgmma steps over the same 32 bytes as the 16-bit k16 ones, V
    // transposed into K-major rows by the producer warpgroup (FP8 wgmma takes K-major B alone),
    // P converted to e4m3 in registers, per-(batch, KV head) descales folded into the softmax
    // scale (q, k) and O's normalisation (v); O is written as bf16.
    static constexpr bool kFp8 = sizeof(Elem) == 1;
    using OutElem = std::conditional_t<kFp8, __nv_bfloat16, Elem>;  // of O
    static constexpr int kElemBytes = sizeof(Elem);

    static constexpr int kDHead = kDHead_;  // 64, 128 or 256; serves multiples of 8 up to it
    static constexpr int kBr = kBr_;        // B_r: query rows per CTA, 64 per consumer warpgroup
    static constexpr int kBc = kBc_;        // B_c: key/value rows per stage
    static constexpr int kConsumerWGs = kBr / 64;  // warpgroups of 64 query rows each
    static constexpr int kStages = kStages_;       // K/V shared-memory stages
    // A producer warpgroup issues the TMA copies and gives its registers to the consumers
    // (setmaxnreg); without it, consumer thread 0 issues them between its own GEMMs.
    static constexpr bool kWarpSpec = kWarpSpec_;
    // The two consumer warpgroups take turns issuing GEMMs (named barriers), so that one's
    // softmax runs while the other's GEMMs keep the tensor cores busy.
    static constexpr bool kPingPong = kPingPong_;
    // Inside a warpgroup: the softmax of block j runs while P V_{j-1} is still on the tensor
    // cores (O is rescaled only after it lands).
    static constexpr bool kOverlap = kOverlap_;
    // O leaves through shared memory and a TMA store per warpgroup (else 4-byte stores from
    // registers).
    static constexpr bool kTmaStore = kTmaStore_;
    // A persistent grid (one CTA per SM looping over tiles): the producer loads the next tile's
    // Q and K/V while the consumers finish the current one; O leaves through its own buffer.
    static constexpr bool kPersistent = kPersistent_;
    // The persistent grid draws its tiles from a global counter (a zeroed int per launch) in an
    // order that puts the heaviest query blocks first within groups of heads whose K/V fit in L2,
    // so that uneven (causal) tiles even out over the SMs; else tile c, c + grid, ... per CTA.
    static constexpr bool kDynamic = kDynamic_;
    // CTAs in clusters of two that take neighbouring query blocks of one (batch, head): each
    // producer loads half of every K/V block and multicasts it to both, so each block leaves L2
    // once per pair; a stage is refilled once the consumers of both CTAs have released it.
    static constexpr bool kCluster = kCluster_;
    static constexpr int kClusterCtas = kCluster ? 2 : 1;
    // Across the tiles of a persistent CTA: the next tile's S_0 GEMM is issued before the current
    // tile's last P V and its softmax runs under it, so the tensor cores keep working through
    // the tile change; the next Q lands in a second buffer while the current one is still read.
    static constexpr bool kTileOverlap = kTileOverlap_;
    static constexpr int kQBuffers = kTileOverlap ? 2 : 1;
    // Each consumer warpgroup loads its Q rows into registers once per tile (wgmma A fragments),
    // so the S GEMMs read only K from shared memory (at d_head 128 a fifth of the bytes the
    // GEMMs read per block), and sQ is free for the next tile's Q after the first block.
    static constexpr bool kQRegs = kQRegs_;
    // A row's running max m moves only when the block's max exceeds it by more than
    // kRescaleLog2 (exp2 units; P then stays <= 2^8, exact in fp16/bf16 relative terms), and a
    // warp rescales O only when one of its rows moved: most blocks skip the rescale.
    static constexpr bool kLazyRescale = kLazyRescale_;
    static constexpr float kRescaleLog2 = 8.f;
    // A share of the softmax's exp2s by a polynomial on the FMA pipe (exp2_fma), the rest on
    // MUFU (16 results per clock and SM, a bound of the softmax where a score costs few GEMM
    // FLOPs: FP8 at d_head 128). Degree 2 for FP8 (P is rounded to 3 mantissa bits), 3 for
    // fp16/bf16.
    static constexpr bool kExp2Fma = kExp2Fma_;
    // Varlen (packed) batches (FwdParams::cu_seqlens_q/k): each tile finds its sequence's rows in
    // the packed tensors (TMA maps over all rows; loads past a sequence's end read the next
    // sequence's rows, which the key-tail mask hides and whose V rows are zeroed in shared memory
    // before P V), and a warpgroup whose rows cross the sequence's end stores from registers.
    static constexpr bool kVarlen = kVarlen_;
    static constexpr bool kMask = kMask_;        // causal / sliding window (as flash::FwdConfig)
    static constexpr bool kSoftcap = kSoftcap_;  // scores -> softcap * tanh(scores / softcap)

    static constexpr int kProducerWGs = kWarpSpec ? 1 : 0;
    static constexpr int kThreads = 128 * (kConsumerWGs + kProducerWGs);
    static constexpr int kConsumerWarps = 4 * kConsumerWGs;
    // Registers after setmaxnreg: the producer keeps few, the consumers take what it gives up
    // (the CTA's launch allocation, 168 per thread at 384 threads, 128 at 512). The producer of
    // the dynamic schedule or of a cluster needs a few more than 24 (else it spills).
    // FP8: the producer warpgroup transposes V, which takes more registers; with kVarlen it
    // also holds its sequence's span and the tail block's key count (72: the consumers keep 216).
    static constexpr bool kBusyProducer = kDynamic || kCluster;
    static constexpr int kProducerRegs = kFp8            ? (kVarlen ? 72 : 56)
                                         : kBusyProducer ? (kConsumerWGs == 3 ? 32 : 40)
                                                         : 24;
    // (One consumer warpgroup: 256 threads launch with 248, so it takes as much as two do.)
    static constexpr int kConsumerRegs = kConsumerWGs == 3 ? 160
                                         : kFp8            ? (kVarlen ? 216 : 224)
                                         : kBusyProducer   ? 232
                                                           : 240;

    // One warp of the wgmma accumulator layout is the mma.sync m16n8 layout of one m16 tile, so
    // the window mask of the sm80 kernels applies: S and O are n8 tiles of 4 values per thread.
    static constexpr int kNTilesS = kBc / 8;
    static constexpr int kNTilesO = kDHead / 8;
    // The FMA pipe's share of the exp2s, in eighths (Sm90FwdConfig.exp2_fma_tiles mirrors it).
    static constexpr int kExp2FmaEighths = 2;
    static constexpr int kExp2FmaTiles = kExp2Fma ? kNTilesS * kExp2FmaEighths / 8 : 0;
    static constexpr int kExp2FmaDegree = kFp8 ? 2 : 3;

    // Shared memory: tiles of panels 128 bytes wide (the 128-byte swizzle's width: 64 columns of
    // 16-bit elements, 128 of FP8), each panel rows x 128 bytes; Q (per buffer), then K and V per
    // stage (FP8: V transposed, then the V tiles as TMA lands them), O, then the mbarriers. O is
    // staged as OutElem in 64-column panels.
    static constexpr int kPanelCols = 128 / kElemBytes;
    static constexpr int kPanels = kDHead / kPanelCols;
    static constexpr int kOutPanels = kDHead / 64;
    static constexpr int kQBytes = kBr * kDHead * kElemBytes;
    static constexpr int kKVBytes = kBc * kDHead * kElemBytes;
    static constexpr int kVRawBytes = kFp8 ? kKVBytes : 0;  // per stage
    // O's staging buffer: its own on a persistent grid or with FP8 (sQ is too small), else sQ.
    static constexpr int kOBytes = kPersistent || (kFp8 && kTmaStore) ? kBr * kDHead * 2 : 0;
    static constexpr int kBarrierBytes = 1024;
    // + 1024: the dynamic smem base is rounded up to the 1024-byte swizzle period.
    static constexpr int kSmemBytes = kQBuffers * kQBytes + kStages * (2 * kKVBytes + kVRawBytes) +
                                      kOBytes + kBarrierBytes + 1024;
    // FP8: exp2 offset of P (P <= 2^8 < e4m3's 448), so that small probabilities keep bits.
    static constexpr float kPShiftLog2 = kFp8 ? 8.f : 0.f;

    static_assert(sizeof(Elem) == 2 || std::is_same_v<Elem, __nv_fp8_e4m3>,
                  "fp16, bf16 or e4m3 elements only");
    static_assert(!kFp8 ||
                      ((kDHead == 128 || kDHead == 256) &&
                       (kBc == 64 || kBc == 128 || kBc == 192) && kWarpSpec && kBr == 128 &&
                       kStages >= 2 && !kDynamic && !kCluster && !kTileOverlap && !kLazyRescale),
                  "FP8: d_head 128 or 256, B_c 64, 128 or 192 (a transposed V row: one "
                  "128-byte swizzled row of keys, or 64-byte ones), B_r 128 with the producer "
                  "warpgroup (it transposes V), 2+ stages, a static schedule, no CTA pairs, "
                  "tile overlap or lazy rescale (P would exceed e4m3's range)");
    static_assert(kDHead == 64 || kDHead == 128 || kDHead == 256, "d_head variants 64/128/256");
    static_assert(kBc == 64 || kBc == 96 || kBc == 128 || kBc == 176 || kBc == 192,
                  "B_c must be a wgmma N the kernels instantiate: 64, 96, 128, 176 or 192");
    static_assert(kBr == 64 || kBr == 128 || kBr == 192,
                  "B_r is 64 per consumer warpgroup, 1 to 3 of them");
    static_assert(kStages >= 1 && kStages <= 4, "1 to 4 K/V stages");
    static_assert(!kPingPong || (kConsumerWGs == 2 && kWarpSpec),
                  "ping-pong needs two consumer warpgroups and a producer");
    static_assert(!kPersistent || (kWarpSpec && kTmaStore && !kPingPong),
                  "the persistent grid needs the producer and the TMA-store epilogue (and no "
                  "ping-pong)");
    // What a thread gets at launch (one CTA per SM, multiples of 8, at most 255): setmaxnreg
    // moves registers between the warpgroups inside that allocation, never beyond it.
    static constexpr int kLaunchRegs = ((65536 / kThreads < 255 ? 65536 / kThreads : 255) / 8) * 8;
    static_assert(!kWarpSpec || kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWGs <=
                                    kLaunchRegs * kThreads,
                  "setmaxnreg: the consumers ask for more registers than the producer gives up");
    static_assert(!kDynamic || kPersistent, "dynamic tile scheduling needs the persistent grid");
    static_assert(!kCluster || (kWarpSpec && !kDynamic && !kMask),
                  "K/V multicast needs the producer warpgroup, a static schedule and no mask (the "
                  "two CTAs visit the same KV blocks)");
    static_assert(!kTileOverlap || kPersistent, "the tile overlap needs the persistent grid");
    static_assert(!kVarlen || !kCluster,
                  "varlen: the two CTAs of a pair could lie in different sequences");
    static_assert(kSmemBytes <= 227 * 1024, "shared memory exceeds the sm_90 limit");
};

}  // namespace flash::sm90
