// Host-side launcher of one config and its registry entry. Plain CUDA (no torch): every
// generated per-config .cu file includes only this header. Errors are returned, never swallowed.
#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "../common/params.h"
#include "../registry.h"
#include "config.cuh"
#include "forward_kernel.cuh"

namespace flash {

template <class Cfg>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream) {
    auto* kernel = &fwd_kernel<Cfg>;
    if constexpr (Cfg::kSmemBytes > 48 * 1024) {
        // Opt in to >48 KB of dynamic smem once per device (the attribute is per device context).
        static std::atomic<uint64_t> configured{0};
        int device = 0;
        if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess)
            return err;
        const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
        if (bit == 0 || !(configured.load(std::memory_order_acquire) & bit)) {
            cudaError_t err = cudaFuncSetAttribute(
                kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
            if (err != cudaSuccess)
                return err;
            configured.fetch_or(bit, std::memory_order_acq_rel);
        }
    }
    const dim3 grid((p.seqlen_q + Cfg::kBr - 1) / Cfg::kBr, p.heads, p.batch);
    kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
    return cudaGetLastError();
}

template <class Cfg>
constexpr KernelEntry make_entry(const char* name) {
    return KernelEntry{name,
                       std::is_same_v<typename Cfg::Elem, __half> ? DType::kFp16 : DType::kBf16,
                       Cfg::kDHead,
                       Cfg::kBr,
                       Cfg::kBc,
                       Cfg::kThreads,
                       Cfg::kSmemBytes,
                       Cfg::kMask,
                       Cfg::kSoftcap,
                       &launch_fwd<Cfg>,
                       /*arch=*/80};
}

}  // namespace flash
