// Host-side launcher of one decode config (the main kernel, then the combine when the keys are
// split) and its registry entry. Plain CUDA (no torch).
#pragma once

#include <cuda_runtime.h>

#include "../common/launch_support.cuh"
#include "../common/params.h"
#include "../registry.h"
#include "decode_combine.cuh"
#include "decode_config.cuh"
#include "decode_kernel.cuh"

namespace flash::sm80 {

template <class Cfg>
cudaError_t launch_dec(const DecParams& p, cudaStream_t stream) {
    const int row_blocks = (p.seqlen_q * p.heads_per_kv + Cfg::kBr - 1) / Cfg::kBr;
    const dim3 grid(row_blocks * p.num_splits, p.kv_heads, p.batch);
    if (cudaError_t err =
            launch_checked<&dec_kernel<Cfg>>(grid, Cfg::kThreads, Cfg::kSmemBytes, stream, p);
        err != cudaSuccess || p.num_splits == 1)
        return err;
    const dim3 combine_grid(static_cast<unsigned>(int64_t(p.heads) * p.rows_total));
    return launch_checked<&dec_combine_kernel<typename Cfg::Elem>>(combine_grid, kCombineThreads, 0,
                                                                   stream, p);
}

template <class Cfg>
constexpr DecKernelEntry make_dec_entry(const char* name) {
    return kernel_entry<Cfg>(name, &launch_dec<Cfg>, /*arch=*/80);
}

}  // namespace flash::sm80
