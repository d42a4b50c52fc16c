"""Version 28's persistent programs against the tensor-core kernel's grid of one program an item (GPU).

A program of kernel_mma.py pays, alone, its row's lookups, the query's load and its first block's latency before
any math, and on short rows (b's ~17 blocks, a's 0-5) that is a large part of each program. The persistent kernel
(kernel_mma_persistent.py, `persistent=True`) keeps 8 programs an SM that take (row, KV head, split) items from a
counter, the next item's query and first block in flight while the current item ends. This probe times, on rows as
the engine holds them (longest first) and on issue 5's uniform shapes, each call three ways: the launcher's
defaults ("default": two blocks a step and the ring pass where its rules say), the same kernel at one block a
step without the ring pass ("one-block", what the persistent kernel computes per item), and "persistent"; the
split count is the launcher's own:

    python3 benchmarks/persistent_probe.py [--shapes b:150:1153:1278:32:32 ...] [--bits 2 4] [--out probe.json]

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

# engine rows (a, b, d at 32/32 heads; b of Llama-3-8B at 32/8; a GQA mix), then issue 5's shapes
DEFAULT_SHAPES = ["a:256:161:497:32:32", "b:150:1153:1278:32:32", "d:125:1040:2048:32:32",
                  "b8:256:1153:1278:32:8", "gqa:200:512:4096:32:8", "u8:8:4096:4096:32:32",
                  "u8g:8:4096:4096:32:8", "u64:64:4096:4096:32:32", "u64g:64:4096:4096:32:8",
                  "u256g:256:4096:4096:32:8", "u8l:8:32768:32768:32:32", "u8lg:8:32768:32768:32:8"]
VARIANTS = {"default": {}, "one-block": dict(step_blocks=1, ring_pass=False), "persistent": dict(persistent=True)}


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
    device, copy_gbps, l2 = gpu_setup("persistent_probe")
    records = [run_variant(bits, shape, v, copy_gbps, l2)
               for shape in args.shapes for bits in args.bits for v in args.variants]
    finish(args.out, dict(header=env_header(device), copy_gbps=copy_gbps, records=records))


if __name__ == "__main__":
    main()
