"""Oracles of the GEMM family: the exact codes and scales dequantized in the dtype of the floating
inputs (float64 in the checks), multiplied, plus bias. Plain PyTorch.

Semantics: ``torch._scaled_mm`` (per-tensor and rowwise scales), DeepSeek-V3's 128 x 128 block
scales, the OCP Microscaling spec v1.0 (MXFP8: e4m3 elements, one e8m0 scale per 32 along K),
vLLM's W8A8 / W8A16 linears (``cutlass_scaled_mm``, ``scaled_int8_quant``, ``scaled_fp8_quant``);
the 4-bit weight-only linears: AWQ's and GPTQ's int4 checkpoints (AutoAWQ's ``WQLinear_GEMM``,
AutoGPTQ's ``QuantLinear``) and OCP MXFP4 in gpt-oss's layout (docs/semantics.md, "4-bit weights").
"""

from __future__ import annotations

import torch

from lanekit.reference.numerics import e2m1, finite_amax, quant_scale, quantize_groups, to_codes, unpack_int4
from lanekit.reference.quant import dequantize_w4a4, quantize_w4a4_act

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


# ---- 4-bit weights ----

GPTQ_ZERO_OFFSET = 1    # GPTQ checkpoints store zero - 1 (AutoGPTQ's pack: ``zeros -= 1``)
SYMMETRIC_ZERO = 8      # zeros=None: the midpoint of 0..15


def w4_weight(qweight, scales, zeros, group_size, layout, g_idx=None) -> torch.Tensor:
    """The weight W (K, N) of an AWQ or GPTQ int4 checkpoint, in scales' dtype (exact in float64):
    W[k, n] = (q[k, n] - z[g, n]) * s[g, n] with g = g_idx[k] (default k // group_size).

    awq: qweight (K, N/8), columns in AWQ's nibble order; zeros (K/G, N/8) likewise, the zero
    points themselves. gptq: qweight (K/8, N), eight rows of K to an int32, row 8e + j in nibble
    j; zeros (K/G, N/8), column 8e + j in nibble j, holding zero - 1. zeros None: every zero 8.
    scales: (K/G, N)."""
    if layout == "awq":
        q = unpack_int4(qweight, dim=1, order="awq")
        z = None if zeros is None else unpack_int4(zeros, dim=1, order="awq").to(torch.int64)
    else:
        q = unpack_int4(qweight, dim=0)
        z = None if zeros is None else unpack_int4(zeros, dim=1).to(torch.int64) + GPTQ_ZERO_OFFSET
    K = q.shape[0]
    g = g_idx.to(torch.int64) if g_idx is not None else torch.arange(K, device=q.device) // group_size
    codes = q.to(torch.int64) - (SYMMETRIC_ZERO if z is None else z[g])
    return codes.to(scales.dtype) * scales[g]


def w4a16_linear(x, qweight, scales, zeros=None, group_size=128, layout="awq", g_idx=None, bias=None):
    """x (..., K) @ W (K, N) + bias, W the int4 checkpoint's weight (:func:`w4_weight`)."""
    lead, K = x.shape[:-1], x.shape[-1]
    w = w4_weight(qweight, scales.to(torch.float64), zeros, group_size, layout, g_idx)
    y = _finish(x.reshape(lead.numel(), K).to(torch.float64) @ w, bias, x.dtype)
    return y.reshape(*lead, w.shape[1])


def mxfp4_weight(w_fp4, w_scale, dtype=torch.float64) -> torch.Tensor:
    """The weight W (N, K) of OCP MXFP4 blocks in gpt-oss's layout: w_fp4 (N, K/2) uint8, two e2m1
    codes a byte, element 2i in the low nibble; w_scale (N, K/32) e8m0 bytes (0xFF: NaN)."""
    w = e2m1(unpack_int4(w_fp4, dim=1), dtype)
    return w * e8m0(w_scale).to(dtype).repeat_interleave(MX_GROUP, 1)


def mxfp4_linear(x, w_fp4, w_scale, bias=None):
    """x (..., K) @ W.T + bias, W (N, K) the MXFP4 weight (:func:`mxfp4_weight`)."""
    lead, K = x.shape[:-1], x.shape[-1]
    w = mxfp4_weight(w_fp4, w_scale)
    y = _finish(x.reshape(lead.numel(), K).to(torch.float64) @ w.t(), bias, x.dtype)
    return y.reshape(*lead, w.shape[0])


# ---- W4A8 and int4 x int4 (the int8 dot) ----

def w4a8_weight(qweight, scales, channel_scale, correction, group_size) -> torch.Tensor:
    """The weight W (N, K) of :func:`lanekit.quant.quantize_w4a8`'s tensors, float64 (exact):
    W[n, k] = channel[n] * scales[n, g] * (code[n, k] - 8) (+ correction[n, g]), g = k // group_size,
    codes two to a byte along K (element 2i in the low nibble)."""
    codes = unpack_int4(qweight, dim=1).to(torch.float64) - 8
    s = channel_scale.to(torch.float64).reshape(-1, 1) * scales.to(torch.float64)
    w = codes * s.repeat_interleave(group_size, 1)
    if correction is not None:
        w = w + correction.to(torch.float64).repeat_interleave(group_size, 1)
    return w


def w4a8_linear(x, qweight, scales, channel_scale, correction=None, group_size=128, bias=None):
    """x (..., K) quantized to int8 per token (:func:`quantize_int8_rows`, vLLM's
    ``scaled_int8_quant``), times W.T (:func:`w4a8_weight`), plus bias."""
    lead, K = x.shape[:-1], x.shape[-1]
    codes, s = quantize_int8_rows(x.reshape(lead.numel(), K))
    xq = codes.to(torch.float64) * s.to(torch.float64).reshape(-1, 1)
    w = w4a8_weight(qweight, scales, channel_scale, correction, group_size)
    y = _finish(xq @ w.t(), bias, x.dtype)
    return y.reshape(*lead, w.shape[0])


def int4_values(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Signed int4 values (-8..7, two's complement nibbles) of int8 or uint8 ``packed``, two a byte
    along ``dim`` (element 2i in the low nibble), as int8."""
    codes = unpack_int4(packed.view(torch.uint8), dim=dim).to(torch.int16)
    return torch.where(codes >= 8, codes - 16, codes).to(torch.int8)


def int4_mm(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16):
    """(A @ B) * scale_a * scale_b + bias for A (M, K) = int4_values(a, 1), B (K, N) =
    int4_values(b, 0); scales per tensor or rowwise as :func:`int8_mm` takes them."""
    return scaled_mm(int4_values(a, 1), int4_values(b, 0), scale_a, scale_b, bias, out_dtype, "row")


# ---- SVDQuant W4A4 with its low-rank branch ----

def svdquant_w4a4_linear(x, qweight, wscales, lora_down, lora_up, smooth=None, bias=None, dtype=None):
    """SVDQuant's linear (Li et al., ICLR 2025; nunchaku's ``SVDQW4A4Linear``), float64:
    y = Q4(x / smooth) @ Q4(W).T + (x @ lora_down) @ lora_up.T + bias, x (..., K), qweight
    (N, K / 2) and wscales (K / 64, N) from :func:`reference.quant.quantize_w4a4_wgt`, the
    activation quantized by :func:`reference.quant.quantize_w4a4_act` in ``dtype`` (x's format);
    the low-rank branch takes x unsmoothed (nunchaku's ``lora_down`` has the smoothing folded in);
    lora_down (K, R), lora_up (N, R)."""
    lead, K = x.shape[:-1], x.shape[-1]
    N = qweight.shape[0]
    x2 = x.reshape(lead.numel(), K).to(torch.float64)
    if K == 0:
        y = x2.new_zeros(x2.shape[0], N)
    else:
        qa, sa = quantize_w4a4_act(x2, smooth, dtype or x.dtype)
        y = dequantize_w4a4(qa, sa) @ dequantize_w4a4(qweight, wscales).t()
    y = y + (x2 @ lora_down.to(torch.float64)) @ lora_up.to(torch.float64).t()
    return _finish(y, bias, x.dtype).reshape(*lead, N)
