"""decode_attention: one query token per row against the KIVI cache (packed pages + residual ring)."""

from . import reference
from .ops import decode_attention

__all__ = ["decode_attention", "reference"]
