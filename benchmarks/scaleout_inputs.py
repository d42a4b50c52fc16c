"""bench_scaleout's inputs: the random-weight model folder and the prompt files every config reads."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from common import log
from engine_setup import MODELS

LLAMA2_7B = dict(MODELS["llama2-7b"], max_position_embeddings=4096)  # vocab_size: the tokenizer's (build_model)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=1024, rope_theta=10000.0)

def build_model(folder: Path, tokenizer_dir: str, tiny: bool, device: torch.device, seed: int = 0) -> dict:
    """A random-weight bf16 Llama (vocab = the tokenizer's) saved with save_pretrained, tokenizer beside it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = dict(TINY if tiny else LLAMA2_7B, vocab_size=len(tok))
    marker = folder / "bench_shape.json"
    if marker.is_file() and json.loads(marker.read_text()) == shape:
        log(f"model: reusing {folder}")
        return {"reused": True, "shape": shape}
    config = LlamaConfig(**shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if device.type == "cuda":
        torch.cuda.synchronize()
    init_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    model.save_pretrained(folder)  # safetensors
    tok.save_pretrained(folder)
    save_s = time.perf_counter() - t0
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    marker.write_text(json.dumps(shape))
    log(f"model: {params / 1e9:.2f} B parameters, init {init_s:.1f} s, save {save_s:.1f} s -> {folder}")
    return {"reused": False, "shape": shape, "params": params, "init_s": init_s, "save_s": save_s}


def make_prompts(tokenizer_dir: str, n: int, prompt_len: int, seed: int = 0) -> tuple[list[str], dict]:
    """Texts of about prompt_len tokens: random ordinary token ids, decoded, re-tokenized, trimmed, decoded."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    low = 1 + max((i for i in tok.added_tokens_decoder if i < 1000), default=-1)  # skip special/added tokens
    ids = np.random.default_rng(seed).integers(low, len(tok), size=(n, prompt_len + 16)).tolist()
    texts = tok.batch_decode(ids, skip_special_tokens=True)
    again = tok(texts, add_special_tokens=False)["input_ids"]
    texts = tok.batch_decode([a[:prompt_len] for a in again], skip_special_tokens=True)
    lengths = [len(x) for x in tok(texts)["input_ids"]]  # as the job will tokenize them
    return texts, {"min": min(lengths), "mean": float(np.mean(lengths)), "max": max(lengths)}


def write_inputs(folder: Path, texts: list[str], files: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.parquet"):
        old.unlink()
    for f, part in enumerate(np.array_split(np.arange(len(texts)), min(files, len(texts)))):
        pq.write_table(pa.table({"id": [f"p{i:06d}" for i in part], "prompt": [texts[i] for i in part]}),
                       folder / f"part-{f:03d}.parquet")
