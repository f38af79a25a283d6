"""Triton kernels of the fused layers, and their launchers.

Three kernel families:
- ``_norm_fwd_kernel`` / ``_norm_bwd_kernel``: RMSNorm, LayerNorm and AdaLN, one row of N features
  per program (forward), with the fused residual (and gated residual) add. Rows up to a table's
  width are held in registers (one read of x); wider rows are walked in blocks, several passes.
- ``_rotary_kernel``: RoPE. ``_qk_norm_rope_fwd_kernel``: a per-head RMSNorm, RoPE and optionally
  a per-head quantization, of q and k in one launch; ``_rms_norm_rope_bwd_kernel`` its backward
  (without quantization), q and k in one launch too.
- ``_glu_fwd_kernel`` / ``_glu_bwd_kernel``: SwiGLU and GeGLU.

Every kernel computes in fp32 and casts once on the store (the quantized path's rare redone tiles
take their scales in fp64); offsets are int64, but in ``_qk_norm_rope_fwd_kernel``: int32 within a
row (its launcher checks they fit), and int32 for its rows too unless some tensor's offsets reach
2^31.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lanekit.common.numerics import (max_nan as _max_nan, power_of_two as _power_of_two, quantize as _quantize,
                                     reciprocal_power as _reciprocal_power, unit_exponent as _unit_exponent)

from lanekit.runtime import tuning
from lanekit.runtime.alloc import empty
from lanekit.runtime.lanes import triton_interpreted

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()


# --------------------------------------------------------------------------------------------
# Norms: y = norm(h) [* (offset + w) + b] [* (1 + scale) + shift], h = x, or residual + [gate *] x
# --------------------------------------------------------------------------------------------

@triton.jit
def _norm_load_h(X, R, GATE, x_row, r_row, m_row, cols, mask, stride_xn, stride_rn, stride_gn,
                 HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr):
    """(h, x) in fp32 for the columns ``cols`` of one row: h = x, or residual + [gate *] x."""
    # a gate row serves many rows: evict_last keeps it in L2 (evict_first on x and the residual,
    # read once, measured slower on the H200)
    x = tl.load(X + x_row + cols * stride_xn, mask=mask, other=0.0).to(tl.float32)
    h = x
    if HAS_GATE:
        h = h * tl.load(GATE + m_row + cols * stride_gn, mask=mask, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
    if HAS_RESIDUAL:
        h = h + tl.load(R + r_row + cols * stride_rn, mask=mask, other=0.0).to(tl.float32)
    return h, x


@triton.jit
def _norm_affine(xhat, W, B, SCALE, SHIFT, scale_row, shift_row, cols, mask, offset,
                 stride_w, stride_b, stride_sn, stride_tn, HAS_WEIGHT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_MOD: tl.constexpr):
    """xhat [* (offset + w)] [+ b] [* (1 + scale) + shift]."""
    y = xhat  # the parameters serve every row: evict_last keeps them in L2 beside the stream of x
    if HAS_WEIGHT:
        y = y * (offset + tl.load(W + cols * stride_w, mask=mask, other=0.0,
                                  eviction_policy="evict_last").to(tl.float32))
    if HAS_BIAS:
        y = y + tl.load(B + cols * stride_b, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    if HAS_MOD:
        scale = tl.load(SCALE + scale_row + cols * stride_sn, mask=mask, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
        shift = tl.load(SHIFT + shift_row + cols * stride_tn, mask=mask, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
        y = y * (1.0 + scale) + shift
    return y


@triton.jit
def _norm_fwd_kernel(
    X, R, GATE, SCALE, SHIFT, W, B, Y, H_OUT, MEAN, RSTD,
    stride_xm, stride_xn, stride_rm, stride_rn, stride_gm, stride_gn, stride_sm, stride_sn,
    stride_tm, stride_tn, stride_ym, stride_yn, stride_hm, stride_hn, stride_w, stride_b,
    N, rows_per_mod, eps, offset,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr,
    HAS_MOD: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr, TWO_PART_MEAN: tl.constexpr,
    MOD_ROWS: tl.constexpr,
):
    # Program p: rows [p * MOD_ROWS, (p + 1) * MOD_ROWS), all of one modulation group (the launcher
    # makes MOD_ROWS divide rows_per_mod): its row of scale and shift is loaded once for them.
    cols0 = tl.arange(0, BLOCK_N).to(tl.int64)
    if MOD_ROWS > 1:  # ONE_BLOCK and HAS_MOD only
        m0 = tl.program_id(0).to(tl.int64) * MOD_ROWS // rows_per_mod
        mod_mask = cols0 < N
        mod_scale = tl.load(SCALE + m0 * stride_sm + cols0 * stride_sn, mask=mod_mask, other=0.0)
        mod_shift = tl.load(SHIFT + m0 * stride_tm + cols0 * stride_tn, mask=mod_mask, other=0.0)
        mod_scale, mod_shift = mod_scale.to(tl.float32), mod_shift.to(tl.float32)
    for i in tl.static_range(MOD_ROWS):
        row = tl.program_id(0).to(tl.int64) * MOD_ROWS + i
        m = row // rows_per_mod                          # the row of scale, shift and gate
        x_row, r_row = row * stride_xm, row * stride_rm
        g_row, s_row, t_row = m * stride_gm, m * stride_sm, m * stride_tm
        y_row, h_row = row * stride_ym, row * stride_hm
        if ONE_BLOCK:  # the whole row in registers: x is read once
            mask = cols0 < N
            h, x = _norm_load_h(X, R, GATE, x_row, r_row, g_row, cols0, mask, stride_xn, stride_rn,
                                stride_gn, HAS_RESIDUAL, HAS_GATE)
            mean = 0.0
            mean_lo = 0.0
            if not IS_RMS:
                mean = tl.sum(h, axis=0) / N
                if TWO_PART_MEAN:  # only fp32 outputs can see the rounding of the mean
                    mean_lo = tl.sum(tl.where(mask, h - mean, 0.0), axis=0) / N
            hc = tl.where(mask, (h - mean) - mean_lo, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(hc * hc, axis=0) / N + eps)
            if MOD_ROWS > 1:  # the same steps as _norm_affine's, with scale and shift loaded once
                y = _norm_affine(hc * rstd, W, B, SCALE, SHIFT, s_row, t_row, cols0, mask, offset,
                                 stride_w, stride_b, stride_sn, stride_tn, HAS_WEIGHT, HAS_BIAS, False)
                y = y * (1.0 + mod_scale) + mod_shift
            else:
                y = _norm_affine(hc * rstd, W, B, SCALE, SHIFT, s_row, t_row, cols0, mask, offset,
                                 stride_w, stride_b, stride_sn, stride_tn, HAS_WEIGHT, HAS_BIAS, HAS_MOD)
            tl.store(Y + y_row + cols0 * stride_yn, y.to(Y.dtype.element_ty), mask=mask)
            if HAS_RESIDUAL:
                tl.store(H_OUT + h_row + cols0 * stride_hn, h.to(H_OUT.dtype.element_ty), mask=mask)
        else:  # blocks of the row, one pass for the mean, one for the variance, one to write
            mean = 0.0
            if not IS_RMS:
                acc = tl.zeros([BLOCK_N], dtype=tl.float32)
                for start in range(0, N, BLOCK_N):
                    cols = start + cols0
                    h, x = _norm_load_h(X, R, GATE, x_row, r_row, g_row, cols, cols < N, stride_xn,
                                        stride_rn, stride_gn, HAS_RESIDUAL, HAS_GATE)
                    acc += h
                mean = tl.sum(acc, axis=0) / N
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + cols0
                mask = cols < N
                h, x = _norm_load_h(X, R, GATE, x_row, r_row, g_row, cols, mask, stride_xn,
                                    stride_rn, stride_gn, HAS_RESIDUAL, HAS_GATE)
                hc = tl.where(mask, h - mean, 0.0)
                acc += hc * hc
                acc1 += hc
            mean_lo = 0.0
            if not IS_RMS:  # the corrected two-pass variance (Chan, Golub, LeVeque)
                mean_lo = tl.sum(acc1, axis=0) / N
            rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N - mean_lo * mean_lo + eps)
            for start in range(0, N, BLOCK_N):
                cols = start + cols0
                mask = cols < N
                h, x = _norm_load_h(X, R, GATE, x_row, r_row, g_row, cols, mask, stride_xn,
                                    stride_rn, stride_gn, HAS_RESIDUAL, HAS_GATE)
                y = _norm_affine(((h - mean) - mean_lo) * rstd, W, B, SCALE, SHIFT, s_row, t_row, cols, mask,
                                 offset, stride_w, stride_b, stride_sn, stride_tn, HAS_WEIGHT,
                                 HAS_BIAS, HAS_MOD)
                tl.store(Y + y_row + cols * stride_yn, y.to(Y.dtype.element_ty), mask=mask)
                if HAS_RESIDUAL:
                    tl.store(H_OUT + h_row + cols * stride_hn, h.to(H_OUT.dtype.element_ty), mask=mask)
        # the mean as an unevaluated sum mean + mean_lo: h - mean is exact where h is near the mean, so
        # ((h - mean) - mean_lo) keeps the fp32 accuracy that (h - (mean + mean_lo)) would lose on
        # rows whose mean is large beside their spread
        tl.store(MEAN + 2 * row, mean)
        tl.store(MEAN + 2 * row + 1, mean_lo)
        tl.store(RSTD + row, rstd)


@triton.jit
def _norm_bwd_terms(DY, X, R, GATE, SCALE, W, MEAN_ROW, MEAN_LO_ROW, RSTD_ROW, dy_row, x_row, r_row, g_row,
                    mod_row, cols, mask, offset, stride_dyn, stride_xn, stride_rn, stride_gn,
                    stride_mn, stride_w, HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr,
                    HAS_MOD: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """For columns ``cols`` of one row: (xhat, x, dy, g, dxhat). g is dy through the modulation
    (the gradient of xhat * w + b); dxhat is g through the weight (the gradient of xhat)."""
    h, x = _norm_load_h(X, R, GATE, x_row, r_row, g_row, cols, mask, stride_xn, stride_rn,
                        stride_gn, HAS_RESIDUAL, HAS_GATE)
    xhat = tl.where(mask, ((h - MEAN_ROW) - MEAN_LO_ROW) * RSTD_ROW, 0.0)
    dy = tl.load(DY + dy_row + cols * stride_dyn, mask=mask, other=0.0).to(tl.float32)
    g = dy
    if HAS_MOD:
        g = g * (1.0 + tl.load(SCALE + mod_row + cols * stride_mn, mask=mask, other=0.0).to(tl.float32))
    dxhat = g
    if HAS_WEIGHT:
        dxhat = g * (offset + tl.load(W + cols * stride_w, mask=mask, other=0.0).to(tl.float32))
    return xhat, x, dy, g, dxhat


@triton.jit
def _norm_bwd_kernel(
    DY, DH_OUT, X, R, GATE, SCALE, W, B, MEAN, RSTD,
    DX, DR, DW_PART, DB_PART, DSCALE_PART, DSHIFT_PART, DGATE_PART,
    stride_dym, stride_dyn, stride_dhm, stride_dhn, stride_xm, stride_xn, stride_rm, stride_rn,
    stride_gm, stride_gn, stride_mm, stride_mn, stride_dxm, stride_dxn, stride_drm, stride_drn,
    stride_w, stride_b, N, rows_per_mod, rows_per_program, offset,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_DH_OUT: tl.constexpr,
    HAS_GATE: tl.constexpr, HAS_MOD: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr,
):
    # Program (m, c) takes rows [c * rows_per_program, ...) of modulation group m (rows_per_mod
    # rows sharing one row of scale, shift and gate; all rows when there is no modulation). The
    # sums over rows (dw, db, dscale, dshift, dgate) go to this program's row of the *_PART
    # buffers (num_groups * num_chunks, N), summed on the host: no atomics, deterministic.
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    part = (m * tl.num_programs(1) + c) * N
    row_start = m * rows_per_mod + c * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, (m + 1) * rows_per_mod)
    g_row, mod_row = m * stride_gm, m * stride_mm
    cols0 = tl.arange(0, BLOCK_N).to(tl.int64)
    if ONE_BLOCK:
        mask = cols0 < N
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        dscale = tl.zeros([BLOCK_N], dtype=tl.float32)
        dshift = tl.zeros([BLOCK_N], dtype=tl.float32)
        dgate = tl.zeros([BLOCK_N], dtype=tl.float32)
    for row in range(row_start, row_end):
        mean = tl.load(MEAN + 2 * row)
        mean_lo = tl.load(MEAN + 2 * row + 1)
        rstd = tl.load(RSTD + row)
        dy_row, x_row, r_row = row * stride_dym, row * stride_xm, row * stride_rm
        if ONE_BLOCK:
            xhat, x, dy, g, dxhat = _norm_bwd_terms(
                DY, X, R, GATE, SCALE, W, mean, mean_lo, rstd, dy_row, x_row, r_row, g_row, mod_row,
                cols0, mask, offset, stride_dyn, stride_xn, stride_rn, stride_gn, stride_mn, stride_w,
                HAS_RESIDUAL, HAS_GATE, HAS_MOD, HAS_WEIGHT)
            c1 = tl.sum(dxhat * xhat, axis=0) / N
            c2 = 0.0
            if not IS_RMS:
                c2 = tl.sum(dxhat, axis=0) / N
        else:
            acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + cols0
                xhat, x, dy, g, dxhat = _norm_bwd_terms(
                    DY, X, R, GATE, SCALE, W, mean, mean_lo, rstd, dy_row, x_row, r_row, g_row, mod_row,
                    cols, cols < N, offset, stride_dyn, stride_xn, stride_rn, stride_gn,
                    stride_mn, stride_w, HAS_RESIDUAL, HAS_GATE, HAS_MOD, HAS_WEIGHT)
                acc1 += dxhat * xhat
                acc2 += dxhat
            c1 = tl.sum(acc1, axis=0) / N
            c2 = 0.0
            if not IS_RMS:
                c2 = tl.sum(acc2, axis=0) / N
        for start in range(0, N, BLOCK_N):
            cols = start + cols0
            if not ONE_BLOCK:  # reload this block (ONE_BLOCK keeps the row from above)
                mask = cols < N
                xhat, x, dy, g, dxhat = _norm_bwd_terms(
                    DY, X, R, GATE, SCALE, W, mean, mean_lo, rstd, dy_row, x_row, r_row, g_row, mod_row,
                    cols, mask, offset, stride_dyn, stride_xn, stride_rn, stride_gn, stride_mn, stride_w,
                    HAS_RESIDUAL, HAS_GATE, HAS_MOD, HAS_WEIGHT)
            dh = (dxhat - (xhat * c1 + c2)) * rstd
            if HAS_DH_OUT:  # the returned sum h was used downstream too
                dh += tl.load(DH_OUT + row * stride_dhm + cols * stride_dhn, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                tl.store(DR + row * stride_drm + cols * stride_drn, dh.to(DR.dtype.element_ty), mask=mask)
            dx = dh
            if HAS_GATE:
                dx = dh * tl.load(GATE + g_row + cols * stride_gn, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + row * stride_dxm + cols * stride_dxn, dx.to(DX.dtype.element_ty), mask=mask)
            # this row's terms of the sums over rows; y_pre = xhat * w + b, the modulation's input
            y_pre = xhat
            if HAS_WEIGHT:
                y_pre = xhat * (offset + tl.load(W + cols * stride_w, mask=mask, other=0.0).to(tl.float32))
            if HAS_BIAS:
                y_pre += tl.load(B + cols * stride_b, mask=mask, other=0.0).to(tl.float32)
            if ONE_BLOCK:
                dw += g * xhat
                db += g
                dscale += dy * y_pre
                dshift += dy
                dgate += dh * x
            else:  # accumulate in this program's partial row; its first row starts it
                # [BLOCK_N] bool, none on the first row; a where, since Triton 3.9's interpreter
                # widens a broadcast scalar comparison (mask & (row > row_start)) to int64
                reread = tl.where(row > row_start, mask, False)
                if HAS_WEIGHT:
                    p = DW_PART + part + cols
                    tl.store(p, tl.load(p, mask=reread, other=0.0) + g * xhat, mask=mask)
                if HAS_BIAS:
                    p = DB_PART + part + cols
                    tl.store(p, tl.load(p, mask=reread, other=0.0) + g, mask=mask)
                if HAS_MOD:
                    p = DSCALE_PART + part + cols
                    tl.store(p, tl.load(p, mask=reread, other=0.0) + dy * y_pre, mask=mask)
                    p = DSHIFT_PART + part + cols
                    tl.store(p, tl.load(p, mask=reread, other=0.0) + dy, mask=mask)
                if HAS_GATE:
                    p = DGATE_PART + part + cols
                    tl.store(p, tl.load(p, mask=reread, other=0.0) + dh * x, mask=mask)
    if ONE_BLOCK:
        if HAS_WEIGHT:
            tl.store(DW_PART + part + cols0, dw, mask=mask)
        if HAS_BIAS:
            tl.store(DB_PART + part + cols0, db, mask=mask)
        if HAS_MOD:
            tl.store(DSCALE_PART + part + cols0, dscale, mask=mask)
            tl.store(DSHIFT_PART + part + cols0, dshift, mask=mask)
        if HAS_GATE:
            tl.store(DGATE_PART + part + cols0, dgate, mask=mask)


def _rows(t: torch.Tensor | None, N: int) -> torch.Tensor | None:
    """t as (rows, N): a view when the leading dims allow one, else a copy."""
    return None if t is None else t.reshape(math.prod(t.shape[:-1]), N)


def _strides(t: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if t is None else (t.stride(0), t.stride(1))


def _stride(t: torch.Tensor | None) -> int:
    """The stride of a (N,) parameter (0 when absent, or when expanded from one value)."""
    return 0 if t is None else t.stride(0)


def _norm_config(device: torch.device, N: int, rows: int = 0) -> tuple[int, bool, int]:
    """(BLOCK_N, ONE_BLOCK, num_warps) for rows of N features."""
    cfg = tuning.norm_config(device, N)
    block = min(triton.next_power_of_2(max(N, 1)), cfg.max_block_n)
    return block, N <= block, cfg.num_warps


def norm_fwd(*, x, weight, bias, eps, offset=0.0, is_rms, residual=None, gate=None, scale=None,
             shift=None, rows_per_mod=1):
    """Launch the forward. x, residual: (..., N); gate, scale, shift: (rows // rows_per_mod, N).
    Returns (y like x, h like x or None, mean (rows,) fp32, rstd (rows,) fp32)."""
    N = x.shape[-1]
    x2, r2 = _rows(x, N), _rows(residual, N)
    rows = x2.shape[0]
    y = empty(x.shape, dtype=x.dtype, device=x.device)
    h = empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    mean = empty((rows, 2), dtype=torch.float32, device=x.device)   # mean, and its remainder
    rstd = empty((rows,), dtype=torch.float32, device=x.device)
    if rows == 0 or N == 0:
        return y, h, mean, rstd
    y2, h2 = y.view(-1, N), (h.view(-1, N) if h is not None else None)
    BLOCK_N, one_block, num_warps = _norm_config(x.device, N)
    # rows sharing one row of scale and shift (AdaLN per batch entry) go MOD_ROWS to a program,
    # which loads that row once (up to MOD_ROWS times less to read beside x)
    mod_rows = 1
    if scale is not None and one_block:
        while mod_rows < tuning.NORM_MOD_ROWS and rows_per_mod % (2 * mod_rows) == 0:
            mod_rows *= 2
    _norm_fwd_kernel[(rows // mod_rows,)](
        x2, r2, gate, scale, shift, weight, bias, y2, h2, mean, rstd,
        *_strides(x2), *_strides(r2), *_strides(gate), *_strides(scale), *_strides(shift),
        *_strides(y2), *_strides(h2), _stride(weight), _stride(bias),
        N, rows_per_mod, eps, offset,
        IS_RMS=is_rms, HAS_RESIDUAL=residual is not None, HAS_GATE=gate is not None,
        HAS_MOD=scale is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        BLOCK_N=BLOCK_N, ONE_BLOCK=one_block, TWO_PART_MEAN=x.dtype == torch.float32,
        MOD_ROWS=mod_rows, num_warps=num_warps,
    )
    return y, h, mean, rstd


def norm_bwd(*, dy, dh_out, x, weight, bias, mean, rstd, offset=0.0, is_rms, residual=None,
             gate=None, scale=None, shift=None, rows_per_mod=1):
    """Launch the backward. Returns (dx, dresidual, dweight, dbias, dgate, dscale, dshift), None
    where the input is absent; the per-group gradients are (rows // rows_per_mod, N)."""
    N = x.shape[-1]
    x2, r2, dy2, dh2 = _rows(x, N), _rows(residual, N), _rows(dy, N), _rows(dh_out, N)
    rows = x2.shape[0]
    dx = empty(x.shape, dtype=x.dtype, device=x.device)
    dr = empty(residual.shape, dtype=residual.dtype, device=x.device) if residual is not None else None
    if rows == 0 or N == 0:  # nothing to differentiate: the parameters' gradients are zero
        def zeros(t):
            return torch.zeros_like(t) if t is not None else None
        return dx, dr, zeros(weight), zeros(bias), zeros(gate), zeros(scale), zeros(shift)
    has_mod = scale is not None
    groups = rows // rows_per_mod if (has_mod or gate is not None) else 1
    per_group = rows // groups
    BLOCK_N, one_block, num_warps = _norm_config(x.device, N)
    # enough programs to fill the GPU, each summing a run of rows of one group
    chunks = max(1, min(per_group, triton.cdiv(tuning.norm_bwd_programs(x.device), groups)))
    rows_per_program = max(1, triton.cdiv(per_group, chunks))
    chunks = max(1, triton.cdiv(per_group, rows_per_program))

    def partial(needed):
        return empty((groups * chunks, N), dtype=torch.float32, device=x.device) if needed else None

    parts = [partial(weight is not None), partial(bias is not None), partial(has_mod),
             partial(has_mod), partial(gate is not None)]
    dx2, dr2 = dx.view(-1, N), (dr.view(-1, N) if dr is not None else None)
    _norm_bwd_kernel[(groups, chunks)](
        dy2, dh2, x2, r2, gate, scale, weight, bias, mean, rstd, dx2, dr2, *parts,
        *_strides(dy2), *_strides(dh2), *_strides(x2), *_strides(r2), *_strides(gate),
        *_strides(scale), *_strides(dx2), *_strides(dr2), _stride(weight), _stride(bias),
        N, per_group, rows_per_program, offset,
        IS_RMS=is_rms, HAS_RESIDUAL=residual is not None, HAS_DH_OUT=dh_out is not None,
        HAS_GATE=gate is not None, HAS_MOD=has_mod, HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, ONE_BLOCK=one_block, num_warps=num_warps,
    )

    def total(p, like, per_group_sum):
        if p is None:
            return None
        p = p.view(groups, chunks, N).sum(1) if per_group_sum else p.sum(0)
        return p.reshape(like.shape).to(like.dtype)

    dw_p, db_p, ds_p, dsh_p, dg_p = parts
    return (dx, dr, total(dw_p, weight, False), total(db_p, bias, False), total(dg_p, gate, True),
            total(ds_p, scale, True), total(dsh_p, shift, True))


# --------------------------------------------------------------------------------------------
# RoPE, optionally after a per-head RMSNorm and before a per-(token, head) quantization
# --------------------------------------------------------------------------------------------

@triton.jit
def _rotary_tokens(B_IDX, offs_s, CU_SEQLENS, POS, SEQ_OFFSETS, seq_offset, S, stride_pb, stride_ps,
                   IS_VARLEN: tl.constexpr, HAS_POS_IDS: tl.constexpr,
                   HAS_OFFSET_TENSOR: tl.constexpr):
    """(token index along x's sequence dim, in-sequence mask, position) of the sequence indices
    offs_s of batch entry B_IDX; packed (varlen) inputs index tokens from the sequence's start."""
    if IS_VARLEN:
        start = tl.load(CU_SEQLENS + B_IDX).to(tl.int64)
        seqlen = tl.load(CU_SEQLENS + B_IDX + 1).to(tl.int64) - start
    else:
        start = 0
        seqlen = S
    in_seq = offs_s < seqlen
    tok = start + offs_s
    if HAS_POS_IDS:
        pos = tl.load(POS + B_IDX * stride_pb + tok * stride_ps, mask=in_seq, other=0).to(tl.int64)
    else:
        pos = offs_s
        if HAS_OFFSET_TENSOR:
            pos += tl.load(SEQ_OFFSETS + B_IDX).to(tl.int64)
        else:
            pos += seq_offset
    return tok, in_seq, pos


@triton.jit
def _rotary_pairs(offs_i, ROT_START, HALF, INTERLEAVED: tl.constexpr):
    """Feature indices (a, b) of rotary pair i: (i, i + HALF) NeoX, (2i, 2i + 1) interleaved."""
    if INTERLEAVED:
        return ROT_START + 2 * offs_i, ROT_START + 2 * offs_i + 1
    return ROT_START + offs_i, ROT_START + HALF + offs_i


@triton.jit
def _rotary_kernel(
    X, OUT, COS, SIN, POS, CU_SEQLENS, SEQ_OFFSETS,
    stride_xb, stride_xs, stride_xh, stride_xd, stride_ob, stride_os, stride_oh, stride_od,
    stride_cs, stride_cd, stride_ss, stride_sd, stride_pb, stride_ps, S, H, D, ROT_START, HALF,
    seq_offset,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_REST: tl.constexpr, INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
    WRITE_REST: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_POS_IDS: tl.constexpr,
    HAS_OFFSET_TENSOR: tl.constexpr,
):
    # One program: BLOCK_S tokens x BLOCK_H heads of one batch entry, as BLOCK_S * BLOCK_H rows of
    # D features (a token's heads are adjacent in memory, so the rows are too). Each row is
    # handled in three pieces: the rotary pairs' first members a, their second members b, and the
    # features outside the rotary range (HAS_REST), which pass through.
    b = tl.program_id(1).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_S * BLOCK_H)
    offs_s = tl.program_id(0).to(tl.int64) * BLOCK_S + offs_r // BLOCK_H
    h = tl.program_id(2).to(tl.int64) * BLOCK_H + offs_r % BLOCK_H
    tok, in_seq, pos = _rotary_tokens(b, offs_s, CU_SEQLENS, POS, SEQ_OFFSETS, seq_offset, S,
                                      stride_pb, stride_ps, IS_VARLEN, HAS_POS_IDS, HAS_OFFSET_TENSOR)
    row_mask = in_seq & (h < H)
    x_rows = (X + b * stride_xb + tok * stride_xs + h * stride_xh)[:, None]   # [ROWS, 1]
    o_rows = (OUT + b * stride_ob + tok * stride_os + h * stride_oh)[:, None]
    offs_i = tl.arange(0, BLOCK_HALF).to(tl.int64)
    da, db = _rotary_pairs(offs_i, ROT_START, HALF, INTERLEAVED)
    pair_mask = row_mask[:, None] & (offs_i < HALF)[None, :]                  # [ROWS, BLOCK_HALF]
    a = tl.load(x_rows + da[None, :] * stride_xd, mask=pair_mask, other=0.0).to(tl.float32)
    bb = tl.load(x_rows + db[None, :] * stride_xd, mask=pair_mask, other=0.0).to(tl.float32)
    cos = tl.load(COS + pos[:, None] * stride_cs + offs_i[None, :] * stride_cd, mask=pair_mask,
                  other=0.0).to(tl.float32)
    sin = tl.load(SIN + pos[:, None] * stride_ss + offs_i[None, :] * stride_sd, mask=pair_mask,
                  other=0.0).to(tl.float32)
    if CONJUGATE:
        sin = -sin
    ra = a * cos - bb * sin
    rb = bb * cos + a * sin
    tl.store(o_rows + da[None, :] * stride_od, ra.to(OUT.dtype.element_ty), mask=pair_mask)
    tl.store(o_rows + db[None, :] * stride_od, rb.to(OUT.dtype.element_ty), mask=pair_mask)
    if HAS_REST and WRITE_REST:
        offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
        is_rest = (offs_d < D) & ((offs_d < ROT_START) | (offs_d >= ROT_START + 2 * HALF))
        rest_mask = row_mask[:, None] & is_rest[None, :]                      # [ROWS, BLOCK_D]
        rest = tl.load(x_rows + offs_d[None, :] * stride_xd, mask=rest_mask, other=0.0)
        tl.store(o_rows + offs_d[None, :] * stride_od, rest.to(OUT.dtype.element_ty), mask=rest_mask)


# --------------------------------------------------------------------------------------------
# QK-norm: RMSNorm per head, RoPE, and optionally per-(token, head) quantization, of q and k in
# one launch
# --------------------------------------------------------------------------------------------

@triton.jit
def _pick(is_k, k_value, q_value):
    """k's value in a k program, q's in a q program (program-uniform scalars and pointers)."""
    return tl.where(is_k, k_value, q_value)


@triton.jit
def _to_f32(v):
    """v in fp32, exactly. bf16 is widened by moving its bits to the top of the word, one integer
    instruction an element: Triton's own conversion extracts a register's upper bf16 with a byte
    permute and then shifts it (two, on sm90: `python -m benchmarks.sass`)."""
    if v.dtype == tl.bfloat16:
        return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def _load_f32(ptr, mask, EVEN: tl.constexpr):
    if EVEN:
        return _to_f32(tl.load(ptr))
    return _to_f32(tl.load(ptr, mask=mask, other=0.0))


@triton.jit
def _per_feature(w):
    """fp32 w [N] as it is (w + -0.0 is w for every w, -0.0 and NaN included), computed where w's own
    layout holds it: a reduction is where Triton's layout pass stops moving work to the layout of
    a [rows, N] tile's columns. Without it, the work on a per-feature vector broadcast over the
    rows (w.to(f32) + offset) is done after the conversion, once for each of a thread's columns
    rather than once for each of the vector's elements it holds: 32 against 4 in the quantized
    q-and-k kernel's sm90 tile."""
    # -0.0 by its bits: a float constant -0.0 reaches Triton's IR as +0.0, and w + 0.0 turns -0.0
    # into +0.0
    negative_zero = tl.full(w.shape, -2147483648, tl.int32).to(tl.float32, bitcast=True)
    return tl.sum(tl.join(w, negative_zero), axis=1)


@triton.jit
def _store(ptr, value, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr, value)
    else:
        tl.store(ptr, value, mask=mask)


@triton.jit
def _square_sum(a, bb, rest, HAS_REST: tl.constexpr):
    """The fp32 sum over the features (axis 1) of the squares of a, bb [and rest], per row: a's and
    bb's squares added in each thread first (one reduction across threads, not two), fused
    multiply-adds asked for by name (the quantized launch turns off contraction)."""
    ss = tl.sum(tl.fma(bb, bb, a * a), axis=1)
    if HAS_REST:
        ss += tl.sum(rest * rest, axis=1)
    return ss


@triton.jit
def _mean(ss, D, BLOCK_D: tl.constexpr, POW2_D: tl.constexpr):
    """ss / D."""
    if POW2_D:  # dividing by a power of two is exact: a product
        return ss * (1.0 / BLOCK_D)                                  # D == BLOCK_D
    return ss / D


@triton.jit
def _abs_max(a, bb, rest, HAS_REST: tl.constexpr):
    """max |x| over the features (axis 1) of a, bb [and rest], per row; NaN where one is NaN (as
    torch.amax: the hardware's max would drop it)."""
    m = tl.reduce(_max_nan(tl.abs(a), tl.abs(bb)), 1, _max_nan)
    if HAS_REST:
        m = _max_nan(m, tl.reduce(tl.abs(rest), 1, _max_nan))
    return m


@triton.jit
def _qk_load_x(x_rows, da, db, offs_d, stride_xd, pair_mask, rest_mask, EVEN: tl.constexpr,
               HAS_REST: tl.constexpr):
    """(a, bb, rest) in fp32 of the rows x_rows in _qk_norm_rope_fwd_kernel: the rotary pairs' first
    and second members, and the features outside the rotary range (a placeholder without)."""
    a = _load_f32(x_rows + da[None, :] * stride_xd, pair_mask, EVEN)
    bb = _load_f32(x_rows + db[None, :] * stride_xd, pair_mask, EVEN)
    rest = a
    if HAS_REST:
        rest = _to_f32(tl.load(x_rows + offs_d[None, :] * stride_xd, mask=rest_mask, other=0.0))
    return a, bb, rest


@triton.jit
def _qk_weigh_rotate(a, bb, rest, W, stride_w, offset, da, db, offs_i, offs_d, is_rest, COS, SIN,
                     pos, stride_cs, stride_cd, stride_ss, stride_sd, pair_mask, HALF,
                     EVEN: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_REST: tl.constexpr):
    """(a * wa, bb * wb) rotated, and rest * w_rest, in _qk_norm_rope_fwd_kernel: the weights
    (offset + W) of the features a, bb and rest hold, then RoPE by cos and sin at the rows'
    positions; every step one rounded fp32 operation."""
    if HAS_WEIGHT:
        wa = _per_feature(_to_f32(tl.load(W + da * stride_w, mask=offs_i < HALF, other=0.0)) + offset)
        wb = _per_feature(_to_f32(tl.load(W + db * stride_w, mask=offs_i < HALF, other=0.0)) + offset)
        a = a * wa[None, :]
        bb = bb * wb[None, :]
        if HAS_REST:
            w_rest = _per_feature(_to_f32(tl.load(W + offs_d * stride_w, mask=is_rest, other=0.0)) + offset)
            rest = rest * w_rest[None, :]
    # cos and sin of a row's token, loaded for each of its heads (cache hits)
    cos = _load_f32(COS + pos[:, None] * stride_cs + offs_i[None, :] * stride_cd, pair_mask, EVEN)
    sin = _load_f32(SIN + pos[:, None] * stride_ss + offs_i[None, :] * stride_sd, pair_mask, EVEN)
    return a * cos - bb * sin, bb * cos + a * sin, rest


@triton.jit
def _prefetch_rows(rows, row_mask, n, stride, LINES: tl.constexpr, STEP: tl.constexpr,
                   LEVEL: tl.constexpr):
    """Asks for the cache lines of features [0, n) of each row (pointers [ROWS], rows with
    row_mask only) to be brought into LEVEL, "L1" or "L2", STEP features a line, LINES lines a
    row: PTX's prefetch, a hint that holds no register and reads nothing into one (NVIDIA only:
    runtime.tuning.ROTARY asks for it in NVIDIA rows alone)."""
    offs = tl.arange(0, LINES) * STEP
    ptrs = (rows[:, None] + offs[None, :] * stride).to(tl.int64, bitcast=True)
    mask = (row_mask[:, None] & (offs < n)[None, :]).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global." + LEVEL + " [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, mask], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _qk_tile(sb, hb, b, offs_r, POS, SEQ_OFFSETS, seq_offset, S, HQ, HK, q_head_blocks, stride_pb,
             stride_ps, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, ROWS_INT64: tl.constexpr,
             HAS_POS_IDS: tl.constexpr, HAS_OFFSET_TENSOR: tl.constexpr):
    """(is_k, token, head, position, row mask) of the rows offs_r of tile (sb, hb) in
    _qk_norm_rope_fwd_kernel: tokens [sb * BLOCK_S, ...) of batch entry b and head block hb of q,
    or for hb >= q_head_blocks head block hb - q_head_blocks of k."""
    is_k = hb >= q_head_blocks
    offs_s = sb.to(tl.int64 if ROWS_INT64 else tl.int32) * BLOCK_S + offs_r // BLOCK_H
    h = (hb - _pick(is_k, q_head_blocks, 0)) * BLOCK_H + offs_r % BLOCK_H
    tok, in_seq, pos = _rotary_tokens(b, offs_s, SEQ_OFFSETS, POS, SEQ_OFFSETS, seq_offset, S,
                                      stride_pb, stride_ps, False, HAS_POS_IDS, HAS_OFFSET_TENSOR)
    row_mask = in_seq & (h < _pick(is_k, HK, HQ))
    if ROWS_INT64:
        h = h.to(tl.int64)
    return is_k, tok, h, pos, row_mask


@triton.jit
def _qk_rows(is_k, K, Q, b, tok, h, stride_kb, stride_ks, stride_kh, stride_qb, stride_qs, stride_qh):
    """Pointers to the rows (b, tok, h) of k where is_k, else of q."""
    return (_pick(is_k, K, Q) + b * _pick(is_k, stride_kb, stride_qb)
            + tok * _pick(is_k, stride_ks, stride_qs) + h * _pick(is_k, stride_kh, stride_qh))


@triton.jit
def _qk_norm_rope_fwd_kernel(
    Q, K, Q_OUT, K_OUT, Q_W, K_W, Q_SCALE, K_SCALE, COS, SIN, POS, SEQ_OFFSETS,
    stride_qb, stride_qs, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
    stride_qw, stride_kw,
    stride_cs, stride_cd, stride_ss, stride_sd, stride_pb, stride_ps,
    S, HQ, HK, D, ROT_START, HALF, q_head_blocks, seq_offset, eps, offset, x_ahead,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_REST: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    QUANT: tl.constexpr, EVEN: tl.constexpr, ROT_ALL: tl.constexpr, POW2_D: tl.constexpr,
    HAS_POS_IDS: tl.constexpr, HAS_OFFSET_TENSOR: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    ROWS_INT64: tl.constexpr, PREFETCH_X: tl.constexpr, X_LINES: tl.constexpr, X_STEP: tl.constexpr,
    PREFETCH_ROPE: tl.constexpr, ROPE_LINES: tl.constexpr, ROPE_STEP: tl.constexpr,
):
    # Program (s * HEAD_BLOCKS + j, 0, b): tokens [s * BLOCK_S, ...) of batch entry b, and head
    # block j of q, or for j >= q_head_blocks head block j - q_head_blocks of k (one launch: the
    # small k part no longer runs alone at the tail of its own launch). A token block's head blocks
    # are adjacent programs, so the GPU starts them together: they read q's and k's rows of those
    # tokens, adjacent in memory, and the same rows of cos and sin (on the H200 RMSNorm + RoPE read
    # 3820 GB/s so, against 3620 with the token blocks of one head block adjacent). A tile is
    # BLOCK_S tokens x BLOCK_H heads of one batch entry, each (token, head) row of D features in
    # three pieces: the rotary pairs' first members a, their second members bb, and the features
    # outside the rotary range (rest).
    # QUANT: 0 none, 1 int8, 2 fp8 e4m3; then every step of the codes is one correctly rounded
    # fp32 operation (see reference.layers.qk_norm_rope_quant; the launcher turns off fused
    # multiply-adds).
    # EVEN: every row and pair of every tile exists (no masks).
    # row offsets in int64 only where a tensor's may pass 2^31 (ROWS_INT64; int32 saves ~20
    # instructions and registers)
    b = tl.program_id(2).to(tl.int64 if ROWS_INT64 else tl.int32)
    sb = tl.program_id(0) // HEAD_BLOCKS
    hb = tl.program_id(0) % HEAD_BLOCKS
    offs_r = tl.arange(0, BLOCK_S * BLOCK_H)                    # a token's heads are adjacent rows
    is_k, tok, h, pos, row_mask = _qk_tile(
        sb, hb, b, offs_r, POS, SEQ_OFFSETS, seq_offset, S, HQ, HK, q_head_blocks, stride_pb,
        stride_ps, BLOCK_S, BLOCK_H, ROWS_INT64, HAS_POS_IDS, HAS_OFFSET_TENSOR)
    x_rows = _qk_rows(is_k, K, Q, b, tok, h, stride_kb, stride_ks, stride_kh,
                      stride_qb, stride_qs, stride_qh)[:, None]
    stride_xd = _pick(is_k, stride_kd, stride_qd)
    if EVEN:   # every pair exists: the feature offsets are constants, folded into the addresses
        HALF = BLOCK_HALF
    if ROT_ALL:
        ROT_START = 0
    offs_i = tl.arange(0, BLOCK_HALF)        # offsets within a row in int32: see _inner_int32
    da, db = _rotary_pairs(offs_i, ROT_START, HALF, INTERLEAVED)
    pair_mask = row_mask[:, None] & (offs_i < HALF)[None, :]                       # [ROWS, BLOCK_HALF]
    offs_d = tl.arange(0, BLOCK_D)
    is_rest = (offs_d < D) & ((offs_d < ROT_START) | (offs_d >= ROT_START + 2 * HALF))
    rest_mask = row_mask[:, None] & is_rest[None, :]                                        # [ROWS, BLOCK_D]
    a, bb, rest = _qk_load_x(x_rows, da, db, offs_d, stride_xd, pair_mask, rest_mask, EVEN, HAS_REST)
    # Prefetches, issued once this tile's loads are: the lines of cos and sin into L1, for their
    # loads after the sum of squares (held in registers from here they cost 32 a thread and their
    # loads waited beside x's), and into L2 the rows of x of the same head block x_ahead token
    # blocks later (program pid + x_ahead * HEAD_BLOCKS along grid axis 0: the GPU starts it about
    # when this one ends), so that its loads find them there: the DRAM latency hidden without
    # registers (on the H200: runtime.tuning.ROTARY). Only its tokens differ from this tile's:
    # the rest of its addresses is this tile's, computed once.
    if PREFETCH_ROPE:
        _prefetch_rows(COS + pos * stride_cs, row_mask, HALF, stride_cd, ROPE_LINES, ROPE_STEP, "L1")
        _prefetch_rows(SIN + pos * stride_ss, row_mask, HALF, stride_sd, ROPE_LINES, ROPE_STEP, "L1")
    if PREFETCH_X:
        _, tok2, h2, _, mask2 = _qk_tile(
            sb + x_ahead, hb, b, offs_r, POS, SEQ_OFFSETS, seq_offset, S, HQ, HK, q_head_blocks,
            stride_pb, stride_ps, BLOCK_S, BLOCK_H, ROWS_INT64, False, HAS_OFFSET_TENSOR)
        _prefetch_rows(_qk_rows(is_k, K, Q, b, tok2, h2, stride_kb, stride_ks, stride_kh,
                                stride_qb, stride_qs, stride_qh), mask2, D, 1, X_LINES, X_STEP, "L2")
    ss = _square_sum(a, bb, rest, HAS_REST)                                                 # [ROWS]
    # the outputs (and scales) are contiguous (the launcher's contract): row (b, tok, h) of them
    # is row (b * S + tok) * H + h, one index for all, with no strides to pick
    row = (b * S + tok) * _pick(is_k, HK, HQ) + h
    W = _pick(is_k, K_W, Q_W)
    stride_w = _pick(is_k, stride_kw, stride_qw)
    # With QUANT the codes are those of u = RoPE(x * (offset + w)), without the norm: rstd, one
    # positive factor per row, divides out of n / scale (reference.layers.qk_norm_rope_quant). So
    # they depend on no sum, and the fp32 sum of squares serves the scale alone.
    if not QUANT:
        rstd = (1.0 / tl.sqrt(_mean(ss, D, BLOCK_D, POW2_D) + eps))[:, None]
        a = a * rstd
        bb = bb * rstd
        if HAS_REST:
            rest = rest * rstd
    ra, rb, rest = _qk_weigh_rotate(
        a, bb, rest, W, stride_w, offset, da, db, offs_i, offs_d, is_rest, COS, SIN, pos,
        stride_cs, stride_cd, stride_ss, stride_sd, pair_mask, HALF, EVEN, HAS_WEIGHT, HAS_REST)
    if QUANT:
        qmax = 127.0 if QUANT == 1 else 448.0     # a constant: no reciprocal of it at run time
        amax = _abs_max(ra, rb, rest, HAS_REST)                                              # [ROWS]
        # Rows whose max |u| lies outside [2^-100, 2^100) (all zero, tiny, huge or not finite)
        # take u from x * p instead, p a power of two that brings max |u| into [1, 2) (see the
        # oracle); rows whose sum of squares lies below 2^-100, or whose scale would not be a
        # normal fp32 number, their scale from fp64. All are rare, so the tile is redone, from x
        # reloaded (in the oracle too, row by row: p is 1 elsewhere).
        t = amax * tl.math.rsqrt(_mean(ss, D, BLOCK_D, POW2_D) + eps)        # scale * qmax, or inf
        redo = row_mask & ~((amax >= 2.0 ** -100) & (amax < 2.0 ** 100))
        slow = redo | (row_mask & ~((ss >= 2.0 ** -100) & (t >= qmax * 2.0 ** -126)
                                    & (t < qmax * 2.0 ** 127)))
        slow_tile = tl.max(slow.to(tl.int32), axis=0) > 0
        if slow_tile:
            a, bb, rest = _qk_load_x(x_rows, da, db, offs_d, stride_xd, pair_mask, rest_mask, EVEN,
                                     HAS_REST)
            # x * p_x, max |x| brought into [1, 2): its fp32 squares neither overflow nor lose
            # more than 2^-100 of the sum; p_x's square taken out again in fp64. (The scale is
            # compared by tolerance: no fp64 division, whose slow path spills.)
            k_x = _unit_exponent(_abs_max(a, bb, rest, HAS_REST))
            p_x = _power_of_two(k_x)
            inv_px = _reciprocal_power(p_x).to(tl.float64)
            ss_x = _square_sum(a * p_x[:, None], bb * p_x[:, None], rest * p_x[:, None], HAS_REST)
            rstd64 = tl.math.rsqrt(ss_x.to(tl.float64) * inv_px * inv_px * (1.0 / D) + eps)
            # p from max |u| where it is finite and nonzero (at most 2^125 / max |x|: x * p stays
            # finite), else from max |x|
            k = tl.where((amax > 0) & (amax < float("inf")),
                         tl.minimum(_unit_exponent(amax), k_x + 125), k_x)
            p = tl.where(redo, _power_of_two(k), 1.0)
            ra, rb, rest = _qk_weigh_rotate(
                a * p[:, None], bb * p[:, None], rest * p[:, None], W, stride_w, offset, da, db,
                offs_i, offs_d, is_rest, COS, SIN, pos, stride_cs, stride_cd, stride_ss, stride_sd,
                pair_mask, HALF, EVEN, HAS_WEIGHT, HAS_REST)
            amax = _abs_max(ra, rb, rest, HAS_REST)
            inv_p = _reciprocal_power(p).to(tl.float64)
            scale = (amax.to(tl.float64) * inv_p * rstd64 * (1.0 / qmax)).to(tl.float32)
            # u not finite even from x * p (inf or NaN in x, or weights that overflow it)
            scale = tl.where(amax < float("inf"), scale, float("nan"))
        else:
            scale = t * (1.0 / qmax)
        scale = tl.where(amax == 0, 1.0, scale)
        _store(_pick(is_k, K_SCALE, Q_SCALE) + row, scale, row_mask, EVEN)
        # one correctly rounded division per row, a product per element (an IEEE division per
        # element made this kernel compute-bound: about 30 instructions each on sm90), bounded so
        # that an all-zero row's is finite
        inv = tl.minimum(tl.math.div_rn(tl.full(amax.shape, qmax, tl.float32), amax), 2.0 ** 127)[:, None]
        # The clamp to the code range cannot act where max |u| lies in [2^-100, 2^100): |u| <= amax,
        # inv <= (qmax / amax)(1 + 2^-24), so |u * inv| rounded is at most qmax (1 + 2^-22), which
        # rounds to qmax at most (int8: 127.00003; e4m3: 448.0001, the next step up being 32 away).
        # Redone tiles clamp.
        if slow_tile:
            ra = _quantize(ra * inv, qmax, QUANT, True)
            rb = _quantize(rb * inv, qmax, QUANT, True)
            if HAS_REST:
                rest = _quantize(rest * inv, qmax, QUANT, True)
        else:
            ra = _quantize(ra * inv, qmax, QUANT, False)
            rb = _quantize(rb * inv, qmax, QUANT, False)
            if HAS_REST:
                rest = _quantize(rest * inv, qmax, QUANT, False)
    o_rows = (_pick(is_k, K_OUT, Q_OUT) + row * (BLOCK_D if POW2_D else D))[:, None]
    _store(o_rows + da[None, :], ra.to(Q_OUT.dtype.element_ty), pair_mask, EVEN)
    _store(o_rows + db[None, :], rb.to(Q_OUT.dtype.element_ty), pair_mask, EVEN)
    if HAS_REST:
        tl.store(o_rows + offs_d[None, :], rest.to(Q_OUT.dtype.element_ty), mask=rest_mask)


@triton.jit
def _rms_norm_rope_bwd_kernel(
    DQ_OUT, DK_OUT, Q, K, DQ, DK, COS, SIN, POS, SEQ_OFFSETS, Q_W, K_W, DQW_PART, DKW_PART,
    stride_qyb, stride_qys, stride_qyh, stride_qyd, stride_kyb, stride_kys, stride_kyh, stride_kyd,
    stride_qb, stride_qs, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd, stride_dkb, stride_dks, stride_dkh, stride_dkd,
    stride_cs, stride_cd, stride_ss, stride_sd, stride_pb, stride_ps, stride_qw, stride_kw,
    S, HQ, HK, D, HALF, seq_offset, eps, offset,
    BLOCK_S: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_POS_IDS: tl.constexpr,
    HAS_OFFSET_TENSOR: tl.constexpr,
):
    # Program (s, t, b): BLOCK_S tokens of batch entry b, every head of q (t = 0) or of k (t = 1),
    # in one launch. The heads share the weight, whose gradient this program sums into its row of
    # DQW_PART or DKW_PART (B * programs along s, D), summed on the host.
    s_block = tl.program_id(0)
    is_k = tl.program_id(1) > 0
    b = tl.program_id(2).to(tl.int64)
    part = (b * tl.num_programs(0) + s_block) * D
    H = _pick(is_k, HK, HQ)
    DY = _pick(is_k, DK_OUT, DQ_OUT)
    X = _pick(is_k, K, Q)
    DX = _pick(is_k, DK, DQ)
    W = _pick(is_k, K_W, Q_W)
    DW_PART = _pick(is_k, DKW_PART, DQW_PART)
    stride_yb, stride_ys = _pick(is_k, stride_kyb, stride_qyb), _pick(is_k, stride_kys, stride_qys)
    stride_yh, stride_yd = _pick(is_k, stride_kyh, stride_qyh), _pick(is_k, stride_kyd, stride_qyd)
    stride_xb, stride_xs = _pick(is_k, stride_kb, stride_qb), _pick(is_k, stride_ks, stride_qs)
    stride_xh, stride_xd = _pick(is_k, stride_kh, stride_qh), _pick(is_k, stride_kd, stride_qd)
    stride_dxb, stride_dxs = _pick(is_k, stride_dkb, stride_dqb), _pick(is_k, stride_dks, stride_dqs)
    stride_dxh, stride_dxd = _pick(is_k, stride_dkh, stride_dqh), _pick(is_k, stride_dkd, stride_dqd)
    stride_w = _pick(is_k, stride_kw, stride_qw)
    offs_s = s_block * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    tok, row_mask, pos = _rotary_tokens(b, offs_s, SEQ_OFFSETS, POS, SEQ_OFFSETS, seq_offset, S,
                                        stride_pb, stride_ps, False, HAS_POS_IDS, HAS_OFFSET_TENSOR)
    offs_i = tl.arange(0, BLOCK_HALF).to(tl.int64)
    da, db = _rotary_pairs(offs_i, 0, HALF, INTERLEAVED)
    pair_mask = row_mask[:, None] & (offs_i < HALF)[None, :]
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    is_rest = (offs_d >= 2 * HALF) & (offs_d < D)
    rest_mask = row_mask[:, None] & is_rest[None, :]
    cos = tl.load(COS + pos[:, None] * stride_cs + offs_i[None, :] * stride_cd, mask=pair_mask,
                  other=0.0).to(tl.float32)
    sin = tl.load(SIN + pos[:, None] * stride_ss + offs_i[None, :] * stride_sd, mask=pair_mask,
                  other=0.0).to(tl.float32)
    wa = tl.full([BLOCK_HALF], 1.0, tl.float32)
    wb = tl.full([BLOCK_HALF], 1.0, tl.float32)
    wr = tl.full([BLOCK_D], 1.0, tl.float32)
    if HAS_WEIGHT:
        wa = tl.load(W + da * stride_w, mask=offs_i < HALF, other=0.0).to(tl.float32) + offset
        wb = tl.load(W + db * stride_w, mask=offs_i < HALF, other=0.0).to(tl.float32) + offset
        wr = tl.load(W + offs_d * stride_w, mask=is_rest, other=0.0).to(tl.float32) + offset
    dwa = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    dwb = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    dwr = tl.zeros([BLOCK_D], dtype=tl.float32)
    for h in range(H):
        y_rows = DY + b * stride_yb + tok[:, None] * stride_ys + h * stride_yh
        x_rows = X + b * stride_xb + tok[:, None] * stride_xs + h * stride_xh
        dx_rows = DX + b * stride_dxb + tok[:, None] * stride_dxs + h * stride_dxh
        dya = tl.load(y_rows + da[None, :] * stride_yd, mask=pair_mask, other=0.0).to(tl.float32)
        dyb = tl.load(y_rows + db[None, :] * stride_yd, mask=pair_mask, other=0.0).to(tl.float32)
        dn_r = tl.load(y_rows + offs_d[None, :] * stride_yd, mask=rest_mask, other=0.0).to(tl.float32)
        dn_a = dya * cos + dyb * sin                    # the rotation by -theta
        dn_b = dyb * cos - dya * sin
        xa = tl.load(x_rows + da[None, :] * stride_xd, mask=pair_mask, other=0.0).to(tl.float32)
        xb = tl.load(x_rows + db[None, :] * stride_xd, mask=pair_mask, other=0.0).to(tl.float32)
        xr = tl.load(x_rows + offs_d[None, :] * stride_xd, mask=rest_mask, other=0.0).to(tl.float32)
        ss = tl.sum(xa * xa, axis=1) + tl.sum(xb * xb, axis=1) + tl.sum(xr * xr, axis=1)
        rstd = (1.0 / tl.sqrt(ss / D + eps))[:, None]
        xa, xb, xr = xa * rstd, xb * rstd, xr * rstd    # xhat
        ga, gb, gr = dn_a * wa[None, :], dn_b * wb[None, :], dn_r * wr[None, :]
        c1 = (tl.sum(ga * xa, axis=1) + tl.sum(gb * xb, axis=1) + tl.sum(gr * xr, axis=1)) / D
        c1 = c1[:, None]
        tl.store(dx_rows + da[None, :] * stride_dxd, ((ga - xa * c1) * rstd).to(DX.dtype.element_ty), mask=pair_mask)
        tl.store(dx_rows + db[None, :] * stride_dxd, ((gb - xb * c1) * rstd).to(DX.dtype.element_ty), mask=pair_mask)
        tl.store(dx_rows + offs_d[None, :] * stride_dxd, ((gr - xr * c1) * rstd).to(DX.dtype.element_ty), mask=rest_mask)
        dwa += tl.sum(dn_a * xa, axis=0)
        dwb += tl.sum(dn_b * xb, axis=0)
        dwr += tl.sum(dn_r * xr, axis=0)
    if HAS_WEIGHT:
        tl.store(DW_PART + part + da, dwa, mask=offs_i < HALF)
        tl.store(DW_PART + part + db, dwb, mask=offs_i < HALF)
        tl.store(DW_PART + part + offs_d, dwr, mask=is_rest)


# --------------------------------------------------------------------------------------------
# Gated linear units: y = act(gate) * up
# --------------------------------------------------------------------------------------------

_SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2.0 / math.pi))
_INV_SQRT_2 = tl.constexpr(1.0 / math.sqrt(2.0))
_INV_SQRT_2PI = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _glu_act(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in fp32: 0 silu, 1 gelu (erf), 2 gelu (tanh approximation)."""
    # 1 - sigmoid(z) is taken as sigmoid(-z): subtracting from 1 loses it where sigmoid(z) ~ 1
    if ACT == 0:
        s = tl.sigmoid(g)
        return g * s, s * (1.0 + g * tl.sigmoid(-g))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * _INV_SQRT_2))
        return g * cdf, cdf + g * _INV_SQRT_2PI * tl.exp(-0.5 * g * g)
    else:
        # 0.5 * (1 + tanh(u)) = sigmoid(2u), and 1 - tanh(u)^2 = 4 s (1 - s): no cancellation
        inner = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        s = tl.sigmoid(2.0 * inner)
        d_inner = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * g * g)
        return g * s, s + 2.0 * g * s * tl.sigmoid(-2.0 * inner) * d_inner


@triton.jit
def _glu_block(N, BLOCK_N: tl.constexpr):
    """(row, columns, mask) of this program: programs walk the column blocks of row 0, then row 1..."""
    blocks = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0).to(tl.int64)
    row = pid // blocks
    cols = (pid % blocks) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    return row, cols, cols < N


@triton.jit
def _glu_fwd_kernel(G, U, Y, stride_gm, stride_gn, stride_um, stride_un, stride_ym, stride_yn,
                    N, ACT: tl.constexpr, BLOCK_N: tl.constexpr):
    row, cols, mask = _glu_block(N, BLOCK_N)
    g = tl.load(G + row * stride_gm + cols * stride_gn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_um + cols * stride_un, mask=mask, other=0.0).to(tl.float32)
    act, _ = _glu_act(g, ACT)
    tl.store(Y + row * stride_ym + cols * stride_yn, (act * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(DY, G, U, DG, DU, stride_dym, stride_dyn, stride_gm, stride_gn, stride_um,
                    stride_un, stride_dgm, stride_dgn, stride_dum, stride_dun,
                    N, ACT: tl.constexpr, BLOCK_N: tl.constexpr):
    row, cols, mask = _glu_block(N, BLOCK_N)
    dy = tl.load(DY + row * stride_dym + cols * stride_dyn, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_gm + cols * stride_gn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_um + cols * stride_un, mask=mask, other=0.0).to(tl.float32)
    act, dact = _glu_act(g, ACT)
    tl.store(DU + row * stride_dum + cols * stride_dun, (dy * act).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + row * stride_dgm + cols * stride_dgn, (dy * u * dact).to(DG.dtype.element_ty), mask=mask)


def _glu_grid(rows, N, device):
    """(grid, BLOCK_N, num_warps): the row's block, or where rows of several blocks (inputs that
    could not be flattened: _flat) leave the last block of each partly idle, the largest power of
    two down to block_n >> fit_shifts that divides N, with warps in proportion (N = 14336, half of
    each row's last 4096-block idle: 2048 and half the warps). A row of one block keeps it."""
    cfg = tuning.glu_config(device)
    block, num_warps = min(cfg.block_n, triton.next_power_of_2(max(N, 1))), cfg.num_warps
    if rows > 1 and N > block and N % block:
        for shift in range(1, cfg.fit_shifts + 1):
            if N % (block >> shift) == 0:
                block, num_warps = block >> shift, max(1, num_warps >> shift)
                break
    return (rows * triton.cdiv(N, block),), block, num_warps


def _flat(*ts):
    """The tensors as one (1, rows * N) row when all are contiguous: every program then gets a full
    block, where rows of N = 14336 leave the last block of each row partly idle."""
    if all(t.is_contiguous() for t in ts):
        return tuple(t.view(1, -1) for t in ts)
    return ts


def glu_fwd(*, gate, up, activation, out):
    """gate, up, out: (rows, N) views with any strides; writes act(gate) * up into out."""
    rows, N = gate.shape
    if rows == 0 or N == 0:
        return out
    gate, up, out_rows = _flat(gate, up, out)
    rows, N = gate.shape
    grid, block, num_warps = _glu_grid(rows, N, gate.device)
    _glu_fwd_kernel[grid](gate, up, out_rows, *gate.stride(), *up.stride(), *out_rows.stride(), N,
                          ACT=ACTIVATIONS[activation], BLOCK_N=block, num_warps=num_warps)
    return out


def glu_bwd(*, dy, gate, up, activation, dgate, dup):
    """Writes d(gate) and d(up), (rows, N) views with any strides (halves of one fused gradient
    when the input was fused)."""
    rows, N = gate.shape
    if rows == 0 or N == 0:
        return
    dy, gate, up, dgate, dup = _flat(dy, gate, up, dgate, dup)
    rows, N = gate.shape
    grid, block, num_warps = _glu_grid(rows, N, gate.device)
    _glu_bwd_kernel[grid](dy, gate, up, dgate, dup, *dy.stride(), *gate.stride(), *up.stride(),
                          *dgate.stride(), *dup.stride(), N, ACT=ACTIVATIONS[activation],
                          BLOCK_N=block, num_warps=num_warps)


_QUANT_CODES = {None: 0, torch.int8: 1, torch.float8_e4m3fn: 2}


def _batched(t):
    """(B, S, H, D) view of a (B, S, H, D) or packed (T, H, D) tensor (packed: B = 1)."""
    return t if t is None or t.dim() == 4 else t.unsqueeze(0)


def rotary_fwd(*, x, cos, sin, out, rot_start, rotary_dim, interleaved=False, conjugate=False,
               position_ids=None, cu_seqlens=None, max_seqlen=None, seqlen_offsets=0):
    """Rotate x's features [rot_start, rot_start + rotary_dim) into out (which may be x itself).

    x, out: (B, S, H, D), or packed (T, H, D) with cu_seqlens (B + 1,) or position_ids (T,).
    """
    varlen = cu_seqlens is not None
    if varlen:
        B, S = cu_seqlens.shape[0] - 1, max_seqlen
        x4, o4 = x.unsqueeze(0), out.unsqueeze(0)
        x_strides = (0, x.stride(0), x.stride(1), x.stride(2))
        o_strides = (0, out.stride(0), out.stride(1), out.stride(2))
    else:
        x4, o4 = _batched(x), _batched(out)
        B, S = x4.shape[0], x4.shape[1]
        x_strides, o_strides = x4.stride(), o4.stride()
    H, D = x4.shape[2], x4.shape[3]
    if B == 0 or S == 0 or H == 0:
        return out
    pos = position_ids
    if pos is not None and pos.dim() == 1:  # packed tokens: one position per token
        pos = pos.unsqueeze(0)
    pos_strides = (0, 0) if pos is None else ((0 if varlen else pos.stride(0)), pos.stride(1))
    offsets_tensor = isinstance(seqlen_offsets, torch.Tensor)
    cfg = tuning.rotary_config(x.device)
    half = rotary_dim // 2
    block_h = min(triton.next_power_of_2(H), cfg.block_rows)   # a token's heads first, then tokens
    block_s = max(1, cfg.block_rows // block_h)
    grid = (triton.cdiv(S, block_s), B, triton.cdiv(H, block_h))
    _rotary_kernel[grid](
        x4, o4, cos, sin, pos, cu_seqlens, seqlen_offsets if offsets_tensor else None,
        *x_strides, *o_strides, *cos.stride(), *sin.stride(), *pos_strides,
        S, H, D, rot_start, half, 0 if offsets_tensor else int(seqlen_offsets),
        BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        BLOCK_D=triton.next_power_of_2(D), HAS_REST=rotary_dim < D, INTERLEAVED=interleaved,
        CONJUGATE=conjugate, WRITE_REST=out.data_ptr() != x.data_ptr(),
        IS_VARLEN=varlen, HAS_POS_IDS=pos is not None, HAS_OFFSET_TENSOR=offsets_tensor,
        num_warps=cfg.num_warps,
    )
    return out


def _one_launch(q, k, q_weight, k_weight) -> bool:
    """Whether q and k can share a launch: the kernel picks k's pointers in k's programs, so both
    need the same types (a weight present on one side only, or of another dtype, cannot)."""
    if (q_weight is None) != (k_weight is None):
        return False
    return q_weight is None or q_weight.dtype == k_weight.dtype


def _inner_int32(t):
    """t, or a contiguous copy when the offsets along its last dim (up to size * stride) do not fit
    int32, as _qk_norm_rope_fwd_kernel takes them (int32 there saves registers and instructions;
    rows are addressed in int64 when a tensor's offsets reach 2^31: ROW_OFFSET_LIMIT)."""
    if t.shape[-1] * abs(t.stride(-1)) >= 2 ** 31:
        return t.contiguous()
    return t


ROW_OFFSET_LIMIT = 2 ** 31  # offsets below it are int32 in the q-and-k kernel (tests lower it)


def _fits_int32(t) -> bool:
    """Whether every element offset of t (None: nothing) is below ROW_OFFSET_LIMIT."""
    return t is None or sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()) if n) < ROW_OFFSET_LIMIT


_LINE = 128  # bytes in a cache line (NVIDIA's L1 and L2)


def _lines(n, t) -> int:
    """Cache lines that n contiguous elements of t span from a line's start (a power of two)."""
    return triton.next_power_of_2(max(triton.cdiv(n * t.element_size(), _LINE), 1))


def qk_norm_rope_fwd(*, q, k, q_out, k_out, q_weight, k_weight, cos, sin, rot_start, rotary_dim,
                     interleaved, position_ids, seqlen_offsets, eps, offset, quant_dtype=None,
                     q_scale=None, k_scale=None):
    """RMSNorm of every head vector of q (B, S, Hq, D) and k (B, S, Hkv, D), RoPE of features
    [rot_start, rot_start + rotary_dim), into q_out and k_out: in one launch (for each block of
    tokens, programs of q's head blocks, then of k's), or one per tensor when their weights differ
    in presence or dtype. quant_dtype: int8 or float8_e4m3fn codes into the outs, per-(token, head)
    fp32 scales into q_scale, k_scale (B, S, H). The outs and scales are contiguous (the kernel
    addresses them by row index alone)."""
    assert all(t is None or t.is_contiguous() for t in (q_out, k_out, q_scale, k_scale))
    if not _one_launch(q, k, q_weight, k_weight):
        for x, out, w, scale in ((q, q_out, q_weight, q_scale), (k, k_out, k_weight, k_scale)):
            qk_norm_rope_fwd(q=x, k=x[:, :, :0], q_out=out, k_out=out[:, :, :0], q_weight=w,
                             k_weight=w, cos=cos, sin=sin, rot_start=rot_start,
                             rotary_dim=rotary_dim, interleaved=interleaved,
                             position_ids=position_ids, seqlen_offsets=seqlen_offsets, eps=eps,
                             offset=offset, quant_dtype=quant_dtype, q_scale=scale,
                             k_scale=scale[:, :, :0] if scale is not None else None)
        return
    B, S, HQ, D = q.shape
    HK = k.shape[2]
    if B == 0 or S == 0 or HQ + HK == 0:
        return
    q, k, cos, sin = (_inner_int32(t) for t in (q, k, cos, sin))
    if q_weight is not None:
        q_weight, k_weight = _inner_int32(q_weight), _inner_int32(k_weight)
    cfg = tuning.rotary_config(q.device)
    half = rotary_dim // 2
    rows = cfg.norm_block_rows if quant_dtype is None else cfg.quant_block_rows
    # one tile shape for both: heads of a token first (up to the smaller head count), then tokens
    block_h = min(triton.next_power_of_2(max(min(HQ, HK) if HK else HQ, 1)), rows)
    block_s = max(1, rows // block_h)
    q_head_blocks = triton.cdiv(HQ, block_h)
    head_blocks = q_head_blocks + triton.cdiv(HK, block_h)   # a constexpr: % and // by it are cheap
    s_blocks = triton.cdiv(S, block_s)
    grid = (s_blocks * head_blocks, 1, B)
    block_half = triton.next_power_of_2(max(half, 1))
    even = S % block_s == 0 and HQ % block_h == 0 and HK % block_h == 0 and half == block_half
    offsets_tensor = isinstance(seqlen_offsets, torch.Tensor)
    pos = position_ids
    pos_strides = (0, 0) if pos is None else pos.stride()
    quant = quant_dtype is not None
    # absent tensors: q's own in both slots (never read; the kernel's picks need one type)
    q_w, k_w = (q_weight, k_weight) if q_weight is not None else (q, q)
    q_sc, k_sc = (q_scale, k_scale) if quant else (q_out, q_out)
    cap = tuning.quant_register_cap(cfg, D, rotary_dim, interleaved) if quant else 0
    ROWS_INT64 = not all(_fits_int32(t) for t in (q, k, q_out, k_out, cos, sin, q_scale, k_scale, pos))
    # prefetches (PTX: set in NVIDIA rows of the table only; the interpreter has no inline asm) of
    # lines of contiguous features
    native = not triton_interpreted()
    ahead = cfg.quant_prefetch_ahead if quant else cfg.norm_prefetch_ahead   # programs
    ahead = max(1, round(ahead / head_blocks)) if ahead else 0                 # token blocks
    # (none where every prefetched tile would lie past the end: short sequences)
    ahead = ahead if (native and q.stride(-1) == k.stride(-1) == 1 and ahead < s_blocks
                      and (s_blocks + ahead) * block_s < 2 ** 31) else 0
    prefetch_rope = (native and bool(cfg.prefetch_rope) and cos.stride(-1) == sin.stride(-1) == 1
                     and cos.dtype == sin.dtype)
    _qk_norm_rope_fwd_kernel[grid](
        q, k, q_out, k_out, q_w, k_w, q_sc, k_sc, cos, sin, pos,
        seqlen_offsets if offsets_tensor else None,
        *q.stride(), *k.stride(), _stride(q_weight), _stride(k_weight), *cos.stride(), *sin.stride(), *pos_strides,
        S, HQ, HK, D, rot_start, half, q_head_blocks, 0 if offsets_tensor else int(seqlen_offsets),
        eps, offset, ahead,
        BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_D=triton.next_power_of_2(D), HAS_REST=rotary_dim < D, INTERLEAVED=interleaved,
        HAS_WEIGHT=q_weight is not None, QUANT=_QUANT_CODES[quant_dtype],
        EVEN=even, ROT_ALL=rot_start == 0, POW2_D=D & (D - 1) == 0,
        HAS_POS_IDS=pos is not None, HAS_OFFSET_TENSOR=offsets_tensor, HEAD_BLOCKS=head_blocks,
        ROWS_INT64=ROWS_INT64, PREFETCH_X=ahead > 0, X_LINES=_lines(D, q), X_STEP=_LINE // q.element_size(),
        PREFETCH_ROPE=prefetch_rope, ROPE_LINES=_lines(half, cos), ROPE_STEP=_LINE // cos.element_size(),
        num_warps=cfg.norm_num_warps if quant_dtype is None else cfg.quant_num_warps,
        # the quantized path is specified as exactly rounded steps: no fused multiply-adds
        **({"enable_fp_fusion": False} if quant else {}),
        **({"maxnreg": cap} if cap else {}),
    )


def rms_norm_rope_bwd(*, dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, eps, offset,
                      rotary_dim, interleaved, position_ids, seqlen_offsets):
    """Gradients (dq, dk, dq_weight, dk_weight; a weight's None when it is) of RMSNorm-then-RoPE of
    q (B, S, Hq, D) and k (B, S, Hkv, D), for the output gradients dq_out, dk_out: one launch."""
    if not _one_launch(q, k, q_weight, k_weight):
        dq, _, dqw, _ = rms_norm_rope_bwd(
            dq_out=dq_out, dk_out=dq_out[:, :, :0], q=q, k=q[:, :, :0], q_weight=q_weight,
            k_weight=q_weight, cos=cos, sin=sin, eps=eps, offset=offset, rotary_dim=rotary_dim,
            interleaved=interleaved, position_ids=position_ids, seqlen_offsets=seqlen_offsets)
        dk, _, dkw, _ = rms_norm_rope_bwd(
            dq_out=dk_out, dk_out=dk_out[:, :, :0], q=k, k=k[:, :, :0], q_weight=k_weight,
            k_weight=k_weight, cos=cos, sin=sin, eps=eps, offset=offset, rotary_dim=rotary_dim,
            interleaved=interleaved, position_ids=position_ids, seqlen_offsets=seqlen_offsets)
        return dq, dk, dqw, dkw
    B, S, HQ, D = q.shape
    HK = k.shape[2]
    dq = empty(q.shape, dtype=q.dtype, device=q.device)
    dk = empty(k.shape, dtype=k.dtype, device=k.device)
    cfg = tuning.rotary_config(q.device)
    block_s = cfg.bwd_block_s
    s_blocks = triton.cdiv(S, block_s)
    has_weight = q_weight is not None

    def part():
        return empty((B * s_blocks, D), dtype=torch.float32, device=q.device) if has_weight else None

    dqw_part, dkw_part = part(), part()
    if B * S * (HQ + HK) > 0:
        half = rotary_dim // 2
        offsets_tensor = isinstance(seqlen_offsets, torch.Tensor)
        pos_strides = (0, 0) if position_ids is None else position_ids.stride()
        # absent weights: q's own in their slots (never read or written; the picks need a type)
        q_w, k_w, q_p, k_p = (q_weight, k_weight, dqw_part, dkw_part) if has_weight else (q,) * 4
        _rms_norm_rope_bwd_kernel[(s_blocks, 2 if HK else 1, B)](
            dq_out, dk_out, q, k, dq, dk, cos, sin, position_ids,
            seqlen_offsets if offsets_tensor else None, q_w, k_w, q_p, k_p,
            *dq_out.stride(), *dk_out.stride(), *q.stride(), *k.stride(), *dq.stride(), *dk.stride(),
            *cos.stride(), *sin.stride(), *pos_strides, _stride(q_weight), _stride(k_weight),
            S, HQ, HK, D, half, 0 if offsets_tensor else int(seqlen_offsets), eps, offset,
            BLOCK_S=block_s, BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
            BLOCK_D=triton.next_power_of_2(D), INTERLEAVED=interleaved,
            HAS_WEIGHT=has_weight, HAS_POS_IDS=position_ids is not None,
            HAS_OFFSET_TENSOR=offsets_tensor, num_warps=cfg.num_warps,
        )

    def total(p, w, H):
        if w is None:
            return None
        if B * S * H == 0:
            return torch.zeros_like(w)
        return p.sum(0).to(w.dtype)

    return dq, dk, total(dqw_part, q_weight, HQ), total(dkw_part, k_weight, HK)
