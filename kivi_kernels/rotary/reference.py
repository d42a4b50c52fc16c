"""PyTorch reference for the rotary embedding (the spec and the CPU path): same signature as ops.apply_rotary.

x_out = x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1] (halves of the head dim), math in fp32,
each product and the sum rounded to x's dtype: transformers' apply_rotary_pos_emb with unsqueeze_dim=1.
"""

from __future__ import annotations

import torch

from .ops import check_rotary_args


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D], cos/sin [B, 1, T, D] fp32 -> [B, H, T, D] in x.dtype."""
    rnd = lambda t: t.to(x.dtype).float()
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (rnd(x32 * cos) + rnd(rotated * sin)).to(x.dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, T, D], k [B, Hk, T, D], cos/sin [B, T, D] -> (q_out, k_out), shapes and dtypes of q and k."""
    check_rotary_args(q, k, cos, sin)
    cos32, sin32 = cos.float()[:, None], sin.float()[:, None]
    return _rotate(q, cos32, sin32), _rotate(k, cos32, sin32)
