// The one translation unit that talks to torch. It registers the operators
//   flash_attention::attention(q, k, v, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q,
//       max_seqlen_k, softmax_scale?, causal, window_left, window_right, softcap, return_lse,
//       kernel) -> (out, lse)         the whole call, fixed-length or varlen (the fast path)
//   flash_attention::fwd(q, k, v, out!, lse!?, kernel, softmax_scale, window_left,
//       window_right, softcap) -> ()  into a given out
// (CUDA kernels here; fake implementations for tracing in flash_attention/ops.py), lists
// the kernels of this build (from the generated registry) and holds the dispatch table that
// flash_attention.dispatch computes once per process: with kernel == "" the operator runs the
// table's choice for (dtype, d_head, seqlen_q bucket, mask, softcap), a lookup with no Python
// on the call path. Every input is checked here, so no call can launch on bad input.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "binding/input_layout.h"
#include "registry.h"

namespace {

namespace layout = flash::binding;  // what the kernels can address (input_layout.h)

// Error messages are built here, numbers with std::to_string, and handed to TORCH_CHECK as one
// string: formatting a number through an ostream (what TORCH_CHECK does with its arguments)
// crashed inside this extension in a torch 2.11 process on the GPU machine, while strings were
// fine. FA_CHECK* take TORCH_CHECK*'s arguments and are evaluated only on failure.
void append(std::string& out, const char* s) {
    out += s;
}
void append(std::string& out, const std::string& s) {
    out += s;
}
void append(std::string& out, c10::string_view s) {
    out.append(s.data(), s.size());
}
void append(std::string& out, at::ScalarType t) {
    out += c10::toString(t);
}
void append(std::string& out, const c10::Device& d) {
    out += d.str();
}
void append(std::string& out, double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    out += buf;
}
// Numbers only: a bool or char argument does not compile (no overload prints them).
template <typename T,
          typename = std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                      !std::is_same_v<T, char>>>
void append(std::string& out, T v) {
    out += std::to_string(v);
}
void append(std::string& out, at::IntArrayRef sizes) {
    out += '[';
    for (size_t i = 0; i < sizes.size(); ++i)
        out += (i ? ", " : "") + std::to_string(sizes[i]);
    out += ']';
}

template <typename... Args>
std::string message(const Args&... args) {
    std::string out;
    (append(out, args), ...);
    return out;
}

#define FA_CHECK(cond, ...) TORCH_CHECK(cond, message(__VA_ARGS__))
#define FA_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, message(__VA_ARGS__))
#define FA_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, message(__VA_ARGS__))

const std::unordered_map<std::string, const flash::KernelEntry*>& entries_by_name() {
    static const auto table = [] {
        std::unordered_map<std::string, const flash::KernelEntry*> map;
        int count = 0;
        const flash::KernelEntry* const* entries = flash::kernel_registry(&count);
        for (int i = 0; i < count; ++i)
            map.emplace(entries[i]->name, entries[i]);
        return map;
    }();
    return table;
}

py::list list_kernels() {
    py::list out;
    int count = 0;
    const flash::KernelEntry* const* entries = flash::kernel_registry(&count);
    for (int i = 0; i < count; ++i) {
        const flash::KernelEntry& e = *entries[i];
        py::dict d;
        d["name"] = e.name;
        d["dtype"] = e.dtype == flash::DType::kFp16 ? "fp16" : "bf16";
        d["d_head"] = e.d_head;
        d["block_r"] = e.block_m;
        d["block_c"] = e.block_n;
        d["threads"] = e.threads;
        d["smem_bytes"] = e.smem_bytes;
        d["mask"] = e.mask;
        d["softcap"] = e.softcap;
        d["arch"] = e.arch;
        out.append(d);
    }
    return out;
}

// Device properties, read once per device (ATen's cached copy would pull in cuBLAS/cuSPARSE
// headers, which a minimal CUDA toolkit does not ship).
const cudaDeviceProp& device_properties(int device) {
    static std::mutex mutex;
    static std::unordered_map<int, cudaDeviceProp> cache;
    const std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(device);
    if (it == cache.end()) {
        cudaDeviceProp prop{};
        const cudaError_t err = cudaGetDeviceProperties(&prop, device);
        FA_CHECK(err == cudaSuccess, "cudaGetDeviceProperties failed: ", cudaGetErrorString(err));
        it = cache.emplace(device, prop).first;
    }
    return it->second;
}

// ---- dispatch table ---------------------------------------------------------------------------

// The sequence bucket of flash_attention.dispatch.seq_bucket: seqlen_q rounded up to a power of
// two, 64 .. 16384.
int64_t seq_bucket(int64_t seqlen_q) {
    int64_t bucket = 64;
    while (bucket < seqlen_q && bucket < 16384)
        bucket *= 2;
    return bucket;
}

// local: a sliding window bounded on the left (window_left != -1 after canonical_window); such
// rows may name another Hopper kernel than the masked ones (flash_attention.dispatch).
uint64_t choice_key(bool bf16, int64_t d_head, int64_t bucket, bool mask, bool local,
                    bool softcap) {
    return (uint64_t(bf16) << 40) | (uint64_t(d_head) << 24) | (uint64_t(bucket) << 3) |
           (uint64_t(mask) << 2) | (uint64_t(local && mask) << 1) | uint64_t(softcap);
}

// A row's kernel and its fallback: an sm80-family kernel that runs wherever the kernel (a Hopper
// one) cannot; the same entry when the kernel is an sm80 one.
struct Choice {
    const flash::KernelEntry* kernel;
    const flash::KernelEntry* fallback;
};

struct DispatchTable {
    std::mutex mutex;
    std::unordered_map<uint64_t, Choice> choices;
};

DispatchTable& dispatch_table() {
    static DispatchTable table;
    return table;
}

// Replaces the table: rows (dtype, d_head, bucket, mask, local, softcap, kernel name, fallback
// name).
void set_dispatch(const std::vector<std::tuple<std::string, int64_t, int64_t, bool, bool, bool,
                                               std::string, std::string>>& rows) {
    std::unordered_map<uint64_t, Choice> choices;
    const auto& by_name = entries_by_name();
    for (const auto& [dtype, d_head, bucket, mask, local, softcap, name, fallback] : rows) {
        const auto it = by_name.find(name);
        const auto fb = by_name.find(fallback);
        FA_CHECK(it != by_name.end() && fb != by_name.end(), "dispatch table names kernel ",
                 it == by_name.end() ? name : fallback, ", which is not in this build");
        FA_CHECK(fb->second->arch == 80, "dispatch table: fallback ", fallback,
                 " is not an sm80-family kernel");
        FA_CHECK(dtype == "fp16" || dtype == "bf16", "dispatch table: dtype ", dtype);
        choices[choice_key(dtype == "bf16", d_head, bucket, mask, local, softcap)] =
            Choice{it->second, fb->second};
    }
    DispatchTable& table = dispatch_table();
    const std::lock_guard<std::mutex> lock(table.mutex);
    table.choices = std::move(choices);
}

// The d_head variant that serves d_head (config.variant_for): variants are the multiples of 32,
// and a variant serves the multiples of 8 down to the variant below it.
int64_t d_head_variant(int64_t d_head) {
    return (d_head + 31) / 32 * 32;
}

// The table's choice for a call, {nullptr, nullptr} when it has none (keyed by variant).
Choice lookup(bool bf16, int64_t d_head, int64_t seqlen_q, bool mask, bool local, bool softcap) {
    if (d_head <= 0 || d_head % 8 != 0)
        return Choice{nullptr, nullptr};
    DispatchTable& table = dispatch_table();
    const std::lock_guard<std::mutex> lock(table.mutex);
    const auto it = table.choices.find(
        choice_key(bf16, d_head_variant(d_head), seq_bucket(seqlen_q), mask, local, softcap));
    return it == table.choices.end() ? Choice{nullptr, nullptr} : it->second;
}

// The table's kernel for a call ('' if none), before the run-time fallback (sm90_unfit).
std::string choice(const std::string& dtype, int64_t d_head, int64_t seqlen_q, bool mask,
                   bool softcap, bool local) {
    const flash::KernelEntry* e =
        lookup(dtype == "bf16", d_head, seqlen_q, mask, local, softcap).kernel;
    return e == nullptr ? "" : e->name;
}

// Why a Hopper (sm_90a) kernel cannot run this call, or nullptr when it can: the GPU must be
// sm_90, the batch fixed-length, and every tensor addressable by TMA (16-byte aligned base,
// strides of the dimensions it steps over positive multiples of 16 bytes; an expanded
// dimension, stride 0, runs on the sm80 family, which reads it in place).
const char* sm90_unfit(const cudaDeviceProp& prop, bool varlen,
                       std::initializer_list<const at::Tensor*> tensors) {
    if (prop.major != 9 || prop.minor != 0)
        return "the GPU is not sm_90";
    if (varlen)
        return "varlen batches run on the sm80-family kernels";
    for (const at::Tensor* t : tensors) {
        if (t->dim() != 4)
            return "not a (batch, seqlen, heads, d_head) tensor";
        if (reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0)
            return "a tensor's data is not 16-byte aligned";
        for (int64_t d = 0; d < 3; ++d)
            if (t->size(d) > 1 && (t->stride(d) * t->element_size()) % 16 != 0)
                return "a tensor stride is not a multiple of 16 bytes";
            else if (t->size(d) > 1 && t->stride(d) == 0)
                return "a tensor is expanded (stride 0)";
        if (t->size(1) == 0)
            return "an empty sequence";
    }
    return nullptr;
}

// ---- the operators ----------------------------------------------------------------------------

// Errors raise the Python exception a user expects: TypeError for a wrong type or dtype,
// ValueError for a wrong shape or value (TORCH_CHECK_TYPE / TORCH_CHECK_VALUE).

// Any strides are accepted: what the kernels cannot address is copied (binding/input_layout.h).
void check_rank(const at::Tensor& t, const char* name, int64_t rank, const char* dims) {
    FA_CHECK_VALUE(t.dim() == rank, name, " must be ", rank, "-D ", dims, ", got ", t.dim(), "-D");
}

// q (B, Sq, H, D) or varlen (total_q, H, D); the element type of q, k, v (and out).
at::ScalarType check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         bool varlen) {
    const int64_t rank = varlen ? 3 : 4;
    const char* dims = varlen ? "(total_tokens, heads, d_head)" : "(batch, seq, heads, d_head)";
    check_rank(q, "q", rank, dims);
    check_rank(k, "k", rank, dims);
    check_rank(v, "v", rank, dims);
    const auto dtype = q.scalar_type();
    FA_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16, "q has dtype ", dtype,
                  "; supported: torch.float16, torch.bfloat16");
    FA_CHECK_TYPE(k.scalar_type() == dtype && v.scalar_type() == dtype,
                  "q, k and v must share a dtype");
    FA_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have the same shape, got ", k.sizes(),
                   " and ", v.sizes());
    const int64_t D = q.size(rank - 1), H = q.size(rank - 2), Hk = k.size(rank - 2);
    FA_CHECK_VALUE(D > 0 && D % 8 == 0 && D <= 256, "d_head=", D,
                   " is not supported; supported: every multiple of 8 up to 256");
    FA_CHECK_VALUE(k.size(rank - 1) == D, "d_head of k/v (", k.size(rank - 1),
                   ") differs from d_head of q (", D, ")");
    FA_CHECK_VALUE((Hk == 0 && H == 0) || (Hk > 0 && H % Hk == 0), "heads of q (", H,
                   ") must be a multiple of heads of k/v (", Hk, ")");
    if (!varlen)
        FA_CHECK_VALUE(k.size(0) == q.size(0), "batch of k/v (", k.size(0),
                       ") differs from batch of q (", q.size(0), ")");
    FA_CHECK_VALUE(q.is_cuda(), "q, k and v are on ", q.device(),
                   "; flash_attention runs on CUDA tensors (use .cuda())");
    FA_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(),
                   "q, k and v must be on the same device");
    return dtype;
}

// cu_seqlens: int32, 1-D, contiguous, on q's device, batch + 1 entries.
void check_cu_seqlens_meta(const at::Tensor& cu, const char* name, const at::Device& device) {
    FA_CHECK_TYPE(cu.scalar_type() == at::kInt, name, " must be int32 (torch.int32), got ",
                  cu.scalar_type());
    FA_CHECK_VALUE(cu.dim() == 1 && cu.numel() >= 2, name,
                   " must be 1-D with batch + 1 >= 2 entries, got shape ", cu.sizes());
    FA_CHECK_VALUE(cu.device() == device, name, " must be on ", device, " (q's device), got ",
                   cu.device());
    FA_CHECK_VALUE(cu.is_contiguous(), name, " must be contiguous");
}

// The values of cu_seqlens, checked on the host before any launch: 0 first, non-decreasing,
// `total` last, no sequence longer than max_seqlen. A device-to-host copy (it synchronises), so
// a tensor already checked and not modified since (same TensorImpl, same version counter) is not
// read again: a model's layers reuse one cu_seqlens. The cache holds weak references: they keep
// a dead TensorImpl's memory from being reused by a new tensor (so an address match is the same
// object) without keeping it alive, whose last release would run Python code without the GIL.
// During CUDA graph capture device memory cannot be read; the kernel then clamps every offset
// into the tensors instead.
struct CheckedSeqlens {
    c10::weak_intrusive_ptr<c10::TensorImpl> impl;
    uint32_t version;
    int64_t total, max_seqlen;
};

void check_cu_seqlens_values(const at::Tensor& cu, const char* name, int64_t total,
                             int64_t max_seqlen, cudaStream_t stream) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FA_CHECK(cudaStreamIsCapturing(stream, &capture) == cudaSuccess,
             "cudaStreamIsCapturing failed");
    if (capture != cudaStreamCaptureStatusNone)
        return;
    static std::mutex mutex;
    static std::vector<CheckedSeqlens> checked;  // the last few, most recent last
    const uint32_t version = cu.unsafeGetTensorImpl()->version_counter().current_version();
    {
        const std::lock_guard<std::mutex> lock(mutex);
        for (const CheckedSeqlens& c : checked)
            if (c.impl._unsafe_get_target() == cu.unsafeGetTensorImpl() && c.version == version &&
                c.total == total && c.max_seqlen <= max_seqlen)
                return;
    }
    const at::Tensor host = cu.to(at::kCPU);
    const int32_t* values = host.data_ptr<int32_t>();
    const int64_t n = host.numel();
    FA_CHECK_VALUE(values[0] == 0, name, "[0] must be 0, got ", values[0]);
    int64_t longest = 0;
    for (int64_t i = 1; i < n; ++i) {
        FA_CHECK_VALUE(values[i] >= values[i - 1], name, " must be non-decreasing: ", name, "[", i,
                       "] = ", values[i], " < ", name, "[", i - 1, "] = ", values[i - 1]);
        longest = std::max<int64_t>(longest, values[i] - values[i - 1]);
    }
    FA_CHECK_VALUE(values[n - 1] == total, name, "[-1] = ", values[n - 1],
                   " must equal the number of tokens, ", total);
    FA_CHECK_VALUE(longest <= max_seqlen, "a sequence of ", longest, " tokens is longer than ",
                   name == std::string("cu_seqlens_q") ? "max_seqlen_q" : "max_seqlen_k", " = ",
                   max_seqlen);
    const std::lock_guard<std::mutex> lock(mutex);
    if (checked.size() >= 8)
        checked.erase(checked.begin());
    checked.push_back(
        {c10::weak_intrusive_ptr<c10::TensorImpl>(cu.getIntrusivePtr()), version, total, longest});
}

struct Varlen {
    const at::Tensor* cu_q = nullptr;
    const at::Tensor* cu_k = nullptr;
    int64_t max_q = 0, max_k = 0;
};

// The kernel for a call: `name`, or with "" the dispatch table's choice (with its fallback).
Choice choose_kernel(c10::string_view name, at::ScalarType dtype, int64_t d_head, int64_t seqlen_q,
                     bool mask, bool local, bool softcap) {
    if (name.empty()) {
        const Choice chosen =
            lookup(dtype == at::kBFloat16, d_head, seqlen_q, mask, local, softcap);
        FA_CHECK(chosen.kernel != nullptr, "this build has no kernel for ", dtype,
                 " with d_head=", d_head, mask ? " with masks" : "",
                 softcap ? " with a softcap" : "",
                 " (or flash_attention has not set its dispatch table); rebuild with "
                 "FLASH_ATTENTION_KERNELS=default");
        return chosen;
    }
    const auto& table = entries_by_name();
    const auto it = table.find(std::string(name));
    FA_CHECK(it != table.end(), "kernel ", name,
             " is not in this build; rebuild with FLASH_ATTENTION_KERNELS=", name,
             " (comma-separate to add more)");
    return Choice{it->second, nullptr};
}

// Runs q (B, Sq, H, D), k/v (B, Sk, Hk, D) into out (B, Sq, H, D) and, if given, lse (B, H, Sq)
// fp32 contiguous; varlen: q/out (total_q, H, D), k/v (total_k, Hk, D), lse (H, total_q).
// window_left/right: -1 unbounded (causal is -1, 0); they need a kernel with masks unless both
// are -1. softcap: 0 off, else a kernel built for it. Any strides: what the kernels cannot
// address goes through a copy (binding/input_layout.h); out_is_fresh: out was allocated by the
// operator (contiguous, shares no memory), so its layout needs no test.
void run_forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                 const at::Tensor& out, bool out_is_fresh, const std::optional<at::Tensor>& lse,
                 const Varlen& vl, c10::string_view name, double softmax_scale, int64_t window_left,
                 int64_t window_right, double softcap) {
    const bool varlen = vl.cu_q != nullptr;
    const at::ScalarType dtype = check_qkv(q_in, k_in, v_in, varlen);
    const int64_t rank = q_in.dim();
    const int64_t D = q_in.size(rank - 1), H = q_in.size(rank - 2), Hk = k_in.size(rank - 2);
    const int64_t B = varlen ? vl.cu_q->numel() - 1 : q_in.size(0);
    const int64_t Sq = varlen ? vl.max_q : q_in.size(1), Sk = varlen ? vl.max_k : k_in.size(1);
    const bool mask = window_left != -1 || window_right != -1;
    const Choice chosen = choose_kernel(name, dtype, D, Sq, mask, window_left != -1, softcap > 0);
    // The kernel and its fallback share dtype, d_head variant, masks and softcap: the checks
    // below hold for whichever runs.
    const flash::KernelEntry& c = *chosen.kernel;
    const auto device = q_in.device();

    const auto want = c.dtype == flash::DType::kFp16 ? at::kHalf : at::kBFloat16;
    FA_CHECK_TYPE(dtype == want, "kernel ", c.name, " needs ", want, " tensors");
    FA_CHECK_VALUE(D <= c.d_head, "kernel ", c.name, " serves d_head multiples of 8 up to ",
                   c.d_head, ", got ", D);
    check_rank(out, "out", rank, "like q");
    FA_CHECK_VALUE(out.sizes() == q_in.sizes(), "out must have the shape of q ", q_in.sizes(),
                   ", got ", out.sizes());
    FA_CHECK_TYPE(out.scalar_type() == dtype, "out must have dtype ", dtype);
    FA_CHECK_VALUE(B <= 65535 && H <= 65535, "batch (", B, ") and heads (", H,
                   ") must each be at most 65535");
    // kMaxSeqlen leaves room for the largest tile past the last row in 32-bit row indices.
    constexpr int64_t kMaxSeqlen = std::numeric_limits<int>::max() - 256;
    FA_CHECK_VALUE(Sq <= kMaxSeqlen && Sk <= kMaxSeqlen &&
                       q_in.size(0) <= std::numeric_limits<int>::max() &&
                       k_in.size(0) <= std::numeric_limits<int>::max(),
                   "sequence lengths and token counts must be at most 2^31 - 257");
    FA_CHECK_VALUE(std::isfinite(softmax_scale) && softmax_scale > 0,
                   "softmax_scale must be finite and positive, got ", softmax_scale);
    FA_CHECK_VALUE(window_left >= -1 && window_right >= -1 &&
                       window_left <= std::numeric_limits<int>::max() &&
                       window_right <= std::numeric_limits<int>::max(),
                   "window sizes must be -1 (unbounded) or in [0, 2^31)");
    FA_CHECK_VALUE(c.mask || !mask, "kernel ", c.name,
                   " has no masks (config flag m): it cannot run causal or windowed attention");
    FA_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0,
                   "softcap must be 0 (off) or finite and positive, got ", softcap);
    FA_CHECK_VALUE(c.softcap == (softcap > 0), "kernel ", c.name,
                   c.softcap ? " applies a softcap: call it with softcap > 0"
                             : " has no softcap (config flag t)");
    FA_CHECK_VALUE(out.device() == device, "out must be on ", device);
    FA_CHECK_VALUE(out_is_fresh || layout::elements_distinct(out),
                   "out has elements that share memory (an expanded tensor: a stride of 0?); "
                   "pass a tensor whose elements are distinct, e.g. torch.empty_like(q)");
    const int64_t lse_rows = varlen ? q_in.size(0) : Sq;
    if (lse) {
        const bool shape_ok =
            varlen
                ? (lse->dim() == 2 && lse->size(0) == H && lse->size(1) == lse_rows)
                : (lse->dim() == 3 && lse->size(0) == B && lse->size(1) == H && lse->size(2) == Sq);
        FA_CHECK_VALUE(lse->device() == device && lse->scalar_type() == at::kFloat &&
                           lse->is_contiguous() && shape_ok,
                       "lse must be a contiguous fp32 ",
                       varlen ? "(heads, total_q)" : "(batch, heads, seqlen_q)",
                       " tensor on q's device");
    }
    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
    if (varlen) {
        check_cu_seqlens_meta(*vl.cu_q, "cu_seqlens_q", device);
        check_cu_seqlens_meta(*vl.cu_k, "cu_seqlens_k", device);
        FA_CHECK_VALUE(vl.cu_k->numel() == vl.cu_q->numel(),
                       "cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1)");
        FA_CHECK_VALUE(vl.max_q >= 0 && vl.max_k >= 0, "max_seqlen_q/k must be >= 0");
        check_cu_seqlens_values(*vl.cu_q, "cu_seqlens_q", q_in.size(0), vl.max_q, stream);
        check_cu_seqlens_values(*vl.cu_k, "cu_seqlens_k", k_in.size(0), vl.max_k, stream);
    }
    if (B == 0 || Sq == 0 || H == 0 || q_in.size(0) == 0)
        return;
    if (!varlen && Sk == 0) {  // no key for any row: out 0, LSE -inf
        out.zero_();
        if (lse)
            lse->fill_(-std::numeric_limits<float>::infinity());
        return;
    }

    const cudaDeviceProp& prop = device_properties(device.index());
    FA_CHECK(prop.major >= 8,
             "FlashAttention kernels need compute capability 8.0 or newer, this GPU has ",
             prop.major, ".", prop.minor);

    // The tensors as the kernels address them: the caller's, or copies (input_layout.h).
    const c10::MaybeOwned<at::Tensor> q_addr = layout::addressable(q_in);
    const c10::MaybeOwned<at::Tensor> k_addr = layout::addressable(k_in);
    const c10::MaybeOwned<at::Tensor> v_addr = layout::addressable(v_in);
    const at::Tensor &q = *q_addr, &k = *k_addr, &v = *v_addr;
    const bool out_direct =
        out_is_fresh ||
        (layout::unaddressable(out) == nullptr && !layout::spans_overlap(out, q_in) &&
         !layout::spans_overlap(out, k_in) && !layout::spans_overlap(out, v_in));
    const c10::MaybeOwned<at::Tensor> out_addr =
        out_direct ? c10::MaybeOwned<at::Tensor>::borrowed(out)
                   : c10::MaybeOwned<at::Tensor>::owned(at::empty(q_in.sizes(), q_in.options()));
    const at::Tensor& o = *out_addr;

    const flash::KernelEntry* pick = chosen.kernel;
    if (pick->arch == 90) {
        if (const char* why = sm90_unfit(prop, varlen, {&q, &k, &v, &o})) {
            FA_CHECK(chosen.fallback != nullptr, "kernel ", pick->name,
                     " (sm_90a) cannot run this call: ", why);
            pick = chosen.fallback;
        }
    }
    const flash::KernelEntry& e = *pick;
    FA_CHECK(static_cast<size_t>(e.smem_bytes) <= prop.sharedMemPerBlockOptin, "kernel ", e.name,
             " needs ", e.smem_bytes, " bytes of shared memory per block; this GPU allows ",
             prop.sharedMemPerBlockOptin);

    flash::FwdParams p{};
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.o = o.data_ptr();
    p.lse = lse ? lse->data_ptr<float>() : nullptr;
    // Strides by role: (batch, row, head); varlen tensors have no batch dimension.
    const int r = varlen ? 0 : 1;
    p.q_batch_stride = varlen ? 0 : q.stride(0);
    p.q_row_stride = q.stride(r);
    p.q_head_stride = q.stride(r + 1);
    p.k_batch_stride = varlen ? 0 : k.stride(0);
    p.k_row_stride = k.stride(r);
    p.k_head_stride = k.stride(r + 1);
    p.v_batch_stride = varlen ? 0 : v.stride(0);
    p.v_row_stride = v.stride(r);
    p.v_head_stride = v.stride(r + 1);
    p.o_batch_stride = varlen ? 0 : o.stride(0);
    p.o_row_stride = o.stride(r);
    p.o_head_stride = o.stride(r + 1);
    p.lse_batch_stride = varlen ? 0 : H * Sq;
    p.lse_head_stride = lse_rows;
    p.batch = static_cast<int>(B);
    p.heads = static_cast<int>(H);
    p.heads_per_kv = static_cast<int>(H / Hk);
    p.seqlen_q = static_cast<int>(Sq);
    p.seqlen_k = static_cast<int>(Sk);
    p.d_head = static_cast<int>(D);
    // With a softcap, scores become softcap * tanh(scale * s / softcap): the kernel applies
    // scale / softcap inside the tanh and folds softcap into the exp2 scale.
    p.scale_log2 = static_cast<float>((softcap > 0 ? softcap : softmax_scale) * M_LOG2E);
    p.softcap_scale = static_cast<float>(softcap > 0 ? softmax_scale / softcap : 0.0);
    p.window_left = static_cast<int>(window_left);
    p.window_right = static_cast<int>(window_right);
    if (varlen) {
        p.cu_seqlens_q = vl.cu_q->data_ptr<int32_t>();
        p.cu_seqlens_k = vl.cu_k->data_ptr<int32_t>();
        p.total_q = static_cast<int>(q.size(0));
        p.total_k = static_cast<int>(k.size(0));
    }

    at::Tensor tile_counter;  // zeroed by the launcher on the stream; freed in stream order
    if (e.tile_counter) {
        tile_counter = at::empty({1}, q.options().dtype(at::kInt));
        p.tile_counter = tile_counter.data_ptr<int>();
    }
    const cudaError_t err = e.launch(p, stream);
    FA_CHECK(err == cudaSuccess, "launch of kernel ", e.name, " failed: ", cudaGetErrorString(err));
    if (!out_direct)
        out.copy_(o);
}

// What dispatch runs for a fixed-length call and why (for debug logging): the table's kernel,
// or its fallback with the reason the Hopper kernel cannot run the call, and the inputs copied
// because the kernels cannot address them (input_layout.h). The window is the operator's
// (canonical_window: causal folded in, sides that bound nothing -1).
std::string explain(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    int64_t window_left, int64_t window_right, bool softcap) {
    const int64_t D = q.size(-1);
    const bool mask = window_left != -1 || window_right != -1;
    const Choice c =
        lookup(q.scalar_type() == at::kBFloat16, D, q.size(1), mask, window_left != -1, softcap);
    if (c.kernel == nullptr)
        return "no kernel in the dispatch table";
    std::string copies;
    const std::pair<const char*, const at::Tensor*> inputs[] = {{"q", &q}, {"k", &k}, {"v", &v}};
    for (const auto& [name, t] : inputs)
        if (const char* why = layout::unaddressable(*t))
            copies += message(", copies ", name, " (", why, ")");
    if (c.kernel->arch != 90)
        return c.kernel->name + copies;
    const auto qa = layout::addressable(q), ka = layout::addressable(k),
               va = layout::addressable(v);
    const char* why = sm90_unfit(device_properties(q.device().index()), false, {&*qa, &*ka, &*va});
    return why == nullptr
               ? c.kernel->name + copies
               : message(c.fallback->name, " (not ", c.kernel->name, ": ", why, ")", copies);
}

// How the operator will address each tensor of a call (input_layout.h), for tests and debug
// logging; reads only metadata, so CPU tensors do too: {name: "" (in place) or why a copy}, and
// for out "refused: ..." when its elements overlap.
py::dict layout_report(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& out) {
    py::dict report;
    const std::pair<const char*, const at::Tensor*> inputs[] = {{"q", &q}, {"k", &k}, {"v", &v}};
    for (const auto& [name, t] : inputs) {
        const char* why = layout::unaddressable(*t);
        report[name] = why == nullptr ? "" : why;
    }
    if (out) {
        if (!layout::elements_distinct(*out))
            report["out"] = "refused: its elements share memory";
        else if (const char* why = layout::unaddressable(*out))
            report["out"] = why;
        else if (layout::spans_overlap(*out, q) || layout::spans_overlap(*out, k) ||
                 layout::spans_overlap(*out, v))
            report["out"] = "its memory overlaps q, k or v";
        else
            report["out"] = "";
    }
    return report;
}

// flash_attention::fwd: fixed-length batches into a given out (and lse).
void fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const std::optional<at::Tensor>& lse, c10::string_view name, double softmax_scale,
              int64_t window_left, int64_t window_right, double softcap) {
    run_forward(q, k, v, out, /*out_is_fresh=*/false, lse, Varlen{}, name, softmax_scale,
                window_left, window_right, softcap);
}

// (left, right) with causal folded in (right = 0) and every side that bounds nothing written as
// -1; mirrors flash_attention.masks.canonical_window.
std::pair<int64_t, int64_t> canonical_window(bool causal, int64_t left, int64_t right,
                                             int64_t seqlen_q, int64_t seqlen_k) {
    if (causal)
        right = 0;
    if (left >= seqlen_k)
        left = -1;
    if (right >= seqlen_q)
        right = -1;
    return {left, right};
}

// flash_attention::attention: the whole call in C++ (defaults, window, allocation, checks,
// dispatch, launch), so the Python functions above it are a single operator call. Returns out
// and lse; lse is empty unless return_lse. With cu_seqlens_q/k the batch is varlen.
std::tuple<at::Tensor, at::Tensor> attention_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, std::optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, double softcap, bool return_lse,
    c10::string_view kernel) {
    FA_CHECK_VALUE(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(),
                   "give both cu_seqlens_q and cu_seqlens_k, or neither");
    const bool varlen = cu_seqlens_q.has_value();
    Varlen vl;
    if (varlen) {
        vl.cu_q = &*cu_seqlens_q;
        vl.cu_k = &*cu_seqlens_k;
        vl.max_q = max_seqlen_q;
        vl.max_k = max_seqlen_k;
    }
    check_rank(q, "q", varlen ? 3 : 4,
               varlen ? "(total_tokens, heads, d_head)" : "(batch, seq, heads, d_head)");
    const int64_t D = q.size(-1);
    const int64_t Sq = varlen ? max_seqlen_q : q.size(1);
    const int64_t Sk = varlen ? max_seqlen_k : (k.dim() == 4 ? k.size(1) : 0);
    const double scale = softmax_scale ? *softmax_scale : 1.0 / std::sqrt(double(D > 0 ? D : 1));
    FA_CHECK_VALUE(window_left >= -1 && window_right >= -1,
                   "window_size sides must be -1 (unbounded) or >= 0, got (", window_left, ", ",
                   window_right, ")");
    const auto [left, right] = canonical_window(causal, window_left, window_right, Sq, Sk);
    at::Tensor out = at::empty(q.sizes(), q.options());
    at::Tensor lse;
    if (return_lse) {
        const auto lse_shape = varlen ? std::vector<int64_t>{q.size(1), q.size(0)}
                                      : std::vector<int64_t>{q.size(0), q.size(2), q.size(1)};
        lse = at::empty(lse_shape, q.options().dtype(at::kFloat));
    } else {
        lse = at::empty({0}, q.options().dtype(at::kFloat));
    }
    run_forward(q, k, v, out, /*out_is_fresh=*/true,
                return_lse ? std::optional<at::Tensor>(lse) : std::nullopt, vl, kernel, scale, left,
                right, softcap);
    return {out, lse};
}

}  // namespace

TORCH_LIBRARY(flash_attention, m) {
    m.def(
        "fwd(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!)? lse, str kernel, "
        "float softmax_scale, int window_left, int window_right, float softcap) -> ()");
    m.def(
        "attention(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
        "int max_seqlen_q, int max_seqlen_k, float? softmax_scale, bool causal, "
        "int window_left, int window_right, float softcap, bool return_lse, str kernel) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flash_attention, CUDA, m) {
    m.impl("fwd", &fwd_cuda);
    m.impl("attention", &attention_cuda);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashAttention-2 forward kernels (see flash_attention for the Python API)";
    m.def("kernels", &list_kernels, "the kernels of this build, in config-set order");
    m.def("set_dispatch", &set_dispatch,
          "replace the dispatch table: rows (dtype, d_head, bucket, mask, local, softcap, kernel, "
          "fallback)");
    m.def("layout_report", &layout_report,
          "how the operator addresses q, k, v (and out): '' in place, else why it copies",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out") = py::none());
    m.def("explain", &explain, "the kernel a fixed-length call runs, and why not a Hopper one");
    m.def("choice", &choice, "the dispatch table's kernel for a call ('' if none)",
          py::arg("dtype"), py::arg("d_head"), py::arg("seqlen_q"), py::arg("mask"),
          py::arg("softcap"), py::arg("local") = false);
}
