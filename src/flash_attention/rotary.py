"""Rotary position embedding as flash_attn applies it to a KV-cache call: the first rotary_dim
= 2 * cos.shape[-1] features of each head rotate by the angles of their row's position, the rest
pass through. ``interleaved=True`` rotates the pairs (0, 1), (2, 3), ... (GPT-J style);
``interleaved=False`` the halves (i, i + rotary_dim / 2) (GPT-NeoX style). Plain torch: the
reference and the checks use it on any device."""

from __future__ import annotations

import torch


def rotary_dim(cos: torch.Tensor) -> int:
    return 2 * cos.shape[-1]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (batch, seq, heads, d) rotated at positions (batch, seq) (rows of cos and sin, each
    (seqlen_ro, rotary_dim / 2)); computed in fp32, returned in x's dtype."""
    rd = rotary_dim(cos)
    c = cos[positions].float()[:, :, None, :]  # (batch, seq, 1, rd / 2)
    s = sin[positions].float()[:, :, None, :]
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., rd:]), dim=-1)
