"""The perf gate's case list against the dispatch tables (CPU): every kind of kernel the tables
run on the gate's GPU (sm_90) has a gate case that dispatch routes to it, computed with
dispatch's own functions on the `default` kernel set, and each call feature has a case; the
same for the backward kernels the operator picks (the select of kernels.bwd_sm80 and
bwd_sm90) and the backward's features."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fa_tools.gate import coverage
from fa_tools.gpu.perfcases import (
    BWD_GATE_CASES,
    DEC_GATE_CASES,
    FP8_GATE_CASES,
    FWD_GATE_CASES,
    GATE_CASES,
    Case,
)
from flash_attention import dispatch
from flash_attention.kernels import Call, bwd_sm80, dec_sm80, fwd_sm90, parse, resolve
from flash_attention.kernels.bwd_sm90 import Sm90BwdConfig
from flash_attention.kernels.helpers import helpers
from flash_attention.kernels.legacy import current_name

# the sm80 kind's default tiles alone (a build without the Hopper backward), and their
# helpers: the preprocess and the row-order dQ conversion of each dtype
BWD_DEFAULT = [c.name for c in bwd_sm80.DEFAULT]
BWD_HELPERS = [h.name for h in helpers(bwd_sm80.DEFAULT)]
# what the gate's build holds: the `default` set, the Hopper backward beside the sm80 kind
# (which serves the rest), and both kinds' helpers (the Hopper one's dQ conversion too)
BWD_HOPPER = [c.name for c in resolve("bwd:default")]
BWD_HOPPER_HELPERS = [h.name for h in helpers(resolve("bwd:default"))]
# A build with the fixed-length Hopper backward alone (no varlen kernels, flag j): varlen calls
# run the sm80 family on sm_90 there.
BWD_HOPPER_FIXED = [c.name for c in resolve("bwd:default") if not getattr(c, "varlen", False)]
BWD_HOPPER_FIXED_HELPERS = [h.name for h in helpers([parse(k) for k in BWD_HOPPER_FIXED])]
# the default set behind a d_head 64 kernel of another tile (B_r 64, the old ci set's) that
# comes first: the operator picks its row's kernel (the default's), so the other is shadowed
SHADOWED = [c.name for c in resolve(current_name("bwd_bf16_d64_c128_r64_w8_fb")
                                    + ",bwd_sm80:default")]


def test_the_helpers_of_each_build():
    assert BWD_HELPERS == ["bwd_sm80_preprocess_fp16", "bwd_sm80_convert_dq_fp16",
                           "bwd_sm80_preprocess_bf16", "bwd_sm80_convert_dq_bf16"]
    assert [
        f"bwd_{job}_{dt}" for dt in ("fp16", "bf16")
        for job in ("sm80_preprocess", "sm80_convert_dq", "sm90_convert_dq",
                    "sm90_preprocess_varlen", "sm90_convert_dq_varlen")] == BWD_HOPPER_HELPERS


@pytest.fixture
def rows(monkeypatch, tmp_path):
    """The dispatch rows of a `default` build, with no tuning file (the tables alone)."""
    monkeypatch.setenv("FLASH_ATTENTION_TUNING_FILE", str(tmp_path / "none.json"))
    monkeypatch.setattr(dispatch, "_tuning", None)
    return coverage.dispatch_rows(c.name for c in resolve("fwd:default"))


def _routes(rows, sm90=True) -> dict[str, str]:
    """The forward kernel of every gate case that times the forward (fwd and fwdbwd)."""
    return {c.name: coverage.route(c, rows, sm90) for c in GATE_CASES if c.times_forward}


def test_every_gate_case_has_a_kernel_on_either_gpu(rows):
    """Every forward case has a kernel on sm_90 and, the FP8 ones aside (sm_90 alone), on
    another GPU."""
    fp8 = {c.name for c in FP8_GATE_CASES}
    for sm90 in (True, False):
        missing = [name for name, k in _routes(rows, sm90).items()
                   if k is None and (sm90 or name not in fp8)]
        assert not missing, f"no dispatch row for {missing} (sm90={sm90})"
    assert all(_routes(rows, sm90=False)[name] is None for name in fp8)


def test_every_fp8_kernel_of_the_table_is_run_by_an_fp8_case(rows):
    """Each e4m3 kernel of the default table (d_head 128 and 256, each with and without masks
    and softcap) is run by an FP8 gate case on sm_90; the gate leaves the FP8 cases out on
    another GPU (and says so), and a case made for an FP8 kernel is an FP8 forward case."""
    from fa_tools.gate.perf import runnable_here

    wanted = {c.name for c in resolve("fwd:default") if c.dtype == "e4m3"}
    assert len(wanted) == 16  # 8 fixed-length, 8 varlen (flag j)
    run = {coverage.route(c, rows, True) for c in FP8_GATE_CASES}
    assert wanted <= run
    assert all(c.fp8 and c.kind == "fwd" for c in FP8_GATE_CASES)
    assert any(c.varlen for c in FP8_GATE_CASES) and any(not c.varlen for c in FP8_GATE_CASES)
    assert any(c.kv < c.heads for c in FP8_GATE_CASES)
    assert any(c.window is not None for c in FP8_GATE_CASES)
    assert any(not (c.softcap or c.window) for c in FP8_GATE_CASES), "an SDPA peer"
    kept, left = runnable_here(list(GATE_CASES), "80")
    assert sorted(left) == sorted(c.name for c in FP8_GATE_CASES)
    assert not any(c.fp8 for c in kept)
    assert runnable_here(list(GATE_CASES), "90") == (list(GATE_CASES), [])
    for kernel in wanted:
        case = coverage.case_for_kernel(kernel, rows, sm90=True)
        assert case.fp8 and coverage.route(case, rows, True) == kernel
    assert coverage.case_for_kernel("", rows, sm90=True) is None
    with pytest.raises(ValueError, match="e4m3"):
        Case("e4m3", 128, 4, 4096, kind="bwd")


def test_every_hopper_tile_of_the_table_is_run_by_a_gate_case(rows):
    """Each kernel of the Hopper table (d_head 64, 128, 256; no mask, masks, windows), dtype
    aside."""
    run = {coverage.kind(k) for k in _routes(rows).values()}
    wanted = {coverage.kind(kernel)
              for d in (64, 128, 256) for mask, local in ((False, False), (True, False),
                                                          (True, True))
              for _, kernel in fwd_sm90.table_rows(Call("bf16", d, mask=mask, local=local))}
    # softcap rows with and without masks at d_head 128 and 256
    wanted |= {coverage.kind(kernel) for d, mask in ((128, False), (256, True))
               for _, kernel in fwd_sm90.table_rows(Call("bf16", d, mask=mask, softcap=True))}
    assert len(wanted) > 10
    assert wanted - run == set()


def test_softcap_and_varlen_kernels_are_run(rows):
    """Softcap calls run the Hopper softcap rows, with and without masks; varlen batches the
    Hopper varlen kernels (flag j), with a softcap too; on another GPU the sm80 family runs
    them all."""
    routes = _routes(rows)
    hopper = {k.rsplit("_f", 1)[1] for k in routes.values() if k.startswith("fwd_sm90_")}
    assert any(f.endswith("t") and "m" not in f and "j" not in f for f in hopper), "softcap"
    assert any(f.endswith("mt") and "j" not in f for f in hopper), "softcap with masks"
    varlen = [c for c in GATE_CASES if c.varlen and c.times_forward]
    assert len(varlen) >= 3
    assert all(parse(routes[c.name]).varlen for c in varlen)
    assert any(parse(routes[c.name]).softcap for c in varlen)
    assert any(parse(routes[c.name]).mask for c in varlen)
    assert all(not k.startswith("fwd_sm90_") for k in _routes(rows, sm90=False).values() if k)


def test_each_call_feature_has_a_case():
    assert {c.kind for c in FWD_GATE_CASES} == {"fwd"}
    assert {c.kind for c in BWD_GATE_CASES} == {"bwd", "fwdbwd"}
    assert GATE_CASES == FWD_GATE_CASES + BWD_GATE_CASES + DEC_GATE_CASES + FP8_GATE_CASES
    assert {c.kind for c in DEC_GATE_CASES} == {"decode"}

    def has(pred) -> bool:
        return any(pred(c) for c in FWD_GATE_CASES)

    assert has(lambda c: not (c.causal or c.window or c.softcap)), "no mask"
    assert has(lambda c: c.causal and not c.varlen), "causal"
    assert has(lambda c: c.window is not None and c.window[0] >= 0), "sliding window"
    assert has(lambda c: c.softcap > 0), "softcap"
    assert has(lambda c: c.kv_heads is not None and c.kv_heads < c.heads), "GQA"
    assert has(lambda c: c.varlen), "varlen"
    assert has(lambda c: 128 <= c.seqlen <= 512), "short sequences"
    assert has(lambda c: c.seqlen_k is not None and c.seqlen_k != c.seqlen), "Sq != Sk"
    assert {c.dtype for c in FWD_GATE_CASES} == {"bf16", "fp16"}
    assert has(lambda c: c.d_head == 64) and has(lambda c: c.d_head in (96, 128))
    assert has(lambda c: c.d_head in (160, 192, 224)) and has(lambda c: c.d_head == 256)


def test_every_decode_kernel_and_cache_form_has_a_decode_case():
    """Each decode kernel of the default set, dtype aside, and the combine run by a gate case
    (on a GPU of 132 SMs); every way a step reads its cache: split (the combine) and one pass,
    contiguous and paged (a page smaller than a key block and one holding whole blocks), and
    more than one query (speculative decoding, causal); both dtypes, GQA and MHA."""
    run = {k for c in DEC_GATE_CASES for k in coverage.kernels_run(c, [], [], sm90=True)}
    assert {coverage.kind(c.name) for c in dec_sm80.DEFAULT} <= {coverage.kind(k) for k in run}
    assert any(k.startswith("dec_sm80_combine_") for k in run)
    splits = [coverage.dec_splits(c) for c in DEC_GATE_CASES]
    assert 1 in splits and max(splits) > 2
    pages = {c.page_size for c in DEC_GATE_CASES}
    assert 0 in pages and any(0 < p < 16 * 2 for p in pages) and any(p >= 64 for p in pages)
    assert any(c.seqlen > 1 and c.causal for c in DEC_GATE_CASES)
    assert {c.dtype for c in DEC_GATE_CASES} == {"bf16", "fp16"}
    assert any(c.kv < c.heads for c in DEC_GATE_CASES)
    assert any(c.kv == c.heads for c in DEC_GATE_CASES)


def test_a_decode_case_made_for_a_kernel_runs_it():
    """case_for_dec_kernel inverts kernels_run for every decode kernel of the default set and
    both combines; a decode kernel the table does not run gets none."""
    for cfg in dec_sm80.DEFAULT:
        case = coverage.case_for_dec_kernel(cfg.name)
        assert case.kind == "decode" and cfg.name in coverage.kernels_run(case, [], [], True)
    for dtype in ("bf16", "fp16"):
        name = f"dec_sm80_combine_{dtype}"
        assert name in coverage.kernels_run(coverage.case_for_dec_kernel(name), [], [], True)
    assert coverage.case_for_dec_kernel("dec_sm80_bf16_d128_r16_c32_w2_f") is None
    # a deep kernel runs on sm_90 alone (more shared memory than sm_80 gives a CTA)
    deep = coverage.case_for_dec_kernel("dec_sm80_bf16_d128_r16_c16_w8_f")
    assert deep.keys == 2048 and deep.batch * deep.kv == 128
    assert coverage.case_for_dec_kernel("dec_sm80_bf16_d128_r16_c16_w8_f", sm90=False) is None
    assert coverage.dec_kernel(deep, sm90=False) == "dec_sm80_bf16_d128_r16_c16_w4_f"
    # off sm_90 a case of the deep band splits as the 4-warp kernel does (16 x 8192: 2, combined)
    band = replace(deep, seqlen_k=8192)
    assert coverage.dec_splits(band) == 1 and coverage.dec_splits(band, sm90=False) == 2
    assert "dec_sm80_combine_bf16" in coverage.kernels_run(band, [], [], False)
    assert "dec_sm80_combine_bf16" not in coverage.kernels_run(band, [], [], True)


def test_decode_case_names_and_checks():
    """Page size and kind show in the name; a page size outside a decode case, or a decode
    case without its cache length, is refused."""
    c = Case("bf16", 128, 16, 1, heads=32, kv_heads=8, seqlen_k=8192, page_size=16,
             kind="decode")
    assert c.name == "bf16_d128_b16_s1_sk8192_kv8_page16_decode"
    with pytest.raises(ValueError, match="page_size"):
        Case("bf16", 128, 16, 1, page_size=16)
    with pytest.raises(ValueError, match="seqlen_k"):
        Case("bf16", 128, 16, 1, kind="decode")


def test_a_case_made_for_a_kernel_routes_back_to_it(rows):
    """case_for_kernel inverts route for every kernel the table runs, on sm_90 (fixed-length
    for a row's kernel, varlen for its varlen kernel, or its fallback where it has none) and
    on other GPUs."""
    for sm90 in (True, False):
        kernels = {r.kernel if sm90 else r.fallback for r in rows}
        if sm90:
            kernels |= {r.varlen or r.fallback for r in rows}
        for kernel in sorted(kernels - {""}):  # "": an FP8 row's fallback and varlen kernel
            case = coverage.case_for_kernel(kernel, rows, sm90)
            assert case is not None and coverage.route(case, rows, sm90) == kernel, kernel
            assert case.batch * case.seqlen <= coverage.CASE_TOKENS


def test_case_for_kernel_prefers_the_kernels_own_variant_and_skips_the_undispatched(rows):
    case = coverage.case_for_kernel("fwd_sm90_bf16_d256_r128_c64_s2_fwpiam", rows, sm90=True)
    assert case == Case("bf16", 256, 16, 4096, causal=True), "d 256 (not 160), causal first"
    local = coverage.case_for_kernel("fwd_sm90_bf16_d128_r128_c128_s2_fwialgzm", rows, sm90=True)
    assert local.window == (1024, 0) and not local.causal
    assert coverage.case_for_kernel("fwd_sm80_bf16_d64_r128_c64_w8_fseqbrmt", rows,
                                    sm90=True) is None


# ---- cases chosen by the SASS diff (synthetic code, no build) ---------------------------------


def test_changed_kernels_counts_instructions_from_any_code():
    from fa_tools.gate.sassdiff import changed_kernels

    base = {"a": ["MOV", "FFMA", "HMMA", "EXIT"], "b": ["X", "Y", "Z"], "c": ["S", "T"],
            "gone": ["Q"]}
    head = {"a": ["MOV", "FFMA", "HMMA", "EXIT"], "b": ["X", "Y2", "Y3", "Z"], "c": ["T", "S"],
            "new": ["N"] * 5}
    changes = {c.kernel: c for c in changed_kernels(base, head)}
    assert set(changes) == {"b", "c", "new"}, "unchanged kernels and base-only ones drop out"
    assert (changes["b"].added, changes["b"].removed, changes["b"].changed) == (2, 1, 2)
    assert "b: SASS differs (2 instructions changed: +2 -1 of 4)" in changes["b"].describe()
    assert changes["c"].changed == 2, "a reordering counts the positions that moved"
    assert changes["new"].new and "new in the head (5 instructions)" in changes["new"].describe()
    assert [c.kernel for c in changed_kernels(base, head)] == ["new", "b", "c"]


def test_selection_adds_cases_for_changed_kernels_no_gate_case_runs(rows):
    from fa_tools.gate import sassdiff

    def change(kernel, n):
        return sassdiff.KernelChange(kernel, n, n, 1000)

    changes = [change("fwd_sm80_fp16_d32_r128_c64_w4_fseqkvbor", 90),  # d 32: no Hopper row
               change("fwd_sm90_bf16_d128_r128_c128_s2_fwialgz", 50),  # run by bf16_d128_b16_s4096
               change("fwd_sm80_bf16_d64_r128_c64_w8_fseqbrmt", 40),  # ci set only: no row runs it
               change("fwd_sm90_fp16_d64_r192_c96_s3_fwaln", 30),  # fp16 d 64: no gate case
               change("fwd_sm90_fp16_d256_r128_c64_s2_fwpiaz", 20)]  # over the cap
    sel = sassdiff.select(changes, rows, BWD_DEFAULT, True, GATE_CASES, cap=2)
    assert [a["case"] for a in sel.added] == ["fp16_d32_b16_s4096",
                                              "fp16_d64_b16_s4096"]
    assert sel.added[0]["why"] == ("kernel fwd_sm80_fp16_d32_r128_c64_w4_fseqkvbor: SASS differs "
                                   "(90 instructions changed: +90 -90 of 1000)")
    for added in sel.cases:
        assert coverage.route(added, rows, True) in {c.kernel for c in changes}
    assert sel.covered[0]["case"] == "bf16_d128_b16_s4096"
    skipped = {s["kernel"]: s["why"] for s in sel.skipped}
    assert "no dispatch row runs it" in skipped["fwd_sm80_bf16_d64_r128_c64_w8_fseqbrmt"]
    assert "over the policy's cap of 2" in skipped["fwd_sm90_fp16_d256_r128_c64_s2_fwpiaz"]
    # on an sm_80 GPU the Hopper kernels run nothing: fp16 d 64 runs its sm80 kernel instead
    sel = sassdiff.select(changes, rows, BWD_DEFAULT, False, GATE_CASES, cap=6)
    assert "fwd_sm90_fp16_d64_r192_c96_s3_fwaln" in {s["kernel"] for s in sel.skipped}


# ---- the backward: the kernels the operator picks, cases for changed ones ----------------------


def test_every_default_backward_kernel_kind_and_helper_is_run_by_a_gate_case():
    """Each kernel of the `default` backward set (d_head 64, 128, 256, with and without a
    softcap), dtype aside, is the operator's pick for a backward gate case; the preprocess and
    the dQ conversion of both dtypes run too. No backward case runs a kernel the build lacks."""
    run = {c.name: coverage.kernels_run(c, [], BWD_DEFAULT, sm90=True) for c in BWD_GATE_CASES
           if c.kind == "bwd"}
    assert all(len(kernels) == 3 for kernels in run.values()), run
    ran = {k for kernels in run.values() for k in kernels}
    kinds = {coverage.kind(k) for k in ran if k in BWD_DEFAULT}
    assert kinds == {coverage.kind(k) for k in BWD_DEFAULT}
    assert set(BWD_HELPERS) <= ran


def test_every_backward_kernel_of_the_gate_build_is_run_by_a_gate_case_on_sm90():
    """On the runner's GPU (sm_90) with the `default` set: every Hopper kernel, dtype aside, is
    the pick of a backward gate case (the varlen kernels, flag j, through the varlen cases), and
    so are the helpers that run there (a Hopper kernel runs with the tile-order dQ conversion);
    the sm80 family's kernels and its row-order conversion run on sm_90 for no gate case (both
    Hopper kinds shadow them: the gate measures them on another GPU)."""
    run = {c.name: coverage.kernels_run(c, [], BWD_HOPPER, sm90=True) for c in BWD_GATE_CASES}
    ran = {k for kernels in run.values() for k in kernels}
    hopper = [k for k in BWD_HOPPER if k.startswith("bwd_sm90_")]
    assert {coverage.kind(k) for k in ran if k in BWD_HOPPER} == {
        coverage.kind(k) for k in hopper}
    assert set(BWD_HOPPER_HELPERS) - ran == {f"bwd_sm80_convert_dq_{dt}"
                                             for dt in ("fp16", "bf16")}
    for kernels in run.values():
        main, *helpers = [k for k in kernels if k.startswith("bwd_")]
        kind, dtype = main[:8], main.split("_")[2]
        assert kind in ("bwd_sm80", "bwd_sm90"), kernels
        if getattr(parse(main), "varlen", False):  # the varlen layout's pair
            assert helpers == [f"bwd_sm90_preprocess_varlen_{dtype}",
                               f"bwd_sm90_convert_dq_varlen_{dtype}"], kernels
        else:
            conversion = f"{parse(main).family}_convert_dq"
            assert helpers == [f"bwd_sm80_preprocess_{dtype}", f"bwd_{conversion}_{dtype}"], kernels


def test_a_training_step_runs_the_forward_and_the_backward(rows):
    (step,) = [c for c in BWD_GATE_CASES if c.kind == "fwdbwd"]
    forward, *backward = coverage.kernels_run(step, rows, BWD_DEFAULT, sm90=True)
    assert forward == coverage.route(step, rows, True) and forward.startswith("fwd_sm90_")
    assert backward == ["bwd_sm80_bf16_d128_r64_c128_w8_fh", "bwd_sm80_preprocess_bf16",
                        "bwd_sm80_convert_dq_bf16"]
    assert coverage.kernels_run(step, rows, [], sm90=True) == [forward], "a build without"


def test_each_backward_feature_has_a_case():
    def has(pred) -> bool:
        return any(pred(c) for c in BWD_GATE_CASES)

    assert has(lambda c: c.kind == "bwd" and c.causal and not c.deterministic), "causal"
    assert has(lambda c: c.kind == "bwd" and not (c.causal or c.window or c.softcap)), "no mask"
    assert has(lambda c: c.kind == "bwd" and c.kv_heads is not None), "GQA"
    assert has(lambda c: c.window is not None), "sliding window"
    assert has(lambda c: c.deterministic and not c.varlen), "deterministic"
    assert has(lambda c: c.deterministic and not (c.causal or c.window or c.varlen)), (
        "deterministic with no mask: the rotated order")
    assert has(lambda c: c.varlen and not c.peer_note()), "varlen, against SDPA"
    assert has(lambda c: c.varlen and c.softcap > 0), "varlen with a softcap"
    assert has(lambda c: c.softcap > 0) and has(lambda c: c.kind == "fwdbwd"), "training step"
    assert {c.dtype for c in BWD_GATE_CASES} == {"bf16", "fp16"}
    assert {c.d_head for c in BWD_GATE_CASES} == set(bwd_sm80.DEFAULT_D_HEADS)


def test_a_backward_case_made_for_a_kernel_runs_it():
    """case_for_bwd_kernel inverts the operator's choice for every default kernel and helper;
    a kernel the operator never picks (one of another tile than its d_head's row, shadowed by
    the row's kernel though it comes first in the build) gets none."""
    for kernel in BWD_DEFAULT + BWD_HELPERS:
        case = coverage.case_for_bwd_kernel(kernel, BWD_DEFAULT, sm90=True)
        assert case is not None and case.kind == "bwd", kernel
        assert kernel in coverage.kernels_run(case, [], BWD_DEFAULT, sm90=True), kernel
        assert case.batch * case.seqlen == coverage.BWD_CASE_TOKENS
    assert coverage.case_for_bwd_kernel("bwd_sm80_fp16_d256_r64_c64_w8_ft", BWD_DEFAULT,
                                        sm90=True) == Case(
        "fp16", 256, 4, 4096, causal=True, softcap=coverage.CASE_SOFTCAP, kind="bwd")
    helper = coverage.case_for_bwd_kernel("bwd_sm80_convert_dq_fp16", BWD_DEFAULT, sm90=True)
    assert coverage.bwd_kernel(helper, BWD_DEFAULT, sm90=True) == (
        "bwd_sm80_fp16_d128_r64_c128_w8_fh")
    assert coverage.case_for_bwd_kernel("bwd_sm80_bf16_d64_r64_c128_w8_fh", SHADOWED,
                                        sm90=True) is None
    assert coverage.case_for_bwd_kernel("bwd_sm80_bf16_d64_r128_c128_w8_fh", SHADOWED,
                                        sm90=True) is not None


def test_selection_maps_changed_backward_kernels_to_backward_cases(rows):
    from fa_tools.gate import sassdiff

    def change(kernel, n):
        return sassdiff.KernelChange(kernel, n, n, 2000)

    changes = [change("bwd_sm80_fp16_d128_r64_c128_w8_fht", 70),  # no gate case: a case is made
               change("bwd_sm80_bf16_d128_r64_c128_w8_fht", 60),  # run by the softcap gate case
               change("bwd_sm80_preprocess_fp16", 50),  # run by every fp16 backward case
               change("bwd_sm80_bf16_d64_r128_c128_w8_fht", 40),  # no gate case: a case is made
               change("bwd_sm80_fp16_d256_r64_c64_w8_ft", 30)]  # over the cap
    sel = sassdiff.select(changes, rows, BWD_DEFAULT, True, GATE_CASES, cap=2)
    assert [a["case"] for a in sel.added] == ["fp16_d128_b4_s4096_cap30_causal_bwd",
                                              "bf16_d64_b4_s4096_cap30_causal_bwd"]
    for added, kernel in zip(sel.cases, [c.kernel for c in changes[::3]]):
        assert coverage.bwd_kernel(added, BWD_DEFAULT, sm90=True) == kernel
    covered = {c["kernel"]: c["case"] for c in sel.covered}
    assert covered == {"bwd_sm80_bf16_d128_r64_c128_w8_fht": "bf16_d128_b4_s4096_cap30_bwd",
                       "bwd_sm80_preprocess_fp16": "fp16_d64_b4_s4096_kv4_bwd"}
    (skipped,) = sel.skipped
    assert skipped["kernel"] == "bwd_sm80_fp16_d256_r64_c64_w8_ft" and "cap of 2" in skipped["why"]
    sel = sassdiff.select([change("bwd_sm80_bf16_d64_r64_c128_w8_fh", 10)], rows, SHADOWED,
                          True, GATE_CASES, cap=6)
    assert "the backward operator picks another kernel" in sel.skipped[0]["why"]


def test_backward_gate_cases_run_the_hopper_kernel_on_sm90_where_built():
    """With the Hopper backward built, on an sm_90 GPU a gate case, deterministic or not, runs
    the Hopper kernel of its dtype, softcap and d_head variant (d_head 64, 128, 256), the varlen
    cases the varlen one (flag j); on another GPU, and on sm_90 in a build without them, every
    case runs what it ran before."""
    for case in BWD_GATE_CASES:
        before = coverage.bwd_kernel(case, BWD_DEFAULT, sm90=True)
        assert coverage.bwd_kernel(case, BWD_HOPPER, sm90=False) == before
        assert coverage.bwd_kernel(case, BWD_DEFAULT, sm90=False) == before
        on_hopper = coverage.bwd_kernel(case, BWD_HOPPER, sm90=True)
        cfg = parse(on_hopper)
        assert isinstance(cfg, Sm90BwdConfig), case.name
        assert (cfg.dtype, cfg.softcap, cfg.d_head, cfg.varlen) == (
            case.dtype, case.softcap > 0, case.d_head, case.varlen)
    varlen = [c for c in BWD_GATE_CASES if c.varlen]
    assert [coverage.bwd_kernel(c, BWD_HOPPER, sm90=True) for c in varlen] == [
        "bwd_sm90_bf16_d128_r64_c128_fj", "bwd_sm90_fp16_d64_r128_c128_fj",
        "bwd_sm90_bf16_d128_r64_c128_fjt", "bwd_sm90_fp16_d64_r128_c128_fjt",
        "bwd_sm90_bf16_d256_r64_c64_fj", "bwd_sm90_bf16_d256_r64_c64_fjt"]
    # a build with the fixed-length Hopper kernels alone: varlen cases on the sm80 family
    fixed_only = [k for k in BWD_HOPPER if not (k.startswith("bwd_sm90_") and parse(k).varlen)]
    assert [coverage.bwd_kernel(c, fixed_only, sm90=True) for c in varlen] == [
        "bwd_sm80_bf16_d128_r64_c128_w8_fh", "bwd_sm80_fp16_d64_r128_c128_w8_fh",
        "bwd_sm80_bf16_d128_r64_c128_w8_fht", "bwd_sm80_fp16_d64_r128_c128_w8_fht",
        "bwd_sm80_bf16_d256_r64_c64_w8_f", "bwd_sm80_bf16_d256_r64_c64_w8_ft"]
    det, rotated = [c for c in BWD_GATE_CASES if c.deterministic]
    assert coverage.kernels_run(rotated, [], BWD_HOPPER, sm90=True)[0] == (
        "bwd_sm90_bf16_d64_r128_c128_f")
    assert coverage.kernels_run(det, [], BWD_HOPPER, sm90=True) == [
        "bwd_sm90_bf16_d128_r64_c128_f", "bwd_sm80_preprocess_bf16", "bwd_sm90_convert_dq_bf16"]
    assert coverage.kernels_run(det, [], BWD_HOPPER, sm90=False) == [
        "bwd_sm80_bf16_d128_r64_c128_w8_fh", "bwd_sm80_preprocess_bf16", "bwd_sm80_convert_dq_bf16"]
    (step,) = [c for c in BWD_GATE_CASES if c.kind == "fwdbwd"]
    assert coverage.kernels_run(step, [], BWD_HOPPER, sm90=True) == [
        "bwd_sm90_bf16_d128_r64_c128_f", "bwd_sm80_preprocess_bf16", "bwd_sm90_convert_dq_bf16"]
    assert coverage.kernels_run(step, [], BWD_HOPPER, sm90=False) == [
        "bwd_sm80_bf16_d128_r64_c128_w8_fh", "bwd_sm80_preprocess_bf16", "bwd_sm80_convert_dq_bf16"]
    # the rule of coverage.bwd_hopper, which the operator applies in C++: varlen calls run the
    # Hopper backward (its varlen kernels), deterministic ones too, and nothing does off sm_90
    assert coverage.bwd_hopper(Case("bf16", 128, 4, 4096, varlen=True, kind="bwd"), True)
    assert coverage.bwd_hopper(Case("bf16", 128, 4, 4096, deterministic=True, kind="bwd"), True)
    assert not coverage.bwd_hopper(Case("bf16", 128, 4, 4096, kind="bwd"), sm90=False)


def test_a_backward_case_made_for_a_hopper_build_runs_its_kernel():
    """case_for_bwd_kernel in a build with the fixed-length Hopper backward: on sm_90 a Hopper
    kernel gets the plain causal case and an sm80-family kernel it shadows the same case as a
    varlen batch (what still runs it there); off sm_90 a Hopper kernel gets none and an sm80 one
    the plain case; a helper gets a case either way but the Hopper dQ conversion, which runs on
    sm_90 alone (after a Hopper kernel). With the varlen kernels too (flag j): they get the
    varlen case, and the sm80 family none on sm_90."""
    hopper, sm80 = "bwd_sm90_fp16_d128_r64_c128_ft", "bwd_sm80_fp16_d128_r64_c128_w8_fht"
    case = coverage.case_for_bwd_kernel(hopper, BWD_HOPPER_FIXED, sm90=True)
    assert case == Case("fp16", 128, 4, 4096, causal=True, softcap=coverage.CASE_SOFTCAP,
                        kind="bwd")
    assert coverage.case_for_bwd_kernel(hopper, BWD_HOPPER_FIXED, sm90=False) is None
    shadowed = coverage.case_for_bwd_kernel(sm80, BWD_HOPPER_FIXED, sm90=True)
    assert shadowed == Case("fp16", 128, 4, 4096, causal=True, softcap=coverage.CASE_SOFTCAP,
                            kind="bwd", varlen=True)
    assert shadowed.name == "fp16_d128_b4_s4096_cap30_causal_varlen_bwd"
    assert coverage.case_for_bwd_kernel(sm80, BWD_HOPPER_FIXED, sm90=False) == case
    # deterministic dQ no longer reaches the sm80 family on sm_90: it runs the Hopper kernel
    assert coverage.bwd_kernel(replace(case, deterministic=True), BWD_HOPPER_FIXED, True) == hopper
    # d_head 256: shadowed by the Hopper family's split-d kernel on sm_90, a varlen case
    assert coverage.case_for_bwd_kernel("bwd_sm80_bf16_d256_r64_c64_w8_f", BWD_HOPPER_FIXED,
                                        sm90=True) == Case("bf16", 256, 4, 4096, causal=True,
                                                           kind="bwd", varlen=True)
    for kernel in BWD_HOPPER_FIXED + BWD_HOPPER_FIXED_HELPERS:
        for sm90 in (True, False):
            made = coverage.case_for_bwd_kernel(kernel, BWD_HOPPER_FIXED, sm90)
            if made is None:
                assert kernel.startswith("bwd_sm90_") and not sm90, kernel
                continue
            assert kernel in coverage.kernels_run(made, [], BWD_HOPPER_FIXED, sm90), (kernel, sm90)
            assert not made.deterministic, kernel
    tiles = coverage.case_for_bwd_kernel("bwd_sm90_convert_dq_fp16", BWD_HOPPER_FIXED, sm90=True)
    assert coverage.bwd_kernel(tiles, BWD_HOPPER_FIXED, True) == "bwd_sm90_fp16_d128_r64_c128_f"
    assert not tiles.varlen
    # the sm80 family's row-order dQ conversion: after its d_head 128 kernel, varlen on sm_90
    rows = coverage.case_for_bwd_kernel("bwd_sm80_convert_dq_fp16", BWD_HOPPER_FIXED, sm90=True)
    assert coverage.bwd_kernel(rows, BWD_HOPPER_FIXED, True) == "bwd_sm80_fp16_d128_r64_c128_w8_fh"
    assert rows == Case("fp16", 128, 4, 4096, causal=True, varlen=True, kind="bwd")
    assert not coverage.case_for_bwd_kernel("bwd_sm80_convert_dq_fp16", BWD_HOPPER_FIXED,
                                            sm90=False).varlen
    # with the varlen kernels: a varlen Hopper kernel gets the varlen case, an sm80 one none
    varlen = coverage.case_for_bwd_kernel("bwd_sm90_fp16_d128_r64_c128_fjt", BWD_HOPPER, True)
    assert varlen == replace(case, varlen=True)
    for kernel in BWD_HOPPER + BWD_HOPPER_HELPERS:
        made = coverage.case_for_bwd_kernel(kernel, BWD_HOPPER, sm90=True)
        if made is None:
            assert kernel.startswith("bwd_sm80_") and "preprocess" not in kernel, kernel
        else:
            assert kernel in coverage.kernels_run(made, [], BWD_HOPPER, True), kernel
    # a build without the Hopper backward has no case for its dQ conversion
    assert coverage.case_for_bwd_kernel("bwd_sm90_convert_dq_fp16", BWD_DEFAULT,
                                        sm90=True) is None


def test_selection_maps_changed_hopper_backward_kernels_to_cases(rows):
    """The SASS diff of a build with the fixed-length Hopper backward on sm_90 (with the varlen
    kernels too, a changed sm80-family kernel is reported as run by no case there, at the end):
    a changed Hopper kernel no
    gate case runs gets the case that runs it, one the gate runs is reported as measured, and a
    changed sm80-family kernel shadowed by a Hopper one is measured by a varlen gate case, or
    gets a varlen case made for it; each family's dQ conversion is measured by a case of its
    family."""
    from fa_tools.gate import sassdiff

    changes = [sassdiff.KernelChange(k, n, n, 2000) for k, n in [
        ("bwd_sm90_fp16_d128_r64_c128_f", 70),  # no gate case: a case is made
        ("bwd_sm90_bf16_d128_r64_c128_f", 60),  # the causal d_head 128 gate case runs it
        ("bwd_sm80_fp16_d64_r128_c128_w8_fh", 50),  # shadowed on sm_90: a varlen gate case
        ("bwd_sm80_fp16_d128_r64_c128_w8_fh", 45),  # shadowed, no gate case: a varlen case is made
        ("bwd_sm90_convert_dq_bf16", 40),  # run after every bf16 Hopper kernel
        ("bwd_sm80_convert_dq_fp16", 30)]]  # after the sm80 family's fp16 kernels (varlen)
    sel = sassdiff.select(changes, rows, BWD_HOPPER_FIXED, True, GATE_CASES, cap=4)
    assert [a["case"] for a in sel.added] == ["fp16_d128_b4_s4096_causal_bwd",
                                              "fp16_d128_b4_s4096_causal_varlen_bwd"]
    for added, change in zip(sel.cases, (changes[0], changes[3])):
        assert coverage.bwd_kernel(added, BWD_HOPPER_FIXED, sm90=True) == change.kernel
    assert {c["kernel"]: c["case"] for c in sel.covered} == {
        "bwd_sm80_fp16_d64_r128_c128_w8_fh": "fp16_d64_b4_s4096_varlen_bwd",
        "bwd_sm90_bf16_d128_r64_c128_f": "bf16_d128_b4_s4096_causal_bwd",
        "bwd_sm90_convert_dq_bf16": "bf16_d128_b4_s4096_causal_bwd",
        "bwd_sm80_convert_dq_fp16": "fp16_d64_b4_s4096_varlen_bwd"}
    sel = sassdiff.select(changes[2:4], rows, BWD_HOPPER, True, GATE_CASES, cap=4)
    assert not sel.added and [s["kernel"] for s in sel.skipped] == [c.kernel for c in changes[2:4]]
    assert sassdiff.arch_of_kernel("bwd_sm90_fp16_d128_r64_c128_f", "90") == "90a"
    assert sassdiff.arch_of_kernel("bwd_sm90_fp16_d128_r64_c128_f", "80") is None
    assert sassdiff.arch_of_kernel("bwd_sm80_preprocess_fp16", "90") == "90"
    assert sassdiff.arch_of_kernel("bwd_sm80_convert_dq_fp16", "90") == "90"
    assert sassdiff.arch_of_kernel("bwd_sm90_convert_dq_fp16", "90") == "90a"
    assert sassdiff.arch_of_kernel("bwd_sm90_convert_dq_fp16", "80") is None
    assert sassdiff.arch_of_kernel("bwd_sm80_fp16_d64_r128_c128_w8_fh", "80") == "80"


def _elf(sections: dict[str, bytes]) -> bytes:
    """A minimal 64-bit little-endian ELF file holding these sections (and .shstrtab)."""
    import struct

    names = b"\0" + b"".join(n.encode() + b"\0" for n in [*sections, ".shstrtab"])
    body, offsets, pos = b"", [], 64
    for data in [*sections.values(), names]:
        offsets.append(pos + len(body))
        body += data
    shoff = 64 + len(body)
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, len(sections) + 2, len(sections) + 1)
    table, name_pos = bytes(64), 1  # section 0 is the null section
    for name, data, off in zip([*sections, ".shstrtab"], [*sections.values(), names], offsets):
        entry = bytearray(64)
        struct.pack_into("<I", entry, 0, name_pos)
        struct.pack_into("<QQ", entry, 0x18, off, len(data))
        table += bytes(entry)
        name_pos += len(name) + 1
    return bytes(header) + body + table


def test_kernel_code_reads_the_text_sections_of_each_cubin(tmp_path, monkeypatch):
    from fa_tools.analysis import cubins
    from fa_tools.gate import sassdiff

    words = [bytes([i]) * 16 for i in range(5)]
    files = {"fwd_k1.sm_90.cubin": {".nv.info": b"x" * 7, ".text._Z2k1": b"".join(words[:3]),
                                    ".text.$__internal_0": b"".join(words[3:])},
             "fwd_k1.sm_80.cubin": {".text._Z2k1": words[0]},
             "fwd_sm90_k2.sm_90a.cubin": {".text._Z2k2": words[4]}}
    for name, sections in files.items():
        (tmp_path / name).write_bytes(_elf(sections))
    members = [cubins.Member(n.split(".")[0], n.split(".sm_")[1][:-6], n) for n in files]
    monkeypatch.setattr(cubins, "list_cubins", lambda binary: members)
    monkeypatch.setattr(cubins, "extracted_dir", lambda binary: tmp_path)
    assert cubins.elf_section(tmp_path / "fwd_k1.sm_80.cubin", ".text._Z2k1") == words[0]
    assert sassdiff.kernel_code(tmp_path / "x.so", "90") == {"fwd_k1": words,
                                                             "fwd_sm90_k2": [words[4]]}
    assert sassdiff.kernel_code(tmp_path / "x.so", "80") == {"fwd_k1": [words[0]]}


def test_kernel_code_leaves_out_a_helper_the_unit_does_not_hold(tmp_path, monkeypatch):
    """A base build from before the Hopper dQ conversion: its Hopper unit holds the main kernel,
    the preprocess and the sm80 family's conversion, while the listing (this commit's configs)
    names the unit's helpers preprocess and convert_dq_tiles. The tile conversion is left out
    of the base's code, so the head's is new."""
    from fa_tools.analysis import cubins
    from fa_tools.gate import sassdiff

    main = ("_ZN5flash4sm9015bwd_sm90_kernelINS0_13Sm90BwdConfigI13__nv_bfloat16Li128ELb0EEEEE"
            "vNS0_13Sm90BwdParamsE")
    pre = "_ZN5flash3bwd21bwd_preprocess_kernelI13__nv_bfloat16EEvNS_9BwdParamsE"
    rows = "_ZN5flash3bwd21bwd_convert_dq_kernelI13__nv_bfloat16EEvNS_9BwdParamsE"
    tiles = "_ZN5flash3bwd27bwd_convert_dq_tiles_kernelI13__nv_bfloat16EEvNS_9BwdParamsE"
    words = [bytes([i]) * 16 for i in range(4)]
    unit = "bwd_sm90_bf16_d128_r64_c128_f"
    for build, conversion in (("base", rows), ("head", tiles)):
        (tmp_path / build).mkdir()
        (tmp_path / build / f"{unit}.sm_90a.cubin").write_bytes(_elf({
            f".text.{main}": words[0], f".text.{pre}": words[1], f".text.{conversion}":
            words[2] if build == "base" else words[3], ".text.$__internal_0": words[2]}))
    members = [cubins.Member(k, "90a", f"{unit}.sm_90a.cubin") for k in (
        unit, "bwd_sm80_preprocess_bf16", "bwd_sm90_convert_dq_bf16")]
    monkeypatch.setattr(cubins, "list_cubins", lambda binary: members)
    monkeypatch.setattr(cubins, "extracted_dir", lambda binary: tmp_path / binary)
    base, head = sassdiff.kernel_code("base", "90"), sassdiff.kernel_code("head", "90")
    assert list(base) == [unit]  # (the preprocess is compared as its sm_90 code)
    assert head["bwd_sm90_convert_dq_bf16"] == [words[3], words[2]]  # with the subroutine
    (change,) = sassdiff.changed_kernels(base, head)
    assert change.kernel == "bwd_sm90_convert_dq_bf16" and change.new


def test_one_wave_tiers_are_run(rows):
    """Each one-wave kernel of the Hopper table (d_head 64 and 128, both tiers; dtype aside) is
    run by a gate case whose tiles fit in one wave on the gate GPU, and a case too large for one
    wave runs its row's kernel."""
    run = {coverage.kind(k) for k in _routes(rows).values()}
    wanted = {coverage.kind(kernel) for d in (64, 128)
              for _, kernel in fwd_sm90.one_wave_table_rows(Call("bf16", d))}
    assert len(wanted) == 4
    assert wanted - run == set()
    big = Case("bf16", 64, 64, 577, heads=12)
    assert coverage.route(big, rows, True) == "fwd_sm90_bf16_d64_r128_c128_s2_fwal"
    small = Case("bf16", 64, 1, 577, heads=12)  # 12 x 10 tiles of 64 rows <= 132 SMs
    assert coverage.route(small, rows, True) == "fwd_sm90_bf16_d64_r64_c128_s2_fwia"
    assert coverage.one_wave(small, next(r for r in rows if r.key == coverage.call_key(small)),
                             sms=119) == "fwd_sm90_bf16_d64_r128_c128_s2_fwpia"


def test_fewer_padded_keys_is_run(rows):
    """The fewer-padded-keys kernel (B_c 96 at d_head 128) runs a gate case (257 keys, too many
    tiles for one wave); 512 keys stay on the row's B_c 128 kernel."""
    case = Case("bf16", 128, 64, 257)
    assert case in GATE_CASES
    assert coverage.route(case, rows, True) == "fwd_sm90_bf16_d128_r128_c96_s2_fwal"
    assert coverage.route(Case("bf16", 128, 8, 512), rows, True) == \
        "fwd_sm90_bf16_d128_r128_c128_s2_fwal"
