"""Where a split decode-attention call's time goes (GPU): the tensor-core kernel, the split merge, and the gaps
between them, per shape, from the CUDA profiler's kernel records over rotating input sets (so reads come from
DRAM), beside the call's CUDA-graph time as bench_kernels measures it.

    python3 benchmarks/split_probe.py [--shapes 8,4096,32,8 1,131072,32,8] [--step-blocks 1 2] [--no-pdl]
                                      [--out probe.json]

Prints one line per shape and one JSON object last: `header` (common.env_header: date, GPU, versions) and per
shape and step_blocks (the kernel's 64-token blocks a step) in `records` `graph_us` (gpu_timing.time_graph,
launch gaps included), `kernels` ({kernel name: mean us per call}), `num_splits`, `bytes`, `step_blocks` and
`pdl` (False with --no-pdl: the merge launched after the kernel, not as its programmatic dependent).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

D = 128
DEFAULT_SHAPES = ["8,4096,32,8", "4,4096,32,8", "8,4096,32,32", "8,32768,32,8", "1,131072,32,8", "1,131072,32,32",
                  "64,4096,32,8"]


def kernel_means(calls, repeats: int = 40) -> dict:
    """{kernel name: mean device us per call} over repeats passes of calls (one call each, cycled sets)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(repeats):
            calls[i % len(calls)]()
        torch.cuda.synchronize()
    totals = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.time_range.elapsed_us()
    return {name.split("(")[0][:60]: round(us / repeats, 2) for name, us in totals.items()}


def probe(B: int, L: int, Hq: int, H: int, l2: int, step_blocks=(1,)) -> list[dict]:
    from gpu_timing import sets_for, time_graph
    from kernel_sweep import resolve
    from kivi_data import kivi_args, kivi_bytes, make_kivi_sets

    from kivi_kernels.decode_attention import decode_attention

    nbytes = kivi_bytes(B, L, Hq, H, D, 2, 2)
    n_sets = sets_for(nbytes, l2)
    data = make_kivi_sets(B, L, Hq, H, D, 2, 2, torch.bfloat16, torch.device("cuda"), n_sets, seed=5)
    tuning = resolve("new", B, L, Hq, H, dict(mma=True))  # the launcher's default split count, made explicit
    outs = [torch.empty_like(s["q"]) for s in data["sets"]]
    recs = []
    for sb in step_blocks:
        ints = dict(sm_scale=D**-0.5, k_bits=2, v_bits=2, group_size=32, residual_length=128, page_size=128,
                    step_blocks=sb, **tuning)
        calls = [(lambda i=i, ints=ints, data=data: decode_attention(data["sets"][i]["q"], *kivi_args(data, i),
                                                                     out=outs[i], **ints)) for i in range(n_sets)]
        graph = time_graph(calls)
        recs.append(dict(batch=B, context=L, q_heads=Hq, kv_heads=H, num_splits=tuning["num_splits"], bytes=nbytes,
                         step_blocks=sb, graph_us=round(graph["ms"] * 1e3, 2), kernels=kernel_means(calls)))
    del data
    torch.cuda.empty_cache()
    return recs


def main() -> None:
    from common import env_header, finish
    from gpu_timing import l2_bytes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, help="B,L,q_heads,kv_heads")
    ap.add_argument("--step-blocks", nargs="*", type=int, default=[1], help="the kernel's blocks a step, each timed")
    ap.add_argument("--no-pdl", action="store_true", help="launch the merge after the kernel (no PDL)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("split_probe needs a CUDA GPU")
    from kivi_kernels.decode_attention import common as C

    if args.no_pdl:
        C.programmatic_launch = lambda device: False
    pdl = C.programmatic_launch(torch.device("cuda"))
    l2 = l2_bytes()
    records = []
    for shape in args.shapes:
        B, L, Hq, H = (int(x) for x in shape.split(","))
        for rec in probe(B, L, Hq, H, l2, args.step_blocks):
            records.append(dict(rec, pdl=pdl))
            print(f"B={B} L={L} {Hq}/{H} splits={rec['num_splits']} step_blocks={rec['step_blocks']} pdl={pdl} "
                  f"graph {rec['graph_us']} us  {rec['kernels']}", flush=True)
    result = dict(header=env_header(torch.device("cuda")), records=records)
    finish(args.out, result)


if __name__ == "__main__":
    main()
