"""``hadamard_quantize_int8``: each row of x (R, K), zero-extended to KP = next power of two,
rotated by the normalized Walsh-Hadamard transform (H_KP / sqrt(KP), Sylvester order), then
per-row symmetric int8. One program per row holds its KP values; the transform is log2(KP)
butterfly stages (pairs h apart: a + b, a - b, h = 1, 2, 4, ...), each an fp32 add or subtract,
then one fp32 multiply by fp32(1 / sqrt(KP)): the oracle takes the same steps in the same order,
so the rotated values, and so the codes, are equal bit for bit. ``hadamard_dequantize_int8``:
codes times scale, the same transform (H is its own inverse up to the normalization), the
first K columns."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lanekit.common.numerics import finite_abs, quant_scale, quantize
from lanekit.quant import tuning
from lanekit.runtime.alloc import empty
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.tuning import arch_row

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()


@triton.jit
def _stage(x, KP: tl.constexpr, H: tl.constexpr):
    x3 = tl.permute(tl.reshape(x, (KP // (2 * H), 2, H)), (0, 2, 1))
    a, b = tl.split(x3)
    y = tl.permute(tl.join(a + b, a - b), (0, 2, 1))
    return tl.reshape(y, (KP,))


@triton.jit
def _wht(x, norm, KP: tl.constexpr, LOG2: tl.constexpr):
    for s in tl.static_range(LOG2):
        x = _stage(x, KP, 2 ** s)
    return x * norm


@triton.jit
def _hadamard_quant_kernel(X, Q, S, stride_xm, stride_xk, stride_qm, stride_qk, K, norm,
                           KP: tl.constexpr, LOG2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, KP).to(tl.int64)
    x = tl.load(X + row * stride_xm + offs * stride_xk, mask=offs < K, other=0.0).to(tl.float32)
    y = _wht(x, norm, KP, LOG2)
    amax = tl.max(finite_abs(y), axis=0)
    scale = quant_scale(amax, 127.0, 0.0)            # NaN (codes 0) for a row holding a NaN or inf
    q = quantize(tl.math.div_rn(y, tl.where(scale == 0, 1.0, scale)), 127.0, 1)
    q = tl.where(scale == 0, 0.0, q)
    tl.store(S + row, scale)
    tl.store(Q + row * stride_qm + offs * stride_qk, q.to(tl.int8))


@triton.jit
def _hadamard_dequant_kernel(Q, S, Y, stride_qm, stride_qk, stride_sm, stride_ym, stride_yk, K, norm,
                             KP: tl.constexpr, LOG2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, KP).to(tl.int64)
    q = tl.load(Q + row * stride_qm + offs * stride_qk).to(tl.float32)
    y = _wht(q * tl.load(S + row * stride_sm), norm, KP, LOG2)
    tl.store(Y + row * stride_ym + offs * stride_yk, y.to(Y.dtype.element_ty), mask=offs < K)


def padded_width(K: int) -> int:
    return 1 << max(K - 1, 0).bit_length()


def norm_of(KP: int) -> float:
    """fp32(1 / sqrt(KP)), as a Python float (exact in fp32)."""
    return float(torch.tensor(1.0 / math.sqrt(KP), dtype=torch.float32))


def hadamard_quantize_int8_fwd(*, x):
    R, K = x.shape
    KP = padded_width(K)
    codes = empty((R, KP), dtype=torch.int8, device=x.device)
    scale = empty((R, 1), dtype=torch.float32, device=x.device)
    if R:
        _hadamard_quant_kernel[(R,)](x, codes, scale, *x.stride(), *codes.stride(), K, norm_of(KP),
                                     KP=KP, LOG2=KP.bit_length() - 1,
                                     num_warps=arch_row(tuning.HADAMARD_WARPS, x.device))
    return codes, scale


def hadamard_dequantize_int8_fwd(*, codes, scale, K, output_dtype):
    R, KP = codes.shape
    y = empty((R, K), dtype=output_dtype, device=codes.device)
    if R and K:
        _hadamard_dequant_kernel[(R,)](codes, scale, y, *codes.stride(), scale.stride(0), *y.stride(), K,
                                       norm_of(KP), KP=KP, LOG2=KP.bit_length() - 1,
                                       num_warps=arch_row(tuning.HADAMARD_WARPS, codes.device))
    return y
