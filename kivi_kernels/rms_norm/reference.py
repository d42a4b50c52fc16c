"""PyTorch reference for RMSNorm (the spec and the CPU path): same signature as ops.rms_norm.

out = weight * round_x(x * rsqrt(mean(x^2) + eps)), math in fp32, round_x rounding to x's dtype, the
product rounded once to promote(x.dtype, weight.dtype): transformers' LlamaRMSNorm (and Mistral's,
Qwen2's, Qwen3's, which are copies of it).
"""

from __future__ import annotations

import torch

from .ops import check_rms_norm_args


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> out [..., N] in promote(x.dtype, weight.dtype)."""
    out_dtype = check_rms_norm_args(x, weight, eps)
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = (x32 * rstd).to(x.dtype).float()
    return (x_hat * weight.float()).to(out_dtype)
