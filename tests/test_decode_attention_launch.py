"""The Gluon decode-attention launchers' host side (launch_mma, launch_fma, ops.decode_attention's choice of
kernel): every kernel argument passed once, the grid, eligibility, defaults and bad input. These run on the CPU
with a recorded launch; the kernels themselves are in test_decode_attention_gluon.py (GPU only).
"""

# TRITON_INTERPRET is set on machines without a GPU by conftest.py, before any kernel module loads
import random

import pytest
import torch

from kivi_kernels.decode_attention import decode_attention
from tests.decode_attention_cases import (
    Case,
    make_inputs,
    record_launches,
    run,
)


def test_mma_kernel_rejects_ineligible_calls():
    case = Case((40,), 2, 1, 64, 2, 2)  # head_dim 64, fp32, and the interpreter on the CPU
    q, cache, _ = make_inputs(case)
    with pytest.raises(ValueError, match="mma needs"):
        run(decode_attention, case, q, cache, mma=True)
    for mma in (None, False):  # the knob is checked on every path, not only where the mma kernel runs
        with pytest.raises(ValueError, match="value_copy must be one of"):
            run(decode_attention, case, q, cache, mma=mma, value_copy="natural")
        with pytest.raises(ValueError, match="step_blocks"):
            run(decode_attention, case, q, cache, mma=mma, step_blocks=4)


def test_mma_launcher_passes_every_kernel_argument(monkeypatch):
    """launch_mma's host side (no GPU needed): the recorded launch names every parameter of the Gluon kernel
    exactly once, with the grid, query-group size, register cap and split count the launcher chose."""
    from kivi_kernels.decode_attention import kernel_mma, ops_mma

    calls = record_launches(monkeypatch, ops_mma, "_decode_attention_mma_kernel")
    monkeypatch.setattr(ops_mma, "MMA_RING_PASS", False)  # the ring inside the kernel (the ring pass: below)
    case = Case((300, 77, 1000), 8, 2, 128, 2, 2, dtype=torch.bfloat16)
    q, cache, _ = make_inputs(case)
    out = torch.empty_like(q)
    args = [cache[n] for n in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_res", "v_res",
                               "block_table", "slots", "seq_lens")]
    got = ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, None, 1152)
    assert got is out and len(calls) == 1
    grid, pos, kw = calls[0]
    names = kernel_mma._decode_attention_mma_kernel.arg_names
    passed = list(names[:len(pos)]) + [k for k in kw if k in names]
    assert sorted(passed) == sorted(names), set(names) ^ set(passed)
    splits = grid[2]  # grid (H, B, num_splits): programs start row by row (common.decode_grid)
    assert grid[:2] == (2, 3) and kw["ROW_MAJOR"] is True
    assert splits > 1 and kw["SPLIT"] is True and kw["num_splits"] == splits
    assert kw["QG"] == 4 and kw["GROUP"] == 32 and kw["num_warps"] == 1 and kw["maxnreg"] == ops_mma.MMA_MAXNREG
    assert kw["STAGES"] == ops_mma.MMA_STAGES and kw["V_COPY"] == ops_mma.VALUE_COPIES[ops_mma.MMA_VALUE_COPY]
    assert kw["PDL"] is (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 9)  # split calls, sm_90+
    merges = record_launches(monkeypatch, ops_mma.C, "_merge_splits_kernel")
    monkeypatch.setattr(ops_mma.C, "programmatic_launch", lambda device: True)  # as on sm_90+
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 3, 1152)
    assert calls[-1][2]["PDL"] is True  # a split call lets its merge launch early, and the merge waits
    assert merges[-1][2]["launch_pdl"] is True and merges[-1][2]["WAIT_PRIOR"] is True
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152)
    assert calls[-1][2]["PDL"] is False and len(merges) == 1  # no merge follows an unsplit call
    monkeypatch.setattr(ops_mma.C, "programmatic_launch", lambda device: False)  # below sm_90, or not compiled
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 3, 1152)
    assert calls[-1][2]["PDL"] is False
    assert "launch_pdl" not in merges[-1][2] and merges[-1][2]["WAIT_PRIOR"] is False
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152, stages=3, value_copy="transposed")
    assert calls[-1][2]["STAGES"] == 3 and calls[-1][2]["V_COPY"] == 0
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152, value_copy="sectors")
    assert calls[-1][2]["V_COPY"] == 1
    for gone in ("natural", "halves", "rows"):  # versions 17 and 19 were removed
        with pytest.raises(ValueError, match="value_copy must be one of"):
            ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152, value_copy=gone)
    padded = torch.zeros(*args[3].shape[:3], 16, dtype=args[3].dtype)[..., :8]  # token rows 64 bytes apart
    ops_mma.launch_mma(q, *args[:3], padded, *args[4:], out, 128 ** -0.5, 32, 128, 128, 1, 1152, value_copy="sectors")
    assert calls[-1][2]["V_COPY"] == 0  # 16-byte copies need each token's 8 words in a row
    assert kw["BITS"] == 2
    case4 = Case((300, 77, 1000), 8, 2, 128, 4, 4, dtype=torch.bfloat16)
    q4, cache4, _ = make_inputs(case4)
    args4 = [cache4[n] for n in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_res", "v_res",
                                 "block_table", "slots", "seq_lens")]
    ops_mma.launch_mma(q4, *args4, out, 128 ** -0.5, 32, 128, 128, 1, 1152)
    assert calls[-1][2]["BITS"] == 4 and calls[-1][2]["V_COPY"] == ops_mma.VALUE_COPIES[ops_mma.MMA_VALUE_COPY]
    padded4 = torch.zeros(*args4[3].shape[:3], 32, dtype=args4[3].dtype)[..., :16]  # token rows 128 bytes apart
    ops_mma.launch_mma(q4, *args4[:3], padded4, *args4[4:], out, 128 ** -0.5, 32, 128, 128, 1, 1152,
                       value_copy="sectors")
    assert calls[-1][2]["V_COPY"] == 0  # a 4-bit token's 16 words not in a row: the 4-byte copies
    with pytest.raises(ValueError, match="2-bit or 4-bit keys and values alike"):  # 4-bit keys, 2-bit values
        ops_mma.launch_mma(q4, *args4[:3], *args[3:], out, 128 ** -0.5, 32, 128, 128, 1, 1152)
    assert kw["RING_UNITS"] == ops_mma.MMA_RING_UNITS
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152, ring_units=0)
    assert calls[-1][2]["RING_UNITS"] == 0
    for bad in (-1, 9, 2.0):
        with pytest.raises(ValueError, match="ring_units"):
            ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152, ring_units=bad)
    with pytest.raises(ValueError, match="num_stages"):
        ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152, stages=4)
    assert kw["STEP_BLOCKS"] == 1  # the default on a split call of 16 blocks a row: one block a step
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152)
    assert calls[-1][2]["STEP_BLOCKS"] == 2  # ... and two on an unsplit 2-bit call
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152, step_blocks=1)
    assert calls[-1][2]["STEP_BLOCKS"] == 1
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 3, 1152, step_blocks=2)
    assert calls[-1][2]["STEP_BLOCKS"] == 2
    for bad in (0, 3, 2.0):
        with pytest.raises(ValueError, match="step_blocks"):
            ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152, step_blocks=bad)
    assert pos[0] is q and pos[12] is not out  # with splits the kernel writes the fp32 workspace
    with pytest.raises(ValueError, match="maxnreg"):
        ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152, maxnreg=100)


def test_mma_step_blocks_default(monkeypatch):
    """Two blocks a step at 2 bits where a program reads at least MMA_PAIRS_MIN_BLOCKS packed blocks (unsplit,
    split); one otherwise, at 4 bits, and wherever MMA_STEP_BLOCKS says so."""
    from kivi_kernels.decode_attention import ops_mma

    unsplit, split = ops_mma.MMA_PAIRS_MIN_BLOCKS
    splits = random.randint(2, 64)
    residual = random.choice([64, 128, 192])
    print(f"splits={splits} residual={residual}")  # shown with a failure
    row = 64 * unsplit + residual  # max_tokens whose packed blocks just reach the unsplit threshold
    long_row = 64 * split * splits + residual  # ... and fill the split programs just enough
    assert ops_mma.mma_step_blocks(2, 1, row, residual) == 2
    assert ops_mma.mma_step_blocks(2, 1, row - 64, residual) == 1
    assert ops_mma.mma_step_blocks(2, splits, long_row, residual) == 2
    assert ops_mma.mma_step_blocks(2, splits, long_row - 64, residual) == 1
    assert ops_mma.mma_step_blocks(4, 1, long_row, residual) == 1
    assert ops_mma.mma_step_blocks(4, splits, long_row, residual) == 1
    monkeypatch.setattr(ops_mma, "MMA_STEP_BLOCKS", 1)
    assert ops_mma.mma_step_blocks(2, 1, long_row, residual) == 1
    monkeypatch.setattr(ops_mma, "MMA_STEP_BLOCKS", 2)
    assert ops_mma.mma_step_blocks(4, splits, residual, residual) == 2


def test_mma_eligibility_follows_the_kernels_limits():
    """mma_eligible on host tensors: what the kernel supports, and page tensors cp.async can copy whole."""
    from kivi_kernels.decode_attention import ops_mma

    case = Case((300,), 8, 2, 128, 2, 2, dtype=torch.bfloat16)
    q, cache, _ = make_inputs(case)
    pages = tuple(cache[n] for n in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"))
    ok = dict(k_bits=2, v_bits=2, group_size=32, residual_length=128, page_size=128, qg=4)
    from kivi_kernels.decode_attention import common

    compiled = q.is_cuda and not common.interpreting() and ops_mma._decode_attention_mma_kernel is not None
    assert ops_mma.mma_eligible(q, pages, cache["k_res"], **ok) == compiled  # CPU tensors never are
    assert ops_mma.mma_eligible(q, pages, cache["k_res"], **{**ok, "k_bits": 4, "v_bits": 4}) == compiled
    for bad in (dict(k_bits=4), dict(v_bits=4), dict(k_bits=3, v_bits=3), dict(qg=9), dict(group_size=128),
                dict(page_size=96), dict(residual_length=48)):
        assert not ops_mma.mma_eligible(q, pages, cache["k_res"], **{**ok, **bad}), bad
    assert not ops_mma.mma_eligible(q.float(), pages, cache["k_res"], **ok)  # fp32 queries take the FMA kernel
    assert ops_mma._blocks_aligned(pages[4]) and ops_mma._blocks_aligned(pages[5])
    assert not ops_mma._blocks_aligned(pages[4].transpose(2, 3))  # rows must be contiguous


def test_launcher_defaults_to_the_mma_kernel_for_large_16bit_calls(monkeypatch):
    """ops.decode_attention's choice (host side): large eligible calls, MHA and GQA, take launch_mma; small ones
    and calls that set another path's knobs do not. (The cases here are small, so the size rule is patched to
    call them large; the rule itself is checked on its own.)"""
    from kivi_kernels.decode_attention import ops

    assert not ops.fma_by_default(8, 640, True) and ops.fma_by_default(128, 2176, True)
    assert not ops.fma_by_default(128, 2176, False)
    chosen = []
    monkeypatch.setattr(ops, "fma_by_default", lambda rows, max_tokens, eligible: eligible)
    monkeypatch.setattr(ops, "mma_eligible", lambda *a, **k: True)
    monkeypatch.setattr(ops, "launch_mma", lambda *a, **k: chosen.append("mma") or a[12])
    monkeypatch.setattr(ops, "launch_fma", lambda *a, **k: chosen.append("fma") or a[12])
    monkeypatch.setattr(ops, "fma_eligible", lambda *a, **k: True)
    for q_heads, kv_heads in ((8, 2), (4, 4)):
        case = Case((300, 200), q_heads, kv_heads, 128, 2, 2, dtype=torch.bfloat16)
        q, cache, _ = make_inputs(case)
        out = torch.empty_like(q)
        run(decode_attention, case, q, cache, out=out)
        run(decode_attention, case, q, cache, out=out, fma=True)  # another path's knob
    assert chosen == ["mma", "fma", "mma", "fma"]
    case4 = Case((300, 200), 8, 2, 128, 4, 4, dtype=torch.bfloat16)  # 4-bit caches take it too
    q4, cache4, _ = make_inputs(case4)
    run(decode_attention, case4, q4, cache4, out=torch.empty_like(q4))
    assert chosen[-1] == "mma"
    with pytest.raises(ValueError, match="mma needs"):
        monkeypatch.setattr(ops, "mma_eligible", lambda *a, **k: False)
        run(decode_attention, case, q, cache, out=out, mma=True)


def test_fma_kernel_rejects_ineligible_calls():
    case = Case((300,), 4, 2, 128, 2, 2)  # two query heads per KV head
    q, cache, _ = make_inputs(case)
    with pytest.raises(ValueError, match="fma needs"):
        run(decode_attention, case, q, cache, fma=True)


def test_fma_launcher_passes_every_kernel_argument(monkeypatch):
    """launch_fma's host side (no GPU needed): the recorded launch names every parameter of the Gluon kernel
    exactly once, with the grid, block size and register cap the launcher chose."""
    from kivi_kernels.decode_attention import kernel_gluon, ops_fma

    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    monkeypatch.setattr(ops_fma, "_decode_attention_fma_kernel", Recorder())
    case = Case((300, 77), 3, 3, 128, 2, 2)
    q, cache, _ = make_inputs(case)
    out = torch.empty_like(q)
    args = [cache[n] for n in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_res", "v_res",
                               "block_table", "slots", "seq_lens")]
    got = ops_fma.launch_fma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 512, 64)
    assert got is out and len(calls) == 1
    grid, pos, kw = calls[0]
    assert grid == (3, 2, 1) and kw["ROW_MAJOR"] is True  # (H, B, num_splits)
    names = kernel_gluon._decode_attention_fma_kernel.arg_names
    passed = list(names[:len(pos)]) + [k for k in kw if k in names]
    assert sorted(passed) == sorted(names), set(names) ^ set(passed)
    assert kw["BLOCK_N"] == 64 and kw["num_warps"] == 1 and kw["SPLIT"] is False
    assert kw["ASYNC"] is True and kw["maxnreg"] == ops_fma.FMA_MAXNREG  # aligned caches take the cp.async loop
    assert pos[0] is q and pos[12] is out
    # value codes that are not 16-byte aligned take the plain loop by default and are refused for cp.async
    v_codes = args[3].flatten()
    shifted = torch.cat([v_codes[:1], v_codes]).narrow(0, 1, v_codes.numel()).view(args[3].shape)
    assert shifted.data_ptr() % 16 and shifted.stride() == args[3].stride()
    unaligned = args[:3] + [shifted] + args[4:]
    ops_fma.launch_fma(q, *unaligned, out, 128 ** -0.5, 32, 128, 128, 1, 512, 64)
    assert calls[1][2]["ASYNC"] is False and calls[1][2]["maxnreg"] == ops_fma.FMA_MAXNREG_PLAIN
    with pytest.raises(ValueError, match="cp_async"):
        ops_fma.launch_fma(q, *unaligned, out, 128 ** -0.5, 32, 128, 128, 1, 512, 64, cp_async=True)
    with pytest.raises(ValueError, match="block_n"):
        ops_fma.launch_fma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 512, 32)
