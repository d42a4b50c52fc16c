"""Does a prefill overlap the decode steps on the GPU? (issue 3: the lever left for workload b)

On the H200:

    python benchmarks/overlap_probe.py --out $OUT/overlap.json

Workload b makes prefill (compute-bound matmuls) about half of KIVI-2's time and decode (memory-bound) the other
half. The engine runs them one after the other. This probe measures what running them at once would give, before
the engine is changed: for each system, an engine is built for workload b at the cap, `--rows` sequences are
prefilled and left running, and a prefill batch of `--prefill-prompts` more is admitted into the free slots. Then:

- `decode_ms`: decode steps alone (`--steps-per-prompt` a prefill prompt; CUDA-graph replays chained on the
  device, as decode-ahead runs them);
- `prefill_ms`: the prefill batch alone;
- `both_ms`: both queued on two streams (decode at high priority) behind a sleep kernel; `decode_done_ms` and
  `prefill_done_ms`: when each stream finished, from the sleep's end. The prefill's first host-to-device copy waits
  for the sleep, so the host queues the rest of the prefill after the GPU has started (`host_queue_ms`, from the
  first decode launch, minus the ~100 ms sleep), while the decode steps, queued first, run alone.

`saving` = 1 - both / (decode + prefill): the share of the serial time that overlapping would save. Prints a
table and one JSON object last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import torch  # noqa: E402
from common import env_header, finish  # noqa: E402
from engine_probe import build_engine, engine_config  # noqa: E402
from engine_setup import MODELS, WORKLOADS, StubTokenizer, build_model, free_memory, make_prompts, set_cap  # noqa: E402

SLEEP_CYCLES = 200_000_000  # ~0.1 s at the H200's ~1.98 GHz: longer than the host takes to queue the decode steps


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def queue_decode(runner, running, steps: int) -> None:
    """`steps` decode steps of the running rows on the current stream, each from the last one's argmax."""
    logits = runner.decode([s.output[-1] for s in running], [s.cached_len - 1 for s in running],
                           [s.slot for s in running])
    for _ in range(steps - 1):
        logits = runner.decode_next(logits.argmax(-1))


def timed(fn, stream: torch.cuda.Stream) -> float:
    """GPU ms of what fn queues on `stream`."""
    start, end = _events()
    with torch.cuda.stream(stream):
        start.record()
        fn()
        end.record()
    end.synchronize()
    return start.elapsed_time(end)


def both(decode_fn, prefill_fn, decode_stream, prefill_stream) -> dict:
    """Both queued behind one sleep kernel; ms from the sleep's end to each stream's end."""
    gate, d_end, p_end = torch.cuda.Event(enable_timing=True), *_events()
    with torch.cuda.stream(decode_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        gate.record()
    prefill_stream.wait_event(gate)
    t0 = time.perf_counter()
    with torch.cuda.stream(decode_stream):
        decode_fn()
        d_end.record()
    with torch.cuda.stream(prefill_stream):
        prefill_fn()
        p_end.record()
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    d_ms, p_ms = gate.elapsed_time(d_end), gate.elapsed_time(p_end)
    return dict(both_ms=max(d_ms, p_ms), decode_done_ms=d_ms, prefill_done_ms=p_ms, host_queue_ms=host_ms)


def probe_system(model, system: str, args, device) -> dict:
    from pipeline.actors.engine import LLMEngine, Request, SamplingParams

    prompts = make_prompts("b", WORKLOADS["b"], 4 * args.rows, 0, model.config.vocab_size)
    requests = [Request(f"r{i}", p.ids, SamplingParams(max_new_tokens=p.new_tokens, ignore_eos=True))
                for i, p in enumerate(prompts)]
    engine = LLMEngine(model, StubTokenizer(), engine_config(system, memory_limit_gib=args.cap))
    build_engine(engine, requests)
    slots = engine.plan.num_slots
    extra = min(max(args.prefill_prompts), slots // 4)
    rows = min(args.rows, slots - extra)
    engine.add(requests[:rows])
    while engine.scheduler.waiting:
        engine.step()  # prefills every admitted row; no decode step yet
    engine.add(requests[rows:rows + extra])
    batch = engine.scheduler.next_prefill()
    for seq in batch:
        engine.cache.set_pages(seq.slot, seq.pages)
    runner, running = engine.runner, list(engine.scheduler.running)
    hi, lo = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)
    out = []
    for n in sorted(args.prefill_prompts, reverse=True):
        part = batch[:n]  # a prefix of the admitted batch: its slots and pages are set
        steps = max(2, round(n * args.steps_per_prompt))
        prefill_args = ([s.request.prompt_token_ids for s in part], [s.slot for s in part])
        decode_fn = partial(queue_decode, runner, running, steps)
        prefill_fn = partial(runner.prefill, *prefill_args, chunk_tokens=engine.scheduler.prefill_tokens)
        decode_fn()  # warm: compile, allocator
        prefill_fn()
        torch.cuda.synchronize()
        reps = []
        for _ in range(args.reps):
            d_ms, p_ms = timed(decode_fn, hi), timed(prefill_fn, lo)
            reps.append(dict(decode_ms=d_ms, prefill_ms=p_ms, **both(decode_fn, prefill_fn, hi, lo)))
        med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
        serial = med["decode_ms"] + med["prefill_ms"]
        out.append(dict(system=system, rows=len(running), prefill_rows=len(part),
                        prefill_tokens=sum(map(len, prefill_args[0])), steps=steps,
                        step_ms=med["decode_ms"] / steps, serial_ms=serial, saving=1 - med["both_ms"] / serial,
                        **{k: round(v, 3) for k, v in med.items()}, reps=reps))
        del decode_fn, prefill_fn
    engine.abort()
    del engine, runner
    free_memory(device)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--systems", default="engine-kivi-2,engine-bf16")
    p.add_argument("--model", default="llama2-7b", choices=list(MODELS))
    p.add_argument("--cap", type=float, default=40.0)
    p.add_argument("--rows", type=int, default=128, help="sequences decoding (fewer if the plan holds fewer)")
    p.add_argument("--prefill-prompts", default="16,4",
                   help="comma list: prompts in the overlapped prefill batch (fewer if the plan holds fewer)")
    p.add_argument("--steps-per-prompt", type=float, default=1.75,
                   help="decode steps queued beside the prefill, per prefill prompt (1.75: about as long as it)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.prefill_prompts = [int(n) for n in args.prefill_prompts.split(",")]
    device = torch.device("cuda")
    set_cap(args.cap, device)
    model = build_model(MODELS[args.model], device)
    results = [r for s in args.systems.split(",") for r in probe_system(model, s, args, device)]
    print(f"{'system':<16}{'rows':>5}{'pre':>5}{'step ms':>9}{'decode':>9}{'prefill':>9}{'both':>9}"
          f"{'dec done':>9}{'pre done':>9}{'saving':>8}")
    for r in results:
        print(f"{r['system']:<16}{r['rows']:>5}{r['prefill_rows']:>5}{r['step_ms']:>9.2f}{r['decode_ms']:>9.1f}"
              f"{r['prefill_ms']:>9.1f}{r['both_ms']:>9.1f}{r['decode_done_ms']:>9.1f}{r['prefill_done_ms']:>9.1f}"
              f"{r['saving']:>8.1%}")
    finish(args.out, dict(env_header(device), model=args.model, cap_gib=args.cap, results=results))


if __name__ == "__main__":
    main()
