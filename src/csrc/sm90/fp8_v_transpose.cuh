// The FP8 forward's V transpose: FP8 wgmma takes B K-major alone, so O += P V needs V with the
// keys contiguous. The producer warpgroup copies each V tile as TMA lands it (kBc keys x
// d_head, 128-byte-swizzled panels of 128 columns) into the stage the consumers read: d_head
// rows of kBc keys (kBc = 128: one 128-byte-swizzled row each, the layout of a K tile with
// d_head rows; kBc = 64 and 192: panels of 64 keys, d_head 64-byte rows each with the 64-byte
// swizzle), keys in the order of P's registers.
//
// Key order: the consumers convert S (fp32 accumulators) to P's A fragments in place
// (ForwardConsumer::convert_p): thread (g = lane / 4, t = lane % 4) holds keys 2t, 2t + 1, 8 +
// 2t, 9 + 2t of each 16 (the accumulator layout), where the k32 A fragment's columns are 4t ..
// 4t + 3. So column c = 16u + 4t + i of the transposed V holds key 16u + 2t + (i & 1) + 8 (i >>
// 1), and P V sums the same products as in key order.
#pragma once

#include <cstdint>

#include "../common/ldmatrix.cuh"
#include "ptx.cuh"

namespace flash::sm90 {

template <class Cfg>
struct VTranspose {
    static_assert(Cfg::kBc == 64 || Cfg::kBc == 128 || Cfg::kBc == 192,
                  "a transposed V row is one 128-byte (128-byte swizzle) row of keys or 64-byte "
                  "(64-byte swizzle) rows in panels of 64 keys");
    static constexpr bool kSw128 = Cfg::kBc == 128;
    static constexpr int kGroups = Cfg::kBc / 16;  // 16-key groups u of a row: 4, 8 or 12
    // Groups loaded at a time (4 registers each), so that their latencies overlap.
    static constexpr int kBatch = 4;
    static_assert(kGroups % kBatch == 0, "groups go kBatch at a time");
    static constexpr int kWarpCols = Cfg::kDHead / 4;  // columns of V per producer warp
    static constexpr int kUnitsWide = kWarpCols / 32;  // 32-column units per warp: 1 or 2
    static_assert(kWarpCols % 32 == 0, "a warp transposes whole 32-column units");

    // Byte offset of the 16-byte chunk of transposed row n that holds keys 16u .. 16u + 15: the
    // 128-byte swizzle XORs the chunk with n % 8; with 64-byte rows the chunk u % 4 of panel u /
    // 4 (d_head x 64 bytes), XORed with (n / 2) % 4.
    __device__ __forceinline__ static uint32_t out_offset(int n, int u) {
        if constexpr (kSw128)
            return n * 128 + 16 * (u ^ (n % 8));
        else
            return (u / 4) * (Cfg::kDHead * 64) + n * 64 + 16 * ((u % 4) ^ ((n >> 1) & 3));
    }

    // Thread pt (0 .. 127) of the producer warpgroup: its warp transposes columns [kWarpCols w,
    // kWarpCols (w + 1)) of V in units of 16 keys (group u) x 32 columns c .. c + 31, one
    // ldmatrix.x4.trans, four byte permutes and one stmatrix.x4 each.
    //  - Load matrix m (lanes 8m .. 8m + 7 address its rows): keys 16u + 8 (m & 1) + 0 .. 7,
    //    columns c + 16 (m >> 1) + 0 .. 15 (one 16-byte chunk of each key's row). Transposed as
    //    16-bit values, thread (g, t) gets keys 16u + 8 (m & 1) + 2t, + 1 at columns c + 16 (m >>
    //    1) + 2g, + 1: bytes (key 2t, column 2g), (2t, 2g + 1), (2t + 1, 2g), (2t + 1, 2g + 1).
    //  - Permutes: of matrices 0 and 1 (2 and 3), column 2g's word is bytes 0, 2 of each (keys
    //    2t, 2t + 1, 8 + 2t, 9 + 2t: P's order at columns 4t .. 4t + 3), column 2g + 1's bytes 1,
    //    3 of each.
    //  - Store matrix m, row g (thread (g, t) gives bytes 4t .. 4t + 3): transposed row c + 16 (m
    //    >> 1) + 2g + ((m & 1) ^ (g >= 4)), keys 16u .. 16u + 15. Rows 0, 2, 4, 6, 9, 11, 13, 15
    //    (and the other eight) are eight rows mod 8: no bank conflict under either swizzle, as
    //    the loads (eight keys, eight chunks) have none.
    // Stage s: v_raw(s) (landed) into v(s) (released by the consumers).
    // Keys from `keep` on (a varlen block holding its sequence's end: the next sequence's rows)
    // come out zero: each warp first zeroes those rows of V raw in the columns it transposes.
    __device__ __forceinline__ static void run(const unsigned char* raw, unsigned char* out, int pt,
                                               int keep) {
        const int warp = pt / 32, lane = pt % 32;
        const int m = lane / 8, r = lane % 8, g = lane / 4;
        if (keep < Cfg::kBc) {                       // block-uniform
            constexpr int kChunks = 2 * kUnitsWide;  // 16-byte chunks of a row per warp
            for (int i = lane; i < (Cfg::kBc - keep) * kChunks; i += 32) {
                const int key = keep + i / kChunks, col = warp * kWarpCols + 16 * (i % kChunks);
                st_shared_zero16(smem_u32(raw) + (col / 128) * (Cfg::kBc * 128) + key * 128 +
                                 ((((col % 128) / 16) ^ (key % 8)) << 4));
            }
            __syncwarp();  // the warp's loads below see the zeros
        }
        // Permute selectors: the word for store matrix 0 (2), and the one for 1 (3).
        const uint32_t sel_a = g < 4 ? 0x6420u : 0x7531u, sel_b = g < 4 ? 0x7531u : 0x6420u;
#pragma unroll
        for (int wu = 0; wu < kUnitsWide; ++wu) {
            const int c = warp * kWarpCols + 32 * wu;
            const int col = c + 16 * (m >> 1);  // this lane's load chunk (keys' % 8 is r)
            const uint32_t src = smem_u32(raw) + (col / 128) * (Cfg::kBc * 128) +
                                 (r + 8 * (m & 1)) * 128 + ((((col % 128) / 16) ^ r) << 4);
            const int n = c + 16 * (m >> 1) + 2 * r + ((m & 1) ^ (r >= 4 ? 1 : 0));
            const uint32_t dst = smem_u32(out);
#pragma unroll
            for (int u0 = 0; u0 < kGroups; u0 += kBatch) {
                uint32_t in[kBatch][4];
#pragma unroll
                for (int i = 0; i < kBatch; ++i)
                    ldmatrix_x4_trans(in[i], src + (u0 + i) * 16 * 128);
#pragma unroll
                for (int i = 0; i < kBatch; ++i) {
                    const uint32_t w[4] = {__byte_perm(in[i][0], in[i][1], sel_a),
                                           __byte_perm(in[i][0], in[i][1], sel_b),
                                           __byte_perm(in[i][2], in[i][3], sel_a),
                                           __byte_perm(in[i][2], in[i][3], sel_b)};
                    stmatrix_x4(dst + out_offset(n, u0 + i), w);
                }
            }
        }
    }
};

}  // namespace flash::sm90
