"""Blocks an online-softmax step on engine-like rows: the launcher's rule against one block a step (GPU).

Two blocks a step (versions 25-26) are chosen by the block table's capacity (ops_mma.mma_step_blocks): in the
engine, whose tables hold max_model_len, short rows take two a step as well, where one is faster. This probe times,
on rows as the engine holds them (longest first, in a table 16 pages wide or more) and on issue 5's uniform shapes,
each call the launcher's way ("default") and at one block a step ("one-block"); the split count is the launcher's
own. (step-20261201-h200.json also has a "capacity" and a "per-program" variant: 0cd35a0's tree, where step_blocks
0 chose per program inside the kernel; "capacity" there is "default" here.)

    python3 benchmarks/step_probe.py [--shapes a:256:161:497:32:32 ...] [--bits 2] [--out probe.json]

A shape is name:B:shortest:longest:q_heads:kv_heads (row_order_probe.py). Times are CUDA-graph replays over
rotating input sets, each variant checked against the reference on two rows first. Prints one line per case and
one JSON object last: `header`, `copy_gbps` and `records` with `system`, `shape`, `variant`, `us`, `bytes`,
`gbps` and `frac_of_copy`.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# engine rows (a, b, d at 32/32 heads, a and b of Llama-3-8B at 32/8, a GQA mix, e's early and late rows), then
# issue 5's shapes
DEFAULT_SHAPES = ["a:256:161:497:32:32", "b:150:1153:1278:32:32", "d:125:1040:2048:32:32", "a8:512:161:497:32:8",
                  "b8:256:1153:1278:32:8", "e1:96:257:900:32:32", "e2:96:900:2300:32:32", "gqa:200:512:4096:32:8",
                  "u8:8:4096:4096:32:32", "u8g:8:4096:4096:32:8", "u64:64:4096:4096:32:32", "u64g:64:4096:4096:32:8",
                  "u256g:256:4096:4096:32:8", "u8l:8:32768:32768:32:32", "u8lg:8:32768:32768:32:8"]
VARIANTS = {"default": {}, "one-block": dict(step_blocks=1)}


def run_variant(bits: int, shape: str, variant: str, copy_gbps: float, l2: int) -> dict:
    from row_order_probe import kivi_case, measure, parse_shape

    name, B, Hq, H, lengths = parse_shape(shape)
    calls, check, nbytes = kivi_case(lengths, Hq, H, bits, l2, mma=True, **VARIANTS[variant])
    rec = measure(dict(system=f"kivi-{bits}", shape=name, batch=B, q_heads=Hq, kv_heads=H, variant=variant,
                       lengths=[min(lengths), round(sum(lengths) / B, 1), max(lengths)], bytes=nbytes),
                  calls, check, "longest-first", copy_gbps)
    print(f"kivi-{bits} {name:6s} B={B} {Hq}/{H} lengths {rec['lengths']} {variant:10s} {rec.get('us')} us "
          f"({rec.get('frac_of_copy')} of copy) check {rec['check_rel_l2']:.1e}", flush=True)
    torch.cuda.empty_cache()
    return rec


def main() -> None:
    from common import env_header, finish
    from row_order_probe import gpu_setup

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, help="name:B:shortest:longest:q_heads:kv_heads")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--bits", nargs="*", type=int, default=[2])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device, copy_gbps, l2 = gpu_setup("step_probe")
    records = [run_variant(bits, shape, v, copy_gbps, l2)
               for shape in args.shapes for bits in args.bits for v in args.variants]
    finish(args.out, dict(header=env_header(device), copy_gbps=copy_gbps, records=records))


if __name__ == "__main__":
    main()
