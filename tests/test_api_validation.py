"""Every input error of the API is reported clearly, before anything runs on a GPU. These run
on CPU tensors: structural checks come before the device checks."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_attention as fa
from flash_attention import validation
from flash_attention.kernels import ConfigError


def t(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)


Q = (2, 16, 4, 64)


@pytest.mark.parametrize(
    "q, k, v, exc, message",
    [
        ("q", t(*Q), t(*Q), TypeError, "q must be a torch.Tensor"),
        (t(2, 16, 64), t(*Q), t(*Q), ValueError, "q must be 4-D"),
        (t(*Q, dtype=torch.float32), t(*Q), t(*Q), TypeError, "supported: torch.float16"),
        (t(*Q), t(*Q, dtype=torch.float16), t(*Q), TypeError, "share a dtype"),
        (t(2, 16, 4, 100), t(2, 16, 4, 100), t(2, 16, 4, 100), ValueError,
         "d_head=100 is not supported; supported: every multiple of 8 up to 256"),
        (t(2, 16, 4, 264), t(2, 16, 4, 264), t(2, 16, 4, 264), ValueError, "d_head=264"),
        (t(*Q), t(2, 16, 4, 64), t(2, 17, 4, 64), ValueError, "same shape"),
        (t(*Q), t(3, 16, 4, 64), t(3, 16, 4, 64), ValueError, "batch of k/v"),
        (t(*Q), t(2, 16, 4, 128), t(2, 16, 4, 128), ValueError, "d_head of k/v"),
        (t(*Q), t(2, 16, 3, 64), t(2, 16, 3, 64), ValueError, "multiple of heads"),
        (t(*Q), t(*Q), t(*Q), ValueError, "runs on CUDA tensors"),
        (t(*Q), t(*Q, dtype=torch.bfloat16).to("meta"), t(*Q).to("meta"), ValueError,
         "same device"),
    ],
)
def test_input_errors(q, k, v, exc, message):
    with pytest.raises(exc, match=message):
        fa.attention(q, k, v)


def test_grid_limits():
    big = torch.empty_strided((70000, 1, 1, 64), (64, 64, 64, 1), dtype=torch.float16)
    with pytest.raises(ValueError, match="at most 65535"):
        fa.attention(big, big, big)


@pytest.mark.parametrize(
    "out, exc, message",
    [
        ("x", TypeError, "out must be a torch.Tensor"),
        (t(2, 16, 4, 128), ValueError, "out must have the shape"),
        (t(*Q, dtype=torch.float16), TypeError, "out must have dtype"),
        (t(*Q).to("meta"), ValueError, "out must be on"),
        (t(2, 16, 1, 64).expand(*Q), ValueError, "share memory"),
    ],
)
def test_out_errors(out, exc, message):
    q = t(*Q)
    with pytest.raises(exc, match=message):
        validation.check_out(out, q)


@pytest.mark.parametrize(
    "scale, exc",
    [(0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
     ("0.1", TypeError), (True, TypeError)],
)
def test_scale_errors(scale, exc):
    with pytest.raises(exc, match="softmax_scale"):
        validation.check_scale(scale, 64)


def test_scale_default():
    assert validation.check_scale(None, 64) == pytest.approx(0.125)
    assert validation.check_scale(2, 64) == 2.0


def test_config_errors():
    with pytest.raises(ConfigError, match="cannot parse"):
        fa.parse("not-a-config")
    with pytest.raises(TypeError, match="config must be"):
        fa.api._as_config(42)
    # a name of the old scheme is refused with its name now
    with pytest.raises(ConfigError, match="its name now is fwd_sm80_bf16_d64_r64_c64_w4_fseqkvbor"):
        fa.api._as_config("bf16_d64_r64_c64_w4_fseqkvbor")
    # attention() and forward() run forward kernels only
    with pytest.raises(ConfigError, match="is a bwd_sm80 kernel"):
        fa.api._as_config("bwd_sm80_bf16_d128_r64_c128_w8_fh")
    cfg = fa.parse("fwd_sm90_bf16_d128_r128_c128_s2_fwpia")
    assert fa.api._as_config(cfg) is cfg and fa.api._as_config(cfg.name) == cfg


def test_config_not_built_or_mismatched(monkeypatch):
    monkeypatch.setattr(fa.ops, "BUILT_NAMES", frozenset({"fwd_sm80_bf16_d64_r64_c64_w4_fseqkvbor",
                                                          "fwd_sm80_bf16_d64_r64_c64_w4_fseqkvborm"}))
    prob = validation.Problem(1, 8, 8, 2, 2, 64, "bf16", torch.device("cpu"))
    kernel = fa.api._explicit_kernel
    with pytest.raises(ConfigError, match=r"not in this build.*FLASH_ATTENTION_KERNELS="):
        kernel("fwd_sm80_bf16_d64_r128_c64_w4_fseqkvbor", prob, False, False)
    with pytest.raises(ConfigError, match="is for fp16 with d_head up to 64, but the inputs are "
                                          "bf16"):
        kernel("fwd_sm80_fp16_d64_r64_c64_w4_fseqkvbor", prob, False, False)
    with pytest.raises(ConfigError, match="up to 32, but the inputs are bf16 with d_head=64"):
        kernel("fwd_sm80_bf16_d32_r64_c64_w4_fseqkvbor", prob, False, False)
    with pytest.raises(ConfigError, match="has no masks"):
        kernel("fwd_sm80_bf16_d64_r64_c64_w4_fseqkvbor", prob, True, False)
    with pytest.raises(ConfigError, match="has no softcap"):
        kernel("fwd_sm80_bf16_d64_r64_c64_w4_fseqkvbor", prob, False, True)
    with pytest.raises(ConfigError, match="applies a softcap"):
        kernel("fwd_sm80_bf16_d64_r64_c64_w4_fseqkvbort", prob, False, False)
    assert kernel("fwd_sm80_bf16_d64_r64_c64_w4_fseqkvbor", prob, False, False) == \
        "fwd_sm80_bf16_d64_r64_c64_w4_fseqkvbor"
    # A kernel with masks serves an unmasked call too.
    assert kernel("fwd_sm80_bf16_d64_r64_c64_w4_fseqkvborm", prob, False, False).endswith("m")


def test_missing_extension_explains_how_to_build(monkeypatch):
    monkeypatch.setattr(fa.ops, "LOADED", False)
    monkeypatch.setattr(fa.ops, "load", lambda: False)
    monkeypatch.setattr(fa.ops, "LOAD_ERROR", "the flash_attention CUDA extension is not "
                        "available; build it with `pip install --no-build-isolation -e .`")
    with pytest.raises(fa.ExtensionNotBuilt, match="pip install --no-build-isolation"):
        fa.available_configs()


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        ({"causal": 1}, TypeError, "causal must be a bool"),
        ({"window_size": 5}, TypeError, "window_size must be a pair"),
        ({"window_size": (1, 2, 3)}, TypeError, "window_size must be a pair"),
        ({"window_size": (1.0, 2)}, TypeError, "window_size must be a pair"),
        ({"window_size": (-2, 0)}, ValueError, "window_size left must be -1"),
        ({"window_size": (0, 2**31)}, ValueError, "window_size right must be -1"),
        ({"softcap": -1.0}, ValueError, "softcap must be 0"),
        ({"softcap": float("inf")}, ValueError, "softcap must be 0"),
        ({"softcap": "1"}, TypeError, "softcap must be a float"),
    ],
)
def test_feature_argument_errors(kwargs, exc, message):
    with FakeTensorMode():  # CUDA tensors without a GPU: the checks come before any launch
        q = torch.empty(*Q, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(exc, match=message):
            fa.attention(q, q, q, **kwargs)


def test_inputs_that_require_grad_are_refused_where_there_is_no_backward():
    with FakeTensorMode():
        q = torch.empty(*Q, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        with pytest.raises(RuntimeError, match=r"no backward for a call with out=.*no_grad"):
            fa.attention(q, q, q, out=torch.empty(*Q, dtype=torch.bfloat16, device="cuda"))


def test_import_without_extension_message():
    # The real loader's message names the build command whether or not _C exists here.
    from flash_attention._extension import BUILD_HINT

    assert "pip install --no-build-isolation -e ." in BUILD_HINT
