"""docs/dispatch.md in step with the default tables (the ROWS of flash_attention.kernels.fwd_sm80,
fwd_sm90 and dec_sm80, fwd_sm90's VARLEN_ROWS, FP8_ROWS and FP8_VARLEN_ROWS, dec_sm80's
FP8_ROWS, WIDE_ROWS, DEEP_ROWS and SMALL_PAGE_ROWS, fwd_sm90's ONE_WAVE_ROWS and KEY_PAD_ROWS):
one docs row
per code row, by
key and back;
the docs row's first five columns are the code row's (calls, d_head, seqlen_q, kernel), so a
changed decision fails here until its measurements are written down; every results file a row
names exists. And the rows themselves: one open-ended row per (calls, d_head), every kernel a
valid config that serves its calls."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from flash_attention.kernels import Call, dec_sm80, fwd_sm80, fwd_sm90, parse
from flash_attention.kernels.base import Row, rows_for

DOCS = Path(__file__).resolve().parents[1] / "docs"
HEADER = "| Row | Calls | d_head | seqlen_q | Kernel | Measurements | Results |"
ROWS = {"sm80": fwd_sm80.ROWS, "sm90": fwd_sm90.ROWS, "dec": dec_sm80.ROWS,
        "varlen": fwd_sm90.VARLEN_ROWS, "fp8": fwd_sm90.FP8_ROWS,
        "fp8_varlen": fwd_sm90.FP8_VARLEN_ROWS, "dec_fp8": dec_sm80.FP8_ROWS,
        "dec_wide": dec_sm80.WIDE_ROWS, "dec_deep": dec_sm80.DEEP_ROWS,
        "dec_small_page": dec_sm80.SMALL_PAGE_ROWS,
        "one_wave": fwd_sm90.ONE_WAVE_ROWS,
        "key_pad": fwd_sm90.KEY_PAD_ROWS}
# Tables whose rows are alternatives the extension weighs per call (tiers, padding), not a
# partition of the lengths.
TIERS = {"one_wave", "key_pad", "dec_deep"}
MODULES = {"sm80": fwd_sm80, "sm90": fwd_sm90, "dec": dec_sm80,
           "varlen": SimpleNamespace(table_rows=fwd_sm90.varlen_table_rows,
                                     Config=fwd_sm90.Config),
           "fp8": fwd_sm90,  # its table_rows answers e4m3 calls from FP8_ROWS
           "fp8_varlen": SimpleNamespace(table_rows=fwd_sm90.varlen_table_rows,
                                         Config=fwd_sm90.Config),
           # decode over an e4m3 cache (e5m2's rows are the same), d_head multiples of 16
           "dec_fp8": SimpleNamespace(
               table_rows=lambda call: [] if call.d_head % 16 else
               dec_sm80.table_rows(call, "e4m3"), Config=dec_sm80.Config),
           # decode calls of 17 or more packed rows, 16-bit caches
           "dec_wide": SimpleNamespace(table_rows=lambda call: dec_sm80.table_rows(call,
                                                                                 wide=True),
                                       Config=dec_sm80.Config),
           # decode calls whose 16-row tiles fill one CTA per SM, on sm_90
           "dec_deep": SimpleNamespace(table_rows=lambda call: dec_sm80.table_rows(call,
                                                                                 deep=True),
                                       Config=dec_sm80.Config),
           # decode calls over pages of a multiple of 16 rows the row kernel's B_c does not divide
           "dec_small_page": SimpleNamespace(
               table_rows=lambda call: dec_sm80.table_rows(call, small_page=True),
               Config=dec_sm80.Config),
           "one_wave": SimpleNamespace(table_rows=fwd_sm90.one_wave_table_rows,
                                       Config=fwd_sm90.Config),
           "key_pad": SimpleNamespace(table_rows=fwd_sm90.key_pad_table_rows,
                                      Config=fwd_sm90.Config)}
DTYPES = {"fp8": (fwd_sm90.FP8,), "fp8_varlen": (fwd_sm90.FP8,)}  # the others fp16 and bf16
CODE_ROWS = [row for rows in ROWS.values() for row in rows]


def code_cells(row: Row) -> list[str]:
    """The columns of a docs row that the code decides."""
    return [row.key, ", ".join(row.calls), ", ".join(map(str, row.d_heads)),
            f"<= {row.max_seq}" if row.max_seq else "the rest", f"`{row.kernel}`"]


def doc_rows() -> list[list[str]]:
    """The cells of every row of docs/dispatch.md's decision tables."""
    out, in_table = [], False
    for line in (DOCS / "dispatch.md").read_text().splitlines():
        if line == HEADER:
            in_table = True
        elif in_table and line.startswith("|"):
            if not line.startswith("|---"):
                out.append([cell.strip() for cell in line.strip("|").split(" | ")])
        else:
            in_table = False
    return out


def test_every_code_row_has_one_docs_row_and_back():
    keys = [row.key for row in CODE_ROWS]
    assert len(keys) == len(set(keys)), "row keys must be unique"
    doc_keys = [cells[0] for cells in doc_rows()]
    assert len(doc_keys) == len(set(doc_keys)), "docs/dispatch.md names a row twice"
    assert set(keys) - set(doc_keys) == set(), "code rows without a docs/dispatch.md row"
    assert set(doc_keys) - set(keys) == set(), "docs/dispatch.md rows the code no longer has"


def test_docs_rows_show_the_codes_decisions():
    docs = {cells[0]: cells for cells in doc_rows()}
    for row in CODE_ROWS:
        cells = docs.get(row.key)
        if cells is None:
            continue  # reported by the test above
        want = "| " + " | ".join(code_cells(row)) + " |"
        assert cells[:5] == code_cells(row), (
            f"docs/dispatch.md row {row.key!r} does not match the code; it starts: {want}")
        assert len(cells) == 7 and cells[5], f"row {row.key!r}: no measurements"


def test_docs_rows_name_results_files_that_exist():
    for cells in doc_rows():
        results = cells[-1]
        paths = re.findall(r"`([^`]+)`", results)
        assert paths or results == "not measured", (
            f"row {cells[0]!r} names no results file (or says `not measured`)")
        missing = [p for p in paths if not (DOCS / p).is_file()]
        assert not missing, f"row {cells[0]!r} names missing files (relative to docs/): {missing}"


@pytest.mark.parametrize("family", [f for f in ROWS if f not in TIERS])
def test_each_calls_and_d_head_has_rows_by_length_ending_open(family):
    for calls in {c for row in ROWS[family] for c in row.calls}:
        for d_head in {d for row in ROWS[family] for d in row.d_heads}:
            rows = rows_for(ROWS[family], calls, d_head)
            if not rows:
                continue
            bounds = [row.max_seq for row in rows]
            assert bounds[-1] is None and None not in bounds[:-1], (family, calls, d_head)
            assert bounds[:-1] == sorted(set(bounds[:-1])), (family, calls, d_head)


@pytest.mark.parametrize("family", ROWS)
def test_every_table_kernel_serves_its_key(family):
    """Every kernel of a table (each dtype, d_head 8 ... 256, mask, window bounded on the left,
    softcap) is a valid config of its kind that serves the calls of its row (a varlen kernel:
    packed, as its fixed-length form serves them)."""
    module = MODULES[family]
    named = 0
    for dtype, d_head in itertools.product(DTYPES.get(family, ("fp16", "bf16")), range(8, 257, 8)):
        for mask, local, softcap in itertools.product((False, True), repeat=3):
            if local and not mask:
                continue
            call = Call(dtype, d_head, 1, mask, local, softcap)
            for _, name in module.table_rows(call):
                cfg = parse(name)
                fixed = cfg.replace(varlen=False) if getattr(cfg, "varlen", False) else cfg
                assert isinstance(cfg, module.Config) and fixed.serves(call), (name, call)
                named += 1
    assert named
