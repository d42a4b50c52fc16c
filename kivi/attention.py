"""The "kivi" attention function, registered with transformers' attention interface.

Prefill runs PyTorch SDPA on the full-precision keys and values, then stores them in the cache;
a chunk of a long prompt (the engine's chunked prefill) attends to its whole prefix under a bottom-right
causal mask; decode reads the packed cache with the decode-attention kernel. Layers whose cache is not a
KIVI cache fall through to plain SDPA.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


def kivi_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, T, D]
    key: torch.Tensor,  # [B, H, T, D]
    value: torch.Tensor,  # [B, H, T, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Returns attn_output [B, T, Hq, D] and no weights, like transformers' SDPA function."""
    step = getattr(key, "kivi_step", None)
    if step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    layer, mode = step
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if mode in ("prefill", "chunk"):
        if mode == "chunk":
            out = chunk_attention(query, key, value, scaling), None
        else:  # a padded batch (generate) is masked: no cuDNN plans per shape for it either
            with sdpa_kernel(_NO_CUDNN) if attention_mask is not None else nullcontext():
                out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                             scaling=scaling, **kwargs)
        layer.cache.store_prefill(layer, key, value, attention_mask)
        return out
    out = layer.cache.attend_decode(layer, query[:, :, 0], scaling)  # [B, Hq, D]
    return out.unsqueeze(1), None


# PyTorch sends masked attention to cuDNN on the H200 (torch 2.11), which builds an execution plan for each new
# shape: 50-120 ms a shape there, ~1 s for a chunked prompt of a new length (each chunk's prefix is a new shape),
# where the call itself takes ~0.1 s
_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """query [1, Hq, T, D] (the prefix's last T positions), key/value [1, H, S, D] (the whole prefix, S >= T,
    Hq a multiple of H) -> [1, T, Hq, D]. Query i sees keys 0 .. S - T + i: the causal mask aligned to the bottom
    right, which flash attention takes without a mask tensor (no [T, S] mask, no key/value repeated per head)."""
    if query.shape[0] != 1 or key.shape[2] < query.shape[2] or query.shape[1] % key.shape[1]:
        raise ValueError(f"chunk attention takes one row whose keys cover its queries, got query "
                         f"{tuple(query.shape)} and key {tuple(key.shape)}")
    with sdpa_kernel(_NO_CUDNN):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(
            query.shape[2], key.shape[2]), scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()


AttentionInterface.register("kivi", kivi_attention_forward)
AttentionMaskInterface.register("kivi", sdpa_mask)
