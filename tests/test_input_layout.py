"""The operator's layout decisions (src/csrc/binding/input_layout.h), read through
_C.layout_report on CPU tensors (metadata only): which inputs the kernels address in place and
which go through a copy, and which `out` tensors are refused. The GPU results of the same views
are in test_gpu_fuzz.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("require_extension")

IN_PLACE = ""


def report(q, k, v, out=None):
    from flash_attention import ops

    return ops.extension().layout_report(q, k, v, out)


def z(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)


def test_contiguous_and_aligned_views_run_in_place():
    b = z(2, 513, 8, 136)
    q, k = b[..., :128], b[..., 8:136]  # offset 0 and 16 bytes; strides 272 and 2176 bytes
    bhsd = z(2, 8, 513, 128).transpose(1, 2)
    assert report(q, k, bhsd) == {"q": IN_PLACE, "k": IN_PLACE, "v": IN_PLACE}


def test_expanded_kv_is_read_in_place():
    kv = z(2, 64, 1, 128).expand(2, 64, 8, 128)  # stride 0 over heads
    q = z(2, 64, 8, 128)
    assert report(q, kv, kv) == {"q": IN_PLACE, "k": IN_PLACE, "v": IN_PLACE}


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: z(2, 513, 8, 136)[..., 4:132], "16-byte boundary"),  # 8 bytes past
        (lambda: z(2, 513, 8, 136)[..., 1:129], "16-byte boundary"),  # 2 bytes past
        (lambda: z(2, 513, 8, 132)[..., :128], "multiple of 16 bytes"),  # 264-byte head stride
        (lambda: z(2, 513, 8, 72)[..., 4:68], "16-byte boundary"),  # d_head 64 in 72-wide rows
        (lambda: z(2, 513, 1, 132)[..., :128].expand(2, 513, 1, 128), "multiple of 16 bytes"),
        (lambda: z(2, 16, 4, 128)[..., ::2], "last dimension is not contiguous"),
        (lambda: z(2, 16, 128, 4).transpose(2, 3), "last dimension is not contiguous"),
    ],
)
def test_unaddressable_inputs_are_copied(make, why):
    bad, good = make(), z(*make().shape)
    for name in ("q", "k", "v"):
        args = {"q": good, "k": good, "v": good, name: bad}
        got = report(args["q"], args["k"], args["v"])
        assert why in got[name], got
        assert all(got[n] == IN_PLACE for n in ("q", "k", "v") if n != name), got


def test_size_one_dimensions_may_have_any_stride():
    t = torch.empty_strided((1, 64, 1, 64), (3, 64, 5, 1), dtype=torch.float16)
    assert report(t, t, t)["q"] == IN_PLACE


def test_out_routes():
    q, k, v = z(2, 64, 8, 128), z(2, 64, 8, 128), z(2, 64, 8, 128)
    assert report(q, k, v, z(2, 64, 8, 128))["out"] == IN_PLACE
    assert report(q, k, v, q)["out"] == "its memory overlaps q, k or v"
    packed = z(2, 64, 3, 8, 128)
    assert report(packed[:, :, 0], packed[:, :, 1], packed[:, :, 2], packed[:, :, 0].clone())[
        "out"] == IN_PLACE
    assert "overlaps" in report(q, k, v, v)["out"]
    assert "overlaps" in report(packed[:, :, 0], packed[:, :, 1], packed[:, :, 2],
                                packed[:, :, 2])["out"]
    assert "16-byte boundary" in report(q, k, v, z(2, 64, 8, 136)[..., 4:132])["out"]
    assert report(q, k, v, z(2, 64, 1, 128).expand(2, 64, 8, 128))["out"].startswith("refused")

