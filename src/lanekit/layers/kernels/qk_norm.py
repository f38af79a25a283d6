"""QK-norm of q and k in one launch: a per-head RMSNorm, RoPE and optionally a per-(token, head)
quantization (``_qk_norm_rope_fwd_kernel``), and the backward of RMSNorm + RoPE without
quantization (``_rms_norm_rope_bwd_kernel``), q and k in one launch too.

Offsets in ``_qk_norm_rope_fwd_kernel`` are int32 within a row (its launcher checks they fit), and
int32 for its rows too unless some tensor's offsets reach 2^31 (ROW_OFFSET_LIMIT); the quantized
path's rare redone tiles take their scales in fp64."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.common.numerics import (cast_codes as _cast_codes, max_nan as _max_nan, power_of_two as _power_of_two,
                                     quantize as _quantize,
                                     reciprocal_power as _reciprocal_power, unit_exponent as _unit_exponent)
from lanekit.layers import tuning
from lanekit.layers.kernels.rotary import _rotary_pairs, _rotary_tokens
from lanekit.layers.kernels.shared import _load_f32, _prefetch_rows, _row_scale, _store, _stride, _to_f32
from lanekit.runtime.alloc import empty
from lanekit.runtime.host import cdiv, next_power_of_2
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.launch import launch

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()


@triton.jit
def _pick(is_k, k_value, q_value):
    """k's value in a k program, q's in a q program (program-uniform scalars and pointers)."""
    return tl.where(is_k, k_value, q_value)


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
def _qk_scale(ra, rb, rest, ss, row_mask, x_rows, stride_xd, W, stride_w, offset, da, db, offs_i, offs_d,
              is_rest, pair_mask, rest_mask, COS, SIN, pos, stride_cs, stride_cd, stride_ss, stride_sd, HALF,
              D, eps, qmax, BLOCK_D: tl.constexpr, POW2_D: tl.constexpr, EVEN: tl.constexpr,
              HAS_WEIGHT: tl.constexpr, HAS_REST: tl.constexpr):
    """(ra, rb, rest, amax, scale, slow_tile) in the quantized _qk_norm_rope_fwd_kernel: u = (ra, rb,
    rest) = RoPE(x * (offset + w)), max |u| per row, the rows' scales (fp32 [ROWS]), and whether the
    tile was redone from x (then u is that of x * p, p a power of two per row)."""
    amax = _abs_max(ra, rb, rest, HAS_REST)                                                  # [ROWS]
    # Rows whose max |u| lies outside [2^-100, 2^100) (all zero, tiny, huge or not finite)
    # take u from x * p instead, p a power of two that brings max |u| into [1, 2) (see the
    # oracle); rows whose sum of squares lies below 2^-100, or whose scale would not be a
    # normal fp32 number, their scale from fp64. All are rare, so the tile is redone, from x
    # reloaded (in the oracle too, row by row: p is 1 elsewhere).
    t = amax * tl.math.rsqrt(_mean(ss, D, BLOCK_D, POW2_D) + eps)            # scale * qmax, or inf
    redo = row_mask & ~((amax >= 2.0 ** -100) & (amax < 2.0 ** 100))
    slow = redo | (row_mask & ~((ss >= 2.0 ** -100) & (t >= qmax * 2.0 ** -126)
                                & (t < qmax * 2.0 ** 127)))
    slow_tile = tl.max(slow.to(tl.int32), axis=0) > 0
    if slow_tile:
        ra, rb, rest, amax, scale = _qk_redo(
            amax, redo, x_rows, stride_xd, W, stride_w, offset, da, db, offs_i, offs_d, is_rest, pair_mask,
            rest_mask, COS, SIN, pos, stride_cs, stride_cd, stride_ss, stride_sd, HALF, D, eps, qmax, EVEN,
            HAS_WEIGHT, HAS_REST)
    else:
        scale = t * (1.0 / qmax)
    scale = tl.where(amax == 0, 1.0, scale)
    return ra, rb, rest, amax, scale, slow_tile


@triton.jit
def _qk_redo(amax, redo, x_rows, stride_xd, W, stride_w, offset, da, db, offs_i, offs_d, is_rest, pair_mask,
             rest_mask, COS, SIN, pos, stride_cs, stride_cd, stride_ss, stride_sd, HALF, D, eps, qmax,
             EVEN: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_REST: tl.constexpr):
    """(ra, rb, rest, amax, scale) of a redone tile in _qk_scale: u from x * p (p 1 in the rows not
    in ``redo``), its max |u|, and the scales from fp64."""
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
    return ra, rb, rest, amax, scale


@triton.jit
def _qk_codes(ra, rb, rest, amax, slow_tile, qmax, QUANT: tl.constexpr, HAS_REST: tl.constexpr):
    """The codes (ra, rb, rest) of u in _qk_norm_rope_fwd_kernel: u * qmax / max |u|, rounded to
    int8 (QUANT 1) or fp8 e4m3 (QUANT 2), clamped to the code range in redone tiles alone; NaN
    (fp8; stored as cast_codes' 0x7F) or 0 (int8) in a row whose max |u| is not finite."""
    # one correctly rounded division per row, a product per element (an IEEE division per
    # element made this kernel compute-bound: about 30 instructions each on sm90), bounded so
    # that an all-zero row's is finite
    inv = tl.minimum(tl.math.div_rn(tl.full(amax.shape, qmax, tl.float32), amax), 2.0 ** 127)
    # a row whose scale is NaN (max |u| inf or NaN): every code NaN (fp8) or 0 (int8), the
    # NaN-visible rule (docs/semantics.md); the hardware's min would have dropped the NaN
    inv = tl.where(amax < float("inf"), inv, float("nan"))[:, None]
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
    return ra, rb, rest


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
    # registers (on the H200: docs/tuning/layers.md, ROTARY). Only its tokens differ from this
    # tile's: the rest of its addresses is this tile's, computed once.
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
        # rows whose fp32 sum of squares over- or underflowed (|x| past about 1e19, or tiny; see
        # norm.py), rare: the tile is taken again from x * p, p = 2^k per row bringing max |x|
        # into [1, 2) (exact; 1 in the other rows, which keep their bits), with eps p^2
        at_ends = row_mask & ~((ss >= 2.0 ** -60) & (ss < float("inf")))
        if tl.max(at_ends.to(tl.int32), axis=0) > 0:
            p = tl.where(at_ends, _row_scale(_abs_max(a, bb, rest, HAS_REST), eps), 1.0)
            a = a * p[:, None]
            bb = bb * p[:, None]
            if HAS_REST:
                rest = rest * p[:, None]
            ss = _square_sum(a, bb, rest, HAS_REST)
            rstd = (1.0 / tl.sqrt(_mean(ss, D, BLOCK_D, POW2_D) + (eps * p) * p))[:, None]
        else:
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
        ra, rb, rest, amax, scale, slow_tile = _qk_scale(
            ra, rb, rest, ss, row_mask, x_rows, stride_xd, W, stride_w, offset, da, db, offs_i, offs_d,
            is_rest, pair_mask, rest_mask, COS, SIN, pos, stride_cs, stride_cd, stride_ss, stride_sd, HALF, D,
            eps, qmax, BLOCK_D, POW2_D, EVEN, HAS_WEIGHT, HAS_REST)
        _store(_pick(is_k, K_SCALE, Q_SCALE) + row, scale, row_mask, EVEN)
        ra, rb, rest = _qk_codes(ra, rb, rest, amax, slow_tile, qmax, QUANT, HAS_REST)
    o_rows = (_pick(is_k, K_OUT, Q_OUT) + row * (BLOCK_D if POW2_D else D))[:, None]
    _store(o_rows + da[None, :], _cast_codes(ra, Q_OUT.dtype.element_ty, QUANT), pair_mask, EVEN)
    _store(o_rows + db[None, :], _cast_codes(rb, Q_OUT.dtype.element_ty, QUANT), pair_mask, EVEN)
    if HAS_REST:
        tl.store(o_rows + offs_d[None, :], _cast_codes(rest, Q_OUT.dtype.element_ty, QUANT), mask=rest_mask)


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
        # the statistics of x * p, p = 2^k bringing the row's max |x| into [1, 2): exact, so the
        # same bits as x's where its fp32 sum of squares neither over- nor underflows, and right
        # where it would (|x| past about 1e19, or tiny; see norm.py); rstd(x) = rstd * p
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(xa), axis=1), tl.max(tl.abs(xb), axis=1)),
                          tl.max(tl.abs(xr), axis=1))
        p_row = _row_scale(amax, eps)
        p = p_row[:, None]
        xa, xb, xr = xa * p, xb * p, xr * p
        ss = tl.sum(xa * xa, axis=1) + tl.sum(xb * xb, axis=1) + tl.sum(xr * xr, axis=1)
        # rows past the sequence: 0, not 1 / sqrt(0 + eps) (inf for eps 0, NaN in the weight's sum)
        rstd = tl.where(row_mask, 1.0 / tl.sqrt(ss / D + (eps * p_row) * p_row), 0.0)[:, None]
        xa, xb, xr = xa * rstd, xb * rstd, xr * rstd    # xhat
        ga, gb, gr = dn_a * wa[None, :], dn_b * wb[None, :], dn_r * wr[None, :]
        c1 = (tl.sum(ga * xa, axis=1) + tl.sum(gb * xb, axis=1) + tl.sum(gr * xr, axis=1)) / D
        c1 = c1[:, None]
        tl.store(dx_rows + da[None, :] * stride_dxd, (((ga - xa * c1) * rstd) * p).to(DX.dtype.element_ty),
                 mask=pair_mask)
        tl.store(dx_rows + db[None, :] * stride_dxd, (((gb - xb * c1) * rstd) * p).to(DX.dtype.element_ty),
                 mask=pair_mask)
        tl.store(dx_rows + offs_d[None, :] * stride_dxd, (((gr - xr * c1) * rstd) * p).to(DX.dtype.element_ty),
                 mask=rest_mask)
        dwa += tl.sum(dn_a * xa, axis=0)
        dwb += tl.sum(dn_b * xb, axis=0)
        dwr += tl.sum(dn_r * xr, axis=0)
    if HAS_WEIGHT:
        tl.store(DW_PART + part + da, dwa, mask=offs_i < HALF)
        tl.store(DW_PART + part + db, dwb, mask=offs_i < HALF)
        tl.store(DW_PART + part + offs_d, dwr, mask=is_rest)


_QUANT_CODES = {None: 0, torch.int8: 1, torch.float8_e4m3fn: 2}


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
    return next_power_of_2(max(cdiv(n * t.element_size(), _LINE), 1))


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
    block_h = min(next_power_of_2(max(min(HQ, HK) if HK else HQ, 1)), rows)
    block_s = max(1, rows // block_h)
    q_head_blocks = cdiv(HQ, block_h)
    head_blocks = q_head_blocks + cdiv(HK, block_h)   # a constexpr: % and // by it are cheap
    s_blocks = cdiv(S, block_s)
    grid = (s_blocks * head_blocks, 1, B)
    block_half = next_power_of_2(max(half, 1))
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
    launch(_qk_norm_rope_fwd_kernel, grid,
        q, k, q_out, k_out, q_w, k_w, q_sc, k_sc, cos, sin, pos,
        seqlen_offsets if offsets_tensor else None,
        *q.stride(), *k.stride(), _stride(q_weight), _stride(k_weight), *cos.stride(), *sin.stride(), *pos_strides,
        S, HQ, HK, D, rot_start, half, q_head_blocks, 0 if offsets_tensor else int(seqlen_offsets),
        eps, offset, ahead,
        BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_D=next_power_of_2(D), HAS_REST=rotary_dim < D, INTERLEAVED=interleaved,
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
    s_blocks = cdiv(S, block_s)
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
        launch(_rms_norm_rope_bwd_kernel, (s_blocks, 2 if HK else 1, B),
            dq_out, dk_out, q, k, dq, dk, cos, sin, position_ids,
            seqlen_offsets if offsets_tensor else None, q_w, k_w, q_p, k_p,
            *dq_out.stride(), *dk_out.stride(), *q.stride(), *k.stride(), *dq.stride(), *dk.stride(),
            *cos.stride(), *sin.stride(), *pos_strides, _stride(q_weight), _stride(k_weight),
            S, HQ, HK, D, half, 0 if offsets_tensor else int(seqlen_offsets), eps, offset,
            BLOCK_S=block_s, BLOCK_HALF=next_power_of_2(max(half, 1)),
            BLOCK_D=next_power_of_2(D), INTERLEAVED=interleaved,
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
