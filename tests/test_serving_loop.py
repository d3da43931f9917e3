"""The serving loop (ci/serving_loop.py): on a CPU its harness with the torch reference of the
paged varlen call in place of the kernels (scheduler, page allocator, scatter, checks, report,
exit code), which planted faults must turn to exit 1; the allocator's invariants; the scatter
and the reference call against flash_attention.reference; on a GPU the loop itself with
flash_attention at several page sizes."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from .script_modules import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "ci" / "serving_loop.py"
loop = load_script("ci/serving_loop.py")

CPU = ["--device", "cpu", "--attention", "reference", "--preset", "tiny"]


def run_main(argv, attention_fn=None):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        code = loop.main(argv, attention_fn=attention_fn)
    return code, buf.getvalue()


# ---- the allocator ----------------------------------------------------------------------------


def test_allocator_grows_releases_and_reuses_last_freed_first():
    a = loop.PageAllocator(8)
    assert a.grow(1, 3) == [0, 1, 2] and a.grow(2, 2) == [3, 4] and a.grow(1, 3) == []
    assert a.grow(1, 4) == [5] and a.pages(1) == [0, 1, 2, 5]
    assert (a.free, a.used, a.peak) == (2, 6, 6) and a.problems() == []
    assert a.release(1) == [0, 1, 2, 5] and a.free == 6 and a.peak == 6
    assert a.grow(3, 2) == [5, 2]  # LIFO: the pages freed last come back first
    assert a.problems() == []
    a.release(2)
    a.release(3)
    assert a.free == 8 and a.problems() == [] and sorted(a.free_pages()) == list(range(8))


def test_allocator_is_all_or_none_and_refuses_unknown_owners():
    shuffled = loop.PageAllocator(64, seed=3).grow(0, 64)
    assert sorted(shuffled) == list(range(64)) != shuffled  # a seed scatters the page ids
    a = loop.PageAllocator(4, seed=3)
    a.grow(0, 3)
    with pytest.raises(loop.PoolExhausted, match="needs 2 more pages, 1 are free"):
        a.grow(1, 2)
    assert a.free == 1 and a.pages(1) == [] and a.problems() == []
    with pytest.raises(KeyError):
        a.release(1)
    with pytest.raises(ValueError):
        loop.PageAllocator(0)


def test_allocator_problems_name_each_broken_invariant():
    a = loop.PageAllocator(6)
    a.grow(0, 2)
    a.grow(1, 2)
    a._held[1].append(a._held[0][0])  # one page held by two live sequences
    assert any("page 0 is in sequence 0 and in sequence 1" in p for p in a.problems())
    a = loop.PageAllocator(6)
    a.grow(0, 2)
    a._free.pop()  # a page lost: neither free nor held
    assert a.problems() == ["1 pages are neither free nor held (leaked)"]
    a = loop.PageAllocator(6)
    a.grow(0, 2)
    a._free.append(1)  # a held page also on the free list
    assert any("page 1 is in the free list and in sequence 0" in p for p in a.problems())


# ---- the scatter and the reference call -------------------------------------------------------


@pytest.mark.parametrize("page", [1, 3, 16])
def test_row_slots_place_each_new_row_at_its_position(page):
    """Gathering each sequence's pages after the scatter gives its rows in order."""
    gen = torch.Generator().manual_seed(0)
    before, rows = [5, 0, 17, 2], [1, 9, 1, 30]
    after = [b + n for b, n in zip(before, rows)]
    width = max(-(-a // page) for a in after)
    perm = torch.randperm(len(after) * width + 2, generator=gen)
    table = perm[:len(after) * width].view(len(after), width).to(torch.int32)
    pool = torch.zeros(len(perm), page, 1, 1)
    new = torch.arange(1.0, sum(rows) + 1).view(-1, 1, 1)
    pg, slot = loop.row_slots(table, torch.tensor(before), torch.tensor(rows), sum(rows), page)
    pool[pg, slot] = new
    q0 = 0
    for b in range(len(after)):
        got = pool[table[b].long()].flatten(0, 1)[:, 0, 0]
        want = torch.zeros(width * page)
        want[before[b]:after[b]] = new[q0:q0 + rows[b], 0, 0]
        assert torch.equal(got, want), b
        q0 += rows[b]


@pytest.mark.parametrize("page", [1, 5, 16])
def test_reference_call_matches_kvcache_reference(page):
    """paged_varlen_reference with equal query counts per sequence is
    reference.kvcache_reference over the same pages (out rounded to q's dtype)."""
    from flash_attention.reference import kvcache_reference

    torch.manual_seed(1)
    lens, sq, heads, hk, d = [9, 3, 30], 3, 4, 2, 16
    width = -(-max(lens) // page)
    pages = torch.randn(len(lens) * width + 4, page, hk, d).to(torch.bfloat16)
    vpages = torch.randn_like(pages)
    table = torch.randperm(len(pages))[:len(lens) * width].view(len(lens), width)
    table = table.to(torch.int32)
    q = torch.randn(len(lens), sq, heads, d).to(torch.bfloat16)
    cu_q = torch.arange(0, sq * len(lens) + 1, sq, dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out = loop.paged_varlen_reference(q.flatten(0, 1), pages, vpages, cu_q, cu_k, sq, max(lens),
                                      causal=True, block_table=table,
                                      seqused_k=torch.tensor(lens, dtype=torch.int32))
    want = kvcache_reference(q, pages, vpages, cache_seqlens=torch.tensor(lens),
                             block_table=table, causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.view_as(q), want.out.to(torch.bfloat16), atol=0, rtol=0)


# ---- the harness on a CPU ---------------------------------------------------------------------


@pytest.mark.parametrize("page", [1, 16])
def test_loop_passes_with_the_reference(page, tmp_path):
    """The command line as its docstring gives it: exit 0, the table, the JSON figures; the
    tiny workload mixes prefill and decode in one call, splits prompts by the budget, and the
    pool limits admission."""
    out = tmp_path / "loop.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *CPU, "--page-size", str(page),
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: PASS" in proc.stdout and "peak pages used" in proc.stdout
    result = json.loads(out.read_text())
    fig, cfg = result["figures"], result["config"]
    assert result["pass"] and cfg["page_size"] == page and result["num_pages"] == 256 // page
    assert fig["steps"] > 10 and fig["mixed_steps"] > 0 and fig["partial_chunks"] > 0
    assert fig["decode_tokens"] > 0 and fig["prefill_tokens"] > 0
    assert fig["sequence_checks"] >= fig["steps"] and 0 < fig["worst_of_bound"] <= 1
    assert 0.5 * result["num_pages"] < fig["peak_pages"] <= result["num_pages"]
    assert fig["accuracy_failures"] == 0 and fig["pool_problems"] == 0
    assert fig["max_step_tokens"] <= cfg["token_budget"] and fig["attention_tokens_per_s"] > 0


def test_loop_checks_every_kth_step_and_a_finite_guard():
    code, text = run_main([*CPU, "--check-every", "3", "--guard", "1000", "--seed", "4"])
    assert code == 0, text
    steps = int(text.split("steps (idle, mixed prefill+decode)")[1].split()[0])
    assert f"in {steps // 3} steps" in text


def _drop_last_page(q, k, v, cu_q, cu_k, max_q, max_k, causal, block_table, seqused_k):
    used = (seqused_k - 1) // k.shape[1] * k.shape[1]
    return loop.paged_varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                       block_table=block_table, seqused_k=used)


def _top_left_causal(q, k, v, cu_q, cu_k, max_q, max_k, causal, block_table, seqused_k):
    """torch's is_causal aligns top-left: query i sees keys 0..i whatever the key count."""
    out = torch.zeros_like(q)
    cu, used, page = cu_q.tolist(), seqused_k.tolist(), k.shape[1]
    for b, n in enumerate(used):
        pages = block_table[b, :-(-n // page)].long()
        keys, values = (t[pages].flatten(0, 1)[:n].float().transpose(0, 1) for t in (k, v))
        qs = q[cu[b]:cu[b + 1]].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(qs, keys, values, is_causal=causal, enable_gqa=True)
        out[cu[b]:cu[b + 1]] = o.transpose(0, 1).to(q.dtype)
    return out


def _scribbles_on_a_free_page(q, k, v, cu_q, cu_k, max_q, max_k, causal, block_table,
                              seqused_k):
    """A right answer, then a write into a page no sequence holds (all guard: every held page
    has rows written): only the pool checks can see it."""
    out = loop.paged_varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                      block_table=block_table, seqused_k=seqused_k)
    free = torch.isnan(k.flatten(1)).all(1).nonzero().flatten()
    if len(free):
        k[free[-1], -1] = 0.0
    return out


def _one_row_nan(q, k, v, cu_q, cu_k, max_q, max_k, causal, block_table, seqused_k):
    out = loop.paged_varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                      block_table=block_table, seqused_k=seqused_k)
    out[-1, 0, 0] = float("nan")
    return out


def _fp8_output(q, k, v, cu_q, cu_k, max_q, max_k, causal, block_table, seqused_k):
    out = loop.paged_varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                      block_table=block_table, seqused_k=seqused_k)
    return out.to(torch.float8_e4m3fn).to(out.dtype)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("fault, what", [
    (_drop_last_page, "accuracy failures, 0 pool"), (_top_left_causal, "accuracy failures"),
    (_scribbles_on_a_free_page, "pool problems"), (_one_row_nan, "accuracy failures"),
    (_fp8_output, "accuracy failures")])
def test_loop_fails_on_a_planted_fault(fault, what, page):
    code, text = run_main([*CPU, "--page-size", str(page)], attention_fn=fault)
    assert code == 1, text
    result = text.strip().splitlines()[-1]
    assert result.startswith("RESULT: FAIL") and what in result, result
    if fault is _scribbles_on_a_free_page:
        assert result.startswith("RESULT: FAIL (0 accuracy failures"), result


def test_usage_errors_exit_2():
    assert run_main(["--attention", "flash_attention", "--device", "cpu"])[0] == 2
    assert run_main([*CPU, "--heads", "3"])[0] == 2  # not a multiple of kv_heads 2
    assert run_main([*CPU, "--num-pages", "2"])[0] == 2  # the longest needs 4 pages of 16
    assert run_main([*CPU, "--prompt-min", "50"])[0] == 2
    assert run_main([*CPU, "--check-every", "0"])[0] == 2
    assert run_main([*CPU, "--page-size", "x"])[0] == 2  # argparse's own error
    if not torch.cuda.is_available():
        assert run_main(["--device", "cuda"])[0] == 2


# ---- the GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("page", [1, 16, 64, 256])
def test_loop_on_gpu_with_flash_attention(require_extension, page):
    """64 sequences (prompts 16-2048, 1-64 decode rows, GQA 32 / 8, d_head 128, bf16) through
    the kernels, every step checked."""
    code, text = run_main(["--sequences", "64", "--gen-max", "64", "--page-size", str(page)])
    print(text)
    assert code == 0, text
