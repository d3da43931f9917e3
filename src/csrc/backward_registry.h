// What the backward operator knows about a built backward kernel: its name (the config's short
// form), the facts it validates a call against, and the launcher (preprocess, main kernel, dQ
// conversion on one stream). Plain C++; the table is generated (backward/registry.cu) from the
// build's backward config set.
#pragma once

#include <cuda_runtime.h>

#include "common/bwd_params.h"
#include "registry.h"

namespace flash {

using BwdLaunchFn = cudaError_t (*)(const BwdParams&, cudaStream_t);

struct BwdKernelEntry {
    const char* name;  // config short form, e.g. bwd_bf16_d128_c128_r64_w8_fb
    DType dtype;
    int d_head;   // the variant: serves every multiple of 8 up to it
    int block_c;  // B_c: keys per CTA
    int block_r;  // B_r: query rows per iteration (BwdParams::seqlen_q_pad is a multiple)
    int threads;
    int smem_bytes;
    bool softcap;  // applies BwdParams::softcap_scale (serves only softcap > 0)
    // 80: the sm80 family (any GPU, every call); 90: sm_90a, fixed-length calls
    // whose tensors TMA can address (the binding falls back to the sm80 family for the rest).
    int arch;
    BwdLaunchFn launch;
};

// Defined in the generated backward registry: every backward kernel of this build.
const BwdKernelEntry* const* bwd_kernel_registry(int* count);

}  // namespace flash
