"""decode_attention (docs/design.md op 3): reference vs an independent naive computation, Triton (the
interpreter on the CPU) vs reference, argument checks, and an H200 compile check that needs no GPU.

Caches are built with kernels/packing.py directly: each row's keys/values are quantized page by page into
random page ids (a permuted, non-identity block table), the residual ring holds tokens [nq, L) at slot t % R.
Every byte no row owns (unused pages, trailing groups of a row's last page, unused ring slots, block-table
entries past a row's pages) is poisoned with NaN / garbage, so reading anything outside [0, L) fails.

Tolerances (max |out - ref| over outputs of magnitude ~1): fp32 2e-5; fp16 6e-3 (keys, values and
probabilities are rounded to fp16 for tl.dot); bf16 4e-2 (the same in bf16; GPU only, the interpreter
computes bf16 arithmetic wrongly so there bf16 dots run in fp32 and the tolerance is loose).
"""

import os

import torch

if not torch.cuda.is_available():  # before kernels are imported (conftest does it first); a GPU runs them compiled
    os.environ.setdefault("TRITON_INTERPRET", "1")

import inspect  # noqa: E402
import math  # noqa: E402
import zlib  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels import packing  # noqa: E402
from kernels.decode_attention import attend, decode_attention, kernel, reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 1.5e-2, torch.bfloat16: 6e-2}
torch.set_num_threads(1)


@dataclass
class Case:
    lens: tuple[int, ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    k_bits: int
    v_bits: int
    page_size: int = 128
    group_size: int = 32
    residual: int = 128
    dtype: torch.dtype = torch.float32
    num_splits: int | None = None
    block_n: int | None = None
    use_dot: bool | None = None
    extra: tuple = ()  # more launcher tuning: (name, value) pairs
    scale_dtype: torch.dtype | None = None  # scales and zero points (None: dtype; KiviConfig.scale_dtype)
    spread: float = 1.0  # keys and values scaled by this (wide groups)

    @property
    def id(self) -> str:
        t = "T" + "_".join(map(str, self.lens)) if len(set(self.lens)) > 1 else f"T{self.lens[0]}"
        extra = "" if self.page_size == 128 else f"-P{self.page_size}"
        extra += "" if self.residual == 128 else f"-R{self.residual}"
        extra += "" if self.num_splits is None else f"-S{self.num_splits}"
        extra += "" if self.block_n is None else f"-N{self.block_n}"
        extra += "" if self.use_dot is None else ("-dot" if self.use_dot else "-bcast")
        extra += "".join(f"-{k}{int(v)}" for k, v in self.extra)
        extra += "" if self.scale_dtype in (None, self.dtype) else "-s16"
        extra += "" if self.spread == 1.0 else f"-x{self.spread:g}"
        dt = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype]
        return (f"B{len(self.lens)}-{t}-Hq{self.q_heads}-H{self.kv_heads}-D{self.head_dim}"
                f"-k{self.k_bits}v{self.v_bits}{extra}-{dt}")


def seeded(key: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(key.encode()))


def build_cache(case: Case, gen: torch.Generator):
    """Quantized KIVI cache of the rows of `case` + the dequantized keys/values of each row in token order."""
    G, R, P, D, H = case.group_size, case.residual, case.page_size, case.head_dim, case.kv_heads
    kb, vb, dt = case.k_bits, case.v_bits, case.dtype
    sdt = case.scale_dtype or dt
    B = len(case.lens)
    S = B + 2
    nqs = [G * math.ceil(max(0, L - R) / G) for L in case.lens]
    npages = [-(-nq // P) for nq in nqs]
    N = sum(npages) + 3
    max_pages = max(npages) + 2
    cache = dict(
        k_codes=torch.randint(-2**31, 2**31 - 1, (N, H, P * kb // 32, D), generator=gen, dtype=torch.int32),
        k_scale=torch.full((N, H, P // G, D), math.nan, dtype=sdt),
        k_zero=torch.full((N, H, P // G, D), math.nan, dtype=sdt),
        v_codes=torch.randint(-2**31, 2**31 - 1, (N, H, P, D * vb // 32), generator=gen, dtype=torch.int32),
        v_scale=torch.full((N, H, P, D // G), math.nan, dtype=sdt),
        v_zero=torch.full((N, H, P, D // G), math.nan, dtype=sdt),
        k_res=torch.full((S, H, R, D), math.nan, dtype=dt),
        v_res=torch.full((S, H, R, D), math.nan, dtype=dt),
    )
    block_table = torch.randint(N + 7, 2**20, (S, max_pages), generator=gen, dtype=torch.int32)  # garbage
    slots = torch.randperm(S, generator=gen)[:B].int()
    free_pages = torch.randperm(N, generator=gen).tolist()
    rows = []
    for b, L in enumerate(case.lens):
        # KIVI-like keys: per-channel offsets and spread; values plain
        chan = torch.randn(H, 1, D, generator=gen) * 2
        keys = ((torch.randn(H, L, D, generator=gen) * (1 + chan.abs()) + chan) * case.spread).to(dt)
        values = (torch.randn(H, L, D, generator=gen) * case.spread).to(dt)
        nq, n_p, s = nqs[b], npages[b], int(slots[b])
        deq_k = deq_v = torch.zeros(H, 0, D)
        if n_p:
            pad = torch.zeros(H, n_p * P, D, dtype=dt)
            pk, pv = pad.clone(), pad.clone()
            pk[:, :nq], pv[:, :nq] = keys[:, :nq], values[:, :nq]
            kc, ks, kz = packing.quantize_keys(pk.view(H, n_p, P, D), kb, G, dtype=sdt)
            vc, vs, vz = packing.quantize_values(pv.view(H, n_p, P, D), vb, G, dtype=sdt)
            deq_k = packing.dequantize_keys(kc, ks, kz, kb, G).reshape(H, n_p * P, D)[:, :nq]
            deq_v = packing.dequantize_values(vc, vs, vz, vb, G).reshape(H, n_p * P, D)[:, :nq]
            # poison the groups / tokens of the last page that lie past nq
            tail = nq - (n_p - 1) * P
            ks[:, -1, tail // G:], kz[:, -1, tail // G:] = math.nan, math.nan
            vs[:, -1, tail:], vz[:, -1, tail:] = math.nan, math.nan
            ids = [free_pages.pop() for _ in range(n_p)]
            block_table[s, :n_p] = torch.tensor(ids, dtype=torch.int32)
            for name, x in (("k_codes", kc), ("k_scale", ks), ("k_zero", kz),
                            ("v_codes", vc), ("v_scale", vs), ("v_zero", vz)):
                cache[name][ids] = x.transpose(0, 1)
        ring = torch.arange(nq, L) % R
        cache["k_res"][s][:, ring] = keys[:, nq:]
        cache["v_res"][s][:, ring] = values[:, nq:]
        rows.append((torch.cat([deq_k, keys[:, nq:].float()], 1), torch.cat([deq_v, values[:, nq:].float()], 1)))
    seq_lens = torch.tensor(case.lens, dtype=torch.int32)
    tensors = {k: v.to(DEVICE) for k, v in cache.items()}
    tensors.update(block_table=block_table.to(DEVICE), slots=slots.to(DEVICE), seq_lens=seq_lens.to(DEVICE))
    return tensors, rows


def naive_attention(q: torch.Tensor, rows, sm_scale: float) -> torch.Tensor:
    """Per row: plain softmax attention over its dequantized tokens in order (zeros for an empty row)."""
    B, Hq, D = q.shape
    out = torch.zeros(B, Hq, D)
    for b, (keys, values) in enumerate(rows):
        if keys.shape[1] == 0:
            continue
        qg = Hq // keys.shape[0]
        k = keys.repeat_interleave(qg, 0)  # [Hq, L, D]
        v = values.repeat_interleave(qg, 0)
        p = torch.softmax((q[b].float()[:, None, :] @ k.transpose(1, 2)).squeeze(1) * sm_scale, -1)
        out[b] = (p[:, None, :] @ v).squeeze(1)
    return out


def make_inputs(case: Case):
    gen = seeded(case.id)
    cache, rows = build_cache(case, gen)
    q = torch.randn(len(case.lens), case.q_heads, case.head_dim, generator=gen).to(case.dtype).to(DEVICE)
    return q, cache, rows


def run(fn, case: Case, q, cache, out=None, **tuning):
    return fn(
        q, cache["k_codes"], cache["k_scale"], cache["k_zero"], cache["v_codes"], cache["v_scale"],
        cache["v_zero"], cache["k_res"], cache["v_res"], cache["block_table"], cache["slots"],
        cache["seq_lens"], sm_scale=case.head_dim ** -0.5, k_bits=case.k_bits, v_bits=case.v_bits,
        group_size=case.group_size, residual_length=case.residual, page_size=case.page_size, out=out, **tuning,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    diff = (actual.float().cpu() - expected.float().cpu()).abs()
    assert not diff.isnan().any(), f"{what}: NaN in output at {diff.isnan().nonzero()[:5].tolist()}"
    worst = diff.max().item()
    assert worst <= tol, (
        f"{what}: max |diff| {worst:.3g} > {tol:.3g} (mean {diff.mean().item():.3g}) at "
        f"{list(divmod(diff.argmax().item(), diff.shape[-1]))}"
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


# The Gluon FMA kernel (kernel_gluon.py): compiled only (Gluon has no interpreter), so these run on a GPU.
# MHA 2-bit D=128: odd lengths, empty rows, ring-only rows, more splits than blocks, G=16/64, R=64/192,
# pages of 256, fp32 / fp16 / bf16.
FMA_CASES = [
    Case((1000, 161, 0), 3, 3, 128, 2, 2, num_splits=2),
    Case((1000, 161, 0), 3, 3, 128, 2, 2, num_splits=2, extra=(("magic", False),)),  # version 12, fp32
    Case((700, 33, 300, 128, 129), 4, 4, 128, 2, 2, dtype=torch.float16, num_splits=3),
    Case((700, 33, 129, 2000), 2, 2, 128, 2, 2, group_size=16, dtype=torch.bfloat16, num_splits=3,
         extra=(("magic", False), ("cp_async", False))),
    Case((500, 150), 2, 2, 128, 2, 2, group_size=64, residual=192, dtype=torch.bfloat16),
    Case((333, 290), 1, 1, 128, 2, 2, group_size=16, residual=64, page_size=256, num_splits=7),
    Case((2000, 1), 2, 2, 128, 2, 2, dtype=torch.bfloat16, num_splits=40),
    Case((900, 65, 0), 2, 2, 128, 2, 2, dtype=torch.bfloat16, scale_dtype=torch.float16, num_splits=3),
    Case((1000, 161, 0, 64, 65), 3, 3, 128, 2, 2, num_splits=3, block_n=64),
    Case((700, 33), 2, 2, 128, 2, 2, group_size=16, residual=64, dtype=torch.float16, block_n=64,
         extra=(("maxnreg", 128),)),
    Case((1000, 161, 0, 64, 65, 300), 3, 3, 128, 2, 2, num_splits=3, block_n=64, extra=(("cp_async", False),)),
    Case((700, 33, 129, 2000), 2, 2, 128, 2, 2, group_size=128, residual=128, dtype=torch.float16, page_size=256,
         num_splits=5, extra=(("cp_async", True),)),
    Case((900, 77, 5), 2, 2, 128, 2, 2, group_size=16, residual=192, dtype=torch.bfloat16,
         extra=(("cp_async", True),)),
    Case((1500, 1, 200), 2, 2, 128, 2, 2, block_n=128, num_splits=2, extra=(("cp_async", True), ("maxnreg", 168))),
    Case((333, 290), 1, 1, 128, 2, 2, group_size=16, residual=64, page_size=256, num_splits=7,
         extra=(("cp_async", False),)),
    # version 13's step (kernel_gluon_magic.py), both loops: odd lengths, empty and ring-only rows, splits,
    # G=16/64/128, R=64/192, long rows, fp32 / fp16 / bf16
    Case((1000, 161, 0, 64, 65, 300), 3, 3, 128, 2, 2, num_splits=3, extra=(("magic", True),)),
    Case((700, 33, 129, 2000), 2, 2, 128, 2, 2, group_size=128, residual=128, dtype=torch.float16, page_size=256,
         num_splits=5, extra=(("magic", True),)),
    Case((900, 77, 5), 2, 2, 128, 2, 2, group_size=16, residual=192, dtype=torch.bfloat16, extra=(("magic", True),)),
    Case((500, 150), 2, 2, 128, 2, 2, group_size=64, residual=64, dtype=torch.float16, num_splits=2,
         extra=(("magic", True), ("cp_async", False))),
    Case((20000, 3000), 1, 1, 128, 2, 2, dtype=torch.float32, num_splits=1, extra=(("magic", True),)),
]
# version 13 (the default) subtracts a magic offset after its sums (kernel_gluon_magic.py): ~1e-4 of a score and
# of an output against fp32 math, so its fp32 cases get this tolerance (version 12 keeps fp32's 2e-5)
MAGIC_FP32_TOL = 5e-4


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("case", FMA_CASES, ids=lambda c: c.id)
def test_fma_kernel_matches_reference(case: Case):
    from kernels.decode_attention.ops_fma import FMA_MAGIC

    magic = dict(case.extra).get("magic", FMA_MAGIC)  # the launcher's default when the case does not say
    tol = MAGIC_FP32_TOL if magic and case.dtype == torch.float32 else TOL[case.dtype]
    check_against_reference(case, tol, block_n=case.block_n, fma=True, **dict(case.extra))


def check_against_reference(case: Case, tol: float, **knobs) -> None:
    """The launcher with these knobs against the reference, into a NaN-poisoned output (unwritten rows fail);
    rows with seq_len 0 must come back as zeros."""
    q, cache, _ = make_inputs(case)
    expected = run(reference.decode_attention, case, q, cache)
    out = torch.full(q.shape, math.nan, dtype=q.dtype, device=DEVICE)
    got = run(decode_attention, case, q, cache, out=out, num_splits=case.num_splits, **knobs)
    assert got is out
    assert_close(got, expected, tol, case.id)
    for b, L in enumerate(case.lens):
        if L == 0:
            assert (got[b] == 0).all(), "rows with seq_len 0 must be zeros"


# Version 14, the tensor-core kernel with register-built fragments (kernel_mma.py): 1 to 8 query heads per KV
# head, fp16 / bf16, odd lengths, empty and ring-only rows, splits, G=32/64, R=64/128/192, pages of 64/256.
MMA_CASES = [
    Case((1000, 161, 0, 64, 65, 300), 8, 2, 128, 2, 2, dtype=torch.bfloat16, num_splits=3),
    Case((700, 33, 129, 2000), 8, 1, 128, 2, 2, dtype=torch.float16, num_splits=5, page_size=256),
    Case((900, 77, 5), 6, 2, 128, 2, 2, group_size=64, residual=192, dtype=torch.bfloat16),
    Case((500, 150), 4, 4, 128, 2, 2, group_size=64, residual=64, dtype=torch.float16, num_splits=2),
    Case((333, 290, 96), 14, 2, 128, 2, 2, page_size=64, dtype=torch.bfloat16, num_splits=7),
    Case((2000, 1), 6, 2, 128, 2, 2, dtype=torch.float16, num_splits=40),
    Case((20000, 3000), 4, 1, 128, 2, 2, dtype=torch.bfloat16, num_splits=1),
    Case((1000, 161, 0), 8, 8, 128, 2, 2, dtype=torch.float16),
    # bf16 queries and ring with fp16 scales and zero points (KiviConfig.scale_dtype="float16")
    Case((1000, 161, 0, 64, 65, 300), 8, 2, 128, 2, 2, dtype=torch.bfloat16, scale_dtype=torch.float16,
         num_splits=3),
    Case((900, 77, 5), 4, 4, 128, 2, 2, group_size=64, residual=192, dtype=torch.bfloat16,
         scale_dtype=torch.float16),
]


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: c.id)
def test_mma_kernel_matches_reference(case: Case):
    check_against_reference(case, TOL[case.dtype], mma=True)


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("case", [MMA_CASES[i] for i in (0, 1, 5)], ids=lambda c: c.id)
def test_mma_kernel_with_three_stages_matches_reference(case: Case):
    """num_stages=3: two packed blocks in flight (odd lengths, splits, pages of 256, QG 1 and 4)."""
    check_against_reference(case, TOL[case.dtype], mma=True, num_stages=3)


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: c.id)
def test_mma_kernel_with_scores_ahead_matches_reference(case: Case):
    """score_ahead: each step scores the next block beside this block's values (3 stages; the last step scores a
    block past its split, whose result must stay unused)."""
    check_against_reference(case, TOL[case.dtype], mma=True, score_ahead=True)


@pytest.mark.skipif(DEVICE == "cpu", reason="Gluon kernels need a GPU (no interpreter mode)")
@pytest.mark.parametrize("value_copy", ["transposed", "halves", "rows", "sectors"])
@pytest.mark.parametrize("case", [MMA_CASES[i] for i in (0, 1, 5)], ids=lambda c: c.id)
def test_mma_kernel_with_each_value_copy_matches_reference(case: Case, value_copy: str):
    """Each way the value words reach shared memory: version 15's 4-byte transposed copies, version 17's 16-byte
    pieces in two halves, version 19's in token rows, version 20's in global order (kernel_mma_stage.py)."""
    check_against_reference(case, TOL[case.dtype], mma=True, value_copy=value_copy)


@pytest.mark.parametrize("mma", [None, True], ids=["default", "mma"])
def test_wide_groups_with_fp16_scales_stay_finite(mma):
    """A bf16 cache whose groups span up to ~1e5 (past fp16's range: some fp16 scales and zeros saturate at
    +-65,504): the launcher (its default path, and the tensor-core kernel on a GPU) agrees with the reference
    and stays finite. The table kernel dequantizes bf16 caches into bf16, so wide groups cannot overflow it."""
    if mma and DEVICE == "cpu":
        pytest.skip("Gluon kernels need a GPU (no interpreter mode)")
    case = Case((700, 300), 8, 2, 128, 2, 2, dtype=torch.bfloat16, scale_dtype=torch.float16, spread=2e4)
    q, cache, _ = make_inputs(case)
    q = (q.float() * 1e-3).to(q.dtype)  # scores of a few units, not one-hot: the check compares whole rows
    assert cache["k_zero"][~cache["k_zero"].isnan()].abs().max() == 65504  # some group did saturate
    expected = run(reference.decode_attention, case, q, cache).float()
    got = run(decode_attention, case, q, cache, mma=mma).float()
    assert expected.isfinite().all() and got.isfinite().all()
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()


def test_mma_kernel_rejects_ineligible_calls():
    case = Case((40,), 2, 1, 64, 2, 2)  # head_dim 64, fp32, and the interpreter on the CPU
    q, cache, _ = make_inputs(case)
    with pytest.raises(ValueError, match="mma needs"):
        run(decode_attention, case, q, cache, mma=True)
    for mma in (None, False):  # the knob is checked on every path, not only where the mma kernel runs
        with pytest.raises(ValueError, match="value_copy must be one of"):
            run(decode_attention, case, q, cache, mma=mma, value_copy="natural")


def _record_launches(monkeypatch, module, name):
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    monkeypatch.setattr(module, name, Recorder())
    return calls


def test_mma_launcher_passes_every_kernel_argument(monkeypatch):
    """launch_mma's host side (no GPU needed): the recorded launch names every parameter of the Gluon kernel
    exactly once, with the grid, query-group size, register cap and split count the launcher chose."""
    from kernels.decode_attention import kernel_mma, ops_mma

    calls = _record_launches(monkeypatch, ops_mma, "_decode_attention_mma_kernel")
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
    splits = grid[2]
    assert grid[:2] == (3, 2) and splits > 1 and kw["SPLIT"] is True and kw["num_splits"] == splits
    assert kw["QG"] == 4 and kw["GROUP"] == 32 and kw["num_warps"] == 1 and kw["maxnreg"] == ops_mma.MMA_MAXNREG
    assert kw["STAGES"] == ops_mma.MMA_STAGES and kw["V_COPY"] == ops_mma.VALUE_COPIES[ops_mma.MMA_VALUE_COPY]
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152, stages=3, value_copy="halves")
    assert calls[-1][2]["STAGES"] == 3 and calls[-1][2]["V_COPY"] == 1
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152, value_copy="sectors")
    assert calls[-1][2]["V_COPY"] == 3
    with pytest.raises(ValueError, match="value_copy must be one of"):
        ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152, value_copy="natural")
    padded = torch.zeros(*args[3].shape[:3], 16, dtype=args[3].dtype)[..., :8]  # token rows 64 bytes apart
    ops_mma.launch_mma(q, *args[:3], padded, *args[4:], out, 128 ** -0.5, 32, 128, 128, 1, 1152, value_copy="rows")
    assert calls[-1][2]["V_COPY"] == 0  # 16-byte copies need each token's 8 words in a row
    assert kw["SCORE_AHEAD"] == ops_mma.MMA_SCORE_AHEAD
    ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152, score_ahead=True)
    assert calls[-1][2]["SCORE_AHEAD"] is True and calls[-1][2]["STAGES"] == 3  # scores ahead take 3 stages
    with pytest.raises(ValueError, match="score_ahead needs num_stages=3"):
        ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152, stages=2, score_ahead=True)
    with pytest.raises(ValueError, match="num_stages"):
        ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152, stages=4)
    assert pos[0] is q and pos[12] is not out  # with splits the kernel writes the fp32 workspace
    with pytest.raises(ValueError, match="maxnreg"):
        ops_mma.launch_mma(q, *args, out, 128 ** -0.5, 32, 128, 128, 1, 1152, maxnreg=100)


def test_mma_eligibility_follows_the_kernels_limits():
    """mma_eligible on host tensors: what the kernel supports, and page tensors cp.async can copy whole."""
    from kernels.decode_attention import ops_mma

    case = Case((300,), 8, 2, 128, 2, 2, dtype=torch.bfloat16)
    q, cache, _ = make_inputs(case)
    pages = tuple(cache[n] for n in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"))
    ok = dict(k_bits=2, v_bits=2, group_size=32, residual_length=128, page_size=128, qg=4)
    from kernels.decode_attention import common

    compiled = q.is_cuda and not common.interpreting() and ops_mma._decode_attention_mma_kernel is not None
    assert ops_mma.mma_eligible(q, pages, cache["k_res"], **ok) == compiled  # CPU tensors never are
    for bad in (dict(k_bits=4), dict(v_bits=4), dict(qg=9), dict(group_size=128), dict(page_size=96),
                dict(residual_length=48)):
        assert not ops_mma.mma_eligible(q, pages, cache["k_res"], **{**ok, **bad}), bad
    assert not ops_mma.mma_eligible(q.float(), pages, cache["k_res"], **ok)  # fp32 queries take the FMA kernel
    assert ops_mma._blocks_aligned(pages[4]) and ops_mma._blocks_aligned(pages[5])
    assert not ops_mma._blocks_aligned(pages[4].transpose(2, 3))  # rows must be contiguous


def test_launcher_defaults_to_the_mma_kernel_for_large_16bit_calls(monkeypatch):
    """ops.decode_attention's choice (host side): large eligible calls, MHA and GQA, take launch_mma; small ones
    and calls that set another path's knobs do not. (The cases here are small, so the size rule is patched to
    call them large; the rule itself is checked on its own.)"""
    from kernels.decode_attention import ops

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
    with pytest.raises(ValueError, match="mma needs"):
        monkeypatch.setattr(ops, "mma_eligible", lambda *a, **k: False)
        run(decode_attention, case, q, cache, out=out, mma=True)


def test_reference_takes_the_launchers_arguments():
    """The reference is the spec and the CPU path: it accepts every argument the launcher does, in order."""
    assert (list(inspect.signature(reference.decode_attention).parameters)
            == list(inspect.signature(decode_attention).parameters))


def test_fma_kernel_rejects_ineligible_calls():
    case = Case((300,), 4, 2, 128, 2, 2)  # two query heads per KV head
    q, cache, _ = make_inputs(case)
    with pytest.raises(ValueError, match="fma needs"):
        run(decode_attention, case, q, cache, fma=True)


def test_fma_launcher_passes_every_kernel_argument(monkeypatch):
    """launch_fma's host side (no GPU needed): the recorded launch names every parameter of the Gluon kernel
    exactly once, with the grid, block size and register cap the launcher chose."""
    from kernels.decode_attention import kernel_gluon, ops_fma

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
    assert grid == (2, 3, 1)
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
    from kernels.decode_attention.common import choose_num_splits

    cpu = torch.device("cpu")
    assert choose_num_splits(64 * 8, 4096, cpu) == 1  # enough programs already
    assert choose_num_splits(1 * 8, 32768, cpu) == 32  # one row, long context: many splits
    assert choose_num_splits(1 * 8, 512, cpu) == 2  # short context caps the split count
    assert choose_num_splits(8 * 8, 4096, cpu) == 5


def test_wave_splits_fill_whole_waves():
    """wave_splits: the fewest splits whose waves of `slots` programs are within 5% of the ideal programs / slots,
    else the cap (on random calls), and the examples of its docstring (512 programs, 1,056 slots: 2 splits, one
    wave, instead of 5; 32 programs: 32 splits, not 66)."""
    import math
    import random

    from kernels.decode_attention.common import MIN_TOKENS_PER_SPLIT, wave_splits

    assert wave_splits(512, 4352, 1056, 128) == 2 and wave_splits(32, 131_200, 1056, 128) == 32
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    for _ in range(300):
        programs, max_tokens = rng.randrange(1, 5000), rng.randrange(64, 140_000)
        slots, max_splits = rng.choice([528, 1056, 1584]), rng.choice([32, 128])
        splits = wave_splits(programs, max_tokens, slots, max_splits)
        cap = max(1, min(max_tokens // MIN_TOKENS_PER_SPLIT, max_splits))
        fits = lambda s, p=programs, n=slots: math.ceil(p * s / n) / s <= 1.05 * p / n
        assert 1 <= splits <= cap, seed
        assert splits == cap or fits(splits), seed
        assert not any(fits(s) for s in range(1, splits)), seed


def test_kernels_compile_for_h200():
    from kernels.decode_attention import ops_fma, ops_mma
    from tests.compile_util import compile_for_sm90_many

    common = dict(K_BITS=2, V_BITS=2, GROUP=32, RESIDUAL=128, PAGE=128, HEAD_DIM=128, BLOCK_N=64,
                  SPLIT=True, NUM_STAGES=3, LAZY_L=True, KEY_VEC=1, INPUT_PRECISION=None, USE_ASM=True,
                  stride_kc_w=128, stride_ks_g=128, stride_vc_t=8, stride_vs_t=4, stride_res_t=128)
    variants = [
        dict(common, QG=4, QG_PAD=16, USE_DOT=True, DOT_DTYPE=tl.bfloat16, q="*bf16", cache="bf16"),
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
    from kernels.decode_attention.kernel_gluon import _decode_attention_fma_kernel

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
    from kernels.decode_attention.kernel_mma import _decode_attention_mma_kernel

    mma_consts = dict(gluon_consts, QG=4)
    mma_aligned = [a for a in _decode_attention_mma_kernel.arg_names if a.endswith("_ptr") or a.startswith("stride_")]
    specs.append((_decode_attention_mma_kernel, gluon_ptrs, mma_consts,
                  dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))
    s16_ptrs = dict(gluon_ptrs, ks_ptr="*fp16", kz_ptr="*fp16", vs_ptr="*fp16", vz_ptr="*fp16")
    specs.append((_decode_attention_mma_kernel, s16_ptrs, mma_consts,  # bf16 query and ring, fp16 scales
                  dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))
    specs.append((_decode_attention_mma_kernel, s16_ptrs, dict(mma_consts, STAGES=3),  # two blocks in flight
                  dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))
    specs.append((_decode_attention_mma_kernel, s16_ptrs, dict(mma_consts, STAGES=3, SCORE_AHEAD=True),  # version 18
                  dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))
    for v_copy, stages in ((0, 2), (1, 2), (3, 2), (3, 3)):  # versions 15, 17, 20 (19's is the default)
        specs.append((_decode_attention_mma_kernel, s16_ptrs, dict(mma_consts, V_COPY=v_copy, STAGES=stages),
                      dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))
    fp16_ptrs = {k: v.replace("bf16", "fp16") for k, v in gluon_ptrs.items()}
    specs.append((_decode_attention_mma_kernel, dict(fp16_ptrs, o_ptr="*fp16"),
                  dict(mma_consts, QG=1, GROUP=64, SPLIT=False, stride_vs_t=2),
                  dict(num_warps=1, maxnreg=ops_mma.MMA_MAXNREG, aligned=mma_aligned)))
    specs.append((attend._merge_splits_kernel, dict(ws_o_ptr="*fp32", ws_lse_ptr="*fp32", o_ptr="*bf16"),
                  dict(NUM_SPLITS=5, SPLITS_PAD=8, HEAD_DIM=128), dict(num_warps=2)))
    for result in compile_for_sm90_many(specs):
        assert result["cubin_bytes"] > 0, result
