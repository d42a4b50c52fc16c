"""store_prefill / store_decode (docs/design.md ops 1 and 2): reference vs a per-group oracle, Triton vs
reference, decode appends vs one prefill, and an H200 compile check that needs no GPU.

On the CPU the Triton kernels run in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1), where bf16
arithmetic is wrong, so bf16 is tested only on a GPU. Pools are poisoned (NaN / -1) beforehand, and pools
are compared whole, so any write outside the target pages/slots fails.
"""

import os

import torch

if not torch.cuda.is_available():  # before kernels are imported (conftest does it first); a GPU runs them compiled
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from kernels import packing  # noqa: E402
from kernels.kv_store import ops, reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
POOLS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_res", "v_res")
torch.set_num_threads(1)


def _on_cpu(fn):
    """Run a reference op on CPU copies and write the pools (the last 8 arguments) back. The CPU reference is
    the bit-exact spec: on CUDA, torch divides by a Python scalar through its reciprocal, so packing.py's fp32
    scale there can differ by an ulp (and a code, rarely) from true division, which the kernel implements."""

    def run(*args, **kwargs):
        cpu = [a.cpu() for a in args]
        fn(*cpu, **kwargs)
        for a, c in zip(args[-8:], cpu[-8:], strict=True):
            a.copy_(c)

    return run


SPEC = SimpleNamespace(store_prefill=_on_cpu(reference.store_prefill), store_decode=_on_cpu(reference.store_decode))
BACKENDS = {"reference": SPEC, "triton": ops}


def seeded(request) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def make_pools(N, S, H, D, cfg, dtype, scale_dtype=None):
    """Poisoned pools: NaN for float tensors, -1 for int32 codes; scales and zeros in scale_dtype (default
    dtype)."""
    kb, vb, G, R, P = (cfg[k] for k in ("k_bits", "v_bits", "group_size", "residual_length", "page_size"))
    shapes = dict(k_codes=(N, H, P * kb // 32, D), k_scale=(N, H, P // G, D), k_zero=(N, H, P // G, D),
                  v_codes=(N, H, P, D * vb // 32), v_scale=(N, H, P, D // G), v_zero=(N, H, P, D // G),
                  k_res=(S, H, R, D), v_res=(S, H, R, D))
    kind = lambda n: torch.int32 if "codes" in n else dtype if "res" in n else scale_dtype or dtype
    return {n: torch.full(s, -1 if "codes" in n else math.nan, device=DEVICE, dtype=kind(n))
            for n, s in shapes.items()}


def make_batch(gen, B, H, T, D, lengths, dtype, num_pages):
    """Non-contiguous key/value [B, H, T, D] (a transposed [B, T, H, D]) with NaN padding around the real
    tokens (left padding, plus right padding on odd rows); random distinct slots and page ids."""
    lengths = torch.tensor(lengths, dtype=torch.int32)
    right = torch.tensor([(T - int(n)) // 3 if b % 2 else 0 for b, n in enumerate(lengths)], dtype=torch.int32)
    starts = T - lengths - right
    kv = []
    for _ in range(2):
        x = torch.randn(B, T, H, D, generator=gen).to(dtype)
        pos = torch.arange(T)
        pad = (pos < starts[:, None]) | (pos >= (starts + lengths)[:, None])  # [B, T]
        kv.append(x.masked_fill(pad[:, :, None, None], math.nan).to(DEVICE).transpose(1, 2))
    S = B + 2
    slots = torch.randperm(S, generator=gen)[:B].int()
    max_pages = num_pages // S
    block_table = torch.randperm(num_pages, generator=gen)[: S * max_pages].view(S, max_pages).int()
    dev = lambda t: t.to(DEVICE)
    return (*kv, dev(starts), dev(lengths), dev(slots), dev(block_table))


def nq_of(L: int, cfg) -> int:
    G, R = cfg["group_size"], cfg["residual_length"]
    return G * -(-max(0, L - R) // G)


def oracle_prefill(key, value, starts, lengths, slots, block_table, pools, cfg):
    """Straightforward loops on kernels/packing.py: one group, then one residual token at a time."""
    kb, vb, G, R, P = (cfg[k] for k in ("k_bits", "v_bits", "group_size", "residual_length", "page_size"))
    dtype = pools["k_scale"].dtype
    for b in range(key.shape[0]):
        s, start, L = int(slots[b]), int(starts[b]), int(lengths[b])
        nq = nq_of(L, cfg)
        for t0 in range(0, nq, G):
            page, off = int(block_table[s, t0 // P]), t0 % P
            k = key[b, :, start + t0 : start + t0 + G]  # [H, G, D]
            v = value[b, :, start + t0 : start + t0 + G]
            kc, ks, kz = packing.quantize_keys(k, kb, G, dtype)
            vc, vs, vz = packing.quantize_values(v, vb, G, dtype)
            pools["k_codes"][page, :, off * kb // 32 : (off + G) * kb // 32] = kc
            pools["k_scale"][page, :, off // G] = ks[:, 0]
            pools["k_zero"][page, :, off // G] = kz[:, 0]
            pools["v_codes"][page, :, off : off + G] = vc
            pools["v_scale"][page, :, off : off + G] = vs
            pools["v_zero"][page, :, off : off + G] = vz
        for t in range(nq, L):
            pools["k_res"][s, :, t % R] = key[b, :, start + t]
            pools["v_res"][s, :, t % R] = value[b, :, start + t]


def assert_same(got: dict, want: dict, names=POOLS):
    """Exact equality, NaN (poison) included; prints where values differ."""
    for n in names:
        a, b = got[n], want[n]
        nan_a = a.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
        nan_b = b.isnan() if b.is_floating_point() else torch.zeros_like(b, dtype=torch.bool)
        bad = (nan_a != nan_b) | (~nan_a & ~nan_b & (a != b))
        if bad.any():
            idx = bad.nonzero()[:5].tolist()
            diff = (a.double() - b.double())[~nan_a & ~nan_b].abs()
            raise AssertionError(f"{n}: {int(bad.sum())} of {a.numel()} differ (max |diff| {diff.max():.3g}, "
                                 f"mean {diff.mean():.3g}); first at {idx}: got {[a[tuple(i)].item() for i in idx]}"
                                 f" want {[b[tuple(i)].item() for i in idx]}")


def cfg_of(kb, vb, G=32, R=128, P=64):
    return dict(k_bits=kb, v_bits=vb, group_size=G, residual_length=R, page_size=P)


def run_prefill(mod, batch, pools, cfg):
    mod.store_prefill(*batch, *(pools[n] for n in POOLS), **cfg)


# id, B, H, lengths, T, D, (kb, vb, G, R, P)
REF_CASES = [
    ("B1-T1-D64", 1, 2, [1], 1, 64, (2, 4, 32, 128, 64)),
    ("B1-T31-D128", 1, 2, [31], 31, 128, (4, 2, 32, 128, 64)),
    ("B3-T33-D64", 3, 2, [33, 1, 31], 40, 64, (2, 2, 16, 32, 48)),
    ("B3-T129-D128", 3, 3, [127, 129, 60], 140, 128, (2, 4, 32, 128, 64)),
    ("B1-T300-D64", 1, 3, [300], 300, 64, (4, 4, 32, 128, 64)),
    ("B3-T300-D64", 3, 2, [300, 129, 0], 310, 64, (2, 4, 32, 64, 32)),
    ("B3-T300-D128", 3, 1, [33, 300, 127], 305, 128, (4, 2, 16, 32, 48)),
    ("B1-T1000-D64", 1, 3, [1000], 1003, 64, (2, 4, 32, 128, 64)),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", REF_CASES, ids=[c[0] for c in REF_CASES])
def test_reference_prefill_matches_oracle(request, case, dtype):
    _, B, H, lengths, T, D, bits = case
    cfg = cfg_of(*bits)
    batch = make_batch(seeded(request), B, H, T, D, lengths, dtype, num_pages=(B + 2) * 20)
    got, want = make_pools((B + 2) * 20, B + 2, H, D, cfg, dtype), make_pools((B + 2) * 20, B + 2, H, D, cfg, dtype)
    run_prefill(reference, batch, got, cfg)
    oracle_prefill(*batch, want, cfg)
    assert_same(got, want)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bf16_keys_with_fp16_scales(request, backend):
    """KiviConfig.scale_dtype="float16" on a bf16 model: both backends store what the oracle stores (scales
    and zeros rounded to fp16, the ring in bf16). The interpreter has no bf16, so Triton runs on a GPU only."""
    if backend == "triton" and DEVICE == "cpu":
        pytest.skip("bf16 under the Triton interpreter")
    B, H, lengths, T, D = 3, 2, [300, 1, 160], 301, 128
    cfg = cfg_of(2, 4, 32, 128, 64)
    gen = seeded(request)
    batch = make_batch(gen, B, H, T, D, lengths, torch.bfloat16, num_pages=(B + 2) * 12)
    key, value = batch[0], batch[1]
    outliers = torch.rand(key.shape, generator=gen) < 0.002  # past fp16's range: saturate, never inf
    key[outliers.to(key.device) & ~key.isnan()] = 3e5  # (the NaN padding stays poison)
    value[outliers.flip(0).to(value.device) & ~value.isnan()] = -2e5
    got, want = (make_pools((B + 2) * 12, B + 2, H, D, cfg, torch.bfloat16, torch.float16) for _ in range(2))
    run_prefill(reference if backend == "reference" else ops, batch, got, cfg)
    oracle_prefill(*batch, want, cfg)
    assert got["k_scale"].dtype == torch.float16 and got["k_res"].dtype == torch.bfloat16
    assert_same(got, want)
    used = [got[n][~got[n].isnan()] for n in ("k_scale", "k_zero", "v_scale", "v_zero")]
    assert all(t.numel() and t.isfinite().all() for t in used)
    assert max(t.abs().max() for t in used) == 65504  # some group did saturate


def row_pages(pools, block_table, slot, nq, cfg):
    """Gather a row's packed store back into token order: dequantized keys, values [H, nq, D] (fp32)."""
    kb, vb, G, P = cfg["k_bits"], cfg["v_bits"], cfg["group_size"], cfg["page_size"]
    pages = block_table[slot, : -(-nq // P)].long()
    cat = lambda n, d: torch.cat(list(pools[n][pages]), dim=d)  # pages [np, H, ...] -> along dim d of [H, ...]
    k = packing.dequantize_keys(cat("k_codes", 1)[:, : nq * kb // 32], cat("k_scale", 1)[:, : nq // G],
                                cat("k_zero", 1)[:, : nq // G], kb, G)
    v = packing.dequantize_values(cat("v_codes", 1)[:, :nq], cat("v_scale", 1)[:, :nq], cat("v_zero", 1)[:, :nq],
                                  vb, G)
    return k, v


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("bits", [(2, 4), (4, 2)], ids=["k2v4", "k4v2"])
def test_prefill_dequantizes_within_half_step(request, bits, dtype):
    """|x_hat - x| <= scale / 2, plus the rounding of zero and scale to the cache dtype: at most half an ulp
    of zero and QMAX half-ulps of scale (eps * (|zero| + QMAX * scale) with eps = finfo(dtype).eps), plus
    fp32 slop. Residual tokens are copied exactly."""
    cfg = cfg_of(*bits)
    B, H, T, D = 3, 3, 300, 64
    key, value, starts, lengths, slots, bt = batch = make_batch(seeded(request), B, H, T, D, [300, 161, 129],
                                                                dtype, num_pages=100)
    pools = make_pools(100, B + 2, H, D, cfg, dtype)
    run_prefill(reference, batch, pools, cfg)
    eps, G, R = torch.finfo(dtype).eps, cfg["group_size"], cfg["residual_length"]
    for b in range(B):
        s, st, L = int(slots[b]), int(starts[b]), int(lengths[b])
        nq = nq_of(L, cfg)
        assert nq > 0
        k_hat, v_hat = row_pages(pools, bt, s, nq, cfg)
        for x_hat, x, bits_, dim in (
            (k_hat, key[b, :, st : st + nq], cfg["k_bits"], -2),
            (v_hat, value[b, :, st : st + nq], cfg["v_bits"], -1),
        ):
            x = x.float()
            mn = x.unflatten(dim, (-1, G)).amin(dim=dim if dim == -1 else -2).repeat_interleave(G, dim)
            mx = x.unflatten(dim, (-1, G)).amax(dim=dim if dim == -1 else -2).repeat_interleave(G, dim)
            qmax = 2**bits_ - 1
            step = (mx - mn) / qmax
            tol = 0.5 * step + eps * (mn.abs() + qmax * step) + 1e-6 * (x.abs() + 1)
            err = (x_hat - x).abs()
            assert (err <= tol).all(), f"max err/tol {(err / tol).max():.3f}, max err {err.max():.3g}"
        t = torch.arange(nq, L, device=DEVICE)
        assert torch.equal(pools["k_res"][s][:, t % R], key[b, :, st + t])
        assert torch.equal(pools["v_res"][s][:, t % R], value[b, :, st + t])


# id, B, H, lengths, T, D, (kb, vb, G, R, P), dtype: small grids, the interpreter runs ~40 ms per program
TRITON_CASES = [
    ("B3-T140-D64-k2v4-fp16", 3, 2, [127, 129, 33], 140, 64, (2, 4, 32, 64, 32), torch.float16),
    ("B1-T300-D128-k4v2-fp32", 1, 1, [300], 300, 128, (4, 2, 32, 128, 64), torch.float32),
    ("B2-T40-D64-k2v2-fp16", 2, 3, [31, 1], 40, 64, (2, 2, 16, 16, 48), torch.float16),
    ("B2-T100-D128-k4v4-fp16", 2, 1, [100, 0], 100, 128, (4, 4, 16, 32, 32), torch.float16),
]
if DEVICE == "cuda":
    TRITON_CASES.append(("B3-T300-D128-k2v4-bf16", 3, 4, [300, 1, 129], 301, 128, (2, 4, 32, 128, 64),
                         torch.bfloat16))


@pytest.mark.parametrize("case", TRITON_CASES, ids=[c[0] for c in TRITON_CASES])
def test_triton_prefill_matches_reference(request, case):
    _, B, H, lengths, T, D, bits, dtype = case
    cfg = cfg_of(*bits)
    batch = make_batch(seeded(request), B, H, T, D, lengths, dtype, num_pages=(B + 2) * 12)
    got, want = make_pools((B + 2) * 12, B + 2, H, D, cfg, dtype), make_pools((B + 2) * 12, B + 2, H, D, cfg, dtype)
    run_prefill(ops, batch, got, cfg)
    run_prefill(SPEC, batch, want, cfg)
    assert_same(got, want)


# D, G, block_c, num_warps, loop_chunks: chunks of keys and values per program (D = 96: the last chunk is partly
# past D), and the decode store's loop over a head's chunks in one program
TUNINGS = [(96, 32, None, 1, False), (96, 32, 32, 2, False), (64, 16, 16, 1, False), (128, 32, 128, 4, False),
           (96, 32, 32, 1, True), (96, 32, None, 1, True), (64, 16, 16, 2, True), (128, 32, None, 1, True)]


@pytest.mark.parametrize("tuning", TUNINGS, ids=[f"D{t[0]}-G{t[1]}-c{t[2]}-w{t[3]}" + ("-loop" if t[4] else "")
                                                 for t in TUNINGS])
def test_triton_tuning_matches_reference(request, tuning):
    """Every channel-chunk width and warp count stores what the reference stores: a prefill, then decode
    appends through a flush (the prefill leaves a full ring behind)."""
    D, G, block_c, num_warps, loop_chunks = tuning
    cfg, dtype = cfg_of(2, 4, G=G, R=2 * G, P=2 * G), torch.float16
    B, H, N, lengths = 2, 2, 16, [3 * G + 5, 2 * G + 4]
    key, value, starts, lens, slots, bt = make_batch(seeded(request), B, H, 4 * G, D, lengths, dtype, num_pages=N)
    got, want = make_pools(N, B + 2, H, D, cfg, dtype), make_pools(N, B + 2, H, D, cfg, dtype)
    first = torch.tensor([2 * G + 1, 2 * G], dtype=torch.int32, device=DEVICE)  # row 1 flushes at its first append
    ops.store_prefill(key, value, starts, first, slots, bt, *(got[n] for n in POOLS), **cfg, block_c=block_c,
                      num_warps=num_warps)
    SPEC.store_prefill(key, value, starts, first, slots, bt, *(want[n] for n in POOLS), **cfg)
    rows = torch.arange(B, device=DEVICE)
    for step in range(4):
        pos = first + step
        seq_lens = torch.where(pos < lens, pos + 1, 0).int()
        at = (starts + pos).clamp(max=key.shape[2] - 1)
        ops.store_decode(key[rows, :, at], value[rows, :, at], seq_lens, slots, bt, *(got[n] for n in POOLS), **cfg,
                         block_c=block_c, num_warps=num_warps, loop_chunks=loop_chunks)
        SPEC.store_decode(key[rows, :, at], value[rows, :, at], seq_lens, slots, bt, *(want[n] for n in POOLS), **cfg)
    assert_same(got, want)


def test_bad_tuning_is_a_clear_error():
    cfg, dtype = cfg_of(2, 4), torch.float16
    pools = make_pools(8, 3, 2, 64, cfg, dtype)
    key = torch.zeros(1, 2, 64, dtype=dtype, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    table = torch.zeros(3, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="block_c=48"):
        ops.store_decode(key, key, one, one, table, *(pools[n] for n in POOLS), **cfg, block_c=48)
    with pytest.raises(ValueError, match="block_c=16 must be .* multiple of group_size=32"):
        ops.store_decode(key, key, one, one, table, *(pools[n] for n in POOLS), **cfg, block_c=16)
    with pytest.raises(ValueError, match="num_warps"):
        ops.store_decode(key, key, one, one, table, *(pools[n] for n in POOLS), **cfg, num_warps=3)


@pytest.mark.parametrize("backend", ["reference", "triton", "triton-loop"])
@pytest.mark.parametrize("bits", [(2, 4), (4, 2)], ids=["k2v4", "k4v2"])
def test_decode_appends_match_one_prefill(request, backend, bits):
    """Prefill part of each row, append the rest one token at a time (several flushes, rows finishing at
    different steps, one always-inactive row), then compare with store_prefill of the whole sequences:
    the pages must be identical (so flushes follow nq = G * ceil(max(0, L - R) / G)) and so must the live
    ring slots [nq, L)."""
    mod = BACKENDS[backend.removesuffix("-loop")]
    # one program per head's keys or values, going over 4 chunks of 16 channels when it flushes
    loop = dict(loop_chunks=True, block_c=16) if backend.endswith("-loop") else {}
    cfg, dtype = cfg_of(*bits, G=16, R=32, P=32), torch.float16
    B, H, D, N = 3, 2, 64, 60
    total, first = [90, 115, 0], [20, 45, 0]
    key, value, starts, lengths, slots, bt = make_batch(seeded(request), B, H, 120, D, total, dtype, num_pages=N)
    step_pools = make_pools(N, B + 2, H, D, cfg, dtype)
    mod.store_prefill(key, value, starts, torch.tensor(first, dtype=torch.int32, device=DEVICE), slots, bt,
                      *(step_pools[n] for n in POOLS), **cfg)
    rows = torch.arange(B, device=DEVICE)
    for step in range(max(t - f for t, f in zip(total, first, strict=True))):
        pos = torch.tensor([f + step for f in first], device=DEVICE)
        live = pos < lengths
        seq_lens = torch.where(live, pos + 1, 0).int()
        at = (starts + pos).clamp(max=key.shape[2] - 1)
        mod.store_decode(key[rows, :, at], value[rows, :, at], seq_lens, slots, bt,
                         *(step_pools[n] for n in POOLS), **cfg, **loop)
    whole = make_pools(N, B + 2, H, D, cfg, dtype)
    run_prefill(SPEC, (key, value, starts, lengths, slots, bt), whole, cfg)
    assert_same(step_pools, whole, names=POOLS[:6])
    R = cfg["residual_length"]
    for b in range(B):
        s, L = int(slots[b]), total[b]
        live = torch.tensor(sorted({t % R for t in range(nq_of(L, cfg), L)}), dtype=torch.long, device=DEVICE)
        assert_same({n: step_pools[n][s][:, live] for n in POOLS[6:]}, {n: whole[n][s][:, live] for n in POOLS[6:]},
                    names=POOLS[6:])
    idle = [s for s in range(B + 2) if s not in slots.tolist() or s == int(slots[2])]
    assert step_pools["k_res"][idle].isnan().all() and step_pools["v_res"][idle].isnan().all()


def test_validation_errors_name_the_tensor():
    cfg, dtype = cfg_of(2, 4), torch.float16
    pools = make_pools(8, 3, 2, 64, cfg, dtype)
    key = torch.zeros(2, 2, 40, 64, dtype=dtype, device=DEVICE)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device=DEVICE)
    bt = torch.zeros(3, 4, dtype=torch.int32, device=DEVICE)
    args = [key, key.clone(), i32(0, 0), i32(40, 3), i32(0, 1), bt, *(pools[n] for n in POOLS)]
    for mod in BACKENDS.values():
        bad = list(args)
        bad[4] = i32(0, 1).long()
        with pytest.raises(TypeError, match="slots"):
            mod.store_prefill(*bad, **cfg)
        bad = list(args)
        bad[9] = pools["v_codes"][..., :-1]
        with pytest.raises(ValueError, match=r"v_codes must have shape \(8, 2, 64, 8\), got \(8, 2, 64, 7\)"):
            mod.store_prefill(*bad, **cfg)
        with pytest.raises(ValueError, match="group_size"):
            mod.store_prefill(*args, **{**cfg, "group_size": 24})
        with pytest.raises(ValueError, match=r"key must be \[B, H, D\]"):
            mod.store_decode(key, key, i32(1, 1), i32(0, 1), bt, *(pools[n] for n in POOLS), **cfg)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU-only check")
def test_triton_on_cpu_without_interpreter_points_to_reference(monkeypatch):
    cfg, dtype = cfg_of(2, 4), torch.float16
    pools = make_pools(8, 3, 2, 64, cfg, dtype)
    key = torch.zeros(1, 2, 64, dtype=dtype)
    one = torch.ones(1, dtype=torch.int32)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="reference backend"):
        ops.store_decode(key, key, one, one, torch.zeros(3, 4, dtype=torch.int32), *(pools[n] for n in POOLS),
                         **cfg)


_COMPILE_SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from kernels.kv_store import kernel
INT_PTRS = {"starts_ptr", "lengths_ptr", "slots_ptr", "seq_lens_ptr", "block_table_ptr", "k_codes_ptr",
            "v_codes_ptr"}
out = []
for fn in (kernel.store_prefill_kernel, kernel.store_decode_kernel):
    for dtype, consts in json.loads(sys.argv[1]):
        data, scales = (dtype.split("/") * 2)[:2]  # "bf16/fp16": bf16 keys and ring, fp16 scales and zeros
        ptr_ty = lambda n: "*i32" if n in INT_PTRS else "*" + (scales if "scale" in n or "zero" in n else data)
        sig = {p.name: "constexpr" if p.is_constexpr else ptr_ty(p.name) if p.name.endswith("_ptr") else "i32"
               for p in fn.params}
        consts = {k: v for k, v in consts.items() if k in sig}  # LOOP_CHUNKS, BLOCK_D: the decode kernel's only
        src = triton.compiler.ASTSource(fn, sig, consts)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "enable_fp_fusion": False})
        ptx = k.asm["ptx"]
        out.append(dict(name=fn.__name__, dtype=dtype, cubin=len(k.asm["cubin"]),
                        ops=sorted(set(re.findall(r"\b(fma\.rn\.f32|div\.(?:rn|full|approx)\.f32|bar\.sync)", ptx)))))
print(json.dumps(out))
"""


def test_kernels_compile_for_h200(tmp_path):
    """Compile both kernels for sm_90 with the real JIT (a subprocess without TRITON_INTERPRET): no GPU
    needed. The PTX must use IEEE division and no fused multiply-add, or codes could differ from the
    reference, and the decode kernel must keep its barrier between the flush and the overwrite."""
    configs = [("fp16", dict(K_BITS=2, V_BITS=4, GROUP=32, RESIDUAL=128, PAGE=64, BLOCK_C=64, NC=1)),
               ("bf16", dict(K_BITS=4, V_BITS=2, GROUP=16, RESIDUAL=32, PAGE=48, BLOCK_C=64, NC=2)),
               ("bf16/fp16", dict(K_BITS=2, V_BITS=2, GROUP=32, RESIDUAL=128, PAGE=128, BLOCK_C=64, NC=2)),
               ("bf16/fp16", dict(K_BITS=2, V_BITS=2, GROUP=32, RESIDUAL=128, PAGE=128, BLOCK_C=32, NC=4,
                                  LOOP_CHUNKS=True, BLOCK_D=128))]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real every time
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(configs)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 8
    for r in results:
        assert r["cubin"] > 0
        assert "div.rn.f32" in r["ops"] and "fma.rn.f32" not in r["ops"], r
        assert not any(o.startswith(("div.full", "div.approx")) for o in r["ops"]), r
        if r["name"] == "store_decode_kernel":
            assert "bar.sync" in r["ops"], r
