"""Quantize and dequantize kernels of rows (R, C), any strides, int64 offsets:

- ``_amax_kernel``: the per-tensor dynamic scale's first pass, one program per row, the row's
  absmax folded into one fp32 with ``tl.atomic_max`` (amax >= 0: the max is order-free; a NaN or
  inf counts as +inf, which the atomic max keeps where it would drop a NaN).
- ``_quantize_kernel``: program (row, group): the group's absmax (dynamic), scale = amax / qmax
  (``div_rn``: correctly rounded), codes = div_rn(x, scale) saturated and rounded half to even
  (``common.numerics.quantize``), stored with the scale.
- ``_dequantize_kernel``: program (row, group): codes times the scale in fp32, rounded once to
  the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.common.numerics import cast_codes, finite_abs, quant_scale, quantize
from lanekit.quant import tuning
from lanekit.runtime.alloc import empty
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.tuning import arch_row

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@triton.jit
def _amax_kernel(X, AMAX, stride_xm, stride_xk, C, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK):
        x = tl.load(X + row * stride_xm + (c0 + offs) * stride_xk, mask=offs < C - c0, other=0.0)
        acc = tl.maximum(acc, finite_abs(x.to(tl.float32)))
    tl.atomic_max(AMAX, tl.max(acc, axis=0))      # +inf for a NaN or inf: an atomic max keeps it


@triton.jit
def _codes(x, scale, Q, QMAX: tl.constexpr, INT8: tl.constexpr):
    """The codes of fp32 x with its scale, in Q's dtype: div_rn(x, scale) saturated and rounded half
    to even; int8 codes are 0 wherever the scale is 0."""
    if INT8:
        q = quantize(tl.math.div_rn(x, tl.where(scale == 0, 1.0, scale)), QMAX, 1)
        q = tl.where(scale == 0, 0.0, q)
    else:
        q = quantize(tl.math.div_rn(x, scale), QMAX, 2)
    return cast_codes(q, Q.dtype.element_ty, 1 if INT8 else 2)


@triton.jit
def _quantize_kernel(X, Q, S, AMAX, stride_xm, stride_xk, stride_qm, stride_qk, stride_sm, stride_sk,
                     C, group, QMAX: tl.constexpr, INT8: tl.constexpr, TENSOR: tl.constexpr,
                     STATIC: tl.constexpr, ZERO: tl.constexpr, BLOCK: tl.constexpr):
    """TENSOR: one scale (STATIC: S[0]; else from AMAX, stored by program (0, 0)); else the
    group's (STATIC: read from S[row, g]; else computed and stored there). An all-zero group's
    dynamic scale: 1 for fp8, 0 for int8 (int8 codes are 0 wherever the scale is 0); a group
    holding a NaN or inf: NaN, its codes fp8's NaN or int8's 0 (as a NaN x with a static scale)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    start = g * group
    end = tl.minimum(start + group, C)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    if STATIC:
        if TENSOR:
            scale = tl.load(S).to(tl.float32)
        else:
            scale = tl.load(S + row * stride_sm + g * stride_sk).to(tl.float32)
    elif TENSOR:
        amax = tl.load(AMAX)
        scale = quant_scale(amax, QMAX, ZERO)
        if (row == 0) & (g == 0):
            tl.store(S, scale)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(start, end, BLOCK):
            x = tl.load(X + row * stride_xm + (c0 + offs) * stride_xk, mask=offs < end - c0, other=0.0)
            acc = tl.maximum(acc, finite_abs(x.to(tl.float32)))
        amax = tl.max(acc, axis=0)
        scale = quant_scale(amax, QMAX, ZERO)          # NaN for a group holding a NaN or inf
        tl.store(S + row * stride_sm + g * stride_sk, scale)
    for c0 in range(start, end, BLOCK):
        mask = offs < end - c0
        x = tl.load(X + row * stride_xm + (c0 + offs) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        tl.store(Q + row * stride_qm + (c0 + offs) * stride_qk, _codes(x, scale, Q, QMAX, INT8), mask=mask)


@triton.jit
def _quantize_groups_kernel(X, Q, S, stride_xm, stride_xk, stride_qm, stride_qk, stride_sm, stride_sk, R, C, G,
                            QMAX: tl.constexpr, INT8: tl.constexpr, STATIC: tl.constexpr, ZERO: tl.constexpr,
                            GROUP: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr):
    """_quantize_kernel's group granularity (dynamic or static per-group scales, GROUP a power of
    two) over a [ROWS, GROUPS, GROUP] tile a program: the same elementwise steps and max, so the
    same bits."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)              # [ROWS]
    gs = tl.program_id(1).to(tl.int64) * GROUPS + tl.arange(0, GROUPS).to(tl.int64)            # [GROUPS]
    cols = gs[:, None] * GROUP + tl.arange(0, GROUP).to(tl.int64)[None, :]                    # [GROUPS, GROUP]
    row_ok = rows < R
    mask = row_ok[:, None, None] & (cols < C)[None, :, :]
    x = tl.load(X + rows[:, None, None] * stride_xm + cols[None, :, :] * stride_xk, mask=mask,
                other=0.0).to(tl.float32)                                                      # [ROWS, GROUPS, GROUP]
    s_ptrs = S + rows[:, None] * stride_sm + gs[None, :] * stride_sk
    s_mask = row_ok[:, None] & (gs < G)[None, :]
    if STATIC:
        scale = tl.load(s_ptrs, mask=s_mask, other=1.0).to(tl.float32)
    else:
        scale = quant_scale(tl.max(finite_abs(x), axis=2), QMAX, ZERO)   # NaN for a group holding a NaN or inf
        tl.store(s_ptrs, scale, mask=s_mask)
    tl.store(Q + rows[:, None, None] * stride_qm + cols[None, :, :] * stride_qk,
             _codes(x, scale[:, :, None], Q, QMAX, INT8), mask=mask)


@triton.jit
def _dequantize_kernel(Q, S, Y, stride_qm, stride_qk, stride_sm, stride_sk, stride_ym, stride_yk,
                       C, group, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    scale = tl.load(S + row * stride_sm + g * stride_sk)
    start = g * group
    end = tl.minimum(start + group, C)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    for c0 in range(start, end, BLOCK):
        mask = offs < end - c0
        q = tl.load(Q + row * stride_qm + (c0 + offs) * stride_qk, mask=mask).to(tl.float32)
        tl.store(Y + row * stride_ym + (c0 + offs) * stride_yk, (q * scale).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_groups_kernel(Q, S, Y, stride_qm, stride_qk, stride_sm, stride_sk, stride_ym, stride_yk, R, C, G,
                              GROUP: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr):
    """_dequantize_kernel by group (GROUP a power of two) over a [ROWS, GROUPS, GROUP] tile a
    program, as _quantize_groups_kernel: the same product and rounding, the same bits."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    gs = tl.program_id(1).to(tl.int64) * GROUPS + tl.arange(0, GROUPS).to(tl.int64)
    cols = gs[:, None] * GROUP + tl.arange(0, GROUP).to(tl.int64)[None, :]
    row_ok = rows < R
    mask = row_ok[:, None, None] & (cols < C)[None, :, :]
    scale = tl.load(S + rows[:, None] * stride_sm + gs[None, :] * stride_sk, mask=row_ok[:, None] & (gs < G)[None, :],
                    other=0.0)
    q = tl.load(Q + rows[:, None, None] * stride_qm + cols[None, :, :] * stride_qk, mask=mask).to(tl.float32)
    tl.store(Y + rows[:, None, None] * stride_ym + cols[None, :, :] * stride_yk,
             (q * scale[:, :, None]).to(Y.dtype.element_ty), mask=mask)


def _group_tile(G: int, device) -> tuple[int, int]:
    """(rows, groups) of a by-group program (QUANT_GROUP_TILE), no more groups than the row has."""
    rows, groups = arch_row(tuning.QUANT_GROUP_TILE, device)
    return rows, min(groups, triton.next_power_of_2(G))


def _tiled(granularity: str, group: int) -> bool:
    """Whether the by-group kernels of [rows, groups, group] tiles take it: a power-of-two group."""
    return granularity == "group" and group >= 16 and group & (group - 1) == 0


def _block(width: int, device) -> int:
    return min(arch_row(tuning.QUANT_BLOCK, device), triton.next_power_of_2(max(width, 16)))


def _layout(granularity, R, C, group_size):
    """(columns per program, programs per row)."""
    group = group_size if granularity == "group" else C
    return group, (triton.cdiv(C, group) if C else 0)


def quantize_fwd(*, x, dtype, scale, granularity, group_size):
    """Codes (R, C) in ``dtype`` and fp32 scales ((1,), (R, 1) or (R, G)) of x (R, C)."""
    R, C = x.shape
    device = x.device
    codes = empty((R, C), dtype=dtype, device=device)
    group, G = _layout(granularity, R, C, group_size)
    int8 = dtype == torch.int8
    zero = 0.0 if int8 else 1.0
    tensor = granularity == "tensor"
    warps = arch_row(tuning.QUANT_WARPS, device)
    if scale is not None:
        s = scale.to(torch.float32)
        amax = s
    elif tensor:
        s = empty((1,), dtype=torch.float32, device=device)
        amax = torch.zeros((1,), dtype=torch.float32, device=device)
        if R and C:
            _amax_kernel[(R,)](x, amax, *x.stride(), C, BLOCK=_block(C, device), num_warps=warps)
    else:
        s = empty((R, G if granularity == "group" else 1), dtype=torch.float32, device=device)
        amax = s
    s_strides = (0, 0) if tensor else s.stride()
    if R and C and _tiled(granularity, group):
        rows, groups = _group_tile(G, device)
        _quantize_groups_kernel[(triton.cdiv(R, rows), triton.cdiv(G, groups))](
            x, codes, s, *x.stride(), *codes.stride(), *s_strides, R, C, G,
            QMAX=QMAX[dtype], INT8=int8, STATIC=scale is not None, ZERO=zero, GROUP=group, ROWS=rows,
            GROUPS=groups, num_warps=warps)
    elif R and C:
        _quantize_kernel[(R, G)](
            x, codes, s, amax, *x.stride(), *codes.stride(), *s_strides, C, group,
            QMAX=QMAX[dtype], INT8=int8, TENSOR=tensor, STATIC=scale is not None, ZERO=zero,
            BLOCK=_block(min(group, C), device), num_warps=warps)
    elif scale is None:
        s.fill_(zero)      # nothing to measure: the all-zero convention
    return codes, s


def dequantize_fwd(*, codes, scale, granularity, group_size, output_dtype):
    R, C = codes.shape
    device = codes.device
    y = empty((R, C), dtype=output_dtype, device=device)
    group, G = _layout(granularity, R, C, group_size)
    s = scale.to(torch.float32)
    s_strides = (0, 0) if granularity == "tensor" else (s.stride(0), 0 if granularity == "token" else s.stride(1))
    if R and C and _tiled(granularity, group):
        rows, groups = _group_tile(G, device)
        _dequantize_groups_kernel[(triton.cdiv(R, rows), triton.cdiv(G, groups))](
            codes, s, y, *codes.stride(), *s_strides, *y.stride(), R, C, G, GROUP=group, ROWS=rows, GROUPS=groups,
            num_warps=arch_row(tuning.QUANT_WARPS, device))
    elif R and C:
        _dequantize_kernel[(R, G)](codes, s, y, *codes.stride(), *s_strides, *y.stride(), C, group,
                                   BLOCK=_block(min(group, C), device),
                                   num_warps=arch_row(tuning.QUANT_WARPS, device))
    return y
