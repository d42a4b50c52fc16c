"""Launcher of version 27's ring pass (kernel_ring.py): the full-precision ring's share of a decode-attention
call as a normalized fp32 partial and its base-2 log-sum-exp, which the split merge joins with the tensor-core
kernel's partials (ops_mma.launch_mma with ring_pass: one more split). Same signature as reference.ring_partial,
the spec."""

from __future__ import annotations

import math

import torch

from . import common as C
from .kernel_ring import _ring_partial_kernel

_OP = "ring_partial"
# ring slots a step and warps a program: beside the tensor-core kernel 32 x 2 was 0-3% faster than the paged bf16
# kernel's 64 x 4 (ring-pass-20261201-h200-stream-forms.json)
RING_BLOCK_N = 32
RING_WARPS = 2


def ring_partial(
    q: torch.Tensor,
    k_res: torch.Tensor,
    v_res: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    group_size: int,
    residual_length: int,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D] against the ring slots of rows slots[b] (k_res, v_res [S, H, R, D]) that hold tokens
    [nq, L) of seq_lens[b] = L -> (o [B, Hq, D] fp32, normalized over those tokens; lse [B, Hq] fp32, the base-2
    log-sum-exp of the scaled scores, -inf where a row's ring is empty). out, lse: optional buffers to write."""
    out, lse = check_ring_args(q, k_res, v_res, slots, seq_lens, group_size, residual_length, out, lse)
    return launch_ring_partial(q, k_res, v_res, slots, seq_lens, out, lse, sm_scale, group_size, residual_length,
                               block_n=block_n, num_warps=num_warps)


def check_ring_args(q, k_res, v_res, slots, seq_lens, group_size, residual_length, out, lse):
    """Shapes, dtypes and devices (ValueError/TypeError naming the bad tensor); the output buffers, made where
    not given."""
    C.check_int(_OP, "group_size", group_size)
    C.check_int(_OP, "residual_length", residual_length)
    C.check_tensor(_OP, "q", q, (-1, -1, -1), C.FLOAT_DTYPES)
    batch, q_heads, head_dim = q.shape
    C.check_tensor(_OP, "k_res", k_res, (-1, -1, residual_length, head_dim), C.FLOAT_DTYPES)
    C.check_tensor(_OP, "v_res", v_res, tuple(k_res.shape), (k_res.dtype,))
    if k_res.stride() != v_res.stride():
        raise ValueError(f"{_OP}: k_res and v_res must share strides, got {k_res.stride()} and {v_res.stride()}")
    kv_heads = k_res.shape[1]
    if not C.is_pow2(head_dim) or head_dim < 16 or kv_heads <= 0 or q_heads % kv_heads:
        raise ValueError(f"{_OP}: q [B, Hq, D] has shape {list(q.shape)}; D must be a power of two >= 16 and Hq a "
                         f"multiple of the {kv_heads} KV heads of k_res (shape {list(k_res.shape)})")
    C.check_tensor(_OP, "slots", slots, (batch,), (torch.int32,))
    C.check_tensor(_OP, "seq_lens", seq_lens, (batch,), (torch.int32,))
    if out is None:
        out = torch.empty((batch, q_heads, head_dim), dtype=torch.float32, device=q.device)
    if lse is None:
        lse = torch.empty((batch, q_heads), dtype=torch.float32, device=q.device)
    C.check_tensor(_OP, "out", out, (batch, q_heads, head_dim), (torch.float32,))
    C.check_tensor(_OP, "lse", lse, (batch, q_heads), (torch.float32,))
    C.check_device(_OP, dict(q=q, k_res=k_res, v_res=v_res, slots=slots, seq_lens=seq_lens, out=out, lse=lse))
    return out, lse


def launch_ring_partial(q, k_res, v_res, slots, seq_lens, out, lse, sm_scale, group_size, residual_length,
                        block_n: int | None = None, num_warps: int | None = None):
    """The launch itself (arguments checked by the caller; out and lse may be views with strided rows and heads):
    grid common.decode_grid(B, H, 1)'s first two dimensions."""
    batch, q_heads, head_dim = q.shape
    if batch == 0:
        return out, lse
    kv_heads = k_res.shape[1]
    qg = q_heads // kv_heads
    block_n = min(RING_BLOCK_N, max(16, C.triton_next_pow2(residual_length))) if block_n is None else block_n
    if not C.is_pow2(block_n) or block_n < 16:
        raise ValueError(f"{_OP}: block_n={block_n} must be a power of two >= 16")
    num_warps = RING_WARPS if num_warps is None else num_warps
    C.check_int(_OP, "num_warps", num_warps, (1, 2, 4, 8))
    dot_dtype, precision = C.dot_config(q.dtype, k_res.dtype)
    grid, row_major = C.decode_grid(batch, kv_heads, 1)
    _ring_partial_kernel[grid[:2]](
        q, k_res, v_res, slots, seq_lens, out, lse,
        qk_scale=float(sm_scale) * math.log2(math.e),
        stride_q_b=q.stride(0), stride_q_h=q.stride(1),
        stride_res_s=k_res.stride(0), stride_res_h=k_res.stride(1), stride_res_t=k_res.stride(2),
        stride_o_b=out.stride(0), stride_o_h=out.stride(1), stride_lse_b=lse.stride(0), stride_lse_h=lse.stride(1),
        GROUP=group_size, RESIDUAL=residual_length, HEAD_DIM=head_dim, QG=qg, QG_PAD=max(16, C.triton_next_pow2(qg)),
        BLOCK_N=block_n, USE_DOT=True, DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision, ROW_MAJOR=row_major,
        num_warps=num_warps,
    )
    return out, lse
