// The one translation unit that talks to torch: it lists the kernels of this build (from the
// generated registry) and runs one of them on tensors the Python layer has validated. Checks are
// repeated here so that a direct call of the extension cannot launch on bad input either.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>

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

void check_bshd(const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
    TORCH_CHECK(t.dim() == 4, name, " must be 4-D (batch, seq, heads, d_head), got ", t.dim(),
                "-D");
    TORCH_CHECK(t.stride(3) == 1, name, " must have a contiguous last dimension");
}

// Runs kernel `name` on q (B, Sq, H, D), k/v (B, Sk, Hk, D) into out (B, Sq, H, D) and, if given,
// lse (B, H, Sq) fp32 contiguous.
void forward(const std::string& name, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const at::Tensor& out, std::optional<at::Tensor> lse, double softmax_scale) {
    const auto& table = entries_by_name();
    const auto it = table.find(name);
    TORCH_CHECK(it != table.end(), "kernel ", name, " is not in this build");
    const flash::KernelEntry& e = *it->second;

    check_bshd(q, "q");
    check_bshd(k, "k");
    check_bshd(v, "v");
    check_bshd(out, "out");
    const auto want = e.dtype == flash::DType::kFp16 ? at::kHalf : at::kBFloat16;
    for (const at::Tensor* t : {&q, &k, &v, &out})
        TORCH_CHECK(t->scalar_type() == want, "kernel ", name, " needs ", want, " tensors");
    const int64_t B = q.size(0), Sq = q.size(1), H = q.size(2), D = q.size(3);
    const int64_t Sk = k.size(1), Hk = k.size(2);
    TORCH_CHECK(D == e.d_head, "kernel ", name, " is for d_head=", e.d_head, ", got ", D);
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
    TORCH_CHECK(Sk > 0, "seqlen_k must be positive (the Python API handles empty keys)");

    const c10::cuda::CUDAGuard guard(device);
    const cudaDeviceProp& prop = device_properties(device.index());
    TORCH_CHECK(prop.major >= 8,
                "FlashAttention kernels need compute capability 8.0 or newer, "
                "this GPU has ",
                prop.major, ".", prop.minor);
    TORCH_CHECK(static_cast<size_t>(e.smem_bytes) <= prop.sharedMemPerBlockOptin, "kernel ", name,
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
    p.scale_log2 = static_cast<float>(softmax_scale * M_LOG2E);

    const cudaError_t err = e.launch(p, c10::cuda::getCurrentCUDAStream(device.index()).stream());
    TORCH_CHECK(err == cudaSuccess, "launch of kernel ", name,
                " failed: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashAttention-2 forward kernels (see flash_attention for the Python API)";
    m.def("kernels", &list_kernels, "the kernels of this build, in config-set order");
    m.def("forward", &forward, "run one kernel by name", py::arg("name"), py::arg("q"),
          py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("softmax_scale"));
}
