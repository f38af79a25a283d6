"""The attention backward (FlashAttention-2's algorithm) and its launcher, flash_attn_bwd.

The probabilities are recomputed from the forward's
LSE; with z the score after scale, softcap, ALiBi and bias, and P = softmax(z):
  dV = P^T dO,  dP = dO V^T,  dZ = P * (dP - Delta),  Delta_i = sum_d dO_id O_id - dLSE_i,
  dX = dZ * (1 - tanh^2) under softcap (X = q k^T * scale),  dQ = scale dX K,  dK = scale dX^T Q.
With dropout, dV and dP use the dropped-and-rescaled P, regenerated from the forward's seed.
One kernel computes Delta. One computes dK and dV per key block, walking the query blocks (and,
for GQA, every query head sharing its KV head, so dK and dV are never summed across programs).
One computes dQ per query block, walking the key blocks. That recomputes P and dP (7 matrix
products where FlashAttention-2 does 5 and adds dQ up with atomics), but on the H200 it ran
faster than fp32 atomic adds of dQ from the dK/dV kernel (263 vs 243 TFLOP/s forward+backward,
D=128 causal; 320 vs 290 at D=64), whose extra accumulator spilled registers. No atomics, so
the gradients are deterministic.
As in the forward, only tiles that cross a window edge or the end of a sequence apply the
masks: elsewhere a row past the end has LSE +inf (so P = 0) and a key past the end is zero.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from lanekit.attention import tuning
from lanekit.attention.kernels.common import (LOG2E, _block, _check_grid, _strides4, _strides_bthd, _tile,
                                              _varlen_bounds, clamp_varlen)
from lanekit.common.numerics import tanh as _tanh
from lanekit.runtime import alloc
from lanekit.runtime.host import cdiv, next_power_of_2
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.launch import launch

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()


@triton.jit
def _flash_attn_bwd_preprocess_kernel(
    Out, DOut, Lse, DLse, Delta, Lse2,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_dob, stride_dom, stride_doh, stride_dod,
    Hq, Sq, Dv,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)                 # [BLOCK_M]
    offs_dv = tl.arange(0, BLOCK_DV)
    m_in = offs_m < Sq
    tile = m_in[:, None] & (offs_dv[None, :] < Dv)
    o = tl.load(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od,
                mask=tile, other=0.0).to(tl.float32)                               # [BLOCK_M, BLOCK_DV]
    do = tl.load(DOut + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                 mask=tile, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    row = (b * Hq + h) * Sq + offs_m
    if HAS_DLSE:
        delta -= tl.load(DLse + row, mask=m_in, other=0.0)
    tl.store(Delta + row, delta, mask=m_in)
    # The LSE in log2 units; +inf for a row that saw no key, so that its recomputed P is 0.
    lse = tl.load(Lse + row, mask=m_in, other=0.0)
    tl.store(Lse2 + row, tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634), mask=m_in)


@triton.jit
def _flash_attn_bwd_probs(
    qk, i, j, lse2, bias_ptrs, mask_ptrs, counter,
    slope_log2, sm_scale_log2, softcap_scale, softcap_log2,
    Sq, Sk, window_left, window_right, dropout_p, seed,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    # The probabilities of one tile of raw scores qk, recomputed exactly as the forward does.
    # i, j: query rows and key columns, broadcastable to qk's shape (either orientation).
    # Returns P (0 where masked), tanh of the softcapped score (for the chain rule) and the
    # dropout keep mask; the last two are 0 and True when their feature is off.
    t = 0.0
    if HAS_SOFTCAP:
        t = _tanh(qk * softcap_scale)
        s = softcap_log2 * t
    else:
        s = qk * sm_scale_log2
    if MASKED:
        keep = (i < Sq) & (j < Sk)
        if HAS_LEFT:
            keep = keep & (j >= i + (Sk - Sq) - window_left)
        if HAS_RIGHT:
            keep = keep & (j <= i + (Sk - Sq) + window_right)
        if HAS_MASK:
            keep = keep & (tl.load(mask_ptrs, mask=keep, other=0) != 0)
    elif HAS_MASK:
        keep = tl.load(mask_ptrs) != 0
    if HAS_ALIBI or HAS_BIAS:
        b = tl.zeros_like(s)
        if HAS_ALIBI:
            b -= slope_log2 * tl.abs(i + (Sk - Sq) - j).to(tl.float32)
        if HAS_BIAS:
            if MASKED:
                bias = tl.load(bias_ptrs, mask=keep, other=0.0)
            else:
                bias = tl.load(bias_ptrs)
            b += bias.to(tl.float32) * 1.4426950408889634
        z = (b - lse2) + s
    else:
        z = s - lse2
    if MASKED or HAS_MASK:
        z = tl.where(keep, z, float("-inf"))
    p = tl.math.exp2(z)
    kept = True
    if HAS_DROPOUT:
        kept = tl.rand(seed, counter) >= dropout_p
    return p, t, kept


@triton.jit
def _bwd_sequence(CuSeqQ, CuSeqK, b, Sq, Sk, IS_VARLEN: tl.constexpr):
    # (first query row, Sq, first key row, Sk) of sequence b: with cu_seqlens (varlen) its rows
    # of the packed tensors and its own lengths, else 0 and the batch's Sq and Sk.
    q_start = 0
    k_start = 0
    if IS_VARLEN:
        q_start, Sq, k_start, Sk = _varlen_bounds(CuSeqQ, CuSeqK, b)
    return q_start, Sq, k_start, Sk


@triton.jit
def _bwd_tile_offsets(BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_DV: tl.constexpr, INT64_TILES: tl.constexpr):
    # Offsets within a tile: the program's own rows (BLOCK_R), the rows it walks (BLOCK_C), the
    # head dims; int64 where a stride is so large that (block size) * stride overflows int32.
    offs_r = tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    if INT64_TILES:
        offs_r = offs_r.to(tl.int64)
        offs_c = offs_c.to(tl.int64)
        offs_d = offs_d.to(tl.int64)
        offs_dv = offs_dv.to(tl.int64)
    return offs_r, offs_c, offs_d, offs_dv


@triton.jit
def _head_base(P, b, h, row, stride_b, stride_h, stride_row):
    # Row ``row`` of head h of batch entry b of a (B, S, H, ...) operand (or of bias and mask's
    # (B, H, Sq, Sk), the row along the axis given)
    return P + b * stride_b + h * stride_h + row * stride_row


@triton.jit
def _rows_ptrs(P, b, h, start, block, offs_r, offs_c, stride_b, stride_h, stride_r, stride_c):
    # [rows, cols] pointers of rows start + block + offs_r of head h of batch entry b of a
    # (B, S, H, D) operand (start: the sequence's first packed row, 0 unless varlen)
    return (P + b * stride_b + h * stride_h + (start + block) * stride_r
            + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c)


@triton.jit
def _visible_blocks(start, S, S_other, before, after, BLOCK: tl.constexpr, BLOCK_OTHER: tl.constexpr,
                    HAS_BEFORE: tl.constexpr, HAS_AFTER: tl.constexpr):
    # Rows [start, start + BLOCK) of one axis (S long), row x seeing rows [x - before, x + after]
    # of the other (S_other long; no bound where that side has no window): the blocks of the
    # other axis they see, [lo, hi), lo a block start, and inside it [full_lo, full_hi), blocks
    # every row sees whole, which need no bound or window mask (none when the rows run past S).
    lo = 0
    hi = S_other
    if HAS_BEFORE:
        lo = tl.maximum(start - before, 0) // BLOCK_OTHER * BLOCK_OTHER
    if HAS_AFTER:
        hi = tl.minimum(tl.maximum(start + BLOCK + after, 0), S_other)
    full_lo = lo
    if HAS_BEFORE:
        full_lo = tl.cdiv(tl.maximum(start + BLOCK - 1 - before, 0), BLOCK_OTHER) * BLOCK_OTHER
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = S_other // BLOCK_OTHER * BLOCK_OTHER
    if HAS_AFTER:
        full_hi = tl.minimum(full_hi, tl.maximum(start + after + 1, 0) // BLOCK_OTHER * BLOCK_OTHER)
    full_hi = tl.where(start + BLOCK > S, full_lo, tl.maximum(full_hi, full_lo))
    return lo, hi, full_lo, full_hi


@triton.jit
def _flash_attn_bwd_dkdv_inner(
    dk, dv, k, v, q_base, do_base, bias_base, mask_base, Alibi, Lse2, Delta, DBias,
    row_base, rng_offset, h0,
    stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod, stride_bh, stride_bm, stride_bn,
    stride_mh, stride_mm, stride_mn, stride_ah, stride_lh,
    offs_n, offs_n_local, offs_m_local, offs_d, offs_dv,
    sm_scale_log2, softcap_scale, softcap_log2,
    GROUP, Sq, Sk, D, Dv, window_left, window_right, dropout_p, seed, rng_stride,
    lo, hi, lo2, hi2,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_DBIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    # dK and dV of one key block ([BLOCK_N, *], keys as rows) over the query blocks [lo, hi) of
    # each of the GROUP query heads h0 + g sharing its KV head. One flat loop over (g, block):
    # a loop over g around the loop over blocks kept more registers live and spilled on sm90.
    j = offs_n[:, None]
    d_in = offs_d[None, :] < D
    dv_in = offs_dv[None, :] < Dv
    blocks1 = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_M)
    blocks = blocks1 + tl.cdiv(tl.maximum(hi2 - lo2, 0), BLOCK_M)
    for it in range(0, GROUP * blocks):
        g = (it // blocks).to(tl.int64)
        t = it % blocks
        start_m = tl.where(t < blocks1, lo + t * BLOCK_M, lo2 + (t - blocks1) * BLOCK_M)
        start_m64 = tl.cast(start_m, tl.int64)
        offs_m = start_m + offs_m_local                                             # [BLOCK_M]
        rows = row_base + g * stride_lh                            # LSE row of (b, h0 + g, 0)
        q_ptrs = (q_base + g * stride_qh + start_m64 * stride_qm
                  + offs_m_local[:, None] * stride_qm + offs_d[None, :] * stride_qd)
        do_ptrs = (do_base + g * stride_doh + start_m64 * stride_dom
                   + offs_m_local[:, None] * stride_dom + offs_dv[None, :] * stride_dod)
        if MASKED:
            m_in = offs_m[:, None] < Sq
            q = tl.load(q_ptrs, mask=m_in & d_in, other=0.0)                       # [BLOCK_M, BLOCK_D]
            do = tl.load(do_ptrs, mask=m_in & dv_in, other=0.0)                    # [BLOCK_M, BLOCK_DV]
            lse2 = tl.load(Lse2 + rows + offs_m, mask=offs_m < Sq, other=float("inf"))
            delta = tl.load(Delta + rows + offs_m, mask=offs_m < Sq, other=0.0)
        else:
            if EVEN_D:
                q = tl.load(q_ptrs)
                do = tl.load(do_ptrs)
            else:
                q = tl.load(q_ptrs, mask=d_in, other=0.0)
                do = tl.load(do_ptrs, mask=dv_in, other=0.0)
            lse2 = tl.load(Lse2 + rows + offs_m)
            delta = tl.load(Delta + rows + offs_m)
        slope_log2 = 0.0
        if HAS_ALIBI:
            slope_log2 = tl.load(Alibi + (h0 + g) * stride_ah).to(tl.float32) * 1.4426950408889634
        qk_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)             # [BLOCK_N, BLOCK_M]
        i = offs_m[None, :]
        p_t, t_t, kept_t = _flash_attn_bwd_probs(
            qk_t, i, j, lse2[None, :],
            bias_base + g * stride_bh + start_m64 * stride_bm + offs_m_local[None, :] * stride_bm
            + offs_n_local[:, None] * stride_bn,
            mask_base + g * stride_mh + start_m64 * stride_mm + offs_m_local[None, :] * stride_mm
            + offs_n_local[:, None] * stride_mn,
            rng_offset + (rows + start_m64 + offs_m_local[None, :].to(tl.int64)) * rng_stride + j,
            slope_log2, sm_scale_log2, softcap_scale, softcap_log2,
            Sq, Sk, window_left, window_right, dropout_p, seed,
            MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_MASK, HAS_DROPOUT)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)            # [BLOCK_N, BLOCK_M]
        if HAS_DROPOUT:
            inv_keep = 1.0 / (1.0 - dropout_p)
            pd_t = tl.where(kept_t, p_t * inv_keep, 0.0)
            dp_t = tl.where(kept_t, dp_t * inv_keep, 0.0)
        else:
            pd_t = p_t
        dv += tl.dot(pd_t.to(do.dtype), do, input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])                                        # dZ^T
        if HAS_DBIAS:
            dbias_ptrs = DBias + (rows + start_m64 + offs_m_local[None, :]) * Sk + offs_n_local[:, None]
            if MASKED:
                tl.store(dbias_ptrs, ds_t, mask=(i < Sq) & (j < Sk))
            else:
                tl.store(dbias_ptrs, ds_t)
        if HAS_SOFTCAP:
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["Hq", "GROUP", "Sq", "Sk", "D", "Dv", "window_left", "window_right",
                               "dropout_p", "seed", "rng_offset", "stride_lb", "stride_lh", "rng_stride"])
def _flash_attn_bwd_dkdv_kernel(
    Q, K, V, DOut, Lse2, Delta, DK, DV, DBias, Bias, Mask, Alibi, CuSeqQ, CuSeqK,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ab, stride_ah, stride_lb, stride_lh,
    Hq, GROUP, Sq, Sk, D, Dv,
    sm_scale, sm_scale_log2, softcap_scale, softcap_log2,
    window_left, window_right, dropout_p, seed, rng_offset, rng_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_DBIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INT64_TILES: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    if EVEN_D:  # D fills its block: see EVEN_D above fwd._flash_attn_fwd_kernel
        D = BLOCK_D
        Dv = BLOCK_DV
    # One program: key block pid_n of KV head hk in batch b. Tiles are transposed, keys as rows
    # ([BLOCK_N, BLOCK_M]), so that P^T and dS^T feed the dot products without a transpose.
    pid_n = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    start_n = pid_n * BLOCK_N
    start_n64 = start_n.to(tl.int64)
    q_start, Sq, k_start, Sk = _bwd_sequence(CuSeqQ, CuSeqK, b, Sq, Sk, IS_VARLEN)
    if IS_VARLEN:
        if start_n >= Sk:   # past sequence b's keys
            return
    offs_n_local, offs_m_local, offs_d, offs_dv = _bwd_tile_offsets(BLOCK_N, BLOCK_M, BLOCK_D, BLOCK_DV, INT64_TILES)
    offs_n = start_n + offs_n_local                                                 # [BLOCK_N]
    n_in = offs_n < Sk
    k = tl.load(_rows_ptrs(K, b, hk, k_start, start_n64, offs_n_local, offs_d, stride_kb, stride_kh, stride_kn,
                           stride_kd),
                mask=n_in[:, None] & (offs_d[None, :] < D), other=0.0)             # [BLOCK_N, BLOCK_D]
    v = tl.load(_rows_ptrs(V, b, hk, k_start, start_n64, offs_n_local, offs_dv, stride_vb, stride_vh, stride_vn,
                           stride_vd),
                mask=n_in[:, None] & (offs_dv[None, :] < Dv), other=0.0)           # [BLOCK_N, BLOCK_DV]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # Query blocks that see this key block: [m_lo, m_hi), and inside it [full_lo, full_hi) without
    # masks; the blocks on either side need them. Query i sits at key position i + shift, so key j
    # is seen by queries j - shift - window_right .. j - shift + window_left.
    shift = Sk - Sq
    m_lo, m_hi, full_lo, full_hi = _visible_blocks(start_n, Sk, Sq, window_right + shift, window_left - shift,
                                                   BLOCK_N, BLOCK_M, HAS_RIGHT, HAS_LEFT)
    h0 = hk * GROUP                                # the first query head on this KV head
    q_base = _head_base(Q, b, h0, q_start, stride_qb, stride_qh, stride_qm)
    do_base = _head_base(DOut, b, h0, q_start, stride_dob, stride_doh, stride_dom)
    bias_base = _head_base(Bias, b, h0, start_n64, stride_bb, stride_bh, stride_bn)
    mask_base = _head_base(Mask, b, h0, start_n64, stride_mb, stride_mh, stride_mn)
    row_base = b * stride_lb + h0 * stride_lh + q_start
    # [full_lo, full_hi) unmasked; then, in one loop, the masked blocks on either side of it:
    # [m_lo, full_lo) (on the causal diagonal; empty without a right window) and [full_hi, m_hi)
    # (a window's far edge, the last partial block). A third loop for the diagonal cost registers.
    dk, dv = _flash_attn_bwd_dkdv_inner(
        dk, dv, k, v, q_base, do_base, bias_base, mask_base, Alibi + b * stride_ab, Lse2, Delta,
        DBias + start_n64, row_base, rng_offset, h0,
        stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod, stride_bh, stride_bm, stride_bn,
        stride_mh, stride_mm, stride_mn, stride_ah, stride_lh,
        offs_n, offs_n_local, offs_m_local, offs_d, offs_dv, sm_scale_log2, softcap_scale,
        softcap_log2, GROUP, Sq, Sk, D, Dv, window_left, window_right, dropout_p, seed, rng_stride, full_lo, full_hi, 0, 0,
        BLOCK_M, False, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_MASK,
        HAS_DROPOUT, HAS_DBIAS, INPUT_PRECISION)
    dk, dv = _flash_attn_bwd_dkdv_inner(
        dk, dv, k, v, q_base, do_base, bias_base, mask_base, Alibi + b * stride_ab, Lse2, Delta,
        DBias + start_n64, row_base, rng_offset, h0,
        stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod, stride_bh, stride_bm, stride_bn,
        stride_mh, stride_mm, stride_mn, stride_ah, stride_lh,
        offs_n, offs_n_local, offs_m_local, offs_d, offs_dv, sm_scale_log2, softcap_scale,
        softcap_log2, GROUP, Sq, Sk, D, Dv, window_left, window_right, dropout_p, seed, rng_stride, m_lo, full_lo, full_hi, m_hi,
        BLOCK_M, True, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_MASK,
        HAS_DROPOUT, HAS_DBIAS, INPUT_PRECISION)

    dk_ptrs = _rows_ptrs(DK, b, hk, k_start, start_n64, offs_n_local, offs_d, stride_dkb, stride_dkh, stride_dkn,
                         stride_dkd)
    dv_ptrs = _rows_ptrs(DV, b, hk, k_start, start_n64, offs_n_local, offs_dv, stride_dvb, stride_dvh, stride_dvn,
                         stride_dvd)
    tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=n_in[:, None] & (offs_d[None, :] < D))
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=n_in[:, None] & (offs_dv[None, :] < Dv))


@triton.jit
def _flash_attn_bwd_dq_inner(
    dq, q, do, lse2, delta, k_base, v_base, bias_base, mask_base, rng_base,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, stride_mm, stride_mn,
    offs_m, offs_m_local, offs_n_local, offs_d, offs_dv,
    slope_log2, sm_scale_log2, softcap_scale, softcap_log2,
    Sq, Sk, D, Dv, window_left, window_right, dropout_p, seed, rng_stride,
    lo, hi,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    # dQ of one query block ([BLOCK_M, *]) over the key blocks [lo, hi).
    i = offs_m[:, None]
    d_in = offs_d[None, :] < D
    dv_in = offs_dv[None, :] < Dv
    for start_n in range(lo, hi, BLOCK_N):
        start_n64 = tl.cast(start_n, tl.int64)
        offs_n = start_n + offs_n_local                                              # [BLOCK_N]
        k_ptrs = k_base + start_n64 * stride_kn + offs_n_local[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_base + start_n64 * stride_vn + offs_n_local[:, None] * stride_vn + offs_dv[None, :] * stride_vd
        if MASKED:
            n_in = offs_n[:, None] < Sk
            k = tl.load(k_ptrs, mask=n_in & d_in, other=0.0)                        # [BLOCK_N, BLOCK_D]
            v = tl.load(v_ptrs, mask=n_in & dv_in, other=0.0)                       # [BLOCK_N, BLOCK_DV]
        elif EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_in, other=0.0)
            v = tl.load(v_ptrs, mask=dv_in, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)               # [BLOCK_M, BLOCK_N]
        j = offs_n[None, :]
        p, t, kept = _flash_attn_bwd_probs(
            qk, i, j, lse2[:, None],
            bias_base + start_n64 * stride_bn + offs_m_local[:, None] * stride_bm + offs_n_local[None, :] * stride_bn,
            mask_base + start_n64 * stride_mn + offs_m_local[:, None] * stride_mm + offs_n_local[None, :] * stride_mn,
            rng_base + offs_m_local[:, None].to(tl.int64) * rng_stride + j,
            slope_log2, sm_scale_log2, softcap_scale, softcap_log2,
            Sq, Sk, window_left, window_right, dropout_p, seed,
            MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_MASK, HAS_DROPOUT)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)              # [BLOCK_M, BLOCK_N]
        if HAS_DROPOUT:
            dp = tl.where(kept, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=INPUT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["Hq", "GROUP", "Sq", "Sk", "D", "Dv", "window_left", "window_right",
                               "dropout_p", "seed", "rng_offset", "stride_lb", "stride_lh", "rng_stride"])
def _flash_attn_bwd_dq_kernel(
    Q, K, V, DOut, Lse2, Delta, DQ, Bias, Mask, Alibi, CuSeqQ, CuSeqK,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_dqb, stride_dqm, stride_dqh, stride_dqd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ab, stride_ah, stride_lb, stride_lh,
    Hq, GROUP, Sq, Sk, D, Dv,
    sm_scale, sm_scale_log2, softcap_scale, softcap_log2,
    window_left, window_right, dropout_p, seed, rng_offset, rng_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INT64_TILES: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    if EVEN_D:  # D fills its block: see EVEN_D above fwd._flash_attn_fwd_kernel
        D = BLOCK_D
        Dv = BLOCK_DV
    # One program: query block pid_m of query head h in batch b, walking the key blocks it sees.
    # Query blocks last to first: under a causal mask (a right window) the last ones see the
    # most keys, and starting the longest programs first keeps the grid's last wave short.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    start_m64 = start_m.to(tl.int64)
    q_start, Sq, k_start, Sk = _bwd_sequence(CuSeqQ, CuSeqK, b, Sq, Sk, IS_VARLEN)
    if IS_VARLEN:
        if start_m >= Sq:   # past sequence b's queries
            return
    offs_m_local, offs_n_local, offs_d, offs_dv = _bwd_tile_offsets(BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, INT64_TILES)
    offs_m = start_m + offs_m_local                                                 # [BLOCK_M]
    m_in = offs_m < Sq
    # q and do written out, not through _rows_ptrs: with that inlined call's line info, ptxas gave
    # one windowed sm90 sample 54 more registers and a spill (the same PTX instructions otherwise)
    q = tl.load(Q + b * stride_qb + h * stride_qh + (q_start + start_m64) * stride_qm
                + offs_m_local[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=m_in[:, None] & (offs_d[None, :] < D), other=0.0)             # [BLOCK_M, BLOCK_D]
    do = tl.load(DOut + b * stride_dob + h * stride_doh + (q_start + start_m64) * stride_dom
                 + offs_m_local[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                 mask=m_in[:, None] & (offs_dv[None, :] < Dv), other=0.0)          # [BLOCK_M, BLOCK_DV]
    row_base = b * stride_lb + h * stride_lh + q_start                              # LSE row of (b, h, 0)
    lse2 = tl.load(Lse2 + row_base + offs_m, mask=m_in, other=float("inf"))
    delta = tl.load(Delta + row_base + offs_m, mask=m_in, other=0.0)
    k_base = _head_base(K, b, hk, k_start, stride_kb, stride_kh, stride_kn)
    v_base = _head_base(V, b, hk, k_start, stride_vb, stride_vh, stride_vn)
    bias_base = _head_base(Bias, b, h, start_m64, stride_bb, stride_bh, stride_bm)
    mask_base = _head_base(Mask, b, h, start_m64, stride_mb, stride_mh, stride_mm)
    rng_base = rng_offset + (row_base + start_m64) * rng_stride
    slope_log2 = 0.0
    if HAS_ALIBI:
        slope_log2 = tl.load(Alibi + b * stride_ab + h * stride_ah).to(tl.float32) * 1.4426950408889634

    # Key blocks this query block sees: [lo, hi), and inside it [full_lo, full_hi) without masks,
    # as in the forward. Query i sees keys i + shift - window_left .. i + shift + window_right.
    shift = Sk - Sq
    lo, hi, full_lo, full_hi = _visible_blocks(start_m, Sq, Sk, window_left - shift, shift + window_right,
                                               BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # [lo, full_lo) masked (empty without a left window), [full_lo, full_hi) unmasked,
    # [full_hi, hi) masked
    if HAS_LEFT:
        dq = _flash_attn_bwd_dq_inner(
            dq, q, do, lse2, delta, k_base, v_base, bias_base, mask_base, rng_base,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, stride_mm, stride_mn,
            offs_m, offs_m_local, offs_n_local, offs_d, offs_dv, slope_log2, sm_scale_log2, softcap_scale,
            softcap_log2, Sq, Sk, D, Dv, window_left, window_right, dropout_p, seed, rng_stride, lo, full_lo,
            BLOCK_N, True, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_MASK,
            HAS_DROPOUT, INPUT_PRECISION)
    dq = _flash_attn_bwd_dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, bias_base, mask_base, rng_base,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, stride_mm, stride_mn,
        offs_m, offs_m_local, offs_n_local, offs_d, offs_dv, slope_log2, sm_scale_log2, softcap_scale,
        softcap_log2, Sq, Sk, D, Dv, window_left, window_right, dropout_p, seed, rng_stride, full_lo, full_hi,
        BLOCK_N, False, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_MASK,
        HAS_DROPOUT, INPUT_PRECISION)
    dq = _flash_attn_bwd_dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, bias_base, mask_base, rng_base,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, stride_mm, stride_mn,
        offs_m, offs_m_local, offs_n_local, offs_d, offs_dv, slope_log2, sm_scale_log2, softcap_scale,
        softcap_log2, Sq, Sk, D, Dv, window_left, window_right, dropout_p, seed, rng_stride, full_hi, hi,
        BLOCK_N, True, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_MASK,
        HAS_DROPOUT, INPUT_PRECISION)
    tl.store(_rows_ptrs(DQ, b, h, q_start, start_m64, offs_m_local, offs_d, stride_dqb, stride_dqh, stride_dqm,
                        stride_dqd),
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=m_in[:, None] & (offs_d[None, :] < D))


def flash_attn_bwd(
    *,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    softmax_scale: float,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    attn_bias: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    seed: int,
    offset: int,
    bias_grad: bool,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the backward of :func:`flash_attn_fwd` with the same normalized arguments, plus
    dout (B, Sq, Hq, Dv), the forward's out and lse, and dlse (B, Hq, Sq) fp32 or None. Returns
    dq, dk, dv in the inputs' shapes and dtype, and dbias (B, Hq, Sq, Sk) fp32 when ``bias_grad``
    (else None). Varlen as in :func:`flash_attn_fwd` (packed tensors, lse and dlse (Hq, total_q);
    no block table).
    """
    varlen = cu_seqlens_q is not None
    if varlen:   # in range on the device, as the forward read them
        cu_seqlens_q, cu_seqlens_k = clamp_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        total_q, Hq, D = q.shape
        B, Sq, Sk = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        stride_lb, stride_lh, rng_stride = 0, total_q, Sk
    else:
        B, Sq, Hq, D = q.shape
        Sk = k.shape[1]
        stride_lb, stride_lh, rng_stride = Hq * Sq, Sq, Sk
    Hkv, Dv = k.shape[-2], v.shape[-1]
    if dlse is not None:
        # read as (B, Hq, Sq) rows: autograd may hand over a transposed or expanded (stride 0) grad
        dlse = dlse.contiguous()
    dq = alloc.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = alloc.empty(k.shape, dtype=k.dtype, device=q.device)
    dv = alloc.empty(v.shape, dtype=v.dtype, device=q.device)
    # Entries of dbias outside every visited tile are masked out, so their gradient is 0.
    dbias = torch.zeros((B, Hq, Sq, Sk), dtype=torch.float32, device=q.device) if bias_grad else None
    _check_grid(B, Hq)
    if varlen and (B == 0 or k.shape[0] == 0):
        dq.zero_()  # no key anywhere: every gradient is 0 (dk, dv are empty then or zeroed below)
        dk.zero_()
        dv.zero_()
        return dq, dk, dv, dbias
    if B * Hq == 0 or (Sq == 0 and Sk == 0):
        return dq, dk, dv, dbias
    if varlen and Sk == 0:
        dq.zero_()
        return dq, dk, dv, dbias
    block_d, block_dv = _block(D), _block(Dv)
    bucket = max(block_d, block_dv)
    fp32 = q.dtype == torch.float32
    cfg_kv = _tile(tuning.FLASH_ATTN_BWD_DKDV_FP32 if fp32 else tuning.FLASH_ATTN_BWD_DKDV, q.device, bucket)
    cfg_q = _tile(tuning.FLASH_ATTN_BWD_DQ_FP32 if fp32 else tuning.FLASH_ATTN_BWD_DQ, q.device, bucket)
    left, right = window_size
    mask = attn_mask.view(torch.uint8) if attn_mask is not None else None
    tile_strides = [*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *_strides4(attn_bias), *_strides4(mask), Sk]
    int64_tiles = max(tile_strides) * max(cfg_kv.block_m, cfg_kv.block_n, cfg_q.block_m, cfg_q.block_n,
                                          block_d, block_dv) >= 2**31
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    lse2 = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    common = dict(
        EVEN_D=(D == block_d and Dv == block_dv),
        HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, HAS_SOFTCAP=softcap > 0,
        HAS_ALIBI=alibi_slopes is not None, HAS_BIAS=attn_bias is not None,
        HAS_MASK=mask is not None, HAS_DROPOUT=dropout_p > 0,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else None, INT64_TILES=int64_tiles,
        IS_VARLEN=varlen,
    )
    operands = (attn_bias if attn_bias is not None else q, mask if mask is not None else q,
                alibi_slopes if alibi_slopes is not None else q,
                cu_seqlens_q if varlen else q, cu_seqlens_k if varlen else q)
    operand_strides = (*_strides4(attn_bias), *_strides4(mask),
                       *(alibi_slopes.stride() if alibi_slopes is not None else (0, 0)), stride_lb, stride_lh)
    scalars = (Hq, Hq // Hkv, Sq, Sk, D, Dv, softmax_scale, softmax_scale * LOG2E,
               softmax_scale / softcap if softcap > 0 else 0.0, softcap * LOG2E,
               left, right, dropout_p, seed, offset, rng_stride)
    # Packed rows: the preprocessing sees one batch of total_q rows (its LSE is (1, Hq, total_q)).
    rows_out, rows_dout = (out[None], dout[None]) if varlen else (out, dout)
    rows = rows_out.shape[1]
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        if rows > 0:
            pre_m = 64 if not triton_interpreted() else 16
            launch(_flash_attn_bwd_preprocess_kernel, (cdiv(rows, pre_m), Hq, rows_out.shape[0]),
                rows_out, rows_dout, lse, dlse if dlse is not None else lse, delta, lse2,
                *rows_out.stride(), *rows_dout.stride(), Hq, rows, Dv,
                BLOCK_M=pre_m, BLOCK_DV=block_dv, HAS_DLSE=dlse is not None,
            )
        # varlen: a sequence holds at most k.shape[0] keys and q.shape[0] queries, whatever
        # max_seqlen_k and max_seqlen_q say (they size only the grid and the dropout counters)
        key_blocks = cdiv(min(Sk, k.shape[0]) if varlen else Sk, cfg_kv.block_n)
        query_blocks = cdiv(min(Sq, total_q) if varlen else Sq, cfg_q.block_m)
        if Sk > 0:
            launch(_flash_attn_bwd_dkdv_kernel, (key_blocks, Hkv, B),
                q, k, v, dout, lse2, delta, dk, dv, dbias if dbias is not None else q, *operands,
                *_strides_bthd(q, varlen), *_strides_bthd(k, varlen), *_strides_bthd(v, varlen),
                *_strides_bthd(dout, varlen), *_strides_bthd(dk, varlen), *_strides_bthd(dv, varlen),
                *operand_strides, *scalars,
                BLOCK_M=cfg_kv.block_m, BLOCK_N=cfg_kv.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
                HAS_DBIAS=bias_grad, **common,
                **cfg_kv.options(),
            )
        if Sq > 0:
            launch(_flash_attn_bwd_dq_kernel, (query_blocks, Hq, B),
                q, k, v, dout, lse2, delta, dq, *operands,
                *_strides_bthd(q, varlen), *_strides_bthd(k, varlen), *_strides_bthd(v, varlen),
                *_strides_bthd(dout, varlen), *_strides_bthd(dq, varlen),
                *operand_strides, *scalars,
                BLOCK_M=cfg_q.block_m, BLOCK_N=cfg_q.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
                **common,
                **cfg_q.options(),
            )
    return dq, dk, dv, dbias
