"""A long prompt's chunked prefill under a memory cap: is its full-precision scratch in the memory plan?

A prompt past `max_prefill_tokens` is prefilled in chunks, its keys and values kept in full precision in a
scratch of its own length (EngineCache.set_chunk). The plan sets that scratch aside for the longest such prompt
among the requests it is made for (memory.scratch_bytes); `--no-scratch` plans as before it did, with none
set aside. On the H200 (a Llama-3-8B shape with 65,536 positions, random bf16 weights, KIVI-2, a 40 GiB cap):

    python benchmarks/scratch_probe.py --out $OUT/scratch.json
    python benchmarks/scratch_probe.py --no-scratch --out $OUT/scratch-off.json

Requests: one prompt of `--long` tokens (a 32,768-token prompt's scratch is 4 GiB at 8 KV heads) and
`--short` prompts of 1,024, each asking for 16 new tokens; the cap fills with the cache. With `--late` the long
prompt arrives after the build (planned for the short prompts alone) and a few decode steps: the engine holds it
until the rows in flight are done, then builds its cache again with its scratch aside (LLMEngine._rebuild);
`--late --no-hold` admits it as before that (it then runs out of memory and is retried in smaller chunks). Prints
one JSON object last: the plan (slots, pages, scratch; the first build's too), each row's finish reason, errors,
out-of-memory retries, rebuilds and times.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import torch  # noqa: E402
from common import env_header, finish  # noqa: E402
from engine_setup import MODELS, SMOKE_MODELS, GiB, StubTokenizer, build_model, set_cap  # noqa: E402

from pipeline.actors.engine import EngineConfig, LLMEngine, Request, SamplingParams, build  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--long", type=int, default=32768)
    p.add_argument("--short", type=int, default=64, help="prompts of 1,024 tokens beside the long one")
    p.add_argument("--cap-gib", type=float, default=40.0)
    p.add_argument("--no-scratch", action="store_true", help="plan without the scratch (as before 9e68da0)")
    p.add_argument("--late", action="store_true", help="the long prompt after the build and a few steps")
    p.add_argument("--no-hold", action="store_true", help="with --late: admit it at once (no rebuild)")
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny GQA model on the CPU, short prompts")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cuda = not args.cpu_smoke
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        set_cap(args.cap_gib, device)
        shape = dict(MODELS["llama3-8b"], max_position_embeddings=65536)
        long_len, short_len, budget = args.long, 1024, 16384
    else:
        shape, long_len, short_len, budget = SMOKE_MODELS["tiny-gqa"], 200, 20, 64
    model = build_model(shape, device)
    if args.no_scratch:  # the plan before: no prefill lengths passed on, so nothing is set aside
        real = build.plan_for
        build.plan_for = lambda *a, **kw: real(*a, **{**kw, "prefill_lens": None})
    config = EngineConfig(memory_limit_gib=args.cap_gib if cuda else None, max_prefill_tokens=budget,
                          max_batch_size=256)
    engine = LLMEngine(model, StubTokenizer(), config)
    gen = torch.Generator().manual_seed(0)
    lens = [long_len] + [short_len] * args.short
    reqs = [Request(f"r{i}", torch.randint(0, 32000 if cuda else 500, (n,), generator=gen).tolist(),
                    SamplingParams(max_new_tokens=16, ignore_eos=True)) for i, n in enumerate(lens)]
    if args.no_hold:
        LLMEngine._scratch_short = lambda self, seq: False
    t0 = time.perf_counter()
    out, first_plan = run(engine, reqs, args.late)
    wall = time.perf_counter() - t0
    plan = engine.plan
    stats = engine.stats()
    result = {
        **env_header(device), "args": vars(args),
        "plan": {"num_slots": plan.num_slots, "num_pages": plan.num_pages, "budget_gib": plan.budget_bytes / GiB,
                 "workspace_gib": plan.workspace_bytes / GiB, "scratch_gib": plan.scratch_bytes / GiB},
        "long_prompt": {"tokens": long_len, "finish_reason": out[0].finish_reason, "error": out[0].error,
                        "ttft_s": out[0].ttft_s},
        "rows_done": sum(c.finish_reason == "length" for c in out), "rows_failed": sum(c.finish_reason == "error"
                                                                                        for c in out),
        "first_plan": first_plan, "rebuilds": stats["rebuilds"],
        "oom_retries": stats["oom_retries"], "wall_s": wall, "build_s": stats["build_s"],
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GiB if cuda else None,
    }
    finish(args.out, result)


def run(engine: LLMEngine, reqs: list[Request], late: bool) -> tuple[list, dict]:
    """Completions in request order (reqs[0] the long prompt) and the first build's plan; late: the short prompts
    first, the long one after the first prefill and a decode step."""
    if not late:
        out = engine.generate(reqs)
        return out, {"num_slots": engine.plan.num_slots, "scratch_gib": engine.plan.scratch_bytes / GiB}
    short = engine.add(reqs[1:])
    engine.step()
    engine.step()
    first_plan = {"num_slots": engine.plan.num_slots, "scratch_gib": engine.plan.scratch_bytes / GiB}
    long = engine.add(reqs[:1])
    while short.pending or long.pending:
        engine.step()
    return long.results + short.results, first_plan


if __name__ == "__main__":
    main()
