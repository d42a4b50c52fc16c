"""Shared pieces of the kv_store tests (test_kv_store.py, test_kv_store_launch.py): poisoned pools, batches,
the per-group oracle, the CPU reference as the spec, whole-pool comparisons.

Pools are poisoned (NaN / -1) beforehand and compared whole, so any write outside the target pages/slots
fails.
"""

import os

import torch

if not torch.cuda.is_available():  # before kernels are imported (conftest does it first); a GPU runs them compiled
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import zlib  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from kivi_kernels import packing  # noqa: E402
from kivi_kernels.kv_store import ops, reference  # noqa: E402

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
    """Straightforward loops on kivi_kernels/packing.py: one group, then one residual token at a time."""
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
