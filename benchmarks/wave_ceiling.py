"""What holds issue 5's missed decode-attention shapes, from one wave_ceiling_device.sh run (CPU only, no GPU).

Inputs: the run's ncu CSV (the tensor-core kernel alone, one launch a shape, raw counters of the launch, occupancy,
scheduler and warp-state sections) and its bench_kernels JSON (the whole call by CUDA-graph replay, the split merge
included, with a plain copy of the same bytes beside it). Per profiled shape (B, L, KV heads; 32 query heads):

- programs, waves (programs over the resident slots: the tightest of ncu's occupancy limits, registers, shared
  memory, warps and blocks, times the SMs), registers a thread;
- inst_per_program: instructions a one-warp program executes (smsp__inst_executed over the grid), and the
  scheduler's issue rate (instructions issued a cycle) with the warps it holds (ncu's active warps over 4);
- cycles_per_inst: cycles between a warp's instructions, and the stall reasons that make it up (per instruction);
- call_us / frac_of_copy: bench_kernels' call time and its share of the 2 GiB copy's bandwidth;
- target: issue 5's share of copy for the shape (70% at B >= 8 and L >= 4,096; 60% at B=1, L=131,072), target_us the
  call time it needs, kernel_speedup_needed = kernel_us / (target_us - outside_us) with outside_us = call_us -
  kernel_us (the merge and the launch gap; ncu's kernel runs at its own clock, so this is an estimate);
- same_size_copy: the share of copy that a plain copy of the call's bytes reaches (bench_kernels'
  copy_same_bytes), and need_of_same_size_copy = target / same_size_copy, the share of that copy's speed the
  target asks of the kernel, beside has_of_same_size_copy, the share it reaches now.

    python benchmarks/wave_ceiling.py --ncu <run>/ncu.csv --kernels <run>/kernels.json --out wave-ceiling.json

Prints a table on stderr and one JSON object last.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

Q_HEADS, SCHEDULERS_PER_SM = 32, 4


def target_of(batch: int, context: int) -> float | None:
    """Issue 5's share of copy for a 2-bit decode call, or None where it sets none."""
    if batch == 1 and context == 131072:
        return 0.60
    return 0.70 if batch >= 8 and context >= 4096 else None


def number(text: str) -> float:
    return float(text.replace(",", ""))


def ncu_shapes(path: Path) -> dict[tuple[int, int, int], dict[str, str]]:
    """{(B, L, KV heads): {metric: value}} from the CSV wave_ceiling_device.sh writes (`# shape B,L,H` lines, each
    followed by ncu's raw page: a header row, a units row and one row for the profiled launch)."""
    shapes = {}
    for part in path.read_text().split("# shape ")[1:]:
        head, body = part.split("\n", 1)
        rows = list(csv.reader(io.StringIO(body)))
        if len(rows) < 3:
            continue  # ncu failed or timed out for this shape
        shapes[tuple(int(x) for x in head.split(","))] = dict(zip(rows[0], rows[2], strict=False))
    return shapes


def stalls(counters: dict[str, str], top: int = 5) -> dict[str, float]:
    """The `top` stall reasons in cycles per issued instruction (ncu's per-issue-active ratios)."""
    prefix, suffix = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
    found = {k[len(prefix):-len(suffix)]: number(v) for k, v in counters.items()
             if k.startswith(prefix) and k.endswith(suffix) and v}
    return {k: round(v, 2) for k, v in sorted(found.items(), key=lambda kv: -kv[1])[:top]}


def bench_records(path: Path) -> tuple[dict, dict, float]:
    """(2-bit decode records, 2-bit copy_same_bytes records, copy GB/s), both keyed by (B, L, KV heads)."""
    run = json.loads(path.read_text())
    key = lambda r: (r["batch"], r["context"], r["kv_heads"])
    pick = lambda name: {key(r): r for r in run["records"] if r["kernel"] == name and r.get("bits") == 2
                         and r.get("q_heads") == Q_HEADS and r.get("ms")}
    return pick("decode_attention"), pick("copy_same_bytes"), run["copy"]["gbs"]


def row(shape: tuple[int, int, int], counters: dict[str, str], call: dict, copy_rec: dict | None,
        copy_gbs: float) -> dict:
    batch, context, kv_heads = shape
    grid = [int(x) for x in counters["Grid Size"].strip("()").split(",")]
    programs = grid[0] * grid[1] * grid[2]
    sms = int(number(counters["device__attribute_multiprocessor_count"]))
    limits = [counters.get(f"launch__occupancy_limit_{name}") for name in ("registers", "shared_mem", "warps",
                                                                          "blocks")]
    per_sm = min(int(number(v)) for v in limits if v)
    kernel_us = number(counters["gpu__time_duration.sum"]) / 1e3
    clock_ghz = number(counters["sm__cycles_elapsed.avg.per_second"]) / 1e9
    call_us, frac = call["ms"] * 1e3, call["frac_of_copy"]
    warps = number(counters["sm__warps_active.avg.per_cycle_active"])
    out = dict(batch=batch, context=context, q_heads=Q_HEADS, kv_heads=kv_heads, splits=grid[2], programs=programs,
               registers=int(number(counters["launch__registers_per_thread"])), programs_per_sm=per_sm,
               waves=round(programs / (per_sm * sms), 2), kernel_us=round(kernel_us, 2),
               sm_clock_ghz=round(clock_ghz, 3),
               inst_per_program=round(number(counters["smsp__inst_executed.sum"]) / programs),
               issue_per_scheduler_cycle=number(counters["smsp__issue_active.avg.per_cycle_active"]),
               warps_per_scheduler=round(warps / SCHEDULERS_PER_SM, 2),
               cycles_per_inst=number(counters["smsp__average_warp_latency_per_inst_issued.ratio"]),
               stalls=stalls(counters), call_us=round(call_us, 2), bytes=call["bytes"], frac_of_copy=round(frac, 3))
    target = target_of(batch, context)
    if target is not None:
        target_us = call["bytes"] / (target * copy_gbs * 1e3)
        outside_us = max(call_us - kernel_us, 0.0)
        out.update(target=target, met=frac >= target, target_us=round(target_us, 2),
                   kernel_speedup_needed=round(kernel_us / max(target_us - outside_us, 1e-9), 3))
    if copy_rec is not None:
        same = copy_rec["frac_of_copy"]
        out.update(same_size_copy=round(same, 3), has_of_same_size_copy=round(frac / same, 3))
        if target is not None:
            out["need_of_same_size_copy"] = round(target / same, 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ncu", required=True, help="the run's ncu.csv")
    p.add_argument("--kernels", required=True, help="the run's bench_kernels JSON")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    calls, copies, copy_gbs = bench_records(Path(args.kernels))
    rows = [row(shape, counters, calls[shape], copies.get(shape), copy_gbs)
            for shape, counters in ncu_shapes(Path(args.ncu)).items() if shape in calls]
    for r in rows:
        print(f"B={r['batch']:>3} L={r['context']:>6} 32/{r['kv_heads']:<2} {r['programs']:>5} programs "
              f"({r['waves']} waves, {r['registers']} regs) {r['inst_per_program']:>6} inst a program, issue "
              f"{r['issue_per_scheduler_cycle']} at {r['warps_per_scheduler']} warps a scheduler; call "
              f"{r['call_us']} us ({r['frac_of_copy']:.0%}), target {r.get('target', '-')}: kernel x"
              f"{r.get('kernel_speedup_needed', '-')}, same-size copy {r.get('same_size_copy', '-')} needs "
              f"{r.get('need_of_same_size_copy', '-')} of it, has {r.get('has_of_same_size_copy', '-')}",
              file=sys.stderr)
    result = {"ncu_source": str(args.ncu), "kernels_source": str(args.kernels), "copy_gbps": copy_gbs, "rows": rows}
    if args.out:  # written here: benchmarks/common.finish would import torch
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
