// The argument of the Hopper forward kernel: the call's FwdParams plus what the launcher derives
// from them once per launch (the tile scheduler's divisors and the TMA tensor maps). Its layout
// is the kernel's parameter layout: fields are read from the constant bank at fixed offsets.
#pragma once

#include <cuda.h>

#include "../common/params.h"
#include "fast_div.cuh"

namespace flash::sm90 {

struct FwdKernelParams {
    FwdParams p;
    // Tile numbering (forward_tile_scheduler.cuh): tiles per (batch, head)
    // (ForwardTile::tiles_per_head), heads, heads per KV head.
    FastDiv tiles_per_head, heads, heads_per_kv;
    // 4-D maps (d_head, seqlen, heads, batch): Q and O boxes are 64 columns x B_r (Q) or 64 (O,
    // one warpgroup's rows) rows, K and V 64 columns x B_c rows; all 128-byte swizzled.
    CUtensorMap tma_q, tma_k, tma_v, tma_o;
    // kDynamic: (batch, head) pairs per group of the tile order (forward_tile_scheduler.cuh),
    // chosen by the launcher so that a group's K and V stay in L2.
    int sched_heads;
};

}  // namespace flash::sm90
