// Host-side launcher of one backward config and its registry entry. Plain CUDA (no torch):
// every generated backward .cu file includes only this header. Errors are returned.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "../common/launch_support.cuh"
#include "../registry.h"
#include "backward_kernel.cuh"

namespace flash::sm80 {

// Preprocess (D, zeroed dQ accumulator), the main kernel, then the dQ conversion. The caller
// (the binding) has checked every argument; dq_semaphore, when set, is zeroed.
template <class Cfg>
cudaError_t launch_bwd(const BwdParams& p, cudaStream_t stream) {
    using Elem = typename Cfg::Elem;
    if (p.d_pad != Cfg::kDHead)  // the kernel strides the dQ accumulator by its d_head
        return cudaErrorInvalidValue;
    const dim3 grid((p.seqlen_k + Cfg::kBc - 1) / Cfg::kBc, p.kv_heads, p.batch);
    // Deterministic with no mask where it is safe: the rotated order (bwd::rotation_of).
    BwdParams prm = p;
    if (cudaError_t err = bwd::rotation_of(p, (p.seqlen_q + Cfg::kBr - 1) / Cfg::kBr, int(grid.x),
                                           prm.dq_rotation);
        err != cudaSuccess)
        return err;
    return bwd::launch_passes<Elem, bwd::DqLayout::kRows>(prm, stream, [&] {
        return launch_checked<&bwd_kernel<Cfg>>(grid, Cfg::kThreads, Cfg::kSmemBytes, stream, prm);
    });
}

template <class Cfg>
constexpr BwdKernelEntry make_bwd_entry(const char* name) {
    return kernel_entry<Cfg>(name, &launch_bwd<Cfg>, /*arch=*/80);
}

}  // namespace flash::sm80
