"""Reference KIVI quantization and bit packing (PyTorch, fp32 math). This file is the spec.

Quantization of one group of values x (G keys of one channel, or G channels of one token):
    mn, mx = min(x), max(x)                              # fp32
    scale  = ((mx - mn) / (2**bits - 1)).to(dtype)       # stored in the scale dtype
    zero   = mn.to(dtype)                                # stored in the scale dtype
    code   = clamp(floor((x - zero) * (1 / scale) + 0.5), 0, 2**bits - 1)   # 0 where scale == 0
    x_hat  = code * scale + zero
Codes are computed from the *stored* scale and zero, so x_hat is within half a step of x
(up to the rounding of zero and scale to the scale dtype: KiviConfig.scale_dtype). fp16 scales saturate:
a group's min and max clamp to +-65,504 first, so values past it (a bf16 cache's outliers) code to the ends.

Packing: 32 // bits consecutive codes along the packed dimension share one int32 word; code i of
a word sits in bits [i * bits, (i + 1) * bits).
"""

from __future__ import annotations

import torch


def codes_per_word(bits: int) -> int:
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2 or 4, got {bits!r}")
    return 32 // bits


FP16_MAX = 65504.0  # scales and zeros stored in fp16 saturate here (a bf16 cache's keys may go further)


def expected_scale_dtype(scale: torch.Tensor, cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype launchers check scales and zero points against: the cache's or fp16 (KiviConfig.scale_dtype),
    whichever `scale` has; anything else is checked against the cache's, which the error then names."""
    scale_dtype = getattr(scale, "dtype", None)
    return scale_dtype if scale_dtype in (cache_dtype, torch.float16) else cache_dtype


def quantize_groups(
    x: torch.Tensor, bits: int, group_size: int, dim: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uniform quantization in groups of `group_size` along `dim`.

    x: [..., N, ...] with N % group_size == 0 at `dim`.
    Returns codes (int32, same shape as x), scale and zero ([..., N // group_size, ...], `dtype`,
    default x.dtype).
    """
    dtype = dtype or x.dtype
    dim = dim % x.dim()
    n = x.shape[dim]
    if n % group_size:
        raise ValueError(f"size {n} at dim {dim} is not a multiple of group_size={group_size}")
    xf = x.float().unflatten(dim, (n // group_size, group_size))  # [..., N/G, G, ...]
    mn = xf.amin(dim=dim + 1, keepdim=True)
    mx = xf.amax(dim=dim + 1, keepdim=True)
    if dtype == torch.float16:  # saturate: a group past fp16's range keeps a finite scale and zero
        mn, mx = mn.clamp(-FP16_MAX, FP16_MAX), mx.clamp(-FP16_MAX, FP16_MAX)
    qmax = 2**bits - 1
    # divide by a tensor: on CUDA, torch turns division by a Python number into a multiplication by
    # its reciprocal, which rounds differently from the kernels' true division
    scale = ((mx - mn) / torch.tensor(float(qmax), device=x.device)).to(dtype)
    zero = mn.to(dtype)
    scale_f, zero_f = scale.float(), zero.float()
    inv = torch.where(scale_f > 0, 1.0 / scale_f, torch.zeros_like(scale_f))
    codes = torch.floor((xf - zero_f) * inv + 0.5).clamp_(0, qmax).to(torch.int32)
    return codes.flatten(dim, dim + 1), scale.squeeze(dim + 1), zero.squeeze(dim + 1)


def dequantize_groups(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, dim: int
) -> torch.Tensor:
    """Inverse of quantize_groups, in fp32: codes [..., N, ...], scale/zero [..., N/G, ...]."""
    dim = dim % codes.dim()
    grouped = codes.float().unflatten(dim, (-1, group_size))  # [..., N/G, G, ...]: scale/zero broadcast over G
    return (grouped * scale.float().unsqueeze(dim + 1) + zero.float().unsqueeze(dim + 1)).flatten(dim, dim + 1)


def pack_codes(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) along `dim` into int32 words: [.., N, ..] -> [.., N*bits/32, ..]."""
    per_word = codes_per_word(bits)
    dim = dim % codes.dim()
    n = codes.shape[dim]
    if n % per_word:
        raise ValueError(f"size {n} at dim {dim} is not a multiple of {per_word} codes per word")
    c = codes.to(torch.int64).unflatten(dim, (n // per_word, per_word))
    shape = [1] * c.dim()
    shape[dim + 1] = per_word
    shifts = (torch.arange(per_word, device=codes.device) * bits).view(shape)
    words = (c << shifts).sum(dim=dim + 1)  # < 2**32, fits int64
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of pack_codes: int32 [.., W, ..] -> int32 codes [.., W * 32/bits, ..]."""
    per_word = codes_per_word(bits)
    dim = dim % packed.dim()
    w = packed.to(torch.int32).unsqueeze(dim + 1)
    shape = [1] * w.dim()
    shape[dim + 1] = per_word
    shifts = (torch.arange(per_word, device=packed.device, dtype=torch.int32) * bits).view(shape)
    codes = (w >> shifts) & (2**bits - 1)  # arithmetic shift: the mask keeps exactly the code's bits
    return codes.flatten(dim, dim + 1)


# Page-level layout (one head of one page, PAGE tokens, D channels):
#   keys:   codes [PAGE * k_bits / 32, D] packed along tokens; scale/zero [PAGE / G, D]
#   values: codes [PAGE, D * v_bits / 32] packed along channels; scale/zero [PAGE, D / G]
def quantize_keys(
    k: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel key quantization. k: [..., T, D] -> codes [..., T*bits/32, D], scale/zero [..., T/G, D]."""
    codes, scale, zero = quantize_groups(k, bits, group_size, dim=-2, dtype=dtype)
    return pack_codes(codes, bits, dim=-2), scale, zero


def quantize_values(
    v: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token value quantization. v: [..., T, D] -> codes [..., T, D*bits/32], scale/zero [..., T, D/G]."""
    codes, scale, zero = quantize_groups(v, bits, group_size, dim=-1, dtype=dtype)
    return pack_codes(codes, bits, dim=-1), scale, zero


def dequantize_keys(
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """[..., T*bits/32, D] codes + [..., T/G, D] scale/zero -> fp32 keys [..., T, D]."""
    return dequantize_groups(unpack_codes(k_codes, bits, dim=-2), k_scale, k_zero, group_size, dim=-2)


def dequantize_values(
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """[..., T, D*bits/32] codes + [..., T, D/G] scale/zero -> fp32 values [..., T, D]."""
    return dequantize_groups(unpack_codes(v_codes, bits, dim=-1), v_scale, v_zero, group_size, dim=-1)
