"""The "kivi" attention function, registered with transformers' attention interface.

Prefill runs PyTorch SDPA on the full-precision keys and values, then stores them in the cache;
decode reads the packed cache with the decode-attention kernel. Layers whose cache is not a
KIVI cache fall through to plain SDPA.
"""

from __future__ import annotations

import torch
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
    if mode == "prefill":
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                     scaling=scaling, **kwargs)
        layer.cache.store_prefill(layer, key, value, attention_mask)
        return out
    out = layer.cache.attend_decode(layer, query[:, :, 0], scaling)  # [B, Hq, D]
    return out.unsqueeze(1), None


AttentionInterface.register("kivi", kivi_attention_forward)
AttentionMaskInterface.register("kivi", sdpa_mask)
