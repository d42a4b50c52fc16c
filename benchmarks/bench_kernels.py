"""Kernel benchmark: KIVI decode attention (2/4-bit) against SDPA and the paged kernel over bf16; cache stores.

On the H200 (a few minutes; --quick: a subset):

    python benchmarks/bench_kernels.py --out $OUT/bench_kernels.json [--quick] [--tune]

On a CPU (sets TRITON_INTERPRET=1, one tiny config through every kernel; catches errors before the device):

    python benchmarks/bench_kernels.py --cpu-smoke

Kernels (head_dim 128, 32 query heads with 32 or 8 KV heads, batch 1/8/64/256, context 512/4096/32768 and
131072 at batch 1; G=32, R=128, page 128; every row holds `context` tokens: packed tokens + 97..128 residual):
  decode_attention      kivi_kernels.decode_attention over a 2-bit and a 4-bit cache (k_bits = v_bits), bf16; with
                        --tune, each shape also tries a few launch configurations (`candidates`) and reports the
                        fastest (its `tuning`); without it, the launcher's own table decides. Store kernels: the
                        default launch ({}) and, with --tune, each (block_c, num_warps) of STORE_CANDIDATES
  sdpa_bf16             torch SDPA (flash backend) with q of length 1 over contiguous bf16 K/V [B, H, L, D]
                        (enable_gqa for 8 KV heads)
  paged_bf16            kivi_kernels.paged_attention.paged_decode_attention over a bf16 page pool
  reference             kivi_kernels.decode_attention.reference (2-bit), batch <= 8 and context <= 4096, eager only
  copy_same_bytes       torch copy_ of a 2-bit and a 4-bit decode call's bytes (below), every shape
  quantize_pack         kivi_kernels.kv_store store_prefill of a 4096-token prompt (batch 1 and 8; 8 and 32 KV heads)
  residual_flush        kivi_kernels.kv_store store_decode at a step where every row flushes its oldest residual group
                        (batch 64 and 256; 8 and 32 KV heads)
  residual_append       the same at an engine's step, where 1 row in 32 flushes (rows of staggered lengths up to
                        1,153 tokens; batch 141 and 238 with 32 KV heads, workloads b and a; 64 and 256 with 8)
  residual_append_only  the same where no row flushes (rows of one length, 1,152 tokens: 31 of 32 steps of rows
                        that started together, as in a wave of workload b or e)

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
                copy_same_bytes: a copy_ moving a decode call's bytes (half read, half written) for each shape
                and bits, timed the same way; a decode record's frac_of_same_size_copy is that copy's ms / its
                ms (how close the call comes to what a plain copy of its size reaches, ramp and tail included).
  check         before timing, outputs on rows 0 and B-1 against the fp32 reference (or torch math) of the same
                data: rel_l2 = ||out - ref|| / ||ref||; "fail" above 2e-2. Stores: codes equal the reference's.
Random data is drawn with private generators before any capture (a failed capture cannot break later draws).
A config that does not fit (estimated bytes > 85% of free memory) is recorded as skipped; an exception is
recorded with its message and the run goes on. The JSON is rewritten after every shape.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent),
                 str(Path(__file__).resolve().parent.parent / ".scratch")]  # --store-baseline


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small subset")
    p.add_argument("--tune", action="store_true", help="try a few launch configurations per decode shape")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny config on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--only", choices=("all", "stores", "quantize", "attention"), default="all",
                   help="which kernels to run (quantize: quantize-and-pack at prefill alone)")
    p.add_argument("--store-baseline", action="store_true",
                   help="also time the store kernels before the channel-chunk rewrite: .scratch/store_ops_v0.py and "
                   "store_kernel_v0.py, made by `git show c20ce12:kernels/kv_store/kernel.py`, and that commit's "
                   "ops.py with store_prefill/store_decode renamed *_v0 and its kernel import pointed at "
                   "store_kernel_v0")
    p.add_argument("--workers", type=int, default=12, help="parallel compile processes (GPU)")
    p.add_argument("--out", default=None, help="write the JSON result here too")
    return p.parse_args()


ARGS = parse_args() if __name__ == "__main__" else argparse.Namespace(cpu_smoke=False)
if ARGS.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before any module defining @triton.jit functions is imported

import json  # noqa: E402

import torch  # noqa: E402
from common import copy_bandwidth, env_header, log, write_json  # noqa: E402
from kernel_cases import (  # noqa: E402
    CHECK_TOL,
    DEV,
    bench_copy_same,
    bench_kivi,
    bench_paged,
    bench_reference,
    bench_sdpa,
    decode_candidates,
)
from store_cases import LOOP_TUNINGS, bench_store_flush, bench_store_prefill, store_tunings  # noqa: E402


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
    shapes = attention_shapes(ARGS.quick, ARGS.cpu_smoke) if ARGS.only not in ("stores", "quantize") else []
    compile_errors = precompile_all(shapes, ARGS.tune) if DEV.type == "cuda" and shapes else {}
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
            elif r.get("check_equal") is not None:  # copy_same_bytes
                r["check"] = "ok" if r["check_equal"] else "fail"
        result = dict(header=header, copy=copy, wall_s=round(time.time() - t_start, 1), quick=ARGS.quick,
                      tune=ARGS.tune, cpu_smoke=ARGS.cpu_smoke, compile_errors=compile_errors, records=records)
        if ARGS.out:
            write_json(ARGS.out, result)
        return result

    if ARGS.cpu_smoke:
        store_cfgs = dict(prefill=[(1, 256, 2, 64)], flush=[(2, 2, 64)], append=[(3, 2, 64)])
    else:
        store_cfgs = dict(prefill=[(b, 4096, h, 128) for h in (8, 32) for b in ((1,) if ARGS.quick else (1, 8))],
                          flush=[(b, h, 128) for h in (8, 32) for b in (64, 256)],
                          append=[(141, 32, 128), (238, 32, 128), (64, 8, 128), (256, 8, 128)])
    store_runs = [("new", t) for t in store_tunings(ARGS.tune)] + ([("v0", {})] if ARGS.store_baseline else [])
    if ARGS.only == "quantize":
        store_cfgs.update(flush=[], append=[])
    for bits in (2, 4) if ARGS.only != "attention" else ():
        for impl, tuning in store_runs:
            for B, T, H, D in store_cfgs["prefill"]:
                records.append(bench_store_prefill(B, T, H, D, bits, copy_gbps, tuning, impl))
                log(summary_line(records[-1]))
            for B, H, D in store_cfgs["flush"]:
                records.append(bench_store_flush(B, H, D, bits, copy_gbps, tuning=tuning, impl=impl))
                log(summary_line(records[-1]))
        for tuning in LOOP_TUNINGS:  # the decode store with and without its loop over a head's chunks
            for B, H, D in store_cfgs["flush"]:
                records.append(bench_store_flush(B, H, D, bits, copy_gbps, tuning=tuning))
                log(summary_line(records[-1]))
        for tuning in store_tunings(ARGS.tune) + LOOP_TUNINGS:  # an engine's step: 1 row in G flushes
            for B, H, D in store_cfgs["append"]:
                for flushing in ("staggered", "none"):
                    records.append(bench_store_flush(B, H, D, bits, copy_gbps, L=1152, tuning=tuning,
                                                     flushing=flushing))
                    log(summary_line(records[-1]))
    save()
    for B, L, Hq, H, D in shapes:
        recs = [bench_sdpa(B, L, Hq, H, D, copy_gbps), bench_paged(B, L, Hq, H, D, copy_gbps)]
        recs += [bench_kivi(B, L, Hq, H, D, bits, copy_gbps, ARGS.tune) for bits in (2, 4)]
        if (B <= 8 and L <= 4096) or ARGS.cpu_smoke:
            recs.append(bench_reference(B, L, Hq, H, D, copy_gbps))
        copies = {bits: bench_copy_same(B, L, Hq, H, D, bits, copy_gbps) for bits in (2, 4)}
        sdpa_ms = recs[0].get("ms")
        for r in recs:
            if sdpa_ms and r.get("ms") and r is not recs[0]:
                r["speedup_vs_sdpa_bf16"] = sdpa_ms / r["ms"]
            same = copies.get(r["bits"]) if r["kernel"] == "decode_attention" else None
            if same and same.get("ms") and r.get("ms"):
                r["frac_of_same_size_copy"] = same["ms"] / r["ms"]
            log(summary_line(r))
        recs += copies.values()
        for r in copies.values():
            log(summary_line(r))
        records.extend(recs)
        save()
    result = save()
    print_table(records)
    print(json.dumps(dict(header=header, copy_gbps=copy_gbps, n_records=len(records)), default=str))
    return result


STORES = ("quantize_pack", "residual_flush", "residual_append", "quantize_pack_v0", "residual_flush_v0")


def summary_line(r: dict) -> str:
    head = f"{r.get('kernel', '?'):18s} b{r.get('bits', '-')!s:>2} B={r.get('batch')!s:>4} L={r.get('context')!s:>6} " \
           f"H={r.get('q_heads')}/{r.get('kv_heads')}" + (f" {r['tuning']}" if r.get("kernel") in STORES else "")
    if r.get("skipped") or r.get("error") or r.get("ms") is None:
        return f"{head}  {'skipped: ' + r['skipped'] if r.get('skipped') else 'ERROR ' + str(r.get('error'))}"
    frac = r.get("frac_of_copy")
    sp = r.get("speedup_vs_sdpa_bf16")
    return (f"{head}  {r['ms']:.4f} ms  {r['gbps']:.0f} GB/s" + (f" ({frac:.0%} of copy)" if frac else "")
            + (f"  x{sp:.2f} vs sdpa" if sp else "")
            + (f"  rel_l2 {r['check_rel_l2']:.1e}" if r.get("check_rel_l2") is not None else "  (no check)"))


def print_table(records) -> None:
    print("kernel             bits batch context  heads     ms        GB/s   copy%  vs_sdpa  same%  check")
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
              f"{sp or 0:7.2f}  {(r.get('frac_of_same_size_copy') or 0) * 100:5.1f}  {r.get('check', '')}")


if __name__ == "__main__":
    main()
