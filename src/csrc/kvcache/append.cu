// The KV-cache append / rotary kernel (append.h). One CTA per (row j, sequence b); its threads
// walk the row's heads x d_head elements, each element computed in fp32 from the one or two
// source values its rotation reads. A row whose position is outside the cache (or whose page or
// cache row is outside the tensors) is not written: the error bit goes to status, and the
// attention over that sequence returns NaN (decode_kernel.cuh). A position past cos/sin's rows
// writes NaN, so a wrong rotary table is never a silently wrong answer either.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "../common/params.h"
#include "append.h"

namespace flash::kvcache {
namespace {

__device__ int g_status = 0;  // per device (each context has its own copy of the module)

__device__ __forceinline__ float to_float(__half x) {
    return __half2float(x);
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
    return __bfloat162float(x);
}
template <typename Elem>
__device__ __forceinline__ Elem from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
    return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// x1 cos - x2 sin (first) or x1 sin + x2 cos, each product rounded before the sum (no FMA), as
// torch computes flash_attention.rotary.apply_rotary in fp32: the reference's values exactly.
__device__ __forceinline__ float rotate(float x1, float x2, float c, float s, bool first) {
    return first ? __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s))
                 : __fadd_rn(__fmul_rn(x1, s), __fmul_rn(x2, c));
}

template <typename Elem>
__global__ void append_kernel(const __grid_constant__ AppendParams p) {
    const int j = blockIdx.x, b = blockIdx.y;
    const int pos = (p.base_pos != nullptr ? p.base_pos[b] : p.base_const) + (p.per_row ? j : 0);
    int bad = 0;
    int64_t dst_row = 0;
    if (p.dst_cache) {
        if (pos < 0 || pos >= p.capacity) {
            bad |= decode::kStatusSeqlen;
        } else if (p.block_table != nullptr) {
            const int page = p.block_table[b * p.block_table_stride + pos / p.page_size];
            if (page < 0 || page >= p.num_pages)
                bad |= decode::kStatusPage;
            else
                dst_row = page * p.dst_batch_stride + int64_t(pos % p.page_size) * p.dst_row_stride;
        } else {
            const int row = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
            if (row < 0 || row >= p.cache_batch)
                bad |= decode::kStatusCacheRow;
            else
                dst_row = row * p.dst_batch_stride + int64_t(pos) * p.dst_row_stride;
        }
    } else {
        dst_row = b * p.dst_batch_stride + int64_t(j) * p.dst_row_stride;
    }
    const bool rotary = p.cos != nullptr;
    const bool rotary_bad = rotary && (pos < 0 || pos >= p.seqlen_ro);
    if (rotary_bad)
        bad |= decode::kStatusRotary;
    if (bad != 0 && threadIdx.x == 0 && p.status != nullptr)
        atomicOr(p.status, bad);
    if (bad & ~decode::kStatusRotary)
        return;  // nowhere inside the cache to write

    const Elem* src =
        static_cast<const Elem*>(p.src) + b * p.src_batch_stride + int64_t(j) * p.src_row_stride;
    Elem* dst = static_cast<Elem*>(p.dst) + dst_row;
    const int half = p.rotary_dim / 2;
    const int64_t cos_at = int64_t(pos) * p.cos_row_stride,
                  sin_at = int64_t(pos) * p.sin_row_stride;
    // Entry i of this position's cos / sin row, in fp32 (read only for a valid position).
    const auto angle = [&](const void* table, int64_t at, int i) {
        return p.rotary_fp32 ? static_cast<const float*>(table)[at + i]
                             : to_float(static_cast<const Elem*>(table)[at + i]);
    };
    const int n = p.heads * p.d_head;
    for (int idx = threadIdx.x; idx < n; idx += blockDim.x) {
        const int h = idx / p.d_head, c = idx % p.d_head;
        const Elem* x = src + h * p.src_head_stride;
        float out;
        if (!rotary || c >= p.rotary_dim) {
            out = to_float(x[c]);
        } else if (rotary_bad) {
            out = NAN;
        } else if (p.interleaved) {  // pairs (2i, 2i + 1)
            const int i = c / 2;
            const float x1 = to_float(x[2 * i]), x2 = to_float(x[2 * i + 1]);
            out = rotate(x1, x2, angle(p.cos, cos_at, i), angle(p.sin, sin_at, i), c % 2 == 0);
        } else {  // halves (i, i + rotary_dim / 2)
            const int i = c < half ? c : c - half;
            const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
            out = rotate(x1, x2, angle(p.cos, cos_at, i), angle(p.sin, sin_at, i), c < half);
        }
        dst[h * p.dst_head_stride + c] = from_float<Elem>(out);
    }
}

}  // namespace

cudaError_t launch_append(const AppendParams& p, bool is_bf16, cudaStream_t stream) {
    if (p.batch == 0 || p.seqlen == 0 || p.heads == 0)
        return cudaSuccess;
    const dim3 grid(p.seqlen, p.batch);
    if (is_bf16)
        append_kernel<__nv_bfloat16><<<grid, 128, 0, stream>>>(p);
    else
        append_kernel<__half><<<grid, 128, 0, stream>>>(p);
    return cudaGetLastError();
}

cudaError_t status_word(int** word) {
    static int* known[64] = {};
    int device = 0;
    if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess)
        return err;
    if (device < 64 && known[device] != nullptr) {
        *word = known[device];
        return cudaSuccess;
    }
    void* address = nullptr;
    if (cudaError_t err = cudaGetSymbolAddress(&address, g_status); err != cudaSuccess)
        return err;
    *word = static_cast<int*>(address);
    if (device < 64)
        known[device] = *word;
    return cudaSuccess;
}

cudaError_t read_status(bool clear, int* value) {
    if (cudaError_t err = cudaMemcpyFromSymbol(value, g_status, sizeof(int)); err != cudaSuccess)
        return err;
    if (!clear)
        return cudaSuccess;
    const int zero = 0;
    return cudaMemcpyToSymbol(g_status, &zero, sizeof(int));
}

}  // namespace flash::kvcache
