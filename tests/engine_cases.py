"""Shared pieces of the engine tests (test_engine.py, test_engine_decode.py, test_engine_growth.py,
test_engine_parts.py, test_engine_memory.py, test_engine_scratch.py, test_engine_dtypes.py, test_engine_service.py,
test_progress.py, test_model_runner.py): a stub tokenizer, transformers' greedy generate as the reference, seeded
requests, and an fp32 GPU model for A/Bs of engine settings.
The tiny CPU Llama fixture they share, `tiny`, is in conftest.py."""

from __future__ import annotations

import inspect
import warnings

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import kivi
from pipeline.actors.engine import EngineConfig, LLMEngine, Request, SamplingParams

warnings.filterwarnings("ignore", category=FutureWarning)
VOCAB = 101


class StubTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)


def hf_greedy(model, prompt: list[int], n: int, cache) -> tuple[list[int], int]:
    """Greedy tokens of generate(), and how many of them are decided by a clear margin: past the first
    near-tie (top-2 logits within 1e-4), rounding differences of batched matmuls may pick either token."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True, **{name: cache})
    clear = 0
    for logits in out.logits:
        top2 = logits[0].float().topk(2).values
        if top2[0] - top2[1] < 1e-4:
            break
        clear += 1
    return out.sequences[0, len(prompt):].tolist(), clear


def requests(lengths, new_tokens, seed=0, **sampling):
    """Requests r0, r1, ... of random prompts of these lengths, each asking for its new tokens (and `sampling`'s
    other SamplingParams, e.g. stop=("@",): a stop string the stub tokenizer never writes, so rows may stop early)."""
    gen = torch.Generator().manual_seed(seed)
    return [Request(f"r{i}", torch.randint(0, VOCAB, (n,), generator=gen).tolist(),
                    SamplingParams(max_new_tokens=m, **sampling))
            for i, (n, m) in enumerate(zip(lengths, new_tokens, strict=True))]


SMALL_KIVI = kivi.KiviConfig(group_size=16, residual_length=32, page_size=32, backend="reference")


def gpu_llama(dtype: torch.dtype, kv_heads: int, seed: int):
    """A seeded random Llama on the GPU for the engine's GPU tests: hidden 256, 2 layers, 4 query heads of 64 over
    `kv_heads`, no EOS."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=64, max_position_embeddings=1024)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="kivi", dtype=dtype).cuda().eval()
    model.generation_config.eos_token_id = None
    return model


def gpu_fp32_tokens(reqs: list[Request], **engine_config) -> tuple[list[list[int]], LLMEngine]:
    """Greedy tokens of `reqs` (and the engine) from a fresh fp32 Llama on the GPU (seed 9: the same weights each
    call; hidden 256, 2 layers, 4/2 heads) with the full-precision cache and EngineConfig(**engine_config): the
    A/B of an engine setting that may change only fp32 rounding (a 2-bit cache would turn such differences into
    different codes at group edges)."""
    model = gpu_llama(torch.float32, kv_heads=2, seed=9)
    engine = LLMEngine(model, StubTokenizer(), EngineConfig(kivi=None, max_prefill_tokens=1024, memory_limit_gib=4.0,
                                                           **engine_config))
    return [c.token_ids for c in engine.generate(reqs)], engine
