// The split-KV combine: the num_splits partial outputs of each (query row, head), each
// normalised by its own sum, merged in fp32 by their LSEs: O = sum_s exp(lse_s - M) O_s / sum_s
// exp(lse_s - M), LSE = M + log(sum_s exp(lse_s - M)), M = max_s lse_s. One CTA per row: warp 0
// turns the LSEs into weights (shared memory), then each warp sums every kWarps-th split's
// partial, kUnroll splits' loads in flight at once, and the warps' sums are added. (A warp per
// row that waited for each split's load in turn took 6-11 us on an H200 where the loads need
// 2-3.) A NaN partial (a sequence with bad cache metadata) makes the row NaN.
#pragma once

#include <cmath>
#include <cstdint>

#include "../common/numeric.cuh"
#include "../common/params.h"
#include "../common/programmatic_launch.cuh"

namespace flash::sm80 {

constexpr int kCombineThreads = 128;
constexpr int kMaxSplits = 256;  // the binding caps num_splits here

template <typename Elem>
__global__ void __launch_bounds__(kCombineThreads)
    dec_combine_kernel(const __grid_constant__ DecParams p) {
    constexpr int kWarps = kCombineThreads / 32;
    constexpr int kChunks = 2;  // float4 column chunks per lane: d_head up to 256
    constexpr int kUnroll = 4;
    __shared__ float weights[kMaxSplits];
    __shared__ float4 sums[kWarps][32 * kChunks];
    __shared__ float row_inv, row_lse;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t row = blockIdx.x;  // head * rows_total + global row
    const int head = static_cast<int>(row / p.rows_total);
    const int64_t grow = row - int64_t(head) * p.rows_total;
    const int64_t split_step = int64_t(p.heads) * p.rows_total;
    const int n = p.num_splits;
    grid_dependency_wait();  // the decode kernel's partials (a programmatic launch on sm_90)

    if (warp == 0) {
        float mx = -INFINITY;
        bool nan = false;
        for (int s = lane; s < n; s += 32) {
            const float l = p.lse_accum[s * split_step + row];
            nan |= l != l;
            mx = fmaxf(mx, l);
        }
#pragma unroll
        for (int d = 16; d > 0; d /= 2)
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
        nan = __any_sync(0xffffffffu, nan);
        float sum = 0.f;
        for (int s = lane; s < n; s += 32) {
            const float l = p.lse_accum[s * split_step + row];
            const float w = mx == -INFINITY || l == -INFINITY ? 0.f : __expf(l - mx);
            weights[s] = w;
            sum += w;
        }
#pragma unroll
        for (int d = 16; d > 0; d /= 2)
            sum += __shfl_xor_sync(0xffffffffu, sum, d);
        if (lane == 0) {
            row_inv = nan ? NAN : (sum > 0.f ? 1.f / sum : 0.f);
            row_lse = nan ? NAN : (sum > 0.f ? mx + logf(sum) : -INFINITY);
        }
    }
    __syncthreads();

    const float* part = p.o_accum + row * p.d_head;
    const int64_t part_step = split_step * p.d_head;
    float4 acc[kChunks];
#pragma unroll
    for (int k = 0; k < kChunks; ++k)
        acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = warp; s0 < n; s0 += kWarps * kUnroll) {
        float4 x[kUnroll][kChunks];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)  // the loads first: kUnroll x kChunks in flight
#pragma unroll
            for (int k = 0; k < kChunks; ++k) {
                const int s = s0 + u * kWarps, c = (lane + 32 * k) * 4;
                x[u][k] = s < n && c < p.d_head
                              ? *reinterpret_cast<const float4*>(part + s * part_step + c)
                              : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int s = s0 + u * kWarps;
            const float w = s < n ? weights[s] : 0.f;
#pragma unroll
            for (int k = 0; k < kChunks; ++k) {
                acc[k].x += w * x[u][k].x;
                acc[k].y += w * x[u][k].y;
                acc[k].z += w * x[u][k].z;
                acc[k].w += w * x[u][k].w;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < kChunks; ++k)
        sums[warp][lane + 32 * k] = acc[k];
    __syncthreads();
    if (warp != 0)
        return;

    // Where the row goes: (batch, position) of a fixed-length batch, the packed row of varlen.
    const int64_t b = p.cu_seqlens_q != nullptr ? 0 : grow / p.seqlen_q;
    const int64_t i = p.cu_seqlens_q != nullptr ? grow : grow - b * p.seqlen_q;
    Elem* o = static_cast<Elem*>(p.o) + b * p.o_batch_stride + i * p.o_row_stride +
              head * p.o_head_stride;
    const float inv = row_inv;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
        const int c = (lane + 32 * k) * 4;
        if (c >= p.d_head)
            continue;
        float4 t = sums[0][lane + 32 * k];
#pragma unroll
        for (int w = 1; w < kWarps; ++w) {
            const float4 y = sums[w][lane + 32 * k];
            t.x += y.x;
            t.y += y.y;
            t.z += y.z;
            t.w += y.w;
        }
        uint2 packed;
        packed.x = pack2<Elem>(t.x * inv, t.y * inv);
        packed.y = pack2<Elem>(t.z * inv, t.w * inv);
        *reinterpret_cast<uint2*>(o + c) = packed;
    }
    if (lane == 0 && p.lse != nullptr)
        p.lse[b * p.lse_batch_stride + int64_t(head) * p.lse_head_stride + i] = row_lse;
}

}  // namespace flash::sm80
