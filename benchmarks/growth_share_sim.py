"""The scheduler alone (no model) under page growth: does a Kaplan-Meier estimate of the share of max_new_tokens
that rows use beat the mean over finished rows, which early in a job counts only the rows that stopped soonest?

Rows of 1,024-token prompts ask for 1,024 new tokens and stop at a length drawn from 16 to 1,024 (bench_engine's
d `--stop-early`); every row may stop early, so each grows (Scheduler's page growth). Each engine step is a prefill
of what next_prefill admits, or a decode step of the rows in flight (Scheduler.reserve first). The Kaplan-Meier
estimate counts rows in flight as censored at their share so far. Throughput is modelled from H200 costs: 10 ms a
decode step, 22 us a prefilled token. CPU only, a few seconds:

    python benchmarks/growth_share_sim.py --out sim.json

Prints one JSON object last: per (slots, pages, seed) the preemptions, recomputed tokens, decode steps, mean rows
in flight and modelled tokens/s of both estimates.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

from pipeline.actors.engine import scheduler as S  # noqa: E402
from pipeline.actors.engine.block_manager import BlockManager  # noqa: E402
from pipeline.actors.engine.request import Request, SamplingParams, Sequence  # noqa: E402

STEP_S, PREFILL_TOKEN_S, PROMPT, NEW = 0.010, 22e-6, 1024, 1024


def kaplan_meier_share(finished: list[float], running: list[float]) -> float:
    """Mean share of the product-limit estimate: finished rows' shares as events, running rows' as censored;
    past the last observation the survivors are taken to run to the end (share 1)."""
    if not finished:
        return S.INITIAL_SHARE
    points = sorted([(x, 1) for x in finished] + [(x, 0) for x in running], key=lambda p: (p[0], -p[1]))
    surviving, area, prev = 1.0, 0.0, 0.0
    for i, (x, event) in enumerate(points):
        area, prev = area + surviving * (x - prev), x
        if event:
            surviving *= 1 - 1 / (len(points) - i)
    return area + surviving * (1 - prev)


class KaplanMeierScheduler(S.Scheduler):
    @property
    def used_share(self) -> float:
        if getattr(self, "_share", None) is None:
            self._share = kaplan_meier_share(list(self.shares), [len(s.output) / s.max_new_tokens
                                                                 for s in self.running if s.grows])
        return self._share


def simulate(km: bool, slots: int, pages: int, prompts: int, page: int, seed: int) -> dict:
    rng = random.Random(seed)
    blocks = BlockManager(slots, pages, lambda t: -(-t // page))
    sched = (KaplanMeierScheduler if km else S.Scheduler)(blocks, 16384)
    stops = {}
    for i in range(prompts):
        seq = Sequence.start(i, Request(f"r{i}", [1] * PROMPT, SamplingParams(max_new_tokens=NEW, stop=("@",))), NEW)
        seq.grows, stops[i] = True, rng.randint(16, NEW)
        sched.add(seq)
    steps = rows = prefilled = preempted = 0
    while sched.has_work():
        sched._share = None  # once a step
        batch = sched.next_prefill()
        if batch:
            prefilled += sum(s.cached_len for s in batch)
            sched.start_running(batch)
            for s in batch:
                s.output.append(0)
            continue
        preempted += len(sched.reserve()[1])
        steps, rows = steps + 1, rows + len(sched.running)
        for s in list(sched.running):
            s.output.append(0)
            if len(s.output) >= stops[s.index]:
                s.finish_reason = "stop"
                sched.finish(s)
                blocks.release(s)
    return {"preempted": preempted, "recomputed_tokens": prefilled - PROMPT * prompts, "decode_steps": steps,
            "mean_rows": round(rows / steps, 1),
            "tok_per_s": round(sum(stops.values()) / (steps * STEP_S + prefilled * PREFILL_TOKEN_S))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    # engine-bf16's half-length plan on Llama-2-7B at 40 GiB (33 slots, 404 pages of 128 tokens), more slots over
    # the same pages, and a KIVI-2-like pool
    records = []
    for slots, pages in ((33, 404), (48, 404), (132, 1356)):
        for seed in range(args.seeds):
            rec = {"slots": slots, "pages": pages, "seed": seed,
                   "mean": simulate(False, slots, pages, args.prompts, 128, seed),
                   "kaplan_meier": simulate(True, slots, pages, args.prompts, 128, seed)}
            print(rec)
            records.append(rec)
    result = {"records": records}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
