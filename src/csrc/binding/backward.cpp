// The backward operator, in its own translation unit:
//   flash_attention::bwd(dout, q, k, v, out, lse, dlse?, cu_seqlens_q?, cu_seqlens_k?,
//       max_seqlen_q, max_seqlen_k, softmax_scale?, causal, window_left, window_right, softcap,
//       deterministic, kernel) -> (dq, dk, dv)
//   flash_attention::bwd_kernels() -> str     the backward kernels of this build, comma-separated
// The fake implementation and the autograd formula of flash_attention::attention that calls it
// are in flash_attention/backward.py. Every input is checked here before any launch; what the
// kernels cannot address is copied (binding/input_layout.h), as in the forward.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../backward_registry.h"
#include "input_layout.h"
#include "validation.h"

namespace {

namespace layout = flash::binding;

// Messages are built as strings (numbers through std::to_string), never through TORCH_CHECK's
// ostream formatting (see binding.cpp).
std::string str(int64_t v) {
    return std::to_string(v);
}
std::string str(at::IntArrayRef sizes) {
    std::string out = "[";
    for (size_t i = 0; i < sizes.size(); ++i)
        out += (i ? ", " : "") + std::to_string(sizes[i]);
    return out + "]";
}
std::string str(double v) {
    return std::to_string(v);
}

std::vector<const flash::BwdKernelEntry*> entries() {
    int count = 0;
    const flash::BwdKernelEntry* const* table = flash::bwd_kernel_registry(&count);
    return std::vector<const flash::BwdKernelEntry*>(table, table + count);
}

std::string bwd_kernels() {
    std::string out;
    for (const flash::BwdKernelEntry* e : entries())
        out += (out.empty() ? "" : ",") + std::string(e->name);
    return out;
}

// The named kernel, or the one for (dtype, d_head, softcap): the smallest built d_head variant
// not below d_head (flash_attention.config_bwd.select mirrors this).
const flash::BwdKernelEntry& choose(c10::string_view name, bool bf16, int64_t d_head,
                                    bool softcap) {
    const flash::BwdKernelEntry* best = nullptr;
    for (const flash::BwdKernelEntry* e : entries()) {
        if (!name.empty()) {
            if (name == e->name)
                return *e;
            continue;
        }
        if ((e->dtype == flash::DType::kBf16) == bf16 && e->softcap == softcap &&
            e->d_head >= d_head && (best == nullptr || e->d_head < best->d_head))
            best = e;
    }
    TORCH_CHECK(name.empty(), "backward kernel " + std::string(name) +
                                  " is not in this build; rebuild with "
                                  "FLASH_ATTENTION_BWD_KERNELS=" +
                                  std::string(name));
    TORCH_CHECK(best != nullptr, std::string("this build has no backward kernel for ") +
                                     (bf16 ? "bf16" : "fp16") + " with d_head=" + str(d_head) +
                                     (softcap ? " with a softcap" : "") +
                                     "; rebuild with FLASH_ATTENTION_BWD_KERNELS=default");
    return *best;
}

void check_like(const at::Tensor& t, const char* name, const at::Tensor& like,
                const char* like_name) {
    TORCH_CHECK_VALUE(t.sizes() == like.sizes(), std::string(name) + " must have the shape of " +
                                                     like_name + " " + str(like.sizes()) +
                                                     ", got " + str(t.sizes()));
    TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(),
                     std::string(name) + " must have the dtype of " + like_name);
    TORCH_CHECK_VALUE(t.device() == like.device(),
                      std::string(name) + " must be on the device of " + like_name);
}

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

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in,
    const std::optional<at::Tensor>& dlse_in, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    double softcap, bool deterministic, c10::string_view kernel) {
    TORCH_CHECK_VALUE(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(),
                      "give both cu_seqlens_q and cu_seqlens_k, or neither");
    const bool varlen = cu_seqlens_q.has_value();
    const int64_t rank = varlen ? 3 : 4;
    for (const auto& [t, name] :
         {std::pair{&q_in, "q"}, std::pair{&k_in, "k"}, std::pair{&v_in, "v"}})
        TORCH_CHECK_VALUE(t->dim() == rank, std::string(name) + " must be " +
                                                (varlen ? "3-D (total_tokens, heads, d_head)"
                                                        : "4-D (batch, seq, heads, d_head)") +
                                                ", got " + str(t->dim()) + "-D");
    const auto dtype = q_in.scalar_type();
    TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16,
                     "q must be torch.float16 or torch.bfloat16");
    TORCH_CHECK_TYPE(k_in.scalar_type() == dtype && v_in.scalar_type() == dtype,
                     "q, k and v must share a dtype");
    check_like(out_in, "out", q_in, "q");
    check_like(dout_in, "dout", q_in, "q");
    TORCH_CHECK_VALUE(
        k_in.sizes() == v_in.sizes(),
        "k and v must have the same shape, got " + str(k_in.sizes()) + " and " + str(v_in.sizes()));
    // By role: (batch, row, head, d) fixed-length; varlen (token, head, d), the batch from
    // cu_seqlens and the lengths their longest (max_seqlen_q/k, checked by the forward).
    const int64_t H = q_in.size(rank - 2), D = q_in.size(rank - 1), Hk = k_in.size(rank - 2);
    const int64_t B = varlen ? cu_seqlens_q->numel() - 1 : q_in.size(0);
    const int64_t Sq = varlen ? max_seqlen_q : q_in.size(1);
    const int64_t Sk = varlen ? max_seqlen_k : k_in.size(1);
    const int64_t total_q = q_in.size(0), total_k = k_in.size(0);
    if (varlen) {
        for (const auto& [cu, name] : {std::pair{&*cu_seqlens_q, "cu_seqlens_q"},
                                       std::pair{&*cu_seqlens_k, "cu_seqlens_k"}}) {
            TORCH_CHECK_TYPE(cu->scalar_type() == at::kInt, std::string(name) + " must be int32");
            TORCH_CHECK_VALUE(cu->dim() == 1 && cu->numel() == B + 1 && B >= 1 &&
                                  cu->is_contiguous() && cu->device() == q_in.device(),
                              std::string(name) +
                                  " must be a contiguous 1-D tensor of batch + 1 >= 2 entries "
                                  "on q's device, the same length as the other");
        }
        TORCH_CHECK_VALUE(max_seqlen_q >= 0 && max_seqlen_k >= 0, "max_seqlen_q/k must be >= 0");
        TORCH_CHECK_VALUE(total_q <= std::numeric_limits<int>::max() - 512 &&
                              total_k <= std::numeric_limits<int>::max() - 512,
                          "token counts must be at most 2^31 - 513");
    } else {
        TORCH_CHECK_VALUE(k_in.size(0) == B, "batch of k/v differs from batch of q");
    }
    TORCH_CHECK_VALUE(k_in.size(rank - 1) == D, "d_head of k/v differs from d_head of q");
    TORCH_CHECK_VALUE(
        D > 0 && D % 8 == 0 && D <= 256,
        "d_head=" + str(D) + " is not supported; supported: every multiple of 8 up to 256");
    TORCH_CHECK_VALUE(
        (Hk == 0 && H == 0) || (Hk > 0 && H % Hk == 0),
        "heads of q (" + str(H) + ") must be a multiple of heads of k/v (" + str(Hk) + ")");
    TORCH_CHECK_VALUE(B <= 65535 && Hk <= 65535 && H <= 65535,
                      "batch and heads must each be at most 65535");
    constexpr int64_t kMaxSeqlen = std::numeric_limits<int>::max() - 256;
    TORCH_CHECK_VALUE(Sq <= kMaxSeqlen && Sk <= kMaxSeqlen,
                      "sequence lengths must be at most 2^31 - 257");
    const auto device = q_in.device();
    TORCH_CHECK_VALUE(q_in.is_cuda(), "q, k and v are on " + device.str() +
                                          "; flash_attention runs on CUDA tensors");
    TORCH_CHECK_VALUE(k_in.device() == device && v_in.device() == device,
                      "q, k and v must be on the same device");
    const std::vector<int64_t> lse_shape =
        varlen ? std::vector<int64_t>{H, total_q} : std::vector<int64_t>{B, H, Sq};
    TORCH_CHECK_VALUE(lse_in.scalar_type() == at::kFloat && lse_in.sizes() == lse_shape &&
                          lse_in.device() == device,
                      std::string("lse must be the forward's fp32 ") +
                          (varlen ? "(heads, total_q)" : "(batch, heads, seqlen_q)") + " = " +
                          str(lse_shape) + " tensor on q's device, got " + str(lse_in.sizes()));
    if (dlse_in)
        TORCH_CHECK_VALUE(dlse_in->scalar_type() == at::kFloat && dlse_in->sizes() == lse_shape &&
                              dlse_in->device() == device,
                          "dlse must be an fp32 tensor of the shape of lse");
    const double scale = softmax_scale ? *softmax_scale : 1.0 / std::sqrt(double(D));
    TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0,
                      "softmax_scale must be finite and positive, got " + str(scale));
    TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0,
                      "softcap must be 0 (off) or finite and positive, got " + str(softcap));
    TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1 &&
                          window_left <= std::numeric_limits<int>::max() &&
                          window_right <= std::numeric_limits<int>::max(),
                      "window sizes must be -1 (unbounded) or in [0, 2^31)");
    const auto [left, right] = canonical_window(causal, window_left, window_right, Sq, Sk);

    const flash::BwdKernelEntry& e = choose(kernel, dtype == at::kBFloat16, D, softcap > 0);
    TORCH_CHECK_VALUE((e.dtype == flash::DType::kBf16) == (dtype == at::kBFloat16) &&
                          e.d_head >= D && e.softcap == (softcap > 0),
                      std::string("backward kernel ") + e.name +
                          " cannot serve this call (dtype, d_head or softcap)");

    at::Tensor dq = at::empty(q_in.sizes(), q_in.options());
    at::Tensor dk = at::empty(k_in.sizes(), k_in.options());
    at::Tensor dv = at::empty(v_in.sizes(), v_in.options());
    if (B == 0 || H == 0 || Sq == 0 || Sk == 0 || total_q == 0 ||
        total_k == 0) {  // nothing to attend: every gradient is 0
        dq.zero_();
        dk.zero_();
        dv.zero_();
        return {dq, dk, dv};
    }

    const c10::cuda::CUDAGuard guard(device);
    int major = 0, optin = 0;
    TORCH_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.index()) ==
                        cudaSuccess &&
                    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                           device.index()) == cudaSuccess,
                "cudaDeviceGetAttribute failed");
    TORCH_CHECK(major >= 8, "FlashAttention kernels need compute capability 8.0 or newer");
    TORCH_CHECK(e.smem_bytes <= optin,
                std::string("backward kernel ") + e.name + " needs " + str(int64_t(e.smem_bytes)) +
                    " bytes of shared memory per block; this GPU allows " + str(int64_t(optin)));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
    if (varlen) {
        // The values, as the forward checks them (a cached no-op for the cu_seqlens the forward
        // of this backward already read): a max_seqlen below a sequence's length would leave
        // that sequence's tail without gradients.
        layout::check_cu_seqlens_values(*cu_seqlens_q, "cu_seqlens_q", total_q, max_seqlen_q,
                                        stream);
        layout::check_cu_seqlens_values(*cu_seqlens_k, "cu_seqlens_k", total_k, max_seqlen_k,
                                        stream);
    }

    const c10::MaybeOwned<at::Tensor> q_a = layout::addressable(q_in),
                                      k_a = layout::addressable(k_in),
                                      v_a = layout::addressable(v_in),
                                      o_a = layout::addressable(out_in),
                                      do_a = layout::addressable(dout_in);
    const at::Tensor &q = *q_a, &k = *k_a, &v = *v_a, &o = *o_a, &dout = *do_a;
    const at::Tensor lse = lse_in.contiguous();
    const at::Tensor dlse = dlse_in ? dlse_in->contiguous() : at::Tensor();

    // Rows of the fp32 buffers per (batch, head): whole query blocks; varlen, every token of a
    // head with a block of slack past the last (a sequence's last block may reach past it).
    const int64_t Sq_pad = varlen ? (total_q + e.block_r - 1) / e.block_r * e.block_r + e.block_r
                                  : (Sq + e.block_r - 1) / e.block_r * e.block_r;
    const int64_t B_rows = varlen ? 1 : B;
    const auto f32 = q.options().dtype(at::kFloat);
    at::Tensor dq_accum = at::empty({B_rows, H, Sq_pad, e.d_head}, f32);
    at::Tensor d_rows = at::empty({B_rows, H, Sq_pad}, f32);
    at::Tensor lse_log2 = at::empty({B_rows, H, Sq_pad}, f32);
    at::Tensor semaphore;
    if (deterministic)
        semaphore =
            at::zeros({B, H, (Sq + e.block_r - 1) / e.block_r}, q.options().dtype(at::kInt));

    flash::BwdParams p{};
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.o = o.data_ptr();
    p.dout = dout.data_ptr();
    p.dq = dq.data_ptr();
    p.dk = dk.data_ptr();
    p.dv = dv.data_ptr();
    p.lse = lse.data_ptr<float>();
    p.dlse = dlse.defined() ? dlse.data_ptr<float>() : nullptr;
    p.d_rows = d_rows.data_ptr<float>();
    p.lse_log2 = lse_log2.data_ptr<float>();
    p.dq_accum = dq_accum.data_ptr<float>();
    p.dq_semaphore = deterministic ? semaphore.data_ptr<int>() : nullptr;
    const auto strides = [varlen](const at::Tensor& t, int64_t& b, int64_t& r, int64_t& h) {
        b = varlen ? 0 : t.stride(0);
        r = t.stride(varlen ? 0 : 1);
        h = t.stride(varlen ? 1 : 2);
    };
    strides(q, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
    strides(k, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
    strides(v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
    strides(o, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
    strides(dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
    strides(dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
    strides(dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
    strides(dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
    p.batch = static_cast<int>(B);
    p.heads = static_cast<int>(H);
    p.heads_per_kv = static_cast<int>(H / Hk);
    p.kv_heads = static_cast<int>(Hk);
    p.seqlen_q = static_cast<int>(Sq);
    p.seqlen_k = static_cast<int>(Sk);
    p.seqlen_q_pad = static_cast<int>(Sq_pad);
    p.d_head = static_cast<int>(D);
    p.d_pad = e.d_head;
    p.scale_log2 = static_cast<float>((softcap > 0 ? softcap : scale) * M_LOG2E);
    p.softcap_scale = static_cast<float>(softcap > 0 ? scale / softcap : 0.0);
    p.softmax_scale = static_cast<float>(scale);
    if (varlen) {
        p.cu_seqlens_q = cu_seqlens_q->data_ptr<int32_t>();
        p.cu_seqlens_k = cu_seqlens_k->data_ptr<int32_t>();
        p.total_q = static_cast<int>(total_q);
        p.total_k = static_cast<int>(total_k);
    }
    p.window_left = static_cast<int>(left);
    p.window_right = static_cast<int>(right);
    const cudaError_t err = e.launch(p, stream);
    TORCH_CHECK(err == cudaSuccess, std::string("launch of backward kernel ") + e.name +
                                        " failed: " + cudaGetErrorString(err));
    return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flash_attention, m) {
    m.def(
        "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, "
        "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
        "float? softmax_scale, bool causal, int window_left, int window_right, float softcap, "
        "bool deterministic, str kernel) -> (Tensor dq, Tensor dk, Tensor dv)");
    m.def("bwd_kernels() -> str", &bwd_kernels);
}

TORCH_LIBRARY_IMPL(flash_attention, CUDA, m) {
    m.impl("bwd", &bwd_cuda);
}
