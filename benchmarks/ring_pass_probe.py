"""Version 27's ring pass against the ring read inside the tensor-core kernel, on engine-like rows (GPU).

The tensor-core kernel's one-warp programs hold 212 registers, 8 an SM, and read the full-precision ring at 0.85
of the copy bandwidth where the paged bf16 kernel's 4-warp programs read the same bytes at 1.02. With the ring
pass (ops_mma.MMA_RING_PASS) the ring is read by programs of its own (kernel_ring.py) on a side stream, beside the
tensor-core kernel over the packed blocks, and merged as one more split. This probe times one call each way over
rows as the engine holds them (longest first, grid (H, B)) or uniform rows (issue 5's shapes: name:B:L:L:Hq:H),
the ring pass with several tiles, and the paged bf16 kernel over the same lengths; the split count is the
launcher's own:

    python3 benchmarks/ring_pass_probe.py [--shapes a:256:161:497:32:32 ...] [--tiles 32x2 64x4]
                                          [--bits 2 4] [--out probe.json]

A shape is name:B:shortest:longest:q_heads:kv_heads (row_order_probe.py). Times are CUDA-graph replays over
rotating input sets, each variant checked against the reference on two rows first. Prints one line per case and
one JSON object last: `header`, `copy_gbps` and `records` with `system`, `shape`, `variant` ("in-kernel",
"ring-pass-<block_n>x<warps>", or "paged" for the bf16 kernel), `us`, `bytes`, `gbps` and `frac_of_copy`.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_TILE = (32, 2)  # ops_ring's RING_BLOCK_N, RING_WARPS
# all ring (L=128), a's rows (160-497 tokens: ~85% ring by bytes), b's (~40%), d's, uniform rows of 4,096, GQA
DEFAULT_SHAPES = ["ring:256:128:128:32:32", "ring8:512:128:128:32:8", "a:256:161:497:32:32",
                  "b:150:1153:1278:32:32", "d:125:1040:2048:32:32", "packed:150:4096:4096:32:32",
                  "b64:64:4096:4096:32:32", "gqa:200:512:4096:32:8"]


def run_variant(system: str, shape: str, variant: str, copy_gbps: float, l2: int) -> dict:
    from row_order_probe import bf16_case, kivi_case, measure, parse_shape

    from kivi_kernels.decode_attention import ops_ring

    name, B, Hq, H, lengths = parse_shape(shape)
    if variant == "paged":
        calls, check, nbytes = bf16_case(lengths, Hq, H, l2)
    else:
        ring_pass = variant != "in-kernel"
        if ring_pass:
            block_n, warps = map(int, variant.rsplit("-", 1)[1].split("x"))
            ops_ring.RING_BLOCK_N, ops_ring.RING_WARPS = block_n, warps  # read at each launch
        calls, check, nbytes = kivi_case(lengths, Hq, H, int(system.split("-")[1]), l2, ring_pass=ring_pass)
    rec = measure(dict(system=system, shape=name, batch=B, q_heads=Hq, kv_heads=H, variant=variant,
                       lengths=[min(lengths), round(sum(lengths) / B, 1), max(lengths)], bytes=nbytes),
                  calls, check, "longest-first", copy_gbps)
    print(f"{system:7s} {name:6s} B={B} {Hq}/{H} lengths {rec['lengths']} {variant:16s} {rec.get('us')} us "
          f"({rec.get('frac_of_copy')} of copy) check {rec['check_rel_l2']:.1e}", flush=True)
    ops_ring.RING_BLOCK_N, ops_ring.RING_WARPS = DEFAULT_TILE
    torch.cuda.empty_cache()
    return rec


def main() -> None:
    from common import env_header, finish
    from row_order_probe import gpu_setup

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, help="name:B:shortest:longest:q_heads:kv_heads")
    ap.add_argument("--tiles", nargs="*", default=["32x2", "64x4"], help="ring pass block_n x warps")
    ap.add_argument("--bits", nargs="*", type=int, default=[2, 4])
    ap.add_argument("--no-paged", action="store_true", help="skip the paged bf16 kernel")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device, copy_gbps, l2 = gpu_setup("ring_pass_probe")
    variants = ["in-kernel"] + [f"ring-pass-{t}" for t in args.tiles]
    records = []
    for shape in args.shapes:
        for bits in args.bits:
            records += [run_variant(f"kivi-{bits}", shape, v, copy_gbps, l2) for v in variants]
        if not args.no_paged:
            records.append(run_variant("bf16", shape, "paged", copy_gbps, l2))
    finish(args.out, dict(header=env_header(device), copy_gbps=copy_gbps, records=records))


if __name__ == "__main__":
    main()
