"""Launcher helpers shared by the decode-attention ops (quantized and full-precision paged).

Argument checks that raise ValueError/TypeError naming the bad tensor, the split-count heuristic, the
fp32 split workspace and the merge launch.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from .attend import _merge_splits_kernel

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NUM_SMS_DEFAULT = 132  # H200
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 32
ONE_WARP_MAX_SPLITS = 128  # long rows at batch 1 want many splits of one-warp programs
# the cap of wave_splits' one-wave count: 8 KV heads at batch 1 fill the H200's 1,056 slots with 132 splits (the
# most measured); with fewer KV heads the count stays near that instead of rising to 1,056 / heads
WAVE_MAX_SPLITS = 160
# Decode grids start their programs row by row: grid (H, B, num_splits), heads fastest, so (within each split: splits
# are the slowest dimension) the order of the rows is the order programs start in. The engine puts its longest rows
# first (scheduler.decode_rows), so the short programs fill the last wave (longest-processing-time first): on rows of
# mixed lengths 2-bit calls were 17-25% faster and uniform rows as before (row_order_probe.py,
# benchmarks/results/row-order-20261201-h200.json). False: grid (B, H, num_splits), which starts every row's head 0
# first, then head 1, so the last wave mixes long and short programs whatever the rows' order. (A grid (num_splits,
# H, B), one program wide in x for unsplit calls, started the same programs in the same order but was 2-20% slower
# on uniform rows.)
ROW_MAJOR = True
MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z dimensions


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(op: str, tensors: dict[str, torch.Tensor]) -> torch.device:
    """All tensors on one device; a CPU device only under TRITON_INTERPRET=1."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(f"{op}: {name} is on {dev}, expected {first} like the other tensors")
    if first.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"{op}: Triton kernels need a CUDA device (tensors are on {first}); set TRITON_INTERPRET=1 "
            "before importing kernels to run them on the CPU, or use the PyTorch reference backend "
            "(kivi_kernels.get_ops('reference'))."
        )
    return first


def check_tensor(
    op: str, name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]
) -> None:
    """Exact shape (-1 matches anything), one of dtypes, last dim contiguous."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(s != -1 and s != n for s, n in zip(shape, t.shape, strict=True)):
        want = "[" + ", ".join("*" if s == -1 else str(s) for s in shape) + "]"
        raise ValueError(f"{op}: {name} has shape {list(t.shape)}, expected {want}")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}")
    if t.numel() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} (shape {list(t.shape)}) needs a contiguous last dim, strides {t.stride()}")


def check_int(op: str, name: str, value: int, allowed: tuple[int, ...] | None = None) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")
    if allowed is not None and value not in allowed:
        raise ValueError(f"{op}: {name} must be one of {allowed}, got {value}")


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NUM_SMS_DEFAULT


def choose_num_splits(programs: int, max_tokens: int, device: torch.device, programs_per_sm: int = 2,
                      max_splits: int = MAX_SPLITS) -> int:
    """Splits of the key sequence so that programs * splits fills every SM with programs_per_sm programs.

    programs: B * H programs without splitting; max_tokens: the most tokens a row can hold (known on the
    host without a sync, so the choice is stable inside a CUDA graph). Each split keeps at least
    MIN_TOKENS_PER_SPLIT tokens so the merge and the per-program set-up stay small.
    """
    want = math.ceil(programs_per_sm * num_sms(device) / max(programs, 1))
    cap = max(1, max_tokens // MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, cap, max_splits))


@functools.lru_cache(maxsize=4096)
def wave_splits(programs: int, max_tokens: int, slots: int, max_splits: int, slack: float = 0.05) -> int:
    """Splits of the key sequence for programs that run in waves of `slots` at a time (resident programs per SM
    times SMs), each split's share of a row taking about 1/splits of its time: the fewest splits whose
    ceil(programs * splits / slots) / splits is within `slack` of the ideal programs / slots (fewer splits, less
    to merge). A call whose programs * splits overfill the last wave slightly pays a whole extra wave: 512
    programs in 5 splits run in 3 waves of 1,056 slots at 1/5 of a row each (0.6 of a row), in 2 splits in one
    wave (0.5). Of two counts that both fit, the fewer won: 32 programs of 131,072 tokens took 147.0 us in 32
    splits (one wave), 150.3 in 66 (two); 64 programs of 32,768 tokens 79.2 in 16, 86.1 in 33
    (kernels-20261130-h200-sweep-waves4.json).

    programs: B * H programs without splitting; max_tokens as in choose_num_splits (each split keeps at least
    MIN_TOKENS_PER_SPLIT tokens). Meant for calls of less than a wave of programs: from a wave up it lost to
    choose_num_splits (kernels-20261130-h200-sweep-waves.json: 141 rows of 1,152 tokens, 32 heads, took 236 us
    unsplit, 244 in its 3 splits; 92 rows of 1,280, 163 against 182 in 5) or the two were within noise
    (-sweep-waves2.json: 2,048 programs unsplit 5% faster at L=4,096, 8 KV heads, 5.6% slower at L=32,768).

    Where that count runs in one wave, it rises to as many splits as the wave holds (up to the cap): a program's
    share of a row is ceil(units / splits), so 8 programs of 131,072 tokens (2,054 units) read 17 units each in
    126 splits and 16 in 132, 42.5 us against 43.7-44.0 (kernels-20261201-h200-sweep-fill-wave.json)."""
    cap = max(1, min(max_tokens // MIN_TOKENS_PER_SPLIT, max_splits))
    fits = lambda splits: math.ceil(programs * splits / slots) / splits <= (1 + slack) * programs / slots
    splits = next((splits for splits in range(1, cap + 1) if fits(splits)), cap)
    if programs * splits <= slots:  # one wave: fill it
        splits = max(splits, min(cap, slots // programs))
    return splits


def dot_config(q_dtype: torch.dtype, cache_dtype: torch.dtype):
    """(tl dtype for tl.dot operands, input_precision): the common 16-bit type, else exact fp32. A bf16 cache
    dequantizes into bf16 whatever its scales' dtype: fp16 operands could overflow where a group's range
    does not (the dequantization's multiplier 2^bits scale and offset zero - 2^bits scale), so fp16 scales
    are rounded to bf16 there, as bf16 scales were stored.

    The interpreter computes bf16 arithmetic wrongly, so there bf16 operands stay fp32.
    """
    import triton.language as tl

    if q_dtype == cache_dtype == torch.float16:
        return tl.float16, None
    if q_dtype == cache_dtype == torch.bfloat16 and not interpreting():
        return tl.bfloat16, None
    return tl.float32, "ieee"


def split_buffers(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 workspace [B, Hq, S, D] for partial outputs and [B, Hq, S] for their base-2 log-sum-exp."""
    b, hq, d = out.shape
    ws_o = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=out.device)
    ws_lse = torch.empty((b, hq, num_splits), dtype=torch.float32, device=out.device)
    return ws_o, ws_lse


def output_args(out: torch.Tensor, num_splits: int):
    """(o, lse, dict of strides) that stage 1 writes: the output itself, or the split workspace."""
    if num_splits == 1:
        strides = dict(stride_o_b=out.stride(0), stride_o_h=out.stride(1), stride_o_s=0,
                       stride_lse_b=0, stride_lse_h=0)
        return out, out, strides, None
    ws_o, ws_lse = split_buffers(out, num_splits)
    return ws_o, ws_lse, workspace_strides(ws_o, ws_lse), (ws_o, ws_lse)


def workspace_strides(ws_o: torch.Tensor, ws_lse: torch.Tensor) -> dict:
    """The output strides stage 1 takes for a split workspace [B, Hq, S, D] and [B, Hq, S]."""
    return dict(stride_o_b=ws_o.stride(0), stride_o_h=ws_o.stride(1), stride_o_s=ws_o.stride(2),
                stride_lse_b=ws_lse.stride(0), stride_lse_h=ws_lse.stride(1))


MERGE_ELEMENTS = 2048  # partial-output elements a merge program reads (32 a thread at 2 warps)


@functools.cache
def _pdl_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def programmatic_launch(device: torch.device) -> bool:
    """Programmatic dependent launch (sm_90 and newer, compiled only): a kernel so launched may start while
    the one before it finishes, and waits (griddepcontrol.wait) before reading what that one wrote."""
    return device.type == "cuda" and not interpreting() and _pdl_capable(device.index or 0)


def merge_splits(ws_o: torch.Tensor, ws_lse: torch.Tensor, out: torch.Tensor, pdl: bool | None = None) -> None:
    """Second pass: out[b, h] from the NUM_SPLITS partials of the workspace, on grid (B, Hq, D / BLOCK_D) with
    BLOCK_D channels a program (fewer as the splits grow: at 126 splits of a B=1 row a program per 16
    channels, not one program reading 64 KiB per head), launched as a programmatic dependent where it can (pdl
    None) or where pdl says."""
    b, hq, num_splits, d = ws_o.shape
    splits_pad = triton_next_pow2(num_splits)
    block_d = min(d, max(16, MERGE_ELEMENTS // splits_pad))
    pdl = programmatic_launch(out.device) if pdl is None else pdl
    extra = dict(launch_pdl=True) if pdl else {}
    _merge_splits_kernel[(b, hq, d // block_d)](
        ws_o, ws_lse, out,
        stride_ws_b=ws_o.stride(0), stride_ws_h=ws_o.stride(1), stride_ws_s=ws_o.stride(2),
        stride_lse_b=ws_lse.stride(0), stride_lse_h=ws_lse.stride(1),
        stride_o_b=out.stride(0), stride_o_h=out.stride(1),
        NUM_SPLITS=num_splits, SPLITS_PAD=splits_pad, HEAD_DIM=d, BLOCK_D=block_d, WAIT_PRIOR=pdl,
        num_warps=1 if block_d * splits_pad <= 1024 else 2, **extra,
    )


def one_warp_launch(op: str, maxnreg: int, num_splits: int | None, rows: int, max_tokens: int,
                    device: torch.device, per_sm: int, resident: int | None = None) -> int:
    """Checks of a launch of one-warp programs (the Gluon kernels): a register cap ptxas takes (multiples of 8,
    or 255), and the split count when None (rows = batch x KV heads): for `per_sm` programs per SM, or, when
    `resident` is given and the rows are less than a wave, in whole waves of `resident` programs per SM
    (wave_splits)."""
    check_int(op, "maxnreg", maxnreg, tuple(range(64, 256, 8)) + (255,))
    if num_splits is None:
        wave = resident * num_sms(device) if resident is not None else 0
        if rows < wave:  # under a wave: whole waves
            num_splits = wave_splits(rows, max_tokens, wave, WAVE_MAX_SPLITS)
        else:
            num_splits = choose_num_splits(rows, max_tokens, device, programs_per_sm=per_sm,
                                           max_splits=ONE_WARP_MAX_SPLITS)
    check_int(op, "num_splits", num_splits)
    return num_splits


def decode_grid(batch: int, heads: int, num_splits: int) -> tuple[tuple[int, int, int], bool]:
    """(grid, row_major) of a decode-attention launch: (H, B, num_splits) when ROW_MAJOR (and B fits a grid's y
    dimension), else (B, H, num_splits). The kernels read their program ids by the same ROW_MAJOR constexpr."""
    if ROW_MAJOR and batch <= MAX_GRID_YZ:
        return (heads, batch, num_splits), True
    return (batch, heads, num_splits), False


def launch_kivi(kernel, q: torch.Tensor, caches: tuple, out: torch.Tensor, sm_scale: float, num_splits: int,
                workspace: tuple | None = None, before_merge=None, **meta) -> torch.Tensor:
    """One launch of a KIVI decode-attention kernel on decode_grid's grid ((KV heads, B, num_splits) by
    default) with the arguments all of them take, then the split merge. caches: (k_codes, k_scale, k_zero,
    v_codes, v_scale, v_zero, k_res, v_res, block_table, slots, seq_lens); meta: the kernel's own constexprs and
    launch options. workspace: (ws_o [B, Hq, S, D], ws_lse [B, Hq, S]) fp32 with S > num_splits, whose first
    num_splits splits the kernel writes (the others written elsewhere), merged whole after before_merge() (a
    stream join, say: the merge is then not launched as a programmatic dependent)."""
    k_codes, k_scale, _, v_codes, v_scale, _, k_res, _, block_table, _, _ = caches
    if workspace is None:
        o, lse, o_strides, workspace = output_args(out, num_splits)
    else:  # partials into the first num_splits splits of a given workspace, merged with the rest after
        o, lse = workspace
        o_strides = workspace_strides(o, lse)
    grid, row_major = decode_grid(q.shape[0], k_codes.shape[1], num_splits)
    kernel[grid](
        q, *caches, o, lse, qk_scale=float(sm_scale) * math.log2(math.e), num_splits=num_splits,
        **input_strides(q, k_codes, k_scale, v_codes, v_scale, k_res, block_table), **o_strides,
        SPLIT=workspace is not None, ROW_MAJOR=row_major, **meta,
    )
    if before_merge is not None:  # e.g. a join with another stream's writes: then no programmatic launch
        before_merge()
    if workspace is not None:
        merge_splits(*workspace, out, pdl=False if before_merge is not None else None)
    return out


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prepare_out(op: str, out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    check_tensor(op, "out", out, shape, (like.dtype,))
    if out.device != like.device:
        raise ValueError(f"{op}: out is on {out.device}, expected {like.device}")
    return out


def input_strides(q, k_codes, k_scale, v_codes, v_scale, k_res, block_table) -> dict:
    """The stride arguments both decode kernels take (zero/scale and k_res/v_res pairs share strides)."""
    return dict(
        stride_q_b=q.stride(0), stride_q_h=q.stride(1),
        stride_kc_n=k_codes.stride(0), stride_kc_h=k_codes.stride(1), stride_kc_w=k_codes.stride(2),
        stride_ks_n=k_scale.stride(0), stride_ks_h=k_scale.stride(1), stride_ks_g=k_scale.stride(2),
        stride_vc_n=v_codes.stride(0), stride_vc_h=v_codes.stride(1), stride_vc_t=v_codes.stride(2),
        stride_vs_n=v_scale.stride(0), stride_vs_h=v_scale.stride(1), stride_vs_t=v_scale.stride(2),
        stride_res_s=k_res.stride(0), stride_res_h=k_res.stride(1), stride_res_t=k_res.stride(2),
        stride_bt_s=block_table.stride(0),
    )
