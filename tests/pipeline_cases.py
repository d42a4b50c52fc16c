"""Shared pieces of the pipeline tests (test_pipeline_config.py, test_pipeline_unit.py, test_progress.py): a
whitespace tokenizer and an engine that echoes, for the row and stat plumbing only, an actor built on them,
and a Parquet writer."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.actors.actor import GenerateActor
from pipeline.actors.engine import Completion

# --- fakes: a whitespace tokenizer and an engine that echoes, for the row/stat plumbing only ---


class FakeTokenizer:
    chat_template = "fake"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [len(w) for w in text.split()]}


class FakeEngine:
    context = 50

    def __init__(self):
        self.seen = []

    def reset_stats(self):
        pass

    def stats(self):
        return {"max_allocated_mb": 12.5, "kv_cache_bytes": 100, "kv_cache_bytes_bf16": 400, "device_name": "fake",
                "oom_retries_total": 0, "rebuilds_total": 0, "model_dtype": "float32", "cache_dtype": "bfloat16"}

    def generate(self, requests):
        self.seen += requests
        out = []
        for r in requests:
            n = len(r.prompt_token_ids)
            if n > self.context:
                out.append(Completion(r.request_id, "", [], n, "error", error=f"prompt of {n} tokens > {self.context}"))
            else:
                k = r.sampling.max_new_tokens
                out.append(Completion(r.request_id, "ok " * k, [7] * k, n, "length", ttft_s=0.01, decode_s=0.02))
        return out


def fake_actor(source="prompt", **job):
    return GenerateActor({"output": "unused", **job}, source, loader=lambda cfg: (FakeEngine(), FakeTokenizer()))


def write(path, **columns):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path
