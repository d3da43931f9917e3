// The KV-cache append and rotary kernel's arguments and launcher: rows of (batch, seq, heads,
// d_head) sources (new keys, new values, or q) are written, rotated by rotary embedding when
// cos/sin are given, into a KV cache (contiguous or paged) at each sequence's length, or into a
// plain destination (q's rotated copy). Plain C++ on the host side (the binding includes it);
// the kernel is in append.cu.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace flash::kvcache {

struct AppendParams {
    const void* src;  // (batch, seqlen, heads, d_head), any strides, d_head contiguous
    int64_t src_batch_stride, src_row_stride, src_head_stride;
    int batch, seqlen, heads, d_head;

    // Destination: a cache (dst_cache = true) at rows base_pos[b] + j of sequence b, or a plain
    // tensor with the source's shape.
    void* dst;
    bool dst_cache;
    int64_t dst_batch_stride, dst_row_stride, dst_head_stride;  // a paged cache: per page
    const int* block_table;  // (batch, block_table_stride) or nullptr (contiguous)
    int64_t block_table_stride;
    int page_size, num_pages;
    const int* cache_batch_idx;  // contiguous caches: cache row of sequence b, or nullptr
    int cache_batch;
    int capacity;  // rows a sequence's cache holds

    // Positions: base_pos[b] (nullptr: base_const) + j when per_row, else base_pos[b].
    const int* base_pos;
    int base_const;
    bool per_row;

    // Rotary embedding: cos, sin (seqlen_ro, rotary_dim / 2), rows cos_row_stride elements
    // apart, fp32 (rotary_fp32) or the source's element type, read as they are (no copy of the
    // table per step); nullptr: none.
    const void* cos;
    const void* sin;
    int64_t cos_row_stride, sin_row_stride;
    bool rotary_fp32;
    int seqlen_ro, rotary_dim;
    bool interleaved;

    int* status;  // decode::kStatus* bits ORed on bad metadata (nullptr: not kept)

    // An FP8 cache (dst_fp8 1: e4m3, 2: e5m2; 0: the source's type): each value is divided by
    // its (sequence, head)'s descale (descale[b * descale_batch_stride + h *
    // descale_head_stride], nullptr: 1) and rounded to nearest, saturating at the format's
    // largest finite value.
    int dst_fp8;
    const float* descale;
    int64_t descale_batch_stride, descale_head_stride;
};

// A decode step's appends in one launch: q's rotated copy, the new keys, the new values (up to
// kMaxJobs jobs).
constexpr int kMaxJobs = 3;
struct AppendJobs {
    AppendParams job[kMaxJobs];
    int count;
    int chunk_start[kMaxJobs + 1];  // job i's CTAs: blockIdx.z in [chunk_start[i], [i + 1])
    int rows;                       // the jobs' longest seqlen (gridDim.x)
    int batch;
};

// is_bf16: the element type (bf16, else fp16). One thread per element of a row's heads x
// d_head. Returns the launch's error.
cudaError_t launch_appends(AppendJobs& jobs, bool is_bf16, cudaStream_t stream);

// The KV-cache status word of the current device: a static __device__ int the decode and append
// kernels OR decode::kStatus* bits into, so recording an error costs no allocation and no sync.
cudaError_t status_word(int** word);
// Its value (a synchronous read of 4 bytes), cleared afterwards when `clear`.
cudaError_t read_status(bool clear, int* value);

}  // namespace flash::kvcache
