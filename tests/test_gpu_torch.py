"""The operator in PyTorch's machinery on a GPU: torch.compile(fullgraph=True) with no graph
break, CUDA graph capture and replay, torch.library.opcheck, and the FlashAttention-compatible
functions against the reference."""

from __future__ import annotations

import pytest
import torch

import flash_attention as fa
from flash_attention.interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
)

from .gpu_support import check_against_reference, rand_inputs

pytestmark = pytest.mark.gpu


def test_compile_fullgraph_matches_eager(require_extension):
    torch._dynamo.reset()

    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            out = flash_attn_func(q, k, v, causal=True)
            return out * 2 + 1

    q, k, v = rand_inputs(2, 300, 300, 8, 2, 128, torch.bfloat16)
    block = Block()
    eager = block(q, k, v)
    compiled = torch.compile(block, fullgraph=True)  # fails on any graph break
    assert torch.equal(compiled(q, k, v), eager)
    q2, k2, v2 = rand_inputs(2, 300, 300, 8, 2, 128, torch.bfloat16)
    assert torch.equal(compiled(q2, k2, v2), block(q2, k2, v2))


@pytest.mark.parametrize("d_head", [64, 128])  # 128 causal: the dynamic schedule's counter
def test_cuda_graph_replay(require_extension, d_head):
    q, k, v = rand_inputs(2, 257, 257, 4, 4, d_head, torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        fa.attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa.attention(q, k, v, causal=True)
    for seed in (1, 2):
        torch.manual_seed(seed)
        for t in (q, k, v):
            t.normal_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fa.attention(q, k, v, causal=True))
        check_against_reference(out, q, k, v, what="graph replay", causal=True)


@pytest.mark.parametrize("features", [(-1, -1, 0.0), (-1, 0, 0.0), (64, 0, 20.0)])
def test_opcheck(require_extension, features):
    left, right, softcap = features
    q, k, v = rand_inputs(1, 130, 200, 4, 2, 128, torch.bfloat16)
    out = torch.empty_like(q)
    lse = torch.empty(1, 4, 130, device="cuda", dtype=torch.float32)
    torch.library.opcheck(torch.ops.flash_attention.fwd.default,
                          (q, k, v, out, lse, "", 0.088, left, right, softcap))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attn_functions(require_extension, dtype):
    torch.manual_seed(3)
    qkv = torch.randn(2, 211, 3, 4, 64, device="cuda", dtype=dtype)
    q, k, v = qkv.unbind(2)
    out = flash_attn_qkvpacked_func(qkv, causal=True, window_size=(50, -1))
    check_against_reference(out, q, k, v, what="qkvpacked", causal=True, window_size=(50, -1))
    q2 = torch.randn(2, 97, 8, 64, device="cuda", dtype=dtype)
    kv = torch.randn(2, 211, 2, 2, 64, device="cuda", dtype=dtype)
    out, lse, probs = flash_attn_kvpacked_func(q2, kv, softmax_scale=0.2, softcap=3.0,
                                               return_attn_probs=True)
    assert probs is None
    check_against_reference(out, q2, kv[:, :, 0], kv[:, :, 1], softmax_scale=0.2, lse=lse,
                            what="kvpacked", softcap=3.0)
    out = flash_attn_func(q2, kv[:, :, 0], kv[:, :, 1], causal=True, deterministic=True)
    check_against_reference(out, q2, kv[:, :, 0], kv[:, :, 1], what="func", causal=True)
