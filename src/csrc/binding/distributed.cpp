// The operator of ring attention (flash_attention.distributed), in its own translation unit:
//   flash_attention::merge_partials_(out!, lse!, part, part_lse, assign) -> ()
//       merges a call's (part, part_lse) into the running fp32 (out, lse) in place (the math
//       and the kernel: ../distributed/merge.h); merge.py does the same in torch for CPU tensors
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "../distributed/merge.h"
#include "message.h"

namespace {

// Every stride but the last (1) a multiple of `multiple`, the start aligned to `bytes`.
bool aligned(const at::Tensor& t, int64_t multiple, int64_t bytes) {
    bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0 && t.stride(-1) == 1;
    for (int64_t d = 0; d + 1 < t.dim(); ++d)
        ok = ok && (t.size(d) <= 1 || t.stride(d) % multiple == 0);
    return ok;
}

void merge_partials_cuda(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part,
                         const at::Tensor& part_lse, bool assign) {
    FA_CHECK_VALUE(out.dim() == 4 && out.scalar_type() == at::kFloat,
                   "out must be a 4-D (batch, rows, heads, d) float32 tensor, got ", out.sizes(),
                   " ", out.scalar_type());
    FA_CHECK_VALUE(part.sizes() == out.sizes(), "part must have the shape of out ", out.sizes(),
                   ", got ", part.sizes());
    FA_CHECK_TYPE(part.scalar_type() == at::kBFloat16 || part.scalar_type() == at::kHalf,
                  "part must be bfloat16 or float16, got ", part.scalar_type());
    const int64_t B = out.size(0), S = out.size(1), H = out.size(2), D = out.size(3);
    for (const at::Tensor* t : {&lse, &part_lse})
        FA_CHECK_VALUE(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == B &&
                           t->size(1) == H && t->size(2) == S,
                       "lse and part_lse must be float32 (batch, heads, rows) = (", B, ", ", H,
                       ", ", S, "), got ", t->sizes(), " ", t->scalar_type());
    for (const at::Tensor* t : {&lse, &part, &part_lse})
        FA_CHECK_VALUE(t->device() == out.device(), "every tensor must be on out's device (",
                       out.device(), "), got ", t->device());
    FA_CHECK_VALUE(D % 2 == 0 && aligned(out, 2, 8) && aligned(part, 2, 4),
                   "out and part need an even d, a contiguous last dimension and even strides");
    FA_CHECK_VALUE(B * S * H < (int64_t(1) << 40) && S < (int64_t(1) << 31),
                   "merge_partials_: too many rows");
    const c10::cuda::CUDAGuard guard(out.device());
    flash::distributed::MergeParams p{};
    p.out = out.data_ptr<float>();
    p.out_batch_stride = out.stride(0);
    p.out_row_stride = out.stride(1);
    p.out_head_stride = out.stride(2);
    p.lse = lse.data_ptr<float>();
    p.lse_batch_stride = lse.stride(0);
    p.lse_head_stride = lse.stride(1);
    p.lse_row_stride = lse.stride(2);
    p.part = part.data_ptr();
    p.part_batch_stride = part.stride(0);
    p.part_row_stride = part.stride(1);
    p.part_head_stride = part.stride(2);
    p.part_bf16 = part.scalar_type() == at::kBFloat16;
    p.part_lse = part_lse.data_ptr<float>();
    p.part_lse_batch_stride = part_lse.stride(0);
    p.part_lse_head_stride = part_lse.stride(1);
    p.part_lse_row_stride = part_lse.stride(2);
    p.batch = static_cast<int>(B);
    p.rows = static_cast<int>(S);
    p.heads = static_cast<int>(H);
    p.d = static_cast<int>(D);
    p.assign = assign;
    const cudaError_t err = flash::distributed::launch_merge(
        p, c10::cuda::getCurrentCUDAStream(out.device().index()).stream());
    FA_CHECK(err == cudaSuccess, "launch of the merge kernel failed: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flash_attention, m) {
    m.def(
        "merge_partials_(Tensor(a!) out, Tensor(b!) lse, Tensor part, Tensor part_lse, "
        "bool assign) -> ()");
}

TORCH_LIBRARY_IMPL(flash_attention, CUDA, m) {
    m.impl("merge_partials_", &merge_partials_cuda);
}
