// Division by a divisor fixed per launch, for the tile scheduler's index arithmetic. Plain CUDA;
// the launcher builds the divisors on the host, the kernel divides on the device.
#pragma once

#include <cstdint>

namespace flash::sm90 {

// n / d for 0 <= n < 2^31 and a divisor fixed per launch: a multiply-high and a shift
// with a magic number the launcher computes (Granlund-Montgomery), in place of the ~20 dependent
// instructions of an integer division on the tile change's critical path.
struct FastDiv {
    int d;
    uint32_t magic, shift;

    FastDiv() = default;
    __host__ explicit FastDiv(int divisor) : d(divisor > 1 ? divisor : 1), shift(0) {
        divisor = d;
        while ((uint64_t(1) << shift) < uint64_t(divisor))
            ++shift;
        magic = uint32_t((uint64_t(1) << 32) * ((uint64_t(1) << shift) - divisor) / divisor + 1);
    }
    __device__ __forceinline__ int div(int n) const {
        return int((__umulhi(uint32_t(n), magic) + uint32_t(n)) >> shift);
    }
};

}  // namespace flash::sm90
