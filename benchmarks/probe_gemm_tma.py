"""The decode step's matmuls at engine widths: cuBLAS (F.linear) against a TMA Triton kernel written here, over
its tile shapes (issue 3: at 241 rows cuBLAS runs o_proj at ~430 and down_proj at ~480 TFLOP/s, qkv and gate/up
at ~630-650: their 4,096 output columns make 64 tiles of 128 x 128 on 132 multiprocessors,
`linear-splitk-20261130-h200.json`). Does a kernel whose tiles fill the machine bring o and down to the others?

    python benchmarks/probe_gemm_tma.py [--widths 40 128 150 256] [--out gemm.json]
    python benchmarks/probe_gemm_tma.py --cpu-smoke      # TRITON_INTERPRET=1, tiny shapes, checks only

The kernel: one program per [BLOCK_M, BLOCK_N] tile of y = x W^T, the row tiles of a column tile launched next
to each other (the second reads its weight tile from L2); x and W arrive by TMA (host-side tensor descriptors,
out-of-bounds rows zero-filled), NUM_STAGES deep; y leaves by a TMA store (rows past M clipped). A probe, not
used by the engine. Timing as probe_splitk.py: CUDA-graph replays cycling through 8 copies of the weight (no
L2 hits), every config checked against F.linear first. Prints a line per (product, width) and one JSON object
last: `header` and `records` with `product`, `rows`, `cublas_us`, `best_us`, `best`, both TFLOP/s, and every
config's `us`; `step_ms`: the four products over 32 layers, cuBLAS against each product's best config.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from probe_splitk import PRODUCTS, sweep  # noqa: E402  (the products' (in, out) sizes; the loop over them)
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

LAYERS = 32


@triton.jit
def tma_linear_kernel(x_desc, w_desc, y_desc, M, K,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      NUM_STAGES: tl.constexpr):
    # the row tiles of one column tile are neighbours in launch order: they share the weight tile through L2
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    off_m = (pid % tiles_m) * BLOCK_M
    off_n = (pid // tiles_m) * BLOCK_N
    # stage 1: acc [BLOCK_M, BLOCK_N] = sum over K of x[m tile, k] @ W[n tile, k]^T, NUM_STAGES loads in flight
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=NUM_STAGES):
        x = x_desc.load([off_m, k * BLOCK_K])  # [BLOCK_M, BLOCK_K]
        w = w_desc.load([off_n, k * BLOCK_K])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, w.T, acc)
    # stage 2: the tile in y's dtype (rows past M are not written)
    y_desc.store([off_m, off_n], acc.to(y_desc.dtype))


def tma_linear(x: torch.Tensor, weight: torch.Tensor, cfg: dict) -> torch.Tensor:
    """x [M, K], weight [N, K] -> y [M, N] = x weight^T (x's dtype). cfg: block_m, block_n, block_k, stages,
    warps."""
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or x.dtype != weight.dtype or not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype} must be "
                         f"contiguous, of one dtype, with equal K")
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    tma_linear_kernel[grid](
        x_desc=TensorDescriptor.from_tensor(x, [bm, bk]), w_desc=TensorDescriptor.from_tensor(weight, [bn, bk]),
        y_desc=TensorDescriptor.from_tensor(y, [bm, bn]), M=M, K=K,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=cfg["stages"], num_warps=cfg["warps"],
    )
    return y


def configs() -> list[dict]:
    out = []
    for bm, bn, bk, stages in itertools.product((64, 128), (64, 128, 256), (64, 128), (3, 4)):
        if (bm + bn) * bk * 2 * stages + bm * bn * 2 > 220 * 1024:  # past an H200 SM's shared memory
            continue
        out.append(dict(block_m=bm, block_n=bn, block_k=bk, stages=stages, warps=8 if bm * bn >= 128 * 128 else 4))
    return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def probe(name: str, rows: int, weights: list[torch.Tensor]) -> dict:
    from gpu_timing import time_graph

    k, n = PRODUCTS[name]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, weights[0]).float()
    cublas = time_graph([lambda w=w: F.linear(x, w) for w in weights])["ms"] * 1e3
    rec = {"product": name, "rows": rows, "cublas_us": round(cublas, 1), "configs": []}
    for cfg in configs():
        try:
            err = rel_err(tma_linear(x, weights[0], cfg), ref)
        except Exception as e:  # noqa: BLE001 - a config the GPU cannot hold: skipped, reported
            rec["configs"].append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        if not err < 1e-2:
            rec["configs"].append({"config": cfg, "error": f"rel_err {err:.3g}"})
            continue
        us = time_graph([lambda w=w, cfg=cfg: tma_linear(x, w, cfg) for w in weights])["ms"] * 1e3
        rec["configs"].append({"config": cfg, "us": round(us, 1), "rel_err": err})
    ok = [c for c in rec["configs"] if "us" in c]
    flops = 2 * rows * k * n
    rec.update(cublas_tflops=round(flops / cublas / 1e6))
    if ok:
        best = min(ok, key=lambda c: c["us"])
        rec.update(best_us=best["us"], best=best["config"], best_tflops=round(flops / best["us"] / 1e6))
    return rec


def cpu_smoke() -> None:
    """Every config's tile shapes on the interpreter, against F.linear in fp32, on odd row counts."""
    torch.manual_seed(0)
    for rows, k, n in ((5, 128, 64), (70, 256, 192)):
        x, w = torch.randn(rows, k), torch.randn(n, k)
        for cfg in ({"block_m": 64, "block_n": 64, "block_k": 64, "stages": 2, "warps": 4},
                    {"block_m": 64, "block_n": 128, "block_k": 128, "stages": 2, "warps": 4}):
            y = tma_linear(x.half(), w.half(), cfg)
            err = rel_err(y, F.linear(x.half().float(), w.half().float()))
            print(f"rows {rows} k {k} n {n} {cfg}: rel_err {err:.2e}")
            if not err < 1e-2:
                raise SystemExit("check failed")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--widths", type=int, nargs="*", default=[40, 128, 150, 256])
    p.add_argument("--products", nargs="*", default=list(PRODUCTS))
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.cpu_smoke:
        return cpu_smoke()
    from common import copy_bandwidth, env_header, write_json

    dev = torch.device("cuda")
    copy = copy_bandwidth(dev)
    records = sweep(args.products, args.widths, probe,
                    lambda rec: f"cublas {rec['cublas_us']:7.1f} us ({rec['cublas_tflops']} TFLOP/s), tma "
                                f"{rec.get('best_us')} us ({rec.get('best_tflops')} TFLOP/s) {rec.get('best')}")
    step = {}
    for rows in args.widths:
        mine = [r for r in records if r["rows"] == rows]
        step[rows] = dict(cublas_ms=round(sum(r["cublas_us"] for r in mine) * LAYERS / 1e3, 3),
                          best_ms=round(sum(min(r["cublas_us"], r.get("best_us") or 1e9) for r in mine) * LAYERS
                                        / 1e3, 3))
    result = {"header": dict(env_header(dev), copy_bandwidth_gbs=copy["gbs"]), "records": records, "step_ms": step}
    if args.out:
        write_json(args.out, result)
    print(json.dumps({"header": result["header"], "step_ms": step,
                      "best": [{k: r.get(k) for k in ("product", "rows", "cublas_us", "best_us")} for r in records]}))


if __name__ == "__main__":
    main()
