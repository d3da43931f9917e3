"""Every built forward kernel of the ci and default sets against the fp32 reference (GPU)."""

from __future__ import annotations

import math
import os

import pytest
import torch

import flash_attention as fa
from flash_attention.kernels import resolve

from .gpu_support import check_against_reference, poisoned_like, rand_inputs

pytestmark = pytest.mark.gpu

TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}

# (batch, seqlen_q, seqlen_k, heads, kv_heads): odd tails, Sq != Sk, heads != 16, GQA/MQA.
SHAPES = [
    (2, 128, 128, 4, 4),
    (1, 113, 203, 3, 3),
    (2, 128, 217, 5, 5),
    (1, 1023, 1024, 2, 2),
    (3, 1, 300, 4, 4),
    (1, 300, 1, 2, 2),
    (2, 257, 129, 6, 2),
    (1, 64, 512, 8, 1),
    (4, 200, 333, 16, 16),
]


def configs_under_test():
    """The built fixed-length forward configs of the ci and default sets of both forward kinds
    (all built ones with FLASH_ATTENTION_TEST_CONFIGS=built)."""
    if not fa.is_built():
        return []
    # Varlen kernels (fwd_sm90 flag j) take packed batches alone: test_gpu_varlen_hopper.py;
    # FP8 (e4m3) kernels their own inputs and rule: test_gpu_fp8.py.
    built = [c for c in fa.available_configs()
             if not getattr(c, "varlen", False) and c.dtype in TORCH_DTYPE]
    if os.environ.get("FLASH_ATTENTION_TEST_CONFIGS") == "built":
        return built
    wanted = set(TESTED)
    return [c for c in built if c in wanted]


TESTED = resolve("fwd:ci,fwd:default")
CONFIGS = configs_under_test()

# FA_TEST_GRID=gate (the pull-request gate, noxfile): every kernel still runs, each on a rotating
# sample of the grid (two shapes, two masked cases, one layout, one smaller d_head), so that the
# GPU job stays within its time budget while the kernels as a whole cover every option. The full
# grid (the default) is what `nox -s test` and ci/gpu_validate.sh run.
GATE_GRID = os.environ.get("FA_TEST_GRID") == "gate"


def sample(cfgs, options, per_cfg):
    """(cfg, *option) tuples (each option a tuple of the other parameters): every option for
    every cfg, or in the gate grid `per_cfg` options per cfg, rotating with the cfg's index."""
    out = []
    for i, cfg in enumerate(cfgs):
        chosen = ([options[(i * per_cfg + j) % len(options)] for j in range(per_cfg)]
                  if GATE_GRID else options)
        out += [(cfg, *option) for option in chosen]
    return out


def param_id(value):
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)


def test_extension_is_built_with_the_tested_sets(require_extension):
    built = set(fa.available_configs())
    missing = [c.name for c in TESTED if c not in built]
    if missing and os.environ.get("FLASH_ATTENTION_REQUIRE_EXT") == "1":
        pytest.fail(f"configs of the ci/default sets not built: {missing}")


def softcap_of(cfg):
    """A softcap kernel runs with softcap > 0 only; 1.5 bends typical scores well into the tanh."""
    return {"softcap": 1.5} if cfg.softcap else {}


@pytest.mark.parametrize("cfg, shape", sample(CONFIGS, [(s,) for s in SHAPES], 2), ids=param_id)
def test_kernel_matches_reference(cfg, shape):
    """Every kernel without a mask, and every kernel with one serving an unmasked call."""
    torch.manual_seed(hash((cfg.name, shape)) % 2**31)
    batch, sq, sk, heads, kv_heads = shape
    q, k, v = rand_inputs(batch, sq, sk, heads, kv_heads, cfg.d_head, TORCH_DTYPE[cfg.dtype])
    out = poisoned_like(q)
    opts = softcap_of(cfg)
    out2, lse = fa.attention(q, k, v, out=out, return_lse=True, config=cfg, **opts)
    assert out2 is out
    check_against_reference(out, q, k, v, lse=lse, what=f"{cfg} {shape}", **opts)
    # Same inputs again: a kernel without races is bitwise deterministic.
    again = fa.forward(cfg, q, k, v, out=poisoned_like(q), **opts)
    assert torch.equal(again, out), f"{cfg} {shape}: a second run differs (race?)"


MASK_CONFIGS = [c for c in CONFIGS if c.mask]
# (causal, window_size): causal, windows on one or both sides, causal with a left window, and
# the degenerate (0, 0) (each row sees one key).
MASKS = [(True, (-1, -1)), (False, (64, 64)), (False, (0, 0)), (True, (100, -1)),
         (False, (-1, 17)), (False, (300, 0)), (False, (5, 200))]
MASK_SHAPES = [SHAPES[i] for i in (1, 2, 3, 4, 5, 6, 7)]


@pytest.mark.parametrize(
    "cfg, shape, causal, window",
    # shape k % 7 with mask (k + k // 7) % 7: neighbouring options differ in both
    sample(MASK_CONFIGS, [(MASK_SHAPES[k % 7], *MASKS[(k + k // 7) % 7]) for k in range(49)], 2),
    ids=param_id)
def test_masked_kernel_matches_reference(cfg, shape, causal, window):
    """Causal (bottom-right when Sq != Sk, rows without keys when Sq > Sk) and windows."""
    torch.manual_seed(hash((cfg.name, shape, window)) % 2**31)
    batch, sq, sk, heads, kv_heads = shape
    q, k, v = rand_inputs(batch, sq, sk, heads, kv_heads, cfg.d_head, TORCH_DTYPE[cfg.dtype])
    opts = {"causal": causal, "window_size": window, **softcap_of(cfg)}
    out, lse = fa.attention(q, k, v, out=poisoned_like(q), return_lse=True, config=cfg, **opts)
    check_against_reference(out, q, k, v, lse=lse, what=f"{cfg} {shape} {opts}", **opts)
    again = fa.forward(cfg, q, k, v, out=poisoned_like(q), **opts)
    assert torch.equal(again, out), f"{cfg} {shape} {opts}: a second run differs (race?)"


# Persistent Hopper kernels: far more tiles than CTAs (the grid above holds at most 128 tiles,
# one per CTA), so that each CTA runs several in a row: Q buffers reused, tile hand-overs (flag
# n), odd query-block counts for CTA pairs, tails in both sequences. Masked kernels run causal and
# sliding windows whose KV ranges differ by one or two blocks at either end between neighbouring
# query blocks and clip at the sequence ends.
PERSISTENT_CONFIGS = [c for c in CONFIGS if getattr(c, "persistent", False)]
# (causal, window_size) of the masked kernels
MANY_TILE_MASKS = [(True, (-1, -1)), (False, (200, 300)), (False, (1, 700)), (False, (130, 0))]


@pytest.mark.parametrize(
    "cfg, causal, window",
    [(c, *m) for c in PERSISTENT_CONFIGS for m in (MANY_TILE_MASKS if c.mask
                                                   else [(False, (-1, -1))])],
    ids=param_id)
def test_persistent_kernel_over_many_tiles(cfg, causal, window):
    torch.manual_seed(hash((cfg.name, causal, window)) % 2**31)
    batch, sq, sk, heads, kv_heads = 3, 1000, 1111, 30, 6  # 720 tiles of 128 query rows
    q, k, v = rand_inputs(batch, sq, sk, heads, kv_heads, cfg.d_head, TORCH_DTYPE[cfg.dtype])
    opts = {"causal": causal, "window_size": window, **softcap_of(cfg)}
    out, lse = fa.attention(q, k, v, out=poisoned_like(q), return_lse=True, config=cfg, **opts)
    check_against_reference(out, q, k, v, lse=lse, what=f"{cfg} many tiles {opts}", **opts)
    again = fa.forward(cfg, q, k, v, out=poisoned_like(q), **opts)
    assert torch.equal(again, out), f"{cfg} many tiles {opts}: a second run differs (race?)"


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_kernel_row_max_grows_across_blocks(cfg):
    """Scores whose row maxima grow over the KV blocks in the kernels' visit order (the last
    block first) by far more than 8 in exp2 units (a factor 2^8): every rescale path runs,
    including the lazy rescale's moves (flag r) between blocks that keep the old max (softcap
    kernels bound the scores, so there only the plain path runs)."""
    torch.manual_seed(hash(cfg.name) % 2**31 + 1)
    batch, sq, sk, heads = 2, 300, 1100, 4
    q, k, v = rand_inputs(batch, sq, sk, heads, heads, cfg.d_head, TORCH_DTYPE[cfg.dtype])
    growth = torch.linspace(6.0, 1.0, sk, device="cuda", dtype=torch.float32)  # key 0 largest
    k = (k.float() * growth[None, :, None, None]).to(k.dtype)
    q = q * 2
    opts = {"causal": cfg.mask, **softcap_of(cfg)}
    out, lse = fa.attention(q, k, v, out=poisoned_like(q), return_lse=True, config=cfg, **opts)
    check_against_reference(out, q, k, v, lse=lse, what=f"{cfg} growing maxima {opts}", **opts)


@pytest.mark.parametrize("cfg, below", sample(CONFIGS, [(8,), (24,)], 1), ids=param_id)
def test_kernel_serves_smaller_d_head(cfg, below):
    """A variant runs every smaller multiple of 8 (here 8 and 24 below it) in place: the
    missing columns are zero-filled in smem and never stored."""
    d_head = cfg.d_head - below
    if d_head <= 0:
        pytest.skip(f"no d_head {below} below variant {cfg.d_head}")
    torch.manual_seed(d_head)
    q, k, v = rand_inputs(2, 177, 177, 4, 4, d_head, TORCH_DTYPE[cfg.dtype], "packed")
    # out as a view of a wider buffer: columns past d_head must stay untouched.
    wide = torch.full((2, 177, 4, cfg.d_head + 8), 7.0, device="cuda", dtype=q.dtype)
    out = wide[..., :d_head]
    opts = {"causal": cfg.mask, **softcap_of(cfg)}
    fa.attention(q, k, v, out=out, config=cfg, **opts)
    check_against_reference(out, q, k, v, what=f"{cfg} d_head={d_head}", **opts)
    assert torch.all(wide[..., d_head:] == 7.0), "a store went past d_head"


@pytest.mark.parametrize("cfg, layout", sample(CONFIGS, [("bhsd",), ("packed",)], 1),
                         ids=param_id)
def test_kernel_strided_inputs(cfg, layout):
    torch.manual_seed(7)
    q, k, v = rand_inputs(2, 177, 177, 3, 3, cfg.d_head, TORCH_DTYPE[cfg.dtype], layout)
    assert not q.is_contiguous()
    # out as a strided view too: (B, H, S, D) storage seen as (B, S, H, D).
    out = torch.full((2, 3, 177, cfg.d_head), float("nan"), device="cuda",
                     dtype=q.dtype).transpose(1, 2)
    opts = {"causal": cfg.mask, **softcap_of(cfg)}
    fa.attention(q, k, v, out=out, config=cfg, softmax_scale=0.3, **opts)
    check_against_reference(out, q, k, v, softmax_scale=0.3, what=f"{cfg} {layout}", **opts)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
# Every compiled variant, and d_heads between variants (40, 80, 200) that run on the next one.
@pytest.mark.parametrize("d_head", [32, 40, 64, 80, 96, 128, 160, 192, 200, 224, 256])
@pytest.mark.parametrize("seqlen", [1, 64, 500, 2048])
@pytest.mark.parametrize("features", [{}, {"causal": True}, {"window_size": (256, 0)},
                                      {"softcap": 30.0}, {"causal": True, "softcap": 2.0}],
                         ids=lambda f: "-".join(f) or "plain")
def test_dispatched_attention(require_extension, dtype, d_head, seqlen, features):
    torch.manual_seed(seqlen)
    q, k, v = rand_inputs(2, seqlen, seqlen + 3, 4, 2, d_head, TORCH_DTYPE[dtype])
    out, lse = fa.attention(q, k, v, return_lse=True, **features)
    check_against_reference(out, q, k, v, lse=lse,
                            what=f"dispatch {dtype} d{d_head} {seqlen} {features}", **features)


def test_empty_inputs(require_extension):
    q = torch.randn(2, 0, 4, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 5, 4, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = fa.attention(q, k, k, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 4, 0)
    q = torch.randn(0, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    assert fa.attention(q, q, q).shape == q.shape


def test_rows_without_keys_give_zero_and_minus_inf(require_extension):
    """Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key; a whole
    query block of such rows visits no KV block at all."""
    q, k, v = rand_inputs(1, 400, 100, 2, 2, 128, torch.bfloat16)
    out, lse = fa.attention(q, k, v, out=poisoned_like(q), causal=True, return_lse=True)
    assert torch.all(out[:, :300] == 0) and torch.all(lse[:, :, :300] == -math.inf)
    check_against_reference(out, q, k, v, lse=lse, what="causal 400 x 100", causal=True)


def test_empty_keys(require_extension):
    q = torch.randn(2, 7, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 0, 4, 64, device="cuda", dtype=torch.float16)
    out, lse = fa.attention(q, k, k, out=poisoned_like(q), return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


def test_64bit_offsets(require_extension):
    """Inputs whose elements lie beyond 2^31 from the base pointer: batch 1 starts past it."""
    d, s, h = 128, 100, 2
    batch_stride = 2**31 // (d * h) * (d * h) + d * h * 64  # > 2^31 elements
    storage = torch.empty(batch_stride + 4 * s * h * d, device="cuda", dtype=torch.bfloat16)
    storage.normal_()

    def view(offset):
        return storage.as_strided((2, s, h, d), (batch_stride, h * d, d, 1), offset)

    q, k, v = view(0), view(s * h * d), view(2 * s * h * d)  # disjoint in batch 0 and 1
    assert q[1].storage_offset() + q.stride(0) > 2**31
    out = view(3 * s * h * d)
    out.fill_(float("nan"))
    fa.attention(q, k, v, out=out)
    check_against_reference(out, q.contiguous(), k.contiguous(), v.contiguous(), what="2^31+")


def test_runs_on_current_stream_and_other_device_guard(require_extension):
    q, k, v = rand_inputs(1, 256, 256, 2, 2, 128, torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = fa.attention(q, k, v)
    stream.synchronize()
    check_against_reference(out, q, k, v, what="side stream")
