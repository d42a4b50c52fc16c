"""Kernel benchmark: KIVI decode attention (2/4-bit) against SDPA and the paged kernel over bf16; cache stores.

On the H200 (a few minutes; --quick: a subset):

    python benchmarks/bench_kernels.py --out $OUT/bench_kernels.json [--quick] [--tune]

On a CPU (sets TRITON_INTERPRET=1, one tiny config through every kernel; catches errors before the device):

    python benchmarks/bench_kernels.py --cpu-smoke

Kernels (head_dim 128, 32 query heads with 32 or 8 KV heads, batch 1/8/64/256, context 512/4096/32768 and
131072 at batch 1; G=32, R=128, page 128; every row holds `context` tokens: packed tokens + 97..128 residual):
  decode_attention      kernels.decode_attention over a 2-bit and a 4-bit cache (k_bits = v_bits), bf16; with
                        --tune, each shape also tries a few launch configurations (`candidates`) and reports the
                        fastest (its `tuning`); without it, the launcher's own table decides
  sdpa_bf16             torch SDPA (flash backend) with q of length 1 over contiguous bf16 K/V [B, H, L, D]
                        (enable_gqa for 8 KV heads)
  paged_bf16            kernels.paged_attention.paged_decode_attention over a bf16 page pool
  reference             kernels.decode_attention.reference (2-bit), batch <= 8 and context <= 4096, eager only
  quantize_pack         kernels.kv_store store_prefill of a 4096-token prompt (batch 1 and 8; 8 and 32 KV heads)
  residual_flush        kernels.kv_store store_decode at a step where every row flushes its oldest residual group
                        (batch 64 and 256; 8 and 32 KV heads)

How each number is measured:
  ms            median over replays of one CUDA graph that calls the kernel many times, cycling through several
                input sets (each its own memory) so the sets together exceed 4x the L2: DRAM, not L2, is read
                (benchmarks/gpu_timing.py). Launch gaps inside the graph are included, as in an engine that
                replays its decode step. ms_eager: one eager call timed with events (host launch overhead shows
                when it exceeds the GPU time).
  bytes         what the op must move, counted once: decode_attention: codes, scales and zeros of the packed
                tokens, the residual tokens, q and out; bf16 kernels: K and V of all tokens, q and out; stores:
                the input tokens read plus the cache bytes written (+ the flushed residual group read).
  gbps          bytes / ms; frac_of_copy: gbps / the copy bandwidth measured at the start of the same run
                (2 GiB copy_, bytes read plus written, median of 10). speedup_vs_sdpa_bf16: sdpa ms / ms.
  check         before timing, outputs on rows 0 and B-1 against the fp32 reference (or torch math) of the same
                data: rel_l2 = ||out - ref|| / ||ref||; "fail" above 2e-2. Stores: codes equal the reference's.
Random data is drawn with private generators before any capture (a failed capture cannot break later draws).
A config that does not fit (estimated bytes > 85% of free memory) is recorded as skipped; an exception is
recorded with its message and the run goes on. The JSON is rewritten after every shape.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small subset")
    p.add_argument("--tune", action="store_true", help="try a few launch configurations per decode shape")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny config on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--workers", type=int, default=12, help="parallel compile processes (GPU)")
    p.add_argument("--out", default=None, help="write the JSON result here too")
    return p.parse_args()


ARGS = parse_args() if __name__ == "__main__" else argparse.Namespace(cpu_smoke=False)
if ARGS.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before any module defining @triton.jit functions is imported

import json  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import copy_bandwidth, env_header, log, write_json  # noqa: E402
from kivi_data import (  # noqa: E402
    KIVI_POOLS,
    P,
    R,
    bf16_bytes,
    kivi_args,
    kivi_bytes,
    make_kivi_sets,
    table_width,
)

from kernels.decode_attention import decode_attention  # noqa: E402
from kernels.decode_attention import reference as dref  # noqa: E402
from kernels.paged_attention import paged_decode_attention  # noqa: E402

G = 32
CHECK_TOL = 2e-2
DEV = torch.device("cpu" if ARGS.cpu_smoke or not torch.cuda.is_available() else "cuda")
DTYPE = torch.bfloat16 if DEV.type == "cuda" else torch.float16

# launch configurations tried with --tune, by bits (the launcher's table is always tried too)
CANDIDATES = {
    2: [dict(block_n=32, num_warps=1, num_stages=2, lazy=True, key_vec=1, per_sm=8),
        dict(block_n=64, num_warps=4, num_stages=2, lazy=True, key_vec=2, per_sm=4),
        dict(block_n=32, num_warps=2, num_stages=2, lazy=True, key_vec=1, per_sm=7)],
    4: [dict(block_n=32, num_warps=1, num_stages=2, lazy=True, key_vec=1, per_sm=8),
        dict(block_n=64, num_warps=4, num_stages=2, lazy=True, key_vec=4, per_sm=3)],
}


# ----------------------------------------------------------------------------------------------------- timing
def timed(fns, est_ms=None) -> dict:
    if DEV.type != "cuda":
        fns[0]()
        t0 = time.perf_counter()
        fns[0]()
        return {"ms": (time.perf_counter() - t0) * 1e3, "mode": "cpu"}
    from gpu_timing import time_graph

    return time_graph(fns, est_ms)


def eager_ms(fn) -> float | None:
    if DEV.type != "cuda":
        return None
    from gpu_timing import time_eager

    return time_eager(fn, replays=10)


def n_sets(nbytes: int, max_sets: int = 64) -> int:
    if DEV.type != "cuda":
        return 1
    from gpu_timing import l2_bytes, sets_for

    return sets_for(nbytes, l2_bytes(DEV), max_sets=max_sets)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def free_bytes() -> int:
    return torch.cuda.mem_get_info(DEV)[0] if DEV.type == "cuda" else 8 * 2**30


def cleanup() -> None:
    gc.collect()
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def record(kernel, bits, B, L, Hq, H, D, copy_gbps, **extra) -> dict:
    return dict(kernel=kernel, bits=bits, batch=B, context=L, q_heads=Hq, kv_heads=H, head_dim=D, ms=None,
                gbps=None, copy_gbps=copy_gbps, **extra)


def finish(rec: dict, timing: dict, nbytes: int) -> dict:
    rec.update(timing)
    rec["bytes"] = nbytes
    rec["gbps"] = nbytes / (rec["ms"] * 1e-3) / 1e9
    rec["frac_of_copy"] = rec["gbps"] / rec["copy_gbps"] if rec["copy_gbps"] else None
    return rec


def guarded(rec: dict, need_bytes: int, body) -> dict:
    """Run body(rec) unless the estimate does not fit; record skips and exceptions instead of raising."""
    free = free_bytes()
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
        cleanup()
    return rec


# ------------------------------------------------------------------------------------------------ attention
def bench_sdpa(B, L, Hq, H, D, copy_gbps) -> dict:
    rec = record("sdpa_bf16", 16, B, L, Hq, H, D, copy_gbps)
    nbytes = bf16_bytes(B, L, Hq, H, D)

    def body(rec):
        k_sets = n_sets(nbytes)
        g = gen(1)
        kv = torch.randn(2, k_sets * B, H, L, D, device=DEV, dtype=torch.bfloat16, generator=g)
        q = torch.randn(k_sets * B, Hq, 1, D, device=DEV, dtype=torch.bfloat16, generator=g)
        gqa = dict(enable_gqa=True) if Hq != H else {}
        if DEV.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend, rec["backend"] = [SDPBackend.FLASH_ATTENTION], "flash"
        else:
            rec["backend"] = "default"

        def one(i):
            sl = slice(i * B, (i + 1) * B)
            if DEV.type == "cuda":
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q[sl], kv[0, sl], kv[1, sl], **gqa)
            return F.scaled_dot_product_attention(q[sl].float(), kv[0, sl].float(), kv[1, sl].float(), **gqa)

        out = one(0)
        rows = [0, B - 1]
        kk = kv[0, rows].float().repeat_interleave(Hq // H, 1)
        vv = kv[1, rows].float().repeat_interleave(Hq // H, 1)
        ref = torch.softmax(q[rows].float() @ kk.transpose(-1, -2) * D**-0.5, -1) @ vv
        rec["check_rel_l2"] = rel_l2(out[rows], ref)
        del kk, vv, ref
        finish(rec, timed([lambda i=i: one(i) for i in range(k_sets)]), nbytes)
        if rec["ms"] < 1.0:
            rec["ms_eager"] = eager_ms(lambda: one(0))

    return guarded(rec, max(nbytes, 300_000_000) + 2 * 2 * 2 * Hq * L * D * 4 + 2 * 2**30, body)


def bench_paged(B, L, Hq, H, D, copy_gbps) -> dict:
    rec = record("paged_bf16", 16, B, L, Hq, H, D, copy_gbps)
    nbytes = bf16_bytes(B, L, Hq, H, D)

    def body(rec):
        from kernels.paged_attention import reference as pref

        k_sets = n_sets(nbytes, max_sets=16)
        pages = -(-L // P)
        g = gen(2)
        k_pages = torch.randn(k_sets * B * pages, H, P, D, device=DEV, dtype=torch.bfloat16, generator=g)
        v_pages = torch.randn(k_sets * B * pages, H, P, D, device=DEV, dtype=torch.bfloat16, generator=g)
        cpu = torch.Generator().manual_seed(2)
        perm = torch.randperm(k_sets * B * pages, generator=cpu).to(torch.int32)
        table = perm.view(k_sets * B, pages)
        table = torch.cat([table, torch.zeros(k_sets * B, table_width(pages) - pages, dtype=torch.int32)], 1).to(DEV)
        q = torch.randn(k_sets, B, Hq, D, device=DEV, dtype=torch.bfloat16, generator=g)
        seq_lens = torch.full((B,), L, dtype=torch.int32, device=DEV)
        slots = [torch.arange(i * B, (i + 1) * B, dtype=torch.int32, device=DEV) for i in range(k_sets)]
        outs = torch.empty_like(q)

        def one(i):
            return paged_decode_attention(q[i], k_pages, v_pages, table, slots[i], seq_lens, sm_scale=D**-0.5,
                                          page_size=P, out=outs[i])
        one(0)
        rows = [0, B - 1]
        ref = pref.paged_decode_attention(q[0, rows], k_pages, v_pages, table, slots[0][rows], seq_lens[rows],
                                          sm_scale=D**-0.5, page_size=P)
        rec["check_rel_l2"] = rel_l2(outs[0, rows], ref)
        finish(rec, timed([lambda i=i: one(i) for i in range(k_sets)]), nbytes)

    return guarded(rec, 2 * nbytes + 2 * 2**30, body)


def decode_candidates(B, L, Hq, H, bits, tune: bool) -> list[dict]:
    """Explicit tuning dicts: the launcher's table first, then (with --tune) the other candidates."""
    if DEV.type != "cuda":
        return [{}]
    from kernel_sweep import resolve

    out = [resolve("new", B, L, Hq, H, {}, bits)]
    if tune:
        for c in CANDIDATES[bits]:
            t = resolve("new", B, L, Hq, H, c, bits)
            if t not in out:
                out.append(t)
    return out


def bench_kivi(B, L, Hq, H, D, bits, copy_gbps, tune: bool) -> dict:
    rec = record("decode_attention", bits, B, L, Hq, H, D, copy_gbps)
    nbytes = kivi_bytes(B, L, Hq, H, D, bits, bits)

    def body(rec):
        k_sets = n_sets(nbytes)
        data = make_kivi_sets(B, L, Hq, H, D, bits, bits, DTYPE, DEV, k_sets, seed=3)
        ints = dict(sm_scale=D**-0.5, k_bits=bits, v_bits=bits, group_size=G, residual_length=R, page_size=P)
        rows = [0, B - 1] if B > 1 else [0]
        s0 = data["sets"][0]
        a0 = kivi_args(data, 0)
        ref = dref.decode_attention(s0["q"][rows], *a0[:9], s0["slots"][rows], s0["seq_lens"][rows], **ints)
        outs = [torch.empty_like(s["q"]) for s in data["sets"]]
        results = []
        for t in decode_candidates(B, L, Hq, H, bits, tune):
            def call(i, t=t):
                return decode_attention(data["sets"][i]["q"], *kivi_args(data, i), out=outs[i], **ints, **t)
            outs[0].fill_(float("nan"))
            call(0)
            cand = dict(tuning=t, check_rel_l2=rel_l2(outs[0][rows], ref))
            if cand["check_rel_l2"] > CHECK_TOL or not torch.isfinite(outs[0]).all():
                cand["error"] = "check failed"
            else:
                cand.update(timed([lambda i=i, call=call: call(i) for i in range(k_sets)]))
            results.append(cand)
        ok = [c for c in results if "ms" in c]
        best = min(ok, key=lambda c: c["ms"]) if ok else results[0]
        rec.update({k: v for k, v in best.items()})
        if len(results) > 1:
            rec["candidates"] = [dict(tuning=c["tuning"], ms=c.get("ms"), error=c.get("error")) for c in results]
        if "ms" in best:
            finish(rec, {}, nbytes)
            if best["ms"] < 1.0:
                rec["ms_eager"] = eager_ms(lambda: decode_attention(s0["q"], *a0, out=outs[0], **ints,
                                                                    **best["tuning"]))

    need = 1.2 * nbytes + 2 * len(rows_of(B)) * L * H * D * 4 * 6 + 2 * 2**30
    return guarded(rec, int(need), body)


def rows_of(B):
    return [0, B - 1] if B > 1 else [0]


def bench_reference(B, L, Hq, H, D, copy_gbps) -> dict:
    rec = record("reference", 2, B, L, Hq, H, D, copy_gbps)
    nbytes = kivi_bytes(B, L, Hq, H, D, 2, 2)

    def body(rec):
        data = make_kivi_sets(B, L, Hq, H, D, 2, 2, DTYPE, DEV, 1, seed=3)
        ints = dict(sm_scale=D**-0.5, k_bits=2, v_bits=2, group_size=G, residual_length=R, page_size=P)
        q = data["sets"][0]["q"]
        out = torch.empty_like(q)
        fn = lambda: dref.decode_attention(q, *kivi_args(data, 0), out=out, **ints)  # noqa: E731
        ms = eager_ms(fn) if DEV.type == "cuda" else timed([fn])["ms"]  # it syncs: never graph-captured
        finish(rec, dict(ms=ms, mode="eager"), nbytes)

    return guarded(rec, 3 * B * H * L * D * 4 * 2 + nbytes + 2**30, body)


# --------------------------------------------------------------------------------------------------- stores
def decode_store_bytes(B, H, D, bits, esize=2) -> int:
    """One appended token (read k/v, write their ring slots) after a flush that reads G residual tokens and
    writes their codes, one key scale/zero row and G value scale/zero rows."""
    token = 2 * 2 * B * H * D * esize
    group = 2 * B * H * G * D * esize + B * H * G * D * 2 * bits // 8
    scales = B * H * D * 2 * esize + B * H * G * (D // G) * 2 * esize
    return token + group + scales


def bench_store_prefill(B, T, H, D, bits, copy_gbps) -> dict:
    from kernels.kv_store import ops as kv_ops
    from kernels.kv_store import reference as kv_ref

    nbytes = 2 * B * H * T * D * 2 + kivi_bytes(B, T, H, H, D, bits, bits) - 2 * B * H * D * 2
    rec = record("quantize_pack", bits, B, T, H, H, D, copy_gbps)

    def body(rec):
        k_sets = n_sets(nbytes, max_sets=16)
        data = make_kivi_sets(B, T, H, H, D, bits, bits, DTYPE, DEV, k_sets, seed=21)
        kv = torch.randn(2, k_sets, B, H, T, D, device=DEV, dtype=DTYPE, generator=gen(22))
        starts = torch.zeros(B, dtype=torch.int32, device=DEV)
        pools = [data["pools"][n] for n in KIVI_POOLS]
        ints = dict(k_bits=bits, v_bits=bits, group_size=G, residual_length=R, page_size=P)

        def one(i, pools=pools):
            s = data["sets"][i]
            kv_ops.store_prefill(kv[0, i], kv[1, i], starts, s["seq_lens"], s["slots"], s["block_table"], *pools,
                                 **ints)
        one(0)
        ref = [x.clone() for x in pools]
        s = data["sets"][0]
        kv_ref.store_prefill(kv[0, 0], kv[1, 0], starts, s["seq_lens"], s["slots"], s["block_table"], *ref, **ints)
        rec["check_codes_equal"] = bool(torch.equal(ref[0], pools[0]) and torch.equal(ref[3], pools[3]))
        rec["check_rel_l2"] = rel_l2(pools[6], ref[6])
        del ref
        finish(rec, timed([lambda i=i: one(i) for i in range(k_sets)]), nbytes)

    return guarded(rec, 20 * nbytes + 2**30, body)


def bench_store_flush(B, H, D, bits, copy_gbps, L=4096) -> dict:
    from kernels.kv_store import ops as kv_ops
    from kernels.kv_store import reference as kv_ref

    seq = L + 1  # token L is appended; (L - R) % G == 0, so the oldest residual group is flushed first
    nbytes = decode_store_bytes(B, H, D, bits)
    rec = record("residual_flush", bits, B, seq, H, H, D, copy_gbps)

    def body(rec):
        assert (seq - 1 - R) % G == 0
        k_sets = n_sets(nbytes, max_sets=16)
        data = make_kivi_sets(B, seq, H, H, D, bits, bits, DTYPE, DEV, k_sets, seed=23)
        kv = torch.randn(2, k_sets, B, H, D, device=DEV, dtype=DTYPE, generator=gen(24))
        pools = [data["pools"][n] for n in KIVI_POOLS]
        ints = dict(k_bits=bits, v_bits=bits, group_size=G, residual_length=R, page_size=P)
        s = data["sets"][0]
        ref = [x.clone() for x in pools]
        kv_ops.store_decode(kv[0, 0], kv[1, 0], s["seq_lens"], s["slots"], s["block_table"], *pools, **ints)
        kv_ref.store_decode(kv[0, 0], kv[1, 0], s["seq_lens"], s["slots"], s["block_table"], *ref, **ints)
        rec["check_codes_equal"] = bool(torch.equal(ref[0], pools[0]) and torch.equal(ref[3], pools[3]))
        rec["check_rel_l2"] = rel_l2(pools[6], ref[6])
        del ref

        def one(i):  # every call repeats the same work (the flushed group is re-read and rewritten)
            s = data["sets"][i]
            kv_ops.store_decode(kv[0, i], kv[1, i], s["seq_lens"], s["slots"], s["block_table"], *pools, **ints)
        finish(rec, timed([lambda i=i: one(i) for i in range(k_sets)]), nbytes)

    return guarded(rec, 16 * kivi_bytes(B, seq, H, H, D, bits, bits) + 2**30, body)


# ------------------------------------------------------------------------------------------------------ main
def attention_shapes(quick: bool, smoke: bool):
    if smoke:
        return [(2, 300, 4, 2, 64)]
    heads = [(32, 32), (32, 8)]
    if quick:
        shapes = [(1, 4096), (8, 4096), (64, 4096), (8, 32768), (1, 131072)]
    else:  # the target shapes first, so a run cut short still has them
        first = [(8, 4096), (64, 4096), (8, 32768), (1, 131072), (256, 4096), (64, 32768), (256, 32768)]
        rest = [(b, c) for b in (1, 8, 64, 256) for c in (512, 4096, 32768) if (b, c) not in first]
        shapes = first + rest
    return [(b, c, hq, h, 128) for b, c in shapes for hq, h in heads]


def precompile_all(shapes, tune: bool) -> dict:
    """Compile every decode variant the run will launch, in parallel processes (Triton's cache is shared)."""
    from kernel_sweep import precompile

    specs = []
    for B, L, Hq, H, _D in shapes:
        for bits in (2, 4):
            for t in decode_candidates(B, L, Hq, H, bits, tune):
                specs.append(("new", bits, Hq, H, t))
    return precompile(specs, ARGS.workers)


def main() -> None:
    if DEV.type == "cpu" and not ARGS.cpu_smoke:
        sys.exit("no CUDA device: run with --cpu-smoke for the CPU check")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    shapes = attention_shapes(ARGS.quick, ARGS.cpu_smoke)
    compile_errors = precompile_all(shapes, ARGS.tune) if DEV.type == "cuda" else {}
    copy = copy_bandwidth(DEV, nbytes=2 * 2**30 if DEV.type == "cuda" else 64 * 2**20)
    copy_gbps = copy["gbs"]
    log(f"copy bandwidth {copy_gbps:.0f} GB/s")
    header = env_header(DEV)
    records = []
    t_start = time.time()

    def save():
        for r in records:
            rl2 = r.get("check_rel_l2")
            if rl2 is not None:
                r["check"] = "ok" if rl2 <= CHECK_TOL and r.get("check_codes_equal", True) else "fail"
        result = dict(header=header, copy=copy, wall_s=round(time.time() - t_start, 1), quick=ARGS.quick,
                      tune=ARGS.tune, cpu_smoke=ARGS.cpu_smoke, compile_errors=compile_errors, records=records)
        if ARGS.out:
            write_json(ARGS.out, result)
        return result

    if ARGS.cpu_smoke:
        store_cfgs = dict(prefill=[(1, 256, 2, 64)], flush=[(2, 2, 64)])
    else:
        store_cfgs = dict(prefill=[(b, 4096, h, 128) for h in (8, 32) for b in ((1,) if ARGS.quick else (1, 8))],
                          flush=[(b, h, 128) for h in (8, 32) for b in (64, 256)])
    for bits in (2, 4):
        for B, T, H, D in store_cfgs["prefill"]:
            records.append(bench_store_prefill(B, T, H, D, bits, copy_gbps))
            log(summary_line(records[-1]))
        for B, H, D in store_cfgs["flush"]:
            records.append(bench_store_flush(B, H, D, bits, copy_gbps))
            log(summary_line(records[-1]))
    save()
    for B, L, Hq, H, D in shapes:
        recs = [bench_sdpa(B, L, Hq, H, D, copy_gbps), bench_paged(B, L, Hq, H, D, copy_gbps)]
        recs += [bench_kivi(B, L, Hq, H, D, bits, copy_gbps, ARGS.tune) for bits in (2, 4)]
        if (B <= 8 and L <= 4096) or ARGS.cpu_smoke:
            recs.append(bench_reference(B, L, Hq, H, D, copy_gbps))
        sdpa_ms = recs[0].get("ms")
        for r in recs:
            if sdpa_ms and r.get("ms") and r is not recs[0]:
                r["speedup_vs_sdpa_bf16"] = sdpa_ms / r["ms"]
            log(summary_line(r))
        records.extend(recs)
        save()
    result = save()
    print_table(records)
    print(json.dumps(dict(header=header, copy_gbps=copy_gbps, n_records=len(records)), default=str))
    return result


def summary_line(r: dict) -> str:
    head = f"{r.get('kernel', '?'):18s} b{r.get('bits', '-')!s:>2} B={r.get('batch')!s:>4} L={r.get('context')!s:>6} " \
           f"H={r.get('q_heads')}/{r.get('kv_heads')}"
    if r.get("skipped") or r.get("error") or r.get("ms") is None:
        return f"{head}  {'skipped: ' + r['skipped'] if r.get('skipped') else 'ERROR ' + str(r.get('error'))}"
    frac = r.get("frac_of_copy")
    sp = r.get("speedup_vs_sdpa_bf16")
    return (f"{head}  {r['ms']:.4f} ms  {r['gbps']:.0f} GB/s" + (f" ({frac:.0%} of copy)" if frac else "")
            + (f"  x{sp:.2f} vs sdpa" if sp else "") + f"  rel_l2 {r.get('check_rel_l2', float('nan')):.1e}")


def print_table(records) -> None:
    print("kernel             bits batch context  heads     ms        GB/s   copy%  vs_sdpa  check")
    for r in records:
        if r.get("ms") is None:
            why = r.get("skipped") or r.get("error") or ""
            print(f"{r.get('kernel', '?'):18s} {r.get('bits', '')!s:>4} {r.get('batch', '')!s:>5} "
                  f"{r.get('context', '')!s:>7}  {r.get('q_heads', '')}/{r.get('kv_heads', '')}  -- {why[:60]}")
            continue
        frac = r.get("frac_of_copy")
        sp = r.get("speedup_vs_sdpa_bf16")
        print(f"{r['kernel']:18s} {r['bits']!s:>4} {r['batch']:>5} {r['context']:>7}  "
              f"{r['q_heads']}/{r['kv_heads']:<3} {r['ms']:9.4f} {r['gbps']:9.0f} {(frac or 0) * 100:6.1f}  "
              f"{sp or 0:7.2f}  {r.get('check', '')}")


if __name__ == "__main__":
    main()
