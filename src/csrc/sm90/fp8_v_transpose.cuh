// The FP8 forward's V transpose: FP8 wgmma takes B K-major alone, so O += P V needs V with the
// keys contiguous. The producer warpgroup copies each V tile as TMA lands it (kBc keys x
// d_head, 128-byte-swizzled panels of 128 columns) into the stage the consumers read: d_head
// rows of kBc keys (kBc = 128: one 128-byte-swizzled row each, the layout of a K tile with
// d_head rows; kBc = 64: 64-byte rows, 64-byte swizzle), keys in the order of P's registers.
//
// Key order: the consumers convert S (fp32 accumulators) to P's A fragments in place
// (ForwardConsumer::convert_p): thread (g = lane / 4, t = lane % 4) holds keys 2t, 2t + 1, 8 +
// 2t, 9 + 2t of each 16 (the accumulator layout), where the k32 A fragment's columns are 4t ..
// 4t + 3. So column c = 16u + 4t + i of the transposed V holds key 16u + 2t + (i & 1) + 8 (i >>
// 1), and P V sums the same products as in key order.
#pragma once

#include <cstdint>

#include "ptx.cuh"

namespace flash::sm90 {

template <class Cfg>
struct VTranspose {
    static_assert(Cfg::kBc == 64 || Cfg::kBc == 128,
                  "a transposed V row is one 128-byte (128-byte swizzle) or 64-byte (64-byte "
                  "swizzle) row of keys");
    static constexpr int kGroups = Cfg::kBc / 16;  // 16-key groups u of a row: 8 or 4
    static constexpr int kLaneSets = 8 / kGroups;  // lane sets e over a group's columns: 1 or 2
    static constexpr int kSteps = 4 / kLaneSets;   // column steps s per 16 columns: 4 or 2
    static constexpr int kQs = Cfg::kDHead / 64;   // 16-column groups q per warp

    // The 16-byte chunk of row n of the transposed V that holds keys 16u .. 16u + 15: the 128-byte
    // swizzle XORs the chunk with n % 8, the 64-byte one with (n / 2) % 4.
    __device__ __forceinline__ static int chunk(int u, int n) {
        return Cfg::kBc == 128 ? u ^ (n % 8) : u ^ ((n >> 1) & 3);
    }

    // Thread pt (0 .. 127) of the producer warpgroup copies 4-key x 4-column units: 4 words
    // (one per key) in, 4 words (one per column) out. Lane (e, u, t) = (lane / (4 kGroups),
    // lane / 4 % kGroups, lane % 4) takes keys 16u + 2t + {0, 1, 8, 9} (columns 16u + 4t of the
    // output rows) and columns n0 = 16q + 4 ((u + s + kSteps e) % 4).
    // Stage s: v_raw(s) (landed) into v(s) (released by the consumers).
    __device__ __forceinline__ static void run(const unsigned char* raw, unsigned char* out,
                                               int pt) {
        const int warp = pt / 32, lane = pt % 32;
        const int t = lane % 4, u = (lane / 4) % kGroups, e = lane / (4 * kGroups);
        const uint32_t src = smem_u32(raw), dst = smem_u32(out);
        const int key0 = 16 * u + 2 * t;  // keys key0 + {0, 1, 8, 9}: all the same row % 8 pair
        // Not unrolled over q: addresses are recomputed per group rather than held across the
        // producer's loop (56 registers).
#pragma unroll 1
        for (int qi = 0; qi < kQs; ++qi)
#pragma unroll
            for (int s = 0; s < kSteps; ++s) {
                const int q = warp * kQs + qi;
                const int n0 = 16 * q + 4 * ((u + s + kSteps * e) % 4);  // the unit's 1st column
                const int panel = n0 / 128, col = n0 % 128;
                const uint32_t panel_base = src + panel * Cfg::kBc * 128 + col % 16;
                uint32_t w[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int key = key0 + (i & 1) + 8 * (i >> 1);
                    w[i] = ld_shared_u32(panel_base + key * 128 + (((col / 16) ^ (key % 8)) * 16));
                }
                // 4 x 4 byte transpose: out[j] = byte j of w[0], w[1], w[2], w[3].
                const uint32_t lo01 = __byte_perm(w[0], w[1], 0x5140);
                const uint32_t hi01 = __byte_perm(w[0], w[1], 0x7362);
                const uint32_t lo23 = __byte_perm(w[2], w[3], 0x5140);
                const uint32_t hi23 = __byte_perm(w[2], w[3], 0x7362);
                const uint32_t out_w[4] = {
                    __byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                    __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int n = n0 + j;  // output row; columns 16u + 4t .. + 3
                    st_shared_u32(dst + n * Cfg::kBc + chunk(u, n) * 16 + 4 * t, out_w[j]);
                }
            }
    }
};

}  // namespace flash::sm90
