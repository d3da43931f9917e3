// Host-side launcher of one Hopper config: the TMA tensor maps of Q, K, V and O (encoded per call
// through the driver's cuTensorMapEncodeTiled, found at run time so that nothing links libcuda),
// the shared-memory opt-in and the launch. The binding calls it only for calls that
// tma_compatible() accepts; errors are returned, never swallowed.
#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>

#include <cuda.h>
#include <cuda_runtime.h>

#include "../common/launch_support.cuh"
#include "../registry.h"
#include "config.cuh"
#include "forward_kernel.cuh"

namespace flash::sm90 {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn encode_tiled() {
    static const EncodeTiledFn fn = [] {
        void* ptr = nullptr;
        cudaDriverEntryPointQueryResult status{};
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                             cudaEnableDefault, &status) != cudaSuccess ||
            status != cudaDriverEntryPointSuccess)
            return EncodeTiledFn{nullptr};
        return reinterpret_cast<EncodeTiledFn>(ptr);
    }();
    return fn;
}

// A 4-D map (d_head, rows, heads, batch) over a BSHD tensor; strides in elements. A dimension of
// size 1 is never stepped over: its stride is replaced by one the driver accepts.
template <typename Elem>
inline bool encode_bshd(CUtensorMap* map, const void* base, int d_head, int rows, int heads,
                        int batch, int64_t row_stride, int64_t head_stride, int64_t batch_stride,
                        int box_rows) {
    const EncodeTiledFn fn = encode_tiled();
    if (fn == nullptr)
        return false;
    const int64_t bytes_row = row_stride * 2;
    const cuuint64_t dims[4] = {cuuint64_t(d_head), cuuint64_t(rows), cuuint64_t(heads),
                                cuuint64_t(batch)};
    const cuuint64_t strides[3] = {
        cuuint64_t(rows > 1 ? bytes_row : 16),
        cuuint64_t(heads > 1 ? head_stride * 2 : 16),
        cuuint64_t(batch > 1 ? batch_stride * 2 : 16),
    };
    const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
    const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
    const CUtensorMapDataType type = std::is_same_v<Elem, __half>
                                         ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                         : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    return fn(map, type, 4, const_cast<void*>(base), dims, strides, box, elem_strides,
              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
              CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <class Cfg>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream) {
    using Elem = typename Cfg::Elem;
    if (p.cu_seqlens_q != nullptr)
        return cudaErrorInvalidValue;  // varlen runs on the sm_80 kernels
    Sm90Params prm{};
    prm.p = p;
    const int kv_heads = p.heads / p.heads_per_kv;
    const bool ok =
        encode_bshd<Elem>(&prm.tma_q, p.q, p.d_head, p.seqlen_q, p.heads, p.batch, p.q_row_stride,
                          p.q_head_stride, p.q_batch_stride, Cfg::kBr) &&
        encode_bshd<Elem>(&prm.tma_k, p.k, p.d_head, p.seqlen_k, kv_heads, p.batch, p.k_row_stride,
                          p.k_head_stride, p.k_batch_stride, Cfg::kBc / Cfg::kClusterCtas) &&
        encode_bshd<Elem>(&prm.tma_v, p.v, p.d_head, p.seqlen_k, kv_heads, p.batch, p.v_row_stride,
                          p.v_head_stride, p.v_batch_stride, Cfg::kBc / Cfg::kClusterCtas) &&
        encode_bshd<Elem>(&prm.tma_o, p.o, p.d_head, p.seqlen_q, p.heads, p.batch, p.o_row_stride,
                          p.o_head_stride, p.o_batch_stride, 64);
    if (!ok)
        return cudaErrorInvalidValue;

    auto* kernel = &fwd_sm90_kernel<Cfg>;
    if (cudaError_t err = opt_in_smem<&fwd_sm90_kernel<Cfg>>(Cfg::kSmemBytes); err != cudaSuccess)
        return err;
    constexpr int kCtas = Cfg::kClusterCtas;
    const int q_tiles = ForwardTile<Cfg>::tiles_per_head(p);  // pairs with kCluster
    prm.tiles_per_head = FastDiv(q_tiles);
    prm.heads = FastDiv(p.heads);
    prm.heads_per_kv = FastDiv(p.heads_per_kv);
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = kCtas;
    cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(q_tiles * kCtas, p.heads, p.batch);
    config.blockDim = dim3(Cfg::kThreads, 1, 1);
    config.dynamicSmemBytes = Cfg::kSmemBytes;
    config.stream = stream;
    config.attrs = &cluster;
    config.numAttrs = 1;
    if constexpr (Cfg::kPersistent) {  // one CTA per SM (cluster per SM pair), looping over tiles
        // How many CTAs (clusters) run at once: the SMs, or the clusters the GPCs can hold.
        int device = 0;
        if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess)
            return err;
        static std::atomic<int> resident[64] = {};
        int count = device < 64 ? resident[device].load(std::memory_order_relaxed) : 0;
        if (count == 0) {
            cudaError_t err;
            if constexpr (Cfg::kCluster) {
                cudaLaunchConfig_t probe = config;
                probe.gridDim = dim3(kCtas, 1, 1);
                err = cudaOccupancyMaxActiveClusters(&count, kernel, &probe);
            } else {
                err = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
            }
            if (err != cudaSuccess)
                return err;
            if (count < 1)
                return cudaErrorInvalidConfiguration;
            if (device < 64)
                resident[device].store(count, std::memory_order_relaxed);
        }
        const int64_t tiles = int64_t(q_tiles) * p.heads * p.batch;
        config.gridDim = dim3(static_cast<unsigned>((tiles < count ? tiles : count) * kCtas), 1, 1);
    }
    if constexpr (Cfg::kDynamic) {
        if (p.tile_counter == nullptr)
            return cudaErrorInvalidValue;
        // Groups of (batch, head) pairs whose K and V take at most 16 MB, a third of an H100's
        // L2, so that the tiles running at once share them.
        const int64_t kv_bytes = int64_t(p.seqlen_k) * p.d_head * 2 * 2;
        const int64_t kv_heads_per_group = kv_bytes > 0 ? (int64_t(16) << 20) / kv_bytes : 1;
        const int64_t pairs = int64_t(p.batch) * p.heads;
        const int64_t per_group =
            (kv_heads_per_group > 1 ? kv_heads_per_group : 1) * p.heads_per_kv;
        prm.sched_heads = static_cast<int>(per_group < pairs ? per_group : pairs);
        if (cudaError_t err = cudaMemsetAsync(p.tile_counter, 0, sizeof(int), stream);
            err != cudaSuccess)
            return err;
    }
    if constexpr (Cfg::kCluster) {
        if (cudaError_t err = cudaLaunchKernelEx(&config, kernel, prm); err != cudaSuccess)
            return err;
    } else {
        kernel<<<config.gridDim, config.blockDim, config.dynamicSmemBytes, stream>>>(prm);
    }
    return cudaGetLastError();
}

template <class Cfg>
constexpr KernelEntry make_entry(const char* name) {
    return kernel_entry<Cfg>(name, &launch_fwd<Cfg>, /*arch=*/90, /*tile_counter=*/Cfg::kDynamic);
}

}  // namespace flash::sm90
