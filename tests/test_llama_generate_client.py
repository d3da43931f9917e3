"""The Hugging Face Llama generation client (ci/llama_generate_client.py): on a CPU its harness
with the torch reference in place of flash_attn_with_kvcache (registration through
transformers' AttentionInterface, the static and append caches, the valid lengths from the
position ids, the comparison with SDPA's greedy tokens, the near-tie rule, the report and the
exit code, which planted faults must turn to 1); on a GPU the client itself with the kernels."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from .script_modules import load_script

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (noxfile TEST_DEPS has it): the Llama "
    "client's tests need it")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "ci" / "llama_generate_client.py"
client = load_script("ci/llama_generate_client.py")

CPU = ["--attention", "reference", "--device", "cpu"]


def run_main(argv, attention_fn=None):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = client.main(argv, attention_fn=attention_fn)
    return code, buf.getvalue()


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 4
    layer_idx = 0


def _sdpa_bottom_right(q, k, v, scale):
    """transformers' own SDPA path on (1, heads, seq, d) tensors (K/V repeated for GQA), the
    causal mask aligned bottom-right: query i of sq sees keys 0 .. n - sq + i."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sq, n = q.shape[2], k.shape[2]
    mask = torch.arange(n)[None, :] <= (n - sq + torch.arange(sq))[:, None]
    out, _ = sdpa_attention_forward(_Module(), q, k, v, mask[None, None], scaling=scale)
    return out


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seqlen_q", [1, 5])
def test_static_attention_reads_only_the_valid_rows(seqlen_q):
    """The whole cache tensors come in; only rows 0 .. position + 1 of each sequence are read (the
    rows past them are NaN here), causal bottom-right: the prefill (seqlen_q > 1) and a decode
    step equal transformers' SDPA over the valid prefix. Sequences of different lengths too."""
    batch, heads, kv_heads, max_len, d = 2, 8, 2, 40, 16
    lengths = [23, 31]
    cache_k, cache_v = (_rand(batch, kv_heads, max_len, d, seed=s) for s in (1, 2))
    for b, n in enumerate(lengths):
        cache_k[b, :, n:] = cache_v[b, :, n:] = float("nan")
    q = _rand(batch, heads, seqlen_q, d, seed=3)
    pos = torch.stack([torch.arange(n - seqlen_q, n) for n in lengths])
    attention = client.StaticCacheAttention(client.kvcache_torch)
    out, weights = attention(_Module(), q, cache_k, cache_v, None, scaling=0.3, position_ids=pos)
    assert weights is None and out.shape == (batch, seqlen_q, heads, d)
    for b, n in enumerate(lengths):
        expected = _sdpa_bottom_right(q[b:b + 1], cache_k[b:b + 1, :, :n],
                                      cache_v[b:b + 1, :, :n], 0.3)
        torch.testing.assert_close(out[b:b + 1], expected, atol=1e-5, rtol=1e-5)


def test_append_attention_writes_the_new_rows_then_attends():
    """The new keys and values land in the cache of the module's layer at each sequence's
    length (position_ids[:, 0]), in place; the output attends over the updated prefix."""
    batch, heads, kv_heads, max_len, d, s = 2, 8, 2, 32, 16, 3
    start = [10, 17]
    cache = SimpleNamespace(layers=[SimpleNamespace(
        keys=_rand(batch, kv_heads, max_len, d, seed=1),
        values=_rand(batch, kv_heads, max_len, d, seed=2))])
    before_k = cache.layers[0].keys.clone()
    new_k, new_v = (_rand(batch, kv_heads, s, d, seed=seed) for seed in (3, 4))
    q = _rand(batch, heads, s, d, seed=5)
    attention = client.AppendAttention(client.kvcache_torch)
    attention.cache = cache
    pos = torch.stack([torch.arange(n, n + s) for n in start])
    out, _ = attention(_Module(), q, new_k, new_v, None, scaling=0.25, position_ids=pos)
    keys, values = cache.layers[0].keys, cache.layers[0].values
    for b, n in enumerate(start):
        assert torch.equal(keys[b, :, n:n + s], new_k[b]) and torch.equal(values[b, :, n:n + s],
                                                                          new_v[b])
        assert torch.equal(keys[b, :, :n], before_k[b, :, :n])  # earlier rows kept
        assert torch.equal(keys[b, :, n + s:], before_k[b, :, n + s:])  # later rows untouched
        expected = _sdpa_bottom_right(q[b:b + 1], keys[b:b + 1, :, :n + s],
                                      values[b:b + 1, :, :n + s], 0.25)
        torch.testing.assert_close(out[b:b + 1], expected, atol=1e-5, rtol=1e-5)


def test_cache_lengths_come_from_the_positions_without_a_sync():
    pos = torch.tensor([[7, 8, 9]])  # (1, seqlen_q): the model's own default, broadcast
    after = client.cache_lengths(pos, 3, after_update=True)
    before = client.cache_lengths(pos, 3, after_update=False)
    assert after.dtype == before.dtype == torch.int32 and after.is_contiguous()
    assert after.tolist() == [10, 10, 10] and before.tolist() == [7, 7, 7]
    assert client.cache_lengths(torch.tensor([[4], [9]]), 2, True).tolist() == [5, 10]


def test_attention_refuses_what_it_would_ignore():
    q, k, v = _rand(1, 8, 1, 16, seed=0), _rand(1, 2, 8, 16, seed=1), _rand(1, 2, 8, 16, seed=2)
    pos = torch.tensor([[7]])
    for attention in (client.StaticCacheAttention(client.kvcache_torch),
                      client.AppendAttention(client.kvcache_torch)):
        with pytest.raises(NotImplementedError, match="attention_mask"):
            attention(_Module(), q, k, v, torch.zeros(1, 1, 1, 8), scaling=0.25, position_ids=pos)
        with pytest.raises(NotImplementedError, match="dropout"):
            attention(_Module(), q, k, v, None, scaling=0.25, dropout=0.1, position_ids=pos)
        with pytest.raises(NotImplementedError, match="sliding_window"):
            attention(_Module(), q, k, v, None, scaling=0.25, sliding_window=4, position_ids=pos)
        with pytest.raises(NotImplementedError, match="position_ids"):
            attention(_Module(), q, k, v, None, scaling=0.25)


@pytest.mark.parametrize("cache", client.CACHES)
def test_generate_calls_the_kernel_with_the_cache_in_place(cache):
    """generate() reaches the kernel call at every layer and step: the prefill with the prompt's
    rows, then one row a step; the caches are transformers' own tensors as (batch, max_len,
    kv_heads, d) views (no copy), the lengths int32 and growing by one a step; the append mode
    passes the new rows."""
    preset = client.Preset(**{**client.asdict(client.PRESETS["tiny"]), "new_tokens": 4})
    calls = []

    def spy(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, softmax_scale, causal):
        calls.append(SimpleNamespace(q=tuple(q.shape), cache=tuple(k_cache.shape),
                                     contiguous=k_cache.is_contiguous(),
                                     new=None if k is None else tuple(k.shape),
                                     lengths=cache_seqlens.tolist(), dtype=cache_seqlens.dtype,
                                     scale=softmax_scale, causal=causal))
        return client.kvcache_torch(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                    softmax_scale=softmax_scale, causal=causal)

    model = client.build_model(preset, "cpu", seed=0)
    prompts = client.make_prompts(preset, "cpu", seed=0)
    name, attention = client.register("reference", cache, spy)
    assert name in transformers.AttentionInterface._global_mapping
    g = client.run_generation(model, "ours", name, cache, prompts, preset.new_tokens,
                              compile_=False, warmup=0,
                              append=attention if cache == "append" else None)
    b, p, h, hk, d = preset.batch, preset.prompt, preset.heads, preset.kv_heads, preset.head_dim
    assert g.tokens.shape == (b, 4) and g.logits.shape == (b, 4, preset.vocab)
    assert len(g.step_ms) == 3
    steps = [calls[i::preset.layers] for i in range(preset.layers)]
    for layer_calls in steps:
        assert [c.q for c in layer_calls] == [(b, p, h, d)] + [(b, 1, h, d)] * 3
        # the static mode: the rows after this call's update; the append mode: before it
        lengths = [p, p + 1, p + 2, p + 3] if cache == "static" else [0, p, p + 1, p + 2]
        assert [c.lengths for c in layer_calls] == [[n] * b for n in lengths]
        assert all(c.dtype == torch.int32 and c.causal and c.scale == d ** -0.5
                   and not c.contiguous and c.cache[0] == b and c.cache[2:] == (hk, d)
                   for c in layer_calls)
        if cache == "append":
            assert [c.new for c in layer_calls] == [(b, p, hk, d)] + [(b, 1, hk, d)] * 3
        else:
            assert all(c.new is None for c in layer_calls)


def test_compare_tells_near_ties_from_real_errors():
    """A step where ours picks another token counts as a near-tie only if the fp32 logits of the
    two tokens are within 2x sdpa's bf16 error there (+ floor) and ours' logits are within it."""
    ref = torch.zeros(1, 3, 4)
    ref[0, :, 0] = 10.0
    ref[0, 1, 1] = 9.99  # step 1: tokens 0 and 1 tie within the noise
    sdpa_logits = ref + 0.02  # sdpa's error 0.02 everywhere: bound 0.04 + floor 0.01
    sdpa = client.Generation("sdpa", "static", torch.tensor([[0, 0, 0]]), sdpa_logits)

    def ours(tokens, logits):
        return client.Generation("ours", "static", torch.tensor([tokens]), logits,
                                 forced_logits=logits)

    tie = ref.clone()
    tie[0, 1, 1] = 10.02  # ours prefers token 1 at step 1, error 0.03
    c = client.compare(ours([0, 1, 0], tie), sdpa, ref, floor_frac=1e-3)
    assert c.tokens_equal == 1 and c.tokens_total == 3 and c.tokens_ok and c.forced_ok
    (d,) = c.divergences
    assert (d.sequence, d.step, d.ours, d.sdpa) == (0, 1, 1, 0) and d.near_tie
    assert c.logits_ok  # 0.03 <= 2 x 0.02 + 0.01

    wrong = ref.clone()
    wrong[0, 2, 3] = 10.5  # step 2: a token that fp32 puts 10 below the best
    c = client.compare(ours([0, 0, 3], wrong), sdpa, ref, floor_frac=1e-3)
    assert not c.tokens_ok and not c.forced_ok and not c.logits_ok
    assert [(d.step, d.near_tie) for d in c.forced_mismatches] == [(2, False)]
    checks = {x.name: x for x in client.checks_of(c)}
    assert "REAL ERROR" in checks["ours: tokens (free greedy)"].detail


def test_client_passes_with_the_reference_and_writes_its_figures(tmp_path):
    """The command line as CI's docs give it: 128 new tokens from the tiny model, both caches;
    exit 0, the table, and the JSON figures."""
    out = tmp_path / "generate.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *CPU, "--preset", "tiny", "--json",
                           str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: PASS" in proc.stdout and "ms/token" in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["pass"] and figures["attention"] == "reference"
    assert set(figures["runs"]) == {"sdpa", "ours (static)", "ours (append)",
                                    "sdpa (dynamic cache)"}
    steps = client.PRESETS["tiny"].new_tokens
    for label in ("ours (static)", "ours (append)"):
        run = figures["runs"][label]
        assert run["forced_steps"] == run["tokens_total"] == steps * client.PRESETS["tiny"].batch
        assert len(run["step_ms"]) == steps - 1 and run["median_ms"] > 0
        assert all(d["near_tie"] for d in run["divergences"] + run["forced_mismatches"])
        # nearly every step of the forced run picks sdpa's token (random weights: a few ties)
        assert len(run["forced_mismatches"]) <= 0.05 * run["forced_steps"]
    assert all(c["ok"] for c in figures["checks"]) and len(figures["checks"]) == 6


def _scaled(factor):
    def fn(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, softmax_scale, causal):
        return client.kvcache_torch(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                    softmax_scale=softmax_scale * factor, causal=causal)
    return fn


def _drops_last_key(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, softmax_scale,
                    causal):
    """Each query loses its newest key: the length one short."""
    return client.kvcache_torch(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens - 1,
                                softmax_scale=softmax_scale, causal=causal)


def _append_not_kept(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, softmax_scale,
                     causal):
    """The new rows are attended to in the call that brings them but never stored."""
    from flash_attention.reference import kvcache_reference

    return kvcache_reference(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                             softmax_scale=softmax_scale, causal=causal).out.to(q.dtype)


@pytest.mark.parametrize("cache, fault", [
    ("static", _scaled(1.05)), ("append", _scaled(1.05)), ("static", _drops_last_key),
    ("append", _append_not_kept)])
def test_client_fails_on_a_planted_fault(cache, fault):
    code, text = run_main([*CPU, "--cache", cache, "--new-tokens", "32"], attention_fn=fault)
    assert code == 1, text
    result = text.strip().splitlines()[-1]
    assert result.startswith("RESULT: FAIL") and f"ours ({cache})" in result, result
    assert "REAL ERROR" in text


def test_usage_errors_exit_2():
    assert run_main(["--attention", "flash_attention", "--device", "cpu"])[0] == 2
    assert run_main([*CPU, "--new-tokens", "1"])[0] == 2
    if not torch.cuda.is_available():
        assert run_main(["--device", "cuda"])[0] == 2


@pytest.mark.gpu
def test_client_on_gpu_with_flash_attention(require_extension):
    """A 4-layer Llama (8 query / 2 KV heads, d_head 64, 8 prompts of 333 tokens, 128 new tokens)
    through flash_attn_with_kvcache, both caches: tokens and logits within the rules, the
    kernels' status word clean."""
    code, text = run_main(["--preset", "gpu-d64"])
    print(text)
    assert code == 0, text
