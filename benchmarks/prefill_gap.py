"""Prefill's wall time against its GPU time in the engine (issue 3): does a prompt token cost what the GPU
spends on it, or does the host leave the GPU idle between and around prefill batches?

On the H200:

    python benchmarks/prefill_gap.py --out $OUT/prefill_gap.json

Builds the Llama-2-7B shape (random bf16 weights) under a memory cap and runs `--prompts` prompts of
`--prompt-len` tokens with `--new-tokens` each, all admitted at once, so the run is mostly prefill batches (the
engine's default budget of 16,384 padded tokens a batch). CUDA events bracket each ModelRunner.prefill call
(the forward and the last positions' logits). Reports per prompt token: the engine's own prefill time
(`prefill_s` of its stats: the batch's host work, the forward and reading its first tokens), the GPU time inside
the calls, and the GPU idle time between one call's end and the next call's start; and per batch the host ms
spent before the GPU starts. Prints one JSON object last. `--cpu-smoke` runs a tiny model on the CPU (no events).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import torch  # noqa: E402
from common import env_header, finish  # noqa: E402
from engine_probe import engine_config, instrumented_runner  # noqa: E402
from engine_setup import StubTokenizer, free_memory, make_prompts, probe_model, probe_parser  # noqa: E402


class PrefillProbe:
    """For engine_probe.instrumented_runner: host time and CUDA events around each prefill call."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.marks = cuda, []  # [host start, host end, start event, end event, prompt tokens]

    def on_prefill(self, prompts) -> None:
        start = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self.marks.append([time.perf_counter(), None, start, None, sum(len(p) for p in prompts)])
        if start is not None:
            start.record()

    def after_prefill(self) -> None:
        self.marks[-1][1] = time.perf_counter()
        if self.cuda:
            self.marks[-1][3] = torch.cuda.Event(enable_timing=True)
            self.marks[-1][3].record()

    def on_decode(self, positions) -> None:
        pass


def measure(model, system: str, n: int, prompt_len: int, new_tokens: int, cap_gib: float, cuda: bool) -> dict:
    from pipeline.actors.engine import LLMEngine, Request, SamplingParams

    prompts = make_prompts("b", (prompt_len, new_tokens), n, 0, model.config.vocab_size)
    engine = LLMEngine(model, StubTokenizer(), engine_config(system, memory_limit_gib=cap_gib if cuda else None,
                                                             max_batch_size=256, cuda_graphs=cuda))
    engine.generate([Request("warmup", prompts[0].ids, SamplingParams(max_new_tokens=3))])  # builds the runner
    engine.reset_stats()
    probe = PrefillProbe(cuda)
    with instrumented_runner(probe):
        engine.generate([Request(f"r{i}", p.ids, SamplingParams(max_new_tokens=p.new_tokens))
                         for i, p in enumerate(prompts)])
    stats = engine.stats()
    del engine
    free_memory(model.device)  # the next system builds its own cache under the same cap
    marks = probe.marks[1:] or probe.marks  # the first batch's allocator and kernel warm-up left out
    tokens = sum(m[4] for m in marks)
    out = dict(system=system, sequences=n, prefill_calls=len(marks), prompt_tokens=tokens,
               num_slots=stats.get("num_slots"),
               engine_prefill_us_per_token=1e6 * stats["prefill_s"] / max(stats["prefill_tokens"], 1),
               host_call_ms=statistics.median((m[1] - m[0]) * 1e3 for m in marks))
    if cuda:
        torch.cuda.synchronize()
        gpu_ms = [m[2].elapsed_time(m[3]) for m in marks]
        pairs = [(a, b) for a, b in zip(marks[:-1], marks[1:], strict=True)]
        idle_ms = [a[3].elapsed_time(b[2]) for a, b in pairs]
        out.update(gpu_us_per_token=1e3 * sum(gpu_ms) / tokens, gpu_ms_per_call=statistics.median(gpu_ms),
                   idle_ms_between_calls=statistics.median(idle_ms) if idle_ms else None,
                   idle_ms_between_calls_max=max(idle_ms) if idle_ms else None,
                   span_us_per_token=1e3 * marks[0][2].elapsed_time(marks[-1][3]) / tokens)
    return out


def main() -> None:
    p = probe_parser(__doc__, prompts=96, new_tokens=2)
    p.add_argument("--systems", default="engine-kivi-2,engine-bf16")
    args = p.parse_args()
    model, device, cuda = probe_model(args)
    n, prompt_len, new = (args.prompts, args.prompt_len, args.new_tokens) if cuda else (6, 16, 2)
    results = [measure(model, system, n, prompt_len, new, args.cap_gib, cuda) for system in args.systems.split(",")]
    for r in results:
        print(r, flush=True)
    report = dict(header=env_header(device), args=vars(args), results=results)
    finish(args.out, report)


if __name__ == "__main__":
    main()
