"""Kernel ops: each has a Triton launcher and a PyTorch reference with the same signature.

`get_ops(backend)` is the one switch that picks the implementation for a whole model.
"""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

BACKENDS = ("triton", "reference")

# op name -> module that defines it (the Triton launcher lives in <module>.ops, the reference in <module>.reference)
_OPS = {
    "store_prefill": "kernels.kv_store",
    "store_decode": "kernels.kv_store",
    "decode_attention": "kernels.decode_attention",
    "paged_decode_attention": "kernels.paged_attention",
    "store_paged_prefill": "kernels.paged_attention",
    "store_paged_decode": "kernels.paged_attention",
}


def get_ops(backend: str) -> SimpleNamespace:
    """Return a namespace with every op for `backend` ("triton" or "reference")."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    part = "ops" if backend == "triton" else "reference"
    ops = {}
    for name, package in _OPS.items():
        module = importlib.import_module(f"{package}.{part}")
        ops[name] = getattr(module, name)
    return SimpleNamespace(backend=backend, **ops)


def triton_usable(device_type: str) -> bool:
    """True when Triton kernels can run on tensors of `device_type` ("cuda", or "cpu" under the interpreter)."""
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
