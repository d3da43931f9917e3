// Host-side launcher of one backward config and its registry entry. Plain CUDA (no torch):
// every generated backward .cu file includes only this header. Errors are returned.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "../backward_registry.h"
#include "../common/launch_support.cuh"
#include "backward_kernel.cuh"

namespace flash {

// Preprocess (D, zeroed dQ accumulator), the main kernel, then the dQ conversion. The caller
// (the binding) has checked every argument; dq_semaphore, when set, is zeroed.
template <class Cfg>
cudaError_t launch_bwd(const BwdParams& p, cudaStream_t stream) {
    using Elem = typename Cfg::Elem;
    if (p.d_pad != Cfg::kDHead)  // the kernel strides the dQ accumulator by its d_head
        return cudaErrorInvalidValue;
    // The preprocess and the conversion work per query row: a varlen batch is one sequence of
    // total_q rows to them.
    BwdParams rows = p;
    if (p.cu_seqlens_q != nullptr) {
        rows.batch = 1;
        rows.seqlen_q = p.total_q;
    }
    const dim3 pre_grid((rows.seqlen_q_pad + 3) / 4, rows.heads, rows.batch);
    if (cudaError_t err =
            launch_checked<&bwd::bwd_preprocess_kernel<Elem>>(pre_grid, 128, 0, stream, rows);
        err != cudaSuccess)
        return err;

    const dim3 grid((p.seqlen_k + Cfg::kBc - 1) / Cfg::kBc, p.kv_heads, p.batch);
    if (cudaError_t err =
            launch_checked<&bwd::bwd_kernel<Cfg>>(grid, Cfg::kThreads, Cfg::kSmemBytes, stream, p);
        err != cudaSuccess)
        return err;

    const int64_t chunks = int64_t(rows.seqlen_q) * (p.d_head / 8);
    const dim3 cvt_grid(static_cast<unsigned>((chunks + 255) / 256), rows.heads, rows.batch);
    return launch_checked<&bwd::bwd_convert_dq_kernel<Elem>>(cvt_grid, 256, 0, stream, rows);
}

template <class Cfg>
constexpr BwdKernelEntry make_bwd_entry(const char* name) {
    return BwdKernelEntry{name,
                          std::is_same_v<typename Cfg::Elem, __half> ? DType::kFp16 : DType::kBf16,
                          Cfg::kDHead,
                          Cfg::kBc,
                          Cfg::kBr,
                          Cfg::kThreads,
                          Cfg::kSmemBytes,
                          Cfg::kSoftcap,
                          &launch_bwd<Cfg>};
}

}  // namespace flash
