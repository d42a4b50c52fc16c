"""Random KIVI caches for kernel benchmarks: one page pool holding several input sets (for L2 rotation).

Every row of a set holds `context` tokens: nq = quantized_len(context) packed tokens in pages at random page
ids of the shared pool, and the rest in its residual ring slot. Code words are random int32, scales
0.2..0.7, zeros N(0, 1), residual tokens N(0, 1) (keys x2). All data is drawn with a private generator.
"""

from __future__ import annotations

import math

import torch

from kivi.config import KiviConfig

G, R, P = 32, 128, 128


def quantized_len(L: int) -> int:
    return G * math.ceil(max(0, L - R) / G)


def kivi_bytes(B, L, Hq, H, D, kb, vb, esize=2) -> int:
    """Bytes one decode-attention call must move: codes, scales and zeros of the packed tokens, the residual
    tokens, q and out (each counted once)."""
    nq = quantized_len(L)
    codes = B * H * nq * D * (kb + vb) // 8
    scales = B * H * (nq // G) * D * 2 * esize + B * H * nq * (D // G) * 2 * esize
    residual = B * H * (L - nq) * D * 2 * esize
    return codes + scales + residual + 2 * B * Hq * D * esize


def bf16_bytes(B, L, Hq, H, D) -> int:
    return 2 * B * H * L * D * 2 + 2 * B * Hq * D * 2


def table_width(pages: int) -> int:
    """Block-table width: a multiple of 16 (so every run compiles the kernels with the same int specialization)."""
    return max(16, -(-pages // 16) * 16)


def make_paged_sets(B: int, L: int, Hq: int, H: int, D: int, device, n_sets: int, seed: int) -> dict:
    """bf16 page pools [N, H, P, D] shared by n_sets sets of B rows of L tokens each, pages in a random order:
    dict(k_pages, v_pages, table [n_sets * B, width], q [n_sets, B, Hq, D], slots (one [B] per set), seq_lens [B])."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages = -(-L // P)
    k_pages = torch.randn(n_sets * B * pages, H, P, D, device=device, dtype=torch.bfloat16, generator=g)
    v_pages = torch.randn(n_sets * B * pages, H, P, D, device=device, dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(n_sets * B * pages, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    table = perm.view(n_sets * B, pages)
    table = torch.cat([table, torch.zeros(n_sets * B, table_width(pages) - pages, dtype=torch.int32)], 1).to(device)
    q = torch.randn(n_sets, B, Hq, D, device=device, dtype=torch.bfloat16, generator=g)
    slots = [torch.arange(i * B, (i + 1) * B, dtype=torch.int32, device=device) for i in range(n_sets)]
    seq_lens = torch.full((B,), L, dtype=torch.int32, device=device)
    return dict(k_pages=k_pages, v_pages=v_pages, table=table, q=q, slots=slots, seq_lens=seq_lens)


def make_kivi_sets(B, L, Hq, H, D, kb, vb, dtype, device, n_sets: int, seed: int = 0, scale_dtype=None) -> dict:
    """Pools shared by n_sets sets; returns dict(pools=[8 tensors], sets=[dict(q, block_table, slots, seq_lens)]).
    Scales and zeros in scale_dtype, by default what KiviConfig's default stores for a `dtype` model."""
    sdt = scale_dtype or KiviConfig().scale_dtype_for(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    nq = quantized_len(L)
    pages = -(-nq // P)
    N = max(n_sets * B * pages, 1)
    S = n_sets * (B + 1)
    dev = dict(device=device)

    # drawn in place in their own dtypes, with no fp32 copy of a pool (the rings of 16 sets at 238 rows x 32 heads
    # would take 7.5 GiB each)
    def uniform(shape, dt, lo, hi):
        return torch.empty(shape, dtype=dt, **dev).uniform_(lo, hi, generator=gen)

    def normal(shape, dt, std=1.0):
        return torch.empty(shape, dtype=dt, **dev).normal_(0.0, std, generator=gen)

    pools = dict(
        k_codes=torch.randint(-2**31, 2**31 - 1, (N, H, P * kb // 32, D), generator=gen, dtype=torch.int32, **dev),
        k_scale=uniform((N, H, P // G, D), sdt, 0.2, 0.7),
        k_zero=normal((N, H, P // G, D), sdt),
        v_codes=torch.randint(-2**31, 2**31 - 1, (N, H, P, D * vb // 32), generator=gen, dtype=torch.int32, **dev),
        v_scale=uniform((N, H, P, D // G), sdt, 0.2, 0.7),
        v_zero=normal((N, H, P, D // G), sdt),
        k_res=normal((S, H, R, D), dtype, 2.0),
        v_res=normal((S, H, R, D), dtype),
    )
    table = torch.zeros(S, table_width(pages), dtype=torch.int32)
    perm = torch.randperm(N, generator=cpu_gen).to(torch.int32)
    sets = []
    for i in range(n_sets):
        slots = (i * (B + 1) + torch.randperm(B + 1, generator=cpu_gen)[:B]).to(torch.int32)
        if pages:
            table[slots.long(), :pages] = perm[i * B * pages:(i + 1) * B * pages].view(B, pages)
        sets.append(dict(slots=slots.to(device), seq_lens=torch.full((B,), L, dtype=torch.int32, **dev),
                         q=normal((B, Hq, D), dtype)))
    table = table.to(device)
    for s in sets:
        s["block_table"] = table
    return dict(pools=pools, sets=sets, nq=nq, pages=pages)


KIVI_POOLS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_res", "v_res")


def kivi_args(data: dict, i: int) -> list:
    """Positional arguments after q of decode_attention for set i."""
    s = data["sets"][i]
    return [data["pools"][n] for n in KIVI_POOLS] + [s["block_table"], s["slots"], s["seq_lens"]]
