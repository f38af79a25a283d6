"""The attention forward (flash_attn_func, flash_attn_varlen_func, packed and paged variants).

FlashAttention-2's algorithm: one program per (query block, head, batch) keeps a running max and
sum of the scores in fp32 and rescales its accumulator as it walks the key blocks (Dao,
"FlashAttention-2", 2023). Scores live in the log2 domain (exp2 is the native instruction).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lanekit.attention import tuning
from lanekit.attention.kernels.common import (BAD_PAGE, LOG2E, MIN_K_8BIT, QUANT_DTYPES, _add_sinks, _block,
                                              _check_grid, _page_ids, _page_offsets, _pv_dot, _record, _strides4,
                                              _strides_bthd, _tile, _valid_pages, _varlen_bounds, clamp_varlen,
                                              quant_args)
from lanekit.common.numerics import tanh as _tanh
from lanekit.runtime import alloc, errors
from lanekit.runtime.host import cdiv
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.launch import launch
from lanekit.runtime.signature import contiguous_strides, meta, remember
from lanekit.runtime.tuning import compiling

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()


@triton.jit
def _flash_attn_fwd_inner(
    acc, l_i, m_i, q,
    k_base, v_base, bias_base, mask_base, rng_base,
    stride_kn, stride_kd, stride_vn, stride_vd,
    stride_bm, stride_bn, stride_mm, stride_mn,
    offs_m, offs_m_local, offs_d, offs_dv, pos_m,
    slope_log2, sm_scale_log2, softcap_scale, softcap_log2,
    Sq, Sk, D, Dv, window_left, window_right, dropout_p, seed, rng_stride,
    bt_row, page_size, stride_kpage, stride_vpage,
    lo, hi, num_blocks, ERR, PAGE_BIT,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr, INT64_TILES: tl.constexpr,
    PAGED: tl.constexpr, qk_descale=1.0, HAS_DESCALE: tl.constexpr = False, PV_FP16: tl.constexpr = False,
):
    offs_n_local = tl.arange(0, BLOCK_N)
    if INT64_TILES:
        offs_n_local = offs_n_local.to(tl.int64)
    for start_n in range(lo, hi, BLOCK_N):
        start_n64 = tl.cast(start_n, tl.int64)
        offs_n = start_n + offs_n_local                                       # [BLOCK_N]
        n_in = offs_n < Sk
        if PAGED:
            # key n of the sequence sits in page bt_row[n // page_size], at row n % page_size
            k_off, v_off, n_in, bad = _paged_rows(bt_row, offs_n, n_in, page_size, num_blocks, stride_kpage,
                                                  stride_kn, stride_vpage, stride_vn)
            _record(ERR, PAGE_BIT, bad)
            k_ptrs = k_base + k_off[None, :] + offs_d[:, None] * stride_kd
            v_ptrs = v_base + v_off[:, None] + offs_dv[None, :] * stride_vd
        else:
            k_ptrs = k_base + start_n64 * stride_kn + offs_n_local[None, :] * stride_kn + offs_d[:, None] * stride_kd
            v_ptrs = v_base + start_n64 * stride_vn + offs_n_local[:, None] * stride_vn + offs_dv[None, :] * stride_vd
        if MASKED:
            k = tl.load(k_ptrs, mask=n_in[None, :] & (offs_d[:, None] < D), other=0.0)     # [BLOCK_D, BLOCK_N]
            v = tl.load(v_ptrs, mask=n_in[:, None] & (offs_dv[None, :] < Dv), other=0.0)   # [BLOCK_N, BLOCK_DV]
        elif EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=offs_d[:, None] < D, other=0.0)
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < Dv, other=0.0)
        qk = tl.dot(q, k, input_precision=INPUT_PRECISION)                      # [BLOCK_M, BLOCK_N] fp32
        if HAS_DESCALE:  # fp8 (fp32 sums) or int8 (int32, exact) codes: the descales first, then the scale
            qk = qk.to(tl.float32) * qk_descale
        if HAS_SOFTCAP:
            s = softcap_log2 * _tanh(qk * softcap_scale)
        else:
            s = qk * sm_scale_log2

        # keep: inside the window and the mask; the additive terms (ALiBi, bias) go in b, log2 units
        keep = offs_m[:, None] < Sq
        if PAGED:
            if not MASKED:  # a page id out of range masks its keys, in any block
                keep = keep & n_in[None, :]
        if MASKED:
            keep = keep & n_in[None, :]
            if HAS_LEFT:
                keep = keep & (offs_n[None, :] >= pos_m[:, None] - window_left)
            if HAS_RIGHT:
                keep = keep & (offs_n[None, :] <= pos_m[:, None] + window_right)
        tile_in = (offs_m[:, None] < Sq) & n_in[None, :]
        if HAS_MASK:
            mk = tl.load(mask_base + start_n64 * stride_mn + offs_m_local[:, None] * stride_mm
                         + offs_n_local[None, :] * stride_mn, mask=tile_in, other=0)
            keep = keep & (mk != 0)
        if HAS_ALIBI or HAS_BIAS:
            b = tl.zeros_like(s)
            if HAS_ALIBI:
                b -= slope_log2 * tl.abs(pos_m[:, None] - offs_n[None, :]).to(tl.float32)
            if HAS_BIAS:
                bias = tl.load(bias_base + start_n64 * stride_bn + offs_m_local[:, None] * stride_bm
                               + offs_n_local[None, :] * stride_bn, mask=tile_in, other=0.0)
                b += bias.to(tl.float32) * 1.4426950408889634
            t = tl.where(keep, s + b, float("-inf"))
        else:
            t = tl.where(keep, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(t, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                    # all-masked row
        if HAS_ALIBI or HAS_BIAS:
            # (b - m) + s rather than (s + b) - m: with a bias far from zero, s + b would round
            # away the low bits of s; b - m is exact when b is near the row max.
            p = tl.math.exp2(tl.where(keep, (b - m_safe[:, None]) + s, float("-inf")))
        else:
            p = tl.math.exp2(t - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            counter = rng_base + offs_m_local[:, None].to(tl.int64) * rng_stride + offs_n[None, :]
            p = tl.where(tl.rand(seed, counter) >= dropout_p, p, 0.0)
        acc = acc * alpha[:, None] + _pv_dot(p, v, INPUT_PRECISION, PV_FP16)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _paged_rows(bt_row, offs_n, n_in, page_size, num_blocks, stride_kpage, stride_kn, stride_vpage, stride_vn):
    # K's and V's offsets of keys offs_n of one sequence in a paged cache (see _page_ids), the
    # keys still in (a page id outside [0, num_blocks) reads page 0 and masks its keys) and the
    # keys whose page was out of range.
    page = _page_ids(bt_row, offs_n, n_in, page_size)
    page, n_in, bad = _valid_pages(page, n_in, num_blocks)
    return (_page_offsets(page, offs_n, page_size, stride_kpage, stride_kn),
            _page_offsets(page, offs_n, page_size, stride_vpage, stride_vn), n_in, bad)


# Lengths, window sizes and the RNG state change from call to call: not specializing them keeps one
# compiled kernel per set of flags and tile sizes. So a mask along D (a runtime int) is not known to
# be constant in runs of 8, and every masked load along D would be 2 bytes wide, without cp.async:
# where D fills its block (EVEN_D), each kernel replaces D and Dv with the block sizes, constants,
# and its loads and stores along D stay 16 bytes wide.
@triton.jit(do_not_specialize=["Hq", "GROUP", "Sq", "Sk", "D", "Dv", "window_left", "window_right",
                               "dropout_p", "seed", "rng_offset", "stride_lb", "stride_lh", "rng_stride",
                               "page_size"])
def _flash_attn_fwd_kernel(
    Q, K, V, Out, Lse, Bias, Mask, Alibi, CuSeqQ, CuSeqK, BlockTable,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ab, stride_ah, stride_lb, stride_lh, stride_btb,
    Hq, GROUP, Sq, Sk, D, Dv,
    sm_scale_log2, softcap_scale, softcap_log2,
    window_left, window_right, dropout_p, seed, rng_offset, rng_stride, page_size,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    INT64_TILES: tl.constexpr, IS_VARLEN: tl.constexpr, PAGED: tl.constexpr,
    num_blocks, ERR, PAGE_BIT,
    Sinks=None, DescQ=None, DescK=None, DescV=None, stride_dqb=0, stride_dqh=0, stride_dkb=0, stride_dkh=0,
    stride_dvb=0, stride_dvh=0,
    HAS_SINKS: tl.constexpr = False, HAS_DESCALE: tl.constexpr = False, PV_FP16: tl.constexpr = False,
):
    if EVEN_D:  # D fills its block: see EVEN_D above _flash_attn_fwd_kernel
        D = BLOCK_D
        Dv = BLOCK_DV
    # Query blocks last to first: under a causal mask (a right window) the last ones see the
    # most keys, and starting the longest programs first keeps the grid's last wave short.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    start_m64 = start_m.to(tl.int64)
    # Varlen: sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of the packed q
    # (stride_qb is 0), its keys likewise, or its pages' with a block table; Sq and Sk are its own.
    q_start = 0
    k_start = 0
    if IS_VARLEN:
        q_start, Sq, k_start, Sk = _varlen_bounds(CuSeqQ, CuSeqK, b)
        if start_m >= Sq:
            return
    # Row (b, h, i) of the LSE, and of the dropout draws: b * stride_lb + h * stride_lh + i, with
    # the packed row index for i when varlen.
    row0 = b * stride_lb + h * stride_lh + q_start

    offs_m_local = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    if INT64_TILES:  # a stride so large that (block size) * stride overflows int32
        offs_m_local = offs_m_local.to(tl.int64)
        offs_d = offs_d.to(tl.int64)
        offs_dv = offs_dv.to(tl.int64)
    offs_m = start_m + offs_m_local                                              # [BLOCK_M]
    pos_m = offs_m + (Sk - Sq)                     # query i sits at key position i + Sk - Sq

    q_ptrs = (Q + b * stride_qb + h * stride_qh + (q_start + start_m64) * stride_qm
              + offs_m_local[:, None] * stride_qm + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < Sq) & (offs_d[None, :] < D), other=0.0)   # [BLOCK_M, BLOCK_D]
    if PAGED:  # K, V: (num_blocks, page_size, Hkv, D); stride_kb, stride_vb step a page
        k_base = K + hk * stride_kh
        v_base = V + hk * stride_vh
    else:
        k_base = K + b * stride_kb + k_start * stride_kn + hk * stride_kh
        v_base = V + b * stride_vb + k_start * stride_vn + hk * stride_vh
    bt_row = BlockTable + b * stride_btb
    bias_base = Bias + b * stride_bb + h * stride_bh + start_m64 * stride_bm
    mask_base = Mask + b * stride_mb + h * stride_mh + start_m64 * stride_mm
    rng_base = rng_offset + (row0 + start_m64) * rng_stride
    slope_log2 = 0.0
    if HAS_ALIBI:
        slope_log2 = tl.load(Alibi + b * stride_ab + h * stride_ah).to(tl.float32) * 1.4426950408889634

    # Key blocks this query block can see: [lo, hi). Inside it, [full_lo, full_hi) needs no
    # bound or window mask; the blocks on either side do.
    lo = 0
    hi = Sk
    if HAS_LEFT:
        lo = tl.maximum(start_m + (Sk - Sq) - window_left, 0) // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + (Sk - Sq) + window_right, 0), Sk)
    full_lo = lo
    if HAS_LEFT:
        full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + (Sk - Sq) - window_left, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = Sk // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        full_hi = tl.minimum(full_hi, tl.maximum(start_m + (Sk - Sq) + window_right + 1, 0) // BLOCK_N * BLOCK_N)
    full_hi = tl.maximum(full_hi, full_lo)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    qk_descale = 1.0
    if HAS_DESCALE:  # FlashAttention-3's descales, one per (sequence, KV head)
        qk_descale = tl.load(DescQ + b * stride_dqb + hk * stride_dqh) * tl.load(DescK + b * stride_dkb + hk * stride_dkh)
    # [lo, full_lo) masked (empty without a left window), [full_lo, full_hi) unmasked,
    # [full_hi, hi) masked
    if HAS_LEFT:
        acc, l_i, m_i = _flash_attn_fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, bias_base, mask_base, rng_base,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, stride_mm, stride_mn,
            offs_m, offs_m_local, offs_d, offs_dv, pos_m, slope_log2, sm_scale_log2, softcap_scale,
            softcap_log2, Sq, Sk, D, Dv, window_left, window_right, dropout_p, seed, rng_stride,
            bt_row, page_size, stride_kb, stride_vb, lo, full_lo, num_blocks, ERR, PAGE_BIT,
            BLOCK_N, True, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_MASK,
            HAS_DROPOUT, INPUT_PRECISION, INT64_TILES, PAGED,
            qk_descale, HAS_DESCALE, PV_FP16)
    acc, l_i, m_i = _flash_attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, bias_base, mask_base, rng_base,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, stride_mm, stride_mn,
        offs_m, offs_m_local, offs_d, offs_dv, pos_m, slope_log2, sm_scale_log2, softcap_scale,
        softcap_log2, Sq, Sk, D, Dv, window_left, window_right, dropout_p, seed, rng_stride,
        bt_row, page_size, stride_kb, stride_vb, full_lo, full_hi, num_blocks, ERR, PAGE_BIT,
        BLOCK_N, False, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_MASK,
        HAS_DROPOUT, INPUT_PRECISION, INT64_TILES, PAGED,
        qk_descale, HAS_DESCALE, PV_FP16)
    acc, l_i, m_i = _flash_attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, bias_base, mask_base, rng_base,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, stride_mm, stride_mn,
        offs_m, offs_m_local, offs_d, offs_dv, pos_m, slope_log2, sm_scale_log2, softcap_scale,
        softcap_log2, Sq, Sk, D, Dv, window_left, window_right, dropout_p, seed, rng_stride,
        bt_row, page_size, stride_kb, stride_vb, full_hi, hi, num_blocks, ERR, PAGE_BIT,
        BLOCK_N, True, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_MASK,
        HAS_DROPOUT, INPUT_PRECISION, INT64_TILES, PAGED,
        qk_descale, HAS_DESCALE, PV_FP16)

    if HAS_SINKS:  # each head's sink joins the denominator (gpt-oss)
        acc, l_i, m_i = _add_sinks(acc, l_i, m_i, tl.load(Sinks + h))
    empty = l_i == 0.0                                                           # no visible key
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    if HAS_DESCALE:
        out = out * tl.load(DescV + b * stride_dvb + hk * stride_dvh)
    if HAS_DROPOUT:
        out = out * (1.0 / (1.0 - dropout_p))
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    m_in = offs_m < Sq
    o_ptrs = (Out + b * stride_ob + h * stride_oh + (q_start + start_m64) * stride_om
              + offs_m_local[:, None] * stride_om + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_in[:, None] & (offs_dv[None, :] < Dv))
    tl.store(Lse + row0 + offs_m, lse, mask=m_in)


def flash_attn_fwd(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    attn_bias: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    seed: int,
    offset: int,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
    block_table: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward. Arguments are already validated and normalized by the public function:
    ``attn_bias``/``attn_mask`` are 4-D views expanded to (B, Hq, Sq, Sk) (stride 0 where
    broadcast), ``alibi_slopes`` is (B, Hq) (stride 0 over B when shared), ``window_size`` holds
    the causal mask. Returns out (B, Sq, Hq, Dv) in q's dtype and lse (B, Hq, Sq) fp32.

    Varlen (``cu_seqlens_q`` given, FlashAttention's ``flash_attn_varlen_func``): q is (total_q,
    Hq, D), k and v (total_k, Hkv, D) or, with ``block_table`` (B, max_pages) int32, paged as
    (num_blocks, page_size, Hkv, D); ``cu_seqlens_q``/``cu_seqlens_k`` (B + 1,) int32; no bias or
    mask. Returns out (total_q, Hq, Dv) and lse (Hq, total_q). Dropout draw (h, row, j) of the
    packed query row is counter offset + (h * total_q + row) * max_seqlen_k + j.

    ``sinks`` (Hq,) fp32: a logit per head in every row's denominator. fp8 or int8 q, k, v come
    with their (B, Hkv) fp32 descales (all three given) and ``out_dtype`` (bf16, fp16 or fp32):
    see ``common.quant_args`` for how P.V runs.
    """
    varlen = cu_seqlens_q is not None
    paged = block_table is not None
    if varlen:   # the lengths brought into range on the device (no value read back)
        cu_seqlens_q, cu_seqlens_k = clamp_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  block_table)
    key = (meta(q), meta(k), meta(v), meta(attn_bias), meta(attn_mask), meta(alibi_slopes), meta(cu_seqlens_q),
           meta(block_table), max_seqlen_q, max_seqlen_k, softmax_scale, window_size, softcap, dropout_p,
           out_dtype, triton_interpreted(), compiling())
    plan = _FWD_PLANS.get(key)
    if plan is None:
        plan = remember(_FWD_PLANS, key, _fwd_plan(q, k, v, attn_bias, attn_mask, alibi_slopes, cu_seqlens_q,
                                                   block_table, max_seqlen_q, max_seqlen_k, softmax_scale, window_size,
                                                   softcap, dropout_p, out_dtype))
    out = alloc.empty(plan.out_shape, dtype=plan.out_dtype, device=q.device)
    lse = alloc.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
    if plan.grid is None:
        return out, lse
    quant = quant_args(q, v, sinks, q_descale, k_descale, v_descale)
    # The mask is read as bytes: a bool tensor views as uint8 without a copy.
    mask = attn_mask.view(torch.uint8) if attn_mask is not None else None
    # Triton launches on the current device: make it q's.
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        launch(_flash_attn_fwd_kernel, plan.grid,
            q, k, v, out, lse,
            attn_bias if attn_bias is not None else q,
            mask if mask is not None else q,
            alibi_slopes if alibi_slopes is not None else q,
            cu_seqlens_q if varlen else q, cu_seqlens_k if varlen else q,
            block_table if paged else q,
            *plan.head, seed, offset, *plan.tail,
            **plan.constexprs, **quant, **plan.options,
            num_blocks=plan.num_blocks, ERR=errors.error_flag(q.device) if paged else q,
            PAGE_BIT=BAD_PAGE,
        )
    return out, lse


class _FwdPlan(NamedTuple):
    """A forward launch's metadata for one signature (flash_attn_fwd's key): the outputs' shapes
    and dtype, the grid (None: nothing to launch), and the kernel's arguments other than its
    tensors, the dropout seed and offset, and the sinks' and fp8 arguments (quant_args), in the
    kernel's order: ``head`` before seed and offset, ``tail`` after them."""
    out_shape: tuple
    lse_shape: tuple
    out_dtype: torch.dtype
    grid: tuple | None
    head: tuple = ()
    tail: tuple = ()
    constexprs: dict = {}
    options: dict = {}
    num_blocks: int = 0


_FWD_PLANS: dict = {}


def _fwd_plan(q, k, v, attn_bias, attn_mask, alibi_slopes, cu_seqlens_q, block_table, max_seqlen_q, max_seqlen_k,
              softmax_scale, window_size, softcap, dropout_p, out_dtype) -> _FwdPlan:
    """flash_attn_fwd's launch metadata, from its tensors' metadata and its scalars alone."""
    varlen, paged = cu_seqlens_q is not None, block_table is not None
    out_dtype = out_dtype or q.dtype
    if varlen:
        total_q, Hq, D = q.shape
        B, Sq, Sk = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        out_shape, lse_shape = (total_q, Hq, v.shape[-1]), (Hq, total_q)
        stride_lb, stride_lh, rng_stride = 0, total_q, Sk
    else:
        B, Sq, Hq, D = q.shape
        Sk = k.shape[1]
        out_shape, lse_shape = (B, Sq, Hq, v.shape[3]), (B, Hq, Sq)
        stride_lb, stride_lh, rng_stride = Hq * Sq, Sq, Sk
    Hkv, Dv = k.shape[-2], v.shape[-1]
    if math.prod(out_shape) == 0 or B == 0 or Sq == 0:
        return _FwdPlan(out_shape, lse_shape, out_dtype, None)
    _check_grid(B, Hq)

    block_d, block_dv = _block(D), _block(Dv)
    if q.dtype in QUANT_DTYPES:  # 8-bit products need k >= 32 (NVIDIA): q k^T over D, P.V over keys
        block_d = max(block_d, MIN_K_8BIT)
    table = tuning.FLASH_ATTN_FWD_FP32 if q.dtype == torch.float32 else tuning.FLASH_ATTN_FWD
    cfg = _tile(table, q.device, max(block_d, block_dv))
    if q.dtype in QUANT_DTYPES and cfg.block_n < MIN_K_8BIT:
        cfg = dataclasses.replace(cfg, block_n=MIN_K_8BIT)
    left, right = window_size
    # out is allocated contiguous (alloc.empty): its strides follow from its shape
    out_strides = contiguous_strides(out_shape)
    out_strides = (0, *out_strides) if varlen else out_strides
    # Tile offsets (row within a block times a stride) are int32 unless some stride is so large
    # that they would overflow; the block's own start is always int64.
    tile_strides = [*q.stride(), *k.stride(), *v.stride(), *_strides4(attn_bias), *_strides4(attn_mask)]
    int64_tiles = max(tile_strides) * max(cfg.block_m, cfg.block_n, block_d, block_dv) >= 2**31
    # A varlen sequence holds at most total_q queries: a larger max_seqlen_q would only add
    # programs that find no row (10**7 for 7 tokens took minutes interpreted).
    rows = min(Sq, total_q) if varlen else Sq
    head = (*_strides_bthd(q, varlen), *_strides_bthd(k, varlen, paged), *_strides_bthd(v, varlen, paged),
            *out_strides,
            *_strides4(attn_bias), *_strides4(attn_mask),
            *(alibi_slopes.stride() if alibi_slopes is not None else (0, 0)),
            stride_lb, stride_lh, block_table.stride(0) if paged else 0,
            Hq, Hq // Hkv, Sq, Sk, D, Dv,
            softmax_scale * LOG2E,
            softmax_scale / softcap if softcap > 0 else 0.0,
            softcap * LOG2E,
            left, right, dropout_p)
    return _FwdPlan(
        out_shape, lse_shape, out_dtype, (cdiv(rows, cfg.block_m), Hq, B), head,
        (rng_stride, k.shape[1] if paged else 1),
        dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
             EVEN_D=(D == block_d and Dv == block_dv),
             HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, HAS_SOFTCAP=softcap > 0,
             HAS_ALIBI=alibi_slopes is not None, HAS_BIAS=attn_bias is not None,
             HAS_MASK=attn_mask is not None, HAS_DROPOUT=dropout_p > 0,
             INPUT_PRECISION="ieee" if q.dtype == torch.float32 else None, INT64_TILES=int64_tiles,
             IS_VARLEN=varlen, PAGED=paged),
        cfg.options(), k.shape[0] if paged else 0)
