"""Prefill of left-padded batches through `kivi.KiviCache` (transformers' `generate` path) on the H200: the first
call at each new padded width, with masked attention left to PyTorch's choice (cuDNN attention there) and with it
kept off cuDNN (what kivi.attention does).

    python benchmarks/hf_prefill_probe.py --out $OUT/hf-prefill.json

Llama-2-7B shape, random bf16 weights, `--rows` rows a batch, the last row padded by a quarter; each width once a
mode (a width a mode sees first; the modes use different widths, so no plan carries over), then the same widths
again (plans built). ms per forward with a fresh KiviCache, synchronized. Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import torch  # noqa: E402
from common import env_header, write_json  # noqa: E402
from engine_setup import MODELS, build_model  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

import kivi  # noqa: E402
import kivi.attention  # noqa: E402

MODES = {"cudnn-allowed": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
                           SDPBackend.CUDNN_ATTENTION],
         "no-cudnn": kivi.attention._NO_CUDNN}


def forward_ms(model, ids, mask) -> float:
    cache = kivi.KiviCache(model.config, kivi.KiviConfig())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--widths", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    model = build_model(MODELS["llama2-7b"], device)
    gen = torch.Generator().manual_seed(0)
    for w in (64, 65, 66, 67, 80):  # Triton's store kernels compile here (widths of each divisibility), off cuDNN
        warm = torch.randint(1, 32000, (args.rows, w), generator=gen).to(device)
        mask = torch.ones_like(warm)
        mask[-1, : w // 4] = 0
        forward_ms(model, warm, mask)
    records = []
    for m, (mode, backends) in enumerate(MODES.items()):
        kivi.attention._NO_CUDNN = backends
        widths = [300 + 37 * (args.widths * m + i) for i in range(args.widths)]
        for again in (False, True):
            for w in widths:
                ids = torch.randint(1, 32000, (args.rows, w), generator=gen).to(device)
                mask = torch.ones_like(ids)
                mask[-1, : w // 4] = 0
                ms = forward_ms(model, ids, mask)
                records.append(dict(mode=mode, width=w, rows=args.rows, first_at_width=not again, ms=ms))
                print(f"{mode:14s} width {w:4d} {'again' if again else 'first'}: {ms:7.1f} ms", flush=True)
    kivi.attention._NO_CUDNN = MODES["no-cudnn"]
    summary = {f"{mode} {'first' if first else 'again'}": round(statistics.median(
        r["ms"] for r in records if r["mode"] == mode and r["first_at_width"] == first), 1)
        for mode in MODES for first in (True, False)}
    result = dict(header=env_header(device), args=vars(args), records=records, median_ms=summary)
    if args.out:
        write_json(args.out, result)
    print(json.dumps(dict(median_ms=summary)))


if __name__ == "__main__":
    main()
