"""Shared pieces of the fused-layer tests (test_fused_layers.py, test_silu_mul.py): the device they run on and a
small random transformers model."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_lm(model_type: str = "llama", dtype: torch.dtype = torch.float32, **config):
    """A seeded random causal LM of `model_type` (2 layers, hidden 64, 4/2 heads of 16, vocabulary 300, SDPA
    attention) on DEVICE in eval mode; `config` overrides or adds config fields (e.g. hidden_act)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=256,
                  attn_implementation="sdpa")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **dict(fields, **config)),
                                            dtype=dtype).to(DEVICE).eval()
