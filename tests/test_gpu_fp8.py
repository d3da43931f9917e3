"""The FP8 forward (fwd_sm90 e4m3 kernels) on an sm_90 GPU: every built one by name over odd
shapes, masks, softcap, GQA and descales drawn at random per (batch, KV head); the rule is
FlashAttention 3's (error at most 2x that of a reference that rounds P to FP8 the same way, plus
a small absolute term, references on the dequantised inputs in fp32); dispatch, flash_attn_func's
FP8 names, views, and bad input refused clearly. Varlen packs (the varlen kernels, flag j, by
name and dispatched, flash_attn_varlen_func): each sequence by the same rule, descales per
sequence, empty and one-token sequences; NaN in the next sequence's rows never reaches one."""

from __future__ import annotations

import pytest
import torch

import flash_attention as fa
from flash_attention import fp8
from flash_attention.interface import flash_attn_func
from flash_attention.kernels import fwd_sm90
from flash_attention.reference import attention_reference_fp8, dequantize_fp8

pytestmark = pytest.mark.gpu


def fp8_configs(varlen: bool):
    if not fa.is_built():
        return []
    return [c for c in fa.available_configs()
            if isinstance(c, fwd_sm90.Config) and c.dtype == fwd_sm90.FP8 and c.varlen == varlen]


FP8_CONFIGS = fp8_configs(varlen=False)
FP8_VARLEN_CONFIGS = fp8_configs(varlen=True)


def fp8_inputs(batch, seqlen_q, seqlen_k, heads, kv_heads, d_head, seed=0, layout="bshd"):
    """q, k, v quantised to e4m3 with per-(batch, KV head) descales, from normal inputs whose
    magnitude differs per head (so the descales differ)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def draw(seq, h):
        shape = (batch, h, seq, d_head) if layout == "bhsd" else (batch, seq, h, d_head)
        x = torch.randn(shape, device="cuda", generator=g)
        mag = torch.rand(batch, h, device="cuda", generator=g) * 4 + 0.25
        x = x * (mag[:, :, None, None] if layout == "bhsd" else mag[:, None, :, None])
        return x.transpose(1, 2) if layout == "bhsd" else x

    q, k, v = draw(seqlen_q, heads), draw(seqlen_k, kv_heads), draw(seqlen_k, kv_heads)
    q8, qd = fp8.quantize(q.contiguous(), kv_heads)
    k8, kd = fp8.quantize(k.contiguous())
    v8, vd = fp8.quantize(v.contiguous())
    if layout == "bhsd":  # the quantised tensors as transposed views
        q8, k8, v8 = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q8, k8, v8))
    return q8, k8, v8, qd, kd, vd


def check_fp8(out, lse, q, k, v, qd, kd, vd, what="", softmax_scale=None, **features):
    """FlashAttention 3's rule: max|out - ref| <= 2 x max|ref_p8 - ref| + floor (3x with a
    softcap), ref the fp32 attention over the dequantised inputs, ref_p8 the same with P rounded
    to e4m3 and its output to bf16 as ours is (a row of one key has P exact, and then bf16's
    rounding is all the error either has); the floor is 2^-10 of max|ref|. LSE against the
    reference's within what FP8 wgmma's accumulation costs: Hopper's FP8 tensor cores keep
    about 14 bits of a sum, aligned to its largest product (DeepSeek-V3's measurement), so each
    of a score's d products may be off
    by 2^-13 of the largest: a row's LSE by d 2^-13 max|q_i| max|k_i| times the scale, plus 1e-3
    (measured: up to 1.4e-2 on scores of about 50, well inside; 1e-4 on scores of about 4)."""
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert torch.isfinite(out).all(), f"{what}: NaN/inf in out"
    ref, lse_ref = attention_reference_fp8(q, k, v, qd, kd, vd, softmax_scale, **features)
    ref_p8, _ = attention_reference_fp8(q, k, v, qd, kd, vd, softmax_scale, round_p=True,
                                        **features)
    err = (out.float() - ref).abs().max().item()
    err_p8 = (ref_p8.to(out.dtype).float() - ref).abs().max().item()
    factor = 3 if features.get("softcap", 0) > 0 else 2
    floor = ref.abs().max().item() * 2 ** -10
    assert err <= factor * err_p8 + floor, (
        f"{what}: max error {err:.3e} > {factor} x FP8-P reference error {err_p8:.3e} + "
        f"{floor:.1e}")
    if lse is not None:
        empty = torch.isinf(lse_ref)
        assert torch.equal(torch.isinf(lse), empty), f"{what}: LSE -inf rows differ"
        heads, d = q.shape[2], q.shape[3]
        q_max = dequantize_fp8(q, qd).abs().amax(dim=-1).transpose(1, 2)  # (b, h, sq)
        k_max = dequantize_fp8(k, kd).abs().amax(dim=(1, 3))  # (b, h_k)
        k_max = k_max.repeat_interleave(heads // k.shape[2], dim=1)[:, :, None]
        scale = softmax_scale if softmax_scale is not None else d ** -0.5
        # (a softcap's tanh has slope <= 1: the same bound)
        bound = d * 2 ** -13 * q_max * k_max * scale + 1e-3
        gap = (lse_ref - lse).abs()[~empty]
        worst = (gap - bound[~empty]).max().item()
        assert worst <= 0, (f"{what}: LSE off by {gap.max().item():.2e}, {worst:.2e} past the "
                            "FP8 accumulation bound")
    return err, err_p8


SHAPES = [  # (batch, seqlen_q, seqlen_k, heads, kv_heads, d_head)
    (2, 113, 203, 4, 2, 128),
    (1, 1023, 1024, 2, 2, 128),
    (2, 128, 217, 4, 4, 96),
    (1, 1, 300, 8, 1, 128),
    (1, 2048, 2048, 2, 1, 128),
    (3, 257, 129, 6, 3, 112),
    (2, 113, 203, 4, 2, 256),
    (1, 300, 517, 2, 1, 192),
    (1, 1024, 1024, 2, 2, 256),
]
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (64, 17)), (True, (100, -1))]


def _features_of(cfg):
    masks = MASKS if cfg.mask else MASKS[:1]
    return [(c, w, 30.0 if cfg.softcap else 0.0) for c, w in masks]


@pytest.mark.parametrize("cfg", FP8_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_kernel_by_name(require_sm90, cfg, shape):
    b, sq, sk, h, hk, d = shape
    if fwd_sm90.variant_for(d) != cfg.d_head:
        pytest.skip(f"d_head {d} runs on the d_head {fwd_sm90.variant_for(d)} kernels")
    q, k, v, qd, kd, vd = fp8_inputs(b, sq, sk, h, hk, d, seed=sq + sk + d)
    for causal, window, softcap in _features_of(cfg):
        out, lse = fp8.attention_fp8(q, k, v, qd, kd, vd, causal=causal, window_size=window,
                                     softcap=softcap, return_lse=True, config=cfg.name)
        check_fp8(out, lse, q, k, v, qd, kd, vd, what=f"{cfg.name} {shape} {causal} {window}",
                  causal=causal, window_size=window, softcap=softcap)
        again = fp8.attention_fp8(q, k, v, qd, kd, vd, causal=causal, window_size=window,
                                  softcap=softcap, config=cfg.name)
        assert torch.equal(again, out), f"{cfg.name}: a second run differs (a race?)"


def test_fp8_dispatch_and_flash_attn_func(require_sm90):
    q, k, v, qd, kd, vd = fp8_inputs(2, 300, 300, 8, 2, 128, seed=7)
    for causal in (False, True):
        out, lse, probs = flash_attn_func(q, k, v, causal=causal, q_descale=qd, k_descale=kd,
                                          v_descale=vd, return_attn_probs=True)
        assert probs is None
        check_fp8(out, lse, q, k, v, qd, kd, vd, what=f"flash_attn_func causal={causal}",
                  causal=causal)
    ext = fa.api.ops.extension()
    assert ext.choice("e4m3", 128, 300, False, False).startswith("fwd_sm90_e4m3_d128")
    assert ext.choice("e4m3", 128, 300, True, False).endswith("m")
    assert ext.choice("e4m3", 192, 300, False, True).startswith("fwd_sm90_e4m3_d256")
    q, k, v, qd, kd, vd = fp8_inputs(1, 257, 300, 4, 2, 256, seed=8)
    out = flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    check_fp8(out, None, q, k, v, qd, kd, vd, what="flash_attn_func d_head 256", causal=True)


def test_fp8_descales_none_scalar_and_views(require_sm90):
    q, k, v, qd, kd, vd = fp8_inputs(2, 200, 333, 4, 2, 128, seed=3, layout="bhsd")
    assert not q.is_contiguous()
    out = fp8.attention_fp8(q, k, v, qd, kd, vd, causal=True)
    check_fp8(out, None, q, k, v, qd, kd, vd, what="bhsd views", causal=True)
    # no descales (inputs of unit scale quantised as they are): 1
    q1, k1, v1 = (torch.randn(2, 200, h, 128, device="cuda").to(torch.float8_e4m3fn)
                  for h in (4, 2, 2))
    out = fp8.attention_fp8(q1, k1, v1)
    check_fp8(out, None, q1, k1, v1, None, None, None, what="no descales")
    # per-tensor descales, expanded scalars (stride 0), and a softmax_scale given
    x = [torch.randn(2, 200, h, 128, device="cuda") * 3 for h in (4, 2, 2)]
    (qs, dq), (ks, dk), (vs, dv) = (fp8.quantize(t, 2, per_tensor=True) for t in x)
    assert dq.stride() == (0, 0)
    out, lse = fp8.attention_fp8(qs, ks, vs, dq, dk, dv, softmax_scale=0.05, return_lse=True)
    check_fp8(out, lse, qs, ks, vs, dq, dk, dv, what="expanded scalar", softmax_scale=0.05)
    # expanded k / v (stride 0 over the batch) are copied for TMA, never misread
    k1, v1 = k[:1].expand(2, -1, -1, -1), v[:1].expand(2, -1, -1, -1)
    out = fp8.attention_fp8(q, k1, v1, qd, kd, vd)
    check_fp8(out, None, q, k1, v1, qd, kd, vd, what="expanded k/v")


def test_fp8_bad_input(require_sm90):
    q, k, v, qd, kd, vd = fp8_inputs(2, 64, 64, 4, 2, 128, seed=1)
    with pytest.raises(ValueError, match="q_descale must be an fp32"):
        fp8.attention_fp8(q, k, v, qd[:, :1], kd, vd)
    with pytest.raises(ValueError, match="k_descale must be an fp32"):
        fp8.attention_fp8(q, k, v, qd, kd.double(), vd)
    with pytest.raises(TypeError, match=r"q, k and v must share a dtype|supported"):
        fp8.attention_fp8(q, k.to(torch.bfloat16), v)
    with pytest.raises(ValueError, match="multiple of 16"):
        q72 = torch.zeros(1, 8, 2, 72, device="cuda").to(torch.float8_e4m3fn)
        fp8.attention_fp8(q72, q72, q72)
    with pytest.raises((RuntimeError, ValueError), match=r"no kernel|d_head"):
        q64 = torch.zeros(1, 8, 2, 64, device="cuda").to(torch.float8_e4m3fn)
        fp8.attention_fp8(q64, q64, q64)
    with pytest.raises(TypeError, match="float8_e4m3fn inputs"):
        fa.attention(q, k, v)
    with pytest.raises(ValueError, match="for float8_e4m3fn"):
        b = q.to(torch.bfloat16)
        flash_attn_func(b, b, b, q_descale=qd)


# ---- varlen packs ------------------------------------------------------------------------------

# (lengths_q, lengths_k): tails of every B_c (64, 128), empty and one-token sequences, Sq != Sk;
# and a pack of 24 sequences (many tiles, uneven lengths).
VARLEN_PACKS = {
    "tails": ([1, 0, 63, 65, 127, 129, 191, 193, 300], [1, 5, 63, 65, 127, 129, 191, 0, 301]),
    "many": ([(37 * i) % 700 + 1 for i in range(24)], [(53 * i) % 900 + 1 for i in range(24)]),
}


def fp8_pack(lq, lk, heads, kv_heads, d_head, seed):
    """Packed e4m3 q (total_q, heads, d), k, v (total_k, kv_heads, d) with descales per (sequence,
    KV head), each sequence drawn and quantised on its own (fp8_inputs), cu_seqlens int32."""
    parts, descales = [], []
    for b, (nq, nk) in enumerate(zip(lq, lk, strict=True)):
        q, k, v, qd, kd, vd = fp8_inputs(1, max(nq, 1), max(nk, 1), heads, kv_heads, d_head,
                                         seed=seed + b)
        parts.append((q[0, :nq], k[0, :nk], v[0, :nk]))
        descales.append((qd, kd, vd))
    q8, k8, v8 = (torch.cat([p[i] for p in parts]) for i in range(3))
    qd, kd, vd = (torch.cat([d[i] for d in descales]) for i in range(3))

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                            device="cuda")

    return q8, k8, v8, qd, kd, vd, cu(lq), cu(lk)


def check_fp8_pack(out, lse, q8, k8, v8, qd, kd, vd, lq, lk, what, **features):
    """Each sequence by check_fp8 on its own slices; a sequence without keys: O 0, LSE -inf."""
    assert out.shape == q8.shape and out.dtype == torch.bfloat16 and lse.shape == (
        q8.shape[1], q8.shape[0])
    q0 = k0 = 0
    for b, (nq, nk) in enumerate(zip(lq, lk, strict=True)):
        sq, sk = slice(q0, q0 + nq), slice(k0, k0 + nk)
        if nq and not nk:
            assert (out[sq] == 0).all() and (lse[:, sq] == float("-inf")).all(), what
        elif nq:
            check_fp8(out[None, sq], lse[None, :, sq], q8[None, sq], k8[None, sk], v8[None, sk],
                      qd[b:b + 1], kd[b:b + 1], vd[b:b + 1], what=f"{what} sequence {b} "
                      f"({nq} x {nk})", **features)
        q0, k0 = q0 + nq, k0 + nk


def run_varlen(q8, k8, v8, qd, kd, vd, cu_q, cu_k, lq, lk, config=None, **features):
    return fp8.attention_fp8(q8, k8, v8, qd, kd, vd, return_lse=True, config=config,
                             cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq),
                             max_seqlen_k=max(lk), **features)


@pytest.mark.parametrize("pack", list(VARLEN_PACKS))
@pytest.mark.parametrize("cfg", FP8_VARLEN_CONFIGS, ids=lambda c: c.name)
def test_fp8_varlen_kernel_by_name(require_sm90, cfg, pack):
    lq, lk = VARLEN_PACKS[pack]
    d_head = {128: 96, 256: 192}[cfg.d_head]  # the d_head 96 and 192 calls these kernels serve
    for causal, window, softcap in _features_of(cfg):
        q8, k8, v8, qd, kd, vd, cu_q, cu_k = fp8_pack(lq, lk, 6, 2, d_head, seed=len(lq))
        features = {"causal": causal, "window_size": window, "softcap": softcap}
        out, lse = run_varlen(q8, k8, v8, qd, kd, vd, cu_q, cu_k, lq, lk, cfg.name, **features)
        check_fp8_pack(out, lse, q8, k8, v8, qd, kd, vd, lq, lk, f"{cfg.name} {pack} {features}",
                       **features)
        again, _ = run_varlen(q8, k8, v8, qd, kd, vd, cu_q, cu_k, lq, lk, cfg.name, **features)
        assert torch.equal(again, out), f"{cfg.name} {pack}: a second run differs (race?)"


@pytest.mark.parametrize("d_head", [128, 256])
@pytest.mark.parametrize("features", [{}, {"causal": True}, {"softcap": 30.0},
                                      {"window_size": (64, 0), "softcap": 30.0}],
                         ids=lambda f: "-".join(f) or "plain")
def test_fp8_varlen_dispatch_and_flash_attn_varlen_func(require_sm90, d_head, features):
    from flash_attention.interface import flash_attn_varlen_func

    lq = lk = [700, 1, 0, 260, 129]
    q8, k8, v8, qd, kd, vd, cu_q, cu_k = fp8_pack(lq, lk, 8, 2, d_head, seed=d_head)
    out, lse = run_varlen(q8, k8, v8, qd, kd, vd, cu_q, cu_k, lq, lk, **features)
    check_fp8_pack(out, lse, q8, k8, v8, qd, kd, vd, lq, lk, f"dispatched d{d_head}", **features)
    out2, lse2, _ = flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, max(lq), max(lk),
                                           return_attn_probs=True, q_descale=qd, k_descale=kd,
                                           v_descale=vd, **features)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


def test_fp8_varlen_nan_past_a_sequence_never_reaches_it(require_sm90):
    """A sequence's last KV block reads the next sequence's rows: e4m3 NaN there (0x7f) must be
    masked (K) and zeroed (V, in the producer's transpose)."""
    lq = lk = [100, 70, 50]
    q8, k8, v8, qd, kd, vd, cu_q, cu_k = fp8_pack(lq, lk, 4, 4, 128, seed=7)
    k8.view(torch.uint8)[100:] = 0x7F
    v8.view(torch.uint8)[100:] = 0x7F
    for causal in (False, True):
        out, lse = run_varlen(q8, k8, v8, qd, kd, vd, cu_q, cu_k, lq, lk, causal=causal)
        check_fp8_pack(out[:100], lse[:, :100], q8[:100], k8[:100], v8[:100], qd[:1], kd[:1],
                       vd[:1], [100], [100], f"sequence 0 (causal={causal})", causal=causal)


def test_fp8_varlen_bad_input_refused(require_sm90):
    lq = [30, 40]
    q8, k8, v8, qd, kd, vd, cu_q, cu_k = fp8_pack(lq, lq, 4, 2, 128, seed=3)
    with pytest.raises(ValueError, match=r"\(2, 2\)"):  # descales per (sequence, KV head)
        run_varlen(q8, k8, v8, qd[:1], kd, vd, cu_q, cu_k, lq, lq)
    with pytest.raises((ValueError, RuntimeError), match="block_table or seqused_k"):
        from flash_attention.interface import flash_attn_varlen_func

        flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, 40, 40, q_descale=qd, k_descale=kd,
                               v_descale=vd, seqused_k=cu_k[1:])
