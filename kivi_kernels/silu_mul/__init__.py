"""SiLU-and-multiply of a fused gate/up product (the SwiGLU MLP's act_fn(gate) * up, one kernel)."""

from . import ops, reference
from .ops import silu_mul

__all__ = ["ops", "reference", "silu_mul"]
