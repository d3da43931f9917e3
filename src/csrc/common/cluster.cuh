// Thread block clusters (sm_90 and newer): a CTA's rank in its cluster, the cluster-wide
// barrier, and loads from another CTA's shared memory (distributed shared memory). The PTX needs
// sm_90: callers compile these only for it (__CUDA_ARCH__ >= 900). Plain CUDA (no torch).
#pragma once

#include <cstdint>

namespace flash {

__device__ __forceinline__ uint32_t cluster_ctarank() {
    uint32_t rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    return rank;
}

// Every thread of every CTA of the cluster arrives and waits: this CTA's shared memory
// (barriers included) stays valid, and what was written before is visible, across the cluster.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// Shared-memory address `addr` (this CTA's window) as the same offset in CTA `rank`'s.
__device__ __forceinline__ uint32_t cluster_map(uint32_t addr, uint32_t rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
    return remote;
}

// A float / four floats at a cluster_map address.
__device__ __forceinline__ float ld_cluster_f32(uint32_t remote) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
    return v;
}
__device__ __forceinline__ float4 ld_cluster_f32x4(uint32_t remote) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(remote)
                 : "memory");
    return v;
}

}  // namespace flash
