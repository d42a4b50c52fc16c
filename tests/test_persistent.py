"""Version 28: the tensor-core decode-attention kernel as persistent programs (kernel_mma_persistent.py). On a GPU,
against the reference into NaN-poisoned outputs, with the grid cut to one or two SMs' worth of programs so that
each program takes many items one after another (rows of 0 to 40 packed blocks, ring-only and empty rows, splits,
2 and 4 bits, 1 to 8 query heads per KV head); calls one after another (the item counter must come back to zero);
and a CUDA-graph replay. On the CPU, the launcher's host side with recorded launches and the knob's checks.
"""

# TRITON_INTERPRET is set on machines without a GPU by conftest.py, before any kernel module loads
import dataclasses
import math
import random

import pytest
import torch

from kernels.decode_attention import decode_attention, reference
from tests.decode_attention_cases import (
    DEVICE,
    TOL,
    Case,
    assert_close,
    check_against_reference,
    make_inputs,
    record_launches,
    run,
)

# rows of every kind in one call: empty, ring only (L <= R), one packed group, part pages, long rows
CASES = [
    Case((0, 1, 129, 160, 161, 300, 1000, 2700, 64, 128, 193, 4000), 8, 8, 128, 2, 2, dtype=torch.bfloat16),
    Case((1000, 161, 0, 96, 2049, 530), 32, 8, 128, 2, 2, dtype=torch.bfloat16, scale_dtype=torch.float16),
    Case((333, 290, 96, 1500, 700), 14, 2, 128, 4, 4, page_size=64, dtype=torch.float16),
    Case((900, 40, 2100, 257), 8, 1, 128, 2, 2, group_size=64, dtype=torch.float16),
    Case((1200, 3, 611, 1999), 16, 2, 128, 4, 4, dtype=torch.bfloat16, scale_dtype=torch.float16),
]
ARG_NAMES = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_res", "v_res", "block_table", "slots",
             "seq_lens")
gpu = pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")


def few_programs(monkeypatch, sms: int) -> None:
    """The launcher sees `sms` SMs: its grid holds 8 * sms programs, fewer than the cases' items."""
    from kernels.decode_attention import ops_mma

    monkeypatch.setattr(ops_mma.C, "num_sms", lambda device: sms)


@gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sms", [1, 2, None])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_persistent_calls_match_reference(monkeypatch, case: Case, sms: int | None, num_splits: int):
    if sms is not None:
        few_programs(monkeypatch, sms)
    check_against_reference(dataclasses.replace(case, num_splits=num_splits), TOL[case.dtype], mma=True,
                            persistent=True)


@gpu
def test_persistent_calls_one_after_another_reset_the_counter(monkeypatch):
    """Five calls of random shapes and split counts in a row, each against the reference: the counter, which the
    last program of each call resets, reads zero after every call."""
    from kernels.decode_attention import ops_mma

    few_programs(monkeypatch, 1)
    for _ in range(5):
        case = random.choice(CASES)
        splits = random.randint(1, 4)
        print(f"{case.id} splits={splits}")  # shown with a failure
        check_against_reference(dataclasses.replace(case, num_splits=splits), TOL[case.dtype], mma=True,
                                persistent=True)
        assert ops_mma._COUNTERS[torch.device(DEVICE, torch.cuda.current_device())].tolist() == [0, 0]


@gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_persistent_replayed_from_a_cuda_graph_matches_reference(monkeypatch, num_splits: int):
    few_programs(monkeypatch, 2)
    case = dataclasses.replace(CASES[1], num_splits=num_splits)
    q, cache, _ = make_inputs(case)
    out = torch.full(q.shape, math.nan, dtype=q.dtype, device=DEVICE)
    args = [cache[n] for n in ARG_NAMES]
    ints = dict(sm_scale=128 ** -0.5, k_bits=2, v_bits=2, group_size=32, residual_length=128, page_size=128)
    knobs = dict(mma=True, persistent=True, num_splits=num_splits)
    decode_attention(q, *args, out=out, **ints, **knobs)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, *args, out=out, **ints, **knobs)
    for _ in range(3):
        q.copy_(torch.randn_like(q.float()).to(q.dtype))
        cache["v_res"].copy_(torch.randn_like(cache["v_res"].float()).to(q.dtype))
        out.fill_(math.nan)
        graph.replay()
        expected = reference.decode_attention(q, *args, **ints)
        assert_close(out, expected, TOL[case.dtype], f"replay, {num_splits} splits")


def test_persistent_launcher_grid_and_arguments(monkeypatch):
    """persistent: one-dimensional grid of min(items, 8 programs an SM) programs, the device's zeroed counter,
    batch and KV heads, every kernel argument given and none of the other kernel's (stages, step, ring pass,
    grid order); the merge as a programmatic dependent of split calls; by default (MMA_PERSISTENT) no ring pass."""
    from kernels.decode_attention import kernel_mma_persistent, ops_mma

    calls = record_launches(monkeypatch, ops_mma, "_decode_attention_mma_persistent_kernel")
    plain = record_launches(monkeypatch, ops_mma, "_decode_attention_mma_kernel")
    merges = record_launches(monkeypatch, ops_mma.C, "_merge_splits_kernel")
    monkeypatch.setattr(ops_mma.C, "programmatic_launch", lambda device: True)  # as on sm_90+
    monkeypatch.setattr(ops_mma, "_COUNTERS", {})
    sms = random.randint(1, 3)
    few_programs(monkeypatch, sms)
    case = Case(tuple(random.randint(0, 3000) for _ in range(random.randint(1, 9))), 8, 2, 128, 2, 2,
                dtype=torch.bfloat16)
    q, cache, _ = make_inputs(case)
    args = [cache[n] for n in ARG_NAMES]
    splits = random.randint(1, 4)
    print(f"sms={sms} splits={splits} lens={case.lens}")  # shown with a failure
    ops_mma.launch_mma(q, *args, torch.empty_like(q), 128 ** -0.5, 32, 128, 128, splits, 4096, persistent=True)
    grid, pos, kw = calls[-1]
    items = len(case.lens) * 2 * splits
    assert grid == (min(items, ops_mma.MMA_RESIDENT * sms),) and kw["batch"] == len(case.lens) and kw["heads"] == 2
    assert kw["counter_ptr"].dtype == torch.int32 and kw["counter_ptr"].tolist() == [0, 0]
    assert kw["num_splits"] == splits and kw["SPLIT"] is (splits > 1) and kw["PDL"] is (splits > 1)
    names = kernel_mma_persistent._decode_attention_mma_persistent_kernel.arg_names
    assert set(kw) - {"num_warps", "maxnreg"} <= set(names)
    assert sorted(list(names[:len(pos)]) + [k for k in kw if k in names]) == sorted(names)
    if splits > 1:
        assert merges[-1][2]["NUM_SPLITS"] == splits and merges[-1][2]["WAIT_PRIOR"] is True
    n_plain = len(plain)
    monkeypatch.setattr(ops_mma, "MMA_PERSISTENT", True)
    ops_mma.launch_mma(q, *args, torch.empty_like(q), 128 ** -0.5, 32, 128, 128, None, 4096)
    assert len(plain) == n_plain and len(calls) == 2  # the default, not the ring pass
    monkeypatch.setattr(ops_mma, "MMA_PERSISTENT", False)
    ops_mma.launch_mma(q, *args, torch.empty_like(q), 128 ** -0.5, 32, 128, 128, None, 4096)
    assert len(plain) == n_plain + 1 and len(calls) == 2


@pytest.mark.parametrize("mma", [None, False])
@pytest.mark.parametrize("knobs,match", [
    (dict(persistent=1), "persistent must be"),
    (dict(persistent=True, ring_pass=True), "persistent programs take"),
    (dict(persistent=True, num_stages=3), "persistent programs take"),
    (dict(persistent=True, step_blocks=2), "persistent programs take"),
])
def test_persistent_rejects_bad_knobs(knobs: dict, match: str, mma):
    case = CASES[0]
    q, cache, _ = make_inputs(case)
    with pytest.raises(ValueError, match=match):
        run(decode_attention, case, q, cache, mma=mma, **knobs)
