"""Typed launcher for the rotary kernel. Shapes: B batch rows, Hq/Hk query/key heads, T positions, D head_dim."""

from __future__ import annotations

import torch
import triton

from .kernel import rotary_kernel

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_rotary_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q [B, Hq, T, D], k [B, Hk, T, D], cos/sin [B, T, D]; one dtype and device; D even. Raises on bad input."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != q.dtype or t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be fp16/bf16/fp32 like q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, H, T, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, _, T, D = q.shape
    if k.shape[0] != B or k.shape[2:] != (T, D):
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in B, T or D")
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (B, T, D):
            raise ValueError(f"{name} must be [B, T, D] = {(B, T, D)}, got {tuple(t.shape)}")


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, T, D], k [B, Hk, T, D], cos/sin [B, T, D] -> (q_out, k_out), new tensors laid out as q and k."""
    check_rotary_args(q, k, cos, sin)
    B, Hq, T, D = q.shape
    Hk = k.shape[1]
    if D & (D - 1):
        raise ValueError(f"the rotary kernel takes a power-of-two head_dim, got {D}")
    if B * T == 0:
        return torch.empty_like(q), torch.empty_like(k)
    inputs = [t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, cos, sin)]
    q, k, cos, sin = inputs
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)  # same strides as q and k (dense layouts)
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin), ("q_out", q_out), ("k_out", k_out)):
        if sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) >= 2**31:
            raise ValueError(f"rotary offsets are int32: {name} {tuple(t.shape)} reaches too far, split the call")
    for name, t in (("q_out", q_out), ("k_out", k_out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    rotary_kernel[(B * T,)](
        q_ptr=q, k_ptr=k, cos_ptr=cos, sin_ptr=sin, q_out_ptr=q_out, k_out_ptr=k_out,
        seq_len=T, n_q_heads=Hq, n_k_heads=Hk,
        stride_q_b=q.stride(0), stride_q_h=q.stride(1), stride_q_t=q.stride(2),
        stride_k_b=k.stride(0), stride_k_h=k.stride(1), stride_k_t=k.stride(2),
        stride_cos_b=cos.stride(0), stride_cos_t=cos.stride(1), stride_sin_b=sin.stride(0), stride_sin_t=sin.stride(1),
        stride_qo_b=q_out.stride(0), stride_qo_h=q_out.stride(1), stride_qo_t=q_out.stride(2),
        stride_ko_b=k_out.stride(0), stride_ko_h=k_out.stride(1), stride_ko_t=k_out.stride(2),
        HALF=D // 2, BLOCK_HQ=triton.next_power_of_2(Hq), BLOCK_HK=triton.next_power_of_2(Hk),
        num_warps=4 if Hq * D <= 4096 else 8,
        enable_fp_fusion=False,  # no fused multiply-add: fp32 results match torch's separate mul and add
    )
    return q_out, k_out
