// Host-side launcher of one config and its registry entry. Plain CUDA (no torch): every
// generated per-config .cu file includes only this header. Errors are returned, never swallowed.
#pragma once

#include <cuda_runtime.h>

#include "../common/launch_support.cuh"
#include "../common/params.h"
#include "../registry.h"
#include "forward_config.cuh"
#include "forward_kernel.cuh"

namespace flash::sm80 {

template <class Cfg>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream) {
    const dim3 grid((p.seqlen_q + Cfg::kBr - 1) / Cfg::kBr, p.heads, p.batch);
    return launch_checked<&fwd_kernel<Cfg>>(grid, Cfg::kThreads, Cfg::kSmemBytes, stream, p);
}

template <class Cfg>
constexpr FwdKernelEntry make_fwd_entry(const char* name) {
    return kernel_entry<Cfg>(name, &launch_fwd<Cfg>, /*arch=*/80);
}

}  // namespace flash::sm80
