"""KIVI settings: one frozen, validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (2, 4)
BACKENDS = ("triton", "reference")
SCALE_DTYPES = ("float16", "model")


@dataclass(frozen=True)
class KiviConfig:
    """How the KV cache is quantized (KIVI, arXiv 2402.02750).

    k_bits / v_bits:  bits per key / value code (2 or 4).
    group_size:       G. Keys: G consecutive tokens of one channel share a scale and zero point.
                      Values: G consecutive channels of one token share a scale and zero point.
    residual_length:  R. The most recent tokens (between R-G+1 and R once a sequence is longer
                      than R) stay in full precision; older tokens move to the packed store one
                      whole group of G tokens at a time.
    page_size:        tokens per page of the packed store (a multiple of group_size).
    backend:          "triton" (GPU kernels, or the Triton interpreter) or "reference" (PyTorch).
    scale_dtype:      dtype of the scales and zero points of a 16-bit model's cache: "float16" (three more
                      mantissa bits than bf16, and the tensor-core decode kernel folds them in with packed
                      fp16 products; packed keys and values past fp16's +-65,504 saturate) or "model" (the
                      model's dtype). fp32 models keep fp32 scales either way.
    """

    k_bits: int = 2
    v_bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    page_size: int = 128
    backend: str = "triton"
    scale_dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("k_bits", "v_bits"):
            if getattr(self, name) not in SUPPORTED_BITS:
                raise ValueError(f"{name} must be one of {SUPPORTED_BITS}, got {getattr(self, name)!r}")
        g = self.group_size
        if not isinstance(g, int) or g < 16 or g & (g - 1):  # the kernels need a power of two
            raise ValueError(f"group_size must be a power of two >= 16, got {g!r}")
        if (
            not isinstance(self.residual_length, int)
            or self.residual_length < self.group_size
            or self.residual_length % self.group_size
        ):
            raise ValueError(
                f"residual_length must be a positive multiple of group_size={self.group_size}, "
                f"got {self.residual_length!r}"
            )
        if not isinstance(self.page_size, int) or self.page_size < self.group_size or (
            self.page_size % self.group_size
        ):
            raise ValueError(
                f"page_size must be a positive multiple of group_size={self.group_size}, got {self.page_size!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype!r}")

    def scale_dtype_for(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the scales and zero points in a cache whose residual tokens are `dtype`."""
        if self.scale_dtype == "float16" and dtype in (torch.float16, torch.bfloat16):
            return torch.float16
        return dtype

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError unless head_dim splits into whole value groups and whole code words."""
        if head_dim % self.group_size:
            raise ValueError(f"head_dim={head_dim} is not divisible by group_size={self.group_size}")

    def quantized_length(self, seq_len: int) -> int:
        """Tokens of a sequence of seq_len tokens that live in the packed store (a multiple of G)."""
        over = max(0, seq_len - self.residual_length)
        return -(-over // self.group_size) * self.group_size
