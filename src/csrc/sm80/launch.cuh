// Host-side launcher of one config and its registry entry. Plain CUDA (no torch): every
// generated per-config .cu file includes only this header. Errors are returned, never swallowed.
#pragma once

#include <atomic>
#include <cstdint>

#include <cuda_runtime.h>

#include "../common/launch_support.cuh"
#include "../common/params.h"
#include "../registry.h"
#include "config.cuh"
#include "forward_kernel.cuh"

namespace flash {

template <class Cfg>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream) {
    auto* kernel = &fwd_kernel<Cfg>;
    static std::atomic<uint64_t> configured{0};
    int device = 0;
    if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess)
        return err;
    if (cudaError_t err = opt_in_smem(kernel, Cfg::kSmemBytes, device, configured);
        err != cudaSuccess)
        return err;
    const dim3 grid((p.seqlen_q + Cfg::kBr - 1) / Cfg::kBr, p.heads, p.batch);
    kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
    return cudaGetLastError();
}

template <class Cfg>
constexpr KernelEntry make_entry(const char* name) {
    return kernel_entry<Cfg>(name, &launch_fwd<Cfg>, /*arch=*/80);
}

}  // namespace flash
