"""The GPU subcommands of fa-tools: sanitize and debug on the default configs (GPU)."""

from __future__ import annotations

import pytest

import flash_attention as fa
from flash_attention.kernels import resolve

pytestmark = pytest.mark.gpu


def _built_defaults():
    if not fa.is_built():
        return []
    default = set(resolve("fwd:default"))  # the forward default set of both forward kinds
    return [c.name for c in fa.available_configs() if c in default]


@pytest.mark.parametrize("kernel", _built_defaults())
def test_debug_finds_no_mismatch(kernel):
    from fa_tools.gpu import debug

    rows, mismatch = debug.run(kernel, batch=2, seqlen_q=200, seqlen_k=333, heads=2)
    assert rows == 2 * 200 * 2
    assert mismatch is None, mismatch


def test_debug_reports_a_planted_mismatch(require_extension, monkeypatch):
    from fa_tools.gpu import debug

    real = fa.attention

    def wrong(q, k, v, **kw):
        out, lse = real(q, k, v, **kw)
        out[0, 70, 1, 3] += 1.0  # batch 0, row 70, head 1
        return out, lse

    monkeypatch.setattr(fa, "attention", wrong)
    kernel = fa.available_configs()[0].name
    cfg = fa.parse(kernel)
    _, m = debug.run(kernel, batch=1, seqlen_q=100, seqlen_k=150, heads=2)
    assert m is not None and (m.batch, m.head) == (0, 1)
    assert m.q_block * cfg.block_r + m.row == 70
    assert len(m.trace) == -(-150 // cfg.block_c)  # one (m, l) per KV block


def test_sanitize_default_configs_clean():
    from fa_tools.analysis.binaries import ToolError
    from fa_tools.gpu import sanitize

    kernels = _built_defaults()
    if not kernels:
        pytest.fail("no default configs built")
    try:
        results = sanitize.run(kernels)
    except ToolError as exc:
        pytest.fail(str(exc))
    for r in results:
        assert r.ok, f"{r.tool}: {r.errors} errors\n" + "\n".join(r.log.splitlines()[-30:])


def test_clock_stamps_count_the_cycles_of_a_spin():
    """The gate's cycle measure (fa_tools.gpu.clockstamp): stamps around a device-side spin of
    N cycles read N cycles, whatever the clock did meanwhile."""
    import torch

    from fa_tools.gpu.clockstamp import Stamps

    n = 20_000_000
    for _ in range(3):
        stamps = Stamps()
        # The GPU busy first, so that the marks and the spin are queued back to back as the
        # gate's timed calls are: an idle GPU ran the first mark at once and then waited for the
        # host to launch the spin, and that wait (670k cycles on a loaded runner) was counted.
        torch.cuda._sleep(n // 4)
        stamps.mark()
        torch.cuda._sleep(n)
        stamps.mark()
        torch.cuda.synchronize()
        assert n <= stamps.cycles() <= 1.02 * n + 200_000
        assert 300 < stamps.mhz() < 3000
    with pytest.raises(RuntimeError, match="two marks"):
        stamps.mark()


def test_bench_times_the_backward_of_each_named_kernel(require_extension):
    """fa-tools bench --pass bwd: one row per built backward kernel of the call's variant
    (the operator's choice without --configs), each with our rate and the ratio to SDPA FA2's
    backward timed in the same rounds."""
    from fa_tools.gpu import bench
    from flash_attention.backward import built

    names = {c.name for c in built()}
    wanted = [k for k in bench.backward_kernels("bwd:default", "bf16", 64) if k in names]
    if not wanted:
        pytest.skip("no bf16 d_head 64 backward kernel of the default set built")
    rows = bench.run(["bf16"], [64], [(1, 512)], heads=4, configs=",".join(wanted), reps=2,
                     rounds=1, sustained=False, pass_="bwd")
    assert [r["config"] for r in rows] == wanted
    assert all(r["pass"] == "bwd" and r["ours_tflops"] > 0 for r in rows)
    assert all(r["ratio_sdpa_fa2"] is None or r["ratio_sdpa_fa2"] > 0 for r in rows)
    (default,) = bench.run(["bf16"], [64], [(1, 512)], heads=4, reps=2, rounds=1,
                           sustained=False, pass_="bwd")
    assert default["config"] in names
