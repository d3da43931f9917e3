// The decode operators, in their own translation unit:
//   flash_attention::kvcache(q, k_cache!, v_cache!, k?, v?, rotary_cos?, rotary_sin?,
//       cache_seqlens?, cache_seqlen, cache_batch_idx?, block_table?, softmax_scale?, causal,
//       window_left, window_right, softcap, rotary_interleaved, num_splits, return_lse, kernel,
//       k_descale?, v_descale?, cache_leftpad?) -> (out, lse)
//       flash_attn_with_kvcache: append (with rotary), then attend
//   flash_attention::varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k?, seqused_k?,
//       block_table?, max_seqlen_q, max_seqlen_k, softmax_scale?, causal, window_left,
//       window_right, softcap, num_splits, return_lse, kernel, k_descale?, v_descale?)
//       -> (out, lse)   flash_attn_varlen_func over a paged cache and/or per-sequence key counts
// The caches (or pages) are q's dtype, or FP8 (float8_e4m3fn, float8_e5m2) with fp32 descales
// per (batch, kv_head): the kernels dequantise K and V as their tiles arrive, and the append
// quantises the new rows with the same descales.
// Both check every shape, dtype and device on the host before any launch; what lives on the
// device (cache lengths, block tables, cache_batch_idx, cache_leftpad) is not read back (no
// sync per decode step): the kernels bound every access by it, and a bad value gives NaN rows
// and a bit in the device's status word (kvcache_status). Lengths given on the host are
// checked on the host.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../common/params.h"
#include "../kvcache/append.h"
#include "decode.h"
#include "device_properties.h"
#include "dispatch.h"
#include "input_layout.h"
#include "kernel_registry.h"
#include "message.h"
#include "params.h"
#include "validation.h"

namespace flash::binding {

namespace {

// The most splits of one call (the fp32 partials take num_splits x the output's rows, 4 bytes
// per element); num_splits above it runs with this many.
constexpr int64_t kMaxSplits = 256;

void check_cuda(cudaError_t err, const char* what) {
    FA_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

// An int32 metadata tensor of `rank` dims on q's device; returned contiguous (a copy when not).
at::Tensor int_meta(const at::Tensor& t, const char* name, int64_t rank, const at::Device& device,
                    const char* dims) {
    FA_CHECK_TYPE(t.scalar_type() == at::kInt, name, " must be int32 (torch.int32), got ",
                  t.scalar_type());
    FA_CHECK_VALUE(t.dim() == rank, name, " must be ", rank, "-D ", dims, ", got shape ",
                   t.sizes());
    FA_CHECK_VALUE(t.device() == device, name, " must be on ", device, " (q's device), got ",
                   t.device());
    return t.contiguous();
}

bool is_fp8(at::ScalarType t) {
    return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

// A cache the kernels read (and the append writes) in place: no copy can stand in for it. Of
// q's dtype, or FP8.
void check_cache(const at::Tensor& c, const char* name, at::ScalarType dtype,
                 const at::Device& device) {
    FA_CHECK_TYPE(c.scalar_type() == dtype || is_fp8(c.scalar_type()), name, " has dtype ",
                  c.scalar_type(), "; it must have q's dtype ", dtype,
                  " or be an FP8 cache (torch.float8_e4m3fn, torch.float8_e5m2)");
    FA_CHECK_VALUE(c.device() == device, name, " must be on ", device, " (q's device)");
    const char* why = unaddressable(c);
    FA_CHECK_VALUE(why == nullptr, name, " cannot be addressed in place (", why ? why : "",
                   "): a KV cache is read and written where it lies, so its last dimension must "
                   "be contiguous and its other strides multiples of 16 bytes");
}

// The splits of the keys (num_splits = 0). A decode CTA keeps about 64 KB of K/V in flight,
// enough for one CTA per SM to draw an H100's bandwidth but not an H200's (two per SM do; their
// shared memory allows two). So: no split when the CTAs fill most of a wave of two per SM; two
// when they fill most of one per SM and the keys are long enough (4096 or more) to pay for the
// combine; else as many as one wave of two per SM holds (each split at least 128 keys, at most
// 128 splits). Never more than one wave: a step bound by memory gains nothing from more waves,
// which add each CTA's start and the combine's reads of more partials (the wave-filling count of
// earlier, 33 splits in 16 waves at 16 x 8k keys, ran at 0.73x SDPA cuDNN's speed on an H200).
// Measured: docs/results.md, decode. Mirrored by dec_sm80.heuristic_splits (Python).
int choose_splits(int64_t ctas, int64_t keys, int sms) {
    const int64_t wave = 2 * int64_t(sms);
    if (ctas >= (wave * 4) / 5)
        return 1;
    if (ctas >= (int64_t(sms) * 4) / 5)
        return keys >= 4096 ? 2 : 1;
    return static_cast<int>(std::min<int64_t>(
        {128, std::max<int64_t>(1, keys / 128), std::max<int64_t>(1, wave / ctas)}));
}

// The K and V bytes a call reads at most: `keys` rows of every sequence and KV head.
int64_t kv_bytes(int64_t batch, int64_t kv_heads, int64_t keys, int64_t d_head,
                 const at::Tensor& cache) {
    return 2 * batch * kv_heads * keys * d_head * int64_t(cache.element_size());
}

// What the choice of a decode kernel weighs: the call's packed rows (seqlen_q x heads_per_kv),
// the K and V bytes it reads at most, its 16-row tiles (row blocks x KV heads x batch), its keys
// per sequence, num_splits as given and the GPU.
struct DecodeCall {
    int64_t rows, kv_bytes, tiles, keys, num_splits;
    at::Device device;
    int64_t page_size;  // a paged cache's rows per page, 0 for a contiguous one
};

// The split count a call of `tiles` 16-row tiles and `keys` keys per sequence runs its row's
// deep kernel with (num_splits=0), 0 where it runs another: the deep kernel (8 warps, one CTA
// per SM with twice the bytes in flight of a 4-warp CTA) where its CTAs fill more than half the
// SMs, one per SM at most: one split over more than half, two over a third to a half, each
// split kDeepMinKeys keys or more. Over more tiles than SMs it would run a second wave (H200,
// 20-24 x 1024 keys: 1.12-1.32x the 4-warp kernel's time); below, 10-16 sequences x 1024-8192
// keys at one split: 0.85-0.93x the 4-warp kernel's best (docs/dispatch.md). Mirrored by
// dec_sm80.deep_splits (Python).
constexpr int64_t kDeepMinKeys = 1024;  // dec_sm80.DEEP_MIN_KEYS
int deep_splits(int64_t tiles, int64_t keys, int64_t sms) {
    if (tiles <= sms / 3 || tiles > sms)
        return 0;
    const int splits = tiles > sms / 2 ? 1 : 2;
    return keys >= kDeepMinKeys * splits ? splits : 0;
}

// A decode kernel and the num_splits it runs with (0: choose_splits's).
struct DecodeChoice {
    const flash::DecKernelEntry* kernel;
    int64_t num_splits;
};

// The decode kernel for a call: `name`, or the dec table's choice for (q's dtype, the cache's
// dtype, d_head) (flash_attention.kernels.dec_sm80.select_for decides alike):
// - its row of 32-row tiles (bucket 32) from kWideFrom packed rows and kWideMinBytes where the
//   table has one. Below kWideMinBytes a step is bound by fixed costs more than by bandwidth,
//   and the two 16-row CTAs of a KV head find its keys in L2 (H200: 16-row tiles 4-7% faster
//   at 32-64 MiB, 32-row tiles 6-30% faster from 128 MiB; docs/dispatch.md);
// - else its row of 16-row tiles, or that row's deep kernel (its one-wave column) with
//   num_splits=0 where deep_splits says so, on a GPU that gives a CTA its shared memory;
// - a 16-row kernel over pages of a multiple of 16 rows that its B_c does not divide gives
//   way to the row's small-page kernel (bucket kSmallPageBucket) where one is built: 16-key
//   blocks, each inside one page, where the row's 32-key blocks straddle two (H200, d_head 64,
//   pages of 16: 1.04-1.30x faster than the row-by-row gather, 1.01-1.05x than its blocks
//   addressed per 16-row group; docs/dispatch.md).
constexpr int64_t kWideFrom = 17;                    // dec_sm80.WIDE_FROM
constexpr int64_t kWideMinBytes = int64_t(1) << 27;  // dec_sm80.WIDE_MIN_BYTES
constexpr int64_t kSmallPageBucket = 1016;           // dec_sm80.SMALL_PAGE_BUCKET
DecodeChoice choose_decode(c10::string_view name, at::ScalarType dtype, at::ScalarType cache,
                           int64_t d_head, const DecodeCall& call) {
    const flash::DecKernelEntry* kernel = nullptr;
    int64_t num_splits = call.num_splits;
    if (name.empty()) {
        const int code = dtype_code(dtype, cache);
        if (call.rows >= kWideFrom && call.kv_bytes >= kWideMinBytes)
            kernel =
                lookup_bucket<flash::DecKernelEntry>(code, d_head, 32, false, false, false).kernel;
        if (kernel == nullptr) {
            const Choice<flash::DecKernelEntry> row =
                lookup_bucket<flash::DecKernelEntry>(code, d_head, 16, false, false, false);
            kernel = row.kernel;
            const flash::DecKernelEntry* deep = row.one_wave[0];
            if (deep != nullptr && call.num_splits == 0) {
                const cudaDeviceProp& prop = device_properties(call.device.index());
                const int splits = deep_splits(call.tiles, call.keys, prop.multiProcessorCount);
                if (splits > 0 && deep->smem_bytes <= int64_t(prop.sharedMemPerBlockOptin)) {
                    kernel = deep;
                    num_splits = splits;
                }
            }
            if (kernel != nullptr && kernel != deep && call.page_size > 0 &&
                call.page_size % 16 == 0 && call.page_size % kernel->block_c != 0) {
                const flash::DecKernelEntry* small =
                    lookup_bucket<flash::DecKernelEntry>(code, d_head, kSmallPageBucket, false,
                                                         false, false)
                        .kernel;
                if (small != nullptr && small->block_r == kernel->block_r)
                    kernel = small;
            }
        }
        FA_CHECK(kernel != nullptr, "this build has no decode kernel for q of ", dtype,
                 " over a cache of ", cache, " with d_head=", d_head,
                 " (or flash_attention has not set its dispatch table); rebuild with "
                 "FLASH_ATTENTION_KERNELS=default");
    } else {
        kernel = choose_kernel<flash::DecKernelEntry>(name, dtype, d_head, 1, false, false, false,
                                                      "decode ")
                     .kernel;
    }
    FA_CHECK_VALUE(dtype_code(dtype) == int(kernel->dtype) &&
                       dtype_code(cache) == int(kernel->cache_dtype) && kernel->d_head >= d_head,
                   "decode kernel ", kernel->name, " does not serve q of ", dtype,
                   " over a cache of ", cache, " with d_head=", d_head);
    return {kernel, num_splits};
}

// A call's DecodeCall after set_queries (p's batch, KV heads, seqlen_q, heads_per_kv).
DecodeCall decode_call(const flash::DecParams& p, int64_t keys, int64_t d_head,
                       const at::Tensor& cache, int64_t num_splits, const at::Device& device) {
    const int64_t rows = int64_t(p.seqlen_q) * p.heads_per_kv;
    return {rows,
            kv_bytes(p.batch, p.kv_heads, keys, d_head, cache),
            (rows + 15) / 16 * p.kv_heads * p.batch,
            keys,
            num_splits,
            device,
            p.block_table != nullptr ? int64_t(p.page_size) : 0};
}

// An FP8 cache's descales (k_descale, v_descale: fp32 (batch, kv_heads), any strides) into p;
// refused with a cache of q's dtype. None: 1.
void set_descales(flash::DecParams& p, const std::optional<at::Tensor>& k_descale,
                  const std::optional<at::Tensor>& v_descale, const at::Tensor& cache,
                  int64_t batch, int64_t kv_heads) {
    if (!is_fp8(cache.scalar_type())) {
        FA_CHECK_VALUE(!k_descale && !v_descale,
                       "k_descale / v_descale go with an FP8 cache (torch.float8_e4m3fn, "
                       "torch.float8_e5m2); this cache is ",
                       cache.scalar_type());
        return;
    }
    check_descale(k_descale, "k_descale", batch, kv_heads, cache.device());
    check_descale(v_descale, "v_descale", batch, kv_heads, cache.device());
    const std::optional<at::Tensor>* d[3] = {nullptr, &k_descale, &v_descale};
    for (int i = 1; i < 3; ++i) {
        if (!d[i]->has_value())
            continue;
        p.descale[i] = (*d[i])->data_ptr<float>();
        p.descale_batch_stride[i] = (*d[i])->stride(0);
        p.descale_head_stride[i] = (*d[i])->stride(1);
    }
}

// q: fp16/bf16, CUDA, `rank`-D; its dtype.
at::ScalarType check_query(const at::Tensor& q, int64_t rank, const char* dims) {
    check_rank(q, "q", rank, dims);
    const at::ScalarType dtype = q.scalar_type();
    FA_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16, "q has dtype ", dtype,
                  "; supported: torch.float16, torch.bfloat16");
    FA_CHECK_VALUE(q.is_cuda(), "q is on ", q.device(), "; flash_attention runs on CUDA tensors");
    return dtype;
}

// The K and V a decode kernel reads (caches, pages or packed rows): `rank`-D, one shape, q's
// dtype and device, addressable in place, d_head and heads that go with q's.
void check_keys(const at::Tensor& k, const at::Tensor& v, const char* k_name, const char* v_name,
                int64_t rank, const char* dims, const at::Tensor& q) {
    check_rank(k, k_name, rank, dims);
    check_rank(v, v_name, rank, dims);
    FA_CHECK_VALUE(k.sizes() == v.sizes(), k_name, " and ", v_name,
                   " must have the same shape, got ", k.sizes(), " and ", v.sizes());
    check_cache(k, k_name, q.scalar_type(), q.device());
    check_cache(v, v_name, q.scalar_type(), q.device());
    FA_CHECK_TYPE(k.scalar_type() == v.scalar_type(), k_name, " and ", v_name,
                  " must have one dtype, got ", k.scalar_type(), " and ", v.scalar_type());
    const int64_t D = q.size(-1), H = q.size(-2), Hk = k.size(-2);
    FA_CHECK_VALUE(D > 0 && D % 8 == 0 && D <= 256, "d_head=", D,
                   " is not supported; supported: every multiple of 8 up to 256");
    FA_CHECK_VALUE(!is_fp8(k.scalar_type()) || D % 16 == 0, "d_head=", D,
                   " is not supported with an FP8 cache; supported: multiples of 16 up to 256 "
                   "(a row must be whole 16-byte chunks)");
    FA_CHECK_VALUE(k.size(-1) == D, "d_head of ", k_name, " (", k.size(-1),
                   ") differs from d_head of q (", D, ")");
    FA_CHECK_VALUE(Hk > 0 && H % Hk == 0, "heads of q (", H, ") must be a multiple of the ", k_name,
                   "'s kv_heads (", Hk, ")");
}

// A paged cache: block_table (batch, max_pages) int32 over pages (num_pages, page_size, Hk, D).
// Returns the table as the kernels read it (contiguous rows).
at::Tensor set_pages(flash::DecParams& p, const at::Tensor& block_table, const at::Tensor& pages,
                     int64_t batch) {
    at::Tensor table =
        int_meta(block_table, "block_table", 2, pages.device(), "(batch, max_pages)");
    FA_CHECK_VALUE(table.size(0) == batch, "block_table has ", table.size(0),
                   " rows; the batch has ", batch);
    FA_CHECK_VALUE(pages.size(1) > 0, "page_size must be >= 1");
    const int64_t capacity = table.size(1) * pages.size(1);
    FA_CHECK_VALUE(capacity < (int64_t(1) << 31), "block_table x page_size (", capacity,
                   ") exceeds 2^31 - 1 keys");
    p.block_table = table.data_ptr<int32_t>();
    p.block_table_stride = table.stride(0);
    p.page_size = static_cast<int>(pages.size(1));
    p.page_shift = -1;
    for (int shift = 0; shift < 31; ++shift)
        if ((int64_t(1) << shift) == p.page_size)
            p.page_shift = shift;
    p.num_pages = static_cast<int>(pages.size(0));
    p.capacity = static_cast<int>(capacity);
    return table;
}

// A tensor's strides by role (params.h): (batch or page, row, head) of 4-D tensors, (0, row,
// head) of packed (tokens, heads, d_head) ones.
RoleStrides roles(const at::Tensor& t) {
    return role_strides(t, t.dim() == 3);
}

void set_key_strides(flash::DecParams& p, const at::Tensor& k, const at::Tensor& v) {
    const RoleStrides ks = roles(k), vs = roles(v);
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.k_batch_stride = ks.batch;
    p.k_row_stride = ks.row;
    p.k_head_stride = ks.head;
    p.v_batch_stride = vs.batch;
    p.v_row_stride = vs.row;
    p.v_head_stride = vs.head;
}

// q as the kernels read it (the caller's, or its rotated or contiguous copy).
void set_q(flash::DecParams& p, const at::Tensor& q) {
    const RoleStrides s = roles(q);
    p.q = q.data_ptr();
    p.q_batch_stride = s.batch;
    p.q_row_stride = s.row;
    p.q_head_stride = s.head;
}

// q, out and lse (all fresh or checked), and the shape the kernels read from them.
void set_queries(flash::DecParams& p, const at::Tensor& q, const at::Tensor& out, float* lse,
                 int64_t batch, int64_t kv_heads, int64_t seqlen_q, int64_t rows_total) {
    const bool four = q.dim() == 4;
    const int64_t H = q.size(-2);
    FA_CHECK_VALUE(rows_total * H < (int64_t(1) << 31), "query rows x heads exceeds 2^31");
    const RoleStrides os = roles(out);
    set_q(p, q);
    p.o = out.data_ptr();
    p.lse = lse;
    p.o_batch_stride = os.batch;
    p.o_row_stride = os.row;
    p.o_head_stride = os.head;
    p.lse_batch_stride = four ? H * seqlen_q : 0;  // (batch, heads, seqlen_q) or (heads, total_q)
    p.lse_head_stride = four ? seqlen_q : rows_total;
    p.heads = static_cast<int>(H);
    p.kv_heads = static_cast<int>(kv_heads);
    p.heads_per_kv = static_cast<int>(H / kv_heads);
    p.batch = static_cast<int>(batch);
    p.seqlen_q = static_cast<int>(seqlen_q);
    p.d_head = static_cast<int>(q.size(-1));
    p.rows_total = static_cast<int>(rows_total);
}

// What launching `kernel` needs of the GPU, checked before anything is launched.
void check_device(const flash::DecKernelEntry& kernel, const at::Device& device) {
    const cudaDeviceProp& prop = device_properties(device.index());
    FA_CHECK(prop.major >= 8,
             "the decode kernels need compute capability 8.0 or newer, this GPU "
             "has ",
             prop.major, ".", prop.minor);
    FA_CHECK(kernel.smem_bytes <= int64_t(prop.sharedMemPerBlockOptin), "decode kernel ",
             kernel.name, " needs ", kernel.smem_bytes,
             " bytes of shared memory; this GPU gives "
             "a CTA ",
             int64_t(prop.sharedMemPerBlockOptin));
}

// The splits (num_splits, or the heuristic's for `keys` keys per sequence) and the grid's
// limits, after set_queries.
void plan_splits(flash::DecParams& p, const flash::DecKernelEntry& kernel, int64_t num_splits,
                 int64_t keys, const at::Device& device) {
    const int64_t row_blocks =
        (int64_t(p.seqlen_q) * p.heads_per_kv + kernel.block_r - 1) / kernel.block_r;
    const int sms = device_properties(device.index()).multiProcessorCount;
    const int64_t splits = num_splits > 0
                               ? std::min<int64_t>(num_splits, kMaxSplits)
                               : choose_splits(row_blocks * p.kv_heads * p.batch, keys, sms);
    FA_CHECK_VALUE(
        row_blocks * splits < (int64_t(1) << 31) && p.batch <= 65535 && p.kv_heads <= 65535,
        "the decode grid is too large: batch ", p.batch, ", kv_heads ", p.kv_heads,
        ", row blocks x splits ", row_blocks * splits);
    p.num_splits = static_cast<int>(splits);
}

// The split-KV buffers and the status word of p, then the launch on the stream.
void launch_decode(flash::DecParams& p, const flash::DecKernelEntry& kernel, const at::Tensor& like,
                   cudaStream_t stream) {
    at::Tensor o_accum, lse_accum;
    if (p.num_splits > 1) {
        const auto f32 = like.options().dtype(at::kFloat);
        o_accum = at::empty({p.num_splits, p.heads, p.rows_total, p.d_head}, f32);
        lse_accum = at::empty({p.num_splits, p.heads, p.rows_total}, f32);
        p.o_accum = o_accum.data_ptr<float>();
        p.lse_accum = lse_accum.data_ptr<float>();
    }
    check_cuda(kvcache::status_word(&p.status), "the KV-cache status word");
    check_cuda(kernel.launch(p, stream), kernel.name);
}

void set_window(flash::DecParams& p, bool causal, int64_t window_left, int64_t window_right) {
    FA_CHECK_VALUE(window_left >= -1 && window_right >= -1,
                   "window_size sides must be -1 (unbounded) or >= 0, got (", window_left, ", ",
                   window_right, ")");
    p.window_left = static_cast<int>(std::min<int64_t>(window_left, 1 << 30));
    p.window_right = causal ? 0 : static_cast<int>(std::min<int64_t>(window_right, 1 << 30));
}

void set_scale(flash::DecParams& p, std::optional<double> softmax_scale, double softcap) {
    const double scale = softmax_scale ? *softmax_scale : 1.0 / std::sqrt(double(p.d_head));
    FA_CHECK_VALUE(std::isfinite(scale) && scale > 0, "softmax_scale must be finite and > 0");
    FA_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0, "softcap must be finite and >= 0");
    p.scale_log2 = static_cast<float>((softcap > 0 ? softcap : scale) * M_LOG2E);
    p.softcap_scale = static_cast<float>(softcap > 0 ? scale / softcap : 0.0);
}

at::Tensor empty_lse(bool wanted, std::vector<int64_t> shape, const at::Tensor& like) {
    return at::empty(wanted ? shape : std::vector<int64_t>{0}, like.options().dtype(at::kFloat));
}

// ---- flash_attn_with_kvcache ------------------------------------------------------------------

// The source rows of an append with the last dimension contiguous (the kernel reads them so).
at::Tensor rows_source(const at::Tensor& t) {
    return t.size(-1) > 1 && t.stride(-1) != 1 ? t.contiguous() : t;
}

// Where the append writes, from the decode parameters' cache fields.
kvcache::AppendParams append_params(const at::Tensor& src, const flash::DecParams& d,
                                    const int* base_pos, int base_const, bool per_row,
                                    const at::Tensor& cos, const at::Tensor& sin,
                                    bool interleaved) {
    kvcache::AppendParams a{};
    a.src = src.data_ptr();
    a.src_batch_stride = src.stride(0);
    a.src_row_stride = src.stride(1);
    a.src_head_stride = src.stride(2);
    a.batch = static_cast<int>(src.size(0));
    a.seqlen = static_cast<int>(src.size(1));
    a.heads = static_cast<int>(src.size(2));
    a.d_head = static_cast<int>(src.size(3));
    a.block_table = d.block_table;
    a.block_table_stride = d.block_table_stride;
    a.page_size = d.page_size;
    a.num_pages = d.num_pages;
    a.cache_batch_idx = d.cache_batch_idx;
    a.cache_batch = d.cache_batch;
    a.capacity = d.capacity;
    a.base_pos = base_pos;
    a.base_const = base_const;
    a.per_row = per_row;
    if (cos.defined()) {
        a.cos = cos.data_ptr();
        a.sin = sin.data_ptr();
        a.cos_row_stride = cos.stride(0);
        a.sin_row_stride = sin.stride(0);
        a.rotary_fp32 = cos.scalar_type() == at::kFloat;
        a.seqlen_ro = static_cast<int>(cos.size(0));
        a.rotary_dim = static_cast<int>(2 * cos.size(1));
        a.interleaved = interleaved;
    }
    return a;
}

// An append into an FP8 cache quantises with the cache's descale (i: 1 k, 2 v, of p).
kvcache::AppendParams quantised(kvcache::AppendParams a, const flash::DecParams& p, int i,
                                const at::Tensor& cache) {
    if (!is_fp8(cache.scalar_type()))
        return a;
    a.dst_fp8 = cache.scalar_type() == at::kFloat8_e4m3fn ? 1 : 2;
    a.descale = p.descale[i];
    a.descale_batch_stride = p.descale_batch_stride[i];
    a.descale_head_stride = p.descale_head_stride[i];
    return a;
}

// Adds an append into `dst` to the step's jobs: a cache (its rows at each sequence's positions)
// or a plain tensor shaped like the source.
void add_append(kvcache::AppendJobs& jobs, kvcache::AppendParams a, const at::Tensor& dst,
                bool cache) {
    a.dst = dst.data_ptr();
    a.dst_cache = cache;
    a.dst_batch_stride = dst.stride(0);
    a.dst_row_stride = dst.stride(1);
    a.dst_head_stride = dst.stride(2);
    check_cuda(kvcache::status_word(&a.status), "the KV-cache status word");
    jobs.job[jobs.count++] = a;
}

// A contiguous cache (batch_cache, seqlen_cache, Hk, D), its rows picked by cache_batch_idx.
at::Tensor set_contiguous_cache(flash::DecParams& p, const at::Tensor& cache,
                                const std::optional<at::Tensor>& cache_batch_idx, int64_t batch) {
    at::Tensor idx;
    if (cache_batch_idx.has_value()) {
        idx = int_meta(*cache_batch_idx, "cache_batch_idx", 1, cache.device(), "(batch,)");
        FA_CHECK_VALUE(idx.size(0) == batch, "cache_batch_idx has ", idx.size(0),
                       " entries; q has batch ", batch);
        p.cache_batch_idx = idx.data_ptr<int32_t>();
    } else {
        FA_CHECK_VALUE(cache.size(0) == batch, "batch of the cache (", cache.size(0),
                       ") differs from batch of q (", batch,
                       "); pass cache_batch_idx to pick "
                       "cache rows");
    }
    FA_CHECK_VALUE(cache.size(1) < (int64_t(1) << 31), "seqlen_cache exceeds 2^31 - 1");
    p.cache_batch = static_cast<int>(cache.size(0));
    p.capacity = static_cast<int>(cache.size(1));
    return idx;
}

// cache_leftpad (batch,) int32 of a contiguous cache: sequence b's keys start at its row
// cache_leftpad[b] (flash_attn's; a paged cache's first key is its first page's, as there).
// Checked against the lengths on the device (kStatusLeftpad), not read back.
at::Tensor set_leftpad(flash::DecParams& p, const std::optional<at::Tensor>& cache_leftpad,
                       bool paged, int64_t batch, const at::Device& device) {
    if (!cache_leftpad.has_value())
        return at::Tensor();
    FA_CHECK_VALUE(!paged,
                   "cache_leftpad does not go with block_table: a paged sequence starts at its "
                   "first page (give the block table the pages from the first key on)");
    at::Tensor pad = int_meta(*cache_leftpad, "cache_leftpad", 1, device, "(batch,)");
    FA_CHECK_VALUE(pad.size(0) == batch, "cache_leftpad has ", pad.size(0),
                   " entries; q has batch ", batch);
    p.leftpad_k = pad.data_ptr<int32_t>();
    return pad;
}

// The new rows k, v (batch, seqlen_new, Hk, D): their count (0 without them).
int64_t check_new_rows(const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                       const at::Tensor& q, int64_t kv_heads, int capacity, bool have_lengths) {
    FA_CHECK_VALUE(k.has_value() == v.has_value(), "give both k and v, or neither");
    if (!k)
        return 0;
    check_rank(*k, "k", 4, "(batch, seqlen_new, kv_heads, d_head)");
    FA_CHECK_VALUE(k->sizes() == v->sizes(), "k and v must have the same shape, got ", k->sizes(),
                   " and ", v->sizes());
    FA_CHECK_TYPE(k->scalar_type() == q.scalar_type() && v->scalar_type() == q.scalar_type(),
                  "k and v must have q's dtype ", q.scalar_type());
    FA_CHECK_VALUE(k->device() == q.device() && v->device() == q.device(),
                   "k and v must be on q's device");
    FA_CHECK_VALUE(k->size(0) == q.size(0) && k->size(2) == kv_heads && k->size(3) == q.size(3),
                   "k and v must be (batch, seqlen_new, kv_heads, d_head) = (", q.size(0),
                   ", seqlen_new, ", kv_heads, ", ", q.size(3), "), got ", k->sizes());
    FA_CHECK_VALUE(k->size(1) <= capacity, "k has ", k->size(1), " new rows; the cache holds ",
                   capacity, " per sequence");
    FA_CHECK_VALUE(have_lengths,
                   "appending k and v needs cache_seqlens: where each sequence's "
                   "new rows go");
    return k->size(1);
}

// The cache lengths before the append: a tensor on the device (read only there), one on the
// host (checked here, then copied over), an int (checked here), or none (the whole cache).
struct CacheLengths {
    at::Tensor device;     // (batch,) int32 on q's device, when given as a tensor
    int constant = -1;     // the int, when given as one (-1: none)
    int64_t longest = -1;  // the longest length known on the host (-1: unknown)
};

CacheLengths cache_lengths(const std::optional<at::Tensor>& tensor, int64_t value, int64_t batch,
                           int64_t new_rows, int capacity, const at::Device& device) {
    CacheLengths out;
    const auto fits = [&](int64_t length, const std::string& what) {
        FA_CHECK_VALUE(length >= 0 && length + new_rows <= capacity, what, " = ", length,
                       new_rows ? " plus the new rows " + std::to_string(new_rows) : "",
                       " does not fit the cache of ", capacity, " rows");
    };
    if (tensor.has_value()) {
        const at::Tensor& s = *tensor;
        FA_CHECK_TYPE(s.scalar_type() == at::kInt, "cache_seqlens must be int32, got ",
                      s.scalar_type());
        FA_CHECK_VALUE(s.dim() == 1 && s.size(0) == batch, "cache_seqlens must be (batch,) = (",
                       batch, ",), got shape ", s.sizes());
        if (!s.is_cpu()) {
            FA_CHECK_VALUE(s.device() == device,
                           "cache_seqlens must be on q's device or the CPU, "
                           "got ",
                           s.device());
            out.device = s.contiguous();
            return out;
        }
        const at::Tensor host = s.contiguous();
        const int32_t* v = host.data_ptr<int32_t>();
        for (int64_t b = 0; b < batch; ++b) {
            fits(v[b], "cache_seqlens[" + std::to_string(b) + "]");
            out.longest = std::max<int64_t>(out.longest, v[b]);
        }
        out.device = host.to(device, /*non_blocking=*/true);
    } else if (value >= 0) {
        fits(value, "cache_seqlens");
        out.constant = static_cast<int>(value);
        out.longest = value;
    }
    return out;
}

// rotary_cos, rotary_sin as the append reads them (their own dtype, q's or fp32; a copy only
// when a row is not contiguous), or undefined.
std::pair<at::Tensor, at::Tensor> check_rotary(const std::optional<at::Tensor>& cos,
                                               const std::optional<at::Tensor>& sin,
                                               const at::Tensor& q, bool have_lengths,
                                               int64_t longest, int64_t positions) {
    if (!cos.has_value() && !sin.has_value())
        return {};
    FA_CHECK_VALUE(cos.has_value() && sin.has_value(),
                   "give both rotary_cos and rotary_sin, or neither");
    FA_CHECK_VALUE(cos->dim() == 2 && cos->sizes() == sin->sizes(),
                   "rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2), got ",
                   cos->sizes(), " and ", sin->sizes());
    FA_CHECK_VALUE(cos->device() == q.device() && sin->device() == q.device(),
                   "rotary_cos and rotary_sin must be on q's device");
    const auto type = cos->scalar_type();
    FA_CHECK_TYPE((type == q.scalar_type() || type == at::kFloat) && sin->scalar_type() == type,
                  "rotary_cos and rotary_sin must have q's dtype or float32");
    FA_CHECK_VALUE(cos->size(1) > 0 && 2 * cos->size(1) <= q.size(-1),
                   "rotary_dim (2 x rotary_cos.shape[1] = ", 2 * cos->size(1),
                   ") must be in [2, d_head = ", q.size(-1), "]");
    FA_CHECK_VALUE(have_lengths, "rotary embedding needs cache_seqlens: the positions of q and k");
    FA_CHECK_VALUE(longest < 0 || longest + positions <= cos->size(0), "rotary_cos has ",
                   cos->size(0), " rows; positions up to ", longest + positions - 1, " are needed");
    const auto rows = [](const at::Tensor& t) {
        return t.size(1) > 1 && t.stride(1) != 1 ? t.contiguous() : t;
    };
    return {rows(*cos), rows(*sin)};
}

std::tuple<at::Tensor, at::Tensor> kvcache_cuda(
    const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
    const std::optional<at::Tensor>& rotary_cos, const std::optional<at::Tensor>& rotary_sin,
    const std::optional<at::Tensor>& cache_seqlens, int64_t cache_seqlen,
    const std::optional<at::Tensor>& cache_batch_idx, const std::optional<at::Tensor>& block_table,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    double softcap, bool rotary_interleaved, int64_t num_splits, bool return_lse,
    c10::string_view kernel_name, const std::optional<at::Tensor>& k_descale,
    const std::optional<at::Tensor>& v_descale, const std::optional<at::Tensor>& cache_leftpad) {
    // Checks, before anything is launched.
    const at::ScalarType dtype = check_query(q_in, 4, "(batch, seqlen_q, heads, d_head)");
    const bool paged = block_table.has_value();
    check_keys(k_cache, v_cache, "k_cache", "v_cache", 4,
               paged ? "(num_pages, page_size, kv_heads, d_head)"
                     : "(batch_cache, seqlen_cache, kv_heads, d_head)",
               q_in);
    const int64_t B = q_in.size(0), Sq = q_in.size(1), H = q_in.size(2), D = q_in.size(3);
    const int64_t Hk = k_cache.size(2);
    flash::DecParams p{};
    FA_CHECK_VALUE(!(paged && cache_batch_idx.has_value()),
                   "cache_batch_idx does not go with "
                   "block_table: a paged cache's rows are its block table's");
    const at::Tensor table = paged ? set_pages(p, *block_table, k_cache, B) : at::Tensor();
    const at::Tensor batch_idx =
        paged ? at::Tensor() : set_contiguous_cache(p, k_cache, cache_batch_idx, B);
    const at::Tensor leftpad = set_leftpad(p, cache_leftpad, paged, B, q_in.device());
    const bool have_lengths = cache_seqlens.has_value() || cache_seqlen >= 0;
    const int64_t S_new = check_new_rows(k_new, v_new, q_in, Hk, p.capacity, have_lengths);
    const CacheLengths lengths =
        cache_lengths(cache_seqlens, cache_seqlen, B, S_new, p.capacity, q_in.device());
    const bool q_per_row = causal || window_left >= 0;  // flash_attn's positions of q's rows
    const auto [cos, sin] = check_rotary(rotary_cos, rotary_sin, q_in, have_lengths,
                                         lengths.longest, std::max(S_new, q_per_row ? Sq : 1));
    set_descales(p, k_descale, v_descale, k_cache, B, Hk);
    at::Tensor out = at::empty(q_in.sizes(), q_in.options());
    at::Tensor lse = empty_lse(return_lse, {B, H, Sq}, q_in);
    set_queries(p, q_in, out, return_lse ? lse.data_ptr<float>() : nullptr, B, Hk, Sq, B * Sq);
    set_window(p, causal, window_left, window_right);
    set_scale(p, softmax_scale, softcap);
    const int64_t keys = lengths.longest >= 0 ? lengths.longest + S_new : p.capacity;
    const auto [kernel, splits] =
        choose_decode(kernel_name, dtype, k_cache.scalar_type(), D,
                      decode_call(p, keys, D, k_cache, num_splits, q_in.device()));
    check_device(*kernel, q_in.device());
    plan_splits(p, *kernel, splits, keys, q_in.device());

    // The append (q's rotated copy, the new rows into the caches), then attention over the
    // updated caches: cache_seqlens + S_new keys per sequence.
    const c10::cuda::CUDAGuard guard(q_in.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q_in.device().index()).stream();
    const bool bf16 = dtype == at::kBFloat16;
    const int* base = lengths.device.defined() ? lengths.device.data_ptr<int32_t>() : nullptr;
    const int base_const = std::max(lengths.constant, 0);
    at::Tensor q = unaddressable(q_in) != nullptr ? q_in.contiguous() : q_in;
    kvcache::AppendJobs jobs{};
    jobs.batch = static_cast<int>(B);
    if (cos.defined()) {
        q = at::empty(q_in.sizes(), q_in.options());
        add_append(jobs,
                   append_params(rows_source(q_in), p, base, base_const, q_per_row, cos, sin,
                                 rotary_interleaved),
                   q, /*cache=*/false);
    }
    if (S_new > 0) {
        add_append(jobs,
                   quantised(append_params(rows_source(*k_new), p, base, base_const, true, cos, sin,
                                           rotary_interleaved),
                             p, 1, k_cache),
                   k_cache, /*cache=*/true);
        add_append(jobs,
                   quantised(append_params(rows_source(*v_new), p, base, base_const, true,
                                           at::Tensor(), at::Tensor(), false),
                             p, 2, v_cache),
                   v_cache, /*cache=*/true);
    }
    // The keys each sequence has after the append: the lengths (on the device) plus S_new, or a
    // constant. The decode kernel copies its older keys' first blocks while the append runs.
    if (lengths.device.defined()) {
        p.seqused_k = lengths.device.data_ptr<int32_t>();
        p.seqused_add = static_cast<int>(S_new);
        p.seqlen_k = p.capacity;
    } else {
        p.seqlen_k =
            lengths.constant >= 0 ? static_cast<int>(lengths.constant + S_new) : p.capacity;
    }
    p.after_append = jobs.count > 0;
    p.new_keys = static_cast<int>(S_new);
    if (jobs.count > 0)
        check_cuda(kvcache::launch_appends(jobs, bf16, stream), "the KV-cache append");
    if (B == 0 || Sq == 0 || H == 0)
        return {out, lse};
    set_q(p, q);
    set_key_strides(p, k_cache, v_cache);
    launch_decode(p, *kernel, q_in, stream);
    return {out, lse};
}

// ---- flash_attn_varlen_func over a paged cache / seqused_k -------------------------------------

// q (total_q, H, D) packed by cu_seqlens_q; k, v (num_pages, page_size, Hk, D) with block_table
// (batch, max_pages), else (total_k, Hk, D) packed by cu_seqlens_k. Keys of sequence b:
// seqused_k[b] if given, else cu_seqlens_k's difference.
std::tuple<at::Tensor, at::Tensor> varlen_paged_cuda(
    const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& block_table,
    int64_t max_seqlen_q, int64_t max_seqlen_k, std::optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, double softcap, int64_t num_splits, bool return_lse,
    c10::string_view kernel_name, const std::optional<at::Tensor>& k_descale,
    const std::optional<at::Tensor>& v_descale) {
    const at::ScalarType dtype = check_query(q_in, 3, "(total_q, heads, d_head)");
    const bool paged = block_table.has_value();
    const int64_t rank = paged ? 4 : 3;
    check_keys(k, v, "k", "v", rank,
               paged ? "(num_pages, page_size, kv_heads, d_head)" : "(total_k, kv_heads, d_head)",
               q_in);
    const int64_t total_q = q_in.size(0), H = q_in.size(1), D = q_in.size(2);
    const at::Device device = q_in.device();
    const at::Tensor cu_q = int_meta(cu_seqlens_q, "cu_seqlens_q", 1, device, "(batch + 1,)");
    const at::Tensor cu_k = int_meta(cu_seqlens_k, "cu_seqlens_k", 1, device, "(batch + 1,)");
    FA_CHECK_VALUE(cu_q.numel() >= 2 && cu_k.numel() == cu_q.numel(),
                   "cu_seqlens_q and cu_seqlens_k must have the same length, batch + 1 >= 2");
    FA_CHECK_VALUE(max_seqlen_q >= 0 && max_seqlen_k >= 0, "max_seqlen_q/k must be >= 0");
    const int64_t B = cu_q.numel() - 1;
    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
    check_cu_seqlens_values(cu_q, "cu_seqlens_q", total_q, max_seqlen_q, stream);

    flash::DecParams p{};
    const at::Tensor table = paged ? set_pages(p, *block_table, k, B) : at::Tensor();
    if (!paged) {  // packed keys: sequence b's rows are its cu_seqlens_k range
        check_cu_seqlens_values(cu_k, "cu_seqlens_k", k.size(0), max_seqlen_k, stream);
        p.capacity = static_cast<int>(std::min<int64_t>(k.size(0), (int64_t(1) << 31) - 1));
        p.total_k = static_cast<int>(p.capacity);
    }
    const at::Tensor used = seqused_k.has_value()
                                ? int_meta(*seqused_k, "seqused_k", 1, device, "(batch,)")
                                : at::Tensor();
    FA_CHECK_VALUE(!used.defined() || used.size(0) == B, "seqused_k has ",
                   used.defined() ? used.size(0) : 0, " entries; the batch is ", B);
    p.seqused_k = used.defined() ? used.data_ptr<int32_t>() : nullptr;
    p.cu_seqlens_q = cu_q.data_ptr<int32_t>();
    p.cu_seqlens_k = cu_k.data_ptr<int32_t>();
    p.total_q = static_cast<int>(total_q);
    p.seqlen_k = static_cast<int>(max_seqlen_k);
    set_descales(p, k_descale, v_descale, k, B, k.size(rank - 2));
    at::Tensor out = at::empty(q_in.sizes(), q_in.options());
    at::Tensor lse = empty_lse(return_lse, {H, total_q}, q_in);
    set_queries(p, q_in, out, return_lse ? lse.data_ptr<float>() : nullptr, B, k.size(rank - 2),
                max_seqlen_q, total_q);
    set_window(p, causal, window_left, window_right);
    set_scale(p, softmax_scale, softcap);
    const int64_t keys = paged ? p.capacity : max_seqlen_k;
    const auto [kernel, splits] = choose_decode(kernel_name, dtype, k.scalar_type(), D,
                                                decode_call(p, keys, D, k, num_splits, device));
    check_device(*kernel, device);
    plan_splits(p, *kernel, splits, keys, device);
    if (B == 0 || total_q == 0 || H == 0 || max_seqlen_q == 0)
        return {out, lse};
    const at::Tensor q = unaddressable(q_in) != nullptr ? q_in.contiguous() : q_in;
    set_q(p, q);
    set_key_strides(p, k, v);
    launch_decode(p, *kernel, q_in, stream);
    return {out, lse};
}

}  // namespace

int64_t kvcache_status(int64_t device, bool clear) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    int value = 0;
    check_cuda(kvcache::read_status(clear, &value), "reading the KV-cache status word");
    return value;
}

}  // namespace flash::binding

TORCH_LIBRARY_FRAGMENT(flash_attention, m) {
    m.def(
        "kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
        "Tensor? rotary_cos, Tensor? rotary_sin, Tensor? cache_seqlens, int cache_seqlen, "
        "Tensor? cache_batch_idx, Tensor? block_table, float? softmax_scale, bool causal, "
        "int window_left, int window_right, float softcap, bool rotary_interleaved, "
        "int num_splits, bool return_lse, str kernel, Tensor? k_descale=None, "
        "Tensor? v_descale=None, Tensor? cache_leftpad=None) -> (Tensor out, Tensor lse)");
    m.def(
        "varlen_paged(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "Tensor? seqused_k, Tensor? block_table, int max_seqlen_q, int max_seqlen_k, "
        "float? softmax_scale, bool causal, int window_left, int window_right, float softcap, "
        "int num_splits, bool return_lse, str kernel, Tensor? k_descale=None, "
        "Tensor? v_descale=None) -> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(flash_attention, CUDA, m) {
    m.impl("kvcache", &flash::binding::kvcache_cuda);
    m.impl("varlen_paged", &flash::binding::varlen_paged_cuda);
}
