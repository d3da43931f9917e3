"""Every input error of the API is reported clearly, before anything runs on a GPU. These run
on CPU tensors: structural checks come before the device checks."""

from __future__ import annotations

import pytest
import torch

import flash_attention as fa
from flash_attention import validation
from flash_attention.config import ConfigError


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
        (t(2, 16, 4, 96), t(2, 16, 4, 96), t(2, 16, 4, 96), ValueError, "d_head=96"),
        (t(*Q), t(2, 16, 4, 64), t(2, 17, 4, 64), ValueError, "same shape"),
        (t(*Q), t(3, 16, 4, 64), t(3, 16, 4, 64), ValueError, "batch of k/v"),
        (t(*Q), t(2, 16, 4, 128), t(2, 16, 4, 128), ValueError, "d_head of k/v"),
        (t(*Q), t(2, 16, 3, 64), t(2, 16, 3, 64), ValueError, "multiple of heads"),
        (t(2, 16, 4, 128)[..., ::2], t(*Q), t(*Q), ValueError, "contiguous last dimension"),
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
        (t(2, 16, 4, 128)[..., ::2], ValueError, "contiguous last dimension"),
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


def test_capability_below_sm80(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(RuntimeError, match=r"capability 7\.5.*need 8\.0"):
        validation.check_capability(torch.device("cuda", 0))


def test_config_errors():
    with pytest.raises(ConfigError, match="cannot parse"):
        fa.KernelConfig.parse("not-a-config")
    with pytest.raises(TypeError, match="config must be"):
        fa.api._as_config(42)


def test_config_not_built_or_mismatched(monkeypatch):
    built = (fa.KernelConfig.parse("bf16_d64_r64_c64_w4_fseqkvbor"),)
    monkeypatch.setattr(fa.api, "_built", lambda: built)
    prob = validation.Problem(1, 8, 8, 2, 2, 64, "bf16", torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"not in this build.*FLASH_ATTENTION_KERNELS="):
        fa.api._resolve_config("bf16_d64_r128_c64_w4_fseqkvbor", prob)
    with pytest.raises(ConfigError, match="is for fp16 with d_head=64, but the inputs are bf16"):
        fa.api._resolve_config("fp16_d64_r64_c64_w4_fseqkvbor", prob)
    assert fa.api._resolve_config(None, prob) == built[0]
    prob128 = validation.Problem(1, 8, 8, 2, 2, 128, "bf16", torch.device("cpu"))
    with pytest.raises(ConfigError, match="no kernel for bf16 with d_head=128"):
        fa.api._resolve_config(None, prob128)


def test_missing_extension_explains_how_to_build(monkeypatch):
    def broken():
        raise fa.ExtensionNotBuilt("the flash_attention CUDA extension is not available; build "
                                   "it with `pip install --no-build-isolation -e .`")

    monkeypatch.setattr(fa.api, "extension", broken)
    fa.api._built.cache_clear()
    try:
        with pytest.raises(fa.ExtensionNotBuilt, match="pip install --no-build-isolation"):
            fa.available_configs()
    finally:
        fa.api._built.cache_clear()


def test_import_without_extension_message():
    # The real loader's message names the build command whether or not _C exists here.
    from flash_attention._extension import BUILD_HINT

    assert "pip install --no-build-isolation -e ." in BUILD_HINT
