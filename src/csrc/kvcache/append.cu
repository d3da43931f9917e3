// The KV-cache append / rotary kernel (append.h): one launch for a step's jobs (q's rotated copy,
// new keys, new values), a thread per element of a row's heads x d_head, each element computed in
// fp32 from the one or two source values its rotation reads. A row whose position is outside the
// cache (or whose page or cache row is outside the tensors) is not written: the error bit goes to
// status, and the attention over that sequence returns NaN (decode_kernel.cuh). A position past
// cos/sin's rows writes NaN, so a wrong rotary table is never a silently wrong answer either.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>

#include "../common/params.h"
#include "../common/programmatic_launch.cuh"
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

constexpr int kAppendThreads = 128;

// One element (row j of sequence b, column idx of the row's heads x d_head) of job p.
template <typename Elem>
__device__ __forceinline__ void append_element(const AppendParams& p, int j, int b, int idx,
                                               bool record) {
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
    if (bad != 0 && record && p.status != nullptr)
        atomicOr(p.status, bad);
    if ((bad & ~decode::kStatusRotary) || idx >= p.heads * p.d_head)
        return;  // nowhere inside the cache to write, or past the row

    const Elem* __restrict__ src =
        static_cast<const Elem*>(p.src) + b * p.src_batch_stride + int64_t(j) * p.src_row_stride;
    const int h = idx / p.d_head, c = idx - h * p.d_head;
    const Elem* x = src + h * p.src_head_stride;
    // Entry i of this position's cos / sin row, in fp32 (read only for a valid position).
    const auto angle = [&](const void* table, int64_t row_stride, int i) {
        const int64_t at = int64_t(pos) * row_stride + i;
        return p.rotary_fp32 ? static_cast<const float*>(table)[at]
                             : to_float(static_cast<const Elem*>(table)[at]);
    };
    const int half = p.rotary_dim / 2;
    float out;
    if (!rotary || c >= p.rotary_dim) {
        out = to_float(x[c]);
    } else if (rotary_bad) {
        out = NAN;
    } else if (p.interleaved) {  // pairs (2i, 2i + 1)
        const int i = c / 2;
        const float x1 = to_float(x[2 * i]), x2 = to_float(x[2 * i + 1]);
        out = rotate(x1, x2, angle(p.cos, p.cos_row_stride, i), angle(p.sin, p.sin_row_stride, i),
                     c % 2 == 0);
    } else {  // halves (i, i + rotary_dim / 2)
        const int i = c < half ? c : c - half;
        const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
        out = rotate(x1, x2, angle(p.cos, p.cos_row_stride, i), angle(p.sin, p.sin_row_stride, i),
                     c < half);
    }
    const int64_t at = h * p.dst_head_stride + c;
    if (p.dst_fp8 == 0) {
        static_cast<Elem*>(p.dst)[dst_row + at] = from_float<Elem>(out);
        return;
    }
    const float scale = p.descale == nullptr
                            ? 1.f
                            : p.descale[b * p.descale_batch_stride + h * p.descale_head_stride];
    const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(__fdiv_rn(out, scale), __NV_SATFINITE,
                                                       p.dst_fp8 == 1 ? __NV_E4M3 : __NV_E5M2);
    static_cast<__nv_fp8_storage_t*>(p.dst)[dst_row + at] = q;
}

// Grid (rows, batch, chunks of every job): CTA (j, b, z) writes one chunk of kAppendThreads
// elements of row j of sequence b of the job z falls in.
template <typename Elem>
__global__ void __launch_bounds__(kAppendThreads)
    append_kernel(const __grid_constant__ AppendJobs jobs) {
    flash::grid_dependents_launch();  // the decode kernel may start its copies of older keys
    const int j = blockIdx.x, b = blockIdx.y, z = blockIdx.z;
    int i = 0;
    while (i + 1 < jobs.count && z >= jobs.chunk_start[i + 1])
        ++i;
    const AppendParams& p = jobs.job[i];
    if (j >= p.seqlen)
        return;
    const int chunk = z - jobs.chunk_start[i];
    append_element<Elem>(p, j, b, chunk * kAppendThreads + threadIdx.x,
                         chunk == 0 && threadIdx.x == 0);
}

}  // namespace

cudaError_t launch_appends(AppendJobs& jobs, bool is_bf16, cudaStream_t stream) {
    if (jobs.count <= 0 || jobs.count > kMaxJobs)
        return cudaErrorInvalidValue;
    jobs.rows = 0;
    jobs.chunk_start[0] = 0;
    for (int i = 0; i < jobs.count; ++i) {
        const AppendParams& p = jobs.job[i];
        const int chunks = (p.heads * p.d_head + kAppendThreads - 1) / kAppendThreads;
        jobs.chunk_start[i + 1] = jobs.chunk_start[i] + (chunks > 0 ? chunks : 1);
        jobs.rows = p.seqlen > jobs.rows ? p.seqlen : jobs.rows;
    }
    if (jobs.batch == 0 || jobs.rows == 0)
        return cudaSuccess;
    const dim3 grid(jobs.rows, jobs.batch, jobs.chunk_start[jobs.count]);
    if (is_bf16)
        append_kernel<__nv_bfloat16><<<grid, kAppendThreads, 0, stream>>>(jobs);
    else
        append_kernel<__half><<<grid, kAppendThreads, 0, stream>>>(jobs);
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
