// What the launchers of both families share: the dynamic shared-memory opt-in (once per device),
// a checked launch, the SM count, and the registry entry of a config. Plain CUDA (no torch).
#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "../registry.h"

namespace flash {

// Raises kKernel's dynamic smem limit to `bytes` on the current device the first time it runs
// there (the attribute is per device context); nothing to do up to the default 48 KB.
template <auto kKernel>
cudaError_t opt_in_smem(int bytes) {
    if (bytes <= 48 * 1024)
        return cudaSuccess;
    static std::atomic<uint64_t> configured{0};  // one bit per device
    int device = 0;
    if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess)
        return err;
    const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
    if (bit != 0 && (configured.load(std::memory_order_acquire) & bit))
        return cudaSuccess;
    if (cudaError_t err =
            cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
        err != cudaSuccess)
        return err;
    configured.fetch_or(bit, std::memory_order_acq_rel);
    return cudaSuccess;
}

// The SMs of the current device, asked once per device.
inline cudaError_t multiprocessor_count(int& count) {
    static std::atomic<int> known[64] = {};
    int device = 0;
    if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess)
        return err;
    count = device < 64 ? known[device].load(std::memory_order_relaxed) : 0;
    if (count > 0)
        return cudaSuccess;
    if (cudaError_t err = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
        err != cudaSuccess)
        return err;
    if (count < 1)
        return cudaErrorInvalidConfiguration;
    if (device < 64)
        known[device].store(count, std::memory_order_relaxed);
    return cudaSuccess;
}

// kKernel<<<grid, threads, smem, stream>>>(params) after opt_in_smem: the error of either.
template <auto kKernel, class Params>
cudaError_t launch_checked(dim3 grid, int threads, int smem, cudaStream_t stream,
                           const Params& params) {
    if (cudaError_t err = opt_in_smem<kKernel>(smem); err != cudaSuccess)
        return err;
    kKernel<<<grid, threads, smem, stream>>>(params);
    return cudaGetLastError();
}

// The registry entry of config Cfg of any kind, launched by `launch`; arch: 80 (sm80 family) or
// 90 (sm_90a). Filled field by field (C++17: the build's standard under older torch).
// A config's element type as a registry DType.
template <typename Elem>
constexpr DType dtype_of() {
    return std::is_same_v<Elem, __half>          ? DType::kFp16
           : std::is_same_v<Elem, __nv_bfloat16> ? DType::kBf16
           : std::is_same_v<Elem, __nv_fp8_e5m2> ? DType::kE5m2
                                                 : DType::kE4m3;
}

// Cfg::CacheElem where a config has one (the decode kernels), else Cfg::Elem.
template <class Cfg, class = void>
struct CacheElemOf {
    using type = typename Cfg::Elem;
};
template <class Cfg>
struct CacheElemOf<Cfg, std::void_t<typename Cfg::CacheElem>> {
    using type = typename Cfg::CacheElem;
};

template <class Cfg, class Params>
constexpr KernelEntry<Params> kernel_entry(const char* name,
                                           cudaError_t (*launch)(const Params&, cudaStream_t),
                                           int arch, bool tile_counter = false,
                                           bool varlen_only = false) {
    KernelEntry<Params> e{};
    e.name = name;
    e.dtype = dtype_of<typename Cfg::Elem>();
    e.cache_dtype = dtype_of<typename CacheElemOf<Cfg>::type>();
    e.d_head = Cfg::kDHead;
    e.block_r = Cfg::kBr;
    e.block_c = Cfg::kBc;
    e.threads = Cfg::kThreads;
    e.smem_bytes = Cfg::kSmemBytes;
    e.mask = Cfg::kMask;
    e.softcap = Cfg::kSoftcap;
    e.arch = arch;
    e.tile_counter = tile_counter;
    e.varlen_only = varlen_only;
    e.launch = launch;
    return e;
}

}  // namespace flash
