// Numeric helpers both kernel families use: the shared-memory address of a pointer, packing
// fp32 pairs into 16-bit pairs (and quads into FP8), and fast exp2 (on MUFU or the FMA pipe) /
// reciprocal / log2 / tanh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

namespace flash {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Two fp32 values -> one 32-bit register of two 16-bit values, `lo` in the low half.
template <typename Elem>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}

// Four fp32 values -> one 32-bit register of four e4m3 bytes, a in the lowest (round to nearest,
// saturated to +-448: cvt.rn.satfinite.e4m3x2.f32).
__device__ __forceinline__ uint32_t pack4_e4m3(float a, float b, float c, float d) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
    return lo | (hi << 16);
}

// fp32 accumulators of n8 tiles (the mma.sync m16n8 / wgmma layout of a warp's 16 rows) ->
// 16-bit A fragments of the next GEMM, whose k16 step kk is n8 tiles 2 kk and 2 kk + 1. The
// four registers of a step are also the stmatrix.x4 fragments of those two tiles.
template <typename Elem, int kSteps>
__device__ __forceinline__ void to_a_fragments(const float (&x)[2 * kSteps][4],
                                               uint32_t (&f)[kSteps][4]) {
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
        f[kk][0] = pack2<Elem>(x[2 * kk][0], x[2 * kk][1]);
        f[kk][1] = pack2<Elem>(x[2 * kk][2], x[2 * kk][3]);
        f[kk][2] = pack2<Elem>(x[2 * kk + 1][0], x[2 * kk + 1][1]);
        f[kk][3] = pack2<Elem>(x[2 * kk + 1][2], x[2 * kk + 1][3]);
    }
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// 1/x, relative error under 2^-22; 1/inf = 0.
__device__ __forceinline__ float fast_rcp(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// log2(x), absolute error about 2^-22 (lg2.approx; x > 0 here: a row sum of at least 1).
__device__ __forceinline__ float fast_log2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// 2^x without the MUFU unit (FADDs, FFMAs, an FMUL and one integer op), so that a kernel bound by
// MUFU's 16 results per clock and SM can move a share of its exp2s to the FMA pipe: x = j + f
// with j = rint(x) (the low bits of x + 1.5 * 2^23) and f in [-1/2, 1/2]; 2^f = 1 + f q(f), q of
// degree kDegree - 1 fitted for relative error (max in fp32: degree 2 2.0e-3, 3 1.0e-4;
// tests/test_numeric_cpu.py evaluates the same steps); times 2^j built in the exponent
// field. x at or below -127 (-inf too) gives 0, NaN gives NaN (max.NaN keeps it); x must stay
// below 128 (a score minus its row max does).
template <int kDegree>
__device__ __forceinline__ float exp2_fma(float x) {
    static_assert(kDegree == 2 || kDegree == 3, "exp2_fma: degree 2 or 3");
    asm("max.NaN.f32 %0, %0, 0fC2FE0000;" : "+f"(x));  // -127
    const float t = x + 12582912.f;                    // 1.5 * 2^23: rint(x) in the low bits
    const float f = x - (t - 12582912.f);              // exact
    float q;
    if constexpr (kDegree == 2)
        q = fmaf(0.23986402f, f, 0.70294195f);
    else
        q = fmaf(fmaf(0.055008922f, f, 0.24221098f), f, 0.6932829f);
    // 2^j = (j + 127) << 23: t's bits are 1.5 * 2^23's plus j, whose bits above the low 9 shift
    // out (j = -127 gives +0).
    const float scale = __int_as_float((__float_as_int(t) << 23) + 0x3F800000);
    return fmaf(q, f, 1.f) * scale;
}

// tanh(x) = 1 - 2 / (e^(2x) + 1): one ex2 and one rcp (two MUFU ops), absolute error 2.4e-7
// (studies/tanh_approx_probe.cu); the backwards' softcap. The forwards take tanh_mufu.
__device__ __forceinline__ float tanh_fast(float x) {
    return 1.f - 2.f * fast_rcp(fast_exp2(x * 2.8853900817779268f) + 1.f);  // 2 log2(e)
}

// tanh.approx.f32: one MUFU op (MUFU.TANH). Its relative error, measured over every fp32 value
// on an H200 (studies/tanh_approx_probe.cu), is at most 1.1e-5: a softcap c turns it into at
// most 1.1e-5 c of a logit (5.6e-4 at c = 50; a bf16 score rounds by 2^-9 of itself).
__device__ __forceinline__ float tanh_mufu(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

}  // namespace flash
