"""RMSNorm, LayerNorm and AdaLN, forward and backward:
y = norm(h) [* (offset + w) + b] [* (1 + scale) + shift], h = x, or residual + [gate *] x.

``_norm_fwd_kernel`` takes one row of N features per program, with the fused residual (and gated
residual) add; rows up to a table's width are held in registers (one read of x), wider rows are
walked in blocks, several passes. ``_norm_bwd_kernel`` sums the parameters' gradients over runs of
rows, into one partial row a program, summed on the host.

Rows at fp32's ends: the statistics are taken of h * p, p = 2^k a power of two that brings max |h|
into [1, 2) (k from max |h|'s exponent bits, so the scaling is exact), where the fp32 sum of
squares of h would overflow (|h| past about 1e19) or fall where its roundings lose the row (a
tiny row). var(h p) = var(h) p^2 and rstd(h p) with eps p^2 = rstd(h) / p, so xhat = (h p - mean_p)
* rstd_p is the same; p is kept per row for the backward (MEAN's third column; 1 for the other
rows, whose results are the bits they were without it). eps p^2 is kept below about 2^101
(``shared._row_scale``): a row that small is eps's, and h p then stays far above fp32's underflow.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.layers import tuning
from lanekit.layers.kernels.shared import _row_scale, _rows, _stride, _strides
from lanekit.runtime.alloc import empty
from lanekit.runtime.host import cdiv, next_power_of_2
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.launch import launch
from lanekit.runtime.signature import contiguous_strides, meta, remember
from lanekit.runtime.tuning import compiling

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()


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
def _norm_stats(h, mask, N, IS_RMS: tl.constexpr, TWO_PART_MEAN: tl.constexpr):
    """(mean, mean_lo, hc, sum of hc^2) of a row h held whole (masked columns 0): the mean as an
    unevaluated sum mean + mean_lo (0, 0 for RMSNorm), hc = (h - mean) - mean_lo."""
    mean = 0.0
    mean_lo = 0.0
    if not IS_RMS:
        mean = tl.sum(h, axis=0) / N
        if TWO_PART_MEAN:  # only fp32 outputs can see the rounding of the mean
            mean_lo = tl.sum(tl.where(mask, h - mean, 0.0), axis=0) / N
    hc = tl.where(mask, (h - mean) - mean_lo, 0.0)
    return mean, mean_lo, hc, tl.sum(hc * hc, axis=0)


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
            p = tl.full((), 1.0, tl.float32)
            mean, mean_lo, hc, ss = _norm_stats(h, mask, N, IS_RMS, TWO_PART_MEAN)
            # a sum of squares in [2^-60, inf) lost nothing to under- or overflow that shows at
            # fp32's precision (a square that underflows is 2^-63 below the row's largest); a row
            # outside (or NaN) is taken again, scaled
            if not ((ss >= 2.0 ** -60) & (ss < float("inf"))):
                p = _row_scale(tl.max(tl.abs(h), axis=0), eps)
                mean, mean_lo, hc, ss = _norm_stats(h * p, mask, N, IS_RMS, TWO_PART_MEAN)
            rstd = 1.0 / tl.sqrt(ss / N + (eps * p) * p)
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
        else:  # blocks of the row: one pass for max |h| (the scale p), one for the mean, one for
            # the variance, one to write (a row this wide is rare; the max pass costs a read)
            amax = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + cols0
                h, x = _norm_load_h(X, R, GATE, x_row, r_row, g_row, cols, cols < N, stride_xn,
                                    stride_rn, stride_gn, HAS_RESIDUAL, HAS_GATE)
                amax = tl.maximum(amax, tl.abs(h))
            p = _row_scale(tl.max(amax, axis=0), eps)
            mean = 0.0
            if not IS_RMS:
                acc = tl.zeros([BLOCK_N], dtype=tl.float32)
                for start in range(0, N, BLOCK_N):
                    cols = start + cols0
                    h, x = _norm_load_h(X, R, GATE, x_row, r_row, g_row, cols, cols < N, stride_xn,
                                        stride_rn, stride_gn, HAS_RESIDUAL, HAS_GATE)
                    acc += h * p
                mean = tl.sum(acc, axis=0) / N
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + cols0
                mask = cols < N
                h, x = _norm_load_h(X, R, GATE, x_row, r_row, g_row, cols, mask, stride_xn,
                                    stride_rn, stride_gn, HAS_RESIDUAL, HAS_GATE)
                hc = tl.where(mask, h * p - mean, 0.0)
                acc += hc * hc
                acc1 += hc
            mean_lo = 0.0
            if not IS_RMS:  # the corrected two-pass variance (Chan, Golub, LeVeque)
                mean_lo = tl.sum(acc1, axis=0) / N
            rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N - mean_lo * mean_lo + (eps * p) * p)
            for start in range(0, N, BLOCK_N):
                cols = start + cols0
                mask = cols < N
                h, x = _norm_load_h(X, R, GATE, x_row, r_row, g_row, cols, mask, stride_xn,
                                    stride_rn, stride_gn, HAS_RESIDUAL, HAS_GATE)
                y = _norm_affine(((h * p - mean) - mean_lo) * rstd, W, B, SCALE, SHIFT, s_row, t_row, cols, mask,
                                 offset, stride_w, stride_b, stride_sn, stride_tn, HAS_WEIGHT,
                                 HAS_BIAS, HAS_MOD)
                tl.store(Y + y_row + cols * stride_yn, y.to(Y.dtype.element_ty), mask=mask)
                if HAS_RESIDUAL:
                    tl.store(H_OUT + h_row + cols * stride_hn, h.to(H_OUT.dtype.element_ty), mask=mask)
        # the mean as an unevaluated sum mean + mean_lo: h - mean is exact where h is near the mean, so
        # ((h - mean) - mean_lo) keeps the fp32 accuracy that (h - (mean + mean_lo)) would lose on
        # rows whose mean is large beside their spread. All three, and rstd, are h * p's.
        tl.store(MEAN + 3 * row, mean)
        tl.store(MEAN + 3 * row + 1, mean_lo)
        tl.store(MEAN + 3 * row + 2, p)
        tl.store(RSTD + row, rstd)


@triton.jit
def _norm_bwd_terms(DY, X, R, GATE, SCALE, W, MEAN_ROW, MEAN_LO_ROW, RSTD_ROW, P_ROW, dy_row, x_row, r_row,
                    g_row, mod_row, cols, mask, offset, stride_dyn, stride_xn, stride_rn, stride_gn,
                    stride_mn, stride_w, HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr,
                    HAS_MOD: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """For columns ``cols`` of one row: (xhat, x, dy, g, dxhat). g is dy through the modulation
    (the gradient of xhat * w + b); dxhat is g through the weight (the gradient of xhat). The
    statistics are h * P_ROW's (the forward's row scale)."""
    h, x = _norm_load_h(X, R, GATE, x_row, r_row, g_row, cols, mask, stride_xn, stride_rn,
                        stride_gn, HAS_RESIDUAL, HAS_GATE)
    xhat = tl.where(mask, ((h * P_ROW - MEAN_ROW) - MEAN_LO_ROW) * RSTD_ROW, 0.0)
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
        mean = tl.load(MEAN + 3 * row)
        mean_lo = tl.load(MEAN + 3 * row + 1)
        row_p = tl.load(MEAN + 3 * row + 2)  # h * row_p's statistics: dh takes rstd(h) = rstd * row_p
        rstd = tl.load(RSTD + row)
        dy_row, x_row, r_row = row * stride_dym, row * stride_xm, row * stride_rm
        if ONE_BLOCK:
            xhat, x, dy, g, dxhat = _norm_bwd_terms(
                DY, X, R, GATE, SCALE, W, mean, mean_lo, rstd, row_p, dy_row, x_row, r_row, g_row, mod_row,
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
                    DY, X, R, GATE, SCALE, W, mean, mean_lo, rstd, row_p, dy_row, x_row, r_row, g_row, mod_row,
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
                    DY, X, R, GATE, SCALE, W, mean, mean_lo, rstd, row_p, dy_row, x_row, r_row, g_row, mod_row,
                    cols, mask, offset, stride_dyn, stride_xn, stride_rn, stride_gn, stride_mn, stride_w,
                    HAS_RESIDUAL, HAS_GATE, HAS_MOD, HAS_WEIGHT)
            dh = ((dxhat - (xhat * c1 + c2)) * rstd) * row_p
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


def _norm_config(device: torch.device, N: int, rows: int = 0) -> tuple[int, bool, int]:
    """(BLOCK_N, ONE_BLOCK, num_warps) for rows of N features."""
    cfg = tuning.norm_config(device, N)
    block = min(next_power_of_2(max(N, 1)), cfg.max_block_n)
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
    mean = empty((rows, 3), dtype=torch.float32, device=x.device)   # mean, its remainder, the row scale
    rstd = empty((rows,), dtype=torch.float32, device=x.device)
    if rows == 0 or N == 0:
        return y, h, mean, rstd
    y2, h2 = y.view(-1, N), (h.view(-1, N) if h is not None else None)
    key = (meta(x2), meta(r2), meta(gate), meta(scale), meta(shift), meta(weight), meta(bias), eps, offset, is_rms,
           rows_per_mod, triton_interpreted(), compiling())
    plan = _FWD_PLANS.get(key)
    if plan is None:
        plan = remember(_FWD_PLANS, key, _norm_fwd_plan(x2, r2, gate, scale, shift, weight, bias, eps, offset,
                                                        is_rms, rows_per_mod))
    grid, args, constexprs = plan
    launch(_norm_fwd_kernel, grid,
        x2, r2, gate, scale, shift, weight, bias, y2, h2, mean, rstd, *args, **constexprs,
    )
    return y, h, mean, rstd


_FWD_PLANS: dict = {}


def _norm_fwd_plan(x2, r2, gate, scale, shift, weight, bias, eps, offset, is_rms, rows_per_mod):
    """norm_fwd's (grid, arguments after the tensors, constexprs) for rows x2 (rows, N), from the
    tensors' metadata and the scalars alone (y and h are allocated contiguous: (N, 1) strides)."""
    rows, N = x2.shape
    BLOCK_N, one_block, num_warps = _norm_config(x2.device, N)
    # rows sharing one row of scale and shift (AdaLN per batch entry) go MOD_ROWS to a program,
    # which loads that row once (up to MOD_ROWS times less to read beside x)
    mod_rows = 1
    if scale is not None and one_block:
        while mod_rows < tuning.NORM_MOD_ROWS and rows_per_mod % (2 * mod_rows) == 0:
            mod_rows *= 2
    out_strides = contiguous_strides((rows, N))
    args = (*_strides(x2), *_strides(r2), *_strides(gate), *_strides(scale), *_strides(shift),
            *out_strides, *(out_strides if r2 is not None else (0, 0)), _stride(weight), _stride(bias),
            N, rows_per_mod, eps, offset)
    constexprs = dict(
        IS_RMS=is_rms, HAS_RESIDUAL=r2 is not None, HAS_GATE=gate is not None,
        HAS_MOD=scale is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        BLOCK_N=BLOCK_N, ONE_BLOCK=one_block, TWO_PART_MEAN=x2.dtype == torch.float32,
        MOD_ROWS=mod_rows, num_warps=num_warps)
    return (rows // mod_rows,), args, constexprs


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
    chunks = max(1, min(per_group, cdiv(tuning.norm_bwd_programs(x.device), groups)))
    rows_per_program = max(1, cdiv(per_group, chunks))
    chunks = max(1, cdiv(per_group, rows_per_program))

    def partial(needed):
        return empty((groups * chunks, N), dtype=torch.float32, device=x.device) if needed else None

    parts = [partial(weight is not None), partial(bias is not None), partial(has_mod),
             partial(has_mod), partial(gate is not None)]
    dx2, dr2 = dx.view(-1, N), (dr.view(-1, N) if dr is not None else None)
    launch(_norm_bwd_kernel, (groups, chunks),
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
