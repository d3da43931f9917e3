// What the binding knows about a built kernel: the name (its config short form), the shape facts
// it needs to validate a call, and the launcher. Plain C++; the table of entries is generated
// (registry.cu) from the build's config set, so this list is never kept by hand.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"

namespace flash {

using LaunchFn = cudaError_t (*)(const FwdParams&, cudaStream_t);

enum class DType : int { kFp16 = 0, kBf16 = 1 };

struct KernelEntry {
    const char* name;  // config short form, e.g. bf16_d128_r128_c64_w4_fseqkvbor
    DType dtype;
    int d_head;
    int block_m;  // B_r
    int block_n;  // B_c
    int threads;
    int smem_bytes;
    bool mask;     // serves causal / sliding-window masks (window_left/right of FwdParams)
    bool softcap;  // applies FwdParams::softcap_scale (and serves only softcap > 0)
    LaunchFn launch;
    // 80: an sm_80-family kernel (runs on sm_80 and newer); 90: an sm_90a kernel (Hopper only;
    // TMA-compatible fixed-length calls, see tma_compatible in the binding).
    int arch;
    // The kernel needs FwdParams::tile_counter: the binding allocates one int per call.
    bool tile_counter;
};

// Defined in the generated registry.cu: every kernel of this build, in config-set order.
const KernelEntry* const* kernel_registry(int* count);

}  // namespace flash
