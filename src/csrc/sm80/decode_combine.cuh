// The split-KV combine: the num_splits partial outputs of each (query row, head), each
// normalised by its own sum, merged in fp32 by their LSEs: O = sum_s exp(lse_s - M) O_s / sum_s
// exp(lse_s - M), LSE = M + log(sum_s exp(lse_s - M)), M = max_s lse_s. One CTA per row; each
// warp takes every kWarps-th split and loads kUnroll of them at once, LSEs and partials
// together, merging them into a running (max, sum, O) as the online softmax does, so a step
// of up to kWarps x kUnroll splits waits for one round of loads, not one for the LSEs and more
// for the partials (the weights-first kernel before it took 4.5 us a step at 33 splits on an
// H200); the warps' results are merged through shared memory. A NaN LSE (a sequence with bad
// cache metadata) makes the row NaN.
#pragma once

#include <cmath>
#include <cstdint>

#include "../common/numeric.cuh"
#include "../common/params.h"
#include "../common/programmatic_launch.cuh"

namespace flash::sm80 {

constexpr int kCombineThreads = 128;

template <typename Elem>
__global__ void __launch_bounds__(kCombineThreads)
    dec_combine_kernel(const __grid_constant__ DecParams p) {
    constexpr int kWarps = kCombineThreads / 32;
    constexpr int kChunks = 2;   // float4 column chunks per lane: d_head up to 256
    constexpr int kUnroll = 12;  // splits a warp loads at once: 48 splits a round
    __shared__ float4 sums[kWarps][32 * kChunks];
    __shared__ float warp_max[kWarps], warp_sum[kWarps];
    __shared__ bool warp_nan[kWarps];  // each warp writes its own: no initialisation race
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t row = blockIdx.x;  // head * rows_total + global row
    const int head = static_cast<int>(row / p.rows_total);
    const int64_t grow = row - int64_t(head) * p.rows_total;
    const int64_t split_step = int64_t(p.heads) * p.rows_total;
    const int n = p.num_splits;
    grid_dependency_wait();  // the decode kernel's partials (a programmatic launch on sm_90)

    const float* part = p.o_accum + row * p.d_head;
    const int64_t part_step = split_step * p.d_head;
    float mx = -INFINITY, sum = 0.f;  // the same in every lane of the warp
    bool nan = false;
    float4 acc[kChunks];
#pragma unroll
    for (int k = 0; k < kChunks; ++k)
        acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = warp; s0 < n; s0 += kWarps * kUnroll) {
        float l[kUnroll];
        float4 x[kUnroll][kChunks];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {  // every load of the round first
            const int s = s0 + u * kWarps;
            l[u] = s < n ? p.lse_accum[s * split_step + row] : -INFINITY;
#pragma unroll
            for (int k = 0; k < kChunks; ++k) {
                const int c = (lane + 32 * k) * 4;
                x[u][k] = s < n && c < p.d_head
                              ? *reinterpret_cast<const float4*>(part + s * part_step + c)
                              : make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
        float new_mx = mx;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            nan |= l[u] != l[u];
            new_mx = fmaxf(new_mx, l[u]);
        }
        if (new_mx == -INFINITY)
            continue;  // nothing seen yet: weights all 0
        const float scale = mx == -INFINITY ? 0.f : __expf(mx - new_mx);
        sum *= scale;
#pragma unroll
        for (int k = 0; k < kChunks; ++k) {
            acc[k].x *= scale;
            acc[k].y *= scale;
            acc[k].z *= scale;
            acc[k].w *= scale;
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const float w = l[u] == -INFINITY ? 0.f : __expf(l[u] - new_mx);
            sum += w;
#pragma unroll
            for (int k = 0; k < kChunks; ++k) {
                acc[k].x += w * x[u][k].x;
                acc[k].y += w * x[u][k].y;
                acc[k].z += w * x[u][k].z;
                acc[k].w += w * x[u][k].w;
            }
        }
        mx = new_mx;
    }
#pragma unroll
    for (int k = 0; k < kChunks; ++k)
        sums[warp][lane + 32 * k] = acc[k];
    if (lane == 0) {
        warp_max[warp] = mx;
        warp_sum[warp] = sum;
        warp_nan[warp] = nan;
    }
    __syncthreads();
    if (warp != 0)
        return;

    // The warps' (max, sum, O) merged: factors exp(max_w - M).
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w)
        m_all = fmaxf(m_all, warp_max[w]);
    float f[kWarps], total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
        f[w] = warp_max[w] == -INFINITY ? 0.f : __expf(warp_max[w] - m_all);
        total += f[w] * warp_sum[w];
    }
    bool row_nan = false;
#pragma unroll
    for (int w = 0; w < kWarps; ++w)
        row_nan |= warp_nan[w];
    const float inv = row_nan ? NAN : (total > 0.f ? 1.f / total : 0.f);

    // Where the row goes: (batch, position) of a fixed-length batch, the packed row of varlen.
    const int64_t b = p.cu_seqlens_q != nullptr ? 0 : grow / p.seqlen_q;
    const int64_t i = p.cu_seqlens_q != nullptr ? grow : grow - b * p.seqlen_q;
    Elem* o = static_cast<Elem*>(p.o) + b * p.o_batch_stride + i * p.o_row_stride +
              head * p.o_head_stride;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
        const int c = (lane + 32 * k) * 4;
        if (c >= p.d_head)
            continue;
        float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const float4 y = sums[w][lane + 32 * k];
            t.x += f[w] * y.x;
            t.y += f[w] * y.y;
            t.z += f[w] * y.z;
            t.w += f[w] * y.w;
        }
        uint2 packed;
        packed.x = pack2<Elem>(t.x * inv, t.y * inv);
        packed.y = pack2<Elem>(t.z * inv, t.w * inv);
        *reinterpret_cast<uint2*>(o + c) = packed;
    }
    if (lane == 0 && p.lse != nullptr)
        p.lse[b * p.lse_batch_stride + int64_t(head) * p.lse_head_stride + i] =
            row_nan ? NAN : (total > 0.f ? m_all + logf(total) : -INFINITY);
}

}  // namespace flash::sm80
