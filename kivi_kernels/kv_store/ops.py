"""Typed launchers for the KV store kernels (ops 1 and 2 of docs/design.md).

Shapes: B batch rows, H KV heads, T padded prompt length, D head_dim, N pages, P page_size,
S slots, R residual_length, G group_size, kb/vb key/value bits.
"""

from __future__ import annotations

import os

import torch
import triton

from ..packing import expected_scale_dtype
from .kernel import store_decode_kernel, store_prefill_kernel

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# store_decode with one program per head's keys or values, its flush a loop over channel chunks, from this many KV
# heads up (None: never). At 32 heads it made the engine's append 16-23% faster (141 rows: 15.2 -> 12.8 us a layer;
# 238: 22.6 -> 17.4) and a flush of every row 3-11% slower; at 8 heads the append lost up to 30% (64 rows: 4.7 ->
# 6.2 us): kernel_notes.md, store kernels, 12; kernels-20261130-h200-stores-loop.json
STORE_LOOP_MIN_HEADS: int | None = 16


def _check_tensor(name: str, t, shape, dtype, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype} (shape {tuple(t.shape)})")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (shape {tuple(t.shape)})")


def check_store_args(key, value, rows, slots, block_table, k_codes, k_scale, k_zero,
                     v_codes, v_scale, v_zero, k_res, v_res, *, k_bits, v_bits, group_size,
                     residual_length, page_size) -> None:
    """Validate the layout shared by store_prefill (key [B, H, T, D]) and store_decode (key [B, H, D]).

    `rows` are the int32 [B] per-row tensors (starts and lengths, or seq_lens). Raises ValueError/TypeError.
    """
    if not isinstance(key, torch.Tensor):
        raise TypeError(f"key must be a torch.Tensor, got {type(key).__name__}")
    if key.dim() not in (3, 4):
        raise ValueError(f"key must be [B, H, T, D] or [B, H, D], got shape {tuple(key.shape)}")
    B, H, D = key.shape[0], key.shape[1], key.shape[-1]
    dtype, dev = key.dtype, key.device
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"key must be fp16/bf16/fp32, got {dtype} (shape {tuple(key.shape)})")
    _check_tensor("value", value, key.shape, dtype, dev)
    for name, t in (("key", key), ("value", value)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    for bits_name, bits in (("k_bits", k_bits), ("v_bits", v_bits)):
        if bits not in (2, 4):
            raise ValueError(f"{bits_name} must be 2 or 4, got {bits!r}")
    G, R, P = group_size, residual_length, page_size
    if G <= 0 or G & (G - 1) or G % (32 // k_bits):
        raise ValueError(f"group_size={G} must be a power of two and a multiple of 32 // k_bits")
    if D % G or D % (32 // v_bits):
        raise ValueError(f"head_dim={D} must be a multiple of group_size={G} and of 32 // v_bits")
    if R <= 0 or R % G or P <= 0 or P % G:
        raise ValueError(f"residual_length={R} and page_size={P} must be positive multiples of {G}")
    for name, t in rows + (("slots", slots),):
        _check_tensor(name, t, (B,), torch.int32, dev)
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise ValueError(f"block_table must be [S, max_pages], got {getattr(block_table, 'shape', block_table)}")
    _check_tensor("block_table", block_table, block_table.shape, torch.int32, dev)
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table must be contiguous in its last dim, got strides {block_table.stride()}")
    if not isinstance(k_codes, torch.Tensor) or k_codes.dim() != 4:
        raise ValueError(f"k_codes must be [N, H, P*kb/32, D], got {getattr(k_codes, 'shape', k_codes)}")
    N, S = k_codes.shape[0], block_table.shape[0]
    sdt = expected_scale_dtype(k_scale, dtype)
    pools = (
        ("k_codes", k_codes, (N, H, P * k_bits // 32, D), torch.int32),
        ("k_scale", k_scale, (N, H, P // G, D), sdt),
        ("k_zero", k_zero, (N, H, P // G, D), sdt),
        ("v_codes", v_codes, (N, H, P, D * v_bits // 32), torch.int32),
        ("v_scale", v_scale, (N, H, P, D // G), sdt),
        ("v_zero", v_zero, (N, H, P, D // G), sdt),
        ("k_res", k_res, (S, H, R, D), dtype),
        ("v_res", v_res, (S, H, R, D), dtype),
    )
    for name, t, shape, want_dtype in pools:
        _check_tensor(name, t, shape, want_dtype, dev)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")


def _launch_config(key: torch.Tensor, group_size: int, block_c: int | None, num_warps: int | None) -> dict:
    """Programs of BLOCK_C channels of the keys or the values of one group (NC = cdiv(D, BLOCK_C) chunks each):
    one-warp programs of [G, 64] tiles keep each program's reductions inside its warp and its registers few."""
    if key.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "kv_store Triton kernels got CPU tensors without TRITON_INTERPRET=1: use the reference backend "
            "(kivi_kernels.kv_store.reference, or kivi_kernels.get_ops('reference')) on the CPU"
        )
    D = key.shape[-1]
    if block_c is None:
        block_c = max(group_size, min(64, triton.next_power_of_2(D)))
    if block_c <= 0 or block_c & (block_c - 1) or block_c % group_size:
        raise ValueError(f"block_c={block_c} must be a power of two and a multiple of group_size={group_size}")
    num_warps = 1 if num_warps is None else num_warps
    if num_warps not in (1, 2, 4, 8):
        raise ValueError(f"num_warps must be 1, 2, 4 or 8, got {num_warps!r}")
    return dict(BLOCK_C=block_c, NC=triton.cdiv(D, block_c), num_warps=num_warps, enable_fp_fusion=False)


def _pool_strides(k_codes, k_scale, v_codes, v_scale, k_res) -> dict:
    return dict(
        stride_kc_n=k_codes.stride(0), stride_kc_h=k_codes.stride(1), stride_kc_w=k_codes.stride(2),
        stride_ks_n=k_scale.stride(0), stride_ks_h=k_scale.stride(1), stride_ks_g=k_scale.stride(2),
        stride_vc_n=v_codes.stride(0), stride_vc_h=v_codes.stride(1), stride_vc_t=v_codes.stride(2),
        stride_vs_n=v_scale.stride(0), stride_vs_h=v_scale.stride(1), stride_vs_t=v_scale.stride(2),
        stride_res_s=k_res.stride(0), stride_res_h=k_res.stride(1), stride_res_t=k_res.stride(2),
    )


def store_prefill(key, value, starts, lengths, slots, block_table, k_codes, k_scale, k_zero,
                  v_codes, v_scale, v_zero, k_res, v_res, *, k_bits: int, v_bits: int, group_size: int,
                  residual_length: int, page_size: int, block_c: int | None = None,
                  num_warps: int | None = None) -> None:
    """Store a padded prompt batch into empty slots (in place).

    key, value: [B, H, T, D] cache dtype, last dim contiguous; row b's tokens are
    key[b, :, starts[b] : starts[b] + lengths[b]]. starts, lengths, slots: int32 [B].
    block_table: int32 [S, max_pages]. Pools as in docs/design.md (contiguous):
    k_codes int32 [N, H, P*kb/32, D], k_scale/k_zero [N, H, P/G, D], v_codes int32 [N, H, P, D*vb/32],
    v_scale/v_zero [N, H, P, D/G], k_res/v_res [S, H, R, D].
    Tokens [0, nq) with nq = G * ceil(max(0, L - R) / G) go to pages, [nq, L) to ring slots t % R.
    Preconditions not checked here (they would need a device sync): starts + lengths <= T, the block
    table holds ceil(nq / P) valid pages for each row, distinct slots.
    Tuning (optional): block_c channels per program (a power of two, a multiple of G; default 64), num_warps.
    (One group a program: programs looping over groups lost, with the next tile in registers and staged through
    shared memory alike; kernel_notes.md, store kernels 13 and 15.)
    """
    check_store_args(key, value, (("starts", starts), ("lengths", lengths)), slots, block_table,
                     k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, k_bits=k_bits,
                     v_bits=v_bits, group_size=group_size, residual_length=residual_length,
                     page_size=page_size)
    if key.dim() != 4:
        raise ValueError(f"key must be [B, H, T, D], got shape {tuple(key.shape)}")
    B, H, T, D = key.shape
    if B == 0 or T == 0:
        return
    cfg = _launch_config(key, group_size, block_c, num_warps)
    store_prefill_kernel[(B, H, triton.cdiv(T, group_size) * 2 * cfg["NC"])](
        key_ptr=key, value_ptr=value, starts_ptr=starts, lengths_ptr=lengths, slots_ptr=slots,
        block_table_ptr=block_table, k_codes_ptr=k_codes, k_scale_ptr=k_scale, k_zero_ptr=k_zero,
        v_codes_ptr=v_codes, v_scale_ptr=v_scale, v_zero_ptr=v_zero, k_res_ptr=k_res, v_res_ptr=v_res,
        D=D,
        stride_key_b=key.stride(0), stride_key_h=key.stride(1), stride_key_t=key.stride(2),
        stride_value_b=value.stride(0), stride_value_h=value.stride(1), stride_value_t=value.stride(2),
        stride_bt_s=block_table.stride(0),
        **_pool_strides(k_codes, k_scale, v_codes, v_scale, k_res),
        K_BITS=k_bits, V_BITS=v_bits, GROUP=group_size, RESIDUAL=residual_length, PAGE=page_size, **cfg,
    )


def store_decode(key, value, seq_lens, slots, block_table, k_codes, k_scale, k_zero,
                 v_codes, v_scale, v_zero, k_res, v_res, *, k_bits: int, v_bits: int, group_size: int,
                 residual_length: int, page_size: int, block_c: int | None = None,
                 num_warps: int | None = None, loop_chunks: bool | None = None) -> None:
    """Append one token per row (in place): key, value [B, H, D] are token L = seq_lens[b] - 1.

    seq_lens, slots: int32 [B] (seq_lens 0 = inactive row, skipped). Other tensors as in store_prefill.
    When L >= R and (L - R) % G == 0 the oldest group (slots (L - R) % R ..) is quantized into page
    block_table[slot, (L - R) // P] first; then the token goes to ring slot L % R. Tuning as in store_prefill,
    and loop_chunks (default: from STORE_LOOP_MIN_HEADS KV heads up): one program for the keys or the values of
    a whole head, its flush going over the chunks of block_c channels in turn (store_decode_kernel, LOOP_CHUNKS).
    """
    check_store_args(key, value, (("seq_lens", seq_lens),), slots, block_table,
                     k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, k_bits=k_bits,
                     v_bits=v_bits, group_size=group_size, residual_length=residual_length,
                     page_size=page_size)
    if key.dim() != 3:
        raise ValueError(f"key must be [B, H, D], got shape {tuple(key.shape)}")
    B, H, D = key.shape
    if B == 0:
        return
    cfg = _launch_config(key, group_size, block_c, num_warps)
    if loop_chunks is None:
        loop_chunks = STORE_LOOP_MIN_HEADS is not None and H >= STORE_LOOP_MIN_HEADS
    loop_chunks = bool(loop_chunks)
    store_decode_kernel[(B, H, 2 if loop_chunks else 2 * cfg["NC"])](
        key_ptr=key, value_ptr=value, seq_lens_ptr=seq_lens, slots_ptr=slots, block_table_ptr=block_table,
        k_codes_ptr=k_codes, k_scale_ptr=k_scale, k_zero_ptr=k_zero,
        v_codes_ptr=v_codes, v_scale_ptr=v_scale, v_zero_ptr=v_zero, k_res_ptr=k_res, v_res_ptr=v_res,
        D=D,
        stride_key_b=key.stride(0), stride_key_h=key.stride(1),
        stride_value_b=value.stride(0), stride_value_h=value.stride(1),
        stride_bt_s=block_table.stride(0),
        **_pool_strides(k_codes, k_scale, v_codes, v_scale, k_res),
        K_BITS=k_bits, V_BITS=v_bits, GROUP=group_size, RESIDUAL=residual_length, PAGE=page_size,
        LOOP_CHUNKS=loop_chunks, BLOCK_D=triton.next_power_of_2(D) if loop_chunks else 1, **cfg,
    )
