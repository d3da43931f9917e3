// Thin wrappers over the PTX instructions the sm80-family kernels are built from: cp.async
// (global -> smem, 16 bytes, zero-fill for rows past the end), ldmatrix (common/ldmatrix.cuh)
// and mma.sync m16n8k16 with fp32 accumulators.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "../common/ldmatrix.cuh"
#include "../common/numeric.cuh"

namespace flash {

// 16-byte async copy; when !valid nothing is read and the 16 smem bytes are zero-filled. The
// ignore-src predicate form keeps the condition in a predicate register, not a source-size GPR.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
    asm volatile(
        "{\n"
        ".reg .pred ignore;\n"
        "setp.eq.u32 ignore, %2, 0;\n"
        "cp.async.cg.shared.global [%0], [%1], 16, ignore;\n"
        "}\n" ::"r"(dst),
        "l"(src), "r"(static_cast<uint32_t>(valid)));
}

// 16-byte async copy of a chunk known to be inside the tensor (no source-size operand).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most n committed groups are still in flight (this thread's copies only).
template <int n>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(n) : "memory");
}

// mma is a pure function of its registers (no volatile), so the scheduler may interleave it with
// the fragment loads; ldmatrix stays volatile so it is never moved across a barrier.
// D += A * B for one m16n8k16 tile; A row-major 16x16, B column-major 16x8, D fp32 16x8.
template <typename Elem>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         const uint32_t (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace flash
