"""Tuning sweep of the decode-attention kernel on the GPU: variants x shapes, CUDA-graph timing, one JSON.

    python benchmarks/kernel_sweep.py --plan profile --out $OUT/sweep.json     # many variants, few shapes
    ncu --clock-control none ... python benchmarks/kernel_sweep.py --ncu        # one call of each ncu variant

Compiles run first, in parallel worker processes (one tiny launch of each distinct variant fills Triton's
cache with the same specialization the timed calls use: explicit tuning, block tables 16-wide multiples).
Every variant is checked against the PyTorch reference on rows 0 and B-1 before it is timed.

Variant "v1" is the kernel as it was before issue 5, kept out of the tree for comparisons: the plans find it
in .scratch/ (git-ignored): `git show 258601d:kernels/decode_attention/kernel.py > .scratch/kernel_v1.py`,
plus that commit's ops.py as .scratch/baseline_v1.py with `decode_attention` renamed `decode_attention_v1`
and its imports pointed at `kivi_kernels.decode_attention.common` and `kernel_v1` (carry .scratch to the device).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT), str(ROOT / ".scratch")]

import torch  # noqa: E402
from kernel_sweep_plans import plan  # noqa: E402

D = 128
DTYPE = torch.bfloat16


# ------------------------------------------------------------------------------------------------ variants
def max_tokens_of(L: int) -> int:
    """The launcher's max_tokens for rows of L tokens in kivi_data's caches (block-table capacity + the ring)."""
    from kivi_data import P, R, quantized_len, table_width

    return table_width(-(-quantized_len(L) // P)) * P + R


def resolve(impl: str, B: int, L: int, Hq: int, H: int, tuning: dict, bits: int = 2) -> dict:
    """Explicit tuning (every knob set) so that compile keys never depend on the batch size."""
    from kivi_data import P

    max_tokens = max_tokens_of(L)
    t = dict(tuning)
    if impl == "v1":
        from kivi_kernels.decode_attention import common as C

        t.setdefault("block_n", 128)
        t.setdefault("num_splits", C.choose_num_splits(B * H, max_tokens, torch.device("cuda"), programs_per_sm=2))
        return t
    from kivi_kernels.decode_attention.ops import MAX_SPLITS, launch_config
    from kivi_kernels.decode_attention.ops_fma import FMA_PER_SM

    if t.get("mma") or t.get("fma"):  # the Gluon kernels (kernel_mma.py, kernel_gluon.py): only the split count
        from kivi_kernels.decode_attention import common as C  # (and register cap, block size) apply
        from kivi_kernels.decode_attention.ops_fma import FMA_MAXNREG
        from kivi_kernels.decode_attention.ops_mma import MMA_MAXNREG, MMA_PER_SM, mma_resident

        per_sm = t.pop("per_sm", None)
        maxnreg = t.get("maxnreg") or (MMA_MAXNREG if t.get("mma") else FMA_MAXNREG)
        resident = mma_resident(maxnreg) if t.get("mma") and per_sm is None else None  # the launcher's default
        per_sm = per_sm or (MMA_PER_SM if t.get("mma") else FMA_PER_SM)
        t.setdefault("num_splits", C.one_warp_launch("sweep", maxnreg, None, B * H, max_tokens, torch.device("cuda"),
                                                     per_sm, resident=resident))
        return t

    cfg = launch_config(B, H, Hq // H, max_tokens, P, D, True, True, torch.device("cuda"), bits=bits,
                        swap=bool(t.get("swap_ab", False)))
    per_sm = t.pop("per_sm", None)
    if per_sm is not None:
        from kivi_kernels.decode_attention import common as C

        cfg["num_splits"] = C.choose_num_splits(B * H, max_tokens, torch.device("cuda"), programs_per_sm=per_sm,
                                                max_splits=MAX_SPLITS)
    for k, v in cfg.items():
        t.setdefault(k, v)
    return t


def call_fn(impl: str):
    if impl == "v1":
        from baseline_v1 import decode_attention_v1

        return decode_attention_v1
    from kivi_kernels.decode_attention import decode_attention

    return decode_attention


def compile_key(impl, bits, Hq, H, t) -> str:
    return json.dumps([impl, bits, Hq, H, sorted(t.items())])


DATA_KEYS = ("dtype", "scale_dtype")  # a variant's data (not launcher knobs): torch dtype names


def data_dtypes(tuning: dict) -> tuple:
    """(dtype, scale dtype or None for the product's default) of a variant's data."""
    sdt = tuning.get("scale_dtype")
    return getattr(torch, tuning.get("dtype", "bfloat16")), sdt and getattr(torch, sdt)


def _warm_one(spec) -> str:
    """Worker: one tiny launch of a variant (fills the Triton cache)."""
    impl, bits, Hq, H, t = spec
    t = dict(t)
    dtype, sdt = data_dtypes(t)
    t = {k: v for k, v in t.items() if k not in DATA_KEYS}
    try:
        from kivi_data import kivi_args, make_kivi_sets

        data = make_kivi_sets(1, 700, Hq, H, D, bits, bits, dtype, torch.device("cuda"), 1, seed=1, scale_dtype=sdt)
        fn = call_fn(impl)
        fn(data["sets"][0]["q"], *kivi_args(data, 0), sm_scale=D**-0.5, k_bits=bits, v_bits=bits, group_size=32,
           residual_length=128, page_size=128, **t)
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {str(exc)[:300]}"


def precompile(specs: list, workers: int) -> dict:
    uniq = {}
    for s in specs:
        uniq.setdefault(compile_key(*s), s)
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with ctx.Pool(min(workers, len(uniq))) as pool:
        results = pool.map(_warm_one, list(uniq.values()), chunksize=1)
    errors = {k: r for k, r in zip(uniq, results, strict=True) if r != "ok"}
    print(f"precompiled {len(uniq)} variants in {time.time() - t0:.1f} s, {len(errors)} errors", flush=True)
    for k, r in errors.items():
        print("  compile error", k, r, flush=True)
    return errors


# ------------------------------------------------------------------------------------------------ running
def run_shape(shape, variants, l2, results, sdpa=True):
    from gpu_timing import sets_for, time_graph
    from kivi_data import kivi_args, kivi_bytes, make_kivi_sets

    from kivi_kernels.decode_attention import reference as dref

    B, L, Hq, H = shape
    dev = torch.device("cuda")
    data_key = lambda v: (v[1], str(sorted((k, x) for k, x in v[2].items() if k in DATA_KEYS)))
    for bits, dkey in sorted({data_key(v) for v in variants}):
        dtype, sdt = data_dtypes(next(v[2] for v in variants if data_key(v) == (bits, dkey)))
        nbytes = kivi_bytes(B, L, Hq, H, D, bits, bits)
        n_sets = sets_for(nbytes, l2)
        data = make_kivi_sets(B, L, Hq, H, D, bits, bits, dtype, dev, n_sets, seed=11, scale_dtype=sdt)
        rows = [0, B - 1] if B > 1 else [0]
        s0 = data["sets"][0]
        args0 = kivi_args(data, 0)
        ref_args = args0[:8] + [args0[8], s0["slots"][rows], s0["seq_lens"][rows]]
        ints = dict(sm_scale=D**-0.5, k_bits=bits, v_bits=bits, group_size=32, residual_length=128, page_size=128)
        ref = dref.decode_attention(s0["q"][rows], *ref_args, **ints).float()
        for impl, vbits, tuning in variants:
            if data_key((impl, vbits, tuning)) != (bits, dkey):
                continue
            t = resolve(impl, B, L, Hq, H, {k: v for k, v in tuning.items() if k not in DATA_KEYS}, bits)
            rec = dict(kernel=f"decode_attention_{impl}", bits=bits, batch=B, context=L, q_heads=Hq, kv_heads=H,
                       head_dim=D, dtype=str(dtype), scale_dtype=str(data["pools"]["k_scale"].dtype), tuning=t,
                       bytes=nbytes)
            try:
                fn = call_fn(impl)
                outs = [torch.empty_like(s["q"]) for s in data["sets"]]
                calls = [(lambda i=i, fn=fn, data=data, outs=outs, t=t, ints=ints:
                          fn(data["sets"][i]["q"], *kivi_args(data, i), out=outs[i], **ints, **t))
                         for i in range(n_sets)]
                calls[0]()
                out0 = outs[0][rows].float()
                rec["check_rel_l2"] = float((out0 - ref).norm() / ref.norm())
                rec.update(time_graph(calls))
                rec["gbps"] = nbytes / (rec["ms"] * 1e-3) / 1e9
            except Exception as exc:  # noqa: BLE001
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                traceback.print_exc(limit=3)
            results.append(rec)
            print(line(rec), flush=True)
        del data
        torch.cuda.empty_cache()
    if sdpa:
        from kernel_cases import bench_sdpa  # bench_kernels' SDPA row: flash over bf16, checked, then timed

        results.append(bench_sdpa(B, L, Hq, H, D, None))
        print(line(results[-1]), flush=True)


def line(r: dict) -> str:
    head = f"{r['kernel']:22s} b{r['bits']:>2} B={r['batch']:>4} L={r['context']:>6} H={r['q_heads']}/{r['kv_heads']}"
    if r.get("error") or r.get("skipped"):
        return head + "  " + (r.get("error") or r.get("skipped"))
    t = r.get("tuning", {})
    ts = " ".join(f"{k}={v}" for k, v in t.items())
    return (f"{head}  {r['ms'] * 1e3:8.1f} us {r['gbps']:7.0f} GB/s  rel {r.get('check_rel_l2', 0):.1e}  "
            f"[{r.get('mode')}] {ts}")


NCU_VARIANTS = [
    ("v1", {}),
    ("new", dict(block_n=128, num_warps=4, num_stages=3, lazy=True, key_vec=4)),
    ("new", dict(block_n=128, num_warps=4, num_stages=3, lazy=True, key_vec=1)),
    ("new", dict(block_n=64, num_warps=4, num_stages=2, lazy=True, key_vec=1)),
    ("new", dict(block_n=32, num_warps=1, num_stages=3, lazy=True, key_vec=1)),
]


def ncu_main(mma: bool = False, B: int = 64, L: int = 4096, H: int = 32, value_copy: str | None = None,
             step_blocks: int | None = None):
    """Each NCU_VARIANTS entry (with mma, the tensor-core kernel alone, value_copy and step_blocks as given) once
    to warm up, then once more (profile with --launch-skip/count = the number of variants)."""
    from kivi_data import kivi_args, make_kivi_sets

    Hq = 32
    knobs = {k: v for k, v in dict(value_copy=value_copy, step_blocks=step_blocks).items() if v is not None}
    variants = [("new", dict(mma=True, **knobs))] if mma else NCU_VARIANTS
    data = make_kivi_sets(B, L, Hq, H, D, 2, 2, DTYPE, torch.device("cuda"), 1, seed=3)
    ints = dict(sm_scale=D**-0.5, k_bits=2, v_bits=2, group_size=32, residual_length=128, page_size=128)
    for _ in range(2):
        for impl, tuning in variants:
            t = resolve(impl, B, L, Hq, H, tuning)
            call_fn(impl)(data["sets"][0]["q"], *kivi_args(data, 0), **ints, **t)
        torch.cuda.synchronize()
    print("ncu variants:", [(i, resolve(i, B, L, Hq, H, t)) for i, t in variants])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", default="profile")
    ap.add_argument("--out", default=None)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--ncu-mma", default=None, metavar="B,L", help="with --ncu: the tensor-core kernel at B rows of L")
    ap.add_argument("--ncu-kv-heads", type=int, default=32, help="with --ncu-mma: KV heads (32 query heads)")
    ap.add_argument("--ncu-value-copy", default=None, help="with --ncu-mma: the kernel's value_copy (default: its own)")
    ap.add_argument("--ncu-step-blocks", type=int, default=None, help="with --ncu-mma: the kernel's step_blocks")
    ap.add_argument("--no-sdpa", action="store_true")
    args = ap.parse_args()
    if args.ncu:
        if args.ncu_mma:
            B, L = (int(x) for x in args.ncu_mma.split(","))
            ncu_main(mma=True, B=B, L=L, H=args.ncu_kv_heads, value_copy=args.ncu_value_copy,
                     step_blocks=args.ncu_step_blocks)
        else:
            ncu_main()
        return
    from common import copy_bandwidth, env_header
    from gpu_timing import l2_bytes

    shapes = plan(args.plan)
    specs = []
    for (B, L, Hq, H), vs in shapes:
        for impl, bits, tuning in vs:
            specs.append((impl, bits, Hq, H, resolve(impl, B, L, Hq, H, tuning, bits)))
    errors = precompile(specs, args.workers)
    dev = torch.device("cuda")
    copy = copy_bandwidth(dev)
    l2 = l2_bytes(dev)
    print(f"copy {copy['gbs']:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB", flush=True)
    results = []
    t0 = time.time()
    for shape, vs in shapes:
        run_shape(shape, vs, l2, results, sdpa=not args.no_sdpa)
    for r in results:
        r["copy_gbps"] = copy["gbs"]
        if r.get("gbps"):
            r["frac_of_copy"] = r["gbps"] / copy["gbs"]
    out = dict(header=env_header(dev), copy=copy, l2_bytes=l2, plan=args.plan, compile_errors=errors,
               wall_s=round(time.time() - t0, 1), records=results)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    # compact summary: best variant per shape
    print("\nbest per shape/bits:")
    best = {}
    for r in results:
        if r.get("gbps") and r["kernel"].startswith("decode"):
            k = (r["bits"], r["batch"], r["context"], r["q_heads"], r["kv_heads"])
            if k not in best or r["gbps"] > best[k]["gbps"]:
                best[k] = r
    for _k, r in sorted(best.items()):
        print(line(r), f"{r['frac_of_copy']:.0%}")


if __name__ == "__main__":
    main()
