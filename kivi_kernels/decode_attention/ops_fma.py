"""Launcher of the Gluon FMA decode-attention kernel (kernel_gluon.py): 2-bit MHA caches, on a GPU.

ops.decode_attention calls launch_fma by default where fma_eligible holds and the call is large enough
(FMA_MIN_WORK); the measurements behind the constants are in benchmarks/results/kernel_notes.md, versions 11 and 12.
"""

from __future__ import annotations

import torch

from . import common as C

try:  # Gluon (Triton's explicit-layout dialect) ships with triton >= 3.5; it has no interpreter mode
    from .kernel_gluon import _decode_attention_fma_kernel
except ImportError:  # pragma: no cover - older triton
    _decode_attention_fma_kernel = None

_OP = "decode_attention"

# The Gluon FMA kernel. With cp.async stages (kernels-20261129-h200-sweep-async.json, kernel_notes.md version
# 12): 64-token steps, split counts aimed at 48 programs per SM: 1.10-1.20x over the plain loop's best. A cap
# of 144 registers (14 one-warp programs per SM, a few spilled bytes) measured 0-2% faster than 168 (12 per SM,
# no spills) on every shape of kernels-20261129-h200-sweep-caps.json. The plain loop (strides that are not
# 16-byte aligned) keeps version 11's 128-register cap and 32 programs per SM
FMA_BLOCK_N = 64  # tokens per step
FMA_CP_ASYNC = True  # the next packed block's words through two shared-memory stages (cp.async)
FMA_MAXNREG = 144  # register cap per thread with cp.async
FMA_PER_SM = 48  # programs per SM its split count aims for with cp.async
FMA_MAXNREG_PLAIN = 128
# version 13 (kernel_gluon_magic.py): one LOP3 per code, no widening, per-lane value partials. 1.08-1.15x over
# version 12 on every shape of kernels-20261129-h200-sweep-magic.json (B=256, L=4,096: 1,534 vs 1,769 us); the
# engine on workload b: 14.25 vs 14.99 ms per decode step (engine-20261129-h200-magic.json)
FMA_MAGIC = True
FMA_PER_SM_PLAIN = 32
# below this many (KV row x token) pairs per call the tensor-core table measured faster (version 12,
# kernels-20261129-h200-sweep-small.json, 32/32 heads: 7.8 vs 14.2 us at B=1, L=512, 15.9 vs 23.5 at B=1,
# L=2,048, 22.2 vs 24.4 at B=1, L=4,096: a few long one-warp programs); the FMA kernel is faster from B=2,
# L=4,096 (29 vs 38 us), B=4, L=2,048, B=8, L=512 (18 vs 25 us) and B=1, L=16,384 up. Counted with max_tokens,
# the block table's capacity: that bench's tables are padded to 16 pages, so B=1, L=4,096 counts 32 x 4,224 =
# 135k pairs and B=2, L=4,096 270k
FMA_MIN_WORK = 1 << 18


def fma_eligible(q: torch.Tensor, k_bits: int, v_bits: int, group_size: int, residual_length: int,
                 page_size: int, qg: int) -> bool:
    """Whether the Gluon FMA kernel (kernel_gluon.py) can run this call: compiled (not the interpreter),
    2-bit keys and values, one query head per KV head, head_dim 128, pages of whole 128-token blocks."""
    return (_decode_attention_fma_kernel is not None and not C.interpreting() and q.is_cuda
            and k_bits == v_bits == 2 and qg == 1 and q.shape[-1] == 128 and page_size % 128 == 0
            and 16 <= group_size <= 128 and residual_length % 32 == 0)


def cp_async_aligned(*tensors: torch.Tensor) -> bool:
    """Whether cp.async can move 16-byte pieces of these page tensors: 16-byte aligned data and outer strides
    (dims 0 and 1: pages, heads) that are multiples of 16 elements, as Triton's launcher specializes them (the
    compiler then knows every copy's alignment); rows of whole 16-byte pieces."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) % 16 == 0
               and t.stride(2) * t.element_size() % 16 == 0 and t.stride(3) == 1 for t in tensors)


def fma_by_default(rows: int, max_tokens: int, eligible: bool) -> bool:
    """The launcher's default: the FMA kernel for eligible calls of at least FMA_MIN_WORK (KV row x token)
    pairs; rows = batch * KV heads, max_tokens = the block table's capacity plus the residual ring."""
    return eligible and rows * max_tokens >= FMA_MIN_WORK


def launch_fma(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, block_table, slots, seq_lens,
                out, sm_scale, group_size, residual_length, page_size, num_splits, max_tokens, block_n=FMA_BLOCK_N,
                maxnreg=None, cp_async=None, magic=None) -> torch.Tensor:
    """The Gluon FMA kernel: grid common.decode_grid of one-warp programs, then the split merge. cp_async None:
    where the caches allow it (cp_async_aligned); maxnreg None: the chosen loop's cap; magic None: FMA_MAGIC."""
    batch, heads, _ = q.shape
    C.check_int(_OP, "block_n", block_n, (64, 128))
    aligned = cp_async_aligned(k_codes, k_scale, k_zero, v_codes)
    if cp_async and not aligned:
        raise ValueError(f"{_OP}: cp_async needs 16-byte aligned page tensors with outer strides that are "
                         f"multiples of 16 elements; got k_codes strides {k_codes.stride()}, k_scale "
                         f"{k_scale.stride()}, v_codes {v_codes.stride()}")
    cp_async = FMA_CP_ASYNC and aligned if cp_async is None else bool(cp_async)
    if maxnreg is None:
        maxnreg = FMA_MAXNREG if cp_async else FMA_MAXNREG_PLAIN
    if page_size % block_n:
        raise ValueError(f"{_OP}: the fma kernel's block_n={block_n} must divide page_size={page_size}")
    num_splits = C.one_warp_launch(_OP, maxnreg, num_splits, batch * heads, max_tokens, q.device,
                                   FMA_PER_SM if cp_async else FMA_PER_SM_PLAIN)
    caches = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, block_table, slots, seq_lens)
    return C.launch_kivi(
        _decode_attention_fma_kernel, q, caches, out, sm_scale, num_splits,
        GROUP=group_size, RESIDUAL=residual_length, PAGE=page_size, BLOCK_N=block_n,
        ASYNC=cp_async, MAGIC=FMA_MAGIC if magic is None else bool(magic), num_warps=1, maxnreg=maxnreg,
    )
