// Host-side launcher of one Hopper config: the TMA tensor maps of Q, K, V and O (encoded per call,
// tensor_map.h), the shared-memory opt-in and the launch. The binding calls it only for calls that
// sm90_unfit() (binding/tma_fit.h) accepts; errors are returned, never swallowed.
#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>

#include <cuda.h>
#include <cuda_runtime.h>

#include "../common/launch_support.cuh"
#include "../registry.h"
#include "forward_config.cuh"
#include "forward_kernel.cuh"
#include "tensor_map.h"

namespace flash::sm90 {

template <class Cfg>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream) {
    using Elem = typename Cfg::Elem;
    if ((p.cu_seqlens_q != nullptr) != Cfg::kVarlen)
        return cudaErrorInvalidValue;  // a kVarlen kernel runs varlen calls, the others none
    FwdKernelParams prm{};
    prm.p = p;
    const int kv_heads = p.heads / p.heads_per_kv;
    // Varlen: one batch of every packed row (a tile adds its sequence's first row).
    const int rows_q = Cfg::kVarlen ? p.total_q : p.seqlen_q;
    const int rows_k = Cfg::kVarlen ? p.total_k : p.seqlen_k;
    const int batch = Cfg::kVarlen ? 1 : p.batch;
    const bool ok =
        encode_bshd<Elem>(&prm.tma_q, p.q, p.d_head, rows_q, p.heads, batch, p.q_row_stride,
                          p.q_head_stride, p.q_batch_stride, Cfg::kBr) &&
        encode_bshd<Elem>(&prm.tma_k, p.k, p.d_head, rows_k, kv_heads, batch, p.k_row_stride,
                          p.k_head_stride, p.k_batch_stride, Cfg::kBc / Cfg::kClusterCtas) &&
        encode_bshd<Elem>(&prm.tma_v, p.v, p.d_head, rows_k, kv_heads, batch, p.v_row_stride,
                          p.v_head_stride, p.v_batch_stride, Cfg::kBc / Cfg::kClusterCtas) &&
        encode_bshd<typename Cfg::OutElem>(&prm.tma_o, p.o, p.d_head, rows_q, p.heads, batch,
                                           p.o_row_stride, p.o_head_stride, p.o_batch_stride, 64);
    if (!ok)
        return cudaErrorInvalidValue;

    auto* kernel = &fwd_kernel<Cfg>;
    if (cudaError_t err = opt_in_smem<&fwd_kernel<Cfg>>(Cfg::kSmemBytes); err != cudaSuccess)
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
                err = multiprocessor_count(count);
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
constexpr FwdKernelEntry make_fwd_entry(const char* name) {
    return kernel_entry<Cfg>(name, &launch_fwd<Cfg>, /*arch=*/90, /*tile_counter=*/Cfg::kDynamic,
                             /*varlen_only=*/Cfg::kVarlen);
}

}  // namespace flash::sm90
