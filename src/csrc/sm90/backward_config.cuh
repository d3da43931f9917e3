// The compile-time config of a Hopper (sm_90a) backward kernel: the single C++ description of one
// instantiation. flash_attention.kernels.bwd_sm90.BwdConfig holds the same fields and rules.
//
// d_head 64 and 128: one CTA owns B_c = 128 keys (and values) of one (batch, KV head); consumer
// warpgroup g owns keys 64g .. 64g + 63 end to end (its dK and dV rows stay in registers). A
// producer warp streams the query blocks of B_r = 64 rows (128 at d_head 64) that see them (Q,
// dO, LSE * log2(e), D; two stages) for every query head of the group. Per query block, in each
// consumer warpgroup:
//   S^T = K Q^T, dP^T = V dO^T          wgmma, both operands in shared memory (K-major)
//   P^T, dS^T                            registers (fp32), then 16-bit A fragments
//   dV += P^T dO, dK += dS^T Q           wgmma, A from registers, B MN-major in shared memory
//   dQ[:, half g] = dS K[:, half g]      wgmma over all B_c keys: dS^T of both warpgroups
//                                        through shared memory (MN-major A); at d_head 64
//                                        (kDqOwnKeys) dQ_g = dS_g K_g over its own keys instead,
//                                        issued before dK's GEMM so that dQ leaves while dK runs
// and its dQ part goes to shared memory in the accumulator's own order (conflict-free 16-byte
// stores), from where a writer warp of the producer warpgroup adds it to the fp32 dQ
// accumulator with one bulk reduce-add: the accumulator holds each block of B_r rows in that
// order (tile by tile of 8 columns, thread by thread), which the dQ conversion reads back.
//
// d_head 256 (kSplitD): 64 keys' dK and dV rows (256 fp32 registers per thread) do not fit one
// warpgroup, so B_c = 64 and both warpgroups work on all of them, splitting d_head instead:
//   S^T, dP^T [:, query columns 32g ..]  wgmma m64n32, K and V whole, Q and dO rows 32g ..
//   P^T, dS^T                            through shared memory (two buffers each), a barrier
//                                        of both warpgroups per block
//   dV[:, 128g ..] += P^T dO[:, 128g ..], dK likewise with dS^T and Q: A and B from shared memory
//   dQ[:, 128g ..] = dS K[:, 128g ..]    in two parts of 64 columns, each added by the
//                                        consumer threads (16-byte reductions), or with the
//                                        deterministic order handed to the writer
// dO has one stage (shared memory): the next block's dO loads while this block's dK and dQ run.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flash::sm90 {

template <typename Elem_, int kDHead_, int kBr_, int kBc_, bool kVarlen_, bool kSoftcap_>
struct BwdConfig {
    using Elem = Elem_;

    static constexpr int kDHead = kDHead_;  // 64, 128 or 256; serves multiples of 8 up to it
    // Varlen (packed) batches alone: a CTA finds its sequence through cu_seqlens, the TMA maps
    // span the packed rows, the rows of a block past its sequence's end (the next sequence's)
    // are zeroed in shared memory, the per-row buffers hold each sequence from a multiple of
    // bwd::kVarlenRowAlign (backward_common.cuh), and dK/dV rows that end inside the tensor are
    // copied out of the staging buffer.
    static constexpr bool kVarlen = kVarlen_;
    static constexpr bool kSoftcap = kSoftcap_;  // scores -> softcap * tanh(scores / softcap)
    static constexpr bool kMask = true;  // masks are run-time arguments of every backward kernel
    static constexpr int kConsumerWGs = 2;
    // kSplitD: the warpgroups share the CTA's keys and split d_head (see above).
    static constexpr bool kSplitD = kDHead == 256;
    // B_r: query rows per block; 128 only with kDqOwnKeys (d_head 64), where the per-block
    // costs (barriers, waits, the writer's handover) weigh most against GEMMs of 64 columns.
    static constexpr int kBr = kBr_;
    // B_c: keys per CTA, fixed by d_head: 64 per consumer warpgroup, or 64 shared by both with
    // kSplitD. A template argument so that a kernel's name and type say its tile.
    static constexpr int kBc = kBc_;
    static_assert(kBc == (kSplitD ? 64 : 64 * kConsumerWGs), "B_c is 64 at d_head 256, else 128");
    static constexpr int kWgKeys = kSplitD ? 0 : 64;  // the first key of warpgroup g: kWgKeys g
    static constexpr int kStages = 2;  // query-block stages in shared memory (Q, LSE, D)
    static constexpr int kDoStages = kSplitD ? 1 : kStages;  // dO's
    // A warpgroup's S^T and dP^T query columns (from kSCols g), and its dK and dV columns.
    static constexpr int kSCols = kSplitD ? kBr / kConsumerWGs : kBr;
    static constexpr int kDCols = kSplitD ? kDHead / kConsumerWGs : kDHead;
    // kDqOwnKeys: each consumer warpgroup computes dQ = dS K over its own 64 keys, every d_head
    // column (its partial, added by the writer warp like the other's), so the warpgroups never
    // wait for each other inside the loop. Otherwise each computes half the d_head columns over
    // all B_c keys, from both warpgroups' dS^T: a barrier of both per block, half the
    // accumulator (registers: d_head 128).
    static constexpr bool kDqOwnKeys = kDHead == 64;
    static constexpr int kDqCols = kDqOwnKeys ? kDHead : kDHead / kConsumerWGs;  // per warpgroup
    static constexpr int kDqMTiles = kBr / 64;  // m64 tiles of a warpgroup's dQ (query rows)
    // A warpgroup's dQ leaves in parts of 64 columns (two at d_head 256, where its threads add
    // them, or with the deterministic order the writer does).
    static constexpr int kDqParts = kDqCols / 64;
    // dS^T buffers: with kDqOwnKeys a warpgroup's dQ GEMM reads only its own rows of dS^T, and
    // has completed in every warp of the warpgroup before that warpgroup stores the next
    // block's (BackwardConsumer::store_dq), so one buffer serves; otherwise two (the other
    // warpgroup may still read the previous block's).
    static constexpr int kDsBuffers = kDqOwnKeys ? 1 : 2;
    static constexpr int kPBuffers = kSplitD ? 2 : 0;  // P^T in shared memory (kSplitD)
    // kDqBeforeDk: dQ's GEMM is issued before dK's, so that dQ leaves for the writer while dK
    // runs (at d_head 128 without a softcap its registers would spill).
    static constexpr bool kDqBeforeDk = kDqOwnKeys || kSoftcap;

    static constexpr int kThreads = 128 * (kConsumerWGs + 1);
    // The producer warpgroup: warp 0 loads (one thread), warp 1 writes dQ (one thread issues).
    static constexpr int kConsumerWarps = 4 * kConsumerWGs;
    static constexpr int kProducerRegs = 24;
    static constexpr int kConsumerRegs = 240;

    // What the shared TMA loader and epilogue read (sm90/tma_loader.cuh, epilogue.cuh): no
    // cluster, one CTA per (KV block, KV head, batch), d_head in 64-column panels.
    static constexpr bool kCluster = false;
    static constexpr int kClusterCtas = 1;
    static constexpr bool kPersistent = false;
    static constexpr int kPanels = kDHead / 64;
    static constexpr int kPanelCols = 64;
    static constexpr int kOutPanels = kPanels;
    using OutElem = Elem;                        // of dK, dV
    static constexpr int kNTilesO = kDCols / 8;  // n8 tiles of a warpgroup's dK or dV row

    // Shared memory (1024-byte aligned tiles of 64-column panels, 128 bytes per row):
    //   K | V | Q x kStages | dO x kDoStages | dS^T x kDsBuffers | P^T x kPBuffers | dQ |
    //   LSE x kStages | D x kStages | barriers
    // dS^T and P^T are B_c x B_r (B_r / 64 panels). At the end the Q and dO stages stage dV and
    // dK for their TMA stores (each B_c x d_head). dQ holds one part per warpgroup (B_r x 64
    // fp32), one after the other, each in m64 tiles of query rows.
    static constexpr int kKBytes = kBc * kDHead * 2;
    static constexpr int kQBytes = kBr * kDHead * 2;
    static constexpr int kDSBytes = kBc * kBr * 2;
    static constexpr int kDqBytes = kBr * 64 * 4 * kConsumerWGs;  // a dQ part per warpgroup
    static constexpr int kVecBytes = kBr * 4;
    static constexpr int kSK = 0;
    static constexpr int kSV = kSK + kKBytes;
    static constexpr int kSQ = kSV + kKBytes;
    static constexpr int kSdO = kSQ + kStages * kQBytes;
    static constexpr int kSdS = kSdO + kDoStages * kQBytes;
    static constexpr int kSP = kSdS + kDsBuffers * kDSBytes;
    static constexpr int kSdQ = kSP + kPBuffers * kDSBytes;
    static constexpr int kSLse = kSdQ + kDqBytes;
    static constexpr int kSD = kSLse + kStages * kVecBytes;
    static constexpr int kSBarriers = kSD + kStages * kVecBytes;
    static constexpr int kBarrierBytes = 128;
    // + 1024: the dynamic smem base is rounded up to the 1024-byte swizzle period.
    static constexpr int kSmemBytes = kSBarriers + kBarrierBytes + 1024;

    static_assert(sizeof(Elem) == 2, "fp16 or bf16 elements only");
    static_assert(kDHead == 64 || kDHead == 128 || kDHead == 256, "d_head variants 64, 128, 256");
    static_assert(kBr == 64 || (kBr == 128 && kDqOwnKeys), "B_r 64, or 128 with kDqOwnKeys");
    static_assert(kStages * kQBytes >= kKBytes && kDoStages * kQBytes >= kKBytes,
                  "the Q and dO stages stage dV and dK at the end");
    static_assert(kSCols % 16 == 0 && kDCols % 64 == 0, "k16 steps of S^T, panels of dK and dV");
    static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWGs <= 65536,
                  "setmaxnreg: the consumers ask for more registers than the producer gives up");
    static_assert(kSmemBytes <= 227 * 1024, "shared memory exceeds the sm_90 limit");
};

}  // namespace flash::sm90
