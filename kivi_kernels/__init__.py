"""Kernel ops: each has a Triton launcher and a PyTorch reference with the same signature.

`get_ops(backend)` is the one switch that picks the implementation for a whole model.
"""

from __future__ import annotations

import importlib
import os

BACKENDS = ("triton", "reference")

# op name -> module that defines it (the Triton launcher lives in <module>.ops, the reference in <module>.reference)
_OPS = {
    "store_prefill": "kivi_kernels.kv_store",
    "store_decode": "kivi_kernels.kv_store",
    "decode_attention": "kivi_kernels.decode_attention",
    "paged_decode_attention": "kivi_kernels.paged_attention",
    "store_paged_prefill": "kivi_kernels.paged_attention",
    "store_paged_decode": "kivi_kernels.paged_attention",
    "rms_norm": "kivi_kernels.rms_norm",
    "apply_rotary": "kivi_kernels.rotary",
    "silu_mul": "kivi_kernels.silu_mul",
}


class KernelOps:
    """The ops of one backend, imported on first use (so a model that never uses an op never imports it)."""

    def __init__(self, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend

    def __getattr__(self, name: str):
        if name not in _OPS:
            raise AttributeError(f"no kernel op named {name!r}")
        part = "ops" if self.backend == "triton" else "reference"
        fn = getattr(importlib.import_module(f"{_OPS[name]}.{part}"), name)
        setattr(self, name, fn)
        return fn


def get_ops(backend: str) -> KernelOps:
    """Every op for `backend` ("triton" or "reference")."""
    return KernelOps(backend)


def triton_usable(device_type: str) -> bool:
    """True when Triton kernels can run on tensors of `device_type` ("cuda", or "cpu" under the interpreter)."""
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
