"""bench_kernels' cases: timing helpers and the attention benchmarks (SDPA, paged bf16, KIVI decode attention,
the reference). How each number is measured is in bench_kernels.py's docstring."""

from __future__ import annotations

import gc
import os
import time
import traceback

import torch
import torch.nn.functional as F
from common import log
from kivi_data import P, R, bf16_bytes, kivi_args, kivi_bytes, make_kivi_sets, make_paged_sets

from kivi_kernels.decode_attention import decode_attention
from kivi_kernels.decode_attention import reference as dref
from kivi_kernels.paged_attention import paged_decode_attention

G = 32
CHECK_TOL = 2e-2
# the CPU under TRITON_INTERPRET=1 (bench_kernels.py --cpu-smoke sets it before importing this module)
DEV = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda")
DTYPE = torch.bfloat16 if DEV.type == "cuda" else torch.float16

# launch configurations tried with --tune, by bits (the launcher's table is always tried too)
CANDIDATES = {
    2: [dict(block_n=32, num_warps=1, num_stages=2, lazy=True, key_vec=1, per_sm=8),
        dict(block_n=64, num_warps=4, num_stages=2, lazy=True, key_vec=2, per_sm=4),
        dict(block_n=32, num_warps=2, num_stages=2, lazy=True, key_vec=1, per_sm=7)],
    4: [dict(block_n=32, num_warps=1, num_stages=2, lazy=True, key_vec=1, per_sm=8),
        dict(block_n=64, num_warps=4, num_stages=2, lazy=True, key_vec=4, per_sm=3)],
}



# ----------------------------------------------------------------------------------------------------- timing
def timed(fns, est_ms=None) -> dict:
    if DEV.type != "cuda":
        fns[0]()
        t0 = time.perf_counter()
        fns[0]()
        return {"ms": (time.perf_counter() - t0) * 1e3, "mode": "cpu"}
    from gpu_timing import time_graph

    return time_graph(fns, est_ms)


def eager_ms(fn) -> float | None:
    if DEV.type != "cuda":
        return None
    from gpu_timing import time_eager

    return time_eager(fn, replays=10)


def n_sets(nbytes: int, max_sets: int = 64) -> int:
    if DEV.type != "cuda":
        return 1
    from gpu_timing import l2_bytes, sets_for

    return sets_for(nbytes, l2_bytes(DEV), max_sets=max_sets)


def rel_l2(out: torch.Tensor, ref: torch.Tensor, rows: int = 256) -> float:
    """||out - ref|| / ||ref|| in fp32, over the first dim in chunks of `rows`: an fp32 copy of a whole ring pool
    (16 sets of 238 rows x 32 heads: 7.5 GiB) ran the 4-bit residual_append cases out of memory on an 80 GB card."""
    num = den = 0.0
    for i in range(0, out.shape[0], rows):
        o, r = out[i:i + rows].float(), ref[i:i + rows].float()
        num += float((o - r).square().sum())
        den += float(r.square().sum())
    return num ** 0.5 / max(den ** 0.5, 1e-12)


def free_bytes() -> int:
    return torch.cuda.mem_get_info(DEV)[0] if DEV.type == "cuda" else 8 * 2**30


def cleanup() -> None:
    gc.collect()
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def record(kernel, bits, B, L, Hq, H, D, copy_gbps, **extra) -> dict:
    return dict(kernel=kernel, bits=bits, batch=B, context=L, q_heads=Hq, kv_heads=H, head_dim=D, ms=None,
                gbps=None, copy_gbps=copy_gbps, **extra)


def finish(rec: dict, timing: dict, nbytes: int) -> dict:
    rec.update(timing)
    rec["bytes"] = nbytes
    rec["gbps"] = nbytes / (rec["ms"] * 1e-3) / 1e9
    rec["frac_of_copy"] = rec["gbps"] / rec["copy_gbps"] if rec["copy_gbps"] else None
    return rec


def guarded(rec: dict, need_bytes: int, body) -> dict:
    """Run body(rec) unless the estimate does not fit; record skips and exceptions instead of raising."""
    free = free_bytes()
    if need_bytes > 0.85 * free:
        rec["skipped"] = f"needs ~{need_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        return rec
    try:
        body(rec)
    except torch.cuda.OutOfMemoryError as exc:
        rec["error"] = f"OutOfMemoryError: {str(exc)[:200]}"
    except Exception as exc:  # noqa: BLE001 - one config must never end the run
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        log(traceback.format_exc(limit=4))
    finally:
        cleanup()
    return rec


# ------------------------------------------------------------------------------------------------ attention
def bench_sdpa(B, L, Hq, H, D, copy_gbps) -> dict:
    rec = record("sdpa_bf16", 16, B, L, Hq, H, D, copy_gbps)
    nbytes = bf16_bytes(B, L, Hq, H, D)

    def body(rec):
        k_sets = n_sets(nbytes)
        g = gen(1)
        kv = torch.randn(2, k_sets * B, H, L, D, device=DEV, dtype=torch.bfloat16, generator=g)
        q = torch.randn(k_sets * B, Hq, 1, D, device=DEV, dtype=torch.bfloat16, generator=g)
        gqa = dict(enable_gqa=True) if Hq != H else {}
        if DEV.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend, rec["backend"] = [SDPBackend.FLASH_ATTENTION], "flash"
        else:
            rec["backend"] = "default"

        def one(i):
            sl = slice(i * B, (i + 1) * B)
            if DEV.type == "cuda":
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q[sl], kv[0, sl], kv[1, sl], **gqa)
            return F.scaled_dot_product_attention(q[sl].float(), kv[0, sl].float(), kv[1, sl].float(), **gqa)

        out = one(0)
        rows = [0, B - 1]
        kk = kv[0, rows].float().repeat_interleave(Hq // H, 1)
        vv = kv[1, rows].float().repeat_interleave(Hq // H, 1)
        ref = torch.softmax(q[rows].float() @ kk.transpose(-1, -2) * D**-0.5, -1) @ vv
        rec["check_rel_l2"] = rel_l2(out[rows], ref)
        del kk, vv, ref
        finish(rec, timed([lambda i=i: one(i) for i in range(k_sets)]), nbytes)
        if rec["ms"] < 1.0:
            rec["ms_eager"] = eager_ms(lambda: one(0))

    return guarded(rec, max(nbytes, 300_000_000) + 2 * 2 * 2 * Hq * L * D * 4 + 2 * 2**30, body)


def bench_paged(B, L, Hq, H, D, copy_gbps) -> dict:
    rec = record("paged_bf16", 16, B, L, Hq, H, D, copy_gbps)
    nbytes = bf16_bytes(B, L, Hq, H, D)

    def body(rec):
        from kivi_kernels.paged_attention import reference as pref

        k_sets = n_sets(nbytes, max_sets=16)
        data = make_paged_sets(B, L, Hq, H, D, DEV, k_sets, seed=2)
        k_pages, v_pages, table, q = data["k_pages"], data["v_pages"], data["table"], data["q"]
        slots, seq_lens = data["slots"], data["seq_lens"]
        outs = torch.empty_like(q)

        def one(i):
            return paged_decode_attention(q[i], k_pages, v_pages, table, slots[i], seq_lens, sm_scale=D**-0.5,
                                          page_size=P, out=outs[i])
        one(0)
        rows = [0, B - 1]
        ref = pref.paged_decode_attention(q[0, rows], k_pages, v_pages, table, slots[0][rows], seq_lens[rows],
                                          sm_scale=D**-0.5, page_size=P)
        rec["check_rel_l2"] = rel_l2(outs[0, rows], ref)
        finish(rec, timed([lambda i=i: one(i) for i in range(k_sets)]), nbytes)

    return guarded(rec, 2 * nbytes + 2 * 2**30, body)


def decode_candidates(B, L, Hq, H, bits, tune: bool) -> list[dict]:
    """Explicit tuning dicts: the launcher's default first (the tensor-core kernel of kernel_mma.py where it
    applies, else the Gluon FMA kernel for MHA, else the tensor-core table), then (with --tune) the other
    candidates (the FMA kernel among them for MHA)."""
    if DEV.type != "cuda":
        return [{}]
    from kernel_sweep import max_tokens_of, resolve

    from kivi_kernels.decode_attention.ops_fma import _decode_attention_fma_kernel, fma_by_default
    from kivi_kernels.decode_attention.ops_mma import MMA_DEFAULT, _decode_attention_mma_kernel

    mma_ok = bits in (2, 4) and H <= Hq <= 8 * H and MMA_DEFAULT and _decode_attention_mma_kernel is not None  # (bf16)
    mma = fma_by_default(B * H, max_tokens_of(L), mma_ok)
    eligible = bits == 2 and Hq == H and _decode_attention_fma_kernel is not None and not mma  # (D = 128)
    fma = fma_by_default(B * H, max_tokens_of(L), eligible)
    out = [resolve("new", B, L, Hq, H, dict(fma=True), bits)] if fma else []
    out += [resolve("new", B, L, Hq, H, dict(mma=True), bits)] if mma else []
    if tune or not (fma or mma):
        out.append(resolve("new", B, L, Hq, H, {}, bits))
    if tune and mma and Hq == H:
        out.append(resolve("new", B, L, Hq, H, dict(fma=True), bits))
    if tune:
        for c in CANDIDATES[bits]:
            t = resolve("new", B, L, Hq, H, c, bits)
            if t not in out:
                out.append(t)
    return out


def bench_kivi(B, L, Hq, H, D, bits, copy_gbps, tune: bool) -> dict:
    rec = record("decode_attention", bits, B, L, Hq, H, D, copy_gbps)
    nbytes = kivi_bytes(B, L, Hq, H, D, bits, bits)

    def body(rec):
        k_sets = n_sets(nbytes)
        data = make_kivi_sets(B, L, Hq, H, D, bits, bits, DTYPE, DEV, k_sets, seed=3)
        ints = dict(sm_scale=D**-0.5, k_bits=bits, v_bits=bits, group_size=G, residual_length=R, page_size=P)
        rows = [0, B - 1] if B > 1 else [0]
        s0 = data["sets"][0]
        a0 = kivi_args(data, 0)
        ref = dref.decode_attention(s0["q"][rows], *a0[:9], s0["slots"][rows], s0["seq_lens"][rows], **ints)
        outs = [torch.empty_like(s["q"]) for s in data["sets"]]
        results = []
        for t in decode_candidates(B, L, Hq, H, bits, tune):
            def call(i, t=t):
                return decode_attention(data["sets"][i]["q"], *kivi_args(data, i), out=outs[i], **ints, **t)
            outs[0].fill_(float("nan"))
            call(0)
            cand = dict(tuning=t, check_rel_l2=rel_l2(outs[0][rows], ref))
            if cand["check_rel_l2"] > CHECK_TOL or not torch.isfinite(outs[0]).all():
                cand["error"] = "check failed"
            else:
                cand.update(timed([lambda i=i, call=call: call(i) for i in range(k_sets)]))
            results.append(cand)
        ok = [c for c in results if "ms" in c]
        best = min(ok, key=lambda c: c["ms"]) if ok else results[0]
        rec.update({k: v for k, v in best.items()})
        if len(results) > 1:
            rec["candidates"] = [dict(tuning=c["tuning"], ms=c.get("ms"), error=c.get("error")) for c in results]
        if "ms" in best:
            finish(rec, {}, nbytes)
            if best["ms"] < 1.0:
                rec["ms_eager"] = eager_ms(lambda: decode_attention(s0["q"], *a0, out=outs[0], **ints,
                                                                    **best["tuning"]))

    need = 1.2 * nbytes + 2 * len(rows_of(B)) * L * H * D * 4 * 6 + 2 * 2**30
    return guarded(rec, int(need), body)


def rows_of(B):
    return [0, B - 1] if B > 1 else [0]


def bench_reference(B, L, Hq, H, D, copy_gbps) -> dict:
    rec = record("reference", 2, B, L, Hq, H, D, copy_gbps)
    nbytes = kivi_bytes(B, L, Hq, H, D, 2, 2)

    def body(rec):
        data = make_kivi_sets(B, L, Hq, H, D, 2, 2, DTYPE, DEV, 1, seed=3)
        ints = dict(sm_scale=D**-0.5, k_bits=2, v_bits=2, group_size=G, residual_length=R, page_size=P)
        q = data["sets"][0]["q"]
        out = torch.empty_like(q)
        fn = lambda: dref.decode_attention(q, *kivi_args(data, 0), out=out, **ints)  # noqa: E731
        ms = eager_ms(fn) if DEV.type == "cuda" else timed([fn])["ms"]  # it syncs: never graph-captured
        finish(rec, dict(ms=ms, mode="eager"), nbytes)

    return guarded(rec, 3 * B * H * L * D * 4 * 2 + nbytes + 2**30, body)


def bench_copy_same(B, L, Hq, H, D, bits, copy_gbps) -> dict:
    """`copy_` of as many bytes (read plus written) as a `bits`-bit decode-attention call moves, timed the same
    way: what a plain copy of that size reaches, launch ramp and tail included. The fastest of three placements
    of its buffers (destinations after the sources, before them, after a 3 MiB gap), kept as a check: some large
    sizes ran at ~65% of copy_bandwidth's rate on the H200, in all three alike (kernel_notes.md)."""
    rec = record("copy_same_bytes", bits, B, L, Hq, H, D, copy_gbps)
    nbytes = kivi_bytes(B, L, Hq, H, D, bits, bits)
    numel = nbytes // 4  # bf16 halves, as copy_bandwidth copies

    def timed_copy(k_sets: int, placement: str) -> dict | None:
        def make():
            return [torch.empty(numel, dtype=torch.bfloat16, device=DEV) for _ in range(k_sets)]

        first = make()
        gap = torch.empty(3 << 20, dtype=torch.uint8, device=DEV) if placement == "gap" else None
        src, dst = (make(), first) if placement == "dst_first" else (first, make())
        del gap
        for i, t in enumerate(src):
            t.normal_(generator=gen(4 + i))
        dst[0].copy_(src[0])
        if not torch.equal(dst[0], src[0]):
            return None
        return timed([lambda s=s, d=d: d.copy_(s) for s, d in zip(src, dst, strict=True)])

    def body(rec):
        timings = {p: timed_copy(n_sets(nbytes), p) for p in ("src_first", "dst_first", "gap")}
        rec["check_equal"] = all(t is not None for t in timings.values())
        if not rec["check_equal"]:
            rec["error"] = "check failed"
            return
        rec["ms_by_placement"] = {p: t["ms"] for p, t in timings.items()}
        finish(rec, min(timings.values(), key=lambda t: t["ms"]), 4 * numel)

    return guarded(rec, 2 * nbytes * n_sets(nbytes) + 2**30, body)
