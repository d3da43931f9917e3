// What every backward family shares: the preprocess (D, LSE * log2(e), the zeroed dQ
// accumulator) and the dQ conversion kernels, the window of keys a query row sees, the query
// blocks of a KV block that need no mask, the fp32 reductions and flags of the dQ accumulator,
// and the launch of the three passes around a family's main kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "launch_support.cuh"
#include "numeric.cuh"
#include "params.h"
#include "varlen.cuh"

namespace flash::bwd {

constexpr float kLog2e = 1.4426950408889634f;

// Varlen calls of the Hopper family (kWgmmaTiles order): the per-row buffers (LSE * log2(e), D,
// the dQ accumulator) hold sequence b from row varlen_row0(b) of each head's seqlen_q_pad rows,
// a multiple of kVarlenRowAlign, so that its query blocks are whole blocks of that order; its
// rows past the end up to the next multiple hold an LSE of +inf and a D of 0. The start is
// (q_start + kVarlenRowAlign b) rounded down: sequence b + 1 starts at or after sequence b's
// rounded end, and every sequence ends below total_q + kVarlenRowAlign batch (with offsets
// clamped to [0, total_q], even unchecked ones do), the rows the binding allocates.
constexpr int kVarlenRowAlign = kBwdVarlenRowAlign;
__host__ __device__ __forceinline__ int64_t varlen_row0(int64_t q_start, int64_t b) {
    return (q_start + kVarlenRowAlign * b) / kVarlenRowAlign * kVarlenRowAlign;
}
__host__ __device__ __forceinline__ int varlen_rows(int seqlen_q) {
    return (seqlen_q + kVarlenRowAlign - 1) / kVarlenRowAlign * kVarlenRowAlign;
}

__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// p[0] += a, p[1] += b (fp32 reductions, no result): one vector reduction on sm_90, two scalar
// ones before. p is 8-byte aligned.
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}

// p[0] += a (an fp32 reduction, no result: RED, where atomicAdd may give ATOM on sm_90).
__device__ __forceinline__ void red_add1(float* p, float a) {
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(a) : "memory");
}

// p[0..3] += a, b, c, d (fp32 reductions, no result): one vector reduction on sm_90, four scalar
// ones before. p is 16-byte aligned.
__device__ __forceinline__ void red_add4(float* p, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b), "f"(c),
                 "f"(d)
                 : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
    atomicAdd(p + 2, c);
    atomicAdd(p + 3, d);
#endif
}

__device__ __forceinline__ void st_release(int* p, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void red_release_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// The keys a query row sees, off = seqlen_k - seqlen_q: [row + off - left, row + off + right].
struct Window {
    int off;          // fits 32 bits: both lengths are below 2^31 - 256
    int left, right;  // -1: unbounded

    // The first and last key any of rows [r0, r1] sees, clamped to [0, seqlen_k - 1].
    __device__ __forceinline__ void keys(int r0, int r1, int seqlen_k, int64_t& lo,
                                         int64_t& hi) const {
        lo = left < 0 ? 0 : int64_t(r0) + off - left;
        hi = right < 0 ? seqlen_k - 1 : int64_t(r1) + off + right;
        lo = lo > 0 ? lo : 0;
        hi = hi < seqlen_k - 1 ? hi : seqlen_k - 1;
    }
    // The first and last query row that sees any of keys [k0, k1], clamped to [0, seqlen_q - 1].
    __device__ __forceinline__ void rows(int k0, int k1, int seqlen_q, int64_t& lo,
                                         int64_t& hi) const {
        lo = right < 0 ? 0 : int64_t(k0) - off - right;
        hi = left < 0 ? seqlen_q - 1 : int64_t(k1) - off + left;
        lo = lo > 0 ? lo : 0;
        hi = hi < seqlen_q - 1 ? hi : seqlen_q - 1;
    }
    __device__ __forceinline__ bool sees(int64_t row, int64_t key) const {
        const int64_t rel = key - row - off;
        return (left < 0 || rel >= -left) && (right < 0 || rel <= right);
    }
};

__device__ __forceinline__ int64_t floor_div(int64_t a, int64_t b) {  // b > 0
    return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// The deterministic order (BwdParams::dq_semaphore): the turn counter of (sequence `batch`,
// query head, query block i), one per query block of the longest sequence (p.seqlen_q), and the
// turn of KV block kv_block there: how many KV blocks add their dQ to query block i before it.
// They add from the last KV block that sees the block to the first: those CTAs are launched
// earlier (so waiting on them cannot deadlock), and under a causal mask the last one meets the
// block first. Both families follow it; flash_attention.masks.dq_turn is its CPU twin.
template <int kBr>
__device__ __forceinline__ int* dq_turn_counter(const BwdParams& p, int64_t batch, int64_t head,
                                                int i) {
    const int q_blocks = (p.seqlen_q + kBr - 1) / kBr;
    return p.dq_semaphore + (batch * p.heads + head) * q_blocks + i;
}
template <int kBr, int kBc>
__device__ __forceinline__ int dq_turn(const Window& win, int seqlen_q, int seqlen_k, int i,
                                       int kv_block) {
    const int q_last = (i * kBr + kBr < seqlen_q ? i * kBr + kBr : seqlen_q) - 1;
    int64_t k_lo, k_hi;
    win.keys(i * kBr, q_last, seqlen_k, k_lo, k_hi);
    return static_cast<int>(k_hi / kBc) - kv_block;
}

// The rotated order of both families (deterministic calls with no mask, every KV block seeing
// every query block, n_q = r n_kv query blocks for n_kv KV blocks): KV block j starts at query
// block j r, so that the KV blocks reach a block one after another rather than all queue at
// block 0. Their starts are r apart, so the one that reaches block i first is the one whose
// start is i / r, then i / r - 1, ... cyclically: KV block j's turn at block i is
// (i / r - j) mod n_kv, at every head of a GQA group (each head's blocks from the same start).
// A CTA so waits only for CTAs of the same (batch, KV head) that got there first: safe while
// they can all be resident at once (the launcher's condition).
// flash_attention.masks.rotated_dq_turn is its CPU twin; i_over_r = i / r.
__device__ __forceinline__ int rotated_dq_turn(int i_over_r, int kv_block, int n_kv) {
    const int d = i_over_r - kv_block;
    return d < 0 ? d + n_kv : d;
}

// Host, both launchers: r of the rotated order for a call of n_kv KV blocks and n_q query blocks
// per (batch, KV head), or 0 where it keeps the last-KV-block-first order: deterministic, no
// mask, fixed length, n_q a whole multiple of n_kv, and n_kv CTAs on at most half the SMs, so
// that those a CTA may wait for (launched after it) are all resident at once.
inline cudaError_t rotation_of(const BwdParams& p, int n_q, int n_kv, int& r) {
    r = 0;
    if (p.dq_semaphore == nullptr || p.cu_seqlens_q != nullptr || p.window_left >= 0 ||
        p.window_right >= 0 || n_kv <= 0 || n_q % n_kv != 0)
        return cudaSuccess;
    int sms = 0;
    if (cudaError_t err = multiprocessor_count(sms); err != cudaSuccess)
        return err;
    if (int64_t(n_kv) * 2 <= sms)
        r = n_q / n_kv;
    return cudaSuccess;
}

// The query blocks of B_r rows that see all kBc keys k0 .. k0 + kBc - 1 and lie whole inside
// the sequence ([lo, hi]; lo > hi: none): the block [i B_r, i B_r + B_r - 1] x [k0, k1] is inside
// the window iff its corners are, i.e. i B_r + B_r - 1 <= k0 - off + left and
// i B_r >= k1 - off - right. A KV block past the key tail has none. Rows past seqlen_q matter
// only for varlen (their LSE and D are the next sequence's; fixed-length ones have an LSE of
// +inf already), but a whole block costs the same either way.
template <int kBr, int kBc>
__device__ __forceinline__ int2 unmasked_query_blocks(int k_row0, int seqlen_q, int seqlen_k,
                                                      const Window& w) {
    const int64_t k0 = k_row0, k1 = int64_t(k_row0) + kBc - 1;
    int64_t lo = 0, hi = int64_t(seqlen_q) / kBr - 1;  // whole blocks of rows
    if (k1 >= seqlen_k)
        hi = -1;  // the key tail: every block is masked
    if (w.right >= 0) {
        const int64_t need = k1 - w.off - w.right;
        lo = need > 0 ? (need + kBr - 1) / kBr : 0;
    }
    if (w.left >= 0) {
        const int64_t b = floor_div(k0 - w.off + w.left - kBr + 1, kBr);
        hi = b < hi ? b : hi;
    }
    return make_int2(static_cast<int>(lo), static_cast<int>(hi < lo ? lo - 1 : hi));
}

// Two 16-bit values of one 32-bit word -> fp32 (torch builds disable the implicit conversions).
__device__ __forceinline__ float2 unpack2(uint32_t w, __half) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
__device__ __forceinline__ float2 unpack2(uint32_t w, __nv_bfloat16) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}

// The preprocess and the conversion are instantiated by every backward unit, sm80-family ones
// (sm_80, sm_90 code) and Hopper ones (sm_90a only): internal linkage gives each unit its own
// host stub, registered with its own module, so a launch never finds another unit's copy that
// lacks this GPU's code.

// ---- preprocess --------------------------------------------------------------------------------

// Lanes of the preprocess per query row: one 16-byte chunk each of d_pad columns, rounded up to
// a power of two (8 at d_pad 64, 32 at 256), so a warp covers 32 / lanes rows at once.
__host__ __device__ __forceinline__ int preprocess_lanes(int d_pad) {
    int lanes = 1;
    while (lanes * 8 < d_pad)
        lanes *= 2;
    return lanes;
}

template <typename Elem>
struct RowPair {
    const Elem *o, *dout;
};

// Lane `sub` of a row's group of lanes: its part of rowsum(dO * O) over its 16-byte chunk of
// the row (0 for a lane past d_head or a row not live); rows() gives the row's O and dO (called
// only for a live row, so that its addresses are worked out there).
template <typename Elem, class Rows>
__device__ __forceinline__ float row_dot_part(Rows&& rows, int sub, int d_head, bool live) {
    float sum = 0.f;
    if (live && sub * 8 < d_head) {
        const RowPair<Elem> r = rows();
        const uint4 ov = *reinterpret_cast<const uint4*>(r.o + sub * 8);
        const uint4 dv = *reinterpret_cast<const uint4*>(r.dout + sub * 8);
        const uint32_t ow[4] = {ov.x, ov.y, ov.z, ov.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 a = unpack2(ow[e], Elem{}), b = unpack2(dw[e], Elem{});
            sum += a.x * b.x + a.y * b.y;
        }
    }
    return sum;
}

// A row's D and LSE * log2(e) from its lanes' parts of rowsum(dO * O) (`sum`, summed here over
// the row's group of lanes), by its lane 0 when the row is in the buffers: 0 and +inf past the
// sequence, +inf for an LSE of -inf. at(): the row's index in the buffers; in(): in the LSE.
template <class At, class In>
__device__ __forceinline__ void row_stats(const BwdParams& p, float sum, int lanes, int sub,
                                          bool in_pad, bool live, At&& at_of, In&& in_of) {
    for (int s = lanes / 2; s > 0; s /= 2)  // within the row's aligned group of lanes
        sum += __shfl_xor_sync(0xffffffffu, sum, s);
    if (!in_pad || sub != 0)
        return;
    const int64_t at = at_of();
    if (!live) {
        p.d_rows[at] = 0.f;
        p.lse_log2[at] = INFINITY;
        return;
    }
    const int64_t in = in_of();
    p.d_rows[at] = sum - (p.dlse != nullptr ? p.dlse[in] : 0.f);
    const float lse = p.lse[in];
    p.lse_log2[at] = lse == -INFINITY ? INFINITY : lse * kLog2e;
}

// Four warps of 32 / preprocess_lanes(d_pad) query rows each (rows < seqlen_q_pad): D =
// rowsum(dO * O) - dLSE and LSE * log2(e) (0 and +inf past seqlen_q; +inf for an LSE of -inf),
// and the row's dQ accumulator zeroed. Lane l of a row reads its 16-byte chunk l. (One warp per
// row left 24 of 32 lanes idle at d_head 64 and ran at 1.9 TB/s on an H100.)
template <typename Elem>
static __global__ void __launch_bounds__(128)
    bwd_preprocess_kernel(const __grid_constant__ BwdParams p) {
    const int lanes = preprocess_lanes(p.d_pad);
    const int lane = threadIdx.x % 32, sub = lane % lanes;
    const int row = (blockIdx.x * 4 + threadIdx.x / 32) * (32 / lanes) + lane / lanes;
    const int64_t head = blockIdx.y, batch = blockIdx.z;
    const bool in_pad = row < p.seqlen_q_pad, live = row < p.seqlen_q;
    if (in_pad) {
        float* acc = p.dq_accum + ((batch * p.heads + head) * p.seqlen_q_pad + row) * p.d_pad;
        for (int c = sub * 4; c < p.d_pad; c += lanes * 4)
            *reinterpret_cast<float4*>(acc + c) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float sum = row_dot_part<Elem>(
        [&] {
            return RowPair<Elem>{static_cast<const Elem*>(p.o) + batch * p.o_batch_stride +
                                     head * p.o_head_stride + row * p.o_row_stride,
                                 static_cast<const Elem*>(p.dout) + batch * p.do_batch_stride +
                                     head * p.do_head_stride + row * p.do_row_stride};
        },
        sub, p.d_head, live);
    row_stats(
        p, sum, lanes, sub, in_pad, live,
        [&] { return (batch * p.heads + head) * p.seqlen_q_pad + row; },
        [&] { return (batch * p.heads + head) * p.seqlen_q + row; });
}

// The same in the varlen layout (the Hopper varlen kernels): blockIdx.z a sequence (cut as
// seq_span_cut says), its rows up to varlen_rows() of its length from varlen_row0() of each
// head's buffer rows, its tokens at its q_start in the packed tensors and the (heads, total_q)
// LSE.
template <typename Elem>
static __global__ void __launch_bounds__(128)
    bwd_preprocess_varlen_kernel(const __grid_constant__ BwdParams p) {
    const int lanes = preprocess_lanes(p.d_pad);
    const int lane = threadIdx.x % 32, sub = lane % lanes;
    const int row = (blockIdx.x * 4 + threadIdx.x / 32) * (32 / lanes) + lane / lanes;
    const int64_t head = blockIdx.y;
    const SeqSpan sp = seq_span_cut(p, static_cast<int>(blockIdx.z));
    const bool in_pad = row < varlen_rows(sp.seqlen_q), live = row < sp.seqlen_q;
    const int64_t at = head * p.seqlen_q_pad + varlen_row0(sp.q_start, blockIdx.z) + row;
    const int64_t token = sp.q_start + row;
    if (in_pad)
        for (int c = sub * 4; c < p.d_pad; c += lanes * 4)
            *reinterpret_cast<float4*>(p.dq_accum + at * p.d_pad + c) =
                make_float4(0.f, 0.f, 0.f, 0.f);
    float sum = row_dot_part<Elem>(
        [&] {
            return RowPair<Elem>{
                static_cast<const Elem*>(p.o) + head * p.o_head_stride + token * p.o_row_stride,
                static_cast<const Elem*>(p.dout) + head * p.do_head_stride +
                    token * p.do_row_stride};
        },
        sub, p.d_head, live);
    row_stats(
        p, sum, lanes, sub, in_pad, live, [&] { return at; },
        [&] { return head * p.total_q + token; });
}

// ---- dQ conversion ----------------------------------------------------------------------------

// The order of the fp32 dQ accumulator: kRows, row by row (d_pad floats each); kWgmmaTiles, each
// block of 64 rows in the order of a wgmma m64 accumulator (the Hopper kernel's bulk reductions,
// and the sm80 family's 16-byte reductions where p.dq_tiles): n8 tile n (columns 8n .. 8n + 7),
// then thread x = 32 w + 4 r + c of the warpgroup (or lane 4 r + c of the warp owning rows
// 16 w ..), then its four floats: rows 16 w + r and 16 w + r + 8, columns 8n + 2c and 8n + 2c +
// 1, as (row, col), (row, col + 1), (row + 8, col), (row + 8, col + 1).
// kLaneTiles (the sm80 family's scalar reductions, sm_80-89): as kWgmmaTiles to the m16 tile,
// then float j of every lane together: the thread's float j of tile (n, w) at 512 n + 128 w +
// 32 j + lane, so that a warp's scalar reduction of float j covers 128 contiguous bytes.
enum class DqLayout { kRows, kWgmmaTiles, kLaneTiles };

// The four float4 of the row pair (16 w + r, + 8) of n8 tile n in a 64-row block `blk` of the
// tile order (threads 32 w + 4 r .. + 3; lane_major: kLaneTiles), scaled by s and packed:
// lo the row's 8 columns, hi the row + 8's.
template <typename Elem>
__device__ __forceinline__ void tile_pair_values(const float* blk, int n, int pair, bool lane_major,
                                                 float s, uint32_t (&lo)[4], uint32_t (&hi)[4]) {
    if (lane_major) {  // float j of lanes 4 r .. + 3: 4 contiguous floats per j
        const float4* acc =
            reinterpret_cast<const float4*>(blk + n * 512 + (pair / 8) * 128 + (pair % 8) * 4);
        const float4 a0 = acc[0], a1 = acc[8], a2 = acc[16], a3 = acc[24];  // j = 0 .. 3
        lo[0] = pack2<Elem>(a0.x * s, a1.x * s);
        lo[1] = pack2<Elem>(a0.y * s, a1.y * s);
        lo[2] = pack2<Elem>(a0.z * s, a1.z * s);
        lo[3] = pack2<Elem>(a0.w * s, a1.w * s);
        hi[0] = pack2<Elem>(a2.x * s, a3.x * s);
        hi[1] = pack2<Elem>(a2.y * s, a3.y * s);
        hi[2] = pack2<Elem>(a2.z * s, a3.z * s);
        hi[3] = pack2<Elem>(a2.w * s, a3.w * s);
    } else {
        const float4* acc =
            reinterpret_cast<const float4*>(blk + (n * 128 + (pair / 8) * 32 + (pair % 8) * 4) * 4);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float4 a = acc[c];
            lo[c] = pack2<Elem>(a.x * s, a.y * s);
            hi[c] = pack2<Elem>(a.z * s, a.w * s);
        }
    }
}

// dst[0 .. 7] += s * v[0 .. 7], the eight floats one thread owns (BwdParams::accumulate: one
// thread adds each element, so a plain read-modify-write gives the sum atomics would, in vector
// loads and stores; scalar atomics ran the conversion far below the memory's bandwidth). The fp32
// sums are 8-byte aligned with even strides (check_grad_sum): float4s where 16-byte aligned.
__device__ __forceinline__ void add_eight(float* dst, const float (&v)[8], float s) {
    if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
        float4* d = reinterpret_cast<float4*>(dst);
        float4 a = d[0], b = d[1];
        a.x += v[0] * s;
        a.y += v[1] * s;
        a.z += v[2] * s;
        a.w += v[3] * s;
        b.x += v[4] * s;
        b.y += v[5] * s;
        b.z += v[6] * s;
        b.w += v[7] * s;
        d[0] = a;
        d[1] = b;
        return;
    }
    float2* d = reinterpret_cast<float2*>(dst);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 a = d[i];
        a.x += v[2 * i] * s;
        a.y += v[2 * i + 1] * s;
        d[i] = a;
    }
}

// BwdParams::accumulate: the values tile_pair_values packs, scaled and added to the fp32 dq at
// `at` (the row's 8 columns) and, with second_row, at + 8 rows (add_eight).
__device__ __forceinline__ void add_tile_pair(const BwdParams& p, const float* blk, int n, int pair,
                                              bool lane_major, int64_t at, bool second_row) {
    float lo[8], hi[8];
    if (lane_major) {  // float j of lanes 4 r .. + 3: j = 0, 1 the row's, 2, 3 the row + 8's
        const float4* acc =
            reinterpret_cast<const float4*>(blk + n * 512 + (pair / 8) * 128 + (pair % 8) * 4);
        const float4 a0 = acc[0], a1 = acc[8];  // columns 0, 2, 4, 6 and 1, 3, 5, 7
        lo[0] = a0.x, lo[1] = a1.x, lo[2] = a0.y, lo[3] = a1.y;
        lo[4] = a0.z, lo[5] = a1.z, lo[6] = a0.w, lo[7] = a1.w;
        if (second_row) {
            const float4 a2 = acc[16], a3 = acc[24];
            hi[0] = a2.x, hi[1] = a3.x, hi[2] = a2.y, hi[3] = a3.y;
            hi[4] = a2.z, hi[5] = a3.z, hi[6] = a2.w, hi[7] = a3.w;
        }
    } else {  // float4 c: columns 2c, 2c + 1 of the row (x, y) and of the row + 8 (z, w)
        const float4* acc =
            reinterpret_cast<const float4*>(blk + (n * 128 + (pair / 8) * 32 + (pair % 8) * 4) * 4);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float4 a = acc[c];
            lo[2 * c] = a.x, lo[2 * c + 1] = a.y;
            hi[2 * c] = a.z, hi[2 * c + 1] = a.w;
        }
    }
    float* dq = static_cast<float*>(p.dq) + at;
    add_eight(dq, lo, p.softmax_scale);
    if (second_row)
        add_eight(dq + 8 * p.dq_row_stride, hi, p.softmax_scale);
}

// The conversion of the kWgmmaTiles order, thread idx of the grid tile_convert_threads() sizes:
// one per pair of rows (16 w + r, + 8) and tile n, reading the four float4 of threads 32 w +
// 4 r .. + 3 of the tile, 64 contiguous bytes. Consecutive threads take consecutive tiles of
// the same rows, so that a warp's stores are whole row segments.
template <typename Elem>
__device__ __forceinline__ void convert_dq_tile_pair(const BwdParams& p, int64_t idx,
                                                     bool lane_major) {
    const int tiles = p.d_pad / 8;
    const int n = static_cast<int>(idx % tiles);
    const int pair = static_cast<int>(idx / tiles % 32);  // 8 w + r
    const int64_t block = idx / (32 * tiles);
    const int64_t head = blockIdx.y, batch = blockIdx.z;
    const int64_t row = block * 64 + (pair / 8) * 16 + pair % 8;
    if (row >= p.seqlen_q || n * 8 >= p.d_head)
        return;
    const float* blk =
        p.dq_accum + ((batch * p.heads + head) * p.seqlen_q_pad + block * 64) * p.d_pad;
    if (p.accumulate) {
        add_tile_pair(
            p, blk, n, pair, lane_major,
            batch * p.dq_batch_stride + head * p.dq_head_stride + row * p.dq_row_stride + n * 8,
            row + 8 < p.seqlen_q);
        return;
    }
    uint32_t lo[4], hi[4];
    tile_pair_values<Elem>(blk, n, pair, lane_major, p.softmax_scale, lo, hi);
    Elem* dq = static_cast<Elem*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride +
               row * p.dq_row_stride + n * 8;
    *reinterpret_cast<uint4*>(dq) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    if (row + 8 < p.seqlen_q)
        *reinterpret_cast<uint4*>(dq + 8 * p.dq_row_stride) =
            make_uint4(hi[0], hi[1], hi[2], hi[3]);
}

// Threads of a kWgmmaTiles conversion per (batch, head): a row pair and tile of each 64-row
// block (seqlen_q_pad: whole blocks).
inline int64_t tile_convert_threads(const BwdParams& p) {
    return int64_t(p.seqlen_q_pad / 64) * 32 * (p.d_pad / 8);
}

// The sm80 family's conversion: dQ = scale * accumulator in the input dtype (or with
// BwdParams::accumulate added to the fp32 dq). kRows order: one thread per 8 columns of a row;
// the kWgmmaTiles order where p.dq_tiles (its launcher's choice), as
// bwd_convert_dq_tiles_kernel.
template <typename Elem>
static __global__ void __launch_bounds__(256)
    bwd_convert_dq_kernel(const __grid_constant__ BwdParams p) {
    const int64_t idx = int64_t(blockIdx.x) * 256 + threadIdx.x;
    if (p.dq_tiles) {
        convert_dq_tile_pair<Elem>(p, idx, p.dq_tiles == 2);
        return;
    }
    const int chunks = p.d_head / 8;
    const int64_t row = idx / chunks;
    const int chunk = static_cast<int>(idx % chunks);
    const int64_t head = blockIdx.y, batch = blockIdx.z;
    if (row >= p.seqlen_q)
        return;
    const float* acc =
        p.dq_accum + ((batch * p.heads + head) * p.seqlen_q_pad + row) * p.d_pad + chunk * 8;
    const float4 a = *reinterpret_cast<const float4*>(acc);
    const float4 b = *reinterpret_cast<const float4*>(acc + 4);
    const float s = p.softmax_scale;
    const int64_t at =
        batch * p.dq_batch_stride + head * p.dq_head_stride + row * p.dq_row_stride + chunk * 8;
    if (p.accumulate) {  // one thread owns these 8 elements (add_eight)
        const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        add_eight(static_cast<float*>(p.dq) + at, v, s);
        return;
    }
    uint4 out;
    out.x = pack2<Elem>(a.x * s, a.y * s);
    out.y = pack2<Elem>(a.z * s, a.w * s);
    out.z = pack2<Elem>(b.x * s, b.y * s);
    out.w = pack2<Elem>(b.z * s, b.w * s);
    *reinterpret_cast<uint4*>(static_cast<Elem*>(p.dq) + at) = out;
}

// The Hopper family's conversion: dQ = scale * accumulator (kWgmmaTiles order) in the input
// dtype (or added to the fp32 dq).
template <typename Elem>
static __global__ void __launch_bounds__(256)
    bwd_convert_dq_tiles_kernel(const __grid_constant__ BwdParams p) {
    convert_dq_tile_pair<Elem>(p, int64_t(blockIdx.x) * 256 + threadIdx.x, false);
}

// The same in the varlen layout (the Hopper varlen kernels), blockIdx.z a sequence: its block of
// 64 rows k from row varlen_row0() + 64 k of each head's buffer rows, its tokens at its q_start.
// The grid covers max_seqlen_q rows; a longer sequence (cu_seqlens rewritten during CUDA graph
// capture: seq_span_cut) is covered by looping, its rows past the cut set to 0 as the sm80
// family's conversion sets them (with BwdParams::accumulate: nothing added).
template <typename Elem>
static __global__ void __launch_bounds__(256)
    bwd_convert_dq_varlen_kernel(const __grid_constant__ BwdParams p) {
    const int64_t head = blockIdx.y;
    const int b = static_cast<int>(blockIdx.z);
    const SeqSpan sp = seq_span(p, b);
    const int cut = sp.seqlen_q < p.seqlen_q ? sp.seqlen_q : p.seqlen_q;
    const int tiles = p.d_pad / 8;
    const int64_t blocks = (sp.seqlen_q + 63) / 64;
    const float* base = p.dq_accum + (head * p.seqlen_q_pad + varlen_row0(sp.q_start, b)) * p.d_pad;
    for (int64_t idx = int64_t(blockIdx.x) * 256 + threadIdx.x; idx / (32 * tiles) < blocks;
         idx += int64_t(gridDim.x) * 256) {
        const int n = static_cast<int>(idx % tiles);
        const int pair = static_cast<int>(idx / tiles % 32);  // 8 w + r
        const int64_t block = idx / (32 * tiles);
        const int64_t row = block * 64 + (pair / 8) * 16 + pair % 8;
        if (row >= sp.seqlen_q || n * 8 >= p.d_head)
            continue;
        if (p.accumulate) {
            if (row < cut)
                add_tile_pair(
                    p, base + block * 64 * p.d_pad, n, pair, false,
                    head * p.dq_head_stride + (sp.q_start + row) * p.dq_row_stride + n * 8,
                    row + 8 < cut);
            continue;
        }
        uint32_t lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
        if (row < cut)
            tile_pair_values<Elem>(base + block * 64 * p.d_pad, n, pair, false, p.softmax_scale, lo,
                                   hi);
        Elem* dq = static_cast<Elem*>(p.dq) + head * p.dq_head_stride +
                   (sp.q_start + row) * p.dq_row_stride + n * 8;
        *reinterpret_cast<uint4*>(dq) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        if (row + 8 < sp.seqlen_q) {
            if (row + 8 >= cut)
                hi[0] = hi[1] = hi[2] = hi[3] = 0;
            *reinterpret_cast<uint4*>(dq + 8 * p.dq_row_stride) =
                make_uint4(hi[0], hi[1], hi[2], hi[3]);
        }
    }
}

// ---- the passes of a backward call -------------------------------------------------------------

// The preprocess, the family's main kernel (`launch_main()`, a cudaError_t), then the dQ
// conversion on one stream: kWgmmaTiles, the Hopper family's (bwd_convert_dq_tiles_kernel);
// kRows, the sm80 family's (bwd_convert_dq_kernel: rows, or the tile order where p.dq_tiles).
// The sm80 family's passes work per query row: a varlen batch is one sequence of total_q rows
// to them. kVarlenRows (the Hopper varlen kernels): the varlen layout (kVarlenRowAlign), a grid
// row per sequence over the longest one's rows (bwd_preprocess_varlen_kernel,
// bwd_convert_dq_varlen_kernel).
template <typename Elem, DqLayout kLayout, bool kVarlenRows = false, class LaunchMain>
cudaError_t launch_passes(const BwdParams& p, cudaStream_t stream, LaunchMain&& launch_main) {
    static_assert(!kVarlenRows || kLayout == DqLayout::kWgmmaTiles, "the varlen layout is tiles");
    BwdParams rows = p;
    if (p.cu_seqlens_q != nullptr && !kVarlenRows) {
        rows.batch = 1;
        rows.seqlen_q = p.total_q;
    }
    // Rows of the buffers per grid row: a sequence's with the varlen layout, else all of them.
    const int64_t grid_rows = kVarlenRows ? varlen_rows(p.seqlen_q) : rows.seqlen_q_pad;
    const int pre_rows = 4 * (32 / preprocess_lanes(p.d_pad));  // per CTA
    const dim3 pre_grid(static_cast<unsigned>((grid_rows + pre_rows - 1) / pre_rows), rows.heads,
                        rows.batch);
    cudaError_t err;
    if constexpr (kVarlenRows)
        err = launch_checked<&bwd_preprocess_varlen_kernel<Elem>>(pre_grid, 128, 0, stream, rows);
    else
        err = launch_checked<&bwd_preprocess_kernel<Elem>>(pre_grid, 128, 0, stream, rows);
    if (err != cudaSuccess)
        return err;
    if ((err = launch_main()) != cudaSuccess)
        return err;
    const bool tiles = kLayout == DqLayout::kWgmmaTiles || p.dq_tiles;
    const int64_t threads = !tiles        ? int64_t(rows.seqlen_q) * (p.d_head / 8)
                            : kVarlenRows ? (grid_rows / 64) * 32 * (p.d_pad / 8)
                                          : tile_convert_threads(rows);
    const dim3 cvt_grid(static_cast<unsigned>((threads + 255) / 256), rows.heads, rows.batch);
    if constexpr (kVarlenRows)
        return launch_checked<&bwd_convert_dq_varlen_kernel<Elem>>(cvt_grid, 256, 0, stream, rows);
    else if constexpr (kLayout == DqLayout::kWgmmaTiles)
        return launch_checked<&bwd_convert_dq_tiles_kernel<Elem>>(cvt_grid, 256, 0, stream, rows);
    else
        return launch_checked<&bwd_convert_dq_kernel<Elem>>(cvt_grid, 256, 0, stream, rows);
}

}  // namespace flash::bwd
