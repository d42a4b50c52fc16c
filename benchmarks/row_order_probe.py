"""Does the order programs start in matter when a decode batch mixes row lengths? (GPU)

A decode-attention call's programs take time in proportion to their row's length, and an H200 holds only so
many at once (8 one-warp programs an SM for the 2-bit kernel), so a call is a few waves of programs. If the last
wave mixes long and short rows, the call waits for the long ones. This probe times one call over rows of mixed
lengths four ways: rows in a random order or longest first (what the engine's scheduler.decode_rows hands the
kernels), each with the grid starting programs row by row (common.ROW_MAJOR, grid (H, B, splits)) or head by head
(grid (B, H, splits), the layout before). Longest first with row-major dispatch is longest-processing-time-first
scheduling of the programs.

    python3 benchmarks/row_order_probe.py [--shapes d:125:1040:2048:32:32 ...] [--systems kivi-2 kivi-4 bf16]
                                          [--out probe.json]

A shape is name:B:shortest:longest:q_heads:kv_heads; row lengths are drawn uniformly between the two (one draw
per shape, shared by every system and order). Times are CUDA-graph replays over rotating input sets
(gpu_timing.time_graph); each order's output is checked against the reference on two rows. Prints one line per
case and one JSON object last: `header` (common.env_header) and `records` with `system`, `shape`, `batch`,
`lengths` (min, mean, max), `order`, `row_major`, `us`, `bytes`, `gbps` and `frac_of_copy`.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

D = 128
# engine-like mixes (Llama-2-7B at 40 GiB): d's 1,024-token prompts with 16-1,024 new tokens at its 125 rows;
# e's 256-token prompts with up to 2,048 new; b's rows, nearly equal; a GQA mix
DEFAULT_SHAPES = ["d:125:1040:2048:32:32", "e:96:272:2304:32:32", "b:150:1153:1280:32:32", "gqa:200:512:4096:32:8"]
ORDERS = ("random", "longest-first")


def row_lengths(B: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(B)]


def ordered(lengths: list[int], order: str, seed: int) -> list[int]:
    """The rows in the order a call takes them."""
    if order == "longest-first":
        return sorted(lengths, reverse=True)
    out = list(lengths)
    random.Random(seed).shuffle(out)
    return out


def kivi_case(lengths: list[int], Hq: int, H: int, bits: int, l2: int, residual: int = 128, **knobs):
    """(calls(order) -> list of one-set calls, check(order) -> rel L2 on two rows, bytes) for KIVI caches with a
    ring of `residual` slots; knobs go to every decode_attention call."""
    import kivi_data
    from gpu_timing import sets_for
    from kernel_cases import rel_l2
    from kivi_data import kivi_args

    from kivi_kernels.decode_attention import decode_attention
    from kivi_kernels.decode_attention import reference as dref

    B, L = len(lengths), max(lengths)
    before, kivi_data.R = kivi_data.R, residual  # the pools' ring and quantized_len follow it
    try:
        nbytes = sum(kivi_data.kivi_bytes(1, n, Hq, H, D, bits, bits) for n in lengths)
        n_sets = sets_for(nbytes, l2, max_sets=16)
        data = kivi_data.make_kivi_sets(B, L, Hq, H, D, bits, bits, torch.bfloat16, torch.device("cuda"), n_sets,
                                        seed=7)
    finally:
        kivi_data.R = before
    ints = dict(sm_scale=D**-0.5, k_bits=bits, v_bits=bits, group_size=32, residual_length=residual,
                page_size=kivi_data.P)
    outs = [torch.empty_like(s["q"]) for s in data["sets"]]

    def set_order(order):
        lens = torch.tensor(ordered(lengths, order, seed=11), dtype=torch.int32, device="cuda")
        for s in data["sets"]:
            s["seq_lens"] = lens

    def calls(order):
        set_order(order)
        return [lambda i=i: decode_attention(data["sets"][i]["q"], *kivi_args(data, i), out=outs[i], **ints, **knobs)
                for i in range(n_sets)]

    def check(order):
        set_order(order)
        outs[0].fill_(float("nan"))
        calls(order)[0]()
        s, rows = data["sets"][0], [0, B - 1]
        ref = dref.decode_attention(s["q"][rows], *kivi_args(data, 0)[:9], s["slots"][rows], s["seq_lens"][rows],
                                    **ints)
        return rel_l2(outs[0][rows], ref)

    return calls, check, nbytes


def bf16_case(lengths: list[int], Hq: int, H: int, l2: int):
    """The same for the full-precision paged cache (the engine-bf16 kernel)."""
    from gpu_timing import sets_for
    from kernel_cases import rel_l2
    from kivi_data import P, bf16_bytes, make_paged_sets

    from kivi_kernels.paged_attention import ops as paged
    from kivi_kernels.paged_attention import reference as pref

    B, L = len(lengths), max(lengths)
    nbytes = sum(bf16_bytes(1, n, Hq, H, D) for n in lengths)
    n_sets = sets_for(nbytes, l2, max_sets=16)
    data = make_paged_sets(B, L, Hq, H, D, torch.device("cuda"), n_sets, seed=7)
    outs = torch.empty_like(data["q"])

    def call(i):
        return paged.paged_decode_attention(data["q"][i], data["k_pages"], data["v_pages"], data["table"],
                                            data["slots"][i], data["seq_lens"], sm_scale=D**-0.5, page_size=P,
                                            out=outs[i])

    def calls(order):
        data["seq_lens"] = torch.tensor(ordered(lengths, order, seed=11), dtype=torch.int32, device="cuda")
        return [lambda i=i: call(i) for i in range(n_sets)]

    def check(order):
        calls(order)
        outs[0].fill_(float("nan"))
        call(0)
        rows = [0, B - 1]
        ref = pref.paged_decode_attention(data["q"][0, rows], data["k_pages"], data["v_pages"], data["table"],
                                          data["slots"][0][rows], data["seq_lens"][rows], sm_scale=D**-0.5,
                                          page_size=P)
        return rel_l2(outs[0, rows], ref)

    return calls, check, nbytes


def parse_shape(shape: str) -> tuple[str, int, int, int, list[int]]:
    """(name, B, q_heads, kv_heads, row lengths) of name:B:shortest:longest:q_heads:kv_heads (one seeded draw)."""
    name, B, lo, hi, Hq, H = shape.split(":")
    B, lo, hi, Hq, H = int(B), int(lo), int(hi), int(Hq), int(H)
    return name, B, Hq, H, row_lengths(B, lo, hi, seed=B * 7919 + hi)


def measure(rec: dict, calls, check, order: str, copy_gbps: float) -> dict:
    """rec with the check on two rows, then (if it passed) the CUDA-graph time, GB/s and fraction of copy."""
    from gpu_timing import time_graph
    from kernel_cases import CHECK_TOL

    rec["check_rel_l2"] = check(order)
    if not rec["check_rel_l2"] < CHECK_TOL:
        rec["error"] = "check failed"
        return rec
    ms = time_graph(calls(order))["ms"]
    rec.update(us=round(ms * 1e3, 2), gbps=round(rec["bytes"] / (ms * 1e-3) / 1e9, 1))
    rec["frac_of_copy"] = round(rec["gbps"] / copy_gbps, 4)
    return rec


def run_case(system: str, shape: str, copy_gbps: float, l2: int) -> list[dict]:
    from kivi_kernels.decode_attention import common as C

    name, B, Hq, H, lengths = parse_shape(shape)
    if system == "bf16":
        calls, check, nbytes = bf16_case(lengths, Hq, H, l2)
    else:
        calls, check, nbytes = kivi_case(lengths, Hq, H, int(system.split("-")[1]), l2)
    records = []
    for order in ORDERS:
        for row_major in (True, False):
            C.ROW_MAJOR = row_major  # read at each launch, so inside the graph's capture too
            rec = measure(dict(system=system, shape=name, batch=B, q_heads=Hq, kv_heads=H,
                               lengths=[min(lengths), round(sum(lengths) / B, 1), max(lengths)], order=order,
                               row_major=row_major, bytes=nbytes), calls, check, order, copy_gbps)
            records.append(rec)
            print(f"{system:7s} {name:5s} B={B} {Hq}/{H} lengths {rec['lengths']} {order:13s} "
                  f"row_major={row_major!s:5s} {rec.get('us')} us ({rec.get('frac_of_copy')} of copy) "
                  f"check {rec['check_rel_l2']:.1e}", flush=True)
    C.ROW_MAJOR = True
    torch.cuda.empty_cache()
    return records


def gpu_setup(script: str) -> tuple[torch.device, float, int]:
    """(device, copy GB/s measured now, L2 bytes) for a probe that needs a CUDA GPU (SystemExit otherwise)."""
    from common import copy_bandwidth
    from gpu_timing import l2_bytes

    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")
    device = torch.device("cuda")
    return device, copy_bandwidth(device)["gbs"], l2_bytes()


def main() -> None:
    from common import env_header, finish

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, help="name:B:shortest:longest:q_heads:kv_heads")
    ap.add_argument("--systems", nargs="*", default=["kivi-2", "kivi-4", "bf16"], choices=["kivi-2", "kivi-4", "bf16"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device, copy_gbps, l2 = gpu_setup("row_order_probe")
    records = [rec for shape in args.shapes for system in args.systems
               for rec in run_case(system, shape, copy_gbps, l2)]
    finish(args.out, dict(header=env_header(device), copy_gbps=copy_gbps, records=records))


if __name__ == "__main__":
    main()
