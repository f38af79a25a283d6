"""Numerics several families' oracles share: the codes of int8 and fp8 quantization (round half to
even, clamped), per-row symmetric quantization, and exact power-of-two scale helpers. Plain
PyTorch; the Triton counterparts are in ``lanekit.common.numerics``."""

from __future__ import annotations

import torch

QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def to_codes(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 x (already divided by its scale) as ``dtype`` codes: rounded to nearest, ties to even,
    clamped to the format's range (int8: [-128, 127]; e4m3: +-448, the cast rounding)."""
    if dtype == torch.int8:
        return torch.round(x).clamp(-128, 127).to(torch.int8)   # torch.round: ties to even
    return x.clamp(-QUANT_MAX[dtype], QUANT_MAX[dtype]).to(dtype)  # the cast rounds ties to even


def quantize_per_head(v: torch.Tensor, dtype: torch.dtype):
    """Per-(token, head) symmetric quantization of float32 v (..., D): scale = amax / qmax (1 when
    the row is all zero), codes = :func:`to_codes` of v / scale. Every step is one correctly
    rounded fp32 operation. Returns (codes in ``dtype``, scale fp32 (...))."""
    amax = v.abs().amax(-1)
    # divided by tensors: PyTorch's CUDA kernels multiply by the reciprocal of a Python scalar
    # divisor, which is not the correctly rounded quotient
    qmax = torch.full_like(amax, QUANT_MAX[dtype])
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return to_codes(v / scale.unsqueeze(-1), dtype), scale


def unit_exponent(m: torch.Tensor) -> torch.Tensor:
    """The k in [-126, 126] for which m * 2^k lies in [1, 2), for fp32 m >= 0, from m's exponent
    bits: k = 127 - e for the biased exponent e, clamped (k = 126 for 0 and subnormal m, -126 for
    m >= 2^126 and NaN). int32."""
    e = (m.view(torch.int32) >> 23) & 0xFF
    return torch.where(e == 0, 126, (127 - e).clamp(-126, 126)).to(torch.int32)


def power_of_two(k: torch.Tensor) -> torch.Tensor:
    """2^k in fp32 for int32 k in [-126, 127], from its exponent bits (exact)."""
    return ((k + 127) << 23).to(torch.int32).view(torch.float32)
