// Throughput of the softmax's per-score functions on one SM, in results per clock and SM: MUFU's
// ex2, tanh and rcp, common/numeric.cuh's FMA-pipe exp2, a tanh by ex2 and Newton steps (here),
// a softcap score's whole chain (scale, tanh, softmax FFMA, exp2, row sum) with each tanh and the
// two mixed, to tell whether the softcap forward is bound by MUFU.TANH's rate; and the 16-bit and
// FP8 packs of P (F2FP) alone and beside ex2, to tell whether they take MUFU's pipe. 32 warps per
// SM, eight independent chains per thread; cycles from clock64 around the loop of one block per SM.
// Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90 -Isrc/csrc studies/mufu_rate_probe.cu -o /tmp/r && /tmp/r
#include <cstdio>

#include "common/numeric.cuh"

constexpr int kChains = 8, kIters = 4096, kThreads = 1024;

// Two fp32 values -> bf16x2 by integer round-to-nearest-even (IADD3s and a PRMT, no F2FP).
__device__ __forceinline__ uint32_t pack2_bf16_int(float lo, float hi) {
    const uint32_t a = __float_as_uint(lo), b = __float_as_uint(hi);
    const uint32_t ra = a + 0x7FFFu + ((a >> 16) & 1u), rb = b + 0x7FFFu + ((b >> 16) & 1u);
    return __byte_perm(ra, rb, 0x7632);
}

// tanh(x) = 1 - 2 / (e^(2x) + 1) with the ex2 on MUFU and the reciprocal on the FMA pipe (an
// integer first guess within 5%, three Newton steps; absolute error 1.9e-7 on an H200): a
// candidate to move half of a softcap's MUFU.TANH time to the FMA pipe. x is clamped at 9 (e^18 + 1
// stays finite; tanh(9) rounds to 1); -inf gives -1, NaN stays NaN (min.NaN).
__device__ __forceinline__ float tanh_ex2_newton(float x) {
    asm("min.NaN.f32 %0, %0, 0f41100000;" : "+f"(x));                 // 9
    const float d = flash::fast_exp2(x * 2.8853900817779268f) + 1.f;  // 2 log2(e)
    float r = __int_as_float(0x7EF311C3 - __float_as_int(d));
#pragma unroll
    for (int k = 0; k < 3; ++k)
        r = fmaf(r, fmaf(-d, r, 1.f), r);
    return fmaf(-2.f, r, 1.f);
}

template <int kOp>
__device__ __forceinline__ float step(float v, int chain) {
    using namespace flash;
    switch (kOp) {
        case 0:  // ex2 (+ an FADD that keeps the value bounded)
            return fast_exp2(v) - 1.5f;
        case 1:  // tanh.approx (MUFU.TANH) (+ FMUL)
            return tanh_mufu(v) * 1.5f;
        case 2:  // rcp.approx (+ FADD)
            return fast_rcp(v) + 1.f;
        case 3:  // tanh by ex2 + Newton reciprocal (+ FMUL)
            return tanh_ex2_newton(v) * 1.5f;
        case 4:  // exp2_fma<3> (+ FADD)
            return exp2_fma<3>(v) - 1.5f;
        case 5:  // a plain score: softmax FFMA, ex2, row sum (the sum folded back in)
            return fast_exp2(fmaf(v, 0.9f, -1.f)) + v * 0.25f;
        case 6:  // a softcap score with MUFU.TANH
            return fast_exp2(fmaf(tanh_mufu(v * 0.7f), 0.9f, -1.f)) + v * 0.25f;
        case 7:  // a softcap score with tanh_ex2_newton
            return fast_exp2(fmaf(tanh_ex2_newton(v * 0.7f), 0.9f, -1.f)) + v * 0.25f;
        case 8:  // softcap scores, a quarter of the chains by tanh_ex2_newton
            return fast_exp2(fmaf(chain < 2 ? tanh_ex2_newton(v * 0.7f) : tanh_mufu(v * 0.7f), 0.9f,
                                  -1.f)) +
                   v * 0.25f;
        case 9:  // softcap scores, half of the chains by tanh_ex2_newton
            return fast_exp2(fmaf(chain < 4 ? tanh_ex2_newton(v * 0.7f) : tanh_mufu(v * 0.7f), 0.9f,
                                  -1.f)) +
                   v * 0.25f;
        case 10:  // cvt.rn.bf16x2.f32 (F2FP.BF16.F32.PACK_AB) + FMUL
            return __uint_as_float(pack2<__nv_bfloat16>(v * 0.999f, v));
        case 11:  // ex2 + FADD + one bf16x2 pack of its result: do MUFU and F2FP share a pipe?
            return __uint_as_float(pack2<__nv_bfloat16>(fast_exp2(v) - 1.5f, v));
        case 12:  // the same pack by integer rounding (ALU): round-to-nearest-even bits, PRMT
            return __uint_as_float(pack2_bf16_int(fast_exp2(v) - 1.5f, v));
        case 13:  // cvt.rn.satfinite.e4m3x2.f32 + FFMA (FP8's P)
            return fmaf(v, 0.999f,
                        __uint_as_float(__nv_cvt_float2_to_fp8x2(make_float2(v, v), __NV_SATFINITE,
                                                                 __NV_E4M3)));
        default:  // FFMA alone (the FMA pipe's rate, for scale)
            return fmaf(v, 0.999f, 0.001f);
    }
}

template <int kOp>
__global__ void __launch_bounds__(kThreads) rate(float* sink, long long* cycles) {
    float v[kChains];
#pragma unroll
    for (int c = 0; c < kChains; ++c)
        v[c] = 0.1f * (threadIdx.x % 7) + 0.01f * c;
    __syncthreads();
    const long long t0 = clock64();
    for (int i = 0; i < kIters; ++i)
#pragma unroll
        for (int c = 0; c < kChains; ++c)
            v[c] = step<kOp>(v[c], c);
    __syncthreads();
    const long long t1 = clock64();
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < kChains; ++c)
        s += v[c];
    if (s == 12345.f)
        sink[threadIdx.x] = s;  // never: keeps the loop alive
    if (threadIdx.x == 0)
        cycles[blockIdx.x] = t1 - t0;
}

template <int kOp>
void run(const char* name, int sms, float* sink, long long* cycles) {
    rate<kOp><<<sms, kThreads>>>(sink, cycles);  // warm-up
    rate<kOp><<<sms, kThreads>>>(sink, cycles);
    cudaDeviceSynchronize();
    long long worst = 0;
    for (int b = 0; b < sms; ++b)
        worst = cycles[b] > worst ? cycles[b] : worst;
    const double per_clock = double(kThreads) * kChains * kIters / double(worst);
    printf("%-58s %7.2f results / clock / SM\n", name, per_clock);
}

int main() {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    float* sink;
    long long* cycles;
    cudaMalloc(&sink, kThreads * sizeof(float));
    cudaMallocManaged(&cycles, sms * sizeof(long long));
    run<0>("ex2.approx (MUFU.EX2) + FADD", sms, sink, cycles);
    run<1>("tanh.approx (MUFU.TANH) + FMUL", sms, sink, cycles);
    run<2>("rcp.approx (MUFU.RCP) + FADD", sms, sink, cycles);
    run<3>("tanh_ex2_newton (MUFU.EX2 + 9 FMA-pipe) + FMUL", sms, sink, cycles);
    run<4>("exp2_fma<3> (FMA pipe) + FADD", sms, sink, cycles);
    run<5>("plain score: FFMA, ex2, sum", sms, sink, cycles);
    run<6>("softcap score, MUFU.TANH", sms, sink, cycles);
    run<7>("softcap score, tanh_ex2_newton", sms, sink, cycles);
    run<8>("softcap score, a quarter by tanh_ex2_newton", sms, sink, cycles);
    run<9>("softcap score, half by tanh_ex2_newton", sms, sink, cycles);
    run<10>("cvt.rn.bf16x2.f32 (F2FP) + FMUL", sms, sink, cycles);
    run<11>("ex2 + FADD + F2FP (one pack per ex2)", sms, sink, cycles);
    run<12>("ex2 + FADD + integer bf16x2 pack", sms, sink, cycles);
    run<13>("cvt e4m3x2 + FFMA", sms, sink, cycles);
    run<14>("FFMA", sms, sink, cycles);
    if (cudaGetLastError() != cudaSuccess) {
        printf("CUDA error\n");
        return 1;
    }
    return 0;
}
