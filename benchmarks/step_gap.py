"""GPU time against host time per decode step of the engine with CUDA graphs (issue 3): how much of a step
the GPU sits idle while the host handles the previous step's tokens.

On the H200:

    python benchmarks/step_gap.py --out $OUT/step_gap.json

Builds the Llama-2-7B shape (random bf16 weights) under a memory cap, prefills `--prompts` prompts of
`--prompt-len` tokens at once, then records a CUDA event before and after each decode step (graph replay and
logits). Reports medians over the steps at full batch: GPU ms per step, host ms between step starts and GPU
idle ms between steps. Prints one JSON object last. `--cpu-smoke` runs a tiny model on the CPU (no events:
only checks that the script runs).
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
from engine_setup import StubTokenizer, make_prompts, probe_model, probe_parser  # noqa: E402


class StepProbe:
    """For engine_probe.instrumented_runner: host time and CUDA events around each decode step."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.marks = cuda, []  # (host start, start event, end event, batch)

    def on_prefill(self, prompts) -> None:
        pass

    def on_decode(self, positions) -> None:
        start = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self.marks.append([time.perf_counter(), start, None, len(positions)])
        if start is not None:
            start.record()

    def after_decode(self) -> None:
        if self.cuda:
            self.marks[-1][2] = torch.cuda.Event(enable_timing=True)
            self.marks[-1][2].record()


def measure(model, system: str, n: int, prompt_len: int, new_tokens: int, cap_gib: float, cuda: bool) -> dict:
    from pipeline.actors.engine import LLMEngine, Request, SamplingParams

    prompts = make_prompts("b", (prompt_len, new_tokens), n, 0, model.config.vocab_size)
    engine = LLMEngine(model, StubTokenizer(), engine_config(system, memory_limit_gib=cap_gib if cuda else None,
                                                             max_batch_size=256, cuda_graphs=cuda))
    engine.generate([Request("warmup", prompts[0].ids, SamplingParams(max_new_tokens=3))])  # builds the runner
    probe = StepProbe(cuda)
    with instrumented_runner(probe):
        engine.generate([Request(f"r{i}", p.ids, SamplingParams(max_new_tokens=p.new_tokens))
                         for i, p in enumerate(prompts)])
    full = [m for m in probe.marks if m[3] == n][2:]  # steps at full batch, the first two left out (warm-up)
    pairs = list(zip(full[:-1], full[1:], strict=True))  # consecutive steps
    out = dict(system=system, sequences=n, steps=len(full),
               host_ms_between_steps=statistics.median((b[0] - a[0]) * 1e3 for a, b in pairs))
    if cuda:
        torch.cuda.synchronize()
        out["gpu_ms_per_step"] = statistics.median(m[1].elapsed_time(m[2]) for m in full)
        out["gpu_idle_ms_between_steps"] = statistics.median(a[2].elapsed_time(b[1]) for a, b in pairs)
    return out


def main() -> None:
    p = probe_parser(__doc__, prompts=128, new_tokens=48)
    p.add_argument("--system", default="engine-kivi-2")
    args = p.parse_args()
    model, device, cuda = probe_model(args)
    n, prompt_len, new = (args.prompts, args.prompt_len, args.new_tokens) if cuda else (4, 16, 8)
    result = measure(model, args.system, n, prompt_len, new, args.cap_gib, cuda)
    report = dict(header=env_header(device), args=vars(args), result=result)
    finish(args.out, report)


if __name__ == "__main__":
    main()
