// Programmatic dependent launches (PDL, sm_90 and newer): a kernel launched as a programmatic
// dependent of the stream's previous kernel may start while that kernel finishes, and waits on
// the GPU (griddepcontrol.wait) before it reads that kernel's output, so a chain of short
// kernels (a decode step's append, decode and combine) does not pay a launch latency per link.
// Plain CUDA (no torch); included only by the kernels that use it.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>

#include <cuda_runtime.h>

#include "launch_support.cuh"

namespace flash {

// Whether launches on the current device may be programmatic dependents (compute capability
// 9.0 or newer), unless FLASH_ATTENTION_PDL=0 turns them off (read once per process). Asked
// once per device.
inline bool programmatic_launches() {
    static const bool enabled = [] {
        const char* v = std::getenv("FLASH_ATTENTION_PDL");
        return v == nullptr || std::strcmp(v, "0") != 0;
    }();
    static std::atomic<int> known[64] = {};  // 0 unknown, 1 no, 2 yes
    int device = 0;
    if (!enabled || cudaGetDevice(&device) != cudaSuccess || device >= 64)
        return false;
    int state = known[device].load(std::memory_order_relaxed);
    if (state == 0) {
        int major = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) !=
            cudaSuccess)
            return false;
        state = major >= 9 ? 2 : 1;
        known[device].store(state, std::memory_order_relaxed);
    }
    return state == 2;
}

// launch_checked as a programmatic dependent of the stream's previous kernel where
// programmatic_launches() allows: the kernel must call grid_dependency_wait() before it reads
// anything the kernels before it write.
template <auto kKernel, class Params>
cudaError_t launch_dependent(dim3 grid, int threads, int smem, cudaStream_t stream,
                             const Params& params) {
    if (!programmatic_launches())
        return launch_checked<kKernel>(grid, threads, smem, stream, params);
    if (cudaError_t err = opt_in_smem<kKernel>(smem); err != cudaSuccess)
        return err;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kKernel, params);
}

// Device side (no-ops before sm_90 and in a plain launch): wait until the kernels this one
// depends on have ended and their writes are visible; let this kernel's dependents be
// scheduled (they still wait for its end before reading its output).
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace flash
