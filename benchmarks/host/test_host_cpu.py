"""Host-only paths a CPU can time, without a GPU or the compiled extension.

attention() itself cannot run here: after its Python checks it calls the operator, whose CUDA
implementation picks the kernel from the extension's dispatch table and launches. So these time
the Python it runs before that, by name, on fake CUDA tensors
(torch._subclasses.fake_tensor.FakeTensorMode: shapes, strides, dtype and a cuda device, no
storage), which pass validation exactly as real CUDA tensors do:

- validation.check_inputs(q, k, v) (the tensor checks of every call);
- every Python check of a call: check_inputs, check_scale, check_window, check_softcap,
  check_no_grad and the canonical window: attention()'s host path up to the operator;
- dispatch.select(dtype, d_head, seqlen_q, built) over the configs a gate build contains (run
  once per process per (dtype, d_head, bucket, features) to fill the extension's table);
- KernelConfig.parse(short), config_sets.resolve(spec), codegen.kernel_source(cfg).

The problem is the GPU benchmark's tiny one: (batch, seq, heads, d_head) = (1, 128, 8, 64), bf16.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from flash_attention import KernelConfig, codegen, config_sets, dispatch, validation

SHAPE = (1, 128, 8, 64)
DEFAULT_SHORT = "bf16_d128_r128_c64_w4_fseqkvbor"  # the default long-sequence bf16 kernel
BUILT = list(config_sets.resolve("ci,default"))  # what the gate builds


@pytest.fixture(scope="module")
def fake_qkv():
    """q, k, v as fake CUDA tensors, bf16, (1, 128, 8, 64); created under FakeTensorMode and
    used outside it (reading shape, stride, dtype and device needs no mode)."""
    with FakeTensorMode():
        return tuple(torch.empty(SHAPE, dtype=torch.bfloat16, device="cuda") for _ in range(3))


@pytest.fixture(scope="module")
def fake_gqa_strided():
    """GQA (8 query heads over 2 KV heads) in the (batch, heads, seq, d) memory order seen
    through a transpose: the non-contiguous views users pass."""
    with FakeTensorMode():
        q = torch.empty(1, 8, 128, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        k = torch.empty(1, 2, 128, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        v = torch.empty(1, 2, 128, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        return q, k, v


@pytest.mark.benchmark(group="validation")
def test_check_inputs(benchmark, fake_qkv):
    prob = benchmark(validation.check_inputs, *fake_qkv)
    assert (prob.batch, prob.seqlen_q, prob.heads, prob.d_head) == (1, 128, 8, 64)


@pytest.mark.benchmark(group="validation")
def test_check_inputs_gqa_strided(benchmark, fake_gqa_strided):
    prob = benchmark(validation.check_inputs, *fake_gqa_strided)
    assert (prob.heads, prob.kv_heads) == (8, 2)


@pytest.mark.benchmark(group="dispatch")
def test_dispatch_select(benchmark):
    cfg = benchmark(dispatch.select, "bf16", 64, 128, BUILT)
    assert cfg.dtype == "bf16" and cfg.d_head == 64


@pytest.mark.benchmark(group="validation")
def test_api_checks(benchmark, fake_qkv):
    """attention()'s Python before the operator call: every check of a causal call."""
    from flash_attention.masks import canonical_window

    q, k, v = fake_qkv

    def host_path():
        prob = validation.check_inputs(q, k, v)
        validation.check_scale(None, prob.d_head)
        causal, window = validation.check_window(True, (-1, -1))
        validation.check_softcap(0.0)
        validation.check_no_grad(q, k, v)
        return canonical_window(causal, window, prob.seqlen_q, prob.seqlen_k)

    assert benchmark(host_path) == (-1, 0)


@pytest.mark.benchmark(group="config")
def test_config_parse(benchmark):
    cfg = benchmark(KernelConfig.parse, DEFAULT_SHORT)
    assert cfg.short == DEFAULT_SHORT


@pytest.mark.benchmark(group="config")
@pytest.mark.parametrize("spec", ["ci,default", "all"])
def test_config_set_resolve(benchmark, spec):
    assert benchmark(config_sets.resolve, spec)


@pytest.mark.benchmark(group="codegen")
def test_codegen_kernel_source(benchmark):
    cfg = KernelConfig.parse(DEFAULT_SHORT)
    text = benchmark(codegen.kernel_source, cfg)
    assert f"entry_{DEFAULT_SHORT}" in text
