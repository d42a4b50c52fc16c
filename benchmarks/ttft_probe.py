"""Time to first token of an engine's first rows, with and without the warm-up prefill (EngineConfig.warm_prefill).

On the H200, each mode in its own process with its own empty Triton cache (a shared cache would hand the second
process the first one's kernels):

    for w in off on; do
        TRITON_CACHE_DIR=/tmp/tc-$w python benchmarks/ttft_probe.py --warm $w --out $OUT/ttft-$w.json
    done

A SmolLM2-135M-shaped model with random bf16 weights (30 layers, 9/3 heads of 64), KIVI-2, `--rounds` rounds of
36 prompts of 30-300 tokens, 64 new tokens each, each round a `generate` call. Round 0 follows the build; later
rounds run on compiled kernels. With `--long N1,N2,...`, prompts of those lengths follow, one after the other,
with `--prefill-budget` under them, so that each is prefilled in chunks: the first one's time to first token
against a later one's says what the chunked path still sets up after the build (and which Triton kernels it
compiles), and lengths that differ say whether that recurs per shape. `--no-cudnn-sdp` turns PyTorch's cuDNN
attention backend off. Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import torch  # noqa: E402
from common import env_header, write_json  # noqa: E402
from engine_setup import StubTokenizer, build_model  # noqa: E402

from pipeline.actors.engine import EngineConfig, LLMEngine, Request, SamplingParams  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192)


def prompts(seed: int, n: int = 36) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(30, 300, (n,), generator=gen).tolist()
    return [Request(f"r{seed}-{i}", torch.randint(0, SMOLLM2["vocab_size"], (m,), generator=gen).tolist(),
                    SamplingParams(max_new_tokens=64, ignore_eos=True)) for i, m in enumerate(lengths)]


def _cached_kernels() -> set[str]:
    """(cache entry, kernel name) of the compiled kernels in $TRITON_CACHE_DIR (set it to a fresh folder)."""
    root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return {f"{p.parent.name[:8]}/{p.stem}" for p in root.glob("*/*.json") if not p.name.startswith("__grp__")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", choices=["on", "off"], required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long", default="", help="then prompts of these lengths, prefilled in chunks")
    parser.add_argument("--no-cudnn-sdp", action="store_true")
    parser.add_argument("--prefill-budget", type=int, default=1024)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    long_lengths = [int(n) for n in args.long.split(",") if n]
    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(SMOLLM2, device)
    engine = LLMEngine(model, StubTokenizer(), EngineConfig(
        max_model_len=max([2048] + [n + 64 for n in long_lengths]),
        max_prefill_tokens=args.prefill_budget if long_lengths else 16384,
        warm_prefill=None if args.warm == "on" else False))
    rounds = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        ttft_ms = sorted(c.ttft_s * 1e3 for c in engine.generate(prompts(r)))
        rounds.append(dict(round=r, wall_s=time.perf_counter() - t0, ttft_ms_min=ttft_ms[0],
                           ttft_ms_median=statistics.median(ttft_ms), ttft_ms_max=ttft_ms[-1]))
        print(f"warm {args.warm} round {r}: wall {rounds[-1]['wall_s']:.3f} s, ttft ms min {ttft_ms[0]:.1f} "
              f"median {rounds[-1]['ttft_ms_median']:.1f} max {ttft_ms[-1]:.1f}")
    long_ttft_ms, compiled = [], []
    for i, n in enumerate(long_lengths):
        before = _cached_kernels()
        gen = torch.Generator().manual_seed(1000 + i)
        request = Request(f"long-{i}", torch.randint(0, SMOLLM2["vocab_size"], (n,), generator=gen).tolist(),
                          SamplingParams(max_new_tokens=4, ignore_eos=True))
        long_ttft_ms += [c.ttft_s * 1e3 for c in engine.generate([request])]
        compiled.append(sorted(_cached_kernels() - before))
        print(f"warm {args.warm} long prompt {i} ({n} tokens, budget {args.prefill_budget}): "
              f"ttft {long_ttft_ms[-1]:.1f} ms; compiled {compiled[-1]}")
    result = dict(header=env_header(device), warm=args.warm, build_s=engine.build_s, rounds=rounds,
                  long_tokens=long_lengths, cudnn_sdp=torch.backends.cuda.cudnn_sdp_enabled(),
                  prefill_budget=args.prefill_budget, long_ttft_ms=long_ttft_ms, long_compiled=compiled)
    if args.out:
        write_json(args.out, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
