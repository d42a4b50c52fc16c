"""Full-precision paged baseline: paged_decode_attention, store_paged_prefill, store_paged_decode.

Reference vs naive (pools filled by hand at random page ids, naive attention per row in token order),
Triton (the interpreter on the CPU) vs reference with NaN-poisoned outputs and pools, argument checks, and an
H200 compile check. Tolerances (max |out - ref|): fp32 2e-5, fp16 5e-3 (probabilities rounded to fp16 for
tl.dot), bf16 3e-2 (GPU only: the interpreter runs bf16 dots in fp32).
"""

import os

import torch

if not torch.cuda.is_available():  # before kernels are imported (conftest does it first); a GPU runs them compiled
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402

from kivi_kernels.paged_attention import kernel, ops, reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
torch.set_num_threads(1)


def seeded(key: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(key.encode()))


def pools_and_table(gen, lens, H, D, P, dtype, extra_pages=3):
    """NaN pools, a garbage block table and random distinct page ids for each row's ceil(L / P) pages."""
    B = len(lens)
    S = B + 2
    npages = [-(-L // P) for L in lens]
    N = sum(npages) + extra_pages
    k_pages = torch.full((N, H, P, D), math.nan, dtype=dtype)
    v_pages = torch.full((N, H, P, D), math.nan, dtype=dtype)
    block_table = torch.randint(N + 5, 2**20, (S, max(npages) + 2), generator=gen, dtype=torch.int32)
    slots = torch.randperm(S, generator=gen)[:B].int()
    free = torch.randperm(N, generator=gen).tolist()
    for b, n in enumerate(npages):
        block_table[slots[b], :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    return k_pages, v_pages, block_table, slots


def attention_inputs(case_id, lens, Hq, H, D, P, dtype):
    gen = seeded(case_id)
    k_pages, v_pages, block_table, slots = pools_and_table(gen, lens, H, D, P, dtype)
    rows = []
    for b, L in enumerate(lens):
        keys = (torch.randn(H, L, D, generator=gen) * 2).to(dtype)
        values = torch.randn(H, L, D, generator=gen).to(dtype)
        for t in range(L):  # by hand, independent of the store ops
            page = int(block_table[slots[b], t // P])
            k_pages[page, :, t % P] = keys[:, t]
            v_pages[page, :, t % P] = values[:, t]
        rows.append((keys.float(), values.float()))
    q = torch.randn(len(lens), Hq, D, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    tensors = [x.to(DEVICE) for x in (q, k_pages, v_pages, block_table, slots, seq_lens)]
    return tensors, rows


def naive_attention(q, rows, sm_scale):
    B, Hq, D = q.shape
    out = torch.zeros(B, Hq, D)
    for b, (keys, values) in enumerate(rows):
        if keys.shape[1]:
            qg = Hq // keys.shape[0]
            p = torch.softmax(torch.einsum("hd,htd->ht", q[b].float(), keys.repeat_interleave(qg, 0)) * sm_scale, -1)
            out[b] = torch.einsum("ht,htd->hd", p, values.repeat_interleave(qg, 0))
    return out


def assert_close(actual, expected, tol, what):
    diff = (actual.float().cpu() - expected.float().cpu()).abs()
    assert not diff.isnan().any(), f"{what}: NaN in output at {diff.isnan().nonzero()[:5].tolist()}"
    assert diff.max().item() <= tol, f"{what}: max |diff| {diff.max().item():.3g} > {tol:.3g} (mean {diff.mean():.3g})"


ATTN_CASES = [
    # lens, Hq, H, D, P, dtype, tuning
    ((1,), 4, 4, 64, 128, torch.float32, {}),
    ((31, 0, 33), 8, 2, 64, 64, torch.float32, dict(num_splits=3)),
    ((127, 129, 200), 9, 3, 64, 128, torch.float32, {}),
    ((1000,), 8, 1, 128, 128, torch.float32, dict(num_splits=4)),
    ((257, 300), 4, 4, 128, 64, torch.float16, {}),
    ((200, 33), 3, 1, 64, 128, torch.float32, dict(use_dot=False, num_splits=2)),
    ((500, 64, 0), 8, 2, 64, 128, torch.bfloat16, dict(num_splits=2)),
]


def attn_id(case):
    lens, Hq, H, D, P, dtype, tuning = case
    t = "T" + "_".join(map(str, lens))
    extra = "".join(f"-{k}{v}" for k, v in tuning.items())
    return f"B{len(lens)}-{t}-Hq{Hq}-H{H}-D{D}-P{P}-{DT[dtype]}{extra}"


@pytest.mark.parametrize("case", ATTN_CASES, ids=attn_id)
def test_paged_decode_attention(case):
    lens, Hq, H, D, P, dtype, tuning = case
    args, rows = attention_inputs(attn_id(case), lens, Hq, H, D, P, dtype)
    q = args[0]
    sm_scale = D**-0.5
    expected = reference.paged_decode_attention(*args, sm_scale=sm_scale, page_size=P)
    assert_close(expected, naive_attention(q.cpu(), rows, sm_scale), 1e-5 if dtype == torch.float32 else TOL[dtype],
                 "reference vs naive")
    out = torch.full(q.shape, math.nan, dtype=dtype, device=DEVICE)
    got = ops.paged_decode_attention(*args, sm_scale=sm_scale, page_size=P, out=out, **tuning)
    assert got is out
    assert_close(got, expected, TOL[dtype], "triton vs reference")
    for b, L in enumerate(lens):
        if L == 0:
            assert (got[b] == 0).all()


@pytest.mark.parametrize("row_major", [True, False])
def test_paged_decode_both_program_orders(monkeypatch, row_major):
    """grid (H, B, num_splits) and (B, H, num_splits) read the same programs: rows of different lengths, splits."""
    from kivi_kernels.decode_attention import common

    monkeypatch.setattr(common, "ROW_MAJOR", row_major)
    lens, Hq, H, D, P = (70, 0, 200, 33), 4, 2, 64, 32
    args, _ = attention_inputs(f"grid-{row_major}", lens, Hq, H, D, P, torch.float32)
    expected = reference.paged_decode_attention(*args, sm_scale=D**-0.5, page_size=P)
    out = torch.full(args[0].shape, math.nan, dtype=torch.float32, device=DEVICE)
    got = ops.paged_decode_attention(*args, sm_scale=D**-0.5, page_size=P, out=out, num_splits=3)
    assert_close(got, expected, TOL[torch.float32], "triton vs reference")


def store_inputs(case_id, lens, H, D, P, dtype, T):
    """Key/value [B, H, T, D] (non-contiguous, NaN padding left and right of the real tokens) + pools/table."""
    gen = seeded(case_id)
    B = len(lens)
    k_pages, v_pages, block_table, slots = pools_and_table(gen, [L + 1 for L in lens], H, D, P, dtype)
    lengths = torch.tensor(lens, dtype=torch.int32)
    starts = torch.tensor([(T - L) // 2 for L in lens], dtype=torch.int32)
    kv = []
    for _ in range(2):
        x = torch.randn(B, T, H, D, generator=gen).to(dtype)
        pos = torch.arange(T)
        pad = (pos < starts[:, None]) | (pos >= (starts + lengths)[:, None])
        kv.append(x.masked_fill(pad[:, :, None, None], math.nan).transpose(1, 2))  # [B, H, T, D] strided
    return kv, starts, lengths, slots, block_table, k_pages, v_pages


STORE_CASES = [((5, 0, 130), 2, 64, 64, torch.float32, 140), ((1, 77), 3, 128, 128, torch.float16, 90)]


@pytest.mark.parametrize("case", STORE_CASES, ids=lambda c: f"B{len(c[0])}-T{c[5]}-H{c[1]}-D{c[2]}-P{c[3]}-{DT[c[4]]}")
def test_store_paged_prefill_then_decode(case):
    lens, H, D, P, dtype, T = case
    (key, value), starts, lengths, slots, block_table, k_pages, v_pages = store_inputs(
        str(case), lens, H, D, P, dtype, T)
    pools = {name: (k_pages.clone().to(DEVICE), v_pages.clone().to(DEVICE)) for name in ("ref", "triton")}
    args = [x.to(DEVICE) for x in (key, value, starts, lengths, slots, block_table)]
    reference.store_paged_prefill(*args, *pools["ref"], page_size=P)
    ops.store_paged_prefill(*args, *pools["triton"], page_size=P)
    # reference placed each real token where the block table says (checked by hand), nothing else changed
    k_ref = pools["ref"][0].cpu()
    expect = k_pages.clone()
    for b, L in enumerate(lens):
        for t in range(L):
            expect[int(block_table[slots[b], t // P]), :, t % P] = key[b, :, int(starts[b]) + t]
    assert torch.equal(k_ref.nan_to_num(123.0), expect.nan_to_num(123.0))
    for a, e in zip(pools["triton"], pools["ref"], strict=True):
        assert torch.equal(a.cpu().nan_to_num(123.0), e.cpu().nan_to_num(123.0)), "prefill: triton != reference"

    # one decode step appends token L of each active row (a zero-length row stays inactive)
    gen = seeded("decode" + str(case))
    seq_lens = torch.tensor([L + 1 if L else 0 for L in lens], dtype=torch.int32)
    new_k = torch.randn(len(lens), H, D, generator=gen).to(dtype)
    new_v = torch.randn(len(lens), H, D, generator=gen).to(dtype)
    dargs = [x.to(DEVICE) for x in (new_k, new_v, seq_lens, slots, block_table)]
    reference.store_paged_decode(*dargs, *pools["ref"], page_size=P)
    ops.store_paged_decode(*dargs, *pools["triton"], page_size=P)
    for b, L in enumerate(lens):
        if L:
            assert torch.equal(pools["ref"][1][int(block_table[slots[b], L // P]), :, L % P].cpu(), new_v[b])
    for a, e in zip(pools["triton"], pools["ref"], strict=True):
        assert torch.equal(a.cpu().nan_to_num(123.0), e.cpu().nan_to_num(123.0)), "decode: triton != reference"


def test_launchers_reject_bad_arguments():
    (q, k_pages, v_pages, block_table, slots, seq_lens), _ = attention_inputs("bad", (40, 50), 8, 2, 64, 64,
                                                                              torch.float32)
    with pytest.raises(ValueError, match="q has 7 heads"):
        ops.paged_decode_attention(q[:, :7], k_pages, v_pages, block_table, slots, seq_lens, sm_scale=1.0,
                                   page_size=64)
    with pytest.raises(ValueError, match="k_pages has shape"):
        ops.paged_decode_attention(q, k_pages, v_pages, block_table, slots, seq_lens, sm_scale=1.0, page_size=128)
    with pytest.raises(TypeError, match="seq_lens has dtype"):
        ops.paged_decode_attention(q, k_pages, v_pages, block_table, slots, seq_lens.long(), sm_scale=1.0,
                                   page_size=64)
    with pytest.raises(ValueError, match="key has shape"):
        ops.store_paged_decode(q, q, seq_lens, slots, block_table, k_pages, v_pages, page_size=64)


def test_kernels_compile_for_h200():
    from tests.compile_util import compile_for_sm90_many

    decode_ptrs = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", block_table_ptr="*i32", slots_ptr="*i32",
                       seq_lens_ptr="*i32", o_ptr="*fp32", lse_ptr="*fp32", qk_scale="fp32")
    store_ptrs = dict(key_ptr="*fp32", value_ptr="*fp32", block_table_ptr="*i32", slots_ptr="*i32",
                      k_pages_ptr="*bf16", v_pages_ptr="*bf16")
    specs = [
        (kernel._paged_decode_kernel, decode_ptrs,
         dict(PAGE=128, HEAD_DIM=128, QG=4, QG_PAD=16, BLOCK_N=64, NUM_SPLITS=4, USE_DOT=True,
              DOT_DTYPE=tl.bfloat16, INPUT_PRECISION=None), dict(num_warps=4)),
        (kernel._paged_decode_kernel, decode_ptrs,
         dict(PAGE=128, HEAD_DIM=128, QG=4, QG_PAD=16, BLOCK_N=64, NUM_SPLITS=1, USE_DOT=True,
              DOT_DTYPE=tl.bfloat16, INPUT_PRECISION=None, ROW_MAJOR=True), dict(num_warps=4)),
        (kernel._store_paged_prefill_kernel, dict(store_ptrs, starts_ptr="*i32", lengths_ptr="*i32"),
         dict(PAGE=128, HEAD_DIM=128, BLOCK_T=64), dict(num_warps=4)),
        (kernel._store_paged_decode_kernel, dict(store_ptrs, seq_lens_ptr="*i32"),
         dict(PAGE=128, HEAD_DIM=64, HEADS=3, HEADS_PAD=4), dict(num_warps=1)),
    ]
    for result in compile_for_sm90_many(specs):
        assert result["cubin_bytes"] > 0, result
