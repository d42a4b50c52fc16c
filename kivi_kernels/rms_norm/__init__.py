"""RMSNorm (the Llama form: normalize in fp32, round to the input dtype, scale by the weight)."""

from . import ops, reference
from .ops import rms_norm

__all__ = ["ops", "reference", "rms_norm"]
