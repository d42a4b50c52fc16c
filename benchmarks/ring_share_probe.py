"""How a decode call's time splits between packed blocks and full-precision ring tokens, at engine-like row
lengths (GPU; issue 3, engine_notes.md "What the missed ratio targets need").

Our ring flushes its oldest G=32 tokens whenever it fills, so a row keeps 97-128 tokens in full precision (~112).
The official KIVI code quantizes a key residual whole once it reaches R, so its keys keep 0-127 (~64). Whether that
rule is worth its quality cost depends on what the tokens it moves from the ring to packed blocks save. This probe
times the 2-bit decode call over the same rows with rings of R = 128, 96 and 64 slots (the kernel's own flush rule,
so 97-128, 65-96 and 33-64 ring tokens). The rows' lengths are the same in every case, so the tokens a case keeps in
the ring are the only difference: a line us = c + d * ring tokens through the three (d: what a token costs more in
the ring than packed; the largest residual says how straight it is) predicts the call for a ring flushed whole at
R = 128 (ring tokens L - 128 * ceil((L - 128) / 128)).

    python3 benchmarks/ring_share_probe.py [--shapes b:150:1153:1280:32:32 a:256:160:498:32:32] [--out probe.json]

A shape is name:B:shortest:longest:q_heads:kv_heads (row_order_probe's form; rows longest first, as the engine
hands them). Times are CUDA-graph replays over rotating input sets; each case is checked against the reference on
two rows first. Prints one line per case and one JSON object last: `records` (shape, residual, packed and ring
tokens, us, bytes, frac_of_copy) and `fits` (c, d, the residual per shape, and the whole-flush prediction against
R = 128).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from row_order_probe import gpu_setup, kivi_case, measure, parse_shape  # noqa: E402

G = 32  # KIVI's group size: how many tokens our ring flushes at a time
RESIDUALS = (128, 96, 64)
DEFAULT_SHAPES = ["b:150:1153:1280:32:32", "a:256:160:498:32:32"]
# rows that fit the engine's short table view (model_runner: 7 pages of 128 tokens) run one block a step there
SHORT_TABLE_TOKENS = 896


def split_tokens(lengths: list[int], residual: int, flush: int) -> tuple[int, int]:
    """(packed, ring) tokens over the rows when the ring of `residual` slots flushes `flush` tokens when full."""
    packed = sum(flush * math.ceil(max(0, n - residual) / flush) for n in lengths)
    return packed, sum(lengths) - packed


def time_case(lengths: list[int], Hq: int, H: int, residual: int, copy_gbps: float, l2: int) -> dict:
    """The 2-bit call over these rows, longest first, with a ring of `residual` slots (row_order_probe's case and
    measure: a check on two rows, then the CUDA-graph time)."""
    calls, check, nbytes = kivi_case(lengths, Hq, H, 2, l2, residual=residual,
                                     **({"step_blocks": 1} if max(lengths) <= SHORT_TABLE_TOKENS else {}))
    return measure(dict(bytes=nbytes), calls, check, "longest-first", copy_gbps)


def fit(records: list[dict]) -> tuple[float, float, float]:
    """Least squares us = c + d * ring tokens over a shape's records: (c, d, the largest residual in us)."""
    x = torch.tensor([[1.0, r["ring_tokens"]] for r in records], dtype=torch.float64)
    y = torch.tensor([r["us"] for r in records], dtype=torch.float64)
    c, d = torch.linalg.lstsq(x, y[:, None]).solution.flatten().tolist()
    return c, d, float((x @ torch.tensor([c, d], dtype=torch.float64) - y).abs().max())


def main() -> None:
    from common import env_header, finish

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, help="name:B:shortest:longest:q_heads:kv_heads")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device, copy_gbps, l2 = gpu_setup("ring_share_probe")
    records, fits = [], []
    for shape in args.shapes:
        name, B, Hq, H, lengths = parse_shape(shape)
        rows = []
        for residual in RESIDUALS:
            packed, ring = split_tokens(lengths, residual, G)
            rec = dict(shape=name, batch=B, q_heads=Hq, kv_heads=H, residual=residual, packed_tokens=packed,
                       ring_tokens=ring, mean_ring_tokens=round(ring / B, 1),
                       **time_case(lengths, Hq, H, residual, copy_gbps, l2))
            torch.cuda.empty_cache()  # the case's pools
            if "us" in rec:
                rows.append(rec)
            records.append(rec)
            print(f"{name} B={B} {Hq}/{H} R={residual}: ring {rec['mean_ring_tokens']} tokens a row, "
                  f"{rec.get('us')} us ({rec.get('frac_of_copy')} of copy), check {rec['check_rel_l2']:.1e}",
                  flush=True)
        if len(rows) == len(RESIDUALS):
            c, d, worst = fit(rows)
            _, ring = split_tokens(lengths, 128, 128)
            predicted = c + d * ring
            fits.append(dict(shape=name, us_at_no_ring=c, us_per_ring_token=d, largest_residual_us=worst,
                             whole_flush_mean_ring_tokens=round(ring / B, 1), whole_flush_us=round(predicted, 2),
                             whole_flush_over_r128=round(predicted / rows[0]["us"], 4)))
            print(f"{name}: a token in the ring costs {d * 1e3:.3f} ns more than packed (largest residual "
                  f"{worst:.1f} us); a ring flushed whole ({ring / B:.1f} tokens a row): {predicted:.1f} us, "
                  f"{predicted / rows[0]['us']:.3f}x of R=128", flush=True)
    finish(args.out, dict(header=env_header(device), copy_gbps=copy_gbps, records=records, fits=fits))


if __name__ == "__main__":
    main()
