"""The Hugging Face Llama training client (ci/llama_train_client.py): on a CPU its harness with
the torch reference in place of the kernels (registration through transformers'
AttentionInterface, the attention contract, the first-step comparison, training, the report
and the exit code, which planted faults must turn to 1); on a GPU the client itself with
flash_attention on a small Llama."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .script_modules import load_script

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (noxfile TEST_DEPS has it): the Llama "
    "client's tests need it")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "ci" / "llama_train_client.py"
client = load_script("ci/llama_train_client.py")


def run_main(argv, attention_fn=None):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = client.main(argv, attention_fn=attention_fn)
    return code, buf.getvalue()


class _Module(torch.nn.Module):
    is_causal = True


def qkv(batch=2, heads=4, kv_heads=2, seq=24, d=16, dtype=torch.float32, seed=0):
    """transformers' layout: (batch, heads, seq, d), K and V with the KV heads only."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, h, seq, d, generator=gen).to(dtype)
            for h in (heads, kv_heads, kv_heads))


def test_reference_attention_keeps_transformers_contract():
    """Output (batch, seq, heads, d) equal to transformers' own SDPA path (which repeats K and
    V for GQA), causal from the module, scaling honoured."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = _Module()
    module.num_key_value_groups = 2
    q, k, v = qkv()
    ours, weights = client.reference_forward(module, q, k, v, None, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3, is_causal=True)
    assert weights is None and ours.shape == (2, 24, 4, 16) == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    full, _ = client.reference_forward(module, q, k, v, None, scaling=0.3, is_causal=False)
    assert not torch.allclose(full, ours)  # is_causal=False from the caller is honoured


def test_attention_refuses_what_it_would_ignore():
    q, k, v = qkv()
    for fn in client.ATTENTIONS.values():
        with pytest.raises(NotImplementedError, match="attention_mask"):
            fn(_Module(), q, k, v, torch.zeros(2, 1, 24, 24), scaling=0.25)
        with pytest.raises(NotImplementedError, match="dropout"):
            fn(_Module(), q, k, v, None, scaling=0.25, dropout=0.1)
        with pytest.raises(NotImplementedError, match="sliding_window"):
            fn(_Module(), q, k, v, None, scaling=0.25, sliding_window=8)


def test_registered_attention_is_what_the_model_calls():
    """The registered name reaches every layer, with un-repeated K/V, no mask (transformers
    builds none for an implementation it does not know) and the layer's scaling; the bf16 copy
    keeps the fp32 model's weights."""
    calls = []

    def spy(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        calls.append((query.shape, key.shape, value.shape, attention_mask, scaling,
                      module.layer_idx))
        return client.reference_forward(module, query, key, value, attention_mask, scaling,
                                        dropout, **kwargs)

    preset = client.PRESETS["tiny"]
    name = client.register("reference", spy)
    assert name in transformers.AttentionInterface._global_mapping
    model = client.build_model(preset, "cpu", seed=0)
    m = client.variant(model, torch.bfloat16, name)
    assert m.config._attn_implementation == name and model.config._attn_implementation == "sdpa"
    for (n, p), (n2, p2) in zip(model.named_parameters(), m.named_parameters()):
        assert n == n2 and p2.dtype == torch.bfloat16 and torch.equal(p.to(torch.bfloat16), p2)
    ids = client.make_batch(preset, "cpu", seed=0)
    result = client.first_step(m, ids)
    b, s, h, hk, d = preset.batch, preset.seq, preset.heads, preset.kv_heads, preset.head_dim
    assert [c[5] for c in calls] == list(range(preset.layers))
    assert all(c[:5] == ((b, h, s, d), (b, hk, s, d), (b, hk, s, d), None, d ** -0.5)
               for c in calls)
    assert set(result.grads) == {n for n, _ in model.named_parameters()}
    # the loss the comparison differentiates is the one transformers trains on
    with torch.no_grad():
        loss = m(input_ids=ids, labels=ids).loss.item()
    assert result.loss == pytest.approx(loss, rel=1e-5)
    assert result.token_losses.shape == (b * (s - 1),)


def test_compare_applies_the_rule_per_tensor():
    def step(loss, logits, grads):
        return client.StepResult(loss, torch.tensor(logits), torch.tensor(logits),
                                 {k: torch.tensor(v) for k, v in grads.items()})

    ref = step(1.0, [1.0, 2.0], {"a": [1.0, -1.0], "b": [0.5, 0.5], "c": [1.0, 1.0]})
    sdpa = step(1.1, [1.0, 2.1], {"a": [1.1, -1.0], "b": [0.5, 0.5], "c": [1.0, 1.0]})
    ours = step(1.0, [1.0, 2.15], {"a": [1.0, -1.25], "b": [0.5, 0.5001], "c": [1.0]})
    checks = {c.name: c for c in client.compare(ref, sdpa, ours, grad_floor=1e-3,
                                                out_floor=1e-4)}
    assert checks["logits"].ok and checks["logits"].ratio == pytest.approx(1.5, rel=1e-4)
    # 0.25 > 2 x 0.1
    assert not checks["a"].ok and checks["a"].ratio == pytest.approx(2.5, rel=1e-4)
    assert checks["b"].ok and checks["b"].err_sdpa == 0  # within the floor (5e-4)
    assert not checks["c"].ok and checks["c"].err_ours == float("inf")  # misshapen gradient


def test_client_passes_with_the_reference_and_writes_its_figures(tmp_path):
    """The command line as CI's docs give it: exit 0, the table, and the JSON figures."""
    out = tmp_path / "llama.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--attention", "reference", "--device",
                           "cpu", "--preset", "tiny", "--steps", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: PASS" in proc.stdout and "step time: sdpa" in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["pass"] and figures["attention"] == "reference"
    n_params = sum(1 for c in figures["checks"] if c["name"] not in ("logits", "token losses"))
    assert n_params == 2 + 9 * client.PRESETS["tiny"].layers + 1  # embed, norm, head; 9 a layer
    assert all(c["ok"] and c["err_sdpa"] > 0 for c in figures["checks"])
    for run in figures["curves"].values():
        assert len(run["losses"]) == 4 and run["losses"][-1] < run["losses"][0]


class _ScaleGradQ(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, factor):
        ctx.factor = factor
        return q.view_as(q)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _dq_off(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Exact forward, dQ 5% too large: the kind of fault only a backward check sees."""
    return client.reference_forward(module, _ScaleGradQ.apply(query, 1.05), key, value,
                                    attention_mask, scaling, dropout, **kwargs)


def _not_causal(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    return client.reference_forward(module, query, key, value, attention_mask, scaling, dropout,
                                    **{**kwargs, "is_causal": False})


def _rounds_output_to_fp8(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                          **kwargs):
    out, w = client.reference_forward(module, query, key, value, attention_mask, scaling,
                                      dropout, **kwargs)
    return out.to(torch.float8_e4m3fn).to(out.dtype), w


@pytest.mark.parametrize("fault, first_failure", [
    (_dq_off, "q_proj"), (_not_causal, "logits"), (_rounds_output_to_fp8, "logits")])
def test_client_fails_on_a_planted_fault(fault, first_failure):
    code, text = run_main(["--attention", "reference", "--device", "cpu", "--steps", "2"],
                          attention_fn=fault)
    assert code == 1, text
    result = text.strip().splitlines()[-1]
    assert result.startswith("RESULT: FAIL") and first_failure in result, result


def test_usage_errors_exit_2():
    assert run_main(["--attention", "flash_attention", "--device", "cpu"])[0] == 2
    if not torch.cuda.is_available():
        assert run_main(["--device", "cuda"])[0] == 2


@pytest.mark.gpu
def test_client_on_gpu_with_flash_attention(require_extension):
    """A 2-layer Llama (16 query / 4 KV heads, d_head 128, 2 x 1024 tokens) through the kernels:
    the first step within the rule, and the training run."""
    code, text = run_main(["--preset", "gpu-small", "--steps", "6"])
    print(text)
    assert code == 0, text


def test_curve_rule_measures_drift_from_fp32_against_sdpa_own():
    """Ours may drift from the fp32 curve as far as twice SDPA's drift (plus the allowance), not
    further: a bf16 curve that wanders like SDPA's passes, one that wanders 3x as far fails."""
    fp32 = client.Run(losses=[10.0, 9.0, 8.0, 7.0])
    sdpa = client.Run(losses=[10.0, 9.1, 8.2, 7.1])      # drift 0.2
    near = client.Run(losses=[10.0, 8.8, 8.3, 6.9])      # drift 0.3 <= 2 * 0.2 + 0.01 * 10
    far = client.Run(losses=[10.0, 9.0, 8.6, 7.2])       # drift 0.6 > 0.5
    assert client.curve_problems(sdpa, near, fp32, 0.01) == []
    problems = client.curve_problems(sdpa, far, fp32, 0.01)
    assert len(problems) == 1 and "drifts 0.6000" in problems[0]
