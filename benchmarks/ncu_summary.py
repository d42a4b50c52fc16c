"""Summary of ncu's per-instruction source counters for one kernel (issue 5): where warps stall, and which
instructions make the excess global sectors and shared wavefronts.

    ncu --import $OUT/mma.ncu-rep --page source --csv --print-source sass > $OUT/sass.csv
    python benchmarks/ncu_summary.py $OUT/sass.csv --top 12 > $OUT/sass-summary.json

Prints one JSON object: stall reasons' shares of all samples, total global sectors against ideal, shared
wavefronts against their excess, and the `--top` instructions by stall samples and by excess sectors.
"""

from __future__ import annotations

import argparse
import csv
import json


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def summarize(path: str, top: int) -> dict:
    rows = list(csv.reader(open(path, newline="")))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")  # the header row
    header, data = rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]
    col = {name: i for i, name in enumerate(header)}
    get = lambda r, name: number(r[col[name]]) if name in col else 0.0
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = sum(get(r, "Warp Stall Sampling (All Samples)") for r in data) or 1.0
    shares = {s: round(sum(get(r, s) for r in data) / samples, 3) for s in stalls}

    def listing(key: str) -> list[dict]:
        best = sorted(data, key=lambda r: -get(r, key))[:top]
        return [{"sass": r[col["Source"]].strip()[:80], key: get(r, key),
                 "stall_samples": get(r, "Warp Stall Sampling (All Samples)")} for r in best if get(r, key) > 0]

    return {
        "stall_share": {s: v for s, v in sorted(shares.items(), key=lambda kv: -kv[1]) if v >= 0.01},
        "global_sectors": sum(get(r, "L2 Theoretical Sectors Global") for r in data),
        "global_sectors_ideal": sum(get(r, "L2 Theoretical Sectors Global Ideal") for r in data),
        "shared_wavefronts": sum(get(r, "L1 Wavefronts Shared") for r in data),
        "shared_wavefronts_excessive": sum(get(r, "L1 Wavefronts Shared Excessive") for r in data),
        "top_stalled": listing("Warp Stall Sampling (All Samples)"),
        "top_excess_sectors": listing("L2 Theoretical Sectors Global Excessive"),
        "top_excess_wavefronts": listing("L1 Wavefronts Shared Excessive"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    print(json.dumps(summarize(args.csv, args.top)))


if __name__ == "__main__":
    main()
