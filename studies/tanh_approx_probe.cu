// The error of tanh.approx.f32 (MUFU.TANH, the forwards' softcap) and of tanh_fast (1 - 2 /
// (e^(2x) + 1) by ex2 and rcp, the backwards') against tanh in double precision, over every fp32
// value in [-limit, limit] (default 64; beyond it both are +-1): the largest relative and absolute
// errors and where they occur. A softcap c turns a tanh error e into c * e of a logit. Build and
// run on the GPU machine:
//   nvcc -O3 -arch=sm_90 -Isrc/csrc studies/tanh_approx_probe.cu -o /tmp/p && /tmp/p
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/numeric.cuh"

struct Worst {
    unsigned long long rel;  // the error's bits (non-negative doubles order as integers)
    unsigned long long abs;
    float at_rel, at_abs;
};

template <int kWhich>
__global__ void probe(uint32_t first, uint32_t count, Worst* worst) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count;
         i += gridDim.x * blockDim.x) {
        const float x = __uint_as_float(first + i);
        const float y = kWhich == 0 ? flash::tanh_mufu(x) : flash::tanh_fast(x);
        const double ref = tanh(static_cast<double>(x));
        const double abs_err = fabs(static_cast<double>(y) - ref);
        const double rel_err = ref != 0.0 ? abs_err / fabs(ref) : abs_err;
        const unsigned long long rb = __double_as_longlong(rel_err);
        const unsigned long long ab = __double_as_longlong(abs_err);
        if (rb > atomicMax(&worst->rel, rb))
            worst->at_rel = x;  // where: approximate under races
        if (ab > atomicMax(&worst->abs, ab))
            worst->at_abs = x;
    }
}

int main(int argc, char** argv) {
    const float limit = argc > 1 ? static_cast<float>(atof(argv[1])) : 64.f;
    uint32_t top;
    memcpy(&top, &limit, 4);
    const char* names[2] = {"tanh.approx.f32 (MUFU.TANH)", "tanh_fast (ex2 + rcp)"};
    for (int which = 0; which < 2; ++which) {
        Worst* w;
        cudaMallocManaged(&w, sizeof(Worst));
        Worst worst{};
        for (uint32_t sign : {0u, 0x80000000u}) {
            memset(w, 0, sizeof(Worst));
            // every positive (then negative) float from the smallest normal up to the limit
            const uint32_t first = sign | 0x00800000u, count = top - 0x00800000u + 1;
            if (which == 0)
                probe<0><<<4096, 256>>>(first, count, w);
            else
                probe<1><<<4096, 256>>>(first, count, w);
            if (cudaDeviceSynchronize() != cudaSuccess) {
                printf("CUDA error\n");
                return 1;
            }
            if (w->rel > worst.rel)
                worst.rel = w->rel, worst.at_rel = w->at_rel;
            if (w->abs > worst.abs)
                worst.abs = w->abs, worst.at_abs = w->at_abs;
        }
        double rel, abs;
        memcpy(&rel, &worst.rel, 8);
        memcpy(&abs, &worst.abs, 8);
        printf(
            "%-30s |x| <= %g: max relative error %.3e (x = %.6g), max absolute %.3e (x = %.6g)\n",
            names[which], limit, rel, worst.at_rel, abs, worst.at_abs);
        cudaFree(w);
    }
    return 0;
}
