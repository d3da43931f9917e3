// What the launchers of both families share: the dynamic shared-memory opt-in (once per device)
// and the registry entry of a config. Plain CUDA (no torch).
#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../registry.h"

namespace flash {

// Raises `kernel`'s dynamic smem limit to `bytes` on `device` the first time it runs there (the
// attribute is per device context); `configured` is the caller's per-kernel bit set of devices.
template <class Kernel>
cudaError_t opt_in_smem(Kernel kernel, int bytes, int device, std::atomic<uint64_t>& configured) {
    if (bytes <= 48 * 1024)
        return cudaSuccess;
    const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
    if (bit != 0 && (configured.load(std::memory_order_acquire) & bit))
        return cudaSuccess;
    if (cudaError_t err =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
        err != cudaSuccess)
        return err;
    configured.fetch_or(bit, std::memory_order_acq_rel);
    return cudaSuccess;
}

// The registry entry of config Cfg, launched by `launch`; arch: 80 (sm80 family) or 90 (sm_90a).
template <class Cfg>
constexpr KernelEntry kernel_entry(const char* name, LaunchFn launch, int arch,
                                   bool tile_counter = false) {
    return KernelEntry{name,
                       std::is_same_v<typename Cfg::Elem, __half> ? DType::kFp16 : DType::kBf16,
                       Cfg::kDHead,
                       Cfg::kBr,
                       Cfg::kBc,
                       Cfg::kThreads,
                       Cfg::kSmemBytes,
                       Cfg::kMask,
                       Cfg::kSoftcap,
                       launch,
                       arch,
                       tile_counter};
}

}  // namespace flash
