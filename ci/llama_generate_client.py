"""A real inference client: a small Hugging Face Llama (random weights, GQA) generating tokens
greedily with transformers' generate() and its KV cache, the attention of every prefill and
decode step running through this project's flash_attn_with_kvcache (registered through
transformers' AttentionInterface), against the same weights on SDPA.

Two ways of holding the cache (--cache, default both):

- static: transformers' StaticCache (batch, kv_heads, max_len, d_head) per layer, written by the
  model's own cache update before attention is called. The attention function gets the whole
  cache tensors and reads only each sequence's valid rows, in place:
  flash_attn_with_kvcache(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2),
  cache_seqlens=lengths, causal=True) (the kernels take any strides with a contiguous last
  dimension, so the transposed views are read where they lie, no copy).
- append: the same StaticCache tensors, but the cache update only counts rows; the attention
  function writes the new keys and values itself through the kernel's append
  (flash_attn_with_kvcache(..., k=, v=)) and attends over the updated cache in the same call.

The valid lengths: transformers passes every attention function the position ids of its query
rows (batch, seqlen_q). Without padding a token's position is its cache row, so after the
update a sequence holds rows 0 .. position_ids[:, -1] (static) and before it rows
0 .. position_ids[:, 0] - 1 (append). They become a (batch,) int32 tensor on the GPU with no
device-to-host sync: the attention path reads nothing back per step (transformers' generate
loop itself reads one flag per step to decide whether to stop, for SDPA as for us). The prefill
(seqlen_q = the prompt) runs through the same call: causal masks align bottom-right to each
sequence's length, so query i sees keys 0 .. i. The prompts are unpadded and of one length:
transformers gives an attention function it does not know no mask to see padding by, and the
kernels have no left padding (cache_leftpad), so this client never pads.

Checks of each run of ours against the peer, the same bf16 weights on SDPA with the same
StaticCache, and an fp32 reference (the bf16 weights in fp32, one forward teacher-forced on
SDPA's tokens):
1. Free greedy: the generated tokens equal SDPA's. At a sequence's first differing step (its
   inputs still the same) the divergence is acceptable only as a near-tie: the fp32 logits of
   the two chosen tokens within 2x SDPA's bf16 logit error at that step (+ floor), and our
   logits there within that bound too. Anything else is a real error.
2. Forced: a second run of ours decodes SDPA's tokens (a logits processor forces them, the raw
   logits are kept), so every step of every sequence is compared, also after a near-tie: its
   argmax is SDPA's token at every step, each exception a near-tie as in 1. (A random model's
   top two logits are often close: on the tiny preset 1-3% of steps are near-ties, so a free
   run alone rarely compares all its steps.)
3. The logits of every step of the forced run: max|ours - fp32| <= 2 max|sdpa - fp32| + floor
   (FlashAttention's accuracy rule at model scale).
4. flash_attention only: the kernels' status word of bad cache metadata is clean at the end
   (one sync, after all runs).
Also the time per generated token (median of the decode steps of the free run, CUDA events
recorded by a logits processor at each step; after a warm-up generate) of ours and of SDPA with
the static cache and with transformers' default dynamic cache (timing and agreement for
information); with --compile, transformers' automatic torch.compile of the static-cache decode
step (mode reduce-overhead: CUDA graphs), otherwise eager.

Exit 0 when every check passes, 1 when one fails (the table says which), 2 on a usage error.

    python3 ci/llama_generate_client.py                              # GPU: flash_attention
    python3 ci/llama_generate_client.py --preset gpu-long --json /tmp/generate.json
    python3 ci/llama_generate_client.py --attention reference --preset tiny --device cpu

--attention reference swaps flash_attn_with_kvcache for a torch reference of the same call (fp32
math, the input dtype out: flash_attention.reference.kvcache_reference), so the harness
(registration, cache handling, comparison, report, exit code) runs on a machine without a GPU
(tests/test_llama_generate_client.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT / "src", ROOT / "ci"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
from hf_attention import is_causal, refuse_unsupported  # noqa: E402

CACHES = ("static", "append")


@dataclass(frozen=True)
class Preset:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    batch: int
    prompt: int  # tokens per prompt (all prompts of one length: no padding)
    new_tokens: int
    # std of the random weights: about 1 / sqrt(hidden) gives attention scores of std about 1
    # (with transformers' 0.02 a narrow model attends almost uniformly, and no fault in the
    # attention would change a token)
    init_std: float = 0.02


PRESETS = {
    # 4 x (8 query heads, 2 KV heads, d_head 128), 4 prompts of 1000 tokens
    "gpu": Preset(layers=4, hidden=1024, intermediate=2816, heads=8, kv_heads=2, head_dim=128,
                  vocab=32000, batch=4, prompt=1000, new_tokens=128, init_std=0.03),
    "gpu-d64": Preset(layers=4, hidden=512, intermediate=1408, heads=8, kv_heads=2, head_dim=64,
                      vocab=32000, batch=8, prompt=333, new_tokens=128, init_std=0.045),
    # long prompts: the decode steps read 8 x 8k keys per layer
    "gpu-long": Preset(layers=2, hidden=1024, intermediate=2816, heads=8, kv_heads=2,
                       head_dim=128, vocab=32000, batch=8, prompt=8000, new_tokens=128,
                       init_std=0.03),
    # the harness on a CPU: seconds
    "tiny": Preset(layers=2, hidden=128, intermediate=256, heads=8, kv_heads=2, head_dim=16,
                   vocab=512, batch=3, prompt=21, new_tokens=128, init_std=0.09),
}


# ---- the kernel call: flash_attn_with_kvcache or its torch reference --------------------------


def kvcache_torch(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, softmax_scale, causal):
    """The same call on flash_attention.reference.kvcache_reference: fp32 math on upcast inputs,
    the output in q's dtype, the new rows written into the caches in place as the kernel writes
    them (the reference appends into copies; they are copied back)."""
    from flash_attention.reference import kvcache_reference

    r = kvcache_reference(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                          softmax_scale=softmax_scale, causal=causal)
    if k is not None:
        k_cache.copy_(r.k_cache)
        v_cache.copy_(r.v_cache)
    return r.out.to(q.dtype)


def kernel_call(kind: str):
    """The kernel call of --attention kind: flash_attn_with_kvcache itself (imported here, on
    first use, so the module loads on a machine without the extension) or kvcache_torch. Both
    are called as fn(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, softmax_scale,
    causal)."""
    if kind == "flash_attention":
        from flash_attention.interface import flash_attn_with_kvcache

        return flash_attn_with_kvcache
    return kvcache_torch


ATTENTIONS = ("flash_attention", "reference")


# ---- the attention functions transformers calls -----------------------------------------------


def cache_lengths(position_ids: torch.Tensor, batch: int, after_update: bool) -> torch.Tensor:
    """Each sequence's cache rows as a (batch,) int32 tensor on position_ids' device, no sync.
    position_ids (batch or 1, seqlen_q): without padding a token's position is its cache row,
    so after the update the rows 0 .. position_ids[:, -1] hold keys, before it 0 ..
    position_ids[:, 0] - 1."""
    rows = position_ids[:, -1] + 1 if after_update else position_ids[:, 0]
    return rows.to(torch.int32).expand(batch).contiguous()


class StaticCacheAttention:
    """transformers' attention signature over a StaticCache: query (batch, heads, seqlen_q, d),
    key/value the whole cache tensors (batch, kv_heads, max_len, d) with this call's rows
    already written. Returns (out (batch, seqlen_q, heads, d), None)."""

    def __init__(self, kvcache_fn):
        self.kvcache_fn = kvcache_fn

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 **kwargs):
        refuse_unsupported(attention_mask, dropout, kwargs, position_ids=True)
        q = query.transpose(1, 2)  # (batch, seqlen_q, heads, d) views: no copies
        lengths = cache_lengths(kwargs["position_ids"], q.shape[0], after_update=True)
        out = self.kvcache_fn(q, key.transpose(1, 2), value.transpose(1, 2),
                              cache_seqlens=lengths, softmax_scale=scaling,
                              causal=is_causal(module, kwargs))
        return out, None


class AppendAttention:
    """The same signature over an append cache (make_append_cache): key/value are this call's
    new rows (batch, kv_heads, seqlen_q, d), written by the kernel into the cache of
    module.layer_idx at each sequence's length before it attends over the updated cache."""

    def __init__(self, kvcache_fn):
        self.kvcache_fn = kvcache_fn
        self.cache = None  # the append cache of the run in progress (make_append_cache)

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 **kwargs):
        refuse_unsupported(attention_mask, dropout, kwargs, position_ids=True)
        if self.cache is None:
            raise RuntimeError("AppendAttention has no cache: generate with make_append_cache's")
        layer = self.cache.layers[module.layer_idx]
        q = query.transpose(1, 2)
        lengths = cache_lengths(kwargs["position_ids"], q.shape[0], after_update=False)
        out = self.kvcache_fn(q, layer.keys.transpose(1, 2), layer.values.transpose(1, 2),
                              k=key.transpose(1, 2), v=value.transpose(1, 2),
                              cache_seqlens=lengths, softmax_scale=scaling,
                              causal=is_causal(module, kwargs))
        return out, None


def make_append_cache(config, max_cache_len: int):
    """A StaticCache whose layers allocate their tensors and count rows but write nothing: the
    append happens in the attention function (AppendAttention), inside the kernel call."""
    from transformers.cache_utils import StaticCache, StaticLayer

    class RowCountingLayer(StaticLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.cumulative_length.add_(key_states.shape[-2])
            return key_states, value_states

    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    cache.layers = [RowCountingLayer(max_cache_len=max_cache_len) for _ in cache.layers]
    return cache


def register(kind: str, cache: str, kvcache_fn=None):
    """Register the attention under test for one cache kind with transformers; returns (its
    implementation name, the attention function object)."""
    from transformers import AttentionInterface

    fn = kvcache_fn or kernel_call(kind)
    # a name with "flash" in it would send transformers looking for a flash-attn kernel package
    label = {"flash_attention": "ours"}.get(kind, kind)
    name = f"fa_kvcache_{cache}_{label}" + ("" if kvcache_fn is None else "_replaced")
    attention = StaticCacheAttention(fn) if cache == "static" else AppendAttention(fn)
    AttentionInterface.register(name, attention)
    return name, attention


# ---- model, prompts, generation ---------------------------------------------------------------


def build_model(preset: Preset, device: str, seed: int):
    """The fp32 model on SDPA with transformers' random initialisation (seeded), in eval mode;
    no special tokens (no EOS: every sequence generates all its tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=preset.vocab, hidden_size=preset.hidden,
                         intermediate_size=preset.intermediate,
                         num_hidden_layers=preset.layers, num_attention_heads=preset.heads,
                         num_key_value_heads=preset.kv_heads, head_dim=preset.head_dim,
                         max_position_embeddings=preset.prompt + preset.new_tokens,
                         attn_implementation="sdpa", initializer_range=preset.init_std,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.float().eval()


def make_prompts(preset: Preset, device: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, preset.vocab, (preset.batch, preset.prompt), generator=gen).to(device)


def variant(model, dtype: torch.dtype, attn: str):
    m = copy.deepcopy(model).to(dtype)
    m.set_attn_implementation(attn)
    return m.eval()


class StepClock:
    """A logits processor that marks the time at each generated token (a CUDA event on the
    current stream, no sync; the wall clock on a CPU) and leaves the logits as they are."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.marks: list = []

    def __call__(self, input_ids, scores):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        return scores

    def step_ms(self) -> list[float]:
        """The decode steps' times: from one token's logits to the next's (the prefill before
        the first token is not one of them)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


class ForceTokens:
    """A logits processor that makes step t choose tokens[:, t] (everything else -inf), so a
    run decodes the peer's tokens while its own raw logits (output_logits) are kept."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens  # (batch, new_tokens) on the scores' device
        self.step = 0

    def __call__(self, input_ids, scores):
        if self.step >= self.tokens.shape[1]:
            return scores
        forced = torch.full_like(scores, -math.inf)
        forced.scatter_(1, self.tokens[:, self.step, None], 0.0)
        self.step += 1
        return forced


@dataclass
class Generation:
    label: str
    cache: str  # static, append or dynamic
    tokens: torch.Tensor  # (batch, new_tokens) the generated ids (free greedy run)
    logits: torch.Tensor  # (batch, new_tokens, vocab) raw logits of each step of that run
    step_ms: list[float] = field(default_factory=list)
    # raw logits of a run forced to decode the peer's tokens (ForceTokens), or None
    forced_logits: torch.Tensor | None = None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms) if self.step_ms else math.nan


def generate(model, prompts: torch.Tensor, new_tokens: int, cache: str, compile_: bool,
             append: AppendAttention | None = None, processor=None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """One greedy generate(): (tokens (batch, new), raw logits (batch, new, vocab)), the
    logits processor (a StepClock, ForceTokens or None) called at each generated token."""
    from transformers import LogitsProcessorList

    kwargs = {}
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    elif cache == "append":
        append.cache.reset()  # rows counted from 0 again (reused, as generate reuses its own)
        kwargs["past_key_values"] = append.cache
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                             num_beams=1, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             return_dict_in_generate=True, output_logits=True,
                             logits_processor=LogitsProcessorList([processor] if processor
                                                                  else []),
                             disable_compile=not compile_, **kwargs)
    return out.sequences[:, prompts.shape[1]:], torch.stack(out.logits, dim=1)[:, :new_tokens]


def run_generation(model, label: str, attn: str, cache: str, prompts: torch.Tensor,
                   new_tokens: int, compile_: bool, warmup: int,
                   append: AppendAttention | None = None,
                   force: torch.Tensor | None = None) -> Generation:
    """The bf16 copy of the model on attention `attn`: warm-up generates, with `force` (the
    peer's tokens) a run that decodes those tokens, then the measured free greedy run."""
    m = variant(model, torch.bfloat16, attn)
    if append is not None:
        append.cache = make_append_cache(m.config, prompts.shape[1] + new_tokens)
    for _ in range(warmup):
        generate(m, prompts, new_tokens, cache, compile_, append)
    forced = None
    if force is not None:
        _, forced = generate(m, prompts, new_tokens, cache, compile_, append, ForceTokens(force))
    clock = StepClock(prompts.is_cuda)
    tokens, logits = generate(m, prompts, new_tokens, cache, compile_, append, clock)
    del m
    if append is not None:
        append.cache = None
    if prompts.is_cuda:
        torch.cuda.empty_cache()
    return Generation(label, cache, tokens, logits, clock.step_ms()[:new_tokens - 1], forced)


def reference_logits(model, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The fp32 logits of every step, teacher-forced on `tokens`: the bf16 model's weights in
    fp32 (rounding the weights is common to every bf16 run; this measures the computation),
    one forward over prompt + tokens[:-1] on SDPA in fp32, no TF32. (batch, new, vocab) fp32."""
    ref = copy.deepcopy(model).to(torch.bfloat16).float().eval()
    ref.set_attn_implementation("sdpa")
    ids = torch.cat([prompts, tokens[:, :-1]], dim=1)
    with torch.no_grad():
        logits = ref(input_ids=ids, logits_to_keep=tokens.shape[1], use_cache=False).logits
    del ref
    return logits.float()


# ---- the comparison ---------------------------------------------------------------------------


@dataclass
class Disagreement:
    """A step where a run's choice is not the peer's token, judged on the fp32 logits."""

    sequence: int
    step: int  # 0-based index of the generated token
    ours: int  # the token this run chose (its logits' argmax)
    sdpa: int  # the peer's token
    gap_fp32: float  # |fp32 logit of ours' token - of sdpa's|
    noise: float  # sdpa's max |bf16 logit - fp32| at this step
    err_ours: float  # this run's max |bf16 logit - fp32| at this step
    top2_fp32: float  # fp32 gap between the best and the second-best token at this step
    bound: float  # 2 * noise + floor

    @property
    def near_tie(self) -> bool:
        """The two tokens are within bf16 noise of each other in fp32, and this run's logits
        at the step are within the rule: acceptable. Otherwise a real error."""
        return self.gap_fp32 <= self.bound and self.err_ours <= self.bound


@dataclass
class Comparison:
    label: str
    tokens_equal: int  # free run: per sequence, the steps before its first divergence, summed
    tokens_total: int
    divergences: list[Disagreement]  # free run: each sequence's first differing step
    forced_steps: int  # steps of the run decoding sdpa's tokens (0: no such run)
    forced_mismatches: list[Disagreement]  # its steps whose argmax is not sdpa's token
    # max |logits - fp32|: over every step of the forced run (without one, the free run's steps
    # up to each sequence's divergence), and sdpa's over the same steps
    err_ours: float
    err_sdpa: float
    floor: float

    @property
    def bound(self) -> float:
        return 2 * self.err_sdpa + self.floor

    @property
    def logits_ok(self) -> bool:
        return math.isfinite(self.err_ours) and self.err_ours <= self.bound

    @property
    def tokens_ok(self) -> bool:
        return all(d.near_tie for d in self.divergences)

    @property
    def forced_ok(self) -> bool:
        return all(d.near_tie for d in self.forced_mismatches)

    @property
    def ratio(self) -> float:
        if self.err_sdpa > 0:
            return self.err_ours / self.err_sdpa
        return 0.0 if self.err_ours == 0 else math.inf


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Per sequence, the first step where the tokens differ (the length when none does)."""
    differ = (a != b).cpu()
    steps = a.shape[1]
    return [int(row.nonzero()[0]) if row.any() else steps for row in differ]


def max_err(logits: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """max over the vocabulary of |logits - ref|: (batch, steps) fp32."""
    return (logits.float() - ref).abs().amax(dim=-1)


def compare(ours: Generation, sdpa: Generation, ref: torch.Tensor, floor_frac: float
            ) -> Comparison:
    """ours against sdpa (the same prompts and weights) and the fp32 reference `ref`, which is
    teacher-forced on sdpa's tokens: valid for ours' free run up to and including each
    sequence's first divergence (the inputs of that step are still the same), and for every
    step of ours' forced run (its inputs are sdpa's tokens)."""
    floor = floor_frac * ref.abs().max().item()
    err_sdpa = max_err(sdpa.logits, ref)

    def disagreement(b: int, t: int, token: int, logits: torch.Tensor) -> Disagreement:
        s = int(sdpa.tokens[b, t])
        top2 = ref[b, t].topk(2).values
        noise = err_sdpa[b, t].item()
        err = (logits[b, t].float() - ref[b, t]).abs().max().item()
        return Disagreement(b, t, token, s, abs(ref[b, t, token] - ref[b, t, s]).item(), noise,
                            err, (top2[0] - top2[1]).item(), 2 * noise + floor)

    divs = first_divergence(ours.tokens, sdpa.tokens)
    batch, steps = ours.tokens.shape
    divergences = [disagreement(b, t, int(ours.tokens[b, t]), ours.logits)
                   for b, t in enumerate(divs) if t < steps]
    forced, mismatches = ours.forced_logits, []
    if forced is not None:
        choice = forced.float().argmax(dim=-1)
        for b, t in (choice != sdpa.tokens).nonzero().tolist():
            mismatches.append(disagreement(b, t, int(choice[b, t]), forced))
        err, err_peer = max_err(forced, ref).max().item(), err_sdpa.max().item()
    else:
        seen = (torch.arange(steps, device=ref.device)[None, :]
                <= torch.tensor(divs, device=ref.device)[:, None])
        err, err_peer = max_err(ours.logits, ref)[seen].max().item(), err_sdpa[seen].max().item()
    return Comparison(ours.label, sum(divs), batch * steps, divergences,
                      0 if forced is None else batch * steps, mismatches, err, err_peer, floor)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def _listing(ds: list[Disagreement], most: int = 4) -> str:
    shown = ", ".join(f"seq {d.sequence} step {d.step} "
                      f"({'near-tie' if d.near_tie else 'REAL ERROR'})" for d in ds[:most])
    return shown + (f", ... ({len(ds) - most} more)" if len(ds) > most else "")


def checks_of(c: Comparison) -> list[Check]:
    free = f"{c.tokens_equal}/{c.tokens_total} equal"
    if c.divergences:
        free += "; first divergences: " + _listing(c.divergences, most=len(c.divergences))
    checks = [Check(f"{c.label}: tokens (free greedy)", c.tokens_ok, free)]
    if c.forced_steps:
        ties = sum(d.near_tie for d in c.forced_mismatches)
        forced = (f"{c.forced_steps - len(c.forced_mismatches)}/{c.forced_steps} steps choose "
                  f"sdpa's token; {ties} near-ties, {len(c.forced_mismatches) - ties} real errors")
        if c.forced_mismatches:
            forced += ": " + _listing(sorted(c.forced_mismatches, key=lambda d: d.near_tie))
        checks.append(Check(f"{c.label}: argmax on sdpa's tokens", c.forced_ok, forced))
    checks.append(Check(f"{c.label}: logits", c.logits_ok,
                        f"err {c.err_ours:.3e} <= 2 x sdpa {c.err_sdpa:.3e} + floor "
                        f"{c.floor:.1e}"))
    return checks


# ---- the client -------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention", choices=ATTENTIONS, default="flash_attention")
    p.add_argument("--cache", choices=[*CACHES, "both"], default="both",
                   help="static: the model writes the cache, the kernel reads it in place; "
                   "append: the kernel writes the new rows (default both)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model and batch (default: gpu on CUDA, tiny on CPU)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per prompt")
    p.add_argument("--prompt", type=int, default=None, help="tokens per prompt")
    p.add_argument("--batch", type=int, default=None, help="prompts")
    p.add_argument("--warmup", type=int, default=1, help="warm-up generate() calls per run")
    p.add_argument("--compile", action="store_true",
                   help="let transformers torch.compile the static-cache decode step (mode "
                   "reduce-overhead: CUDA graphs); default eager")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logit-floor", type=float, default=1e-3,
                   help="floor of the logits' bounds, as a fraction of max|fp32 logit|")
    p.add_argument("--json", type=Path, help="write the figures here")
    return p.parse_args(argv)


def main(argv=None, attention_fn=None) -> int:
    """Runs the client. attention_fn replaces the --attention kernel call (tests plant faults):
    fn(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, softmax_scale, causal) -> out, with
    flash_attn_with_kvcache's layouts (q (batch, seqlen_q, heads, d), caches (batch, max_len,
    kv_heads, d), any strides) and its in-place append of k, v."""
    args = parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("transformers is not installed (pip install transformers)", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here (use --device cpu --attention reference)",
              file=sys.stderr)
        return 2
    if args.attention == "flash_attention" and attention_fn is None and not cuda:
        print("flash_attention runs on CUDA only: use --attention reference on a CPU",
              file=sys.stderr)
        return 2
    base = PRESETS[args.preset or ("gpu" if cuda else "tiny")]
    preset = Preset(**{**asdict(base), **{k: v for k, v in (
        ("new_tokens", args.new_tokens), ("prompt", args.prompt), ("batch", args.batch))
        if v is not None}})
    if preset.new_tokens < 2 or preset.prompt < 1 or preset.batch < 1:
        print("--new-tokens must be >= 2, --prompt and --batch >= 1", file=sys.stderr)
        return 2
    caches = CACHES if args.cache == "both" else (args.cache,)
    # the fp32 reference is fp32 all through: no TF32 matmuls
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    model = build_model(preset, device, args.seed)
    prompts = make_prompts(preset, device, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    run = {"prompts": prompts, "new_tokens": preset.new_tokens, "compile_": args.compile,
           "warmup": args.warmup}

    # the peer first: its tokens are the ones the fp32 reference is teacher-forced on, and the
    # ones ours' forced run decodes
    sdpa = run_generation(model, "sdpa", "sdpa", "static", **run)
    ours = []
    for cache in caches:
        name, attention = register(args.attention, cache, attention_fn)
        ours.append(run_generation(model, f"ours ({cache})", name, cache, **run,
                                   append=attention if cache == "append" else None,
                                   force=sdpa.tokens))
    dynamic = run_generation(model, "sdpa (dynamic cache)", "sdpa", "dynamic", **run)
    ref = reference_logits(model, prompts, sdpa.tokens)
    err_sdpa = max_err(sdpa.logits, ref).max().item()
    comparisons = [compare(g, sdpa, ref, args.logit_floor) for g in ours]
    info_dynamic = compare(dynamic, sdpa, ref, args.logit_floor)
    checks = [c for cmp in comparisons for c in checks_of(cmp)]
    if args.attention == "flash_attention" and attention_fn is None:
        import flash_attention as fa

        errors = fa.kvcache_errors()  # one sync, after every run
        checks.append(Check("kernel status word", not errors, "; ".join(errors) or "clean"))

    failed = [c for c in checks if not c.ok]
    ok = not failed
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    mode = "torch.compile (reduce-overhead) for static caches" if args.compile else "eager"
    print(f"Llama generate client ({transformers.__version__}, torch {torch.__version__}, {gpu}): "
          f"{preset.layers} layers, hidden {preset.hidden}, {preset.heads} heads / "
          f"{preset.kv_heads} KV heads, d_head {preset.head_dim}, vocab {preset.vocab}, "
          f"{n_params / 1e6:.1f} M parameters, bf16; {preset.batch} prompts x {preset.prompt} "
          f"tokens, {preset.new_tokens} new tokens each, greedy, {mode}; attention under test: "
          f"{args.attention} (flash_attn_with_kvcache" + (", replaced" if attention_fn else "")
          + ")")
    unit = "CUDA events" if cuda else "wall clock"
    print(f"\nms/token: median of the {preset.new_tokens - 1} decode steps of a free greedy run "
          f"({unit}; after {args.warmup} warm-up generate). free: tokens equal to sdpa's (static "
          "cache) before each sequence's first divergence; forced: steps of a run decoding "
          "sdpa's tokens whose argmax is sdpa's token; logit err: max |logits - fp32| (fp32 "
          "teacher-forced on sdpa's tokens) over the forced run, rule err <= 2 err(sdpa) + floor")
    print(f"  {'run':<22} {'ms/token':>9} {'sdpa/run':>8} {'free':>11} {'forced':>11} "
          f"{'logit err':>10} {'ratio':>6} {'of bound':>8}")
    print(f"  {sdpa.label:<22} {sdpa.median_ms:9.3f} {1.0:8.3f} {'(peer)':>11} {'':>11} "
          f"{err_sdpa:10.3e}")
    for g, c in [*zip(ours, comparisons), (dynamic, info_dynamic)]:
        of_bound = c.err_ours / c.bound if c.bound > 0 else math.inf
        forced = (f"{c.forced_steps - len(c.forced_mismatches)}/{c.forced_steps}"
                  if c.forced_steps else "-")
        flag = "" if g is dynamic or (c.tokens_ok and c.forced_ok and c.logits_ok) else "FAIL"
        print(f"  {g.label:<22} {g.median_ms:9.3f} {sdpa.median_ms / g.median_ms:8.3f} "
              f"{f'{c.tokens_equal}/{c.tokens_total}':>11} {forced:>11} {c.err_ours:10.3e} "
              f"{c.ratio:6.2f} {of_bound:8.2f} {flag}")
    print("  (sdpa with the dynamic cache: timing and agreement for information, not checked; "
          "its logit err is over the steps before its divergences)")
    for c in [*comparisons, info_dynamic]:
        listed = [("first differs", d) for d in c.divergences]
        listed += [("forced, argmax differs", d) for d in c.forced_mismatches
                   if not d.near_tie][:8]
        for what, d in listed:
            verdict = ("near-tie: acceptable" if d.near_tie else
                       "REAL ERROR" if c is not info_dynamic else "not a near-tie")
            print(f"  {c.label}: sequence {d.sequence} {what} at step {d.step} (token {d.ours} "
                  f"vs sdpa's {d.sdpa}): fp32 gap {d.gap_fp32:.3e}, bound 2 x sdpa's bf16 "
                  f"error {d.noise:.3e} + floor = {d.bound:.3e}, this run's error "
                  f"{d.err_ours:.3e}; fp32 top-2 gap {d.top2_fp32:.3e} -> {verdict}")
    print("\nchecks:")
    for c in checks:
        print(f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}")
    print(f"\nRESULT: {'PASS' if ok else 'FAIL'}"
          + ("" if ok else f" ({len(failed)} checks failed, first: {failed[0].name})"))
    if args.json:
        def figures(g: Generation, c: Comparison | None) -> dict:
            out = {"cache": g.cache, "median_ms": g.median_ms, "step_ms": g.step_ms}
            if c is not None:
                out.update(tokens_equal=c.tokens_equal, tokens_total=c.tokens_total,
                           forced_steps=c.forced_steps, err_logits=c.err_ours,
                           err_logits_sdpa=c.err_sdpa, floor=c.floor, **{
                               key: [{**asdict(d), "near_tie": d.near_tie} for d in ds]
                               for key, ds in (("divergences", c.divergences),
                                               ("forced_mismatches", c.forced_mismatches))})
            return out

        args.json.write_text(json.dumps({
            "preset": asdict(preset), "attention": args.attention, "device": gpu,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "parameters": n_params, "compile": args.compile, "pass": ok,
            "err_logits_sdpa": err_sdpa,
            "runs": {g.label: figures(g, c) for g, c in
                     [(sdpa, None), *zip(ours, comparisons), (dynamic, info_dynamic)]},
            "checks": [asdict(c) for c in checks],
        }, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
