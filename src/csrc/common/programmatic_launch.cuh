// Programmatic dependent launches (PDL, sm_90 and newer): a kernel launched as a programmatic
// dependent of the stream's previous kernel may start while that kernel finishes, and waits on
// the GPU (griddepcontrol.wait) before it reads that kernel's output, so a chain of short
// kernels (a decode step's append, decode and combine) does not pay a launch latency per link.
// The same launch may make clusters of the grid's CTAs (launch_support.cuh's cluster helpers).
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
// anything the kernels before it write. cluster > 1: consecutive groups of `cluster` CTAs along
// x are thread block clusters (sm_90; grid.x a multiple of it; see max_active_clusters).
template <auto kKernel, class Params>
cudaError_t launch_dependent(dim3 grid, int threads, int smem, cudaStream_t stream,
                             const Params& params, int cluster = 1) {
    const bool dependent = programmatic_launches();
    if (!dependent && cluster == 1)
        return launch_checked<kKernel>(grid, threads, smem, stream, params);
    if (cudaError_t err = opt_in_smem<kKernel>(smem); err != cudaSuccess)
        return err;
    if (cudaError_t err = opt_in_cluster<kKernel>(cluster); err != cudaSuccess)
        return err;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute attributes[2] = {};
    int n = 0;
    if (dependent) {
        attributes[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attributes[n++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (cluster > 1) {
        attributes[n].id = cudaLaunchAttributeClusterDimension;
        attributes[n].val.clusterDim.x = static_cast<unsigned>(cluster);
        attributes[n].val.clusterDim.y = 1;
        attributes[n++].val.clusterDim.z = 1;
    }
    config.attrs = attributes;
    config.numAttrs = n;
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
