"""KV store ops (docs/design.md ops 1 and 2): Triton launchers and the PyTorch reference, same signatures."""

from . import ops, reference
from .ops import store_decode, store_prefill

__all__ = ["ops", "reference", "store_decode", "store_prefill"]
