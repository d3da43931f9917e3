// FlashAttention forward on Hopper: TMA copies into 128-byte-swizzled shared memory completing on
// mbarriers, wgmma for S = Q K^T (both operands in shared memory) and O += P V (P from
// registers), a K/V pipeline of kStages stages, and optionally a producer warpgroup with
// setmaxnreg, ping-pong between the consumer warpgroups, softmax overlapped with P V, an
// epilogue through shared memory and a TMA store, Q held in registers (S GEMMs with A from
// registers) and a lazy rescale of O (only when a row's max grows by more than 2^8).
//
// One CTA owns B_r = 64 x kConsumerWGs query rows of one (batch, head); consumer warpgroup g owns
// rows 64g .. 64g + 63 end to end. Per KV block j (from the last to the first):
//   S_j = Q K_j^T -> softcap -> mask (key tail; window edges with kMask) -> online softmax
//   O += P_j V_j
// issued as S_j, then (O rescaled for block j-1 while S_j runs) P_{j-1} V_{j-1}, so that the
// tensor cores never wait on a warpgroup's softmax when there is work of the other one to do;
// with kOverlap the softmax of S_j runs while P_{j-1} V_{j-1} is still on the tensor cores.
//
// Pipeline: barriers k_full/v_full[s] complete when the TMA copies of stage s have landed (the
// producer arrives once with the byte count); k_empty/v_empty[s] complete when every consumer
// warp has finished the GEMM reading that stage. Use u of stage s waits for phase parity u & 1.
// With kCluster the two CTAs of a cluster take neighbouring query blocks of one (batch, head) and
// the same K/V blocks: each producer copies half of a block's rows and multicasts them to both
// CTAs (each full barrier still counts the whole block's bytes), and each consumer warp arrives
// on the empty barriers of both CTAs, so neither producer refills a stage the other still reads.
// With kTileOverlap a persistent CTA hands one tile to the next without draining: the next
// tile's S_0 is issued before the current tile's last P V (its Q in the second Q buffer), its
// softmax runs while that P V is on the tensor cores, and the epilogue follows.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common/ldmatrix.cuh"
#include "../common/mask.cuh"
#include "../common/numeric.cuh"
#include "../common/params.h"
#include "ptx.cuh"
#include "wgmma.cuh"

namespace flash::sm90 {

// n / d for 0 <= n < 2^31 and a divisor fixed per launch: a multiply-high and a shift
// with a magic number the launcher computes (Granlund-Montgomery), in place of the ~20 dependent
// instructions of an integer division on the tile change's critical path.
struct FastDiv {
    int d;
    uint32_t magic, shift;

    FastDiv() = default;
    __host__ explicit FastDiv(int divisor) : d(divisor > 1 ? divisor : 1), shift(0) {
        divisor = d;
        while ((uint64_t(1) << shift) < uint64_t(divisor))
            ++shift;
        magic = uint32_t((uint64_t(1) << 32) * ((uint64_t(1) << shift) - divisor) / divisor + 1);
    }
    __device__ __forceinline__ int div(int n) const {
        return int((__umulhi(uint32_t(n), magic) + uint32_t(n)) >> shift);
    }
};

struct Sm90Params {
    FwdParams p;
    // Tile numbering: query tiles per (batch, head) (Work::q_tiles), heads, heads per KV head.
    FastDiv q_tiles, heads, heads_per_kv;
    // 4-D maps (d_head, seqlen, heads, batch): Q and O boxes are 64 columns x B_r (Q) or 64 (O,
    // one warpgroup's rows) rows, K and V 64 columns x B_c rows; all 128-byte swizzled.
    CUtensorMap tma_q, tma_k, tma_v, tma_o;
    // kDynamic: (batch, head) pairs per group of the tile order (see Work), chosen by the
    // launcher so that a group's K and V stay in L2.
    int sched_heads;
};

template <class Cfg>
struct Smem {
    static constexpr uint32_t kQ = 0;
    static constexpr uint32_t kK = kQ + Cfg::kQBuffers * Cfg::kQBytes;
    static constexpr uint32_t kV = kK + Cfg::kStages * Cfg::kKVBytes;
    static constexpr uint32_t kO = kV + Cfg::kStages * Cfg::kKVBytes;
    static constexpr uint32_t kBarriers = kO + Cfg::kOBytes;

    unsigned char* base;  // 1024-byte aligned

    // Q of the CTA's tile use u (u counts its tiles with work): buffer u % kQBuffers, whose
    // round u / kQBuffers gives the phases of its full and empty barriers.
    __device__ __forceinline__ static int q_buffer(int u) { return u % Cfg::kQBuffers; }
    __device__ __forceinline__ static uint32_t q_phase(int u) { return (u / Cfg::kQBuffers) & 1; }
    __device__ __forceinline__ unsigned char* q(int u) const {
        return base + kQ + q_buffer(u) * Cfg::kQBytes;
    }
    __device__ __forceinline__ unsigned char* k(int s) const {
        return base + kK + s * Cfg::kKVBytes;
    }
    __device__ __forceinline__ unsigned char* v(int s) const {
        return base + kV + s * Cfg::kKVBytes;
    }
    // O staging of the epilogue: its own buffer on a persistent grid, else sQ (free by then).
    __device__ __forceinline__ unsigned char* o() const {
        return Cfg::kPersistent ? base + kO : q(0);
    }
    __device__ __forceinline__ uint64_t* bar(int i) const {
        return reinterpret_cast<uint64_t*>(base + kBarriers) + i;
    }
    __device__ __forceinline__ uint64_t* q_full(int u) const {
        return q_buffer(u) == 0 ? bar(0) : bar(6 + 4 * Cfg::kStages);
    }
    __device__ __forceinline__ uint64_t* k_full(int s) const { return bar(1 + s); }
    __device__ __forceinline__ uint64_t* v_full(int s) const { return bar(1 + Cfg::kStages + s); }
    __device__ __forceinline__ uint64_t* k_empty(int s) const {
        return bar(1 + 2 * Cfg::kStages + s);
    }
    __device__ __forceinline__ uint64_t* v_empty(int s) const {
        return bar(1 + 3 * Cfg::kStages + s);
    }
    // Persistent grid: a Q buffer is free for a later tile once every consumer warp has
    // finished its last S GEMM of the tile that used it.
    __device__ __forceinline__ uint64_t* q_empty(int u) const {
        return q_buffer(u) == 0 ? bar(1 + 4 * Cfg::kStages) : bar(7 + 4 * Cfg::kStages);
    }
    // Dynamic schedule: the producer passes tile numbers to the consumers through two slots;
    // tile_full[i] completes when slot i holds the next one, tile_empty[i] when every consumer
    // warp has read it.
    __device__ __forceinline__ uint64_t* tile_full(int i) const {
        return bar(2 + 4 * Cfg::kStages + i);
    }
    __device__ __forceinline__ uint64_t* tile_empty(int i) const {
        return bar(4 + 4 * Cfg::kStages + i);
    }
    __device__ __forceinline__ volatile int* tile_slot(int i) const {
        return reinterpret_cast<volatile int*>(base + kBarriers + kSlotOffset) + i;
    }
    static constexpr int kBarrierCount = 8 + 4 * Cfg::kStages;
    static constexpr uint32_t kSlotOffset = Cfg::kBarrierBytes - 16;
    static_assert(kBarrierCount * 8 <= kSlotOffset, "mbarriers do not fit");
};

// One tile of work: a query block of one (batch, head), and the KV blocks it visits. Tiles are
// numbered query block fastest (neighbouring tiles share K and V in L2). With kCluster a tile is
// a pair of neighbouring query blocks, 2t + rank for the CTA of that rank in its cluster (with an
// odd count the last pair's second block lies past seqlen_q: it is computed, never stored). The
// dynamic schedule numbers them in groups of sched_heads (batch, head) pairs whose K and V fit in
// L2 together; inside a group, query blocks from the last down (the most keys under a causal mask
// first, where the counter hands them out first), heads fastest.
template <class Cfg>
struct Work {
    int q_block, head, kv_head, batch;
    int q_row0;  // first query row of the tile
    KvBlocks kv;
    int n_blocks;

    __host__ __device__ __forceinline__ static int q_blocks(const FwdParams& p) {
        return (p.seqlen_q + Cfg::kBr - 1) / Cfg::kBr;
    }
    // Query blocks per (batch, head) in tile numbers: pairs with kCluster (the launcher's too).
    __host__ __device__ __forceinline__ static int q_tiles(const FwdParams& p) {
        return (q_blocks(p) + Cfg::kClusterCtas - 1) / Cfg::kClusterCtas;
    }
    __device__ __forceinline__ static int tiles(const FwdParams& p) {
        return q_tiles(p) * p.heads * p.batch;
    }

    Work() = default;
    __device__ __forceinline__ Work(const Sm90Params& prm, int tile) {
        const FwdParams& p = prm.p;
        const int qb = q_blocks(p);
        int pair;  // batch * heads + head
        if constexpr (!Cfg::kDynamic) {
            pair = prm.q_tiles.div(tile);
            const int in = tile - pair * prm.q_tiles.d;
            if constexpr (Cfg::kCluster)
                q_block = 2 * in + int(cluster_ctarank());
            else
                q_block = Cfg::kMask ? qb - 1 - in : in;  // (masks: from the last block down)
        } else {
            const int per_group = prm.sched_heads * qb;
            const int group = tile / per_group, in = tile % per_group;
            const int heads_in = min(prm.sched_heads, p.batch * p.heads - group * prm.sched_heads);
            q_block = qb - 1 - in / heads_in;
            pair = group * prm.sched_heads + in % heads_in;
        }
        batch = prm.heads.div(pair);
        head = pair - batch * p.heads;
        kv_head = prm.heads_per_kv.div(head);
        q_row0 = q_block * Cfg::kBr;
        if constexpr (Cfg::kMask) {
            kv = window_blocks<Cfg::kBr, Cfg::kBc>(p, p.seqlen_q, p.seqlen_k, q_row0);
            n_blocks = kv.count();
        } else {
            kv = KvBlocks{0, (p.seqlen_k + Cfg::kBc - 1) / Cfg::kBc - 1, 0, 0};
            n_blocks = kv.last + 1;
        }
    }
    // Visit order: last block first (with a causal mask it holds the diagonal, so the row
    // maxima are known early).
    __device__ __forceinline__ int block(int i) const { return kv.last - i; }
    __device__ __forceinline__ bool needs_mask(int j, int seqlen_k) const {
        if constexpr (Cfg::kMask)
            return kv.needs_mask(j);
        return (j + 1) * Cfg::kBc > seqlen_k;
    }
};

// The TMA side: copies of Q and of the K/V blocks into their stages. K/V blocks are numbered
// across the CTA's tiles (g): block g goes to stage g % kStages, its use g / kStages of it.
template <class Cfg>
struct Loader {
    const Sm90Params& prm;
    const Smem<Cfg>& sm;
    const int rank;  // in the cluster (0 without kCluster)

    // Waits until stage s may be refilled: released by the consumers (of both CTAs with kCluster;
    // a CTA-scope wait as the producer reads nothing they wrote, it only orders its next copy
    // after their reads).
    __device__ __forceinline__ static void wait_empty(uint64_t* bar, int use) {
        if (use > 0)
            mbar_wait(bar, (use - 1) & 1);
    }
    // This CTA's share of K/V block `block` (all of it, or half the rows multicast to both CTAs)
    // into stage buffer `dst`, completing on `full`.
    __device__ __forceinline__ void load_kv(unsigned char* dst, const CUtensorMap* map,
                                            uint64_t* full, const Work<Cfg>& w, int block) const {
        mbar_arrive_expect_tx(full, Cfg::kKVBytes);
        constexpr int kRows = Cfg::kBc / Cfg::kClusterCtas;  // a multiple of 8: 1024-byte aligned
        const int row0 = block * Cfg::kBc + rank * kRows;
#pragma unroll
        for (int c = 0; c < Cfg::kPanels; ++c) {
            unsigned char* panel = dst + c * Cfg::kBc * 128 + rank * kRows * 128;
            if constexpr (Cfg::kCluster)
                tma_load_4d_multicast(panel, map, full, 0x3, c * 64, row0, w.kv_head, w.batch);
            else
                tma_load_4d(panel, map, full, c * 64, row0, w.kv_head, w.batch);
        }
    }

    // Q of tile use u (the CTA's u-th tile with work), once the S GEMMs of the tile that used its
    // buffer before are done.
    __device__ __forceinline__ void load_q(const Work<Cfg>& w, int u) const {
        if (Cfg::kPersistent && u >= Cfg::kQBuffers)
            mbar_wait(sm.q_empty(u), Smem<Cfg>::q_phase(u) ^ 1);
        mbar_arrive_expect_tx(sm.q_full(u), Cfg::kQBytes);
#pragma unroll
        for (int c = 0; c < Cfg::kPanels; ++c)
            tma_load_4d(sm.q(u) + c * Cfg::kBr * 128, &prm.tma_q, sm.q_full(u), c * 64, w.q_row0,
                        w.head, w.batch);
    }
    // Block i of the tile's visit order, pipeline block g, once its stage is released.
    __device__ __forceinline__ void load_k(const Work<Cfg>& w, int i, int g) const {
        const int s = g % Cfg::kStages;
        wait_empty(sm.k_empty(s), g / Cfg::kStages);
        load_kv(sm.k(s), &prm.tma_k, sm.k_full(s), w, w.block(i));
    }
    __device__ __forceinline__ void load_v(const Work<Cfg>& w, int i, int g) const {
        const int s = g % Cfg::kStages;
        wait_empty(sm.v_empty(s), g / Cfg::kStages);
        load_kv(sm.v(s), &prm.tma_v, sm.v_full(s), w, w.block(i));
    }
};

// Online softmax of one warpgroup's rows, split so that O can be rescaled after P V_{j-1} has
// landed: scores() turns S into P and returns the rescale factors, rescale() applies them.
// Thread rows: lane / 4 and lane / 4 + 8 of its warp's 16; a row's quad holds its columns.
template <class Cfg>
struct Softmax {
    float m[2];  // running max, raw score units (scaled inside the exp2 FMA)
    float l[2];  // this thread's share of the running sum
    // kLazyRescale: a row of this warp moved its max in the last scores() (warp-uniform), so O
    // needs the rescale; otherwise every factor is 1.
    bool moved = false;

    __device__ __forceinline__ void init() {
        m[0] = m[1] = -INFINITY;
        l[0] = l[1] = 0.f;
    }

    template <bool kFirst>
    __device__ __forceinline__ void scores(float (&S)[Cfg::kNTilesS][4], float scale_log2,
                                           float (&corr)[2]) {
        bool row_moved = false;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = m[h];
#pragma unroll
            for (int t = 0; t < Cfg::kNTilesS; ++t)
                mx = fmaxf(mx, fmaxf(S[t][2 * h], S[t][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            if constexpr (Cfg::kLazyRescale && !kFirst) {
                // Keep the old max while the new one exceeds it by at most kRescaleLog2 (false
                // for an old max of -inf: +inf or NaN on the left).
                if ((mx - m[h]) * scale_log2 <= Cfg::kRescaleLog2)
                    mx = m[h];
                row_moved |= mx != m[h];
            }
            // A row with no finite score yet keeps offset 0: exp2(-inf) = 0, never NaN.
            const float offset = mx == -INFINITY ? 0.f : mx * scale_log2;
            corr[h] = (kFirst || mx == -INFINITY) ? 1.f : fast_exp2((m[h] - mx) * scale_log2);
            m[h] = mx;
            float sum = 0.f;
#pragma unroll
            for (int t = 0; t < Cfg::kNTilesS; ++t)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    S[t][e] = fast_exp2(fmaf(S[t][e], scale_log2, -offset));
                    sum += S[t][e];
                }
            l[h] = kFirst ? sum : l[h] * corr[h] + sum;
        }
        if constexpr (Cfg::kLazyRescale)
            moved = !kFirst && __any_sync(0xffffffffu, row_moved);
    }

    // O *= the factors of the last scores() (skipped by a warp whose rows all kept their max).
    __device__ __forceinline__ void rescale(float (&O)[Cfg::kNTilesO][4],
                                            const float (&corr)[2]) const {
        if (Cfg::kLazyRescale && !moved)
            return;
#pragma unroll
        for (int t = 0; t < Cfg::kNTilesO; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                O[t][e] *= corr[e / 2];
    }

    // Once the last block's scores are in: O's factors 1 / l and the LSE (natural log) per row;
    // a row with no key gives O = 0 and LSE = -inf.
    __device__ __forceinline__ void totals(float (&inv)[2], float (&lse)[2],
                                           float scale_log2) const {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = l[h];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            // MUFU approximations (about 2^-22 relative): the precise 1/x and log2f are ~100
            // dependent instructions with slow paths, on the tile change's critical path.
            inv[h] = sum > 0.f ? fast_rcp(sum) : 0.f;
            lse[h] =
                sum > 0.f ? (m[h] * scale_log2 + fast_log2(sum)) * 0.69314718055994531f : -INFINITY;
        }
    }
    // O /= l, with inv from totals().
    __device__ __forceinline__ static void normalize(float (&O)[Cfg::kNTilesO][4],
                                                     const float (&inv)[2]) {
#pragma unroll
        for (int t = 0; t < Cfg::kNTilesO; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                O[t][e] *= inv[e / 2];
    }
};

// One consumer warpgroup: its 64 query rows through every KV block.
template <class Cfg>
struct Consumer {
    using Elem = typename Cfg::Elem;
    static constexpr int kNS = Cfg::kNTilesS, kNO = Cfg::kNTilesO;
    static constexpr int kStepsQK = Cfg::kDHead / 16, kStepsPV = Cfg::kBc / 16;

    const Sm90Params& prm;
    const Smem<Cfg>& sm;
    const Loader<Cfg>& loader;
    const int wg, warp, lane;  // warpgroup among the consumers; warp among the consumer warps
    // The current tile: a copy with kTileOverlap (the next one is set up while the current one
    // ends), else the caller's (a pointer keeps ptxas from copying its fields).
    std::conditional_t<Cfg::kTileOverlap, Work<Cfg>, const Work<Cfg>*> work{};
    __device__ __forceinline__ const Work<Cfg>& tile() const {
        if constexpr (Cfg::kTileOverlap)
            return work;
        else
            return *work;
    }
    __device__ __forceinline__ void set_tile(const Work<Cfg>& w) {
        if constexpr (Cfg::kTileOverlap)
            work = w;
        else
            work = &w;
    }
    int g0 = 0;  // pipeline number of the tile's first K/V block
    int qu = 0;  // its Q use (Smem::q)

    float O[kNO][4];
    float S[kNS][4];
    uint32_t P[kStepsPV][4];                     // P of the previous block as wgmma A fragments
    uint32_t Qf[Cfg::kQRegs ? kStepsQK : 1][4];  // kQRegs: the tile's Q as wgmma A fragments
    float corr[2];  // O's rescale factors for the previous block's softmax
    Softmax<Cfg> softmax;

    // ---- GEMMs --------------------------------------------------------------------------------

    // S = Q K_i^T, K-major operands: Q rows of this warpgroup and K_i rows, 16 columns of d per
    // instruction (a 32-byte step inside the swizzled 128-byte row, then the next panel).
    // With kQRegs, A is Qf (load_q_regs()).
    __device__ __forceinline__ void issue_qk(int s) {
        const uint32_t q0 = smem_u32(sm.q(qu)) + wg * 64 * 128;
        const uint32_t k0 = smem_u32(sm.k(s));
#pragma unroll
        for (int kk = 0; kk < kStepsQK; ++kk) {
            const uint32_t step = (kk % 4) * 32;  // bytes into the 128-byte row
            const uint64_t b = desc_sw128(k0 + (kk / 4) * Cfg::kBc * 128 + step, 16, 1024);
            if constexpr (Cfg::kQRegs) {
                Wgmma<Cfg::kBc, Elem>::rs_k(S, Qf[kk], b, kk > 0 ? 1u : 0u);
            } else {
                const uint64_t a = desc_sw128(q0 + (kk / 4) * Cfg::kBr * 128 + step, 16, 1024);
                Wgmma<Cfg::kBc, Elem>::ss(S, a, b, kk > 0 ? 1u : 0u);
            }
        }
    }

    // kQRegs, once Q of the tile has landed: this warp's 16 rows, one ldmatrix.x4 per k16 step
    // (lanes 8i .. 8i + 7 address tile i: rows + 8 for odd i, the step's upper 8 columns for
    // i >= 2) from the swizzled panels; then sQ may take the next tile's Q.
    __device__ __forceinline__ void load_q_regs() {
        const int r = (warp % 4) * 16 + lane % 8 + 8 * ((lane / 8) % 2);  // of the warpgroup
        const uint32_t q0 = smem_u32(sm.q(qu)) + (wg * 64 + r) * 128;
#pragma unroll
        for (int kk = 0; kk < kStepsQK; ++kk) {
            const int chunk = 2 * (kk % 4) + lane / 16;  // 16-byte chunk of the 128-byte row
            ldmatrix_x4(Qf[kk], q0 + (kk / 4) * Cfg::kBr * 128 + ((chunk ^ (r & 7)) * 16));
        }
        release_q();
    }

    // O += P V_i: B is V (kv rows x d) MN-major: 8-row groups 1024 bytes apart (SBO), 64-column
    // panels B_c x 128 bytes apart (LBO); 16 kv rows per instruction.
    __device__ __forceinline__ void issue_pv(int s) {
        const uint32_t v0 = smem_u32(sm.v(s));
#pragma unroll
        for (int kk = 0; kk < kStepsPV; ++kk) {
            const uint64_t b = desc_sw128(v0 + kk * 16 * 128, Cfg::kBc * 128, 1024);
            Wgmma<Cfg::kDHead, Elem>::rs(O, P[kk], b, 1u);
        }
    }

    // P (fp32 accumulators of S) -> 16-bit A fragments: n8 tiles 2kk and 2kk + 1 of S are the
    // k16 step kk of P V.
    __device__ __forceinline__ void convert_p() {
#pragma unroll
        for (int kk = 0; kk < kStepsPV; ++kk) {
            P[kk][0] = pack2<Elem>(S[2 * kk][0], S[2 * kk][1]);
            P[kk][1] = pack2<Elem>(S[2 * kk][2], S[2 * kk][3]);
            P[kk][2] = pack2<Elem>(S[2 * kk + 1][0], S[2 * kk + 1][1]);
            P[kk][3] = pack2<Elem>(S[2 * kk + 1][2], S[2 * kk + 1][3]);
        }
    }

    // ---- turns (ping-pong) and stage release --------------------------------------------------

    __device__ __forceinline__ void wait_turn() const {
        if constexpr (Cfg::kPingPong)
            named_sync(1 + wg, 2 * 128);
    }
    __device__ __forceinline__ void pass_turn() const {
        if constexpr (Cfg::kPingPong)
            named_arrive(1 + (1 - wg), 2 * 128);
    }
    // Every consumer warp arrives once: the stage's GEMM reads are complete.
    __device__ __forceinline__ void release(uint64_t* bar) const {
        __syncwarp();
        if (lane == 0)
            mbar_arrive(bar);
    }
    // A K/V stage: with kCluster on the barrier of both CTAs (lane r arrives in CTA r).
    __device__ __forceinline__ void release_kv(uint64_t* bar) const {
        if constexpr (Cfg::kCluster) {
            __syncwarp();
            if (lane < Cfg::kClusterCtas)
                mbar_arrive_cluster(bar, lane);
        } else {
            release(bar);
        }
    }
    // Without a producer warpgroup, consumer thread 0 refills the stage it just released.
    __device__ __forceinline__ bool refills() const { return !Cfg::kWarpSpec && threadIdx.x == 0; }

    // S_i -> P_i: softcap, masks, softmax (corr: O's rescale factors for this block).
    template <bool kFirst>
    __device__ __forceinline__ void softmax_block(int i, float (&corr)[2]) {
        const FwdParams& p = prm.p;
        const Work<Cfg>& w = tile();
        const int j = w.block(i);
        if constexpr (Cfg::kSoftcap) {
#pragma unroll
            for (int t = 0; t < kNS; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    S[t][e] = tanh_fast(S[t][e] * p.softcap_scale);
        }
        if (w.needs_mask(j, p.seqlen_k)) {
            float (&S3)[1][kNS][4] = reinterpret_cast<float (&)[1][kNS][4]>(S);
            const WindowMask<Cfg> mask(p.seqlen_q, p.seqlen_k, w.q_row0, warp * 16, lane);
            // Blocks on one edge check one bound (the right one also holds the key tail).
            const bool lo = Cfg::kMask && j < w.kv.full_first;
            const bool hi = !Cfg::kMask || j > w.kv.full_last;
            if (lo && hi)
                mask.template apply<true, true>(S3, j * Cfg::kBc, p.seqlen_k, p);
            else if (lo)
                mask.template apply<true, false>(S3, j * Cfg::kBc, p.seqlen_k, p);
            else
                mask.template apply<false, true>(S3, j * Cfg::kBc, p.seqlen_k, p);
        }
        softmax.template scores<kFirst>(S, p.scale_log2, corr);
    }

    __device__ __forceinline__ static int stage(int g) { return g % Cfg::kStages; }
    __device__ __forceinline__ static uint32_t phase(int g) { return (g / Cfg::kStages) & 1; }

    // One tile: q_use counts the CTA's tiles with work before it (Q buffers and phases), g its
    // first pipeline block. One guard around the blocks (split guards cost ptxas 2.5% more SASS).
    __device__ __forceinline__ void run(const Work<Cfg>& w, int q_use, int g) {
        start(w, q_use, g);
        if (w.n_blocks > 0) {
            first_block();
            body();
            last_block();
        }
        finish();
    }

    __device__ __forceinline__ void clear_o() {
#pragma unroll
        for (int t = 0; t < kNO; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                O[t][e] = 0.f;
    }

    // A new tile: O cleared, the softmax state reset.
    __device__ __forceinline__ void start(const Work<Cfg>& w, int q_use, int g) {
        set_tile(w);
        g0 = g;
        qu = q_use;
        clear_o();
        softmax.init();
        if constexpr (Cfg::kPingPong) {
            if (wg == 1)
                named_arrive(1, 2 * 128);  // warpgroup 0 takes the first turn of the tile
        }
    }

    // Block 0: S_0 alone, and its softmax.
    __device__ __forceinline__ void first_block() {
        const int n = tile().n_blocks;
        mbar_wait(sm.q_full(qu), Smem<Cfg>::q_phase(qu));
        if constexpr (Cfg::kQRegs)
            load_q_regs();
        mbar_wait(sm.k_full(stage(g0)), phase(g0));
        wait_turn();
        wgmma_fence();
        issue_qk(stage(g0));
        wgmma_commit();
        pass_turn();
        wgmma_wait<0>();
        fence_regs(S);
        release_kv(sm.k_empty(stage(g0)));
        if (n == 1)
            s_gemms_done();
        if (refills() && Cfg::kStages < n)
            loader.load_k(tile(), Cfg::kStages, g0 + Cfg::kStages);
        softmax_block<true>(0, corr);
        convert_p();
    }

    // Blocks 1 .. n - 1: S_i with P_{i-1} V_{i-1}.
    __device__ __forceinline__ void body() {
        for (int i = 1; i < tile().n_blocks; ++i)
            step(i);
    }

    // P_{n-1} V_{n-1}.
    __device__ __forceinline__ void last_block() {
        const int gl = g0 + tile().n_blocks - 1;
        softmax.rescale(O, corr);
        mbar_wait(sm.v_full(stage(gl)), phase(gl));
        wait_turn();
        wgmma_fence();
        issue_pv(stage(gl));
        wgmma_commit();
        pass_turn();
        wgmma_wait<0>();
        fence_regs(O);
        release_kv(sm.v_empty(stage(gl)));
    }

    // O and LSE out.
    __device__ __forceinline__ void finish() {
        if constexpr (Cfg::kPingPong) {
            if (wg == 0)
                named_sync(1, 2 * 128);  // the turn warpgroup 1 passed last; nothing waits on it
        }
        float inv[2], lse[2];
        softmax.totals(inv, lse, prm.p.scale_log2);
        Softmax<Cfg>::normalize(O, inv);
        write_output(tile(), lse);
    }

    // kTileOverlap, in place of last_block() and finish() and the next tile's start() and
    // first_block() (q_use and g of it as for start()) when both tiles have KV blocks: the next S_0
    // is issued before P_{n-1} V_{n-1} and its softmax runs while that is on the tensor cores; then
    // this tile's O and LSE leave, and the next tile continues with body().
    __device__ __forceinline__ void end_into(const Work<Cfg>& next, int q_use, int g) {
        const Work<Cfg> w = work;  // for its output, after the tile moves on
        const int n = w.n_blocks;
        const int gl = g0 + n - 1, s = stage(g), sl = stage(gl);
        mbar_wait(sm.q_full(q_use), Smem<Cfg>::q_phase(q_use));
        qu = q_use;
        if constexpr (Cfg::kQRegs)
            load_q_regs();  // the current tile's S GEMMs are complete
        mbar_wait(sm.k_full(s), phase(g));
        wgmma_fence();
        issue_qk(s);
        wgmma_commit();
        fence_regs(O);  // the rescale runs under the next tile's S_0
        softmax.rescale(O, corr);
        mbar_wait(sm.v_full(sl), phase(gl));
        wgmma_fence();
        issue_pv(sl);
        wgmma_commit();
        float inv[2], lse[2];
        softmax.totals(inv, lse, prm.p.scale_log2);  // this tile's row sums are complete
        softmax.init();
        set_tile(next);
        g0 = g;
        wgmma_wait<1>();  // the next S_0 has landed; P_{n-1} V_{n-1} may still run
        fence_regs(S);
        softmax_block<true>(0, corr);
        // Released after the softmax (an address that depends on it; see step()).
        const int after = __float2int_rz((softmax.l[0] + softmax.l[1]) * 0.f);
        release_kv(sm.k_empty(s) + after);
        if (next.n_blocks == 1)
            s_gemms_done();
        wgmma_wait<0>();
        fence_regs(O);
        release_kv(sm.v_empty(sl));
        Softmax<Cfg>::normalize(O, inv);
        write_output(w, lse);
        clear_o();
        convert_p();
    }

    // Persistent grid: this warp no longer reads the tile's Q (its S GEMMs are done, or with
    // kQRegs Q is in registers); sQ may take the next Q.
    __device__ __forceinline__ void release_q() const {
        if constexpr (Cfg::kPersistent)
            release(sm.q_empty(qu));
    }
    // This warp's last S GEMM of the tile is done: sQ is released here unless load_q_regs()
    // released it already.
    __device__ __forceinline__ void s_gemms_done() const {
        if constexpr (!Cfg::kQRegs)
            release_q();
    }

    // Block i >= 1: S_i, then P_{i-1} V_{i-1} on the tensor cores (O rescaled for block i-1
    // while S_i runs), then the softmax of S_i (with kOverlap while P_{i-1} V_{i-1} runs).
    __device__ __forceinline__ void step(int i) {
        const int g = g0 + i, s = stage(g), sp = stage(g - 1);
        mbar_wait(sm.k_full(s), phase(g));
        wait_turn();
        wgmma_fence();
        issue_qk(s);
        wgmma_commit();
        fence_regs(O);  // the rescale below is issued after S_i, so it runs under it
        softmax.rescale(O, corr);
        mbar_wait(sm.v_full(sp), phase(g - 1));
        wgmma_fence();  // O was rescaled by ordinary instructions
        issue_pv(sp);
        wgmma_commit();
        pass_turn();
        const int n = tile().n_blocks;
        if constexpr (Cfg::kOverlap) {
            wgmma_wait<1>();  // S_i has landed; P_{i-1} V_{i-1} may still run
            fence_regs(S);
            softmax_block<false>(i, corr);
            // K_i is released through an address that depends on the softmax's row sums (an
            // offset that is always 0): ptxas keeps memory operations in order with the wait
            // below but would otherwise schedule the softmax after it, off the P V GEMM.
            const int after = __float2int_rz((softmax.l[0] + softmax.l[1]) * 0.f);
            release_kv(sm.k_empty(s) + after);
            if (i == n - 1)
                s_gemms_done();
            wgmma_wait<0>();
            fence_regs(O);
            release_kv(sm.v_empty(sp));
        } else {
            wgmma_wait<0>();
            fence_regs(S);
            fence_regs(O);
            release_kv(sm.k_empty(s));
            release_kv(sm.v_empty(sp));
            if (i == n - 1)
                s_gemms_done();
            softmax_block<false>(i, corr);
        }
        if (refills()) {
            if (i + Cfg::kStages < n)
                loader.load_k(tile(), i + Cfg::kStages, g + Cfg::kStages);
            if (i - 1 + Cfg::kStages < n)
                loader.load_v(tile(), i - 1 + Cfg::kStages, g - 1 + Cfg::kStages);
        }
        convert_p();
    }

    // O (normalised) and LSE. Rows past seqlen_q and columns past d_head are not written.
    __device__ __forceinline__ void write_output(const Work<Cfg>& w, const float (&lse)[2]) {
        const FwdParams& p = prm.p;
        const int row_in_cta = warp * 16 + lane / 4;  // and + 8
        if (p.lse != nullptr && lane % 4 == 0) {
            float* lse_out = p.lse + int64_t(w.batch) * p.lse_batch_stride +
                             int64_t(w.head) * p.lse_head_stride + w.q_row0;
#pragma unroll
            for (int h = 0; h < 2; ++h)
                if (w.q_row0 + row_in_cta + 8 * h < p.seqlen_q)
                    lse_out[row_in_cta + 8 * h] = lse[h];
        }
        if constexpr (Cfg::kTmaStore) {
            // Into this warpgroup's own rows of the O buffer (sQ, whose S GEMMs are complete, or
            // on a persistent grid its own, free once the previous tile's store has read it), in
            // the swizzled layout of the O map: n8 tile t is 16-byte chunk t % 8 of panel t / 8.
            unsigned char* sq = sm.o();
            if constexpr (Cfg::kPersistent) {
                if (threadIdx.x % 128 == 0)
                    tma_store_wait_read();
                named_sync(3 + wg, 128);  // ... the previous tile's rows have been read
            }
            // One stmatrix.x4 per two n8 tiles t, t + 1 (t even): its 8x8 matrices are rows +0
            // and +8 of tile t, then of t + 1; lane l gives the address of row l % 8 of matrix
            // l / 8, CTA row r below, tile t + l / 16. That tile's chunk (t % 8 + l / 16) ^ (r & 7)
            // is (t % 8) ^ (l / 16) ^ (l % 8): the 128-byte-aligned row address with the lane's
            // chunk, XORed with the compile-time (t % 8) * 16.
            const int r = warp * 16 + 8 * ((lane / 8) % 2) + lane % 8;
            const uint32_t row = smem_u32(sq) + r * 128 + (((lane / 16) ^ (lane % 8)) * 16);
#pragma unroll
            for (int t = 0; t < kNO; t += 2) {
                const uint32_t frag[4] = {
                    pack2<Elem>(O[t][0], O[t][1]), pack2<Elem>(O[t][2], O[t][3]),
                    pack2<Elem>(O[t + 1][0], O[t + 1][1]), pack2<Elem>(O[t + 1][2], O[t + 1][3])};
                stmatrix_x4((row ^ ((t % 8) * 16)) + (t / 8) * Cfg::kBr * 128, frag);
            }
            fence_proxy_async_smem();  // the TMA store reads what these stores wrote
            named_sync(3 + wg, 128);   // ... every thread of the warpgroup has written
            if (threadIdx.x % 128 == 0) {
#pragma unroll
                for (int c = 0; c < Cfg::kPanels; ++c)
                    tma_store_4d(&prm.tma_o, sq + c * Cfg::kBr * 128 + wg * 64 * 128, c * 64,
                                 w.q_row0 + wg * 64, w.head, w.batch);
                tma_store_commit();
                if constexpr (!Cfg::kPersistent)
                    tma_store_wait_read();  // smem stays valid until the store has read it
            }
        } else {
            Elem* o = static_cast<Elem*>(p.o) + int64_t(w.batch) * p.o_batch_stride +
                      int64_t(w.head) * p.o_head_stride;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = w.q_row0 + row_in_cta + 8 * h;
                if (row >= p.seqlen_q)
                    continue;
                Elem* o_row = o + int64_t(row) * p.o_row_stride;
#pragma unroll
                for (int t = 0; t < kNO; ++t) {
                    const int col = t * 8 + (lane % 4) * 2;
                    if (col < p.d_head)
                        *reinterpret_cast<uint32_t*>(o_row + col) =
                            pack2<Elem>(O[t][2 * h], O[t][2 * h + 1]);
                }
            }
        }
    }
};

// The CTA's sequence of tiles, k = 0, 1, ...: static, first_tile + k * step (every gridDim.x-th
// on a persistent grid, else only its own); dynamic, first_tile and then what the producer draws
// from the launch's counter, handed to the consumers through the two smem slots. A tile number
// >= tiles() ends the sequence.
template <class Cfg>
struct Schedule {
    const Smem<Cfg>& sm;
    int tiles, first_tile, step;

    // Producer: passes tile k to the consumers (dynamic; nothing to pass for a static one).
    __device__ __forceinline__ void publish(int k, int tile) const {
        if constexpr (Cfg::kDynamic) {
            const int slot = k % 2;
            if (k >= 2)
                mbar_wait(sm.tile_empty(slot), (k / 2 - 1) & 1);
            *sm.tile_slot(slot) = tile;
            mbar_arrive(sm.tile_full(slot));
        }
    }
    // Producer: the tile after `tile`.
    __device__ __forceinline__ int next(const FwdParams& p, int tile) const {
        if constexpr (Cfg::kDynamic)
            return atomicAdd(p.tile_counter, 1) + int(gridDim.x);
        return tile + step;
    }
    // Consumers (every thread, in order of k): tile k.
    __device__ __forceinline__ int consumer_tile(int k, int lane) const {
        if constexpr (Cfg::kDynamic) {
            const int slot = k % 2;
            mbar_wait(sm.tile_full(slot), (k / 2) & 1);
            // Lane 0's copy for the whole warp, so that ptxas sees a warp-uniform loop (else it
            // keeps a divergent copy of the loop body beside the convergent one).
            const int tile = __shfl_sync(0xffffffffu, *sm.tile_slot(slot), 0);
            if (lane == 0)
                mbar_arrive(sm.tile_empty(slot));
            return tile;
        } else {
            return first_tile + k * step;
        }
    }
};

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fwd_sm90_kernel(const __grid_constant__ Sm90Params params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char smem_raw[];
    const Smem<Cfg> sm{reinterpret_cast<unsigned char*>(
        (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023))};
    const Loader<Cfg> loader{params, sm, Cfg::kCluster ? int(cluster_ctarank()) : 0};
    const FwdParams& p = params.p;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // Tiles of this CTA (of its cluster with kCluster, whose CTAs share the tile): its own
    // (grid = tiles), or every (gridDim.x / cluster size)-th (persistent).
    const int clusters_x = gridDim.x / Cfg::kClusterCtas;
    const int first_tile =
        blockIdx.x / Cfg::kClusterCtas + clusters_x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int tiles = Work<Cfg>::tiles(p);
    const Schedule<Cfg> schedule{sm, tiles, first_tile, Cfg::kPersistent ? clusters_x : tiles};

    if (threadIdx.x == 0) {
        prefetch_tensor_map(&params.tma_q);
        prefetch_tensor_map(&params.tma_k);
        prefetch_tensor_map(&params.tma_v);
        for (int u = 0; u < Cfg::kQBuffers; ++u) {
            mbar_init(sm.q_full(u), 1);
            mbar_init(sm.q_empty(u), Cfg::kConsumerWarps);
        }
        for (int s = 0; s < Cfg::kStages; ++s) {
            mbar_init(sm.k_full(s), 1);
            mbar_init(sm.v_full(s), 1);
            mbar_init(sm.k_empty(s), Cfg::kConsumerWarps * Cfg::kClusterCtas);
            mbar_init(sm.v_empty(s), Cfg::kConsumerWarps * Cfg::kClusterCtas);
        }
        if constexpr (Cfg::kDynamic) {
            for (int i = 0; i < 2; ++i) {
                mbar_init(sm.tile_full(i), 1);
                mbar_init(sm.tile_empty(i), Cfg::kConsumerWarps);
            }
        }
        fence_barrier_init();
    }
    // The barriers are initialised and visible to the TMA unit (and to the other CTA, which
    // multicasts into this one and arrives on its empty barriers).
    if constexpr (Cfg::kCluster)
        cluster_sync();
    else
        __syncthreads();

    const bool producer = Cfg::kWarpSpec && warp >= Cfg::kConsumerWarps;
    if (producer) {
        setmaxnreg_dec<Cfg::kProducerRegs>();
        if (warp == Cfg::kConsumerWarps && lane == 0) {
            int q_use = 0, g = 0;  // both sides count tiles with work and K/V blocks alike
            int k = 0;             // tiles passed to the consumers (dynamic schedule)
            for (int tile = first_tile; tile < tiles; ++k) {
                schedule.publish(k, tile);
                const Work<Cfg> w(params, tile);
                if (w.n_blocks > 0) {
                    loader.load_q(w, q_use++);
                    for (int i = 0; i < w.n_blocks; ++i) {
                        loader.load_k(w, i, g + i);
                        loader.load_v(w, i, g + i);
                    }
                    g += w.n_blocks;
                }
                tile = schedule.next(p, tile);
            }
            if constexpr (Cfg::kDynamic)  // the end of the sequence, for the consumers
                schedule.publish(k, tiles);
        }
    } else {
        if constexpr (Cfg::kWarpSpec)
            setmaxnreg_inc<Cfg::kConsumerRegs>();
        Consumer<Cfg> c{params, sm, loader, warp / 4, warp, lane};
        int q_use = 0, g = 0;
        if constexpr (Cfg::kTileOverlap) {
            // Each tile ends into the next one (its block 0 under this one's last P V), so the
            // next tile is fetched before the current one ends.
            // One call site each of the tile phases: ptxas copies what is inlined.
            int tile = schedule.consumer_tile(0, lane);
            if (tile < tiles) {
                Work<Cfg> w(params, tile);
                bool begun = false;  // the previous end_into() ran this tile's block 0
                for (int k = 1;; ++k) {
                    if (!begun) {
                        c.start(w, q_use, g);
                        if (w.n_blocks > 0)
                            c.first_block();
                    }
                    c.body();
                    q_use += w.n_blocks > 0;
                    g += w.n_blocks;
                    tile = schedule.consumer_tile(k, lane);
                    const bool more = tile < tiles;
                    const Work<Cfg> next(params, more ? tile : 0);
                    begun = more && w.n_blocks > 0 && next.n_blocks > 0;
                    if (begun) {
                        c.end_into(next, q_use, g);
                    } else {
                        if (w.n_blocks > 0)
                            c.last_block();
                        c.finish();
                    }
                    if (!more)
                        break;
                    w = next;
                }
            }
        } else {
            // Rotated (the next tile fetched at the end), as ptxas keeps one copy of the body so.
            for (int k = 1, tile = schedule.consumer_tile(0, lane); tile < tiles;
                 tile = schedule.consumer_tile(k++, lane)) {
                const Work<Cfg> w(params, tile);
                if (!Cfg::kWarpSpec && threadIdx.x == 0 && w.n_blocks > 0) {
                    // The first stages; the rest are refilled as the consumers release them.
                    loader.load_q(w, q_use);
                    for (int i = 0; i < Cfg::kStages && i < w.n_blocks; ++i) {
                        loader.load_k(w, i, g + i);
                        loader.load_v(w, i, g + i);
                    }
                }
                __syncwarp();
                c.run(w, q_use, g);
                q_use += w.n_blocks > 0;
                g += w.n_blocks;
            }
        }
        if constexpr (Cfg::kPersistent) {
            if (threadIdx.x % 128 == 0)
                tma_store_wait_read();  // smem stays valid until the last store has read it
        }
    }
    if constexpr (Cfg::kCluster)
        cluster_sync();  // the other CTA may still arrive on this one's barriers until it is done
#endif
}

}  // namespace flash::sm90
