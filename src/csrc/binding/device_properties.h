// Device properties for the checks and the routing of a call, read once per device (ATen's
// cached copy would pull in cuBLAS/cuSPARSE headers, which a minimal CUDA toolkit does not ship).
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <unordered_map>

#include "message.h"

namespace flash::binding {

inline const cudaDeviceProp& device_properties(int device) {
    static std::mutex mutex;
    static std::unordered_map<int, cudaDeviceProp> cache;
    const std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(device);
    if (it == cache.end()) {
        cudaDeviceProp prop{};
        const cudaError_t err = cudaGetDeviceProperties(&prop, device);
        FA_CHECK(err == cudaSuccess, "cudaGetDeviceProperties failed: ", cudaGetErrorString(err));
        it = cache.emplace(device, prop).first;
    }
    return it->second;
}

}  // namespace flash::binding
