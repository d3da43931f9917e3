"""benchmarks/bench_attention.py's backward and training-step benchmarks without a GPU: their
parameter lists against the cases measured, the tracks asv records from a measured cache, and
skipping (no GPU, no backward kernel, a peer that cannot run a case)."""

from __future__ import annotations

import itertools
import math

import pytest

from .script_modules import load_script, run_asv_class

ba = load_script("benchmarks/bench_attention.py")
GRAD_CLASSES = (ba.Backward, ba.TrainingStep)


def _cache(skipped: dict[str, str] | None = None):
    """A measured cache of every backward case: ours 2 ms, SDPA FA2 2.5, cuDNN 1.6 (cuDNN
    absent on d_head 64, as a peer that cannot run a case)."""
    measured = {c.name: {"ours": 2.0, "sdpa_fa2": 2.5,
                         **({"sdpa_cudnn": 1.6} if c.d_head == 128 else {})}
                for c in ba.BWD_CASES if c.name not in (skipped or {})}
    return ba.Measured(measured, skipped or {})


def test_every_parameter_combination_is_a_measured_case_and_back():
    for cls in GRAD_CLASSES:
        assert cls.param_names == ["dtype", "d_head", "mask", "batch_x_seq"]
        combos = list(itertools.product(*cls.params))
        assert len(combos) == len(ba.BWD_CASES) == len({c.name for c in ba.BWD_CASES})
        assert len(run_asv_class(cls, _cache())) == len(combos), "every combination finds its case"
    assert {c.causal for c in ba.BWD_CASES} == {False, True}
    assert {c.d_head for c in ba.BWD_CASES} == {64, 128}


def test_tracks_are_the_times_and_their_ratios_in_the_same_run():
    got = run_asv_class(ba.Backward, _cache())
    d128 = got[("bf16", 128, "causal", "16x4096")]
    assert d128["track_ours_ms"] == 2.0 and d128["track_sdpa_fa2_ms"] == 2.5
    assert d128["track_ratio_to_sdpa_fa2"] == pytest.approx(0.8)
    assert d128["track_ratio_to_sdpa_cudnn"] == pytest.approx(1.25)
    d64 = got[("fp16", 64, "full", "4x16384")]
    assert math.isnan(d64["track_sdpa_cudnn_ms"]) and math.isnan(
        d64["track_ratio_to_sdpa_cudnn"]), "a peer that could not run: nan, not a number"


def test_cases_without_a_backward_kernel_or_gpu_are_skipped_with_the_reason():
    name = ba.Case("fp16", 64, 16, 1024).name
    cache = _cache({name: "this build has no fp16 backward kernel for d_head 64"})
    for cls in GRAD_CLASSES:
        assert ("fp16", 64, "full", "16x1024") not in run_asv_class(cls, cache)
        with pytest.raises(NotImplementedError, match="no fp16 backward kernel"):
            cls().setup(cache, "fp16", 64, "full", "16x1024")
        no_gpu = {"skip": "no CUDA GPU: timings skipped"}
        assert run_asv_class(cls, no_gpu) == {}
    assert ba.TrainingStep.setup_cache is not ba.Backward.setup_cache, "each measures its kind"


def test_decode_tracks_every_step_with_its_ratio_to_cudnn():
    """Each decode step is a parameter; its tracks are ours, cuDNN's and their ratio from the
    same cache; a step cuDNN cannot run gives nan; a skipped step or no GPU is skipped."""
    assert len(ba.DECODE_SHAPES) == len(set(ba.DECODE_SHAPES)) == len(ba.DECODE_STEPS)
    cache = {s: {"ours": 0.02, "sdpa_cudnn": 0.025} for s in ba.DECODE_SHAPES}
    cache[ba.DECODE_SHAPES[1]] = {"ours": 0.1}
    cache[ba.DECODE_SHAPES[2]] = {"skip": "this build has no flash_attn_with_kvcache"}
    got = run_asv_class(ba.Decode, cache)
    assert set(got) == {(s,) for s in ba.DECODE_SHAPES} - {(ba.DECODE_SHAPES[2],)}
    first = got[(ba.DECODE_SHAPES[0],)]
    assert first["track_ours_ms"] == 0.02 and first["track_sdpa_cudnn_ms"] == 0.025
    assert first["track_ratio_to_sdpa_cudnn"] == pytest.approx(0.8)
    assert math.isnan(got[(ba.DECODE_SHAPES[1],)]["track_ratio_to_sdpa_cudnn"])
    assert run_asv_class(ba.Decode, {"skip": "no CUDA GPU: timings skipped"}) == {}
    assert any("page" in s for s in ba.DECODE_SHAPES) and ba.DECODE_STEPS[0][0] == 1


@pytest.mark.gpu
def test_grad_contenders_give_the_gradients_of_one_problem(require_extension):
    import torch

    q, k, v, dout = (torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    for kind in ("bwd", "fwdbwd"):
        fns = ba.grad_contenders(q, k, v, dout, kind, causal=True)
        ref = fns["ours"]()
        for name, fn in fns.items():
            for g, r in zip(fn(), ref):
                g = g.transpose(1, 2) if name != "ours" else g
                err = ((g.float() - r.float()).norm() / r.float().norm()).item()
                assert err < 2e-2, (kind, name)


def test_backward_kernel_names_of_this_and_older_commits():
    """The benchmark reads the backward kernels an installed build lists, of this tree (one
    name scheme) or an older commit (asv measures those with this file): the sm80 kind's (every
    call runs on one), by dtype and d_head variant, softcap flag apart."""
    import re

    from flash_attention.kernels import bwd_sm80, resolve
    from flash_attention.kernels.legacy import old_name

    def read(name):  # None for no name (a kernel born in the one scheme has no old one)
        m = name and re.fullmatch(ba.SM80_BWD_NAME, name)
        return m and (m[1], int(m[2]), "t" in m[3])

    for cfg in resolve("bwd:all"):
        want = (cfg.dtype, cfg.d_head, cfg.softcap) if cfg.KIND == "bwd_sm80" else None
        assert read(cfg.name) == want == read(old_name(cfg.name)), cfg.name
    assert read(bwd_sm80.default_tile("bf16", 128).name) == ("bf16", 128, False)
    assert read("bwd_sm80_preprocess_bf16") is None and read("bwd_preprocess_bf16") is None


def test_fp8_tracks_every_shape_with_its_speedup():
    """Each FP8 shape is a parameter; its tracks are the FP8 and bf16 times and their ratio
    from the same cache; a skipped shape (a build without FP8, a GPU other than sm_90) or no
    GPU is skipped."""
    assert len(ba.FP8_SHAPES) == len(set(ba.FP8_SHAPES)) == len(ba.FP8_STEPS)
    cache = {s: {"fp8": 2.0, "bf16": 2.5} for s in ba.FP8_SHAPES}
    cache[ba.FP8_SHAPES[1]] = {"skip": "the FP8 forward runs on sm_90 GPUs alone"}
    got = run_asv_class(ba.Fp8Forward, cache)
    assert set(got) == {(s,) for s in ba.FP8_SHAPES} - {(ba.FP8_SHAPES[1],)}
    first = got[(ba.FP8_SHAPES[0],)]
    assert first["track_fp8_ms"] == 2.0 and first["track_bf16_ms"] == 2.5
    assert first["track_speedup_over_bf16"] == pytest.approx(1.25)
    assert run_asv_class(ba.Fp8Forward, {"skip": "no CUDA GPU: timings skipped"}) == {}


def test_fp8_cache_tracks_every_step_with_its_speedup():
    """Each FP8-cache decode step is a parameter; its tracks are the FP8 and bf16 cache times
    and their ratio from the same cache; a skipped step (a build without FP8 caches) or no GPU
    is skipped."""
    assert len(ba.FP8_CACHE_SHAPES) == len(set(ba.FP8_CACHE_SHAPES)) == len(ba.FP8_CACHE_STEPS)
    assert {fmt for *_, fmt in ba.FP8_CACHE_STEPS} == {"e4m3", "e5m2"}
    assert any(page for _, _, page, _ in ba.FP8_CACHE_STEPS)
    cache = {s: {"fp8": 0.3, "bf16": 0.5} for s in ba.FP8_CACHE_SHAPES}
    cache[ba.FP8_CACHE_SHAPES[1]] = {"skip": "this build's flash_attn_with_kvcache takes no FP8"}
    got = run_asv_class(ba.Fp8CacheDecode, cache)
    assert set(got) == {(s,) for s in ba.FP8_CACHE_SHAPES} - {(ba.FP8_CACHE_SHAPES[1],)}
    first = got[(ba.FP8_CACHE_SHAPES[0],)]
    assert first["track_fp8_ms"] == 0.3 and first["track_bf16_ms"] == 0.5
    assert first["track_speedup_over_bf16"] == pytest.approx(0.5 / 0.3)
    assert run_asv_class(ba.Fp8CacheDecode, {"skip": "no CUDA GPU: timings skipped"}) == {}


def test_paged_cache_keeps_every_row_in_its_table_order():
    """paged_cache's pools hold each sequence's rows in its block table's pages (FP8 as bytes),
    and a given table is reused."""
    import torch

    k = torch.arange(2 * 10 * 1 * 16, dtype=torch.float32).view(2, 10, 1, 16)
    k8 = k.to(torch.float8_e5m2)
    table, (pk, pv) = ba.paged_cache(k, k, 4)
    assert table.shape == (2, 3) and pk.shape == (6, 4, 1, 16)
    for pool in (pk, pv):
        assert torch.equal(pool[table.long()].flatten(1, 2)[:, :10], k)
    again, (p8, _) = ba.paged_cache(k8, k8, 4, table)
    assert again is table and p8.dtype == torch.float8_e5m2
    assert torch.equal(p8.view(torch.uint8)[table.long()].flatten(1, 2)[:, :10],
                       k8.view(torch.uint8))
