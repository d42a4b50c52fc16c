"""bench_engine's set-up: cache formats and their bytes, random-weight models, prompts, memory helpers."""

from __future__ import annotations

import argparse
import gc
import math
from dataclasses import dataclass

import torch

GiB = 2**30
# the CPU smoke runs' model (profile_step, step_gap, prefill_gap)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            vocab_size=500, max_position_embeddings=1024)

MODELS = {  # random-weight bf16 Llama shapes; 8192 positions so that workload c (4000 + 256) fits
    "llama2-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      intermediate_size=11008, vocab_size=32000, max_position_embeddings=8192, rope_theta=10000.0),
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    # Mistral-7B v0.3 (full attention: no sliding window since v0.2), built as transformers' Mistral model
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=32768, max_position_embeddings=8192,
                       rope_theta=1000000.0, sliding_window=None),
}

SMOKE_MODELS = {
    "tiny-mha": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     intermediate_size=256, vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0),
    "tiny-gqa": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=256, vocab_size=512, max_position_embeddings=1024, rope_theta=500000.0),
    "tiny-mistral": dict(model_type="mistral", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=256, vocab_size=512, max_position_embeddings=1024,
                         rope_theta=1000000.0, sliding_window=None),
}
# workload -> (prompt tokens, new tokens or an inclusive (low, high) range drawn uniformly per prompt)
WORKLOADS = {"a": (160, 338), "b": (1024, 256), "c": (4000, 256), "d": (1024, (16, 1024)), "e": (256, 2048)}
SMOKE_WORKLOADS = {"a": (12, 24), "b": (40, 12), "c": (100, 6), "d": (40, (2, 24)), "e": (16, 56)}
SMOKE_KIVI = dict(residual_length=32, page_size=32)  # short residual so tiny workloads exercise the packed store
SMOKE_SYSTEMS = ("hf-bf16", "hf-quanto-2", "hf-kivi-2", "engine-bf16", "engine-kivi-2")
NUM_PROMPTS = {"a": 512, "b": 512, "c": 128, "d": 512, "e": 256}
QUICK_NUM_PROMPTS = {"a": 256, "b": 256, "c": 64, "d": 256, "e": 128}
SYSTEMS = ("hf-bf16", "hf-quanto-2", "hf-quanto-4", "hf-kivi-2", "engine-bf16", "engine-kivi-4", "engine-kivi-2")


# -- cache formats: bytes per sequence --------------------------------------------------------------
@dataclass(frozen=True)
class KVFormat:
    """A sequence's KV cache bytes in one format, all layers. bits=16: plain bf16."""

    layers: int
    heads: int  # KV heads
    head_dim: int
    bits: int = 16
    group: int = 32
    residual: int = 128
    page: int = 128

    @property
    def bf16_token(self) -> int:
        return self.layers * 2 * self.heads * self.head_dim * 2

    @property
    def packed_token(self) -> int:
        """Codes of K and V, plus the scale and zero of keys (per G tokens) and values (per G channels)."""
        hd = self.heads * self.head_dim
        return self.layers * (2 * hd * self.bits // 8 + 8 * hd // self.group)

    def quantized(self, length: int) -> int:
        if self.bits == 16:
            return 0
        return self.group * math.ceil(max(0, length - self.residual) / self.group)

    def read_bytes(self, length: int) -> int:
        """What one decode step reads for a sequence of `length` cached tokens."""
        nq = self.quantized(length)
        return nq * self.packed_token + (length - nq) * self.bf16_token

    def held_bytes(self, length: int) -> int:
        """What the cache holds for it (whole pages, the full residual ring)."""
        if self.bits == 16:
            return length * self.bf16_token
        pages = math.ceil(self.quantized(length) / self.page)
        return pages * self.page * self.packed_token + self.residual * self.bf16_token

    def read_table(self, max_len: int) -> list[int]:
        return [self.read_bytes(n) for n in range(max_len + 2)]


def kv_format(model, system: str, kivi_kw: dict) -> KVFormat:
    cfg = model.config
    shape = dict(layers=cfg.num_hidden_layers, heads=cfg.num_key_value_heads,
                 head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    system = system.partition("/")[0]  # a /<variant> suffix changes the engine, not the cache
    if system.endswith("bf16"):
        return KVFormat(**shape)
    bits = int(system.rsplit("-", 1)[1])
    if "quanto" in system:  # transformers' QuantizedCache defaults (approximate: it requantizes everything)
        return KVFormat(**shape, bits=bits, group=64, residual=128)
    return KVFormat(**shape, bits=bits, group=kivi_kw.get("group_size", 32),
                    residual=kivi_kw.get("residual_length", 128), page=kivi_kw.get("page_size", 128))


def _step_parameters(model) -> list[torch.Tensor]:
    """The parameters one decode step reads: every one but the input embedding table (unless the output head
    shares it)."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return [p for p in model.parameters() if p is not emb or emb.data_ptr() == head.data_ptr()]


def weight_read_bytes(model) -> int:
    """Bytes of the weights one decode step reads."""
    return sum(p.numel() * p.element_size() for p in _step_parameters(model))


def decode_flops(model) -> tuple[float, float]:
    """(FLOPs of one decode row through the weights: 2 x the parameters a step reads; FLOPs per cached token of
    one row's attention: 4 x layers x query heads x head_dim, scores and values)."""
    params = sum(p.numel() for p in _step_parameters(model))
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2.0 * params, 4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim


# -- model, prompts, tokenizer ------------------------------------------------------------------------
def build_model(shape: dict, device: torch.device):
    """Random bf16 model built on `device` (Llama unless the shape names another `model_type`: "mistral"),
    attention through the "kivi" hook, no EOS (ignore_eos)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    import kivi  # noqa: F401  (registers the "kivi" attention function)

    shape = dict(shape)
    model_type = shape.pop("model_type", "llama")
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}
    if model_type not in classes:
        raise ValueError(f"build_model: model_type must be one of {sorted(classes)}, got {model_type!r}")
    config_class, model_class = classes[model_type]
    cfg = config_class(**shape, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "kivi"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = model_class(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.eval().requires_grad_(False)
    gen = model.generation_config
    gen.eos_token_id = gen.bos_token_id = gen.pad_token_id = None
    if model.config._attn_implementation != "kivi" or next(model.parameters()).dtype != torch.bfloat16:
        raise RuntimeError(f"model built with attention {model.config._attn_implementation!r}, "
                           f"dtype {next(model.parameters()).dtype}")
    return model


@dataclass
class Prompt:
    ids: list[int]
    new_tokens: int


def make_prompts(workload: str, spec: tuple, n: int, seed: int, vocab: int) -> list[Prompt]:
    """Seeded random token ids (the same for every system and, when vocab >= 32000, every model)."""
    prompt_len, new = spec
    g = torch.Generator().manual_seed(seed * 1009 + ord(workload))
    ids = torch.randint(0, min(vocab, 32000), (n, prompt_len), generator=g).tolist()
    if isinstance(new, tuple):
        news = torch.randint(new[0], new[1] + 1, (n,), generator=g).tolist()
    else:
        news = [new] * n
    return [Prompt(i, k) for i, k in zip(ids, news, strict=True)]


class StubTokenizer:
    """What the engine needs of a tokenizer; counts the finished sequences it is asked to decode."""

    eos_token_id = None

    def __init__(self) -> None:
        self.finished = self.finished_tokens = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.finished += 1
        self.finished_tokens += len(ids)
        return ""


# -- memory helpers -------------------------------------------------------------------------------------
def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def allocated_gib(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated(device) / GiB if device.type == "cuda" else None


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def set_cap(cap_gib: float, device: torch.device) -> None:
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GiB / total), torch.cuda.current_device())


def probe_parser(doc: str, prompts: int, new_tokens: int) -> argparse.ArgumentParser:
    """The flags every engine probe takes (step_gap, prefill_gap): prompts, their length and new tokens, the memory
    cap, the CPU smoke mode and the output file; the caller adds its system flag."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=prompts)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=new_tokens)
    p.add_argument("--cap-gib", type=float, default=40.0)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU (reference kernels)")
    p.add_argument("--out", default=None)
    return p


def probe_model(args: argparse.Namespace):
    """(model, device, cuda) of a probe: the Llama-2-7B shape on the GPU under --cap-gib, or TINY on the CPU with
    --cpu-smoke."""
    cuda = not args.cpu_smoke
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        set_cap(args.cap_gib, device)
    return build_model(MODELS["llama2-7b"] if cuda else TINY, device), device, cuda
