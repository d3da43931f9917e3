"""Host-only paths a CPU can time, without a GPU or the compiled extension.

attention() itself cannot run here: after its Python checks it calls the operator, whose CUDA
implementation picks the kernel from the extension's dispatch table and launches. So these time
the Python it runs before that, by name, on fake CUDA tensors
(torch._subclasses.fake_tensor.FakeTensorMode: shapes, strides, dtype and a cuda device, no
storage), which pass validation exactly as real CUDA tensors do:

- validation.check_inputs(q, k, v) (the tensor checks of every call);
- every Python check of a call: check_inputs, check_scale, check_window, check_softcap,
  check_no_grad and the canonical window: attention()'s host path up to the operator;
- dispatch.select(dtype, d_head, seqlen_q, built) over the forward configs a gate build
  contains (run once per process per (dtype, d_head, bucket, features) to fill the extension's
  table);
- parsing a kernel name, resolving a selection of forward sets, a kernel's generated source.

The problem is the GPU benchmark's tiny one: (batch, seq, heads, d_head) = (1, 128, 8, 64), bf16.

This file runs against the head's src and a base commit's (hostbench.py --base), which may
predate flash_attention.kernels (the one name scheme): there the same work goes through the old
modules (KernelConfig.parse of the old name, config_sets.resolve of the forward sets,
codegen.kernel_source), so that both sides time the same job and keep the same node ids.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from flash_attention import dispatch, validation

SHAPE = (1, 128, 8, 64)
# the default long-sequence bf16 kernel, by its name now and in the old scheme
DEFAULT_NAME = "fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor"
DEFAULT_OLD_NAME = "bf16_d128_r128_c64_w4_fseqkvbor"

try:  # this tree's package: one name scheme, selections of every kind
    from flash_attention.codegen.generate import kernel_source
    from flash_attention.kernels import parse, resolve

    KERNEL = DEFAULT_NAME
    # the forward sets (what config_sets held): the id of each selection timed, and the spec
    SPECS = {"ci,default": "fwd:ci,fwd:default", "all": "fwd:all"}

    def name_of(cfg) -> str:
        return cfg.name
except ImportError:  # a base commit from before it (config, config_sets, the codegen module)
    from flash_attention.config_sets import resolve

    from flash_attention import KernelConfig
    from flash_attention.codegen import kernel_source

    parse = KernelConfig.parse
    KERNEL = DEFAULT_OLD_NAME
    SPECS = {"ci,default": "ci,default", "all": "all"}

    def name_of(cfg) -> str:
        return cfg.short

BUILT = list(resolve(SPECS["ci,default"]))  # the forward kernels the gate builds


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
    cfg = benchmark(parse, KERNEL)
    assert name_of(cfg) == KERNEL and cfg.dtype == "bf16" and cfg.d_head == 128


@pytest.mark.benchmark(group="config")
@pytest.mark.parametrize("spec", ["ci,default", "all"])
def test_config_set_resolve(benchmark, spec):
    configs = benchmark(resolve, SPECS[spec])
    assert configs and all(not name_of(c).startswith("bwd_") for c in configs)


@pytest.mark.benchmark(group="codegen")
def test_codegen_kernel_source(benchmark):
    cfg = parse(KERNEL)
    text = benchmark(kernel_source, cfg)
    assert f"entry_{KERNEL}" in text
