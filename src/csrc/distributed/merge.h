// The merge of a partial attention result into a running one by their LSEs (ring attention,
// flash_attention.distributed): out, lse (fp32) over one key set and part, part_lse over a
// disjoint one become the result over their union, in place:
//   lse' = log(e^lse + e^part_lse),  out' = out e^(lse - lse') + part e^(part_lse - lse'),
// a row with both LSEs -inf staying out 0, LSE -inf. `assign`: out, lse = part, part_lse (the
// first partial of rows nothing has reached). Plain C++ on the host side (the binding includes
// it); the kernel is in merge.cu.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace flash::distributed {

struct MergeParams {
    float* out;  // (batch, rows, heads, d), strides in floats, d contiguous
    int64_t out_batch_stride, out_row_stride, out_head_stride;
    float* lse;  // (batch, heads, rows), strides in floats
    int64_t lse_batch_stride, lse_head_stride, lse_row_stride;
    const void* part;  // like out, 16-bit (part_bf16: bfloat16, else float16), strides in elements
    int64_t part_batch_stride, part_row_stride, part_head_stride;
    bool part_bf16;
    const float* part_lse;  // like lse
    int64_t part_lse_batch_stride, part_lse_head_stride, part_lse_row_stride;
    int batch, rows, heads, d;
    bool assign;
};

// One warp per (batch, row, head); d <= 256 and even.
cudaError_t launch_merge(const MergeParams& p, cudaStream_t stream);

}  // namespace flash::distributed
