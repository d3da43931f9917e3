"""Context parallelism in training: a small Hugging Face Llama (random weights, GQA) trained for a
few AdamW steps on P processes (one per GPU, NCCL), each holding its zigzag shard of ONE long
sequence, attention through flash_attention.distributed.ring_attention.

What each rank does (the model is replicated; no DDP, all by hand):
  - ids, labels and positions of the whole sequence are built the same on every rank: labels
    shifted on the WHOLE sequence (token i's label is token i + 1; the last token has none),
    positions arange(S); each is then sharded with shard_sequence (rank r holds chunks r and
    2P-1-r of 2P), so a shard's tokens keep their global positions (RoPE) and the last token
    of a chunk has the next global token as its label;
  - forward of its shard; every layer's attention is ring_attention over the group (registered
    with transformers' AttentionInterface; q, k, v transposed from (b, h, s, d) to
    (b, s, h, d) views); the LM head and the cross-entropy run in chunks of tokens (each
    checkpointed: no (tokens, vocab) logits kept);
  - loss = (sum of the token losses of all ranks) / (tokens with a label, all ranks): each rank
    back-propagates its own sum / total, the gradients are summed over the ranks (all_reduce,
    in fp32) before AdamW, so every replica takes the step of the whole sequence's mean loss.

Modes:
  --check      on a sequence short enough for one process (default 8192 tokens on GPUs), the
               P-rank run against one process on the whole sequence, same weights and batch:
               1. first step: the token losses and every parameter's gradient against an fp32
                  reference (one process, fp32 weights, flash_attention's fp32 reference
                  attention), FlashAttention's rule: err(cp) <= 2 err(one) + floor, where
                  "one" is the bf16 single-process run with the package's attention
                  (flash_attention.attention on a GPU), floor a fraction of the reference's
                  largest magnitude;
               2. the loss per step over --steps AdamW steps: max_t |cp_t - one_t| <=
                  2 max_t |sdpa_t - one_t| + --curve-tol x loss_1, where sdpa is the same
                  single-process bf16 run on PyTorch's SDPA: the calibration, what swapping one
                  exact bf16 attention for another does to the curve by itself;
               3. the replicas' weights identical on every rank after the steps.
  --long S     P-rank training on S tokens (say 262144 or 524288 on 2 GPUs): the memory
               estimate (saved activations measured per token, one GPU against one rank; why
               one GPU would not hold it), per-step time, tokens/s, peak memory per GPU
               (torch.cuda.max_memory_allocated) and the loss per step; it passes when every
               loss is finite and the replicas agree. --checkpoint auto turns per-layer
               activation checkpointing on where the estimate exceeds 80% of a GPU.

Exit 0 pass, 1 a check failed (or a worker failed: the error is printed), 2 usage error.

    python3 ci/cp_train_example.py --check                 # all GPUs of the machine (2+)
    python3 ci/cp_train_example.py --long 262144 --steps 3
    python3 ci/cp_train_example.py --check --device cpu    # the harness: 2 gloo processes

--device cpu runs the same code over gloo: ring_attention computes its blocks with the fp32
reference on CPU tensors, the single-process runs use flash_attention.reference in place of
the kernels, and the model is a tiny one (tests/test_cp_train_example.py). For tests only, the
hidden option --plant NAME breaks one step of the recipe (positions: every rank uses
arange(local length); labels: shifted after sharding, per shard; grads: not all-reduced), which
the check must catch (exit 1).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT / "src", ROOT / "ci"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
from hf_attention import is_causal, refuse_unsupported  # noqa: E402

IGNORE = -100  # label of a token with no next token (cross_entropy's ignore_index)
PLANTS = ("positions", "labels", "grads")  # --plant: faults for the tests only


@dataclass(frozen=True)
class Preset:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    # random weights' std: 0.02 at hidden 2048 gives attention scores of std about 0.8; the
    # tiny model needs wider weights for that spread (else attention is a near-uniform average
    # that wrong positions would hardly change)
    init_std: float = 0.02


PRESETS = {
    # 4 x (16 query heads, 4 KV heads, d_head 128): about 0.3 B parameters
    "gpu": Preset(layers=4, hidden=2048, intermediate=5632, heads=16, kv_heads=4, head_dim=128,
                  vocab=32000),
    "tiny": Preset(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16,
                   vocab=256, init_std=0.1),
}

# names in transformers' AttentionInterface (none contains "flash": transformers gives names
# with it flash_attn's own mask and padding handling)
RING, ONE, REF = "cp_ring", "cp_one_process", "cp_fp32_reference"


# ---- the attention functions transformers calls ----------------------------------------------


def _check_call(module, attention_mask, dropout, kwargs) -> None:
    refuse_unsupported(attention_mask, dropout, kwargs)
    if not is_causal(module, kwargs):
        raise NotImplementedError("a causal language model only")


def ring_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 **kwargs):
    """This rank's shard: query (b, heads, s_local, d), key/value (b, kv_heads, s_local, d),
    rotated at their global positions. Attention over the whole sequence by the ring."""
    from flash_attention.distributed import ring_attention

    _check_call(module, attention_mask, dropout, kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (b, s, h, d) views
    return ring_attention(q, k, v, causal=True, softmax_scale=scaling,
                          transport=TRANSPORT[0]), None


TRANSPORT = ["push"]  # the ring's transport (--transport), set in each worker


def one_process_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        **kwargs):
    """The whole sequence in one process: the package's kernels on a GPU, its fp32 reference
    (output rounded to the input dtype) on a CPU."""
    _check_call(module, attention_mask, dropout, kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if q.is_cuda:
        import flash_attention as fa  # CUDA pieces load here, on first use

        return fa.attention(q, k, v, causal=True, softmax_scale=scaling), None
    from flash_attention.reference import attention_reference

    out, _ = attention_reference(q, k, v, scaling, causal=True)
    return out.to(query.dtype), None


REF_ROWS = 1024  # query rows per block of the fp32 reference


def _reference_rows(q_rows, k, v, scaling, start):
    from flash_attention.reference import attention_reference

    end = start + q_rows.shape[1]  # rows start..end-1 see keys 0..row (causal, bottom-right)
    out, _ = attention_reference(q_rows, k[:, :end], v[:, :end], scaling, causal=True)
    return out


def reference_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """The fp32 reference: flash_attention.reference (fp32 math) by blocks of query rows, each
    checkpointed, so no (seq x seq) matrix is kept for the backward."""
    _check_call(module, attention_mask, dropout, kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    outs = [checkpoint(functools.partial(_reference_rows, scaling=scaling, start=i),
                       q[:, i:i + REF_ROWS], k, v, use_reentrant=False)
            for i in range(0, q.shape[1], REF_ROWS)]
    return torch.cat(outs, dim=1).to(query.dtype), None


def register() -> None:
    from transformers import AttentionInterface

    for name, fn in ((RING, ring_forward), (ONE, one_process_forward),
                     (REF, reference_forward)):
        AttentionInterface.register(name, fn)


# ---- model, sequence, shards ------------------------------------------------------------------


def build_model(preset: Preset, seq: int, device: torch.device, seed: int):
    """The fp32 model (transformers' random initialisation, seeded), the same on every rank:
    rank 0's weights are broadcast when a group is up."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=preset.vocab, hidden_size=preset.hidden,
                         intermediate_size=preset.intermediate, num_hidden_layers=preset.layers,
                         num_attention_heads=preset.heads, num_key_value_heads=preset.kv_heads,
                         head_dim=preset.head_dim, max_position_embeddings=max(seq, 128),
                         initializer_range=preset.init_std, attn_implementation="sdpa",
                         use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).float()
    if dist.is_initialized():
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
    return model


def variant(model, dtype: torch.dtype, attn: str, layer_checkpoints: bool = False):
    """A copy with its parameters in dtype (buffers, RoPE's inverse frequencies, stay fp32)
    running attention `attn`, optionally with per-layer checkpointing."""
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.data = p.data.to(dtype)
    m.set_attn_implementation(attn)
    if layer_checkpoints:
        checkpoint_layers(m)
    m.train()
    return m


def checkpoint_layers(model) -> None:
    """Per-layer activation checkpointing: each decoder layer keeps only its input and runs its
    forward again in the backward (the ring's with it, on every rank in the same order)."""
    for layer in model.model.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def make_sequence(vocab: int, seq: int, seed: int) -> torch.Tensor:
    """(1, seq) token ids, the same on every rank (CPU generator)."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab, (1, seq), generator=gen)


def shifted_labels(ids: torch.Tensor) -> torch.Tensor:
    """Next-token labels: token i's is ids[i + 1]; the last token has none (IGNORE)."""
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:]
    return labels


@dataclass
class Batch:
    ids: torch.Tensor  # (1, s) this rank's tokens
    labels: torch.Tensor  # (1, s)
    positions: torch.Tensor  # (1, s) their positions in the whole sequence
    n_total: int  # tokens with a label, all ranks together


def whole_batch(ids: torch.Tensor, device) -> Batch:
    labels = shifted_labels(ids)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    return Batch(ids.to(device), labels.to(device), positions.to(device),
                 int((labels != IGNORE).sum()))


def shard_batch(ids: torch.Tensor, device, plant: str | None = None) -> Batch:
    """This rank's zigzag shard of the whole sequence ids (1, S): its tokens, their labels
    (shifted on the whole sequence first) and their global positions."""
    from flash_attention.distributed import shard_sequence

    ids_local = shard_sequence(ids)
    if plant == "labels":  # the fault: shifted within the shard
        labels_local = shifted_labels(ids_local)
    else:
        labels_local = shard_sequence(shifted_labels(ids))
    if plant == "positions":  # the fault: local positions on every rank
        positions = torch.arange(ids_local.shape[1]).unsqueeze(0)
    else:
        positions = shard_sequence(torch.arange(ids.shape[1]).unsqueeze(0))
    count = torch.tensor([int((labels_local != IGNORE).sum())], device=device)
    dist.all_reduce(count)
    return Batch(ids_local.to(device), labels_local.to(device), positions.to(device),
                 int(count.item()))


# ---- loss, step, training ---------------------------------------------------------------------


def _chunk_losses(lm_head, hidden, labels):
    logits = lm_head(hidden).float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                             ignore_index=IGNORE, reduction="none")


def token_losses(model, batch: Batch, chunk: int) -> torch.Tensor:
    """(1, s) fp32 cross-entropy of each token of the batch (0 where no label); the LM head and
    the loss run on chunks of tokens, each checkpointed (the logits are not kept)."""
    hidden = model.model(input_ids=batch.ids, position_ids=batch.positions).last_hidden_state
    head = functools.partial(_chunk_losses, model.lm_head)
    parts = [checkpoint(head, h, lab, use_reentrant=False)
             for h, lab in zip(hidden.split(chunk, dim=1), batch.labels.split(chunk, dim=1))]
    return torch.cat(parts).unsqueeze(0)


def all_reduce_grads(model) -> None:
    """Sum every parameter's gradient over the ranks (in fp32, one collective)."""
    params = list(model.parameters())
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(g).to(g.dtype)
        offset += g.numel()


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    peak_bytes: int = 0
    first_tokens: torch.Tensor | None = None  # step 1's token losses, whole sequence (S,)
    first_grads: dict[str, torch.Tensor] | None = None  # step 1's gradients, fp32


def train(model, batch: Batch, steps: int, lr: float, cp: bool, record_first: bool,
          chunk: int, plant: str | None = None, progress: bool = False) -> Run:
    """AdamW steps on one sequence; cp: the batch is this rank's shard (loss and gradients
    summed over the group). record_first keeps step 1's token losses (gathered into sequence
    order) and gradients (as AdamW would see them). progress: print each step's loss and time
    as it ends (long runs)."""
    from flash_attention.distributed import gather_sequence

    cuda = batch.ids.is_cuda
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    run = Run()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for step in range(steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = token_losses(model, batch, chunk)
        local = tokens.sum()
        (local / batch.n_total).backward()
        total = local.detach().clone()
        if cp:
            if plant != "grads":
                all_reduce_grads(model)
            dist.all_reduce(total)
        if step == 0 and record_first:
            whole = gather_sequence(tokens.detach(), dim=1) if cp else tokens.detach()
            run.first_tokens = whole[0].clone()
            run.first_grads = {n: p.grad.detach().float().clone()
                               for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        run.losses.append(total.item() / batch.n_total)  # .item() waits for the step
        if cuda:
            torch.cuda.synchronize()
        run.step_s.append(time.perf_counter() - t0)
        if progress:
            print(f"step {step + 1}/{steps}: loss {run.losses[-1]:.4f}, "
                  f"{run.step_s[-1]:.1f} s (this rank)", flush=True)
    if cuda:
        run.peak_bytes = torch.cuda.max_memory_allocated()
    return run


def replicas_agree(model) -> bool:
    """Whether every rank's weights are the same after the steps (a fingerprint of each, all
    gathered): identical gradient sums keep the replicas identical."""
    with torch.no_grad():
        fingerprint = [float(sum(p.double().sum() for p in model.parameters())),
                       float(sum(p.double().square().sum() for p in model.parameters()))]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, fingerprint)
    return all(f == everyone[0] for f in everyone)


# ---- the check's comparison -------------------------------------------------------------------


@dataclass
class Check:
    name: str
    err_cp: float
    err_one: float
    err_sdpa: float
    floor: float

    @property
    def bound(self) -> float:
        return 2 * self.err_one + self.floor

    @property
    def ok(self) -> bool:
        return math.isfinite(self.err_cp) and self.err_cp <= self.bound

    def of_bound(self) -> float:
        """err(cp) / bound: at most 1 passes."""
        if self.bound > 0:
            return self.err_cp / self.bound
        return 0.0 if self.err_cp == 0 else math.inf


def _err(t: torch.Tensor | None, ref: torch.Tensor) -> float:
    if t is None or t.shape != ref.shape:
        return math.inf
    return (t.float() - ref).abs().max().item()


def first_step_checks(ref: Run, one: Run, sdpa: Run, cp: Run, grad_floor: float,
                      out_floor: float) -> list[Check]:
    """The token losses, then every parameter of the reference (one missing or misshapen in a
    bf16 run: error inf); floors relative to the reference's largest magnitude."""
    def check(name, r, c, o, s, floor):
        return Check(name, _err(c, r), _err(o, r), _err(s, r), floor * r.abs().max().item())

    checks = [check("token losses", ref.first_tokens, cp.first_tokens, one.first_tokens,
                    sdpa.first_tokens, out_floor)]
    grads = [run.first_grads or {} for run in (ref, cp, one, sdpa)]
    for name, r in grads[0].items():
        checks.append(check(name, r, *(g.get(name) for g in grads[1:]), grad_floor))
    return checks


def curve_check(cp: list[float], one: list[float], sdpa: list[float], tol: float) -> dict:
    """max_t |cp - one| against the calibration max_t |sdpa - one|: pass when the first is at
    most twice the second plus tol x the first loss."""
    gap_cp = max(abs(a - b) for a, b in zip(cp, one))
    gap_sdpa = max(abs(a - b) for a, b in zip(sdpa, one))
    bound = 2 * gap_sdpa + tol * abs(one[0])
    finite = all(math.isfinite(x) for x in [*cp, *one, *sdpa])
    return {"gap_cp": gap_cp, "gap_sdpa": gap_sdpa, "bound": bound,
            "ok": finite and gap_cp <= bound}


# ---- memory estimate --------------------------------------------------------------------------


def saved_bytes_per_token(model, batch: Batch) -> float:
    """Bytes the forward keeps for the backward, per token of this batch: every tensor autograd
    saves in the decoder (saved_tensors_hooks), counted once per storage, parameters left out,
    and the last hidden state (the checkpointed LM head's input)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    kept = []  # holds every saved tensor until counted: no storage is freed and reused

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model.model(input_ids=batch.ids, position_ids=batch.positions).last_hidden_state
    pack(hidden)
    kept.clear()
    return sum(seen.values()) / batch.ids.shape[1]


def memory_estimate(preset: Preset, n_params: int, per_token: float, seq: int, ranks: int,
                    total_bytes: int) -> dict:
    """GB for one GPU with the whole sequence and for one of `ranks` ranks, without and with
    per-layer checkpointing: saved activations (measured per token) + the backward's working
    set (about one layer's activations) + bf16 weights, gradients and AdamW's two states (8
    bytes a parameter) + the ranks' fp32 gradient buffer (4 bytes a parameter)."""
    per_layer = per_token / preset.layers
    layer_input = 2 * preset.hidden  # what a checkpointed layer keeps: its bf16 input

    def gb(tokens, ckpt, cp):
        act = tokens * ((preset.layers * layer_input + 2 * per_layer) if ckpt
                        else (per_token + per_layer))
        return (act + n_params * (8 + (4 if cp else 0))) / 1e9

    return {"per_token_kb": per_token / 1e3, "gpu_gb": total_bytes / 1e9,
            "one_gpu_gb": gb(seq, False, False), "one_gpu_ckpt_gb": gb(seq, True, False),
            "rank_gb": gb(seq // ranks, False, True),
            "rank_ckpt_gb": gb(seq // ranks, True, True)}


# ---- the workers ------------------------------------------------------------------------------


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _setup(opts: dict, rank: int) -> torch.device:
    # the fp32 reference is fp32 all through: no TF32 matmuls
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    register()
    if opts["device"] == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // opts["ranks"]))
    return torch.device("cpu")


def run_check(rank: int, opts: dict, device: torch.device) -> dict | None:
    preset, seq, steps = PRESETS[opts["preset"]], opts["seq"], opts["steps"]
    chunk, lr, plant = opts["chunk"], opts["lr"], opts["plant"]
    model = build_model(preset, seq, device, opts["seed"])
    ids = make_sequence(preset.vocab, seq, opts["seed"])

    cp_model = variant(model, torch.bfloat16, RING, opts["checkpoint"] == "on")
    cp = train(cp_model, shard_batch(ids, device, plant), steps, lr, cp=True, record_first=True,
               chunk=chunk, plant=plant)
    agree = replicas_agree(cp_model)
    del cp_model
    peaks = [None] * opts["ranks"]
    dist.all_gather_object(peaks, cp.peak_bytes)
    result = None
    if rank == 0:  # the single-process runs, on rank 0 while the others wait
        if device.type == "cuda":
            torch.cuda.empty_cache()
        whole = whole_batch(ids, device)
        runs = {}
        for label, dtype, attn, n in (("ref", torch.float32, REF, 1),
                                      ("one", torch.bfloat16, ONE, steps),
                                      ("sdpa", torch.bfloat16, "sdpa", steps)):
            m = variant(model, dtype, attn)
            runs[label] = train(m, whole, n, lr, cp=False, record_first=True, chunk=chunk)
            del m
            if device.type == "cuda":
                torch.cuda.empty_cache()
        checks = first_step_checks(runs["ref"], runs["one"], runs["sdpa"], cp,
                                   opts["grad_floor"], opts["out_floor"])
        curve = curve_check(cp.losses, runs["one"].losses, runs["sdpa"].losses,
                            opts["curve_tol"])
        result = {
            "pass": all(c.ok for c in checks) and curve["ok"] and agree,
            "replicas_agree": agree,
            "checks": [{**asdict(c), "bound": c.bound, "ok": c.ok} for c in checks],
            "curve": curve,
            "losses": {"cp": cp.losses, "one": runs["one"].losses,
                       "sdpa": runs["sdpa"].losses, "fp32": runs["ref"].losses},
            "step_s": {"cp": cp.step_s, "one": runs["one"].step_s},
            "peak_gb": {"cp_per_rank": [p / 1e9 for p in peaks],
                        "one": runs["one"].peak_bytes / 1e9},
            "n_params": sum(p.numel() for p in model.parameters()),
            "device": _device_name(device),
        }
    if device.type == "cuda":
        dist.barrier(device_ids=[rank])
    else:
        dist.barrier()
    return result


def run_long(rank: int, opts: dict, device: torch.device) -> dict | None:
    preset, seq, ranks, chunk = PRESETS[opts["preset"]], opts["seq"], opts["ranks"], opts["chunk"]
    master = build_model(preset, seq, device, opts["seed"])
    n_params = sum(p.numel() for p in master.parameters())
    model = variant(master, torch.bfloat16, RING)
    del master

    # saved activations per token, measured on a short sequence through the same ring
    probe = min(seq, 2 * ranks * 512)
    per_token = torch.tensor([saved_bytes_per_token(
        model, shard_batch(make_sequence(preset.vocab, probe, opts["seed"]), device))],
        device=device)
    dist.all_reduce(per_token, op=dist.ReduceOp.MAX)
    total_bytes = (torch.cuda.get_device_properties(device).total_memory
                   if device.type == "cuda" else 0)
    est = memory_estimate(preset, n_params, per_token.item(), seq, ranks, total_bytes)
    ckpt = opts["checkpoint"] == "on" or (opts["checkpoint"] == "auto" and total_bytes > 0
                                          and est["rank_gb"] > 0.8 * est["gpu_gb"])
    if ckpt:
        checkpoint_layers(model)
    if rank == 0:
        print(f"{seq} tokens over {ranks} ranks: estimated {est['rank_gb']:.0f} GB a rank "
              f"(one GPU: {est['one_gpu_gb']:.0f} GB, {est['one_gpu_ckpt_gb']:.0f} GB "
              f"checkpointed; the GPU has {est['gpu_gb']:.0f}), per-layer checkpointing "
              f"{'on' if ckpt else 'off'}; {opts['steps']} steps", flush=True)

    ids = make_sequence(preset.vocab, seq, opts["seed"])
    run = train(model, shard_batch(ids, device), opts["steps"], opts["lr"], cp=True,
                record_first=False, chunk=chunk, progress=rank == 0)
    agree = replicas_agree(model)
    per_rank = [None] * ranks
    dist.all_gather_object(per_rank, (run.peak_bytes, run.step_s))
    if rank != 0:
        return None
    step_s = [max(r[1][i] for r in per_rank) for i in range(len(run.step_s))]  # slowest rank
    return {"pass": all(math.isfinite(x) for x in run.losses) and agree,
            "replicas_agree": agree, "estimate": est,
            "checkpoint": ckpt, "losses": run.losses, "step_s": step_s,
            "peak_gb": [r[0] / 1e9 for r in per_rank], "n_params": n_params,
            "matmul_params": n_params - model.model.embed_tokens.weight.numel(),
            "device": _device_name(device)}


def worker(rank: int, opts: dict, port: int, out_path: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (DESIGN.md)
    device = _setup(opts, rank)
    TRANSPORT[0] = opts["transport"]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                            world_size=opts["ranks"])
    try:
        result = (run_check if opts["mode"] == "check" else run_long)(rank, opts, device)
    except BaseException:  # any failure ends this rank at once, loudly
        # Its traceback now: the other ranks may be waiting in a collective for this one, and
        # destroy_process_group (or the interpreter's exit) could then wait for them forever.
        # mp.spawn sees the exit code and ends the others.
        traceback.print_exc()
        print(f"rank {rank}: failed (above); ending without waiting for the other ranks",
              file=sys.stderr, flush=True)
        os._exit(1)
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()


# ---- the report -------------------------------------------------------------------------------


def _header(opts: dict, result: dict, device_name: str) -> str:
    p, s, ranks = PRESETS[opts["preset"]], opts["seq"], opts["ranks"]
    return (f"{ranks} ranks ({'nccl' if opts['device'] == 'cuda' else 'gloo'}, {device_name}); "
            f"Llama {p.layers} layers, hidden {p.hidden}, {p.heads} query / {p.kv_heads} KV "
            f"heads x d {p.head_dim}, vocab {p.vocab}, {result['n_params'] / 1e6:.1f} M "
            f"parameters, bf16; one sequence of {s} tokens, {s // ranks} a rank (zigzag "
            f"chunks r and {2 * ranks - 1}-r of {2 * ranks}); AdamW lr {opts['lr']}, "
            f"{opts['steps']} steps")


def report_check(opts: dict, result: dict, device_name: str, worst: int) -> None:
    print("CP training check: " + _header(opts, result, device_name))
    checks = result["checks"]
    grads = checks[1:]
    print("\nfirst step against fp32 (one process, fp32 weights and reference attention); rule "
          "err(cp) <= 2 err(one) + floor")
    print(f"  {sum(c['ok'] for c in grads)} of {len(grads)} parameter gradients pass; the "
          "token losses, then the gradients worst first:")
    print(f"  {'tensor':<46} {'err sdpa':>9} {'err one':>9} {'err cp':>9} {'of bound':>8}")
    ranked = sorted(grads, key=lambda c: c["err_cp"] / c["bound"] if c["bound"] else math.inf,
                    reverse=True)
    for c in [checks[0], *ranked[:worst]]:
        of = c["err_cp"] / c["bound"] if c["bound"] else math.inf
        print(f"  {c['name']:<46} {c['err_sdpa']:9.2e} {c['err_one']:9.2e} {c['err_cp']:9.2e} "
              f"{of:8.2f} {'' if c['ok'] else 'FAIL'}")
    curve, losses = result["curve"], result["losses"]
    print(f"\nloss per step; rule max|cp - one| <= 2 max|sdpa - one| + {opts['curve_tol']} x "
          f"loss_1: {curve['gap_cp']:.2e} <= {curve['bound']:.2e} "
          f"{'ok' if curve['ok'] else 'FAIL'} (max|sdpa - one| {curve['gap_sdpa']:.2e})")
    print(f"  {'step':>4} {'one':>9} {'sdpa':>9} {'cp':>9} {'cp-one':>9} {'sdpa-one':>9}")
    for i, (o, s, c) in enumerate(zip(losses["one"], losses["sdpa"], losses["cp"]), 1):
        print(f"  {i:>4} {o:9.5f} {s:9.5f} {c:9.5f} {c - o:+9.2e} {s - o:+9.2e}")
    print(f"  (fp32 first loss {losses['fp32'][0]:.5f})")
    t_cp, t_one = (statistics.median(result["step_s"][k][1:] or result["step_s"][k])
                   for k in ("cp", "one"))
    print(f"  median step (wall clock, after step 1): cp {t_cp * 1e3:.1f} ms, one process "
          f"{t_one * 1e3:.1f} ms")
    if opts["device"] == "cuda":
        peaks = ", ".join(f"{g:.2f}" for g in result["peak_gb"]["cp_per_rank"])
        print(f"  peak memory GB: cp per rank {peaks}; one process {result['peak_gb']['one']:.2f}")
    print(f"  replicas identical after the steps: {'yes' if result['replicas_agree'] else 'NO'}")
    failed = ([c["name"] for c in checks if not c["ok"]] + ([] if curve["ok"] else ["loss curve"])
              + ([] if result["replicas_agree"] else ["replicas"]))
    print(f"\nRESULT: {'PASS' if result['pass'] else 'FAIL'}"
          + ("" if result["pass"] else f" ({len(failed)} failed, first: {failed[0]})"))


def report_long(opts: dict, result: dict, device_name: str) -> None:
    p, seq, ranks = PRESETS[opts["preset"]], opts["seq"], opts["ranks"]
    print("CP training, long sequence: " + _header(opts, result, device_name))
    est = result["estimate"]
    print(f"\nmemory estimate: saved activations {est['per_token_kb']:.1f} KB a token (all "
          f"{p.layers} layers; measured: the tensors a forward keeps for the backward) + about "
          "one layer's more in the backward + 8 bytes a parameter (bf16 weights, gradients, "
          "AdamW states) + 4 on a rank (fp32 gradient sum)")

    def fits(gb: float) -> str:
        if not est["gpu_gb"]:
            return ""
        return " fits" if gb < est["gpu_gb"] else " does NOT fit"

    print(f"  one GPU, {seq} tokens: {est['one_gpu_gb']:.1f} GB{fits(est['one_gpu_gb'])}; "
          f"with per-layer checkpointing {est['one_gpu_ckpt_gb']:.1f} GB"
          f"{fits(est['one_gpu_ckpt_gb'])}" + (f" (GPU memory {est['gpu_gb']:.1f} GB)"
                                               if est["gpu_gb"] else ""))
    print(f"  one of {ranks} ranks, {seq // ranks} tokens: {est['rank_gb']:.1f} GB; with "
          f"checkpointing {est['rank_ckpt_gb']:.1f} GB -> per-layer activation checkpointing "
          f"{'ON' if result['checkpoint'] else 'off'} (--checkpoint {opts['checkpoint']})")
    peaks = ", ".join(f"{g:.1f}" for g in result["peak_gb"])
    if opts["device"] == "cuda":
        print(f"  measured peak memory per GPU (max_memory_allocated): {peaks} GB")
    print(f"\n  {'step':>4} {'loss':>9} {'time s':>8} {'tokens/s':>10}")
    for i, (loss, t) in enumerate(zip(result["losses"], result["step_s"]), 1):
        print(f"  {i:>4} {loss:9.5f} {t:8.3f} {seq / t:10.0f}")
    times = result["step_s"][1:] or result["step_s"]
    t = statistics.median(times)
    attn = 3.5 * 2 * p.heads * seq * seq * p.head_dim * p.layers  # causal fwd + bwd (2.5x)
    dense = 6 * result["matmul_params"] * seq
    print(f"  median step (steps 2-{len(result['step_s'])}, slowest rank, wall clock with "
          f"synchronize): {t:.3f} s, {seq / t:.0f} tokens/s ({seq / t / ranks:.0f} a GPU), "
          f"{(attn + dense) / t / ranks / 1e12:.1f} model TFLOP/s a GPU (6 x matmul params x "
          f"tokens + causal attention fwd+bwd; recompute not counted)")
    print(f"  replicas identical after the steps: {'yes' if result['replicas_agree'] else 'NO'}")
    print(f"\nRESULT: {'PASS' if result['pass'] else 'FAIL (a loss not finite or replicas apart)'}")


# ---- the command line -------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true",
                      help="the P-rank run against one process on a short sequence")
    mode.add_argument("--long", type=int, metavar="S", help="train on S tokens over the ranks")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda (NCCL, one process a GPU) or cpu (gloo); default cuda if present")
    p.add_argument("--ranks", type=int, default=None,
                   help="processes (default: every GPU; 2 on cpu)")
    p.add_argument("--seq", type=int, default=None,
                   help="--check's sequence length (default 8192 cuda, 64 cpu)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="the model (default gpu on cuda, tiny on cpu)")
    p.add_argument("--steps", type=int, default=None,
                   help="AdamW steps (default: --check 4 cuda, 3 cpu; --long 3)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", choices=("auto", "on", "off"), default="auto",
                   help="per-layer activation checkpointing of the P-rank run: auto is off for "
                   "--check, on for --long where the estimate exceeds 80%% of a GPU")
    p.add_argument("--transport", choices=("push", "pull", "auto"), default="push",
                   help="the ring's transfers (ring_attention's transport)")
    p.add_argument("--chunk", type=int, default=8192,
                   help="tokens per chunk of the LM head + loss (checkpointed)")
    p.add_argument("--grad-floor", type=float, default=1e-4,
                   help="floor of a gradient's bound, fraction of max|reference gradient|")
    p.add_argument("--out-floor", type=float, default=1e-4,
                   help="floor of the token losses' bound, fraction of the largest")
    p.add_argument("--curve-tol", type=float, default=1e-3,
                   help="loss-curve allowance beyond 2x the calibration, fraction of loss_1")
    p.add_argument("--worst", type=int, default=6, help="parameters listed, worst first")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--plant", choices=PLANTS, default=None, help=argparse.SUPPRESS)  # tests only
    return p.parse_args(argv)


def _options(args) -> tuple[dict | None, str]:
    """The workers' options, or None and the usage error."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            return None, "--device cuda: no CUDA device here (--device cpu runs the harness)"
        gpus = torch.cuda.device_count()
        ranks = args.ranks or gpus
        if ranks > gpus:
            return None, f"--ranks {ranks}: {gpus} GPU(s) here"
    else:
        ranks = args.ranks or 2
    if ranks < 2:
        return None, f"context parallelism needs 2 or more ranks, got {ranks}"
    mode = "check" if args.check else "long"
    seq = args.long if mode == "long" else (args.seq or (8192 if device == "cuda" else 64))
    if mode == "long" and args.seq:
        return None, "--seq is --check's length; --long S gives the long run's"
    if seq <= 0 or seq % (2 * ranks):
        return None, (f"a sequence of {seq} tokens does not split into {2 * ranks} equal chunks "
                      f"({ranks} ranks x 2)")
    steps = args.steps or (3 if mode == "long" or device == "cpu" else 4)
    if steps < 1 or args.chunk < 1:
        return None, "--steps and --chunk must be positive"
    opts = {"mode": mode, "device": device, "ranks": ranks, "seq": seq, "steps": steps,
            "preset": args.preset or ("gpu" if device == "cuda" else "tiny"), "lr": args.lr,
            "seed": args.seed, "checkpoint": args.checkpoint, "chunk": args.chunk,
            "grad_floor": args.grad_floor, "out_floor": args.out_floor,
            "curve_tol": args.curve_tol, "plant": args.plant, "transport": args.transport}
    return opts, ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("transformers is not installed (pip install transformers)", file=sys.stderr)
        return 2
    opts, error = _options(args)
    if opts is None:
        print(error, file=sys.stderr)
        return 2
    if opts["device"] == "cuda":
        import flash_attention as fa

        if not fa.is_built():
            print("flash_attention._C is not built (pip install --no-build-isolation -e .)",
                  file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        try:
            mp.spawn(worker, args=(opts, _free_port(), str(out)), nprocs=opts["ranks"],
                     join=True)
        except Exception as exc:  # a worker raised: its traceback is in the message
            print(f"ERROR: a worker failed: {exc}", file=sys.stderr)
            print("\nRESULT: FAIL (a worker failed)")
            return 1
        result = json.loads(out.read_text())
    device_name = result["device"]
    if opts["mode"] == "check":
        report_check(opts, result, device_name, args.worst)
    else:
        report_long(opts, result, device_name)
    if args.json:
        args.json.write_text(json.dumps({
            "options": opts, "device": device_name, "torch": torch.__version__,
            "transformers": transformers.__version__, **result}, indent=1) + "\n")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
