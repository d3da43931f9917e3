// What the binding knows about a built kernel of any kind: its name, the shape facts it needs to
// choose and validate a call, and the launcher. One entry shape for every kind; a registry per
// direction (the launch takes that direction's parameters). Plain C++; the tables are generated
// (generated/registry.cu) from the build's selection, so no list is kept by hand.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"

namespace flash {

// Of q, k and v (kE4m3: torch.float8_e4m3fn, the Hopper forward's FP8 kernels, output bf16;
// kE4m3 and kE5m2 (torch.float8_e5m2) are also the decode kernels' FP8 KV caches).
enum class DType : int { kFp16 = 0, kBf16 = 1, kE4m3 = 2, kE5m2 = 3 };

template <class Params>
struct KernelEntry {
    const char* name;  // the kernel's name, e.g. fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor
    DType dtype;
    DType cache_dtype;  // of k and v: dtype, or an FP8 type (decode kernels over an FP8 cache)
    int d_head;         // the variant: serves every multiple of 8 up to it
    int block_r;        // B_r: query rows per tile (the backward's dQ accumulator pads to it)
    int block_c;        // B_c: key rows per tile
    int threads;
    int smem_bytes;
    // Serves causal / sliding-window masks (window_left/right of the parameters): the forward
    // kernels with flag m; every backward kernel (masks are run-time arguments there).
    bool mask;
    bool softcap;  // applies softcap_scale (and serves only softcap > 0)
    // 80: an sm80-family kernel (runs on sm_80 and newer); 90: an sm_90a kernel (Hopper only;
    // fixed-length calls whose tensors TMA can address, see tma_fit.h in the binding).
    int arch;
    // The kernel needs its parameters' tile_counter: the binding allocates one int per call.
    bool tile_counter;
    // Runs varlen calls only (a Hopper forward with flag j: its TMA maps span the packed rows);
    // every other forward kernel of the sm80 family runs both, a Hopper one fixed-length ones.
    bool varlen_only;
    cudaError_t (*launch)(const Params&, cudaStream_t);
};

using FwdKernelEntry = KernelEntry<FwdParams>;
using BwdKernelEntry = KernelEntry<BwdParams>;
using DecKernelEntry = KernelEntry<DecParams>;

// Defined in the generated registry.cu: every kernel of this build, in selection order.
const FwdKernelEntry* const* fwd_kernel_registry(int* count);
const BwdKernelEntry* const* bwd_kernel_registry(int* count);
const DecKernelEntry* const* dec_kernel_registry(int* count);

}  // namespace flash
