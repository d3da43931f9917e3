"""The operator flash_attention::fwd on a machine without a GPU: its fake implementation, tracing
of the public functions with fake CUDA tensors (as torch.export and torch.compile do), the
dispatch table the extension holds, and the FlashAttention-compatible functions' refusals."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import flash_attention as fa
from flash_attention import dispatch, ops
from flash_attention.interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)


@pytest.fixture
def mode(require_extension):
    return FakeTensorMode()


def fake(mode, *shape, dtype=torch.bfloat16):
    with mode:
        return torch.empty(*shape, dtype=dtype, device="cuda")


def built_feature_call():
    """(dtype, d_head, causal, softcap) of a call this build serves, preferring masks."""
    rows = ops.dispatch_rows(ops.BUILT)
    for dtype, d, _, mask, _, softcap, *_ in sorted(rows, key=lambda r: (not r[3], r[5])):
        return ({"fp16": torch.float16, "bf16": torch.bfloat16}[dtype], d, mask,
                5.0 if softcap else 0.0)
    pytest.skip("this build serves no call")


def test_fake_tensors_trace_through_the_public_functions(mode):
    dtype, d, causal, softcap = built_feature_call()
    q = fake(mode, 2, 33, 4, d, dtype=dtype)
    kv = fake(mode, 2, 40, 2, 2, d, dtype=dtype)
    with mode:
        out, lse = fa.attention(q, kv[:, :, 0], kv[:, :, 1], causal=causal, softcap=softcap,
                                return_lse=True)
        out2, lse2, none = flash_attn_kvpacked_func(q, kv, causal=causal, softcap=softcap,
                                                    return_attn_probs=True)
    assert isinstance(out, FakeTensor) and out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, 4, 33) and lse.dtype == torch.float32 and none is None
    assert out2.shape == q.shape and lse2.shape == lse.shape


def test_strict_export_has_one_operator_call_and_no_break(mode):
    """torch.export with strict=True traces with dynamo, as torch.compile(fullgraph=True) does:
    the whole function becomes one graph around one flash_attention.attention call."""
    dtype, d, causal, softcap = built_feature_call()

    class Block(torch.nn.Module):
        def forward(self, qkv):
            out = flash_attn_qkvpacked_func(qkv, causal=causal, softcap=softcap)
            return out.float().sum(-1)

    qkv = fake(mode, 2, 64, 3, 4, d, dtype=dtype)
    with mode:
        program = torch.export.export(Block(), (qkv,), strict=True)
    calls = [n for n in program.graph.nodes if n.op == "call_function"
             and "flash_attention" in str(n.target)]
    assert len(calls) == 1 and str(calls[0].target) == "flash_attention.attention.default"


def test_fake_implementation_refuses_what_the_build_cannot_run(mode):
    q = fake(mode, 1, 8, 2, 64)
    with mode, pytest.raises(RuntimeError, match="not in this build"):
        torch.ops.flash_attention.fwd(q, q, q, torch.empty_like(q), None,
                                      "fwd_sm80_bf16_d64_r64_c64_w4_fsqkv", 0.1, -1, -1, 0.0)
    odd = fake(mode, 1, 8, 2, 64, dtype=torch.float16)
    if not ops.extension().choice("fp16", 64, 8, True, True):
        with mode, pytest.raises(RuntimeError, match="no kernel for fp16 with d_head=64 with "
                                 "masks with a softcap"):
            fa.attention(odd, odd, odd, causal=True, softcap=3.0)


def test_extension_dispatch_table_is_pythons_choice(require_extension):
    ext = ops.extension()
    for dtype, d in {(c.dtype, c.d_head) for c in ops.BUILT if c.dtype != "e4m3"}:
        for seqlen in (1, 63, 64, 65, 1000, 4096, 5000, 16384, 10**6):
            for (mask, softcap), local in itertools.product(dispatch.FEATURES, (False, True)):
                try:  # a Hopper kernel where one is built for the row, else the sm80 choice
                    fallback = dispatch.select(dtype, d, seqlen, ops.BUILT, mask, softcap)
                    fast = dispatch.select_sm90(dtype, d, seqlen, ops.BUILT, mask, softcap,
                                                local)
                    want = (fast or fallback).name
                except fa.ConfigError:
                    want = ""
                assert ext.choice(dtype, d, seqlen, mask, softcap, local) == want, (
                    dtype, d, seqlen, mask, local, softcap)


def test_extension_fp8_table_is_pythons_choice(require_extension):
    """FP8 rows: the Hopper e4m3 kernel of the row (no sm80 choice exists), '' where none."""
    ext = ops.extension()
    for d, seqlen in itertools.product((64, 96, 128, 256), (1, 1000, 10**6)):
        for (mask, softcap), local in itertools.product(dispatch.FEATURES, (False, True)):
            fast = dispatch.select_sm90("e4m3", d, seqlen, ops.BUILT, mask, softcap, local)
            assert ext.choice("e4m3", d, seqlen, mask, softcap, local) == (
                fast.name if fast else ""), (d, seqlen, mask, local, softcap)


def test_operator_rejects_cpu_tensors(require_extension):
    q = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
    with pytest.raises((NotImplementedError, RuntimeError), match="CPU"):
        torch.ops.flash_attention.fwd(q, q, q, q, None, "", 0.1, -1, -1, 0.0)


@pytest.mark.parametrize("kwargs, match", [({"dropout_p": 0.1}, "dropout_p=0.1"),
                                           ({"alibi_slopes": torch.ones(4)}, "alibi_slopes")])
def test_flash_attn_unsupported_arguments_are_named(kwargs, match):
    q = torch.zeros(1, 4, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=match):
        flash_attn_func(q, q, q, **kwargs)


def test_packed_layouts_are_checked():
    with pytest.raises(ValueError, match=r"qkv must be a 5-D tensor \(batch, seqlen, 3"):
        flash_attn_qkvpacked_func(torch.zeros(1, 4, 2, 4, 64))
    with pytest.raises(ValueError, match=r"kv must be a 5-D tensor \(batch, seqlen_k, 2"):
        flash_attn_kvpacked_func(torch.zeros(1, 4, 4, 64), torch.zeros(1, 4, 3, 4, 64))


def test_varlen_traces_with_fake_tensors(mode):
    dtype, d, causal, softcap = built_feature_call()
    q = fake(mode, 300, 4, d, dtype=dtype)
    kv = fake(mode, 280, 2, d, dtype=dtype)
    cu_q, cu_k = fake(mode, 4, dtype=torch.int32), fake(mode, 4, dtype=torch.int32)
    with mode:
        out, lse, none = flash_attn_varlen_func(q, kv, kv, cu_q, cu_k, 200, 150, causal=causal,
                                                softcap=softcap, return_attn_probs=True)
    assert isinstance(out, FakeTensor) and out.shape == q.shape and none is None
    assert lse.shape == (4, 300) and lse.dtype == torch.float32


@pytest.mark.parametrize("change, exc, match", [
    ({"cu_seqlens_q": ("cpu", torch.int32, 4)}, ValueError, "cu_seqlens_q must be on cuda"),
    ({"cu_seqlens_k": ("cuda", torch.int64, 4)}, TypeError, "cu_seqlens_k must be int32"),
    ({"cu_seqlens_k": ("cuda", torch.int32, 5)}, ValueError, "same length"),
    ({"cu_seqlens_q": ("cuda", torch.int32, 1)}, ValueError, "batch \\+ 1 >= 2 entries"),
    ({"max_seqlen_q": -1}, ValueError, "max_seqlen_q must be in"),
    ({"max_seqlen_k": 2.0}, TypeError, "max_seqlen_k must be an int"),
    ({"q": (300, 4, 100)}, ValueError, "d_head=100 is not supported"),
    ({"q": (1, 300, 4, 64)}, ValueError, "q must be 3-D \\(total_tokens"),
])
def test_varlen_metadata_errors_before_any_launch(mode, change, exc, match):
    """Checks of everything but the values of cu_seqlens (the operator reads those), on fake
    CUDA tensors: they run the same on a machine without a GPU."""
    args = {"q": (300, 4, 64), "cu_seqlens_q": ("cuda", torch.int32, 4),
            "cu_seqlens_k": ("cuda", torch.int32, 4), "max_seqlen_q": 200, "max_seqlen_k": 150}
    args.update(change)
    with mode:
        q = torch.empty(*args["q"], dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(280, 2, 64, dtype=torch.bfloat16, device="cuda")
        cu = {name: torch.zeros(n, dtype=dt, device=dev)
              for name in ("cu_seqlens_q", "cu_seqlens_k")
              for dev, dt, n in [args[name]]}
        with pytest.raises(exc, match=match):
            flash_attn_varlen_func(q, kv, kv, cu["cu_seqlens_q"], cu["cu_seqlens_k"],
                                   args["max_seqlen_q"], args["max_seqlen_k"])


def test_schema_coercions_take_the_checked_path(mode):
    """causal=1 is refused (not coerced to True), a window_size list is accepted."""
    q = fake(mode, 1, 64, 2, 64)
    with mode, pytest.raises(TypeError, match="causal must be a bool"):
        fa.attention(q, q, q, causal=1)
    dtype, d, causal, _ = built_feature_call()
    if causal:
        q = fake(mode, 1, 64, 2, d, dtype=dtype)
        with mode:
            assert fa.attention(q, q, q, window_size=[8, 0]).shape == q.shape


def test_block_table_calls_refuse_gradients():
    """block_table / seqused_k run the decode kernels, which have no backward: a call that
    would need one is refused before any work, by name."""
    q = torch.zeros(8, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="no backward"):
        flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, block_table=cu[None])
    with pytest.raises(NotImplementedError, match="no backward"):
        flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, seqused_k=cu[1:])


def test_decode_debug_log_names_the_kernel_and_why(require_extension):
    """The decode path's debug line: the dec_sm80 row's kernel for the call's dtype and d_head
    variant (d_head 96 runs the d128 kernel), or the named one, and how the splits are set."""
    from flash_attention import kvcache

    ops.require()
    built = {c.name for c in kvcache.built()}
    text = kvcache.explain(torch.bfloat16, 96)
    if "dec_sm80_bf16_d128_r16_c16_w4_f" in built:
        assert "dec_sm80_bf16_d128_r16_c16_w4_f" in text and "d_head 96" in text
        assert "num_splits=0" in text
    assert "3 key splits" in kvcache.explain(torch.bfloat16, 128, num_splits=3)
    assert kvcache.explain(torch.float16, 64, kernel="x") == "decode kernel x (named by the call)"


def test_decode_operators_trace_with_fake_tensors(mode):
    """flash_attn_with_kvcache and the paged varlen call trace on a machine without a GPU: out
    like q, the LSE shapes of flash_attn, and the KV-cache operator's schema declares the caches
    it writes (what torch.compile needs to keep the append)."""
    q = fake(mode, 3, 2, 8, 128)
    cache = fake(mode, 3, 64, 2, 128)
    new = fake(mode, 3, 1, 2, 128)
    lens = fake(mode, 3, dtype=torch.int32)
    with mode:
        out, lse = flash_attn_with_kvcache(q, cache, cache, new, new, cache_seqlens=lens,
                                           causal=True, return_softmax_lse=True)
        padded = flash_attn_with_kvcache(q, cache, cache, new, new, cache_seqlens=lens,
                                         cache_leftpad=lens, causal=True)
    assert isinstance(out, FakeTensor) and out.shape == q.shape and lse.shape == (3, 8, 2)
    assert isinstance(padded, FakeTensor) and padded.shape == q.shape
    schema = torch.ops.flash_attention.kvcache.default._schema
    written = [a.name for a in schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["k_cache", "v_cache"]
    qv = fake(mode, 10, 8, 128)
    pages = fake(mode, 20, 16, 2, 128)
    cu = fake(mode, 4, dtype=torch.int32)
    table = fake(mode, 3, 5, dtype=torch.int32)
    with mode:
        out, lse, _ = flash_attn_varlen_func(qv, pages, pages, cu, cu, 4, 80, causal=True,
                                             return_attn_probs=True, block_table=table)
    assert out.shape == qv.shape and lse.shape == (8, 10)
