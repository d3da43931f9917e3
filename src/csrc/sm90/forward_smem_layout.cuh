// Shared memory of the Hopper forward kernel: where each buffer and each mbarrier lives, and the
// barriers' arrival counts. Buffers are 1024-byte aligned (the 128-byte swizzle's period):
//
//   Q  x kQBuffers  |  K x kStages  |  V x kStages  |  V raw x kStages (FP8)  |  O  |  barriers
//
// FP8: V is what the consumers read, transposed by the producer warpgroup from V raw (the TMA's
// tiles); O has its own buffer on a persistent grid or with FP8 (else it reuses sQ).
// Barriers (8 bytes each; S = kStages), then the dynamic schedule's two tile slots at the end of
// the barrier area:
//   0 q_full[0] | 1 .. S k_full | 1+S .. v_full | 1+2S .. k_empty | 1+3S .. v_empty
//   1+4S q_empty[0] | 2+4S, 3+4S tile_full | 4+4S, 5+4S tile_empty | 6+4S q_full[1] | 7+4S
//   q_empty[1] | FP8: 8+4S .. v_raw_full | 8+5S .. v_raw_empty
#pragma once

#include <cstdint>

#include "ptx.cuh"

namespace flash::sm90 {

template <class Cfg>
struct SmemLayout {
    static constexpr uint32_t kQ = 0;
    static constexpr uint32_t kK = kQ + Cfg::kQBuffers * Cfg::kQBytes;
    static constexpr uint32_t kV = kK + Cfg::kStages * Cfg::kKVBytes;
    static constexpr uint32_t kVRaw = kV + Cfg::kStages * Cfg::kKVBytes;
    static constexpr uint32_t kO = kVRaw + Cfg::kStages * Cfg::kVRawBytes;
    static constexpr uint32_t kBarriers = kO + Cfg::kOBytes;

    unsigned char* base;  // 1024-byte aligned

    // The layout over the kernel's dynamic shared memory, whose base is rounded up to 1024 bytes
    // (Cfg::kSmemBytes has room for that).
    __device__ __forceinline__ static SmemLayout aligned(unsigned char* raw) {
        return SmemLayout{swizzle_aligned(raw)};
    }

    // Q of the CTA's tile use u (u counts its tiles with work): buffer u % kQBuffers, whose
    // round u / kQBuffers gives the phases of its full and empty barriers.
    __device__ __forceinline__ static int q_buffer(int u) { return u % Cfg::kQBuffers; }
    __device__ __forceinline__ static uint32_t q_phase(int u) { return (u / Cfg::kQBuffers) & 1; }
    __device__ __forceinline__ unsigned char* q(int u) const {
        return base + kQ + q_buffer(u) * Cfg::kQBytes;
    }
    __device__ __forceinline__ unsigned char* k(int s) const {
        return base + kK + s * Cfg::kKVBytes;
    }
    __device__ __forceinline__ unsigned char* v(int s) const {
        return base + kV + s * Cfg::kKVBytes;
    }
    __device__ __forceinline__ unsigned char* v_raw(int s) const {
        return base + kVRaw + s * Cfg::kVRawBytes;
    }
    // O staging of the epilogue: its own buffer on a persistent grid or with FP8, else sQ (free
    // by then).
    __device__ __forceinline__ unsigned char* o() const {
        return Cfg::kOBytes > 0 ? base + kO : q(0);
    }
    __device__ __forceinline__ uint64_t* bar(int i) const {
        return reinterpret_cast<uint64_t*>(base + kBarriers) + i;
    }
    __device__ __forceinline__ uint64_t* q_full(int u) const {
        return q_buffer(u) == 0 ? bar(0) : bar(6 + 4 * Cfg::kStages);
    }
    __device__ __forceinline__ uint64_t* k_full(int s) const { return bar(1 + s); }
    __device__ __forceinline__ uint64_t* v_full(int s) const { return bar(1 + Cfg::kStages + s); }
    __device__ __forceinline__ uint64_t* k_empty(int s) const {
        return bar(1 + 2 * Cfg::kStages + s);
    }
    __device__ __forceinline__ uint64_t* v_empty(int s) const {
        return bar(1 + 3 * Cfg::kStages + s);
    }
    // Persistent grid: a Q buffer is free for a later tile once every consumer warp has
    // finished its last S GEMM of the tile that used it.
    __device__ __forceinline__ uint64_t* q_empty(int u) const {
        return q_buffer(u) == 0 ? bar(1 + 4 * Cfg::kStages) : bar(7 + 4 * Cfg::kStages);
    }
    // Dynamic schedule: the producer passes tile numbers to the consumers through two slots;
    // tile_full[i] completes when slot i holds the next one, tile_empty[i] when every consumer
    // warp has read it.
    __device__ __forceinline__ uint64_t* tile_full(int i) const {
        return bar(2 + 4 * Cfg::kStages + i);
    }
    __device__ __forceinline__ uint64_t* tile_empty(int i) const {
        return bar(4 + 4 * Cfg::kStages + i);
    }
    // FP8: v_raw_full[s] completes when the TMA tile of V raw stage s has landed, v_raw_empty[s]
    // when every producer warp has read it into the transposed V.
    __device__ __forceinline__ uint64_t* v_raw_full(int s) const {
        return bar(8 + 4 * Cfg::kStages + s);
    }
    __device__ __forceinline__ uint64_t* v_raw_empty(int s) const {
        return bar(8 + 5 * Cfg::kStages + s);
    }
    __device__ __forceinline__ volatile int* tile_slot(int i) const {
        return reinterpret_cast<volatile int*>(base + kBarriers + kSlotOffset) + i;
    }
    static constexpr int kBarrierCount = 8 + (Cfg::kFp8 ? 6 : 4) * Cfg::kStages;
    static constexpr uint32_t kSlotOffset = Cfg::kBarrierBytes - 16;
    static_assert(kBarrierCount * 8 <= kSlotOffset, "mbarriers do not fit");

    // One thread, before any other uses them. Full barriers take one arrival (the thread that
    // issues the copies, with their byte count); empty barriers one per consumer warp (of both
    // CTAs for K/V with kCluster: either CTA's producer refills only what both have read).
    __device__ __forceinline__ void init_barriers() const {
        for (int u = 0; u < Cfg::kQBuffers; ++u) {
            mbar_init(q_full(u), 1);
            mbar_init(q_empty(u), Cfg::kConsumerWarps);
        }
        for (int s = 0; s < Cfg::kStages; ++s) {
            mbar_init(k_full(s), 1);
            // FP8: V is transposed by the producer's 4 warps, each arriving once.
            mbar_init(v_full(s), Cfg::kFp8 ? 4 : 1);
            if constexpr (Cfg::kFp8) {
                mbar_init(v_raw_full(s), 1);
                mbar_init(v_raw_empty(s), 4);
            }
            mbar_init(k_empty(s), Cfg::kConsumerWarps * Cfg::kClusterCtas);
            mbar_init(v_empty(s), Cfg::kConsumerWarps * Cfg::kClusterCtas);
        }
        if constexpr (Cfg::kDynamic) {
            for (int i = 0; i < 2; ++i) {
                mbar_init(tile_full(i), 1);
                mbar_init(tile_empty(i), Cfg::kConsumerWarps);
            }
        }
        fence_barrier_init();
    }
};

}  // namespace flash::sm90
