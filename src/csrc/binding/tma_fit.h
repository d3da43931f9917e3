// Whether the Hopper (sm_90a) kernels can run a call: an sm_90 GPU, a fixed-length batch (or a
// varlen kernel), and tensors TMA can address. Shared by the forward's dispatch and the backward
// operator.
#pragma once

#include <ATen/ATen.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

namespace flash::binding {

// Why a Hopper (sm_90a) kernel cannot run this call, or nullptr when it can: the GPU must be
// sm_90, the batch fixed-length unless the kernel takes varlen batches (varlen_kernel: a Hopper
// forward with flag j), and every tensor addressable by TMA (16-byte aligned base, strides of
// the dimensions it steps over positive multiples of 16 bytes; an expanded dimension, stride 0,
// runs on the sm80 family, which reads it in place). Tensors are (batch, seqlen, heads, d_head),
// varlen ones (tokens, heads, d_head).
inline const char* sm90_unfit(const cudaDeviceProp& prop, bool varlen,
                              std::initializer_list<const at::Tensor*> tensors,
                              bool varlen_kernel = false) {
    if (prop.major != 9 || prop.minor != 0)
        return "the GPU is not sm_90";
    if (varlen && !varlen_kernel)
        return "varlen batches run on the sm80-family kernels";
    const int64_t rank = varlen ? 3 : 4;
    for (const at::Tensor* t : tensors) {
        if (t->dim() != rank)
            return varlen ? "not a (tokens, heads, d_head) tensor"
                          : "not a (batch, seqlen, heads, d_head) tensor";
        if (reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0)
            return "a tensor's data is not 16-byte aligned";
        for (int64_t d = 0; d < rank - 1; ++d)
            if (t->size(d) > 1 && (t->stride(d) * t->element_size()) % 16 != 0)
                return "a tensor stride is not a multiple of 16 bytes";
            else if (t->size(d) > 1 && t->stride(d) == 0)
                return "a tensor is expanded (stride 0)";
        if (t->size(rank - 3) == 0)
            return "an empty sequence";
    }
    return nullptr;
}

}  // namespace flash::binding
