// FlashAttention backward on Hopper (the algorithm: backward_config.cuh): TMA copies into
// 128-byte-swizzled shared memory completing on mbarriers, a producer warp streaming the query
// blocks, two consumer warpgroups (setmaxnreg) computing the five GEMMs with wgmma, a writer
// warp adding each block's dQ to the fp32 accumulator with bulk reduce-adds (at d_head 256
// without the deterministic order the consumers add it themselves).
//
// This header is the kernel: it initialises the barriers and splits the CTA into its roles, from
//   backward_config.cuh    the tile shapes and the shared-memory layout
//   backward_tile.cuh      the kernel's argument, the shared memory, the CTA's work
//   backward_mainloop.cuh  the producer's loads, a consumer warpgroup's GEMMs
//   backward_dq_writer.cuh the writer warp: dQ to the fp32 accumulator
//   epilogue.cuh           dK and dV out through shared memory and TMA stores
// The preprocess and the dQ conversion around it are common/backward_common.cuh's.
#pragma once

#include "backward_config.cuh"
#include "backward_dq_writer.cuh"
#include "backward_mainloop.cuh"
#include "ptx.cuh"

namespace flash::sm90 {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    bwd_kernel(const __grid_constant__ BwdKernelParams prm) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char smem_raw[];
    const BwdSmem<Cfg> sm = BwdSmem<Cfg>::aligned(smem_raw);
    const BackwardTile<Cfg> w(prm);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        prefetch_tensor_map(&prm.tma_q);
        prefetch_tensor_map(&prm.tma_k);
        prefetch_tensor_map(&prm.tma_v);
        prefetch_tensor_map(&prm.tma_do);
        sm.init_barriers();
    }
    __syncthreads();  // the barriers are initialised and visible to the TMA unit

    if (warp >= Cfg::kConsumerWarps) {
        setmaxnreg_dec<Cfg::kProducerRegs>();
        if (warp == Cfg::kConsumerWarps && lane == 0)
            BackwardLoader<Cfg>{{0}, prm, sm}.run(w);
        else if (warp == Cfg::kConsumerWarps + 1)
            BackwardDqWriter<Cfg>{prm, sm, lane}.run(w);
    } else {
        setmaxnreg_inc<Cfg::kConsumerRegs>();
        BackwardConsumer<Cfg>{prm, sm, w, warp / 4, warp, lane}.run();
    }
#endif
}

}  // namespace flash::sm90
