"""The SwiGLU MLP's activation at engine widths: kivi_kernels/silu_mul against transformers' two ops (issue 3).

On the H200:

    python benchmarks/probe_mlp_act.py --out $OUT/mlp-act.json

For each width (decode rows, and prefill chunks of 4,096 tokens) and intermediate size (Llama-2-7B's 11,008,
Llama-3-8B's 14,336), on a fused gate/up product [rows, 2 I] in bf16 as the engine's fused projections leave it:
  silu_mul     our kernel (one read of the product, one write of [rows, I])
  transformers act_fn(gate) * up on the product's two strided halves (transformers' code under fused projections)
  reference    kivi_kernels/silu_mul/reference.py (fp32 math, the spec)
each checked against the reference first, then timed by CUDA-graph replay over rotating input sets larger than
the L2 cache (gpu_timing.time_graph). Bytes: the product read once and the output written once (the floor);
`gbps` is those bytes over the time, `copy_fraction` that over the copy bandwidth measured in the same run.
`step_saving_ms` is 32 layers' difference between transformers' ops and ours. Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import torch  # noqa: E402
from common import copy_bandwidth, env_header, finish  # noqa: E402
from gpu_timing import cuda_generator, l2_bytes, sets_for, time_graph  # noqa: E402

from kivi_kernels.silu_mul import ops, reference  # noqa: E402

WIDTHS = (21, 64, 141, 150, 256, 512, 4096)
INTERMEDIATE = (11008, 14336)


def transformers_act(gate_up: torch.Tensor) -> torch.Tensor:
    """What transformers' LlamaMLP computes between the fused gate/up product and down_proj."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def record(rows: int, inter: int, copy_gbs: float, gen: torch.Generator) -> dict:
    nbytes = rows * inter * 2 * 3  # [rows, 2 I] read, [rows, I] written, bf16
    sets = [torch.randn(rows, 2 * inter, device="cuda", generator=gen).mul_(3).bfloat16()
            for _ in range(sets_for(nbytes, l2_bytes()))]
    want = reference.silu_mul(sets[0]).float()
    rec = dict(rows=rows, intermediate=inter, bytes=nbytes, sets=len(sets))
    for name, fn in (("silu_mul", ops.silu_mul), ("transformers", transformers_act),
                     ("reference", reference.silu_mul)):
        err = (fn(sets[0]).float() - want).abs().max().item()
        ms = time_graph([lambda x=x, fn=fn: fn(x) for x in sets])["ms"]
        gbps = nbytes / ms / 1e6
        rec.update({f"{name}_us": round(ms * 1e3, 2), f"{name}_max_err": err, f"{name}_gbps": round(gbps),
                    f"{name}_copy_fraction": round(gbps / copy_gbs, 3)})
    rec["step_saving_ms"] = round(32 * (rec["transformers_us"] - rec["silu_mul_us"]) / 1e3, 3)
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    copy = copy_bandwidth(dev)
    gen = cuda_generator(0)
    records = []
    for inter in INTERMEDIATE:
        for rows in WIDTHS:
            records.append(record(rows, inter, copy["gbs"], gen))
            print({k: v for k, v in records[-1].items() if not k.endswith("max_err")}, flush=True)
    result = {"header": dict(env_header(dev), copy_bandwidth_gbs=copy["gbs"]), "records": records}
    finish(args.out, result)


if __name__ == "__main__":
    main()
