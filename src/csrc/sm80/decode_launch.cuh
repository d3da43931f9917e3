// Host-side launcher of one decode config (the main kernel, then the combine when the keys are
// split) and its registry entry. Plain CUDA (no torch). On sm_90 both are programmatic
// dependents of the kernel before them (launch_dependent): each starts while the previous one
// finishes and waits for its end on the GPU, so a short decode step does not pay two launch
// latencies in a row (H200, one sequence, 4096-8192 keys: 0.5-0.6 us of 14-18 us a step).
#pragma once

#include <cuda_runtime.h>

#include "../common/launch_support.cuh"
#include "../common/params.h"
#include "../common/programmatic_launch.cuh"
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
            launch_dependent<&dec_kernel<Cfg>>(grid, Cfg::kThreads, Cfg::kSmemBytes, stream, p);
        err != cudaSuccess || p.num_splits == 1)
        return err;
    const dim3 combine_grid(static_cast<unsigned>(int64_t(p.heads) * p.rows_total));
    return launch_dependent<&dec_combine_kernel<typename Cfg::Elem>>(combine_grid, kCombineThreads,
                                                                     0, stream, p);
}

template <class Cfg>
constexpr DecKernelEntry make_dec_entry(const char* name) {
    return kernel_entry<Cfg>(name, &launch_dec<Cfg>, /*arch=*/80);
}

}  // namespace flash::sm80
