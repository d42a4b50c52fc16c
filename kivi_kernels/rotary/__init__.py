"""Rotary position embedding of queries and keys (transformers' apply_rotary_pos_emb, fused)."""

from . import ops, reference
from .ops import apply_rotary

__all__ = ["apply_rotary", "ops", "reference"]
