"""Launcher of the Gluon FMA decode-attention kernel (kernel_gluon.py): 2-bit MHA caches, on a GPU.

ops.decode_attention calls launch_fma by default where fma_eligible holds and the call is large enough
(FMA_MIN_WORK); the measurements behind the constants are in benchmarks/results/kernel_notes.md, version 11.
"""

from __future__ import annotations

import math

import torch

from . import common as C

try:  # Gluon (Triton's explicit-layout dialect) ships with triton >= 3.5; it has no interpreter mode
    from .kernel_gluon import _decode_attention_fma_kernel
except ImportError:  # pragma: no cover - older triton
    _decode_attention_fma_kernel = None

_OP = "decode_attention"

# The Gluon FMA kernel (kernels-20261129-h200-sweep-fma-regs.json): 64-token steps capped at 128 registers (16
# one-warp programs per SM, a few spills) beat 128-token steps at the compiler's 255 by 1.2-1.4x
FMA_BLOCK_N = 64  # tokens per step
FMA_MAXNREG = 128  # register cap per thread
FMA_PER_SM = 32  # programs per SM its split count aims for
# below this many (KV row x token) pairs per call the tensor-core table measured faster (kernels-20261129-h200-
# fma64.json: 17.6 vs 7.7 us at B=1, L=512, 28 vs 22 us at B=1, L=4,096, 23 vs 21 us at B=8, L=512; the FMA
# kernel is 1.24-2.2x faster from B=1, L=32,768, B=8, L=4,096 and B=64, L=512 up). Counted with max_tokens,
# the block table's capacity: that bench's tables are padded to 16 pages, so B=8, L=512 counts 256 x 2,176
# = 557k pairs and B=1, L=32,768 counts 1.05M
FMA_MIN_WORK = 1 << 20


def fma_eligible(q: torch.Tensor, k_bits: int, v_bits: int, group_size: int, residual_length: int,
                 page_size: int, qg: int) -> bool:
    """Whether the Gluon FMA kernel (kernel_gluon.py) can run this call: compiled (not the interpreter),
    2-bit keys and values, one query head per KV head, head_dim 128, pages of whole 128-token blocks."""
    return (_decode_attention_fma_kernel is not None and not C.interpreting() and q.is_cuda
            and k_bits == v_bits == 2 and qg == 1 and q.shape[-1] == 128 and page_size % 128 == 0
            and 16 <= group_size <= 128 and residual_length % 32 == 0)


def fma_by_default(rows: int, max_tokens: int, eligible: bool) -> bool:
    """The launcher's default: the FMA kernel for eligible calls of at least FMA_MIN_WORK (KV row x token)
    pairs; rows = batch * KV heads, max_tokens = the block table's capacity plus the residual ring."""
    return eligible and rows * max_tokens >= FMA_MIN_WORK


def launch_fma(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, block_table, slots, seq_lens,
                out, sm_scale, group_size, residual_length, page_size, num_splits, max_tokens, block_n,
                maxnreg) -> torch.Tensor:
    """The Gluon FMA kernel: grid (B, H, num_splits) of one-warp programs, then the split merge."""
    batch, heads, _ = q.shape
    C.check_int(_OP, "block_n", block_n, (64, 128))
    if page_size % block_n:
        raise ValueError(f"{_OP}: the fma kernel's block_n={block_n} must divide page_size={page_size}")
    if maxnreg is not None:
        C.check_int(_OP, "maxnreg", maxnreg, tuple(range(64, 256, 8)) + (255,))
    if num_splits is None:
        num_splits = C.choose_num_splits(batch * heads, max_tokens, q.device, programs_per_sm=FMA_PER_SM,
                                         max_splits=C.ONE_WARP_MAX_SPLITS)
    C.check_int(_OP, "num_splits", num_splits)
    o, lse, o_strides, workspace = C.output_args(out, num_splits)
    _decode_attention_fma_kernel[(batch, heads, num_splits)](
        q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, block_table, slots, seq_lens, o, lse,
        qk_scale=float(sm_scale) * math.log2(math.e), num_splits=num_splits,
        **C.input_strides(q, k_codes, k_scale, v_codes, v_scale, k_res, block_table), **o_strides,
        GROUP=group_size, RESIDUAL=residual_length, PAGE=page_size, SPLIT=num_splits > 1, BLOCK_N=block_n,
        num_warps=1, **({} if maxnreg is None else dict(maxnreg=maxnreg)),
    )
    if workspace is not None:
        C.merge_splits(*workspace, out)
    return out
