"""The decode step's matmuls at engine batch widths: time and weight bandwidth per width (issue 3).

On the H200:

    python benchmarks/probe_linear.py --out $OUT/linear.json

Llama-2-7B's products (q/k/v and gate/up fused, as the engine runs them; o, down, lm_head) at batch widths of
the engine's decode graphs, each on 8 copies of its weight so that no call hits the L2 cache, timed as the engine
runs them, inside a CUDA graph (gpu_timing.time_graph; eager events, used before the nineteenth session, added
launch gaps to the small products); torch's `F.linear` (cuBLAS) on the stored [out, in] weight, and `x @ w` on
a transposed copy as a second layout.
`step_matmul_ms` is 32 layers' products plus the head. The peer is the copy bandwidth measured in the same run
(weights' bytes over it: `bound_ms`). cuBLAS's kernel choice depends on the width; the engine's bucket tuning
(model_runner.route_buckets) exists because of what this shows. Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from common import copy_bandwidth, env_header, finish  # noqa: E402
from gpu_timing import time_graph  # noqa: E402

SHAPES = {"qkv": (4096, 12288), "o": (4096, 4096), "gate_up": (4096, 22016), "down": (11008, 4096),
          "lm_head": (4096, 32000)}  # name: (in, out)
WIDTHS = (21, 37, 64, 92, 128, 141, 144, 160, 192, 224, 238, 240, 256)


def time_ms(fn, copies: int) -> float:
    """Median ms per call of fn(i), cycling through the weight copies, replayed as one CUDA graph."""
    return time_graph([lambda i=i: fn(i) for i in range(copies)])["ms"]


def width_record(m: int, weights: dict, transposed: dict) -> dict:
    row = {"rows": m}
    step = step_t = 0.0
    for name, (k, n) in SHAPES.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ws, wts = weights[name], transposed[name]
        ms = time_ms(lambda i, x=x, ws=ws: torch.nn.functional.linear(x, ws[i]), len(ws))
        ms_t = time_ms(lambda i, x=x, wts=wts: x @ wts[i], len(wts))
        row.update({f"{name}_us": round(ms * 1e3, 1), f"{name}_gbps": round(k * n * 2 / ms / 1e6),
                    f"{name}_t_us": round(ms_t * 1e3, 1)})
        layers = 1 if name == "lm_head" else 32
        step, step_t = step + ms * layers, step_t + ms_t * layers
    row.update(step_matmul_ms=round(step, 3), step_matmul_t_ms=round(step_t, 3))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    copy = copy_bandwidth(dev)
    weights = {n: [torch.randn(o, k, device=dev, dtype=torch.bfloat16) for _ in range(8)]
               for n, (k, o) in SHAPES.items()}
    transposed = {n: [w.t().contiguous() for w in ws[:4]] for n, ws in weights.items()}
    step_bytes = sum(k * o * 2 * (1 if n == "lm_head" else 32) for n, (k, o) in SHAPES.items())
    header = dict(env_header(dev), copy_bandwidth_gbs=copy["gbs"],
                  bound_ms=round(step_bytes / (copy["gbs"] * 1e9) * 1e3, 3))
    records = []
    for m in WIDTHS:
        records.append(width_record(m, weights, transposed))
        print(records[-1], flush=True)
    result = {"header": header, "records": records}
    finish(args.out, result)


if __name__ == "__main__":
    main()
