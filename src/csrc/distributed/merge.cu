// The LSE merge of merge.h: one warp per (batch, row, head), lane l taking columns 2 l, 2 l + 1
// of every 64; lane 0 reads both LSEs and hands the weights to the others before it writes the
// new LSE, so no lane reads an LSE another has overwritten.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "merge.h"

namespace flash::distributed {
namespace {

constexpr int kWarps = 8;  // per block

__device__ __forceinline__ float2 load2(const void* base, int64_t offset, bool bf16) {
    if (bf16)
        return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(
            static_cast<const __nv_bfloat16*>(base) + offset));
    return __half22float2(
        *reinterpret_cast<const __half2*>(static_cast<const __half*>(base) + offset));
}

__global__ void __launch_bounds__(32 * kWarps) merge_kernel(const MergeParams p) {
    const int64_t row_id = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row_id >= int64_t(p.batch) * p.rows * p.heads)
        return;
    const int h = static_cast<int>(row_id % p.heads);
    const int64_t s = row_id / p.heads % p.rows, b = row_id / (int64_t(p.heads) * p.rows);
    float* lse = p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + s * p.lse_row_stride;
    float w_old = 0.f, w_part = 1.f, merged = 0.f;
    if (lane == 0) {
        const float part_lse = p.part_lse[b * p.part_lse_batch_stride + h * p.part_lse_head_stride +
                                          s * p.part_lse_row_stride];
        if (p.assign) {
            merged = part_lse;
        } else {
            const float old = *lse;
            const float hi = fmaxf(old, part_lse), lo = fminf(old, part_lse);
            if (hi == -INFINITY) {  // neither saw a key: out 0, LSE -inf
                merged = -INFINITY;
                w_part = 0.f;
            } else {
                merged = hi + log1pf(expf(lo - hi));
                w_old = expf(old - merged);
                w_part = expf(part_lse - merged);
            }
        }
    }
    w_old = __shfl_sync(0xffffffffu, w_old, 0);
    w_part = __shfl_sync(0xffffffffu, w_part, 0);
    float* out = p.out + b * p.out_batch_stride + s * p.out_row_stride + h * p.out_head_stride;
    const int64_t part = b * p.part_batch_stride + s * p.part_row_stride + h * p.part_head_stride;
    for (int c = 2 * lane; c < p.d; c += 64) {
        const float2 x = load2(p.part, part + c, p.part_bf16);
        float2* at = reinterpret_cast<float2*>(out + c);
        float2 o = p.assign ? make_float2(0.f, 0.f) : *at;
        o.x = o.x * w_old + x.x * w_part;
        o.y = o.y * w_old + x.y * w_part;
        *at = o;
    }
    if (lane == 0)
        *lse = merged;
}

}  // namespace

cudaError_t launch_merge(const MergeParams& p, cudaStream_t stream) {
    const int64_t rows = int64_t(p.batch) * p.rows * p.heads;
    if (rows == 0)
        return cudaSuccess;
    const int64_t blocks = (rows + kWarps - 1) / kWarps;
    merge_kernel<<<static_cast<unsigned>(blocks), 32 * kWarps, 0, stream>>>(p);
    return cudaGetLastError();
}

}  // namespace flash::distributed
