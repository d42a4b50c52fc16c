"""The decode step's small kernels on the H200: SiLU-and-multiply tiles and math, and programmatic dependent
launch (PDL) between small kernels in a CUDA graph.

    python benchmarks/probe_small_ops.py --out $OUT/small-ops.json

Part silu: `kivi_kernels/silu_mul` as the engine launches it, beside tile shapes and a fast-math form (approximate
exp and division; silu(gate) still rounded to the dtype before the product), at the decode step's widths of
Llama-2-7B (11,008) and Llama-3-8B (14,336), each timed by CUDA-graph replay with its input in L2 (the gate/up
product the matmul just wrote, as in the engine) and from DRAM (rotating sets), checked against the reference.

Part pdl: a chain of 256 dependent RMSNorm-shaped kernels ([rows, 4096], each reading the one before's output)
captured in one graph, launched plainly, as programmatic dependents that wait at their start, and as dependents
that also let their own dependents launch at their start; the same with a cuBLAS matmul between each pair
(PDL on our kernels only, as the engine could do it). us a kernel is the replay's time over its launches.
Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from common import copy_bandwidth, env_header, write_json  # noqa: E402
from gpu_timing import cuda_generator, l2_bytes, sets_for, time_graph  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

from kivi_kernels.silu_mul import ops as silu_ops  # noqa: E402
from kivi_kernels.silu_mul import reference as silu_reference  # noqa: E402


@triton.jit
def silu_variant_kernel(gate_up_ptr, out_ptr, n_rows, n_cols, stride_gate_up_row, stride_out_row,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    row_offsets = rows.to(tl.int64)
    gate_ptrs = gate_up_ptr + row_offsets[:, None] * stride_gate_up_row + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
    if FAST:
        act = tl.math.fdiv(gate, 1.0 + tl.exp(-gate), ieee_rounding=False)
    else:
        act = tl.math.div_rn(gate, 1.0 + tl.exp(-gate))
    out = act.to(gate_up_ptr.dtype.element_ty).to(tl.float32) * up
    out_ptrs = out_ptr + row_offsets[:, None] * stride_out_row + cols[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_variant(gate_up, out, block_m, block_n, warps, fast):
    m, n = gate_up.shape[0], gate_up.shape[1] // 2
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    silu_variant_kernel[grid](gate_up, out, m, n, gate_up.stride(0), out.stride(0),
                              BLOCK_M=block_m, BLOCK_N=block_n, FAST=fast, num_warps=warps)


SILU_TILES = [(4, 1024, 4), (1, 1024, 4), (2, 1024, 4), (8, 1024, 8), (1, 2048, 8), (2, 512, 2), (1, 512, 2),
              (4, 512, 4), (16, 256, 4)]


def _silu_forms() -> dict:
    forms = {"engine": lambda x, o: o.copy_(silu_ops.silu_mul(x))}
    for bm, bn, w in SILU_TILES:
        for fast in (False, True):
            forms[f"{bm}x{bn}w{w}{'-fast' if fast else ''}"] = (
                lambda x, o, bm=bm, bn=bn, w=w, fast=fast: silu_variant(x, o, bm, bn, w, fast))
    return forms


def _silu_shape(device, m: int, n: int, l2: int) -> list[dict]:
    gen = cuda_generator(m * 7 + n, device)
    nbytes = m * n * 2 * 3
    sets = sets_for(nbytes, l2)
    inputs = [(torch.randn(m, 2 * n, device=device, generator=gen) * 4).to(torch.bfloat16) for _ in range(sets)]
    outs = [torch.empty(m, n, device=device, dtype=torch.bfloat16) for _ in range(sets)]
    want = silu_reference.silu_mul(inputs[0])
    records = []
    for name, fn in _silu_forms().items():
        if name == "engine":  # the launcher as the engine calls it (its own output tensor)
            got = silu_ops.silu_mul(inputs[0])
            hot = time_graph([lambda: silu_ops.silu_mul(inputs[0])])["ms"]
            cold = time_graph([lambda i=i: silu_ops.silu_mul(inputs[i]) for i in range(sets)])["ms"]
        else:
            outs[0].fill_(float("nan"))
            fn(inputs[0], outs[0])
            got = outs[0].clone()
            hot = time_graph([lambda fn=fn: fn(inputs[0], outs[0])])["ms"]
            cold = time_graph([lambda i=i, fn=fn: fn(inputs[i], outs[i]) for i in range(sets)])["ms"]
        exact = (got == want).float().mean().item()
        max_err = (got.float() - want.float()).abs().max().item()
        records.append(dict(part="silu", form=name, rows=m, width=n, us_l2=hot * 1e3, us_dram=cold * 1e3,
                            gbps_dram=nbytes / (cold * 1e-3) / 1e9, exact_fraction=exact, max_abs_err=max_err))
        print(f"silu {m:4d} x {n}: {name:18s} L2 {hot * 1e3:6.2f} us  DRAM {cold * 1e3:6.2f} us "
              f"({records[-1]['gbps_dram']:6.0f} GB/s) exact {exact:.5f}", flush=True)
    return records


def silu_part(device, rows_list, widths) -> list[dict]:
    l2 = l2_bytes(device)
    return [r for n in widths for m in rows_list for r in _silu_shape(device, m, n, l2)]


@triton.jit
def chain_kernel(x_ptr, w_ptr, out_ptr, n_cols, stride_row, BLOCK_N: tl.constexpr,
                 WAIT: tl.constexpr, TRIGGER: tl.constexpr):
    # an RMSNorm of one row a program: out = x / rms(x) * w
    if TRIGGER:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # written before the graph: no wait needed
    if WAIT:
        gdc_wait()
    x = tl.load(x_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / n_cols + 1e-6)
    tl.store(out_ptr + row * stride_row + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _pdl_rows(device, rows: int, links: int) -> list[dict]:
    gen = cuda_generator(rows, device)
    bufs = [torch.randn(rows, 4096, device=device, generator=gen).to(torch.bfloat16) for _ in range(2)]
    w = torch.rand(4096, device=device, generator=gen).to(torch.bfloat16) + 0.5
    weight = (torch.randn(4096, 4096, device=device, generator=gen) * 0.01).to(torch.bfloat16)

    def launch(src, dst, mode):
        extra = dict(launch_pdl=True) if mode != "plain" else {}
        chain_kernel[(rows,)](src, w, dst, 4096, 4096, BLOCK_N=4096, WAIT=mode != "plain",
                              TRIGGER=mode == "wait+trigger", num_warps=4, **extra)

    def chain(mode, matmul):
        def run():  # each kernel reads what the one before it wrote
            for i in range(links):
                if matmul:
                    launch(bufs[0], bufs[1], mode)
                    torch.mm(bufs[1], weight, out=bufs[0])
                else:
                    launch(bufs[i % 2], bufs[(i + 1) % 2], mode)
        return run

    records = []
    for matmul in (False, True):
        base = None
        for mode in ("plain", "wait", "wait+trigger"):
            ms = time_graph([chain(mode, matmul)], max_calls=4)["ms"]
            kernels = links * (2 if matmul else 1)
            us = ms * 1e3 / kernels
            base = us if base is None else base
            records.append(dict(part="pdl", rows=rows, with_matmul=matmul, mode=mode, us_per_kernel=us,
                                us_saved_per_link=(base - us) * kernels / links))
            print(f"pdl rows {rows:4d} matmul {matmul!s:5s} {mode:13s}: {us:6.2f} us a kernel, "
                  f"{records[-1]['us_saved_per_link']:5.2f} us saved a link", flush=True)
    return records


def pdl_part(device, rows_list, links: int = 256) -> list[dict]:
    return [r for rows in rows_list for r in _pdl_rows(device, rows, links)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="silu,pdl")
    parser.add_argument("--rows", default="40,101,150,256")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    copy = copy_bandwidth(device)
    print(f"copy {copy}", flush=True)
    records = []
    if "silu" in args.parts:
        records += silu_part(device, rows, [11008]) + silu_part(device, [256], [14336])
    if "pdl" in args.parts:
        records += pdl_part(device, [40, 256])
    result = dict(header=env_header(device), copy=copy, records=records)
    if args.out:
        write_json(args.out, result)
    summary = {}
    for r in records:
        if r["part"] == "silu":
            key = f"silu {r['rows']}x{r['width']}"
            best = summary.get(key)
            if best is None or r["us_l2"] < best[1]:
                summary[key] = (r["form"], round(r["us_l2"], 2))
    print(json.dumps(dict(summary=summary, records=len(records), median_pdl=statistics.median(
        [r["us_saved_per_link"] for r in records if r["part"] == "pdl"] or [0.0]))))


if __name__ == "__main__":
    main()
