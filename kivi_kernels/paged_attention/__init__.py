"""Full-precision paged baseline: decode attention over [N, H, P, D] pools and their scatter stores."""

from . import reference
from .ops import paged_decode_attention, store_paged_decode, store_paged_prefill

__all__ = ["paged_decode_attention", "store_paged_decode", "store_paged_prefill", "reference"]
