"""The perf gate's case list against the dispatch tables (CPU): every kind of kernel the tables
run on the gate's GPU (sm_90) has a gate case that dispatch routes to it, computed with
dispatch's own functions on the `default` kernel set, and each call feature has a case."""

from __future__ import annotations

import pytest

from fa_tools.gate import coverage
from fa_tools.gpu.perfcases import GATE_CASES, Case
from flash_attention import dispatch
from flash_attention.config_sets import resolve


@pytest.fixture
def rows(monkeypatch, tmp_path):
    """The dispatch rows of a `default` build, with no tuning file (the tables alone)."""
    monkeypatch.setenv("FLASH_ATTENTION_TUNING_FILE", str(tmp_path / "none.json"))
    monkeypatch.setattr(dispatch, "_tuning", None)
    return coverage.dispatch_rows(c.short for c in resolve("default"))


def _routes(rows, sm90=True) -> dict[str, str]:
    return {c.name: coverage.route(c, rows, sm90) for c in GATE_CASES}


def test_every_gate_case_has_a_kernel_on_either_gpu(rows):
    for sm90 in (True, False):
        missing = [name for name, k in _routes(rows, sm90).items() if k is None]
        assert not missing, f"no dispatch row for {missing} (sm90={sm90})"


def test_every_hopper_tile_of_the_table_is_run_by_a_gate_case(rows):
    """Each kernel of SM90_TABLE (d_head 64, 128, 256; no mask, masks, windows), dtype aside."""
    run = {coverage.kind(k) for k in _routes(rows).values()}
    wanted = {coverage.kind(kernel)
              for (dtype, d, _mask, _local, _softcap), table in dispatch.SM90_TABLE.items()
              if dtype == "bf16" and d in (64, 128, 256) for _, kernel in table}
    assert wanted - run == set()


def test_softcap_and_varlen_kernels_are_run(rows):
    """Softcap rows have no Hopper kernel: their sm80-family kernels, with and without masks;
    a varlen batch runs the sm80-family fallback of its row."""
    routes = _routes(rows)
    flags = {k.rsplit("_f", 1)[1] for k in routes.values() if not k.startswith("sm90_")}
    assert any(f.endswith("t") and "m" not in f for f in flags), "softcap, no mask"
    assert any(f.endswith("mt") for f in flags), "softcap with masks"
    varlen = [c for c in GATE_CASES if c.varlen]
    assert varlen and all(not routes[c.name].startswith("sm90_") for c in varlen)


def test_each_call_feature_has_a_case():
    def has(pred) -> bool:
        return any(pred(c) for c in GATE_CASES)

    assert has(lambda c: not (c.causal or c.window or c.softcap)), "no mask"
    assert has(lambda c: c.causal and not c.varlen), "causal"
    assert has(lambda c: c.window is not None and c.window[0] >= 0), "sliding window"
    assert has(lambda c: c.softcap > 0), "softcap"
    assert has(lambda c: c.kv_heads is not None and c.kv_heads < c.heads), "GQA"
    assert has(lambda c: c.varlen), "varlen"
    assert has(lambda c: 128 <= c.seqlen <= 512), "short sequences"
    assert has(lambda c: c.seqlen_k is not None and c.seqlen_k != c.seqlen), "Sq != Sk"
    assert {c.dtype for c in GATE_CASES} == {"bf16", "fp16"}
    assert has(lambda c: c.d_head == 64) and has(lambda c: c.d_head in (96, 128))
    assert has(lambda c: c.d_head in (160, 192, 224)) and has(lambda c: c.d_head == 256)


def test_a_case_made_for_a_kernel_routes_back_to_it(rows):
    """case_for_kernel inverts route for every kernel the table runs, on sm_90 (fixed-length
    for a row's kernel, varlen for a fallback only) and on other GPUs."""
    for sm90 in (True, False):
        kernels = {r.kernel if sm90 else r.fallback for r in rows}
        if sm90:
            kernels |= {r.fallback for r in rows}
        for kernel in sorted(kernels):
            case = coverage.case_for_kernel(kernel, rows, sm90)
            assert case is not None and coverage.route(case, rows, sm90) == kernel, kernel
            assert case.batch * case.seqlen <= coverage.CASE_TOKENS


def test_case_for_kernel_prefers_the_kernels_own_variant_and_skips_the_undispatched(rows):
    case = coverage.case_for_kernel("sm90_bf16_d256_c64_g2_s2_fwpoem", rows, sm90=True)
    assert case == Case("bf16", 256, 16, 4096, causal=True), "d 256 (not 160), causal first"
    local = coverage.case_for_kernel("sm90_bf16_d128_c128_g2_s2_fwoesqrm", rows, sm90=True)
    assert local.window == (1024, 0) and not local.causal
    assert coverage.case_for_kernel("bf16_d64_r128_c64_w8_fseqbrmt", rows, sm90=True) is None
