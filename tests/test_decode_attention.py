"""decode_attention (docs/design.md op 3): reference vs an independent naive computation, the Triton table
kernel (the interpreter on the CPU) vs reference, argument checks, split counts, and an H200 compile check
that needs no GPU. Cases and cache builders: decode_attention_cases.py; the Gluon kernels' tests (GPU only,
and their launchers' host side): test_decode_attention_gluon.py and test_decode_attention_launch.py.
"""

# TRITON_INTERPRET is set on machines without a GPU by conftest.py, before any kernel module loads
import math

import pytest
import torch
import triton.language as tl

from kivi_kernels.decode_attention import attend, decode_attention, kernel, reference
from tests.decode_attention_cases import (
    DEVICE,
    TOL,
    Case,
    assert_close,
    check_against_reference,
    make_inputs,
    naive_attention,
    run,
)

# Reference vs naive: every odd shape (cheap).
REF_CASES = [
    Case((1,), 4, 4, 64, 2, 2),
    Case((31, 0, 33), 8, 2, 64, 2, 4),
    Case((127, 129, 160), 9, 3, 64, 4, 2),
    Case((200, 1000, 161), 8, 1, 128, 2, 2),
    Case((300, 257), 4, 2, 64, 4, 4, page_size=64),
    Case((500,), 3, 3, 128, 2, 4, group_size=64, residual=192, page_size=64),
    Case((129, 1000), 8, 2, 64, 2, 2, dtype=torch.float16),
    Case((1000, 5), 4, 4, 64, 4, 2, dtype=torch.bfloat16),
    Case((700, 160), 8, 2, 64, 2, 4, dtype=torch.bfloat16, scale_dtype=torch.float16),
]


@pytest.mark.parametrize("case", REF_CASES, ids=lambda c: c.id)
def test_reference_matches_naive(case: Case):
    q, cache, rows = make_inputs(case)
    expected = naive_attention(q.cpu(), rows, case.head_dim ** -0.5)
    out = torch.full(q.shape, math.nan, dtype=q.dtype, device=DEVICE)
    got = run(reference.decode_attention, case, q, cache, out=out)
    assert got is out
    assert_close(got, expected, 1e-5 if case.dtype == torch.float32 else TOL[case.dtype], case.id)
    for b, L in enumerate(case.lens):
        if L == 0:
            assert (got[b] == 0).all()


# Triton (interpreter on the CPU) vs reference.
KERNEL_CASES = [
    Case((1,), 4, 4, 64, 2, 2),
    Case((31, 0, 33), 8, 2, 64, 2, 4, num_splits=4),  # more splits than blocks: empty splits
    Case((127, 129, 200), 9, 3, 64, 4, 2, num_splits=3),
    Case((1000,), 8, 1, 128, 2, 2, num_splits=4),
    Case((1000, 161), 8, 1, 128, 2, 2),
    Case((257, 300), 4, 4, 64, 4, 4, page_size=64, num_splits=2),
    Case((200, 33, 0), 4, 2, 64, 2, 4, block_n=32),
    Case((700, 129), 2, 2, 128, 4, 2, use_dot=False, num_splits=2),
    Case((260,), 3, 1, 64, 2, 2, use_dot=False),
    Case((1000,), 4, 1, 64, 2, 4, use_dot=True, dtype=torch.float16, num_splits=2),
    Case((129, 0, 31), 8, 2, 64, 4, 4, dtype=torch.float16),
    Case((500, 64), 2, 1, 64, 2, 2, dtype=torch.bfloat16, num_splits=2),
    # the case above with fp16 scales (a bf16 cache still dequantizes into bf16 here: common.dot_config)
    Case((500, 64), 2, 1, 64, 2, 2, dtype=torch.bfloat16, scale_dtype=torch.float16, num_splits=2),
    Case((500, 150), 4, 2, 128, 2, 4, group_size=64, residual=192, page_size=128, dtype=torch.float16),
    Case((333, 17), 2, 2, 64, 4, 2, group_size=16, residual=48, page_size=64, num_splits=2),
    # launcher tuning knobs (the H200 table picks among these)
    Case((700, 129, 0), 4, 1, 128, 2, 2, dtype=torch.float16, block_n=32, num_splits=3,
         extra=(("num_warps", 1), ("lazy", False), ("key_vec", 4))),
    Case((500, 300), 2, 2, 64, 2, 4, dtype=torch.float16, block_n=128, extra=(("num_warps", 8), ("num_stages", 2))),
    # the swapped-operand loop (kernel_swap.py: 2-bit, D=128, 128-token blocks): MHA and GQA, odd lengths,
    # empty rows, splits, G=16/64, pages of 256, fp32 (exact dots) and fp16
    Case((1000, 161, 0), 3, 3, 128, 2, 2, num_splits=2, extra=(("swap_ab", True),)),
    Case((700, 33, 300), 8, 2, 128, 2, 2, dtype=torch.float16, num_splits=3, extra=(("swap_ab", True),)),
    Case((500, 150), 4, 4, 128, 2, 2, group_size=64, residual=192, extra=(("swap_ab", True),)),
    Case((333, 290), 3, 1, 128, 2, 2, group_size=16, residual=48, page_size=256, extra=(("swap_ab", True),)),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.id)
def test_kernel_matches_reference(case: Case):
    check_against_reference(case, TOL[case.dtype], block_n=case.block_n, use_dot=case.use_dot, **dict(case.extra))

@pytest.mark.parametrize("row_major", [True, False])
def test_both_program_orders_match_reference(monkeypatch, row_major):
    """Programs find (row, head, split) from grid (H, B, num_splits) or (B, H, num_splits) alike: rows of
    different lengths (one empty), GQA, splits, against the reference."""
    from kivi_kernels.decode_attention import common

    monkeypatch.setattr(common, "ROW_MAJOR", row_major)
    assert common.decode_grid(3, 2, 4) == (((2, 3, 4), True) if row_major else ((3, 2, 4), False))
    check_against_reference(Case((300, 0, 161), 4, 2, 64, 2, 2, num_splits=3), TOL[torch.float32])


def test_decode_grid_falls_back_past_the_grid_limit(monkeypatch):
    from kivi_kernels.decode_attention import common

    monkeypatch.setattr(common, "ROW_MAJOR", True)
    assert common.decode_grid(common.MAX_GRID_YZ, 8, 1) == ((8, common.MAX_GRID_YZ, 1), True)
    assert common.decode_grid(common.MAX_GRID_YZ + 1, 8, 1) == ((common.MAX_GRID_YZ + 1, 8, 1), False)


def test_kernel_noncontiguous_query_and_fresh_output():
    case = Case((150, 40), 8, 2, 64, 2, 2)
    q, cache, _ = make_inputs(case)
    q_strided = torch.empty(2, 8, 128, device=DEVICE)[:, :, :64].copy_(q)
    assert not q_strided.is_contiguous()
    expected = run(reference.decode_attention, case, q, cache)
    assert_close(run(decode_attention, case, q_strided, cache), expected, TOL[case.dtype], "strided q")


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda a: a.update(q=a["q"][:, :7]), ValueError, "q has 7 heads"),
        (lambda a: a.update(k_codes=a["k_codes"][:, :, :3]), ValueError, "k_codes has shape"),
        (lambda a: a.update(v_scale=a["v_scale"].half()), TypeError, "v_scale has dtype"),
        (lambda a: a.update(slots=a["slots"].long()), TypeError, "slots has dtype"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:1]), ValueError, "seq_lens has shape"),
        (lambda a: a.update(k_res=a["k_res"].transpose(2, 3)), ValueError, "k_res has shape"),
        (lambda a: a.update(swap_ab=True), ValueError, "swap_ab needs 2-bit keys and values, head_dim 128"),
    ],
    ids=["q-heads", "k_codes-shape", "v_scale-dtype", "slots-dtype", "seq_lens-shape", "k_res-shape", "swap-d64"],
)
def test_launcher_rejects_bad_arguments(mutate, error, match):
    case = Case((40, 50), 8, 2, 64, 2, 2)
    q, cache, _ = make_inputs(case)
    args = dict(q=q, **{k: v for k, v in cache.items()})
    mutate(args)
    tuning = {"swap_ab": args.pop("swap_ab")} if "swap_ab" in args else {}
    with pytest.raises(error, match=match):
        run(decode_attention, case, args.pop("q"), args, **tuning)


def test_choose_num_splits():
    from kivi_kernels.decode_attention.common import choose_num_splits

    cpu = torch.device("cpu")
    assert choose_num_splits(64 * 8, 4096, cpu) == 1  # enough programs already
    assert choose_num_splits(1 * 8, 32768, cpu) == 32  # one row, long context: many splits
    assert choose_num_splits(1 * 8, 512, cpu) == 2  # short context caps the split count
    assert choose_num_splits(8 * 8, 4096, cpu) == 5


def test_wave_splits_fill_whole_waves():
    """wave_splits: the fewest splits whose waves of `slots` programs are within 5% of the ideal programs / slots,
    else the cap, raised to fill the wave where it is one wave (on random calls), and the examples of its
    docstring (512 programs, 1,056 slots: 2 splits, one wave, instead of 5; 32 programs: 33 splits, not 66; 8
    programs: 132)."""
    import math
    import random

    from kivi_kernels.decode_attention.common import MIN_TOKENS_PER_SPLIT, wave_splits

    assert wave_splits(512, 4352, 1056, 128) == 2 and wave_splits(32, 131_200, 1056, 128) == 33
    assert wave_splits(8, 131_200, 1056, 256) == 132 and wave_splits(8, 131_200, 1056, 128) == 128
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    for _ in range(300):
        programs, max_tokens = rng.randrange(1, 5000), rng.randrange(64, 140_000)
        slots, max_splits = rng.choice([528, 1056, 1584]), rng.choice([32, 128])
        splits = wave_splits(programs, max_tokens, slots, max_splits)
        cap = max(1, min(max_tokens // MIN_TOKENS_PER_SPLIT, max_splits))
        fits = lambda s, p=programs, n=slots: math.ceil(p * s / n) / s <= 1.05 * p / n
        fewest = next((s for s in range(1, cap + 1) if fits(s)), cap)
        assert 1 <= splits <= cap, seed
        if programs * fewest <= slots:  # one wave: as many splits as it holds
            assert splits == max(fewest, min(cap, slots // programs)), seed
        else:
            assert splits == fewest, seed


@pytest.mark.parametrize("num_splits,head_dim", [(2, 128), (5, 64), (40, 128), (126, 128)])
def test_merge_splits_matches_a_log_sum_exp_merge(num_splits, head_dim):
    """common.merge_splits on random partials and base-2 log-sum-exps (some splits empty: -inf, and one row with
    every split empty: zeros), on its grid of channel blocks (16 channels a program from 128 splits), into a
    NaN-poisoned output, against the same merge in torch."""
    import random

    from kivi_kernels.decode_attention.common import merge_splits

    seed = random.randrange(2**31)  # fresh each run, named on failure
    gen = torch.Generator(device="cpu").manual_seed(seed)
    b, hq = 3, 4
    ws_o = torch.randn(b, hq, num_splits, head_dim, generator=gen).to(DEVICE)
    ws_lse = (4 * torch.randn(b, hq, num_splits, generator=gen)).to(DEVICE)
    ws_lse[torch.rand(b, hq, num_splits, generator=gen).to(DEVICE) < 0.3] = -math.inf
    ws_lse[1, 2] = -math.inf
    # bf16 on a GPU; fp16 under the CPU interpreter, whose bf16 conversion truncates (an output of -4.246 came
    # back -4.219: past the tolerance at |x| >= 4 in ~4% of runs), where fp16's truncation stays under 0.004
    out_dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    out = torch.full((b, hq, head_dim), math.nan, dtype=out_dtype, device=DEVICE)
    merge_splits(ws_o, ws_lse, out)
    m = ws_lse.amax(-1, keepdim=True)
    w = torch.exp2(ws_lse - torch.where(m == -math.inf, 0.0, m))  # [B, Hq, S]
    denom = w.sum(-1, keepdim=True)
    expected = (ws_o * w[..., None]).sum(-2) / torch.where(denom > 0, denom, 1.0)
    assert_close(out, expected, 2e-2, f"merge of {num_splits} splits, D={head_dim}, seed {seed}")
    assert (out[1, 2] == 0).all(), seed


def test_kernels_compile_for_h200():
    from kivi_kernels.decode_attention import ops_fma, ops_mma
    from tests.compile_util import compile_for_sm90_many

    common = dict(K_BITS=2, V_BITS=2, GROUP=32, RESIDUAL=128, PAGE=128, HEAD_DIM=128, BLOCK_N=64,
                  SPLIT=True, NUM_STAGES=3, LAZY_L=True, KEY_VEC=1, INPUT_PRECISION=None, USE_ASM=True,
                  stride_kc_w=128, stride_ks_g=128, stride_vc_t=8, stride_vs_t=4, stride_res_t=128)
    variants = [
        dict(common, QG=4, QG_PAD=16, USE_DOT=True, DOT_DTYPE=tl.bfloat16, q="*bf16", cache="bf16"),
        dict(common, QG=4, QG_PAD=16, USE_DOT=True, DOT_DTYPE=tl.bfloat16, q="*bf16", cache="bf16", ROW_MAJOR=True),
        dict(common, QG=1, QG_PAD=1, USE_DOT=False, DOT_DTYPE=tl.float32, q="*fp16", cache="fp16",
             K_BITS=4, V_BITS=4, SPLIT=False, LAZY_L=False, NUM_STAGES=2, stride_vc_t=16),
        dict(common, QG=3, QG_PAD=16, USE_DOT=True, DOT_DTYPE=tl.float16, q="*fp16", cache="fp16", HEAD_DIM=64,
             V_BITS=4, BLOCK_N=128, KEY_VEC=4, stride_kc_w=64, stride_ks_g=64, stride_vc_t=8, stride_vs_t=2,
             stride_res_t=64),
        dict(common, QG=4, QG_PAD=16, USE_DOT=True, DOT_DTYPE=tl.bfloat16, q="*bf16", cache="bf16", BLOCK_N=128,
             NUM_STAGES=2, SWAP_AB=True, RING_N=32),
        # a bf16 cache with fp16 scales (KiviConfig.scale_dtype) still dequantizes into bf16
        dict(common, QG=4, QG_PAD=16, USE_DOT=True, DOT_DTYPE=tl.bfloat16, q="*bf16", cache="bf16", scales="fp16"),
        dict(common, QG=4, QG_PAD=16, USE_DOT=True, DOT_DTYPE=tl.bfloat16, q="*bf16", cache="bf16", scales="fp16",
             BLOCK_N=128, NUM_STAGES=2, SWAP_AB=True, RING_N=32),
    ]
    specs = []
    for v in variants:
        q_ty, cache_ty = v.pop("q"), v.pop("cache")
        scale_ty = v.pop("scales", cache_ty)
        o_ty = "*fp32" if v["SPLIT"] else q_ty
        ptrs = dict(q_ptr=q_ty, kc_ptr="*i32", ks_ptr="*" + scale_ty, kz_ptr="*" + scale_ty, vc_ptr="*i32",
                    vs_ptr="*" + scale_ty, vz_ptr="*" + scale_ty, kr_ptr="*" + cache_ty, vr_ptr="*" + cache_ty,
                    block_table_ptr="*i32", slots_ptr="*i32", seq_lens_ptr="*i32", o_ptr=o_ty,
                    lse_ptr="*fp32", qk_scale="fp32", num_splits="i32")
        warps = 1 if v.get("SWAP_AB") else 8 if v["QG"] == 1 else 4
        specs.append((kernel._decode_attention_kernel, ptrs, v, dict(num_warps=warps)))
    from kivi_kernels.decode_attention.kernel_gluon import _decode_attention_fma_kernel

    gluon_ptrs = dict(specs[0][1], o_ptr="*fp32")
    gluon_consts = dict(GROUP=32, RESIDUAL=128, PAGE=128, SPLIT=True, stride_kc_w=128, stride_ks_g=128,
                        stride_vc_t=8, stride_vs_t=4, stride_res_t=128)
    specs.append((_decode_attention_fma_kernel, gluon_ptrs, gluon_consts, dict(num_warps=1)))
    specs.append((_decode_attention_fma_kernel, gluon_ptrs, dict(gluon_consts, BLOCK_N=64, SPLIT=False),
                  dict(num_warps=1, maxnreg=168)))
    aligned = [a for a in _decode_attention_fma_kernel.arg_names if a.endswith("_ptr") or a.startswith("stride_")]
    specs.append((_decode_attention_fma_kernel, gluon_ptrs, dict(gluon_consts, BLOCK_N=64, ASYNC=True),
                  dict(num_warps=1, maxnreg=ops_fma.FMA_MAXNREG, aligned=aligned)))  # the default launch
    for asynchronous in (True, False):  # version 13's step in both loops
        specs.append((_decode_attention_fma_kernel, gluon_ptrs,
                      dict(gluon_consts, BLOCK_N=64, ASYNC=asynchronous, MAGIC=True),
                      dict(num_warps=1, maxnreg=ops_fma.FMA_MAXNREG, aligned=aligned)))
    from kivi_kernels.decode_attention.kernel_mma import _decode_attention_mma_kernel

    specs.append((_decode_attention_fma_kernel, gluon_ptrs, dict(gluon_consts, BLOCK_N=64, ASYNC=True, ROW_MAJOR=True),
                  dict(num_warps=1, maxnreg=ops_fma.FMA_MAXNREG, aligned=aligned)))  # grid (H, B, splits)
    mma_consts = dict(gluon_consts, QG=4)
    mma_aligned = [a for a in _decode_attention_mma_kernel.arg_names if a.endswith("_ptr") or a.startswith("stride_")]
    specs.append((_decode_attention_mma_kernel, gluon_ptrs, dict(mma_consts, PDL=True),  # a split call on sm_90
                  dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))
    s16_ptrs = dict(gluon_ptrs, ks_ptr="*fp16", kz_ptr="*fp16", vs_ptr="*fp16", vz_ptr="*fp16")
    specs.append((_decode_attention_mma_kernel, s16_ptrs, dict(mma_consts, ROW_MAJOR=True, STEP_BLOCKS=2),
                  dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))  # the engine's launch
    specs.append((_decode_attention_mma_kernel, s16_ptrs, mma_consts,  # bf16 query and ring, fp16 scales
                  dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))
    specs.append((_decode_attention_mma_kernel, s16_ptrs, dict(mma_consts, STAGES=3),  # two blocks in flight
                  dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))
    for v_copy, stages in ((0, 2), (1, 3)):  # transposed (version 15), sectors with 3 stages
        specs.append((_decode_attention_mma_kernel, s16_ptrs, dict(mma_consts, V_COPY=v_copy, STAGES=stages),
                      dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))
    fp16_ptrs = {k: v.replace("bf16", "fp16") for k, v in gluon_ptrs.items()}
    specs.append((_decode_attention_mma_kernel, dict(fp16_ptrs, o_ptr="*fp16"),
                  dict(mma_consts, QG=1, GROUP=64, SPLIT=False, stride_vs_t=2),
                  dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))
    for bits4 in (dict(mma_consts, BITS=4, V_COPY=0, stride_vc_t=16), dict(mma_consts, BITS=4, V_COPY=0, QG=8,
                                                                            stride_vc_t=16, STAGES=3),
                  dict(mma_consts, BITS=4, V_COPY=1, stride_vc_t=16), dict(mma_consts, BITS=4, V_COPY=1, QG=8,
                                                                           stride_vc_t=16, STAGES=3)):
        specs.append((_decode_attention_mma_kernel, s16_ptrs, bits4,  # 4-bit caches (kernel_mma_frag4.py)
                      dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))
    specs.append((_decode_attention_mma_kernel, dict(fp16_ptrs, o_ptr="*fp16"),
                  dict(mma_consts, QG=1, GROUP=64, SPLIT=False, stride_vs_t=2, BITS=4, V_COPY=1, stride_vc_t=16),
                  dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))
    for pairs in (dict(mma_consts, STEP_BLOCKS=2), dict(mma_consts, STEP_BLOCKS=2, QG=1, SPLIT=False, STAGES=3),
                  dict(mma_consts, STEP_BLOCKS=2, BITS=4, V_COPY=1, QG=8, stride_vc_t=16),
                  dict(mma_consts, STEP_BLOCKS=2, V_COPY=0), dict(mma_consts, STEP_BLOCKS=2, BITS=4, V_COPY=0,
                                                                  GROUP=64, stride_vc_t=16, stride_vs_t=2)):
        specs.append((_decode_attention_mma_kernel, s16_ptrs, pairs,  # two blocks a step (version 25)
                      dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))
    specs.append((_decode_attention_mma_kernel, s16_ptrs,  # version 27: the engine's unsplit launch, the ring read
                  dict(mma_consts, ROW_MAJOR=True, STEP_BLOCKS=2, RING_PASS=True),  # by the ring pass beside it
                  dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))
    specs.append((_decode_attention_mma_kernel, fp16_ptrs,
                  dict(mma_consts, QG=1, BITS=4, V_COPY=1, stride_vc_t=16, RING_PASS=True),
                  dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))
    from kivi_kernels.decode_attention.kernel_ring import _ring_partial_kernel

    for dtype, qg in (("bf16", 1), ("fp16", 4)):  # the ring pass
        specs.append((_ring_partial_kernel, dict(q_ptr="*" + dtype, kr_ptr="*" + dtype, vr_ptr="*" + dtype,
                                                 slots_ptr="*i32", seq_lens_ptr="*i32", o_ptr="*fp32",
                                                 lse_ptr="*fp32", qk_scale="fp32"),
                      dict(GROUP=32, RESIDUAL=128, HEAD_DIM=128, QG=qg, QG_PAD=16, BLOCK_N=32, USE_DOT=True,
                           DOT_DTYPE=getattr(tl, {"bf16": "bfloat16", "fp16": "float16"}[dtype]),
                           INPUT_PRECISION=None, ROW_MAJOR=True, stride_res_t=128),
                      dict(num_warps=2)))
    specs.append((attend._merge_splits_kernel, dict(ws_o_ptr="*fp32", ws_lse_ptr="*fp32", o_ptr="*bf16"),
                  dict(NUM_SPLITS=5, SPLITS_PAD=8, HEAD_DIM=128), dict(num_warps=2)))
    specs.append((attend._merge_splits_kernel, dict(ws_o_ptr="*fp32", ws_lse_ptr="*fp32", o_ptr="*bf16"),
                  dict(NUM_SPLITS=126, SPLITS_PAD=128, HEAD_DIM=128, BLOCK_D=16, WAIT_PRIOR=True),
                  dict(num_warps=2, launch_pdl=True)))  # the programmatic dependent of a split call
    for result in compile_for_sm90_many(specs):
        assert result["cubin_bytes"] > 0, result
