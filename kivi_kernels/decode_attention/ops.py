"""Launcher of the decode-attention kernel over the KIVI cache (design.md, op 3)."""

from __future__ import annotations

import torch

from ..packing import expected_scale_dtype
from . import common as C
from .kernel import _decode_attention_kernel
from .ops_fma import FMA_BLOCK_N, fma_by_default, fma_eligible, launch_fma
from .ops_mma import MMA_DEFAULT, check_ring_pass, check_step_blocks, check_value_copy, launch_mma, mma_eligible

_OP = "decode_attention"


# Launch table for fp16/bf16 caches (the tensor-core path), from the H200 runs in
# benchmarks/results/kernels-20261129-h200.json (kernel_notes.md has the story). The packed loop moves its
# dequantized bf16 tiles through shared memory on their way to the tensor cores, and at ~250 registers per
# thread an SM holds only 8 one-warp programs: both limit it. One-warp programs of 32 tokens (no cross-warp
# barriers, 8 programs per SM) win wherever there are many KV rows or long rows; four-warp programs of 64
# tokens win at few, short rows and for most 4-bit query groups. Keys are host-side ints (B * H, the block
# table's capacity in tokens, the query-group size and the bits), so the choice is stable inside a CUDA graph.
#   (block_n, num_warps, num_stages, lazy denominator, key_vec, programs per SM the split count aims for)
_ONE_WARP = (32, 1, 2, True, 1, 8)
_FOUR_WARPS = {2: (64, 4, 2, True, 2, 4), 4: (64, 4, 2, True, 4, 3)}
MAX_SPLITS = C.ONE_WARP_MAX_SPLITS  # long rows at batch 1 want many splits (one-warp programs: 8 per SM)
SWAP_PER_SM = 16  # programs per SM the swapped-operand loop's split count aims for


def prefer_swap(rows: int, max_tokens: int) -> bool:
    """Where the swapped-operand loop measured faster than the table's tensor-core path on the H200
    (kernels-20261129-h200-sweep-swap.json): 64-256 KV rows of long context (B=8 at 4,096 tokens, 32/32
    heads: 128 vs 149 us; B=8 at 32,768, 32/8: 248 vs 310 us). With many rows it is 10% slower, at one row
    8% slower."""
    return 64 <= rows <= 256 and max_tokens >= 4096


def _table_config(rows: int, qg: int, bits: int, max_tokens: int) -> tuple:
    if bits <= 2:
        if qg == 1:
            one_warp = rows >= 512 or (rows <= 64 and max_tokens >= 16384)
        else:
            one_warp = rows >= 512 or max_tokens >= 16384 or (rows >= 64 and max_tokens >= 4096)
        return _ONE_WARP if one_warp else _FOUR_WARPS[2]
    if qg == 1:
        one_warp = rows >= 512 or (rows <= 64 and max_tokens >= 65536)
    else:
        one_warp = rows >= 2048 or max_tokens >= 65536
    return _ONE_WARP if one_warp else _FOUR_WARPS[4]


def swap_eligible(k_bits: int, v_bits: int, head_dim: int, page_size: int, use_dot: bool) -> bool:
    """Whether the swapped-operand packed loop (kernel_swap.py) can run this call."""
    return k_bits == v_bits == 2 and head_dim == 128 and page_size % 128 == 0 and use_dot


def launch_config(batch: int, kv_heads: int, qg: int, max_tokens: int, page_size: int, head_dim: int,
                  dot16: bool, use_dot: bool, device: torch.device, bits: int = 2, swap: bool = False) -> dict:
    """block_n, num_warps, num_stages, lazy, key_vec, num_splits and swap_ab for one call (host-side ints only,
    so the choice is stable inside a CUDA graph). bits: the larger of k_bits and v_bits; swap: use the
    swapped-operand loop (the caller checked swap_eligible)."""
    if swap:  # 128-token one-warp programs; the loop's dequantized tiles live in registers
        splits = C.choose_num_splits(batch * kv_heads, max_tokens, device, programs_per_sm=SWAP_PER_SM,
                                     max_splits=MAX_SPLITS)
        return dict(block_n=128, num_warps=1, num_stages=2, lazy=True, key_vec=1, num_splits=splits, swap_ab=True)
    if dot16 and use_dot:
        block_n, warps, stages, lazy, key_vec, per_sm = _table_config(batch * kv_heads, qg, bits, max_tokens)
    else:  # fp32 tiles (fp32 caches, mixed dtypes) or the broadcast path: registers double
        block_n, warps, stages, lazy, key_vec, per_sm = 64, 8, 2, False, 4, 2
        if not use_dot:
            qg_pad = C.triton_next_pow2(qg)
            block_n = min(block_n, max(16, 8192 // (qg_pad * head_dim)))
    block_n = min(block_n, page_size)
    splits = C.choose_num_splits(batch * kv_heads, max_tokens, device, programs_per_sm=per_sm,
                                 max_splits=MAX_SPLITS)
    return dict(block_n=block_n, num_warps=warps, num_stages=stages, lazy=lazy, key_vec=key_vec,
                num_splits=splits, swap_ab=False)


def decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    k_res: torch.Tensor,
    v_res: torch.Tensor,
    block_table: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    k_bits: int,
    v_bits: int,
    group_size: int,
    residual_length: int,
    page_size: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    use_dot: bool | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    lazy: bool | None = None,
    key_vec: int | None = None,
    swap_ab: bool | None = None,
    fma: bool | None = None,
    maxnreg: int | None = None,
    cp_async: bool | None = None,
    magic: bool | None = None,
    mma: bool | None = None,
    value_copy: str | None = None,
    ring_units: int | None = None,
    step_blocks: int | None = None,
    ring_pass: bool | None = None,
) -> torch.Tensor:
    """Attention of one new query token per row over packed tokens [0, nq) and the ring [nq, L).

    q [B, Hq, D]; caches as in design.md; returns out [B, Hq, D] in q's dtype (rows with seq_len 0 are
    zero). Tuning (all optional; defaults from launch_config's table): num_splits (split-K count), block_n
    (tokens per step, a power of two dividing page_size), use_dot (default True: the tensor-core path with the
    query group padded to 16 rows; False: broadcast-multiply-reduce in fp32), num_warps, num_stages (software
    pipelining depth of the packed loop), lazy (per-column softmax denominator, summed once at the end),
    key_vec (key-word loads per thread along channels; 1 keeps the dequantized key tile's shared-memory
    stores free of bank conflicts), swap_ab (2-bit keys and values, head_dim 128, block_n 128 only: the
    transposed products of kernel_swap.py, whose dequantized tiles never leave registers), fma (2-bit keys and
    values, one query head per KV head, head_dim 128, on a GPU: the Gluon FMA kernel of kernel_gluon.py; of the
    other knobs only num_splits and block_n (64 or 128) apply to it), maxnreg (the FMA kernel's register cap per
    thread, which sets how many of its one-warp programs an SM holds), cp_async (the FMA kernel copies the next
    packed block's words into shared memory while it computes the current one; default: where the page
    tensors' strides allow it), magic (the FMA kernel's version 13 step, kernel_gluon_magic.py; default
    ops_fma.FMA_MAGIC), mma (2-bit or 4-bit keys and values, the same for both, 1 to 8 query heads per KV head,
    head_dim 128, fp16 or bf16, on a GPU: the tensor-core kernel of kernel_mma.py, whose fragments are built in
    registers; the default where eligible and large enough, ahead of fma; of the other knobs only num_splits,
    maxnreg, num_stages (its cp.async stages, 2 or 3), value_copy (how it copies value words: "transposed" or
    "sectors", kernel_mma_stage.py; default ops_mma.MMA_VALUE_COPY) and
    ring_units (the weight of 32 ring
    slots in the split count's work units, the ring then spread over splits; 0 gives the whole ring to one split;
    default ops_mma.MMA_RING_UNITS) and step_blocks (64-token blocks per online-softmax step, 1 or 2; default
    ops_mma.mma_step_blocks) apply).
    """
    check_args(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, block_table, slots,
               seq_lens, k_bits=k_bits, v_bits=v_bits, group_size=group_size,
               residual_length=residual_length, page_size=page_size)
    check_value_copy(value_copy)
    check_step_blocks(step_blocks)
    check_ring_pass(ring_pass)
    batch, q_heads, head_dim = q.shape
    kv_heads = k_codes.shape[1]
    qg = q_heads // kv_heads
    out = C.prepare_out(_OP, out, (batch, q_heads, head_dim), q)
    if batch == 0:
        return out

    max_tokens = block_table.shape[1] * page_size + residual_length
    table_knobs = (block_n, use_dot, num_warps, num_stages, lazy, key_vec, swap_ab)
    mma_ok = mma_eligible(q, (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), k_res, k_bits, v_bits,
                          group_size, residual_length, page_size, qg)
    if mma is None:  # where eligible and large enough, unless another path's knobs were given
        untuned = all(v is None for v in (*table_knobs, fma, cp_async, magic))
        mma = MMA_DEFAULT and untuned and fma_by_default(batch * kv_heads, max_tokens, mma_ok)
    if mma:
        if not mma_ok:
            raise ValueError(f"{_OP}: mma needs a CUDA device (no interpreter), 2-bit or 4-bit keys and values (the "
                             f"same for both), 1 to 8 query "
                             f"heads per KV head, head_dim 128, pages of whole 64-token steps, groups of 32 or 64 "
                             f"tokens, fp16 or bf16 for the query and ring alike (scales in it or fp16), and "
                             f"16-byte aligned page tensors; got k_bits={k_bits}, "
                             f"v_bits={v_bits}, q_heads/kv_heads={qg}, head_dim={head_dim}, page_size={page_size}, "
                             f"group_size={group_size}, q {q.dtype}, k_scale {k_scale.dtype}, k_res {k_res.dtype}, "
                             f"device={q.device}")
        return launch_mma(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, block_table, slots,
                          seq_lens, out, sm_scale, group_size, residual_length, page_size, num_splits, max_tokens,
                          maxnreg, num_stages, value_copy, ring_units, step_blocks, ring_pass)
    fma_ok = fma_eligible(q, k_bits, v_bits, group_size, residual_length, page_size, qg)
    if fma is None:  # by default where eligible and large enough, unless the tensor-core path's tuning was asked for
        tuned = any(v is not None for v in table_knobs)
        fma = not tuned and fma_by_default(batch * kv_heads, max_tokens, fma_ok)
    if fma:
        if not fma_ok:
            raise ValueError(f"{_OP}: fma needs a CUDA device (no interpreter), 2-bit keys and values, one query "
                             f"head per KV head, head_dim 128 and pages of whole 128-token blocks; got "
                             f"k_bits={k_bits}, v_bits={v_bits}, q_heads/kv_heads={qg}, head_dim={head_dim}, "
                             f"page_size={page_size}, group_size={group_size}, device={q.device}")
        return launch_fma(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, block_table, slots,
                           seq_lens, out, sm_scale, group_size, residual_length, page_size, num_splits, max_tokens,
                          FMA_BLOCK_N if block_n is None else block_n, maxnreg, cp_async, magic)
    dot_dtype, precision = C.dot_config(q.dtype, k_res.dtype)
    use_dot = True if use_dot is None else bool(use_dot)
    qg_pad = max(16, C.triton_next_pow2(qg)) if use_dot else C.triton_next_pow2(qg)
    eligible = swap_eligible(k_bits, v_bits, head_dim, page_size, use_dot)
    if swap_ab and not eligible:
        raise ValueError(f"{_OP}: swap_ab needs 2-bit keys and values, head_dim 128, a page size that 128 divides "
                         f"and use_dot; got k_bits={k_bits}, v_bits={v_bits}, head_dim={head_dim}, "
                         f"page_size={page_size}, use_dot={use_dot}")
    if swap_ab is None:  # by default where measured faster (16-bit operands, 128-token blocks)
        swap_ab = (eligible and precision is None and block_n in (None, 128)
                   and prefer_swap(batch * kv_heads, max_tokens))
    cfg = launch_config(batch, kv_heads, qg, max_tokens, page_size, head_dim, precision is None, use_dot, q.device,
                        bits=max(k_bits, v_bits), swap=swap_ab)
    block_n = cfg["block_n"] if block_n is None else block_n
    num_splits = cfg["num_splits"] if num_splits is None else num_splits
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    num_stages = cfg["num_stages"] if num_stages is None else num_stages
    lazy = cfg["lazy"] if lazy is None else bool(lazy)
    key_vec = cfg["key_vec"] if key_vec is None else key_vec
    if not C.is_pow2(block_n) or block_n < 16 or page_size % block_n or block_n * head_dim > 16384:
        raise ValueError(f"{_OP}: block_n={block_n} must be a power of two >= 16 dividing page_size={page_size}, "
                         f"with block_n * head_dim <= 16384")
    C.check_int(_OP, "num_splits", num_splits)
    C.check_int(_OP, "num_warps", num_warps, (1, 2, 4, 8, 16))
    C.check_int(_OP, "num_stages", num_stages)

    if swap_ab and block_n != 128:
        raise ValueError(f"{_OP}: swap_ab needs block_n 128, got {block_n}")
    caches = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, block_table, slots, seq_lens)
    return C.launch_kivi(
        _decode_attention_kernel, q, caches, out, sm_scale, num_splits,
        K_BITS=k_bits, V_BITS=v_bits, GROUP=group_size, RESIDUAL=residual_length, PAGE=page_size,
        HEAD_DIM=head_dim, QG=qg, QG_PAD=qg_pad, BLOCK_N=block_n, NUM_STAGES=num_stages,
        LAZY_L=lazy, KEY_VEC=key_vec, USE_DOT=use_dot, DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision,
        USE_ASM=not C.interpreting(), SWAP_AB=swap_ab, RING_N=32 if swap_ab else 0, num_warps=num_warps,
        num_stages=num_stages,
    )


def check_args(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, block_table, slots,
               seq_lens, *, k_bits, v_bits, group_size, residual_length, page_size) -> None:
    """Shapes, dtypes, strides and devices of decode_attention's arguments (ValueError/TypeError)."""
    for name, val in (("k_bits", k_bits), ("v_bits", v_bits)):
        C.check_int(_OP, name, val, (2, 4))
    for name, val in (("group_size", group_size), ("residual_length", residual_length),
                      ("page_size", page_size)):
        C.check_int(_OP, name, val)
    if not C.is_pow2(group_size) or page_size % group_size or residual_length % group_size:
        raise ValueError(f"{_OP}: group_size={group_size} must be a power of two dividing "
                         f"page_size={page_size} and residual_length={residual_length}")
    if not C.is_pow2(page_size) or page_size < 16:
        raise ValueError(f"{_OP}: page_size={page_size} must be a power of two >= 16")
    C.check_tensor(_OP, "q", q, (-1, -1, -1), C.FLOAT_DTYPES)
    batch, q_heads, head_dim = q.shape
    n_pages, kv_heads = k_codes.shape[:2] if k_codes.dim() == 4 else (-1, -1)
    if not C.is_pow2(head_dim) or head_dim < 16 or head_dim % group_size:
        raise ValueError(f"{_OP}: q has head_dim {head_dim} (shape {list(q.shape)}); it must be a power of two "
                         f">= 16 divisible by group_size={group_size}")
    C.check_tensor(_OP, "k_codes", k_codes, (n_pages, kv_heads, page_size * k_bits // 32, head_dim),
                   (torch.int32,))
    if kv_heads <= 0 or q_heads % kv_heads:
        raise ValueError(f"{_OP}: q has {q_heads} heads (shape {list(q.shape)}), not a multiple of the "
                         f"{kv_heads} KV heads of k_codes (shape {list(k_codes.shape)})")
    cache_dtype = k_res.dtype
    if cache_dtype not in C.FLOAT_DTYPES:
        raise TypeError(f"{_OP}: k_res has dtype {cache_dtype}, expected fp16, bf16 or fp32")
    scale_shape = (n_pages, kv_heads, page_size // group_size, head_dim)
    vscale_shape = (n_pages, kv_heads, page_size, head_dim // group_size)
    scale_dtype = expected_scale_dtype(k_scale, cache_dtype)  # all four the same
    C.check_tensor(_OP, "k_scale", k_scale, scale_shape, (scale_dtype,))
    C.check_tensor(_OP, "k_zero", k_zero, scale_shape, (scale_dtype,))
    C.check_tensor(_OP, "v_codes", v_codes, (n_pages, kv_heads, page_size, head_dim * v_bits // 32),
                   (torch.int32,))
    C.check_tensor(_OP, "v_scale", v_scale, vscale_shape, (scale_dtype,))
    C.check_tensor(_OP, "v_zero", v_zero, vscale_shape, (scale_dtype,))
    C.check_tensor(_OP, "k_res", k_res, (-1, kv_heads, residual_length, head_dim), (cache_dtype,))
    C.check_tensor(_OP, "v_res", v_res, tuple(k_res.shape), (cache_dtype,))
    if k_res.stride() != v_res.stride() or k_scale.stride() != k_zero.stride() or (
        v_scale.stride() != v_zero.stride()
    ):
        raise ValueError(f"{_OP}: k_res/v_res, k_scale/k_zero and v_scale/v_zero must share strides")
    C.check_tensor(_OP, "block_table", block_table, (k_res.shape[0], -1), (torch.int32,))
    C.check_tensor(_OP, "slots", slots, (batch,), (torch.int32,))
    C.check_tensor(_OP, "seq_lens", seq_lens, (batch,), (torch.int32,))
    C.check_device(_OP, dict(q=q, k_codes=k_codes, k_scale=k_scale, k_zero=k_zero, v_codes=v_codes,
                             v_scale=v_scale, v_zero=v_zero, k_res=k_res, v_res=v_res,
                             block_table=block_table, slots=slots, seq_lens=seq_lens))
