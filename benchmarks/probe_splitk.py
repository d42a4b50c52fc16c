"""The decode step's matmuls: cuBLAS (F.linear, and with torch's cuBLASLt preference) against a split-K Triton
kernel written here at engine batch widths, over a grid of its tile shapes (issue 3: probe_linear.py, timed
by eager events, had o_proj and down_proj at 35-65% of copy; whether a kernel with more programs over their
4,096 output columns reads the weights faster).

    python benchmarks/probe_splitk.py [--widths 40 96 128 150 241] [--out splitk.json]

The kernel: grid (N / BLOCK_N, SPLIT_K); each program multiplies all M rows of x (one BLOCK_M tile) by a
[BLOCK_N, K / SPLIT_K] slice of W; with SPLIT_K > 1 the programs of a column tile write fp32 partials and the
last to arrive on a semaphore sums them (one launch; it resets the semaphore for graph replays). It is a probe,
not used by the engine: `benchmarks/results/kernel_notes.md` says what it measured (slower than cuBLAS from 96
rows up). Each call cycles through 8 copies of its weight (no L2 hits) inside a CUDA graph
(gpu_timing.time_graph); every config is checked against F.linear first. Prints a line per (product, width)
and one JSON object last: `header` (env_header, copy bandwidth) and `records` with `product`, `rows`,
`cublas_us`, `cublaslt_us`, `best_us`, `best` (the config), `best_gbps` and every config's `us`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from common import copy_bandwidth, env_header, write_json  # noqa: E402
from gpu_timing import time_graph  # noqa: E402


@triton.jit
def splitk_linear_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, sem_ptr,
    M, N, K,
    stride_x_m, stride_w_n, stride_y_m, stride_part_s, stride_part_m,
    K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # stage 1: acc [BLOCK_M, BLOCK_N] = x[:, k_lo:k_hi] @ W[n tile, k_lo:k_hi]^T
    k_lo = pid_s * K_PER_SPLIT
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_x_m + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_w_n + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    y_ptrs = y_ptr + offs_m[:, None] * stride_y_m + offs_n[None, :]
    mask_y = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_y)
    else:
        # stage 2: this split's partial, then the semaphore; the last split of the tile sums them all
        part_ptrs = part_ptr + offs_m[:, None] * stride_part_m + offs_n[None, :]
        tl.store(part_ptrs + pid_s * stride_part_s, acc, mask=mask_y)
        arrived = tl.atomic_add(sem_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptrs + s * stride_part_s, mask=mask_y, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask_y)
            tl.atomic_xchg(sem_ptr + pid_n, 0)


@dataclass(frozen=True)
class SplitKConfig:
    """Tile and launch shape: BLOCK_N output columns and BLOCK_K of the reduction a step, split_k programs
    over K per column tile."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 2
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if not 1 <= self.split_k <= 16:
            raise ValueError(f"split_k must be in [1, 16], got {self.split_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be a power of two <= 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in [1, 8], got {self.num_stages}")


class SplitKWorkspace:
    """fp32 partials and per-column-tile semaphores, kept across calls (CUDA graphs need fixed addresses;
    the kernel leaves every semaphore at zero)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, device: torch.device, split_k: int, rows: int, cols: int, tiles: int):
        key = (device, split_k, rows, cols, tiles)
        if key not in self._bufs:
            self._bufs[key] = (torch.empty((split_k, rows, cols), dtype=torch.float32, device=device),
                               torch.zeros(tiles, dtype=torch.int32, device=device))
        return self._bufs[key]


def splitk_linear(x: torch.Tensor, weight: torch.Tensor, cfg: SplitKConfig,
                  workspace: SplitKWorkspace) -> torch.Tensor:
    """x [M, K], weight [N, K] -> y [M, N] = x weight^T (x's dtype)."""
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(M))
    tiles = triton.cdiv(N, cfg.block_n)
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    part, sem = workspace.get(x.device, cfg.split_k, M, N, tiles)
    splitk_linear_kernel[(tiles, cfg.split_k)](
        x_ptr=x, w_ptr=weight, y_ptr=y, part_ptr=part, sem_ptr=sem, M=M, N=N, K=K,
        stride_x_m=x.stride(0), stride_w_n=weight.stride(0), stride_y_m=y.stride(0),
        stride_part_s=part.stride(0), stride_part_m=part.stride(1),
        K_PER_SPLIT=k_per_split, SPLIT_K=cfg.split_k, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


PRODUCTS = {"qkv": (4096, 12288), "o": (4096, 4096), "gate_up": (4096, 22016), "down": (11008, 4096)}  # (in, out)
COPIES = 8


def configs(rows: int) -> list[SplitKConfig]:
    out = []
    stages = 3 if rows > 128 else 4
    for bn, bk, split in itertools.product((32, 64, 128), (64, 128), (1, 2, 4)):
        warps = 8 if bn * max(rows, 16) >= 128 * 128 else 4
        out.append(SplitKConfig(block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=stages))
    return out


def probe(name: str, rows: int, weights: list[torch.Tensor], copy_gbs: float) -> dict:
    k, n = PRODUCTS[name]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, weights[0]).float()
    cublas = time_graph([lambda w=w: F.linear(x, w) for w in weights])["ms"] * 1e3
    torch.backends.cuda.preferred_blas_library("cublaslt")
    cublaslt = time_graph([lambda w=w: F.linear(x, w) for w in weights])["ms"] * 1e3
    torch.backends.cuda.preferred_blas_library("cublas")
    ws = SplitKWorkspace()
    rec = {"product": name, "rows": rows, "cublas_us": round(cublas, 1), "cublaslt_us": round(cublaslt, 1),
           "configs": []}
    for cfg in configs(rows):
        try:
            y = splitk_linear(x, weights[0], cfg, ws).float()
        except Exception as e:  # noqa: BLE001 - a config the GPU cannot hold (shared memory): skipped, reported
            rec["configs"].append({"config": cfg.__dict__, "error": type(e).__name__})
            continue
        err = ((y - ref).norm() / ref.norm()).item()
        if not err < 1e-2:
            rec["configs"].append({"config": cfg.__dict__, "error": f"rel_err {err:.3g}"})
            continue
        us = time_graph([lambda w=w, cfg=cfg: splitk_linear(x, w, cfg, ws) for w in weights])["ms"] * 1e3
        rec["configs"].append({"config": cfg.__dict__, "us": round(us, 1), "rel_err": err})
    ok = [c for c in rec["configs"] if "us" in c]
    best = min(ok, key=lambda c: c["us"])
    rec.update(best_us=best["us"], best=best["config"], best_gbps=round(k * n * 2 / best["us"] / 1e3),
               cublas_gbps=round(k * n * 2 / cublas / 1e3), copy_gbs=copy_gbs)
    return rec


def sweep(products: list[str], widths: list[int], measure, describe) -> list[dict]:
    """measure(name, rows, weights) -> record for each product (its COPIES random bf16 weights made once) and
    width; a line per record: the product, the width and describe(record)."""
    records = []
    for name in products:
        k, n = PRODUCTS[name]
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        for rows in widths:
            records.append(measure(name, rows, weights))
            print(f"{name:8s} rows {rows:4d}: {describe(records[-1])}", flush=True)
        del weights
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--widths", type=int, nargs="*", default=[40, 96, 128, 150, 241])
    p.add_argument("--products", nargs="*", default=list(PRODUCTS))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    copy = copy_bandwidth(dev)
    records = sweep(args.products, args.widths, lambda name, rows, weights: probe(name, rows, weights, copy["gbs"]),
                    lambda rec: f"cublas {rec['cublas_us']:7.1f} us ({rec['cublas_gbps']} GB/s), cublaslt "
                                f"{rec['cublaslt_us']:7.1f}, split-K {rec['best_us']:7.1f} us ({rec['best_gbps']} "
                                f"GB/s) {rec['best']}")
    result = {"header": dict(env_header(dev), copy_bandwidth_gbs=copy["gbs"]), "records": records}
    if args.out:
        write_json(args.out, result)
    print(json.dumps({"header": result["header"], "best": [{k: r[k] for k in ("product", "rows", "cublas_us",
                                                                              "cublaslt_us", "best_us")}
                                                           for r in records]}))


if __name__ == "__main__":
    main()
