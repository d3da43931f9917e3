// The backward operator, in its own translation unit:
//   flash_attention::bwd(dout, q, k, v, out, lse, dlse?, cu_seqlens_q?, cu_seqlens_k?,
//       max_seqlen_q, max_seqlen_k, softmax_scale?, causal, window_left, window_right, softcap,
//       deterministic, kernel) -> (dq, dk, dv)
//   flash_attention::bwd_kernels() -> str     the backward kernels of this build, comma-separated
//   flash_attention::bwd_explain(dout, q, k, v, varlen, softcap) -> str   what a call's backward
//       runs, and why not the Hopper kernel (debug logging, as the forward's explain())
// The fake implementation and the autograd formula of flash_attention::attention that calls it
// are in flash_attention/backward.py. Every input is checked here before any launch, with the
// forward's checks where they apply (binding/validation.h); what the kernels cannot address is
// copied (binding/input_layout.h), as in the forward.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../registry.h"
#include "device_properties.h"
#include "input_layout.h"
#include "message.h"
#include "tma_fit.h"
#include "validation.h"

namespace {

using namespace flash::binding;

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

// The built kernel named `name` (refused if the build lacks it).
const flash::BwdKernelEntry* named_kernel(c10::string_view name) {
    for (const flash::BwdKernelEntry* e : entries())
        if (name == e->name)
            return e;
    FA_CHECK(false, "backward kernel ", name,
             " is not in this build; rebuild with FLASH_ATTENTION_KERNELS=default,", name);
    return nullptr;
}

// The kernel of the family `arch` (80 or 90) for (dtype, d_head, softcap): its smallest built
// d_head variant not below d_head (flash_attention.config_bwd.select mirrors this); nullptr
// when the build has none.
const flash::BwdKernelEntry* family_kernel(bool bf16, int64_t d_head, bool softcap, int arch) {
    const flash::BwdKernelEntry* best = nullptr;
    for (const flash::BwdKernelEntry* e : entries())
        if (e->arch == arch && (e->dtype == flash::DType::kBf16) == bf16 && e->softcap == softcap &&
            e->d_head >= d_head && (best == nullptr || e->d_head < best->d_head))
            best = e;
    return best;
}

// The choice of a call that names no kernel, given the two families' kernels for it and
// sm90_unfit's verdict on its tensors: the Hopper kernel when it is built and fits, else the
// sm80 family's (nullptr when the build has none); `why` says why not the Hopper kernel
// (nullptr when it runs). bwd_cuda runs it, bwd_explain reports it.
struct FamilyChoice {
    const flash::BwdKernelEntry* kernel;
    const char* why;
};
FamilyChoice choose_family(const flash::BwdKernelEntry* sm80, const flash::BwdKernelEntry* sm90,
                           const char* unfit) {
    if (sm90 == nullptr)
        return {sm80, "no Hopper kernel in this build"};
    return {unfit == nullptr ? sm90 : sm80, unfit};
}

// The sm80 family's dQ order for a fixed-length call (BwdParams::dq_tiles): 1 (tiles, one 16-byte
// reduction per tile and thread) on sm_90 and later, 2 (lane-major tiles, four scalar
// reductions) on sm_80-89, which have no vector reductions. FLASH_ATTENTION_SM80_DQ_ORDER=rows,
// tiles or lane overrides it, so that an sm_90 GPU can test sm_80-89's order (a diagnostic).
int sm80_fixed_length_dq_order(int major) {
    const char* env = std::getenv("FLASH_ATTENTION_SM80_DQ_ORDER");
    if (env == nullptr || *env == '\0')
        return major >= 9 ? 1 : 2;
    static const std::pair<const char*, int> kOrders[] = {{"rows", 0}, {"tiles", 1}, {"lane", 2}};
    for (const auto& [name, order] : kOrders)
        if (std::strcmp(env, name) == 0)
            return order;
    FA_CHECK_VALUE(false, "FLASH_ATTENTION_SM80_DQ_ORDER must be rows, tiles or lane, got '", env,
                   "'");
    return 0;
}

void check_like(const at::Tensor& t, const char* name, const at::Tensor& like,
                const char* like_name) {
    FA_CHECK_VALUE(t.sizes() == like.sizes(), name, " must have the shape of ", like_name, " ",
                   like.sizes(), ", got ", t.sizes());
    FA_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, " must have the dtype of ",
                  like_name, " (", like.scalar_type(), "), got ", t.scalar_type());
    FA_CHECK_VALUE(t.device() == like.device(), name, " must be on the device of ", like_name, " (",
                   like.device(), "), got ", t.device());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in,
    const std::optional<at::Tensor>& dlse_in, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    double softcap, bool deterministic, c10::string_view kernel) {
    const Varlen vl = varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
    const bool varlen = vl.cu_q != nullptr;
    const auto dtype = check_qkv(q_in, k_in, v_in, varlen);
    check_like(out_in, "out", q_in, "q");
    check_like(dout_in, "dout", q_in, "q");
    const auto device = q_in.device();
    if (varlen)  // the values are read on the host below, on the call's stream
        check_varlen_meta(vl, device);
    // By role: (batch, row, head, d) fixed-length; varlen (token, head, d), the batch from
    // cu_seqlens and the lengths their longest (max_seqlen_q/k).
    const CallShape s = call_shape(q_in, k_in, vl);
    const int64_t B = s.batch, H = s.heads, Hk = s.kv_heads, Sq = s.seqlen_q, Sk = s.seqlen_k,
                  D = s.d_head;
    const int64_t total_q = q_in.size(0), total_k = k_in.size(0);
    FA_CHECK_VALUE(B <= 65535 && Hk <= 65535 && H <= 65535, "batch (", B, ") and heads (", H,
                   ", k/v: ", Hk, ") must each be at most 65535");
    constexpr int64_t kMaxSeqlen = std::numeric_limits<int>::max() - 256;
    FA_CHECK_VALUE(Sq <= kMaxSeqlen && Sk <= kMaxSeqlen,
                   "sequence lengths must be at most 2^31 - 257");
    // Varlen row buffers hold every token plus a query block of slack (see Sq_pad below).
    FA_CHECK_VALUE(!varlen || (total_q <= std::numeric_limits<int>::max() - 512 &&
                               total_k <= std::numeric_limits<int>::max() - 512),
                   "token counts must be at most 2^31 - 513");
    const std::vector<int64_t> lse_shape =
        varlen ? std::vector<int64_t>{H, total_q} : std::vector<int64_t>{B, H, Sq};
    FA_CHECK_VALUE(lse_in.scalar_type() == at::kFloat && lse_in.sizes() == lse_shape &&
                       lse_in.device() == device,
                   "lse must be the forward's fp32 ",
                   varlen ? "(heads, total_q)" : "(batch, heads, seqlen_q)", " = ",
                   at::IntArrayRef(lse_shape), " tensor on q's device, got ", lse_in.sizes(), " ",
                   lse_in.scalar_type(), " on ", lse_in.device());
    if (dlse_in)
        FA_CHECK_VALUE(dlse_in->scalar_type() == at::kFloat && dlse_in->sizes() == lse_shape &&
                           dlse_in->device() == device,
                       "dlse must be an fp32 tensor of the shape of lse ",
                       at::IntArrayRef(lse_shape), " on q's device, got ", dlse_in->sizes(), " ",
                       dlse_in->scalar_type(), " on ", dlse_in->device());
    const double scale = softmax_scale ? *softmax_scale : 1.0 / std::sqrt(double(D));
    FA_CHECK_VALUE(std::isfinite(scale) && scale > 0,
                   "softmax_scale must be finite and positive, got ", scale);
    FA_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0,
                   "softcap must be 0 (off) or finite and positive, got ", softcap);
    FA_CHECK_VALUE(window_left >= -1 && window_right >= -1 &&
                       window_left <= std::numeric_limits<int>::max() &&
                       window_right <= std::numeric_limits<int>::max(),
                   "window sizes must be -1 (unbounded) or in [0, 2^31)");
    const auto [left, right] = canonical_window(causal, window_left, window_right, Sq, Sk);

    // The sm80 family serves every call; the Hopper kernel (when built) the calls it can run,
    // decided below once the tensors are known.
    const bool bf16 = dtype == at::kBFloat16;
    const flash::BwdKernelEntry* named = kernel.empty() ? nullptr : named_kernel(kernel);
    const flash::BwdKernelEntry* sm80 = named ? nullptr : family_kernel(bf16, D, softcap > 0, 80);
    const flash::BwdKernelEntry* sm90 = named ? nullptr : family_kernel(bf16, D, softcap > 0, 90);
    FA_CHECK(named != nullptr || sm80 != nullptr || sm90 != nullptr,
             "this build has no backward kernel for ", bf16 ? "bf16" : "fp16", " with d_head=", D,
             softcap > 0 ? " with a softcap" : "",
             "; rebuild with FLASH_ATTENTION_KERNELS=default");
    if (named != nullptr)
        FA_CHECK_VALUE((named->dtype == flash::DType::kBf16) == bf16 && named->d_head >= D &&
                           named->softcap == (softcap > 0),
                       "backward kernel ", named->name, " cannot serve this call (dtype ", dtype,
                       ", d_head=", D, softcap > 0 ? ", a softcap" : ", no softcap", ")");

    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
    if (varlen) {
        // The values, as the forward checks them (a cached no-op for the cu_seqlens the forward
        // of this backward already read): a max_seqlen below a sequence's length would leave
        // that sequence's tail without gradients.
        check_cu_seqlens_values(*vl.cu_q, "cu_seqlens_q", total_q, max_seqlen_q, stream);
        check_cu_seqlens_values(*vl.cu_k, "cu_seqlens_k", total_k, max_seqlen_k, stream);
    }
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

    const cudaDeviceProp& prop = device_properties(device.index());
    FA_CHECK(prop.major >= 8,
             "FlashAttention kernels need compute capability 8.0 or newer, this GPU has ",
             prop.major, ".", prop.minor);

    const c10::MaybeOwned<at::Tensor> q_a = addressable(q_in), k_a = addressable(k_in),
                                      v_a = addressable(v_in), o_a = addressable(out_in),
                                      do_a = addressable(dout_in);
    const at::Tensor &q = *q_a, &k = *k_a, &v = *v_a, &o = *o_a, &dout = *do_a;
    const at::Tensor lse = lse_in.contiguous();
    const at::Tensor dlse = dlse_in ? dlse_in->contiguous() : at::Tensor();

    // The Hopper kernel runs fixed-length calls whose tensors TMA can address on an sm_90 GPU
    // (deterministic ones too); the rest run on the sm80 family.
    const char* unfit = sm90_unfit(prop, varlen, {&q, &k, &v, &dout, &dk, &dv});
    if (named != nullptr && named->arch == 90)
        FA_CHECK(unfit == nullptr, "backward kernel ", named->name,
                 " (sm_90a) cannot run this call: ", unfit);
    const FamilyChoice family = choose_family(sm80, sm90, unfit);
    FA_CHECK(named != nullptr || family.kernel != nullptr,
             "this build has no sm80-family backward kernel for ", bf16 ? "bf16" : "fp16",
             " with d_head=", D, softcap > 0 ? " with a softcap" : "", ", which this call needs (",
             family.why, "); rebuild with FLASH_ATTENTION_KERNELS=default");
    const flash::BwdKernelEntry& e = named != nullptr ? *named : *family.kernel;
    FA_CHECK(size_t(e.smem_bytes) <= prop.sharedMemPerBlockOptin, "backward kernel ", e.name,
             " needs ", e.smem_bytes, " bytes of shared memory per block; this GPU allows ",
             prop.sharedMemPerBlockOptin);

    // Rows of the fp32 buffers per (batch, head): whole query blocks; varlen, every token of a
    // head with a block of slack past the last (a sequence's last block may reach past it).
    const int64_t Sq_pad = varlen ? (total_q + e.block_r - 1) / e.block_r * e.block_r + e.block_r
                                  : (Sq + e.block_r - 1) / e.block_r * e.block_r;
    const int64_t B_rows = varlen ? 1 : B;
    const auto f32 = q.options().dtype(at::kFloat);
    at::Tensor dq_accum = at::empty({B_rows, H, Sq_pad, e.d_head}, f32);
    at::Tensor d_rows = at::empty({B_rows, H, Sq_pad}, f32);
    at::Tensor lse_log2 = at::empty({B_rows, H, Sq_pad}, f32);
    // Deterministic: one turn counter per (batch, query head, query block), zeroed. The kernel
    // indexes it with the query blocks of BwdParams::seqlen_q, which is Sq for both layouts:
    // varlen, max_seqlen_q, so every sequence has room (none longer: checked above, and during
    // CUDA graph capture, where the values cannot be read, cut to it by the kernel).
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
    // The sm80 family's dQ order: rows for varlen calls (a sequence starts at any token, not on
    // a 64-row block), else sm80_fixed_length_dq_order's. The Hopper family's is always tiles.
    p.dq_tiles = varlen ? 0 : sm80_fixed_length_dq_order(prop.major);
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
    FA_CHECK(err == cudaSuccess, "launch of backward kernel ", e.name,
             " failed: ", cudaGetErrorString(err));
    return {dq, dk, dv};
}

// The kernel bwd_cuda runs for a call of these tensors (no kernel named), and why not the
// Hopper one when it falls back to the sm80 family: bwd_cuda's choose_family, from the
// tensors' metadata and the GPU's properties alone (dK and dV are new contiguous tensors, which
// TMA addresses whenever K and V are).
std::string bwd_explain(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, bool varlen, bool softcap) {
    FA_CHECK_VALUE(q.is_cuda(), "bwd_explain needs CUDA tensors, got ", q.device());
    const bool bf16 = q.scalar_type() == at::kBFloat16;
    const int64_t D = q.size(-1);
    const flash::BwdKernelEntry* sm80 = family_kernel(bf16, D, softcap, 80);
    const flash::BwdKernelEntry* sm90 = family_kernel(bf16, D, softcap, 90);
    const c10::MaybeOwned<at::Tensor> qa = addressable(q), ka = addressable(k), va = addressable(v),
                                      da = addressable(dout);
    const FamilyChoice family = choose_family(
        sm80, sm90,
        sm90_unfit(device_properties(q.device().index()), varlen, {&*qa, &*ka, &*va, &*da}));
    if (family.kernel == nullptr)
        return message("no backward kernel in this build (not the Hopper family: ", family.why,
                       ")");
    return family.why == nullptr
               ? std::string(family.kernel->name)
               : message(family.kernel->name, " (not the Hopper family: ", family.why, ")");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flash_attention, m) {
    m.def(
        "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, "
        "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
        "float? softmax_scale, bool causal, int window_left, int window_right, float softcap, "
        "bool deterministic, str kernel) -> (Tensor dq, Tensor dk, Tensor dv)");
    m.def("bwd_kernels() -> str", &bwd_kernels);
    m.def(
        "bwd_explain(Tensor dout, Tensor q, Tensor k, Tensor v, bool varlen, bool softcap) -> str",
        &bwd_explain);
}

TORCH_LIBRARY_IMPL(flash_attention, CUDA, m) {
    m.impl("bwd", &bwd_cuda);
}
