"""Oracles of the GEMM family: the exact codes and scales dequantized in the dtype of the floating
inputs (float64 in the checks), multiplied, plus bias. Plain PyTorch.

Semantics: ``torch._scaled_mm`` (per-tensor and rowwise scales), DeepSeek-V3's 128 x 128 block
scales, the OCP Microscaling spec v1.0 (MXFP8: e4m3 elements, one e8m0 scale per 32 along K),
vLLM's W8A8 / W8A16 linears (``cutlass_scaled_mm``, ``scaled_int8_quant``, ``scaled_fp8_quant``).
"""

from __future__ import annotations

import torch

from lanekit.reference.numerics import finite_amax, quant_scale, quantize_groups, to_codes

BLOCK = 128
MX_GROUP = 32


def _finish(prod: torch.Tensor, bias, out_dtype) -> torch.Tensor:
    if bias is not None:
        prod = prod + bias.to(prod.dtype)
    return prod


def _expand_block(scale: torch.Tensor, rows: int, cols: int, br: int, bc: int) -> torch.Tensor:
    return scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


def dequant_a(a, scale_a, scheme: str) -> torch.Tensor:
    """a (M, K) codes times its scales, float64."""
    a = a.to(torch.float64)
    M, K = a.shape
    s = scale_a.to(torch.float64)
    if scheme == "block":
        return a * _expand_block(s, M, K, 1, BLOCK)
    if scheme == "mx":
        return a * _expand_block(e8m0(scale_a), M, K, 1, MX_GROUP)
    return a * s.reshape(-1, 1)           # (1,) per tensor or (M, 1) per row


def dequant_b(b, scale_b, scheme: str) -> torch.Tensor:
    """b (K, N) codes times its scales, float64."""
    b = b.to(torch.float64)
    K, N = b.shape
    s = scale_b.to(torch.float64)
    if scheme == "block":
        return b * _expand_block(s, K, N, BLOCK, BLOCK)
    if scheme == "mx":
        return b * _expand_block(e8m0(scale_b), K, N, MX_GROUP, 1)
    return b * s.reshape(1, -1)           # (1,) per tensor or (1, N) per column


def e8m0(e: torch.Tensor) -> torch.Tensor:
    """OCP MX e8m0 scale bytes (uint8) as float64: 2^(e - 127), 0xFF NaN."""
    v = torch.exp2(e.to(torch.float64) - 127.0)
    return torch.where(e == 255, torch.full_like(v, float("nan")), v)


def scale_scheme(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> str:
    """"tensor", "row" or "block" from the scales' shapes (checked by lanekit.gemm's api): one
    element each (per tensor); (M, 1) and (1, N) (rowwise; either may be per tensor); else
    128 x 128 blocks, (M, ceil(K/128)) and (ceil(K/128), ceil(N/128)). Where a row and a block
    layout have the same shape they mean the same scales."""
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return "tensor"
    M, N = a.shape[0], b.shape[1]
    row_a = scale_a.numel() == 1 or tuple(scale_a.shape) == (M, 1)
    row_b = scale_b.numel() == 1 or tuple(scale_b.shape) == (1, N)
    return "row" if row_a and row_b else "block"


def scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, scheme=None):
    """(a * scale_a) @ (b * scale_b) + bias in float64, a (M, K), b (K, N); the scheme from the
    scales' shapes unless given."""
    scheme = scheme or scale_scheme(a, b, scale_a, scale_b)
    return _finish(dequant_a(a, scale_a, scheme) @ dequant_b(b, scale_b, scheme), bias, out_dtype)


def int8_mm(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16):
    return scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, "row")


def mx_mm(a, a_scale, b, b_scale, out_dtype=torch.bfloat16):
    return scaled_mm(a, b, a_scale, b_scale, None, out_dtype, "mx")


def quantize_int8_rows(x: torch.Tensor, scale: torch.Tensor | None = None):
    """vLLM's ``scaled_int8_quant`` of the rows of x (R, K), every step one correctly rounded fp32
    operation: dynamic scale = amax / 127 per row (0 for an all-zero row, whose codes are 0; NaN
    for a row holding a NaN or inf, whose codes are 0 too: docs/semantics.md), or
    the given static (1,) scale; codes = round half to even of x / scale, clamped to [-128, 127].
    Returns (codes int8 (R, K), scale fp32 (R,) or (1,))."""
    x = x.to(torch.float32)
    if scale is not None:
        s = scale.to(torch.float32).reshape(1)
        return to_codes(x / s.reshape(1, 1), torch.int8), s
    amax = finite_amax(x, -1) if x.shape[1] else x.new_zeros(x.shape[0])
    s = quant_scale(amax, 127.0, 0.0)          # NaN (codes 0) for a row holding a NaN or inf
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.where(s.reshape(-1, 1) > 0, to_codes(x / safe.reshape(-1, 1), torch.int8),
                        torch.zeros_like(x, dtype=torch.int8))
    return codes, s


def w8a8_linear(x, weight, weight_scale, bias=None, x_scale=None):
    """x (..., K) quantized per token (or with the static x_scale), times the int8 weight (N, K)
    with its per-channel scale (N,), plus bias."""
    lead, K = x.shape[:-1], x.shape[-1]
    codes, s = quantize_int8_rows(x.reshape(x.shape[:-1].numel(), K), x_scale)
    y = scaled_mm(codes, weight.t(), s.reshape(-1, 1), weight_scale.reshape(1, -1), bias, x.dtype, "row")
    return y.reshape(*lead, weight.shape[0])


def fp8_linear(x, weight, weight_scale, bias=None, x_scale=None, block_size=None):
    """x (..., K) quantized to e4m3 per token (per 1 x 128 group with block_size, or with the
    static x_scale; reference.numerics.quantize_groups: scale amax / 448, 1 for a zero group),
    times the e4m3 weight (N, K) with its scale: per tensor (1,), per channel (N,), or per
    128 x 128 block (ceil(N/128), ceil(K/128)); plus bias."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(x.shape[:-1].numel(), K)
    if K == 0:      # nothing to quantize: the empty sum, plus bias
        y = _finish(x2.new_zeros(x2.shape[0], weight.shape[0], dtype=torch.float64), bias, x.dtype)
        return y.reshape(*lead, weight.shape[0])
    if block_size is not None:
        codes, s = quantize_groups(x2, BLOCK, torch.float8_e4m3fn)
        y = scaled_mm(codes, weight.t(), s, weight_scale.t(), bias, x.dtype, "block")
    else:
        codes, s = quantize_groups(x2, max(K, 1) if x_scale is None else None, torch.float8_e4m3fn, x_scale)
        y = scaled_mm(codes, weight.t(), s.reshape(-1, 1), weight_scale.reshape(1, -1), bias,
                      x.dtype, "row")
    return y.reshape(*lead, weight.shape[0])


def w8a16_linear(x, weight, weight_scale, bias=None):
    """x (..., K) times the int8 weight (N, K) dequantized per channel (N,), plus bias."""
    lead, K = x.shape[:-1], x.shape[-1]
    w = weight.to(torch.float64) * weight_scale.to(torch.float64).reshape(-1, 1)
    y = _finish(x.reshape(x.shape[:-1].numel(), K).to(torch.float64) @ w.t(), bias, x.dtype)
    return y.reshape(*lead, weight.shape[0])
