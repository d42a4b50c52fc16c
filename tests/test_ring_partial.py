"""The ring pass (kernel_ring.py, version 27): the full-precision ring's share of a decode-attention call as a
normalized fp32 partial and its base-2 log-sum-exp. The Triton kernel (the interpreter on the CPU) against
reference.ring_partial, the spec, into NaN-poisoned buffers; the reference against plain attention over each
row's ring tokens; and, on a GPU, the tensor-core kernel that merges the partial at its end against the
reference of the whole call; the launcher's host side (workspace, side stream, merge, default) with recorded
launches on the CPU.
"""

# TRITON_INTERPRET is set on machines without a GPU by conftest.py, before any kernel module loads
import dataclasses
import math
import random

import pytest
import torch

from kivi_kernels.decode_attention import decode_attention, reference
from kivi_kernels.decode_attention.ops_ring import ring_partial
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

# odd lengths: empty rows, rings part full (L < R, and just past nq's group steps), full rings, long rows;
# R = 64 / 128 / 192, G = 16 / 32 / 64, 1 to 8 query heads per KV head, head_dim 32 to 128
CASES = [
    Case((0, 1, 31, 128, 129, 160, 300, 1000), 4, 2, 64, 2, 2),
    Case((5, 97, 200, 65), 3, 3, 32, 2, 2, group_size=16, residual=64, dtype=torch.float16),
    Case((129, 191, 500, 0), 8, 1, 128, 2, 2, group_size=64, residual=192, dtype=torch.bfloat16),
    Case((700, 33, 128), 1, 1, 128, 4, 4, dtype=torch.bfloat16),
]
SM_SCALE = {32: 32 ** -0.5, 64: 64 ** -0.5, 128: 128 ** -0.5}


def ring_call(fn, case: Case, q, cache, **kw):
    return fn(q, cache["k_res"], cache["v_res"], cache["slots"], cache["seq_lens"], sm_scale=SM_SCALE[case.head_dim],
              group_size=case.group_size, residual_length=case.residual, **kw)


def assert_lse_close(got: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """-inf exactly where the ring is empty; elsewhere within tol of max(1, |lse|)."""
    got, expected = got.float().cpu(), expected.float().cpu()
    empty = expected == -math.inf
    assert torch.equal(got == -math.inf, empty), f"{what}: -inf at {(got == -math.inf).nonzero().tolist()}"
    diff = (got[~empty] - expected[~empty]).abs() / expected[~empty].abs().clamp(min=1.0)
    assert not diff.isnan().any() and (diff.numel() == 0 or diff.max() <= tol), f"{what}: lse off by {diff.max()}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_ring_pass_matches_reference(case: Case):
    q, cache, _ = make_inputs(case)
    expected_o, expected_lse = ring_call(reference.ring_partial, case, q, cache)
    out = torch.full(q.shape, math.nan, dtype=torch.float32, device=DEVICE)
    lse = torch.full(q.shape[:2], math.nan, dtype=torch.float32, device=DEVICE)
    got_o, got_lse = ring_call(ring_partial, case, q, cache, out=out, lse=lse)
    assert got_o is out and got_lse is lse
    assert_close(got_o, expected_o, TOL[case.dtype], case.id)
    assert_lse_close(got_lse, expected_lse, TOL[case.dtype], case.id)
    for b, L in enumerate(case.lens):
        if L == 0:
            assert (got_o[b] == 0).all(), "an empty ring's partial must be zeros"


@pytest.mark.parametrize("block_n,num_warps", [(16, 1), (128, 8)])
def test_ring_pass_tiles(block_n: int, num_warps: int):
    """Tiles other than the default (64 slots, 4 warps): 16-slot steps that end inside R, one 128-slot step."""
    case = CASES[1] if block_n == 16 else CASES[0]
    q, cache, _ = make_inputs(case)
    expected_o, expected_lse = ring_call(reference.ring_partial, case, q, cache)
    got_o, got_lse = ring_call(ring_partial, case, q, cache, block_n=block_n, num_warps=num_warps)
    assert_close(got_o, expected_o, TOL[case.dtype], f"{case.id} block_n {block_n}")
    assert_lse_close(got_lse, expected_lse, TOL[case.dtype], case.id)


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c.id)
def test_reference_is_attention_over_the_ring_tokens(case: Case):
    """reference.ring_partial against plain softmax attention over each row's last L - nq tokens (the ring's, as
    build_cache stored them), in token order; lse as log2 of the sum of exp of the scaled scores."""
    q, cache, rows = make_inputs(case)
    o, lse = ring_call(reference.ring_partial, case, q, cache)
    qg = case.q_heads // case.kv_heads
    for b, L in enumerate(case.lens):
        nq = case.group_size * math.ceil(max(0, L - case.residual) / case.group_size)
        keys, values = (x[:, nq:].repeat_interleave(qg, 0) for x in rows[b])  # [Hq, L - nq, D]
        if L == 0:
            assert (o[b] == 0).all() and (lse[b] == -math.inf).all()
            continue
        scores = (q[b].float().cpu()[:, None, :] @ keys.transpose(1, 2)).squeeze(1) * SM_SCALE[case.head_dim]
        expected = (torch.softmax(scores, -1)[:, None, :] @ values).squeeze(1)
        assert_close(o[b], expected, 1e-4, f"{case.id} row {b}")
        assert_close(lse[b], torch.logsumexp(scores, -1) / math.log(2), 1e-4, f"{case.id} row {b} lse")


def test_ring_pass_rejects_bad_input():
    case = CASES[0]
    q, cache, _ = make_inputs(case)
    with pytest.raises(ValueError, match="k_res has shape"):
        ring_partial(q, cache["k_res"], cache["v_res"], cache["slots"], cache["seq_lens"], sm_scale=0.1,
                     group_size=32, residual_length=64)
    with pytest.raises(TypeError, match="out has dtype"):
        ring_call(ring_partial, case, q, cache, out=torch.empty(q.shape, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="lse has shape"):
        ring_call(ring_partial, case, q, cache, lse=torch.empty(q.shape, device=DEVICE))
    with pytest.raises(ValueError, match="block_n"):
        ring_call(ring_partial, case, q, cache, block_n=48)
    with pytest.raises(ValueError, match="multiple of the 2 KV heads"):
        ring_call(ring_partial, case, q[:, :3], cache)


# The tensor-core kernel over the packed blocks beside the ring pass, both merged as splits (GPU only: Gluon has no
# interpreter): odd shapes, 2 and 4 bits, fp16 / bf16 (fp16 scales too), G=32/64, R=64/128/192, empty and ring-only
# rows, unsplit and split calls
MERGE_CASES = [
    Case((1000, 161, 0, 64, 65, 300), 8, 2, 128, 2, 2, dtype=torch.bfloat16),
    Case((700, 33, 129, 2000), 8, 1, 128, 2, 2, dtype=torch.float16, page_size=256),
    Case((900, 77, 5), 6, 2, 128, 2, 2, group_size=64, residual=192, dtype=torch.bfloat16),
    Case((500, 150), 4, 4, 128, 2, 2, group_size=64, residual=64, dtype=torch.float16),
    Case((1000, 161, 0, 64, 65, 300), 8, 2, 128, 2, 2, dtype=torch.bfloat16, scale_dtype=torch.float16),
    Case((1000, 161, 0, 96), 8, 8, 128, 4, 4, dtype=torch.bfloat16, scale_dtype=torch.float16),
    Case((333, 290, 96), 14, 2, 128, 4, 4, page_size=64, dtype=torch.float16),
]


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("ring_pass", [True, False])
@pytest.mark.parametrize("case", MERGE_CASES, ids=lambda c: c.id)
def test_mma_calls_with_and_without_the_ring_pass_match_reference(case: Case, ring_pass: bool, num_splits: int):
    check_against_reference(dataclasses.replace(case, num_splits=num_splits), TOL[case.dtype], mma=True,
                            ring_pass=ring_pass)


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("num_splits,step_blocks", [(1, 1), (1, 2), (5, 1)])
def test_ring_pass_replayed_from_a_cuda_graph_matches_reference(num_splits: int, step_blocks: int):
    """The kernel and the ring pass on its side stream captured in one CUDA graph (the fork and the join), then
    replayed over new queries and new ring contents: the merge must wait for this replay's ring partial."""
    case = dataclasses.replace(MERGE_CASES[4], num_splits=num_splits)
    q, cache, _ = make_inputs(case)
    out = torch.full(q.shape, math.nan, dtype=q.dtype, device=DEVICE)
    args = [cache[n] for n in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_res", "v_res",
                               "block_table", "slots", "seq_lens")]
    ints = dict(sm_scale=128 ** -0.5, k_bits=2, v_bits=2, group_size=32, residual_length=128, page_size=128)
    knobs = dict(mma=True, ring_pass=True, num_splits=num_splits, step_blocks=step_blocks)
    decode_attention(q, *args, out=out, **ints, **knobs)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, *args, out=out, **ints, **knobs)
    for _ in range(3):
        q.copy_(torch.randn_like(q.float()).to(q.dtype))
        cache["k_res"].copy_(torch.randn_like(cache["k_res"].float()).to(q.dtype))
        cache["v_res"].copy_(torch.randn_like(cache["v_res"].float()).to(q.dtype))
        out.fill_(math.nan)
        graph.replay()
        expected = reference.decode_attention(q, *args, **ints)
        assert_close(out, expected, TOL[case.dtype], f"replay, {num_splits} splits, step_blocks {step_blocks}")


def test_mma_launcher_runs_the_ring_pass_beside_the_kernel(monkeypatch):
    """Version 27: with ring_pass the kernel reads the packed blocks alone (RING_PASS) into splits [0, S) of a
    workspace [B, Hq, S + 1, D], the ring pass into split S (its rows and heads strided) on a side stream that waits
    for the call's start, and the merge of S + 1 splits follows the join, not as a programmatic dependent; other
    calls keep the ring inside the kernel."""
    from kivi_kernels.decode_attention import kernel_ring, ops_mma, ops_ring

    calls = record_launches(monkeypatch, ops_mma, "_decode_attention_mma_kernel")
    rings = record_launches(monkeypatch, ops_ring, "_ring_partial_kernel")
    merges = record_launches(monkeypatch, ops_mma.C, "_merge_splits_kernel")
    monkeypatch.setattr(ops_mma.C, "programmatic_launch", lambda device: True)  # as on sm_90+
    streams = []
    monkeypatch.setattr(ops_mma, "_SIDE_STREAMS", FakeStreams(streams))
    monkeypatch.setattr(ops_mma.torch.cuda, "current_stream", lambda device=None: FakeStream(streams, "main"))
    monkeypatch.setattr(ops_mma.torch.cuda, "stream", lambda s: s)
    case = Case((300, 77, 1000), 8, 2, 128, 2, 2, dtype=torch.bfloat16)
    q, cache, _ = make_inputs(case)
    out = torch.empty_like(q)
    args = [cache[n] for n in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_res", "v_res",
                               "block_table", "slots", "seq_lens")]
    splits = random.randint(1, 4)
    print(f"splits={splits}")  # shown with a failure
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, splits, 1152, ring_pass=True)
    grid, pos, kw = calls[-1]
    assert grid[2] == splits and kw["RING_PASS"] is True and kw["SPLIT"] is True and kw["PDL"] is False
    ws_o, ws_lse = pos[12], pos[13]
    assert ws_o.shape == (3, 8, splits + 1, 128) and ws_lse.shape == (3, 8, splits + 1)
    grid, pos, kw = rings[-1]
    assert grid == (2, 3) and kw["QG"] == 4 and kw["ROW_MAJOR"] is True and kw["BLOCK_N"] == ops_ring.RING_BLOCK_N
    assert all(a is b for a, b in zip(pos[:5], (q, args[6], args[7], args[9], args[10]), strict=True))
    assert pos[5].data_ptr() == ws_o[:, :, splits].data_ptr() and pos[5].stride() == ws_o[:, :, splits].stride()
    assert pos[6].data_ptr() == ws_lse[:, :, splits].data_ptr() and kw["stride_lse_h"] == splits + 1
    names = kernel_ring._ring_partial_kernel.arg_names
    assert sorted(list(names[:len(pos)]) + [k for k in kw if k in names]) == sorted(names)
    # the side stream waits for the call's start, runs the ring pass, and the main stream joins it before the merge
    assert streams == [("side", "wait_event"), ("main", "wait_stream")]
    grid, pos, kw = merges[-1]
    assert pos[0] is ws_o and kw["NUM_SPLITS"] == splits + 1 and "launch_pdl" not in kw and kw["WAIT_PRIOR"] is False
    n_rings = len(rings)
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, splits, 1152, ring_pass=False)
    assert calls[-1][2]["RING_PASS"] is False and len(rings) == n_rings
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, None, 1152)  # 6 rows: under a wave
    assert calls[-1][2]["RING_PASS"] is False and len(rings) == n_rings
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, None, 1152, ring_pass=True)
    assert calls[-1][0][2] == 1 and calls[-1][2]["RING_PASS"] is True  # no split count given: unsplit
    assert merges[-1][2]["NUM_SPLITS"] == 2 and len(rings) == n_rings + 1
    monkeypatch.setattr(ops_mma.C, "num_sms", lambda device: 1)  # one SM holding 4 programs: the 6 rows fill a
    monkeypatch.setattr(ops_mma, "MMA_RESIDENT", 4)  # wave and are under 16 programs an SM, the default's range
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, None, 1152)
    assert calls[-1][0][2] == 1 and calls[-1][2]["RING_PASS"] is True and len(rings) == n_rings + 2
    for mma in (None, False):  # checked on every path of the call
        with pytest.raises(ValueError, match="ring_pass must be"):
            run(decode_attention, case, q, cache, mma=mma, ring_pass=1)


def test_mma_ring_pass_default(monkeypatch):
    """By default the ring pass runs on 2-bit calls of one to two waves of programs (8 to 16 an SM) with no split
    count given, which then run unsplit; not at 4 bits, not under a wave or from 16 programs an SM, not with a
    split count, and nowhere with MMA_RING_PASS off."""
    from kivi_kernels.decode_attention import ops_mma

    sms = random.randint(1, 200)
    monkeypatch.setattr(ops_mma.C, "num_sms", lambda device: sms)
    dev, reg = torch.device("cpu"), ops_mma.MMA_MAXNREG
    wave = ops_mma.MMA_RESIDENT * sms
    print(f"sms={sms}")  # shown with a failure
    assert ops_mma.mma_ring_pass(2, wave, None, reg, dev) and ops_mma.mma_ring_pass(2, 16 * sms - 1, None, reg, dev)
    assert not ops_mma.mma_ring_pass(2, wave - 1, None, reg, dev)
    assert not ops_mma.mma_ring_pass(2, 16 * sms, None, reg, dev)
    assert not ops_mma.mma_ring_pass(4, wave, None, reg, dev)
    assert not ops_mma.mma_ring_pass(2, wave, 1, reg, dev) and not ops_mma.mma_ring_pass(2, wave, 2, reg, dev)
    monkeypatch.setattr(ops_mma, "MMA_RING_PASS", False)
    assert not ops_mma.mma_ring_pass(2, wave, None, reg, dev)


class FakeStream:
    """A stream that records the calls made on it (name, method) in a shared list."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def record_event(self):
        return object()

    def wait_event(self, event):
        self.log.append((self.name, "wait_event"))

    def wait_stream(self, other):
        self.log.append((self.name, "wait_stream"))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeStreams(dict):
    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __missing__(self, device):
        return FakeStream(self.log, "side")

    def __contains__(self, device):
        return True
