// Causal and sliding-window masks (kernels with kMask). Query row i sees key j iff
//   i + off - window_left <= j <= i + off + window_right,   off = seqlen_k - seqlen_q,
// each side unbounded when its window is -1; causal is (-1, 0), aligned bottom-right.
// A query block visits only the KV blocks some of its rows can see, and masks only the blocks on
// the window's edges (and the key tail); the blocks between are seen whole by every row.
#pragma once

#include <cmath>
#include <cstdint>

#include "params.h"

namespace flash {

__device__ __forceinline__ int64_t floor_div(int64_t n, int64_t d) {
    return n >= 0 ? n / d : -((-n + d - 1) / d);
}

// The KV blocks of one query block: [first, last] (empty when last < first), and the ones seen
// whole by every row, [full_first, full_last] (none when full_last < full_first).
struct KvBlocks {
    int first, last;
    int full_first, full_last;

    __device__ __forceinline__ int count() const { return last >= first ? last - first + 1 : 0; }
    __device__ __forceinline__ bool needs_mask(int j) const {
        return j < full_first || j > full_last;
    }
};

// 64-bit arithmetic: row + off spans up to 2^32.
// seqlen_q/k: of this CTA's sequence.
template <int kBr, int kBc>
__device__ __forceinline__ KvBlocks window_blocks(const FwdParams& p, int seqlen_q, int seqlen_k,
                                                  int q_row0) {
    const int64_t off = int64_t(seqlen_k) - seqlen_q;
    const int64_t row_first = q_row0;
    const int64_t row_last = (q_row0 + kBr < seqlen_q ? q_row0 + kBr : seqlen_q) - 1;
    const bool left_open = p.window_left < 0, right_open = p.window_right < 0;
    int64_t key_lo = left_open ? 0 : row_first + off - p.window_left;
    int64_t key_hi = right_open ? seqlen_k - 1 : row_last + off + p.window_right;
    key_lo = key_lo > 0 ? key_lo : 0;
    key_hi = key_hi < seqlen_k - 1 ? key_hi : seqlen_k - 1;
    KvBlocks b{0, -1, 0, -1};
    if (key_hi < key_lo)
        return b;  // no row of this block sees any key
    b.first = static_cast<int>(key_lo / kBc);
    b.last = static_cast<int>(key_hi / kBc);
    // Block j is seen whole by every row when j*B_c >= row_last + off - left and
    // j*B_c + B_c - 1 <= row_first + off + right, and it is not the partial key tail.
    int64_t full_first = left_open ? b.first : -floor_div(-(row_last + off - p.window_left), kBc);
    int64_t full_last =
        right_open ? b.last : floor_div(row_first + off + p.window_right - kBc + 1, kBc);
    if (full_last > seqlen_k / kBc - 1)
        full_last = seqlen_k / kBc - 1;
    b.full_first = static_cast<int>(full_first > b.first ? full_first : b.first);
    b.full_last = static_cast<int>(full_last < b.last ? full_last : b.last);
    return b;
}

// Bounds of a mask range inside one block pair, clamped to 32 bits: +-kMaskBig lies beyond any
// |column - row| there, so the clamp keeps every answer (forward WindowMask, the sm80
// backward's masked pass).
constexpr int kMaskBig = 1 << 24;
__host__ __device__ __forceinline__ int clamp_mask_bound(int64_t v) {
    return static_cast<int>(v < -kMaskBig ? -kMaskBig : (v > kMaskBig ? kMaskBig : v));
}

// Per-thread view of the mask over one warp's MMA accumulator tiles: element e of tile (mt, nt)
// sits at CTA row r = warp_row0 + mt*16 + lane/4 + 8*(e/2) and block column c = nt*8 +
// 2*(lane%4) + e%2, so c - r is this thread's `diag` plus a compile-time offset. For that
// element key - row - off = (c - r) + kv_col0 - diag0, with diag0 = q_row0 + off the key on the
// diagonal of the CTA's first row: the window is a range of c - r. (masks.block_mask mirrors
// this in Python, and the block emulation uses it.)
template <class Cfg>
struct WindowMask {
    static constexpr int kBig = kMaskBig;

    int col0;       // c of this thread's element (0, 0, 0, 0)
    int diag;       // c - r of that element
    int64_t diag0;  // q_row0 + seqlen_k - seqlen_q

    // seqlen_q/k: of this CTA's sequence.
    __device__ __forceinline__ WindowMask(int seqlen_q, int seqlen_k, int q_row0, int warp_row0,
                                          int lane)
        : col0(2 * (lane % 4)),
          diag(2 * (lane % 4) - lane / 4 - warp_row0),
          diag0(int64_t(q_row0) + seqlen_k - seqlen_q) {}

    // Scores of block kv_col0 that no row may see (outside the window or past seqlen_k) -> -inf.
    // Per row of this thread the visible elements are a range [k_lo, k_hi] of k = c - col0, a
    // compile-time constant per element: two compares with an immediate and a select each.
    // kLo / kHi: whether the block may cut a row on the window's left / right side (the key
    // tail is on the right). A block on one edge checks one bound, a compare and a select: the
    // sm_90 kernels do (a window tile's fixed cost fell by 800 SM cycles of ~3800: both edges are
    // on its critical path); the sm_80 kernels check both (one bound not measured there).
    template <bool kLo = true, bool kHi = true, int kMT, int kNS>
    __device__ __forceinline__ void apply(float (&S)[kMT][kNS][4], int kv_col0, int seqlen_k,
                                          const FwdParams& p) const {
        // Visible iff -left <= (c - r) + base <= right: bounds on c - r, clamped to 32 bits.
        const int64_t base = int64_t(kv_col0) - diag0;
        const int64_t lo = p.window_left < 0 ? -kBig : -p.window_left - base;
        const int64_t hi = p.window_right < 0 ? kBig : p.window_right - base;
        const int lo32 = clamp_mask_bound(lo);
        const int hi32 = clamp_mask_bound(hi);
        const int k_tail = seqlen_k - kv_col0 - col0 - 1;  // the last k before seqlen_k
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // c - r = k - shift for the elements of row mt*16 + 8h (values 2h and 2h + 1)
                const int shift = mt * 16 + 8 * h - diag;
                const int k_lo = lo32 + shift;
                const int k_hi = hi32 + shift < k_tail ? hi32 + shift : k_tail;
#pragma unroll
                for (int nt = 0; nt < kNS; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int k = nt * 8 + e;
                        if ((kLo && k < k_lo) || (kHi && k > k_hi))
                            S[mt][nt][2 * h + e] = -INFINITY;
                    }
            }
    }
};

}  // namespace flash
