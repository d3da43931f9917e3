"""A kernel config beside the block-by-block Python emulation of the algorithm, on small
inputs: reports the first (batch, head, query block, row) whose output or LSE departs from the
emulation, with the values, and the emulation's running max and sum of that row after each KV
block. GPU only."""

from __future__ import annotations

from dataclasses import dataclass

TOLERANCE = {"fp16": 2e-3, "bf16": 1.6e-2}  # |out - emulation| per element, by input dtype


@dataclass
class Mismatch:
    batch: int
    head: int
    q_block: int
    row: int  # row within the query block
    out: list[float]
    expected: list[float]
    lse: float
    expected_lse: float
    trace: list[tuple[int, float, float]]  # (kv block, m, l) of the emulation for this row


def run(config: str, batch: int = 1, seqlen_q: int = 200, seqlen_k: int = 300, heads: int = 2,
        seed: int = 0) -> tuple[int, Mismatch | None]:
    """(rows compared, first mismatch or None). A kernel with masks runs causal, a softcap
    kernel with softcap 1.5; the emulation does the same."""
    import torch

    import flash_attention as fa

    cfg = fa.parse(config)
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[cfg.dtype]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(batch, s, heads, cfg.d_head, device="cuda", dtype=dt, generator=gen)
               for s in (seqlen_q, seqlen_k, seqlen_k))
    features = {"causal": cfg.mask, "softcap": 1.5 if cfg.softcap else 0.0}
    out, lse = fa.attention(q, k, v, config=cfg, return_lse=True, **features)
    # The sm90 family always visits KV blocks from the last to the first.
    reverse = cfg.reverse_kv if cfg.family == "sm80" else True
    emu = fa.emulate_blocks(q, k, v, cfg.block_r, cfg.block_c, reverse, trace=True, **features)
    tol = TOLERANCE[cfg.dtype]
    rows = 0
    for b in range(batch):
        for h in range(heads):
            for row in range(seqlen_q):
                rows += 1
                got, want = out[b, row, h].float(), emu.out[b, row, h]
                lse_got, lse_want = lse[b, h, row].item(), emu.lse[b, h, row].item()
                bad = (not torch.isfinite(got).all() or (got - want).abs().max().item() > tol
                       or abs(lse_got - lse_want) > 1e-3 * max(1.0, abs(lse_want)))
                if bad:
                    qb, r = divmod(row, cfg.block_r)
                    trace = [(t.kv_block, t.m[r].item(), t.l[r].item()) for t in emu.trace
                             if t.batch == b and t.head == h and t.q_block == qb]
                    return rows, Mismatch(b, h, qb, r, got[:8].tolist(), want[:8].tolist(),
                                          lse_got, lse_want, trace)
    return rows, None
