"""Shared pieces of the decode_attention tests (test_decode_attention.py, _gluon.py, _launch.py): cases,
cache builders, the launcher call, comparisons.

Caches are built with kivi_kernels/packing.py directly: each row's keys/values are quantized page by page into
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

import math  # noqa: E402
import zlib  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from kivi_kernels import packing  # noqa: E402
from kivi_kernels.decode_attention import decode_attention, reference  # noqa: E402

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


def record_launches(monkeypatch, module, name):
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    monkeypatch.setattr(module, name, Recorder())
    return calls
