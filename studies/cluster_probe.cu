// What thread block clusters give a decode kernel on this GPU: for each cluster size (2-16, 16
// non-portable) and a decode CTA's shape (threads, dynamic shared memory), how many clusters
// can be resident at once (cudaOccupancyMaxActiveClusters), and where the CTAs of a one-wave
// launch land: SMs touched and CTAs per SM (each CTA records %smid), so we know whether a
// cluster of CTAs that could share an SM is spread over the GPC or packed.
//
//   nvcc -O2 -gencode=arch=compute_90,code=sm_90 -o /tmp/cluster_probe studies/cluster_probe.cu
//   /tmp/cluster_probe [clusters_to_launch=8]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                            \
    do {                                                                                    \
        cudaError_t e_ = (x);                                                               \
        if (e_ != cudaSuccess) {                                                            \
            std::printf("error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
            std::exit(1);                                                                   \
        }                                                                                   \
    } while (0)

__global__ void probe_kernel(int* smid_of_cta, int spin) {
    extern __shared__ unsigned char smem[];
    if (threadIdx.x == 0) {
        unsigned id;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
        smid_of_cta[blockIdx.x] = static_cast<int>(id);
        smem[0] = 1;
    }
    // Stay resident a while, so the whole launch is on the GPU at once.
    long long t0 = clock64();
    while (clock64() - t0 < spin) {
    }
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// A stand-in for a decode CTA's life: `spin` cycles of work, then (barriers) the two cluster
// barriers of the decode kernel's merge.
__global__ void timed_kernel(int spin, int barriers) {
    extern __shared__ unsigned char smem[];
    if (threadIdx.x == 0)
        smem[0] = 1;
    long long t0 = clock64();
    while (clock64() - t0 < spin) {
    }
    if (barriers) {
        asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::
                         : "memory");
        asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::
                         : "memory");
    }
}

// A launch of `ctas` CTAs of `threads` threads and `smem` bytes, in clusters of `cluster` along
// x (1: no cluster attribute); `attr` holds the attribute the config points at.
cudaLaunchConfig_t launch_config(int ctas, int threads, int smem, int cluster,
                                 cudaLaunchAttribute& attr) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(ctas);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    attr = cudaLaunchAttribute{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = cluster > 1 ? 1 : 0;
    return cfg;
}

// Microseconds per launch of `ctas` CTAs in clusters of `cluster` (1: none), 200 launches queued
// back to back between two events.
float time_launches(int ctas, int threads, int smem, int cluster, int spin, int barriers) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = launch_config(ctas, threads, smem, cluster, attr);
    for (int i = 0; i < 20; ++i)
        CHECK(cudaLaunchKernelEx(&cfg, timed_kernel, spin, barriers));
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < 200; ++i)
        CHECK(cudaLaunchKernelEx(&cfg, timed_kernel, spin, barriers));
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms * 1000.f / 200.f;
}

int main(int argc, char** argv) {
    const int launch_clusters = argc > 1 ? std::atoi(argv[1]) : 8;
    cudaDeviceProp prop{};
    CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("# %s, %d SMs, %zu B shared memory per SM, %zu per block (opt-in)\n", prop.name,
                prop.multiProcessorCount, prop.sharedMemPerMultiprocessor,
                prop.sharedMemPerBlockOptin);
    CHECK(cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    CHECK(cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(prop.sharedMemPerBlockOptin)));
    int* d_smid = nullptr;
    CHECK(cudaMalloc(&d_smid, 4096 * sizeof(int)));
    struct Shape {
        int threads, smem;
        const char* what;
    };
    const Shape shapes[] = {{128, 100 * 1024, "w4 d128 (2 CTAs/SM by smem)"},
                            {256, 196 * 1024, "w8 d128 (1 CTA/SM by smem)"},
                            {128, 52 * 1024, "w4 c16 small (4 CTAs/SM)"}};
    std::printf(
        "| CTA | cluster | max active clusters | CTAs | launched | SMs touched | most CTAs "
        "on one SM |\n| --- | --- | --- | --- | --- | --- | --- |\n");
    for (const Shape& s : shapes) {
        for (int c : {2, 4, 8, 16}) {
            cudaLaunchAttribute attr;
            const cudaLaunchConfig_t cfg =
                launch_config(c * launch_clusters, s.threads, s.smem, c, attr);
            int active = -1;
            cudaError_t e = cudaOccupancyMaxActiveClusters(&active, probe_kernel, &cfg);
            if (e != cudaSuccess) {
                std::printf("| %s | %d | error %s | | | | |\n", s.what, c, cudaGetErrorString(e));
                cudaGetLastError();
                continue;
            }
            const int n = c * launch_clusters;
            CHECK(cudaMemset(d_smid, 0xff, n * sizeof(int)));
            e = cudaLaunchKernelEx(&cfg, probe_kernel, d_smid, 200000);
            if (e == cudaSuccess)
                e = cudaDeviceSynchronize();
            if (e != cudaSuccess) {
                std::printf("| %s | %d | %d | %d | error %s | | |\n", s.what, c, active, n,
                            cudaGetErrorString(e));
                cudaGetLastError();
                continue;
            }
            std::vector<int> smid(n);
            CHECK(cudaMemcpy(smid.data(), d_smid, n * sizeof(int), cudaMemcpyDeviceToHost));
            std::vector<int> per_sm(prop.multiProcessorCount + 64, 0);
            int touched = 0, most = 0;
            for (int id : smid) {
                if (id < 0 || id >= int(per_sm.size()))
                    continue;
                if (per_sm[id]++ == 0)
                    ++touched;
                most = per_sm[id] > most ? per_sm[id] : most;
            }
            std::printf("| %s | %d | %d | %d | %d clusters | %d | %d |\n", s.what, c, active, n,
                        launch_clusters, touched, most);
        }
    }
    CHECK(cudaFree(d_smid));

    CHECK(cudaFuncSetAttribute(timed_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    CHECK(cudaFuncSetAttribute(timed_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(prop.sharedMemPerBlockOptin)));
    std::printf(
        "\n# us per launch of 128 or 256 CTAs of 128 threads, 100 KB smem, spinning 2000 "
        "or 8000 cycles; 200 launches back to back\n");
    std::printf(
        "| CTAs | spin | cluster | no barrier | two cluster barriers |\n"
        "| --- | --- | --- | --- | --- |\n");
    for (int ctas : {128, 256})
        for (int spin : {2000, 8000})
            for (int c : {1, 2, 4, 8, 16}) {
                const float plain = time_launches(ctas, 128, 100 * 1024, c, spin, 0);
                const float bar = c > 1 ? time_launches(ctas, 128, 100 * 1024, c, spin, 1) : 0.f;
                std::printf("| %d | %d | %d | %.2f | %.2f |\n", ctas, spin, c, plain, bar);
            }
    return 0;
}
