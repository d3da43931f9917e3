// The one translation unit that talks to torch. It registers the operator
//   flash_attention::fwd(q, k, v, out!, lse!?, kernel, softmax_scale, window_left,
//                        window_right, softcap) -> ()
// (its CUDA kernel here; its fake implementation for tracing in flash_attention/ops.py), lists
// the kernels of this build (from the generated registry) and holds the dispatch table that
// flash_attention.dispatch computes once per process: with kernel == "" the operator runs the
// table's choice for (dtype, d_head, seqlen_q bucket, mask, softcap), a lookup with no Python
// on the call path. Every input is checked here, so no call can launch on bad input.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "registry.h"

namespace {

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
        TORCH_CHECK(err == cudaSuccess,
                    "cudaGetDeviceProperties failed: ", cudaGetErrorString(err));
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

uint64_t choice_key(bool bf16, int64_t d_head, int64_t bucket, bool mask, bool softcap) {
    return (uint64_t(bf16) << 40) | (uint64_t(d_head) << 24) | (uint64_t(bucket) << 2) |
           (uint64_t(mask) << 1) | uint64_t(softcap);
}

struct DispatchTable {
    std::mutex mutex;
    std::unordered_map<uint64_t, const flash::KernelEntry*> choices;
};

DispatchTable& dispatch_table() {
    static DispatchTable table;
    return table;
}

// Replaces the table: rows (dtype, d_head, bucket, mask, softcap, kernel name).
void set_dispatch(
    const std::vector<std::tuple<std::string, int64_t, int64_t, bool, bool, std::string>>& rows) {
    std::unordered_map<uint64_t, const flash::KernelEntry*> choices;
    const auto& by_name = entries_by_name();
    for (const auto& [dtype, d_head, bucket, mask, softcap, name] : rows) {
        const auto it = by_name.find(name);
        TORCH_CHECK(it != by_name.end(), "dispatch table names kernel ", name,
                    ", which is not in this build");
        TORCH_CHECK(dtype == "fp16" || dtype == "bf16", "dispatch table: dtype ", dtype);
        choices[choice_key(dtype == "bf16", d_head, bucket, mask, softcap)] = it->second;
    }
    DispatchTable& table = dispatch_table();
    const std::lock_guard<std::mutex> lock(table.mutex);
    table.choices = std::move(choices);
}

// The table's kernel for a call, nullptr when it has none.
const flash::KernelEntry* lookup(bool bf16, int64_t d_head, int64_t seqlen_q, bool mask,
                                 bool softcap) {
    DispatchTable& table = dispatch_table();
    const std::lock_guard<std::mutex> lock(table.mutex);
    const auto it =
        table.choices.find(choice_key(bf16, d_head, seq_bucket(seqlen_q), mask, softcap));
    return it == table.choices.end() ? nullptr : it->second;
}

std::string choice(const std::string& dtype, int64_t d_head, int64_t seqlen_q, bool mask,
                   bool softcap) {
    const flash::KernelEntry* e = lookup(dtype == "bf16", d_head, seqlen_q, mask, softcap);
    return e == nullptr ? "" : e->name;
}

// ---- the operator -----------------------------------------------------------------------------

void check_bshd(const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
    TORCH_CHECK(t.dim() == 4, name, " must be 4-D (batch, seq, heads, d_head), got ", t.dim(),
                "-D");
    TORCH_CHECK(t.stride(3) == 1, name, " must have a contiguous last dimension");
}

// Runs a kernel on q (B, Sq, H, D), k/v (B, Sk, Hk, D) into out (B, Sq, H, D) and, if given,
// lse (B, H, Sq) fp32 contiguous: kernel `name`, or with "" the dispatch table's choice.
// window_left/right: -1 unbounded (causal is -1, 0); they need a kernel with masks unless both
// are -1. softcap: 0 off, else a kernel built for it.
void fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const std::optional<at::Tensor>& lse, c10::string_view name, double softmax_scale,
              int64_t window_left, int64_t window_right, double softcap) {
    check_bshd(q, "q");
    const bool mask = window_left != -1 || window_right != -1;
    const flash::KernelEntry* chosen = nullptr;
    if (name.empty()) {
        TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                    "q must be fp16 or bf16, got ", q.scalar_type());
        chosen = lookup(q.scalar_type() == at::kBFloat16, q.size(3), q.size(1), mask, softcap > 0);
        TORCH_CHECK(chosen != nullptr, "this build has no kernel for ", q.scalar_type(),
                    " with d_head=", q.size(3), mask ? " with masks" : "",
                    softcap > 0 ? " with a softcap" : "",
                    " (or flash_attention has not set its dispatch table); rebuild with "
                    "FLASH_ATTENTION_KERNELS=default");
    } else {
        const auto& table = entries_by_name();
        const auto it = table.find(std::string(name));
        TORCH_CHECK(it != table.end(), "kernel ", name,
                    " is not in this build; rebuild with FLASH_ATTENTION_KERNELS=", name,
                    " (comma-separate to add more)");
        chosen = it->second;
    }
    const flash::KernelEntry& e = *chosen;

    check_bshd(k, "k");
    check_bshd(v, "v");
    check_bshd(out, "out");
    const auto want = e.dtype == flash::DType::kFp16 ? at::kHalf : at::kBFloat16;
    for (const at::Tensor* t : {&q, &k, &v, &out})
        TORCH_CHECK(t->scalar_type() == want, "kernel ", e.name, " needs ", want, " tensors");
    const int64_t B = q.size(0), Sq = q.size(1), H = q.size(2), D = q.size(3);
    const int64_t Sk = k.size(1), Hk = k.size(2);
    TORCH_CHECK(D == e.d_head, "kernel ", e.name, " is for d_head=", e.d_head, ", got ", D);
    TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have the same shape");
    TORCH_CHECK(k.size(0) == B && k.size(3) == D, "k/v batch and d_head must match q");
    TORCH_CHECK(Hk > 0 && H % Hk == 0, "heads of q (", H, ") must be a multiple of heads of k/v (",
                Hk, ")");
    TORCH_CHECK(out.sizes() == q.sizes(), "out must have the shape of q");
    TORCH_CHECK(B <= 65535 && H <= 65535, "batch and heads must each be at most 65535");
    TORCH_CHECK(Sq <= std::numeric_limits<int>::max() - e.block_m &&
                    Sk <= std::numeric_limits<int>::max() - e.block_n,
                "sequence lengths must be below 2^31");
    TORCH_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0,
                "softmax_scale must be finite and positive");
    TORCH_CHECK(window_left >= -1 && window_right >= -1 &&
                    window_left <= std::numeric_limits<int>::max() &&
                    window_right <= std::numeric_limits<int>::max(),
                "window sizes must be -1 (unbounded) or in [0, 2^31)");
    TORCH_CHECK(e.mask || (window_left == -1 && window_right == -1), "kernel ", e.name,
                " has no masks (config flag m): it cannot run causal or windowed attention");
    TORCH_CHECK(std::isfinite(softcap) && softcap >= 0, "softcap must be finite and >= 0");
    TORCH_CHECK(e.softcap == (softcap > 0), "kernel ", e.name,
                e.softcap ? " applies a softcap: call it with softcap > 0"
                          : " has no softcap (config flag t)");
    const auto device = q.device();
    for (const at::Tensor* t : {&k, &v, &out})
        TORCH_CHECK(t->device() == device, "all tensors must be on the same device");
    if (lse) {
        TORCH_CHECK(lse->device() == device && lse->scalar_type() == at::kFloat &&
                        lse->is_contiguous() && lse->dim() == 3 && lse->size(0) == B &&
                        lse->size(1) == H && lse->size(2) == Sq,
                    "lse must be a contiguous fp32 (batch, heads, seqlen_q) tensor on q's device");
    }
    if (B == 0 || Sq == 0 || H == 0)
        return;
    if (Sk == 0) {  // no key for any row: out 0, LSE -inf
        out.zero_();
        if (lse)
            lse->fill_(-std::numeric_limits<float>::infinity());
        return;
    }

    const c10::cuda::CUDAGuard guard(device);
    const cudaDeviceProp& prop = device_properties(device.index());
    TORCH_CHECK(prop.major >= 8,
                "FlashAttention kernels need compute capability 8.0 or newer, "
                "this GPU has ",
                prop.major, ".", prop.minor);
    TORCH_CHECK(static_cast<size_t>(e.smem_bytes) <= prop.sharedMemPerBlockOptin, "kernel ", e.name,
                " needs ", e.smem_bytes, " bytes of shared memory per block; this GPU allows ",
                prop.sharedMemPerBlockOptin);

    flash::FwdParams p{};
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.o = out.data_ptr();
    p.lse = lse ? lse->data_ptr<float>() : nullptr;
    p.q_batch_stride = q.stride(0);
    p.q_row_stride = q.stride(1);
    p.q_head_stride = q.stride(2);
    p.k_batch_stride = k.stride(0);
    p.k_row_stride = k.stride(1);
    p.k_head_stride = k.stride(2);
    p.v_batch_stride = v.stride(0);
    p.v_row_stride = v.stride(1);
    p.v_head_stride = v.stride(2);
    p.o_batch_stride = out.stride(0);
    p.o_row_stride = out.stride(1);
    p.o_head_stride = out.stride(2);
    p.batch = static_cast<int>(B);
    p.heads = static_cast<int>(H);
    p.heads_per_kv = static_cast<int>(H / Hk);
    p.seqlen_q = static_cast<int>(Sq);
    p.seqlen_k = static_cast<int>(Sk);
    // With a softcap, scores become softcap * tanh(scale * s / softcap): the kernel applies
    // scale / softcap inside the tanh and folds softcap into the exp2 scale.
    p.scale_log2 = static_cast<float>((softcap > 0 ? softcap : softmax_scale) * M_LOG2E);
    p.softcap_scale = static_cast<float>(softcap > 0 ? softmax_scale / softcap : 0.0);
    p.window_left = static_cast<int>(window_left);
    p.window_right = static_cast<int>(window_right);

    const cudaError_t err = e.launch(p, c10::cuda::getCurrentCUDAStream(device.index()).stream());
    TORCH_CHECK(err == cudaSuccess, "launch of kernel ", e.name,
                " failed: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY(flash_attention, m) {
    m.def(
        "fwd(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!)? lse, str kernel, "
        "float softmax_scale, int window_left, int window_right, float softcap) -> ()");
}

TORCH_LIBRARY_IMPL(flash_attention, CUDA, m) {
    m.impl("fwd", &fwd_cuda);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashAttention-2 forward kernels (see flash_attention for the Python API)";
    m.def("kernels", &list_kernels, "the kernels of this build, in config-set order");
    m.def("set_dispatch", &set_dispatch,
          "replace the dispatch table: rows (dtype, d_head, bucket, mask, softcap, kernel)");
    m.def("choice", &choice, "the dispatch table's kernel for a call ('' if none)",
          py::arg("dtype"), py::arg("d_head"), py::arg("seqlen_q"), py::arg("mask"),
          py::arg("softcap"));
}
