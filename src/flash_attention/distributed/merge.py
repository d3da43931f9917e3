"""Merging partial attention results by their LSEs, in fp32: two results over disjoint key sets,
(out_a, lse_a) and (out_b, lse_b), are one over their union with lse = log(e^lse_a + e^lse_b)
and out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse). A row that saw no key in either (both
-inf) stays out 0, lse -inf."""

from __future__ import annotations

import torch


def merge_partials(out: torch.Tensor | None, lse: torch.Tensor | None, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, S, H, D), lse (B, H, S); out/lse None: the first partial (returned in fp32)."""
    out_b, lse_b = out_b.float(), lse_b.float()
    if out is None or lse is None:
        return out_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    finite = torch.isfinite(new)
    safe = torch.where(finite, new, torch.zeros_like(new))
    w_a = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(new))
    w_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(new))
    # (B, H, S) weights on (B, S, H, D) outputs
    merged = out * w_a.transpose(1, 2)[..., None] + out_b * w_b.transpose(1, 2)[..., None]
    return merged, new


def merge_into(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
               assign: bool = False) -> None:
    """merge_partials in place: (out, lse), fp32 (views allowed), become the merge of themselves
    and (out_b, lse_b); assign: become (out_b, lse_b) (rows nothing has reached yet, whatever
    out and lse hold). CUDA tensors: one pass of the package's kernel
    (flash_attention::merge_partials_); others: the torch math above."""
    if out.is_cuda:
        from .. import ops

        ops.require()
        torch.ops.flash_attention.merge_partials_.default(out, lse, out_b, lse_b, assign)
        return
    merged, new = merge_partials(None if assign else out, None if assign else lse, out_b, lse_b)
    out.copy_(merged)
    lse.copy_(new)
