"""Where an engine's memory cap goes: weights, the activation workspace set aside, the cache plan, graph pools.

    python benchmarks/memory_probe.py --workload a --system engine-kivi-2 --cap 40

Builds the engine as bench_engine does (random Llama-2-7B shape, the cap via set_per_process_memory_fraction),
prints allocated GiB after each stage and the plan, and one JSON object last (also to --out). GPU only.
`memory-20261130-h200-a.json` holds what it printed for workload a (KIVI-2: the 238 residual rings are 14.9 of the
cache's 24.7 GiB).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import env_header, finish  # noqa: E402
from engine_probe import build_engine, engine_config  # noqa: E402
from engine_setup import MODELS, WORKLOADS, GiB, StubTokenizer, build_model, make_prompts, set_cap  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="a", choices=sorted(WORKLOADS))
    p.add_argument("--system", default="engine-kivi-2")
    p.add_argument("--cap", type=float, default=40.0)
    p.add_argument("--model", default="llama2-7b", choices=sorted(MODELS))
    p.add_argument("--out", default=None, help="also write the JSON object here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("memory_probe needs a GPU")
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from pipeline.actors.engine import LLMEngine, Request, SamplingParams

    dev = torch.device("cuda")
    stages = {}

    def mark(name: str) -> None:
        torch.cuda.synchronize(dev)
        stages[name] = round(torch.cuda.memory_allocated(dev) / GiB, 3)
        print(f"{name:>24}: {stages[name]:.3f} GiB allocated, peak {torch.cuda.max_memory_allocated(dev) / GiB:.3f}")

    set_cap(args.cap, dev)
    model = build_model(MODELS[args.model], dev)
    mark("model")
    engine = LLMEngine(model, StubTokenizer(), engine_config(args.system, memory_limit_gib=args.cap))
    mark("engine object")
    prompts = make_prompts(args.workload, WORKLOADS[args.workload], 512, seed=0, vocab=model.config.vocab_size)
    requests = [Request(f"r{i}", q.ids, SamplingParams(max_new_tokens=q.new_tokens)) for i, q in enumerate(prompts)]
    build_engine(engine, requests)
    mark("built (cache, graphs)")
    cache = engine.cache
    cache_bytes = sum(t.nbytes for layer in cache.layers for t in layer.tensors.values()) + cache.block_table.nbytes
    plan = engine.plan
    out = dict(stages_gib=stages, plan=dict(num_slots=plan.num_slots, num_pages=plan.num_pages,
                                             budget_gib=plan.budget_bytes / GiB,
                                             workspace_gib=plan.workspace_bytes / GiB),
               cache_tensors_gib=cache_bytes / GiB, slot_bytes=engine.cache.slot_bytes,
               page_bytes=engine.cache.page_bytes, params_gib=sum(p.numel() * 2 for p in model.parameters()) / GiB,
               buffers_gib=sum(b.numel() * b.element_size() for b in model.buffers()) / GiB)
    out = dict(header=env_header(dev), args=vars(args), **out)
    finish(args.out, out)


if __name__ == "__main__":
    main()
