"""PyTorch reference for SiLU-and-multiply (the spec and the CPU path): same signature as ops.silu_mul.

out = round(round(silu(gate)) * up) with gate = gate_up[..., :N], up = gate_up[..., N:], math in fp32, each
round to gate_up's dtype: transformers' `act_fn(gate_proj(x)) * up_proj(x)` for the SwiGLU MLPs of Llama,
Mistral, Qwen2 and Qwen3 when the two products are one (kivi.fused's fused projections).
"""

from __future__ import annotations

import torch

from .ops import check_silu_mul_args


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 N] -> out [..., N] in gate_up's dtype."""
    n_cols = check_silu_mul_args(gate_up)
    gate, up = gate_up.float().split(n_cols, dim=-1)
    act = torch.nn.functional.silu(gate).to(gate_up.dtype).float()
    return (act * up).to(gate_up.dtype)
