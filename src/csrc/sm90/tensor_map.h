// TMA tensor maps of the Hopper kernels, encoded on the host per call through the driver's
// cuTensorMapEncodeTiled (found at run time, so that nothing links libcuda).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

namespace flash::sm90 {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn encode_tiled() {
    static const EncodeTiledFn fn = [] {
        void* ptr = nullptr;
        cudaDriverEntryPointQueryResult status{};
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                             cudaEnableDefault, &status) != cudaSuccess ||
            status != cudaDriverEntryPointSuccess)
            return EncodeTiledFn{nullptr};
        return reinterpret_cast<EncodeTiledFn>(ptr);
    }();
    return fn;
}

// A 4-D map (d_head, rows, heads, batch) over a BSHD tensor; strides in elements. A dimension of
// size 1 is never stepped over: its stride is replaced by one the driver accepts. A box is 128
// bytes of columns (64 16-bit elements, 128 FP8 ones: the swizzle's width) x box_rows.
template <typename Elem>
inline bool encode_bshd(CUtensorMap* map, const void* base, int d_head, int rows, int heads,
                        int batch, int64_t row_stride, int64_t head_stride, int64_t batch_stride,
                        int box_rows) {
    const EncodeTiledFn fn = encode_tiled();
    if (fn == nullptr)
        return false;
    constexpr int64_t kBytes = sizeof(Elem);
    const int64_t bytes_row = row_stride * kBytes;
    const cuuint64_t dims[4] = {cuuint64_t(d_head), cuuint64_t(rows), cuuint64_t(heads),
                                cuuint64_t(batch)};
    const cuuint64_t strides[3] = {
        cuuint64_t(rows > 1 ? bytes_row : 16),
        cuuint64_t(heads > 1 ? head_stride * kBytes : 16),
        cuuint64_t(batch > 1 ? batch_stride * kBytes : 16),
    };
    const cuuint32_t box[4] = {cuuint32_t(128 / kBytes), cuuint32_t(box_rows), 1, 1};
    const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
    const CUtensorMapDataType type = std::is_same_v<Elem, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                     : kBytes == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                                   : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    return fn(map, type, 4, const_cast<void*>(base), dims, strides, box, elem_strides,
              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
              CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace flash::sm90
