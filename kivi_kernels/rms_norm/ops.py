"""Typed launcher for the RMSNorm kernel. Shapes: x [..., N] (M rows once flattened), weight [N]."""

from __future__ import annotations

import torch
import triton

from .kernel import rms_norm_kernel

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_COLS = 16384  # one row per tile: wider rows would need a looped reduction


def check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.dtype:
    """Validate; returns the output dtype (promote(x.dtype, weight.dtype), as torch's product gives)."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be fp16/bf16/fp32, got {t.dtype} (shape {tuple(t.shape)})")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must be [..., N] with N >= 1, got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if not isinstance(eps, float) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    return torch.promote_types(x.dtype, weight.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> out [..., N] (contiguous) in promote(x.dtype, weight.dtype)."""
    out_dtype = check_rms_norm_args(x, weight, eps)
    n_cols = x.shape[-1]
    if n_cols > MAX_COLS:
        raise ValueError(f"rms_norm takes rows of at most {MAX_COLS} elements, got {n_cols}")
    if not weight.is_contiguous():
        weight = weight.contiguous()
    x2 = x.reshape(-1, n_cols)  # a view for the usual layouts, a copy otherwise
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    n_rows = x2.shape[0]
    if n_rows and (n_rows - 1) * x2.stride(0) + n_cols >= 2**31 or x2.numel() >= 2**31:
        raise ValueError(f"rms_norm offsets are int32: {n_rows} rows of stride {x2.stride(0)} reach too far, "
                         "split the call")
    if n_rows == 0:
        return out
    block_n = triton.next_power_of_2(n_cols)
    block_m = max(1, min(16, 2048 // block_n, triton.next_power_of_2(n_rows)))
    rms_norm_kernel[(triton.cdiv(n_rows, block_m),)](
        x_ptr=x2, weight_ptr=weight, out_ptr=out, n_rows=n_rows, n_cols=n_cols, eps=eps,
        stride_x_row=x2.stride(0), stride_out_row=n_cols,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=min(16, max(1, block_m * block_n // 512)),
    )
    return out
