"""Kernel benchmark: KIVI decode attention (2/4-bit) against SDPA and the paged kernel over bf16; cache stores.

On the H200 (first run: a small subset, ~1-2 minutes; then the full sweep, a few minutes):

    python benchmarks/bench_kernels.py --quick --out $OUT/bench_kernels.json
    python benchmarks/bench_kernels.py --out $OUT/bench_kernels.json

On a CPU (sets TRITON_INTERPRET=1, one tiny config; catches errors before the device):

    python benchmarks/bench_kernels.py --cpu-smoke

Kernels (head_dim 128, 32 query heads with 32 or 8 KV heads, batch 1/8/64/256, context 512/4096/32768 and
131072 at batch 1; G=32, R=128, page 128; every row holds `context` tokens: packed tokens + 97..128 residual):
  decode_attention      kernels.decode_attention over a 2-bit and a 4-bit cache (k_bits = v_bits), bf16 scales
  sdpa_bf16             torch SDPA (flash backend when it runs; else the default choice, recorded in `backend`)
                        with q of length 1 over contiguous bf16 K/V [B, H, L, D] (enable_gqa for 8 KV heads)
  paged_bf16            kernels.paged_attention.paged_decode_attention over a bf16 page pool
  reference             kernels.decode_attention.reference (2-bit), batch <= 8 and context <= 4096 only
  variants              decode_attention at batch 8, context 4096, 2-bit: block_n 64, use_dot=False (MHA)
  store_prefill         kernels.kv_store.ops (if present): a 4096-token prompt, batch 1 and 8, 8 KV heads
  store_decode          kernels.kv_store.ops: one step at batch 64/256 where every row flushes a group
                        (store_decode_flush) or only appends (store_decode_append); paged bf16 stores alongside

How each number is measured:
  ms            triton.testing.do_bench median (L2 flushed before every call; eager launches included, so
                tiny configs are launch-bound); ms_graph: do_bench_cudagraph median (replayed CUDA graph, warm L2).
  bytes         what the op must move, counted once: decode_attention: codes, scales, zeros of the packed tokens,
                the residual tokens, q and out; bf16 kernels: K and V of all tokens, q and out; stores: the input
                tokens read plus the cache bytes written (+ the flushed residual group read).
  gbps          bytes / ms; frac_of_copy: gbps / the copy bandwidth measured at the start of the same run
                (2 GiB copy_, bytes read plus written, median of 10).
  speedup_vs_sdpa_bf16  sdpa_bf16 ms / ms of the same shape.
  check         before timing, each kernel's output on rows 0 and B-1 is compared with the fp32 reference (or
                torch math) of the same data: rel_l2 = ||out - ref|| / ||ref|| is recorded; "fail" above 2e-2.
A config that does not fit (estimated bytes > 85% of free memory) is recorded as skipped; an exception
(out of memory included) is recorded with its message and the run goes on. The last stdout line is one JSON
object with every record.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small subset for a first device run")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny config on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--out", default=None, help="write the JSON result here too")
    return p.parse_args()


ARGS = parse_args()
if ARGS.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before any module defining @triton.jit functions is imported

import json  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import copy_bandwidth, env_header, log, write_json  # noqa: E402

from kernels.decode_attention import decode_attention  # noqa: E402
from kernels.decode_attention import reference as dref  # noqa: E402
from kernels.paged_attention import paged_decode_attention, store_paged_decode, store_paged_prefill  # noqa: E402

G, R, P = 32, 128, 128
CHECK_TOL = 2e-2


# ----------------------------------------------------------------------------------------------------- timing
def time_fn(fn, device: torch.device) -> dict:
    if device.type != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return {"ms": (time.perf_counter() - t0) * 1e3, "ms_graph": None}
    import triton.testing

    res = {"ms": triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"), "ms_graph": None}
    try:
        res["ms_graph"] = triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
    except Exception as exc:  # graph capture can fail for some torch ops; eager time still stands
        res["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return res


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return 8 * 2**30


def cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ test data
def quantized_len(L: int) -> int:
    return G * math.ceil(max(0, L - R) / G)


def kivi_bytes(B, L, Hq, H, D, kb, vb, esize=2) -> int:
    nq = quantized_len(L)
    codes = B * H * nq * D * (kb + vb) // 8
    scales = B * H * (nq // G) * D * 2 * esize + B * H * nq * (D // G) * 2 * esize
    residual = B * H * (L - nq) * D * 2 * esize
    return codes + scales + residual + 2 * B * Hq * D * esize


def bf16_bytes(B, L, Hq, H, D) -> int:
    return 2 * B * H * L * D * 2 + 2 * B * Hq * D * 2


def random_block_table(B: int, pages_per_row: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Block table [B + 1, pages] over a pool of B * pages pages in random order; slots permuted."""
    n = B * pages_per_row
    perm = torch.randperm(n, generator=gen).to(torch.int32)
    table = torch.zeros(B + 1, max(pages_per_row, 1), dtype=torch.int32)
    slots = torch.randperm(B + 1, generator=gen)[:B].to(torch.int32)
    if pages_per_row:
        table[slots.long()] = perm.view(B, pages_per_row)
    return table.to(device), slots.to(device)


def make_kivi_cache(B, L, H, D, kb, vb, dtype, device, seed=0) -> dict:
    """Random packed pools (random code words; scales 0.2..0.7, zeros N(0, 1)) + random residual ring."""
    gen = torch.Generator().manual_seed(seed)
    pages = -(-quantized_len(L) // P)
    table, slots = random_block_table(B, pages, device, gen)
    N = max(B * pages, 1)
    dev = dict(device=device)
    torch.manual_seed(seed)
    t = dict(
        k_codes=torch.randint(-2**31, 2**31 - 1, (N, H, P * kb // 32, D), dtype=torch.int32, **dev),
        k_scale=(torch.rand(N, H, P // G, D, **dev) * 0.5 + 0.2).to(dtype),
        k_zero=torch.randn(N, H, P // G, D, **dev).to(dtype),
        v_codes=torch.randint(-2**31, 2**31 - 1, (N, H, P, D * vb // 32), dtype=torch.int32, **dev),
        v_scale=(torch.rand(N, H, P, D // G, **dev) * 0.5 + 0.2).to(dtype),
        v_zero=torch.randn(N, H, P, D // G, **dev).to(dtype),
        k_res=torch.randn(B + 1, H, R, D, **dev).to(dtype) * 2,
        v_res=torch.randn(B + 1, H, R, D, **dev).to(dtype),
    )
    t.update(block_table=table, slots=slots, seq_lens=torch.full((B,), L, dtype=torch.int32, **dev))
    return t


KIVI_ORDER = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_res", "v_res", "block_table",
              "slots", "seq_lens")


def kivi_call(fn, q, cache, kb, vb, rows=None, **tuning):
    args = [cache[n] for n in KIVI_ORDER]
    if rows is not None:
        q, args[-2], args[-1] = q[rows], args[-2][rows], args[-1][rows]
    return fn(q, *args, sm_scale=q.shape[-1] ** -0.5, k_bits=kb, v_bits=vb, group_size=G, residual_length=R,
              page_size=P, **tuning)


# ------------------------------------------------------------------------------------------------ attention
def record(kernel, bits, B, L, Hq, H, D, copy_gbps, **extra) -> dict:
    return dict(kernel=kernel, bits=bits, batch=B, context=L, q_heads=Hq, kv_heads=H, head_dim=D, ms=None,
                gbps=None, copy_gbps=copy_gbps, **extra)


def finish(rec: dict, timing: dict, nbytes: int) -> dict:
    rec.update(timing)
    rec["bytes"] = nbytes
    rec["gbps"] = nbytes / (rec["ms"] * 1e-3) / 1e9
    rec["frac_of_copy"] = rec["gbps"] / rec["copy_gbps"] if rec["copy_gbps"] else None
    return rec


def guarded(rec: dict, need_bytes: int, device, body) -> dict:
    """Run body(rec) unless the estimate does not fit; record skips and exceptions instead of raising."""
    free = free_bytes(device)
    if need_bytes > 0.85 * free:
        rec["skipped"] = f"needs ~{need_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        return rec
    try:
        body(rec)
    except torch.cuda.OutOfMemoryError as exc:
        rec["error"] = f"OutOfMemoryError: {str(exc)[:200]}"
    except Exception as exc:  # noqa: BLE001 - one config must never end the run
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        log(traceback.format_exc(limit=4))
    finally:
        cleanup(device)
    return rec


def bench_sdpa(B, L, Hq, H, D, device, copy_gbps) -> dict:
    rec = record("sdpa_bf16", 16, B, L, Hq, H, D, copy_gbps)

    def body(rec):
        torch.manual_seed(1)
        q = torch.randn(B, Hq, 1, D, device=device, dtype=torch.bfloat16)
        k = torch.randn(B, H, L, D, device=device, dtype=torch.bfloat16)
        v = torch.randn(B, H, L, D, device=device, dtype=torch.bfloat16)
        gqa = dict(enable_gqa=True) if Hq != H else {}
        fn = None
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def flash():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, **gqa)
            try:
                flash()
                fn, rec["backend"] = flash, "flash"
            except Exception as exc:  # flash refuses some shapes / versions: fall back to the default choice
                rec["flash_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        if fn is None:
            fn, rec["backend"] = (lambda: F.scaled_dot_product_attention(q, k, v, **gqa)), "default"
        out = fn()
        rows = [0, B - 1]
        kk = k[rows].float().repeat_interleave(Hq // H, 1)
        vv = v[rows].float().repeat_interleave(Hq // H, 1)
        ref = torch.softmax(q[rows].float() @ kk.transpose(-1, -2) * D**-0.5, -1) @ vv
        rec["check_rel_l2"] = rel_l2(out[rows], ref)
        finish(rec, time_fn(fn, device), bf16_bytes(B, L, Hq, H, D))

    return guarded(rec, bf16_bytes(B, L, Hq, H, D) + 2 * 2 * Hq * L * D * 4 + 2 * 2**30, device, body)


def bench_paged(B, L, Hq, H, D, device, copy_gbps) -> dict:
    rec = record("paged_bf16", 16, B, L, Hq, H, D, copy_gbps)

    def body(rec):
        gen = torch.Generator().manual_seed(2)
        pages = -(-L // P)
        table, slots = random_block_table(B, pages, device, gen)
        torch.manual_seed(2)
        k_pages = torch.randn(B * pages, H, P, D, device=device, dtype=torch.bfloat16)
        v_pages = torch.randn(B * pages, H, P, D, device=device, dtype=torch.bfloat16)
        q = torch.randn(B, Hq, D, device=device, dtype=torch.bfloat16)
        seq_lens = torch.full((B,), L, dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        from kernels.paged_attention import reference as pref

        def fn():
            return paged_decode_attention(q, k_pages, v_pages, table, slots, seq_lens, sm_scale=D**-0.5,
                                          page_size=P, out=out)
        fn()
        rows = [0, B - 1]
        ref = pref.paged_decode_attention(q[rows], k_pages, v_pages, table, slots[rows], seq_lens[rows],
                                          sm_scale=D**-0.5, page_size=P)
        rec["check_rel_l2"] = rel_l2(out[rows], ref)
        finish(rec, time_fn(fn, device), bf16_bytes(B, L, Hq, H, D))

    return guarded(rec, bf16_bytes(B, L, Hq, H, D) + 2 * 2**30, device, body)


def bench_kivi(B, L, Hq, H, D, bits, device, copy_gbps, kernel="decode_attention", **tuning) -> dict:
    rec = record(kernel, bits, B, L, Hq, H, D, copy_gbps, **({"tuning": tuning} if tuning else {}))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16

    def body(rec):
        cache = make_kivi_cache(B, L, H, D, bits, bits, dtype, device, seed=3)
        torch.manual_seed(3)
        q = torch.randn(B, Hq, D, device=device, dtype=dtype)
        out = torch.empty_like(q)
        if kernel == "reference":
            fn = lambda: kivi_call(dref.decode_attention, q, cache, bits, bits, out=out)  # noqa: E731
        else:
            fn = lambda: kivi_call(decode_attention, q, cache, bits, bits, out=out, **tuning)  # noqa: E731
        fn()
        rows = [0, B - 1]
        ref = kivi_call(dref.decode_attention, q, cache, bits, bits, rows=rows)
        rec["check_rel_l2"] = rel_l2(out[rows], ref)
        finish(rec, time_fn(fn, device), kivi_bytes(B, L, Hq, H, D, bits, bits))

    need = kivi_bytes(B, L, Hq, H, D, bits, bits) + 2 * L * H * D * 4 * 8 + 2 * 2**30  # + fp32/int64 check rows
    if kernel == "reference":
        need += 3 * B * H * L * D * 4
    return guarded(rec, need, device, body)


# --------------------------------------------------------------------------------------------------- stores
def decode_store_bytes(B, H, D, bits, flush: bool, esize=2) -> int:
    """One appended token (read k/v, write their ring slots); a flush also reads G residual tokens and writes
    their codes, one key scale/zero row and G value scale/zero rows."""
    token = 2 * 2 * B * H * D * esize
    if not flush:
        return token
    group = 2 * B * H * G * D * esize + B * H * G * D * 2 * bits // 8
    scales = B * H * D * 2 * esize + B * H * G * (D // G) * 2 * esize
    return token + group + scales


def bench_stores(device, copy_gbps, batches_prefill, batches_decode, H=8, D=128, T=4096) -> list[dict]:
    recs = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    try:
        from kernels.kv_store import ops as kv_ops
        from kernels.kv_store import reference as kv_ref
    except ImportError as exc:
        recs.append(dict(kernel="store_prefill", skipped=f"kernels.kv_store not importable: {exc}"))
        kv_ops = kv_ref = None
    for B in batches_prefill:
        L = T
        for bits in (2, 4):
            if kv_ops is None:
                break
            rec = record("store_prefill", bits, B, L, H, H, D, copy_gbps)

            def body(rec, B=B, L=L, bits=bits):
                cache = make_kivi_cache(B, L, H, D, bits, bits, dtype, device, seed=4)
                key = torch.randn(B, H, L, D, device=device, dtype=dtype)
                value = torch.randn(B, H, L, D, device=device, dtype=dtype)
                starts = torch.zeros(B, dtype=torch.int32, device=device)
                lengths = cache["seq_lens"]
                pools = [cache[n] for n in KIVI_ORDER[:8]]
                ints = dict(k_bits=bits, v_bits=bits, group_size=G, residual_length=R, page_size=P)
                fn = lambda: kv_ops.store_prefill(key, value, starts, lengths, cache["slots"],  # noqa: E731
                                                  cache["block_table"], *pools, **ints)
                fn()
                ref_pools = [x.clone() for x in pools]
                kv_ref.store_prefill(key, value, starts, lengths, cache["slots"], cache["block_table"], *ref_pools,
                                     **ints)
                rec["check_codes_equal"] = bool(torch.equal(pools[0], ref_pools[0]) and torch.equal(pools[3],
                                                                                                   ref_pools[3]))
                rec["check_rel_l2"] = rel_l2(pools[6], ref_pools[6])
                nbytes = 2 * B * H * L * D * 2 + kivi_bytes(B, L, H, H, D, bits, bits) - 2 * B * H * D * 2
                finish(rec, time_fn(fn, device), nbytes)

            recs.append(guarded(rec, 3 * kivi_bytes(B, L, H, H, D, bits, bits) + 4 * B * H * L * D * 2 + 2**30,
                                device, body))
        rec = record("store_paged_prefill_bf16", 16, B, T, H, H, D, copy_gbps)

        def body_paged(rec, B=B):
            pages = -(-T // P)
            table, slots = random_block_table(B, pages, device, torch.Generator().manual_seed(5))
            k_pages = torch.empty(B * pages, H, P, D, device=device, dtype=torch.bfloat16)
            v_pages = torch.empty_like(k_pages)
            key = torch.randn(B, H, T, D, device=device, dtype=dtype)
            value = torch.randn(B, H, T, D, device=device, dtype=dtype)
            starts = torch.zeros(B, dtype=torch.int32, device=device)
            lengths = torch.full((B,), T, dtype=torch.int32, device=device)
            fn = lambda: store_paged_prefill(key, value, starts, lengths, slots, table, k_pages,  # noqa: E731
                                             v_pages, page_size=P)
            fn()
            rec["check_rel_l2"] = rel_l2(k_pages[table[slots[0].long(), 0].long()], key[0, :, :P])
            finish(rec, time_fn(fn, device), 4 * B * H * T * D * 2)

        recs.append(guarded(rec, 6 * B * H * T * D * 2 + 2**30, device, body_paged))

    for B in batches_decode:
        L = 4096
        for bits in (2, 4):
            if kv_ops is None:
                break
            for mode, seq in (("flush", L + 1), ("append", L + 2)):
                rec = record(f"store_decode_{mode}", bits, B, seq, H, H, D, copy_gbps)

                def body(rec, B=B, bits=bits, seq=seq, mode=mode):
                    # the token appended is seq - 1: (seq - 1 - R) % G == 0 flushes the oldest residual group first
                    assert ((seq - 1 - R) % G == 0) == (mode == "flush")
                    cache = make_kivi_cache(B, seq, H, D, bits, bits, dtype, device, seed=6)
                    key = torch.randn(B, H, D, device=device, dtype=dtype)
                    value = torch.randn(B, H, D, device=device, dtype=dtype)
                    pools = [cache[n] for n in KIVI_ORDER[:8]]
                    ints = dict(k_bits=bits, v_bits=bits, group_size=G, residual_length=R, page_size=P)
                    args = (key, value, cache["seq_lens"], cache["slots"], cache["block_table"])
                    ref_pools = [x.clone() for x in pools]
                    kv_ops.store_decode(*args, *pools, **ints)
                    kv_ref.store_decode(*args, *ref_pools, **ints)
                    rec["check_codes_equal"] = bool(torch.equal(pools[0], ref_pools[0]) and torch.equal(pools[3],
                                                                                                       ref_pools[3]))
                    rec["check_rel_l2"] = rel_l2(pools[6], ref_pools[6])
                    # every timed call repeats the same work (the flushed group is re-read and rewritten)
                    fn = lambda: kv_ops.store_decode(*args, *pools, **ints)  # noqa: E731
                    finish(rec, time_fn(fn, device), decode_store_bytes(B, H, D, bits, mode == "flush"))

                recs.append(guarded(rec, 2 * kivi_bytes(B, seq, H, H, D, bits, bits) + 2**30, device, body))
        rec = record("store_paged_decode_bf16", 16, B, L, H, H, D, copy_gbps)

        def body_pd(rec, B=B, L=L):
            pages = -(-(L + 1) // P)
            table, slots = random_block_table(B, pages, device, torch.Generator().manual_seed(7))
            k_pages = torch.zeros(B * pages, H, P, D, device=device, dtype=torch.bfloat16)
            v_pages = torch.zeros_like(k_pages)
            key = torch.randn(B, H, D, device=device, dtype=dtype)
            seq_lens = torch.full((B,), L + 1, dtype=torch.int32, device=device)
            fn = lambda: store_paged_decode(key, key, seq_lens, slots, table, k_pages, v_pages,  # noqa: E731
                                            page_size=P)
            fn()
            rec["check_rel_l2"] = rel_l2(k_pages[table[slots[0].long(), L // P].long(), :, L % P], key[0])
            finish(rec, time_fn(fn, device), 4 * B * H * D * 2)

        recs.append(guarded(rec, 4 * B * (L + P) * H * D * 2 + 2**30, device, body_pd))
    return recs


# ------------------------------------------------------------------------------------------------------ main
def attention_configs(quick: bool, smoke: bool):
    if smoke:
        return [(2, 300, 4, 2, 64)]
    heads = [(32, 32), (32, 8)]
    if quick:
        shapes = [(1, 4096), (8, 4096), (64, 4096), (1, 32768), (8, 512)]
    else:
        shapes = [(b, c) for b in (1, 8, 64, 256) for c in (512, 4096, 32768)] + [(1, 131072)]
    return [(b, c, hq, h, 128) for b, c in shapes for hq, h in heads]


def main() -> None:
    device = torch.device("cpu" if ARGS.cpu_smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not ARGS.cpu_smoke:
        sys.exit("no CUDA device: run with --cpu-smoke for the CPU check")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    copy = copy_bandwidth(device, nbytes=2 * 2**30 if device.type == "cuda" else 64 * 2**20)
    copy_gbps = copy["gbs"]
    log(f"copy bandwidth {copy_gbps:.0f} GB/s")
    records = []
    t_start = time.time()
    for B, L, Hq, H, D in attention_configs(ARGS.quick, ARGS.cpu_smoke):
        if ARGS.cpu_smoke:  # the CPU has no flash SDPA or bf16 Triton; one of each, tiny
            recs = [bench_sdpa(B, L, Hq, H, D, device, copy_gbps), bench_paged(B, L, Hq, H, D, device, copy_gbps)]
            recs += [bench_kivi(B, L, Hq, H, D, bits, device, copy_gbps) for bits in (2, 4)]
            recs.append(bench_kivi(B, L, Hq, H, D, 2, device, copy_gbps, kernel="reference"))
        else:
            recs = [bench_sdpa(B, L, Hq, H, D, device, copy_gbps), bench_paged(B, L, Hq, H, D, device, copy_gbps)]
            recs += [bench_kivi(B, L, Hq, H, D, bits, device, copy_gbps) for bits in (2, 4)]
            if B <= 8 and L <= 4096:
                recs.append(bench_kivi(B, L, Hq, H, D, 2, device, copy_gbps, kernel="reference"))
            if B == 8 and L == 4096:
                recs.append(bench_kivi(B, L, Hq, H, D, 2, device, copy_gbps, kernel="decode_attention_variant",
                                       block_n=64))
                if Hq == H:
                    recs.append(bench_kivi(B, L, Hq, H, D, 2, device, copy_gbps,
                                           kernel="decode_attention_variant", use_dot=False))
        sdpa_ms = recs[0].get("ms")
        for r in recs:
            if sdpa_ms and r.get("ms") and r is not recs[0]:
                r["speedup_vs_sdpa_bf16"] = sdpa_ms / r["ms"]
            log(summary_line(r))
        records += recs
    if ARGS.cpu_smoke:
        records += bench_stores(device, copy_gbps, batches_prefill=[1], batches_decode=[2], H=2, D=64, T=256)
    else:
        records += bench_stores(device, copy_gbps, batches_prefill=[1] if ARGS.quick else [1, 8],
                                batches_decode=[64] if ARGS.quick else [64, 256])
    for r in records[-12:]:
        if "kernel" in r and "store" in r["kernel"]:
            log(summary_line(r))
    for r in records:
        rl2 = r.get("check_rel_l2")
        if rl2 is not None:
            r["check"] = "ok" if rl2 <= CHECK_TOL else "fail"
    result = dict(header=env_header(device), copy=copy, wall_s=round(time.time() - t_start, 1),
                  quick=ARGS.quick, cpu_smoke=ARGS.cpu_smoke, records=records)
    print_table(records)
    if ARGS.out:
        write_json(ARGS.out, result)
    print(json.dumps(result, default=str))


def summary_line(r: dict) -> str:
    head = f"{r.get('kernel', '?'):26s} b{r.get('bits', '-')!s:>2} B={r.get('batch')!s:>4} L={r.get('context')!s:>6} " \
           f"H={r.get('q_heads')}/{r.get('kv_heads')}"
    if r.get("skipped") or r.get("error"):
        return f"{head}  {'skipped: ' + r['skipped'] if r.get('skipped') else 'ERROR ' + r['error']}"
    frac = r.get("frac_of_copy")
    sp = r.get("speedup_vs_sdpa_bf16")
    return (f"{head}  {r['ms']:.4f} ms  {r['gbps']:.0f} GB/s" + (f" ({frac:.0%} of copy)" if frac else "")
            + (f"  x{sp:.2f} vs sdpa" if sp else "") + f"  rel_l2 {r.get('check_rel_l2', float('nan')):.1e}")


def print_table(records) -> None:
    print("kernel                      bits batch context  heads     ms        GB/s   copy%  vs_sdpa  check")
    for r in records:
        if "ms" not in r or r.get("ms") is None:
            why = r.get("skipped") or r.get("error") or ""
            print(f"{r.get('kernel', '?'):27s} {r.get('bits', '')!s:>3} {r.get('batch', '')!s:>5} "
                  f"{r.get('context', '')!s:>7}  {r.get('q_heads', '')}/{r.get('kv_heads', '')}  -- {why[:60]}")
            continue
        frac = r.get("frac_of_copy")
        sp = r.get("speedup_vs_sdpa_bf16")
        print(f"{r['kernel']:27s} {r['bits']!s:>3} {r['batch']:>5} {r['context']:>7}  "
              f"{r['q_heads']}/{r['kv_heads']:<3} {r['ms']:9.4f} {r['gbps']:9.0f} {(frac or 0) * 100:6.1f}  "
              f"{sp or 0:7.2f}  {r.get('check', '')}")


if __name__ == "__main__":
    main()
