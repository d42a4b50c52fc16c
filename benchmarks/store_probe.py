"""The decode store's forms and launch settings on the engine's steps and on steps where every row flushes (GPU).

Store 14 (kv_store.ops.STORE_FLUSH_ITEMS: appends by row, flushes shared out as items over a fixed set of
programs) at each (num_warps, flush programs an SM) of `--items`, against the forms before it (a program per head's
keys or values looping over its chunks, and a program per chunk), on three kinds of step (store_cases.FLUSHING):
every row flushes ("all", issue 5's residual_flush), 1 row in 32 does ("staggered", an engine's step of rows of
mixed lengths) and none does ("none", 31 of 32 steps of rows that started together). Each call is checked against
the reference before timing (store_cases.bench_store_flush).

    python3 benchmarks/store_probe.py [--items 1x16 2x8 4x4] [--out probe.json]
    TRITON_INTERPRET=1 python3 benchmarks/store_probe.py --cpu-smoke

Prints one line per case and one JSON object last: `header`, `copy_gbps` and `records` (bench_kernels' store
records, with `form` and the tuning).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (B, H, flushing): issue 5's flush shapes and b's all-flush step (150 rows), then the engine's steps
GPU_CASES = [(64, 8, "all"), (256, 8, "all"), (64, 32, "all"), (150, 32, "all"), (256, 32, "all"),
             (141, 32, "staggered"), (238, 32, "staggered"), (256, 32, "staggered"), (64, 8, "staggered"),
             (256, 8, "staggered"), (150, 32, "none"), (256, 32, "none")]
SMOKE_CASES = [(3, 2, "all"), (3, 2, "staggered")]
BEFORE = {"loop": dict(flush_items=False, loop_chunks=True), "chunks": dict(flush_items=False, loop_chunks=False)}


def forms(items: list[str], sms: int) -> dict[str, dict]:
    """{form name: store_decode tuning}: "items-<warps>x<per SM>" for each of `items`, then the forms before."""
    out = {}
    for spec in items:
        head, _, block_c = spec.partition("c")
        warps, per_sm = (int(x) for x in head.split("x"))
        out[f"items-{spec}"] = dict(flush_items=True, num_warps=warps, flush_programs=per_sm * sms,
                                    **(dict(block_c=int(block_c)) if block_c else {}))
    return {**out, **BEFORE}


def main() -> None:
    import torch
    from common import copy_bandwidth, env_header, finish
    from store_cases import bench_store_flush

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", nargs="*", default=["1x8", "1x12", "1x16", "1x8c64"],
                    help="store 14's settings as <num_warps>x<flush programs an SM>[c<block_c>]")
    ap.add_argument("--bits", nargs="*", type=int, default=[2])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny cases on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    copy_gbps = copy_bandwidth(dev, nbytes=2**24 if args.cpu_smoke else 2 * 2**30)["gbs"]
    D, L = (64, 1152) if args.cpu_smoke else (128, 1152)
    records = []
    for bits in args.bits:
        for B, H, flushing in SMOKE_CASES if args.cpu_smoke else GPU_CASES:
            for name, tuning in forms(args.items, sms).items():
                rec = bench_store_flush(B, H, D, bits, copy_gbps, L=L, tuning=tuning, flushing=flushing)
                rec["form"] = name
                records.append(rec)
                us = rec.get("ms", float("nan")) * 1e3
                print(f"{rec['kernel']:22s} {bits}b B={B:4d} H={H:3d} {name:12s} {us:8.1f} us "
                      f"({rec.get('frac_of_copy') or 0:.0%} of copy) codes equal {rec.get('check_codes_equal')}",
                      flush=True)
    finish(args.out, dict(header=env_header(dev), copy_gbps=copy_gbps, records=records))


if __name__ == "__main__":
    main()
