"""store_prefill / store_decode (docs/design.md ops 1 and 2): reference vs a per-group oracle, Triton vs
reference, decode appends vs one prefill. Launch options, validation and the H200 compile check are in
test_kv_store_launch.py; shared pieces in kv_store_cases.py.

On the CPU the Triton kernels run in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1), where bf16
arithmetic is wrong, so bf16 is tested only on a GPU. Pools are poisoned (NaN / -1) beforehand, and pools
are compared whole, so any write outside the target pages/slots fails.
"""

import pytest
import torch

from kivi_kernels import packing
from kivi_kernels.kv_store import ops, reference
from tests.kv_store_cases import (
    BACKENDS,
    DEVICE,
    POOLS,
    SPEC,
    assert_same,
    cfg_of,
    make_batch,
    make_pools,
    nq_of,
    oracle_prefill,
    run_prefill,
    seeded,
)

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
