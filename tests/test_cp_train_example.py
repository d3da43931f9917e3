"""The context-parallel training example (ci/cp_train_example.py). On a CPU, its whole harness
over gloo with 2 processes (ring_attention's blocks run the fp32 reference on CPU tensors; the
single-process runs use flash_attention.reference): sharding, global positions, labels shifted
on the whole sequence, the loss and gradient reductions, the check's comparison and the exit
code, which planted faults (positions not sharded, labels shifted per shard, gradients not
all-reduced) must turn to 1. On 2+ GPUs, the example itself: the check, and a short long-sequence
run with per-layer checkpointing."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .script_modules import load_script

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (noxfile TEST_DEPS has it): the "
    "context-parallel training example needs it")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "ci" / "cp_train_example.py"
example = load_script("ci/cp_train_example.py")


def run_script(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """The example as a command (its workers are spawned processes, which import the script)."""
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_labels_are_the_next_token_and_the_last_has_none():
    ids = torch.tensor([[5, 7, 9, 11]])
    assert example.shifted_labels(ids).tolist() == [[7, 9, 11, example.IGNORE]]
    batch = example.whole_batch(ids, "cpu")
    assert batch.positions.tolist() == [[0, 1, 2, 3]] and batch.n_total == 3


def test_curve_rule_is_calibrated_by_the_backend_swap():
    one, sdpa = [10.0, 9.0, 8.0], [10.0, 9.01, 8.0]  # calibration: 0.01
    assert example.curve_check([10.0, 9.0, 8.025], one, sdpa, tol=1e-3)["ok"]  # 0.025 <= 0.03
    assert not example.curve_check([10.0, 9.0, 8.035], one, sdpa, tol=1e-3)["ok"]
    assert not example.curve_check([10.0, math.nan, 8.0], one, sdpa, tol=1e-3)["ok"]


def test_cpu_check_passes_and_writes_its_figures(tmp_path):
    out = tmp_path / "cp.json"
    proc = run_script("--check", "--device", "cpu", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: PASS" in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["pass"] and figures["replicas_agree"] and figures["options"]["ranks"] == 2
    n_params = 2 + 9 * example.PRESETS["tiny"].layers + 1  # embed, norm, head; 9 a layer
    assert figures["checks"][0]["name"] == "token losses"
    assert len(figures["checks"]) == 1 + n_params
    assert all(c["ok"] and c["err_one"] > 0 for c in figures["checks"])
    losses = figures["losses"]
    assert len(losses["cp"]) == len(losses["one"]) == 3 and losses["cp"][-1] < losses["cp"][0]
    assert figures["curve"]["gap_sdpa"] > 0  # the calibration measured something


@pytest.mark.parametrize("plant, token_losses_fail", [
    ("positions", True),  # every rank rotates its shard at arange(local): wrong RoPE
    ("labels", True),  # shifted within the shard: a chunk's last token gets the wrong label
    ("grads", False),  # the forward is right; each replica steps on its own shard's gradient
])
def test_planted_fault_fails_the_check(tmp_path, plant, token_losses_fail):
    out = tmp_path / "cp.json"
    proc = run_script("--check", "--device", "cpu", "--plant", plant, "--json", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("RESULT: FAIL"), proc.stdout
    figures = json.loads(out.read_text())
    checks = {c["name"]: c for c in figures["checks"]}
    assert checks["token losses"]["ok"] is not token_losses_fail
    assert figures["replicas_agree"] is (plant != "grads")  # each replica stepped its own way
    assert sum(not c["ok"] for c in figures["checks"]) > len(checks) // 2, proc.stdout


def test_cpu_long_run_with_layer_checkpointing(tmp_path):
    out = tmp_path / "long.json"
    proc = run_script("--long", "256", "--device", "cpu", "--steps", "2", "--checkpoint", "on",
                      "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: PASS" in proc.stdout and "tokens/s" in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["checkpoint"] and figures["replicas_agree"]
    assert len(figures["losses"]) == len(figures["step_s"]) == 2
    assert all(math.isfinite(x) for x in figures["losses"])
    assert figures["estimate"]["per_token_kb"] > 0


def _main(argv) -> int:
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        try:
            return example.main(argv)
        except SystemExit as exc:  # argparse's own usage errors
            return int(exc.code)


def test_usage_errors_exit_2():
    assert _main([]) == 2  # neither --check nor --long
    assert _main(["--check", "--long", "256"]) == 2
    assert _main(["--check", "--device", "cpu", "--seq", "66"]) == 2  # not 4 equal chunks
    assert _main(["--check", "--device", "cpu", "--ranks", "1"]) == 2
    assert _main(["--long", "256", "--seq", "64", "--device", "cpu"]) == 2
    if not torch.cuda.is_available():
        assert _main(["--check", "--device", "cuda"]) == 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"multi-GPU test: {torch.cuda.device_count()} GPU(s) here, 2 needed")
def test_cp_training_on_two_gpus(require_extension, tmp_path):
    """The check (8192 tokens, 4 steps, against one GPU and the fp32 reference), then a short
    long-sequence run through the per-layer checkpointed path."""
    proc = run_script("--check", "--ranks", "2", "--json", str(tmp_path / "check.json"),
                      timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_script("--long", "32768", "--ranks", "2", "--steps", "2", "--checkpoint", "on",
                      timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
