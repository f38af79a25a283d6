"""Attention over a KV cache (flash_attn_with_kvcache): decode and chunked prefill, and its
launcher, flash_attn_kvcache.

One program handles BLOCK_M rows of (query, head) pairs of one KV head, row r = i * GROUP + g for
query i and query head hk * GROUP + g, so that the GROUP heads sharing a KV head read each key once
(decode has one query: a tile of GROUP rows instead of one). The cache is read through a page
table: a contiguous cache (B_cache, S_cache, H, D) is one page of S_cache rows per sequence, and
with no table (HAS_TABLE false) sequence b reads row b, so that no table is built for it (a kernel
launch: 1% of decode at 4k keys on the H200). Keys are split across ``num_splits`` programs
(split-KV, FlashDecoding); each writes its normalized partial output and LSE, and a second kernel
merges them by their LSEs.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lanekit.attention import tuning
from lanekit.attention.kernels.common import (BAD_PAGE, BAD_SEQLENS, LOG2E, MIN_K_8BIT, QUANT_DTYPES, _add_sinks,
                                              _block, _check_grid, _page_ids, _page_offsets, _pv_dot, _record,
                                              _valid_pages, quant_args)
from lanekit.common.numerics import tanh as _tanh
from lanekit.kv_cache.kernels import BAD_SLOT
from lanekit.runtime import alloc, errors
from lanekit.runtime.host import cdiv, next_power_of_2
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.launch import launch
from lanekit.runtime.signature import contiguous_strides, meta, remember
from lanekit.runtime.tuning import compiling

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()


@triton.jit
def _block_page_ids(bt_row, start, first, s_hi, lp, page_size, page_shift, POW2_PAGE: tl.constexpr,
                    PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    # The pages (as stored, int32) of keys start .. start + BLOCK_N - 1 of one sequence, start a
    # multiple of BLOCK_N; keys outside [first, s_hi) get page 0, masked by the caller. PAGE (the
    # page size, a power of two dividing BLOCK_N, no left padding): one table load per page, each
    # entry repeated for its PAGE keys, a page holding no key of [first, s_hi) not looked up;
    # PAGE 0: a load per key (_page_ids).
    if PAGE:
        idx = start // PAGE + tl.arange(0, BLOCK_N // PAGE)                      # [BLOCK_N // PAGE]
        n = idx * PAGE
        ids = tl.load(bt_row + idx, mask=(n + PAGE > first) & (n < s_hi), other=0)
        pages = tl.reshape(tl.broadcast_to(ids[:, None], (BLOCK_N // PAGE, PAGE)), (BLOCK_N,))
    else:
        n = start + tl.arange(0, BLOCK_N)
        pages = _page_ids(bt_row, n + lp, (n >= first) & (n < s_hi), page_size, page_shift, POW2_PAGE)
    return pages


@triton.jit
def _kvcache_key_range(m_block, split, Sq, Sk, GROUP, window_left, window_right, num_splits,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
                       HAS_RIGHT: tl.constexpr):
    # Keys the rows of row block m_block can see, [lo, hi), cut into num_splits runs of whole
    # blocks; this program takes run ``split`` (possibly empty): [s_lo, s_hi), s_lo a block start.
    # first: no row sees a key before this one (never loaded).
    i_first = (m_block * BLOCK_M) // GROUP
    i_last = tl.minimum((m_block * BLOCK_M + BLOCK_M - 1) // GROUP, Sq - 1)
    lo = 0
    hi = Sk
    if HAS_LEFT:
        lo = tl.maximum(i_first + (Sk - Sq) - window_left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(i_last + (Sk - Sq) + window_right + 1, 0), Sk)
    first = lo
    lo = lo // BLOCK_N * BLOCK_N
    blocks = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    per_split = tl.cdiv(blocks, num_splits)
    s_lo = lo + split * per_split * BLOCK_N
    s_hi = tl.minimum(s_lo + per_split * BLOCK_N, hi)
    return first, s_lo, s_hi


@triton.jit
def _kvcache_bases(K, V, KScale, VScale, bt_row, b, hk, lp,
                   stride_kp, stride_kn, stride_kh, stride_vp, stride_vn, stride_vh,
                   stride_ksp, stride_ksn, stride_ksh, stride_vsp, stride_vsn, stride_vsh,
                   PAGES: tl.constexpr, HAS_TABLE: tl.constexpr):
    # KV head hk's K, V and scale pointers. A contiguous cache (PAGES 0) adds sequence b's row
    # (its table entry, or b without a table) and its left padding; paged caches add each key's
    # page in the loop.
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh
    ks_base = KScale + hk * stride_ksh
    vs_base = VScale + hk * stride_vsh
    if PAGES == 0:
        if HAS_TABLE:
            row = tl.load(bt_row).to(tl.int64)
        else:
            row = b
        k_base += row * stride_kp + lp * stride_kn
        v_base += row * stride_vp + lp * stride_vn
        ks_base += row * stride_ksp + lp * stride_ksn
        vs_base += row * stride_vsp + lp * stride_vsn
    return k_base, v_base, ks_base, vs_base


@triton.jit
def _contiguous_offsets(offs_n, stride_kn, stride_vn, stride_ksn, stride_vsn):
    # PAGES 0: keys offs_n of one page holding the whole sequence (int64: a cache may pass 2^31)
    return (offs_n.to(tl.int64) * stride_kn, offs_n.to(tl.int64) * stride_vn,
            offs_n.to(tl.int64) * stride_ksn, offs_n.to(tl.int64) * stride_vsn)


@triton.jit
def _whole_page_offsets(page, start_n, page_size, stride_kp, stride_kn, stride_vp, stride_vn,
                        stride_ksp, stride_ksn, stride_vsp, stride_vsn, BLOCK_N: tl.constexpr):
    # PAGES 1: the block of keys from start_n, all in page ``page`` (int64), from its row
    # start_n % page_size on
    in_page = (start_n % page_size + tl.arange(0, BLOCK_N)).to(tl.int64)
    return (page * stride_kp + in_page * stride_kn, page * stride_vp + in_page * stride_vn,
            page * stride_ksp + in_page * stride_ksn, page * stride_vsp + in_page * stride_vsn)


@triton.jit
def _key_page_offsets(pages, offs_n, lp, page_size, stride_kp, stride_kn, stride_vp, stride_vn,
                      stride_ksp, stride_ksn, stride_vsp, stride_vsn,
                      BLOCK_N: tl.constexpr, POW2_PAGE: tl.constexpr, PAGE: tl.constexpr):
    # PAGES 2: keys offs_n (cache positions offs_n + lp) in their ``pages``
    if PAGE:  # the block starts a page: key j of it sits at row j % PAGE, a constant
        keys = tl.arange(0, BLOCK_N)
        size = PAGE
    else:
        keys = offs_n + lp
        size = page_size
    k_off = _page_offsets(pages, keys, size, stride_kp, stride_kn, POW2_PAGE)
    v_off = _page_offsets(pages, keys, size, stride_vp, stride_vn, POW2_PAGE)
    ks_off = _page_offsets(pages, keys, size, stride_ksp, stride_ksn, POW2_PAGE)
    vs_off = _page_offsets(pages, keys, size, stride_vsp, stride_vsn, POW2_PAGE)
    return k_off, v_off, ks_off, vs_off


@triton.jit
def _kvcache_step(
    acc, l_i, m_i, q, k_base, v_base, ks_base, vs_base, k_off, v_off, ks_off, vs_off,
    offs_n, n_in, offs_d, offs_dv, row_in, pos, slope_log2, stride_kd, stride_vd,
    sm_scale_log2, softcap_scale, softcap_log2, D, Dv, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    QUANTIZED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    qk_descale=1.0, HAS_DESCALE: tl.constexpr = False, PV_FP16: tl.constexpr = False,
):
    # One block of keys offs_n (n_in: those this split owns) at the given offsets: the rows'
    # scores, masks and online-softmax update of (acc, l_i, m_i), as the forward's inner loop.
    k = tl.load(k_base + k_off[None, :] + offs_d[:, None] * stride_kd,
                mask=n_in[None, :] & (offs_d[:, None] < D), other=0.0)          # [BLOCK_D, BLOCK_N]
    v = tl.load(v_base + v_off[:, None] + offs_dv[None, :] * stride_vd,
                mask=n_in[:, None] & (offs_dv[None, :] < Dv), other=0.0)        # [BLOCK_N, BLOCK_DV]
    if QUANTIZED:
        # codes (int8 or e4m3) are exact in q's 16-bit type; each key's scale multiplies its
        # column of scores, each value's scale its column of probabilities
        k_scale = tl.load(ks_base + ks_off, mask=n_in, other=0.0)
        v_scale = tl.load(vs_base + vs_off, mask=n_in, other=0.0)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    qk = tl.dot(q, k, input_precision=INPUT_PRECISION)                          # [BLOCK_M, BLOCK_N]
    if QUANTIZED:
        qk = qk * k_scale[None, :]
    if HAS_DESCALE:  # an fp8/int8 q over a cache of its dtype: the descales before the scale
        qk = qk.to(tl.float32) * qk_descale
    if HAS_SOFTCAP:
        s = softcap_log2 * _tanh(qk * softcap_scale)
    else:
        s = qk * sm_scale_log2
    keep = row_in[:, None] & n_in[None, :]
    if HAS_LEFT:
        keep = keep & (offs_n[None, :] >= pos[:, None] - window_left)
    if HAS_RIGHT:
        keep = keep & (offs_n[None, :] <= pos[:, None] + window_right)
    if HAS_ALIBI:
        bias = -slope_log2[:, None] * tl.abs(pos[:, None] - offs_n[None, :]).to(tl.float32)
        t = tl.where(keep, s + bias, float("-inf"))
    else:
        t = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(t, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if HAS_ALIBI:
        p = tl.math.exp2(tl.where(keep, (bias - m_safe[:, None]) + s, float("-inf")))
    else:
        p = tl.math.exp2(t - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if QUANTIZED:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + _pv_dot(p, v, INPUT_PRECISION, PV_FP16)
    return acc, l_i, m_new


@triton.jit
def _kvcache_append(K, V, KNew, VNew, bt_row, b, hk, seqlen, s_new, capacity, num_blocks,
                    stride_kp, stride_kn, stride_kh, stride_kd, stride_vp, stride_vn, stride_vh, stride_vd,
                    stride_knb, stride_knt, stride_knh, stride_knd, stride_vnb, stride_vnt, stride_vnh, stride_vnd,
                    page_size, page_shift, D, Dv, ERR, SLOT_BIT,
                    PAGES: tl.constexpr, HAS_TABLE: tl.constexpr, POW2_PAGE: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    # flash_attn_with_kvcache's append, by one program of sequence b and KV head hk: new token t
    # to cache position seqlen + t (a page through the table; a contiguous cache's row). A page
    # outside [0, num_blocks) is not written and is recorded (SLOT_BIT), as the append kernel
    # records it (kv_cache.kernels.BAD_SLOT).
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kn_base = KNew + b * stride_knb + hk * stride_knh
    vn_base = VNew + b * stride_vnb + hk * stride_vnh
    bad = tl.zeros([BLOCK_N], dtype=tl.int32)
    for t0 in range(0, s_new, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        pos = seqlen + t
        ok = (t < s_new) & (pos >= 0) & (pos < capacity)
        if PAGES == 0:   # the sequence's row of a contiguous cache
            if HAS_TABLE:
                row = tl.load(bt_row).to(tl.int64)
            else:
                row = b
            k_off = row * stride_kp + pos.to(tl.int64) * stride_kn
            v_off = row * stride_vp + pos.to(tl.int64) * stride_vn
        else:
            pages = _page_ids(bt_row, pos, ok, page_size, page_shift, POW2_PAGE)
            pages, ok, bad_page = _valid_pages(pages, ok, num_blocks)
            bad = tl.maximum(bad, bad_page.to(tl.int32))
            k_off = _page_offsets(pages, pos, page_size, stride_kp, stride_kn, POW2_PAGE)
            v_off = _page_offsets(pages, pos, page_size, stride_vp, stride_vn, POW2_PAGE)
        t64 = t.to(tl.int64)
        kn = tl.load(kn_base + t64[:, None] * stride_knt + offs_d[None, :] * stride_knd,
                     mask=ok[:, None] & (offs_d[None, :] < D), other=0.0)
        tl.store(K + hk * stride_kh + k_off[:, None] + offs_d[None, :] * stride_kd, kn,
                 mask=ok[:, None] & (offs_d[None, :] < D))
        vn = tl.load(vn_base + t64[:, None] * stride_vnt + offs_dv[None, :] * stride_vnd,
                     mask=ok[:, None] & (offs_dv[None, :] < Dv), other=0.0)
        tl.store(V + hk * stride_vh + v_off[:, None] + offs_dv[None, :] * stride_vd, vn,
                 mask=ok[:, None] & (offs_dv[None, :] < Dv))
    _record(ERR, SLOT_BIT, bad > 0)


@triton.jit
def _kvcache_store(Out, Lse, acc, l_i, m_i, split, b, i, h, row_in, offs_dv, Dv,
                   stride_os, stride_ob, stride_om, stride_oh, stride_od,
                   stride_ls, stride_lb, stride_lh, stride_lm, Sinks=None, v_descale=1.0,
                   HAS_SINKS: tl.constexpr = False, HAS_DESCALE: tl.constexpr = False):
    # The rows' normalized output and LSE (natural log) into split ``split``'s partials (or the
    # output itself, unsplit); a row that saw no key gets 0 and -inf. HAS_SINKS (unsplit only:
    # the merge adds them otherwise): the rows' heads' sinks join the denominator.
    if HAS_SINKS:
        acc, l_i, m_i = _add_sinks(acc, l_i, m_i, tl.load(Sinks + h, mask=row_in, other=0.0))
    if HAS_DESCALE:
        acc = acc * v_descale
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    i64 = i.to(tl.int64)
    tl.store(Out + split * stride_os + b * stride_ob + i64[:, None] * stride_om + h[:, None] * stride_oh
             + offs_dv[None, :] * stride_od, out.to(Out.dtype.element_ty),
             mask=row_in[:, None] & (offs_dv[None, :] < Dv))
    tl.store(Lse + split * stride_ls + b * stride_lb + h * stride_lh + i64 * stride_lm, lse, mask=row_in)


@triton.jit(do_not_specialize=["Sq", "GROUP", "D", "Dv", "page_size", "page_shift", "window_left", "window_right",
                               "num_splits", "stride_btb"])
def _flash_attn_kvcache_kernel(
    Q, K, V, KScale, VScale, BlockTable, SeqLens, LeftPad, Alibi, Out, Lse,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kp, stride_kn, stride_kh, stride_kd,
    stride_vp, stride_vn, stride_vh, stride_vd,
    stride_ksp, stride_ksn, stride_ksh, stride_vsp, stride_vsn, stride_vsh,
    stride_btb, stride_ab, stride_ah,
    stride_os, stride_ob, stride_om, stride_oh, stride_od,
    stride_ls, stride_lb, stride_lh, stride_lm,
    Sq, GROUP, D, Dv, page_size, page_shift, window_left, window_right, num_splits,
    sm_scale_log2, softcap_scale, softcap_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_LEFTPAD: tl.constexpr, QUANTIZED: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, PAGES: tl.constexpr, EVEN_D: tl.constexpr, POW2_PAGE: tl.constexpr,
    HAS_TABLE: tl.constexpr, PAGES_AHEAD: tl.constexpr, PAGE: tl.constexpr,
    capacity, num_blocks, ERR, LEN_BIT, PAGE_BIT, s_new,
    Sinks=None, DescQ=None, DescK=None, DescV=None, stride_dqb=0, stride_dqh=0, stride_dkb=0, stride_dkh=0,
    stride_dvb=0, stride_dvh=0,
    HAS_SINKS: tl.constexpr = False, HAS_DESCALE: tl.constexpr = False, PV_FP16: tl.constexpr = False,
    KNew=None, VNew=None, stride_knb=0, stride_knt=0, stride_knh=0, stride_knd=0,
    stride_vnb=0, stride_vnt=0, stride_vnh=0, stride_vnd=0, SLOT_BIT=0, HAS_NEW: tl.constexpr = False,
):
    # HAS_NEW: the s_new tokens of KNew, VNew (B, s_new, Hkv, D / Dv) are appended here, not by a
    # kernel before: the first program of each (sequence, KV head) writes them into the cache
    # (_kvcache_append), and every program reads them from KNew, VNew (never from the cache, which
    # that program may still be writing): the key loop stops at the first new key and a second
    # loop takes the new keys. Unquantized caches only (codes are quantized on the way).
    # PAGES: how keys find their page. 0: the whole sequence is one page (a contiguous cache),
    # looked up once; 1: pages hold whole key blocks (page_size a multiple of BLOCK_N, no left
    # padding), one lookup per block; 2: any page_size, one lookup per key (POW2_PAGE: page_size
    # is 2^page_shift), or, where PAGE is not 0, blocks hold whole pages (page_size == PAGE, a
    # power of two dividing BLOCK_N, no left padding), one lookup per page. Pages are loaded a
    # block ahead of the K and V loads that need them (with PAGES 2 only where PAGES_AHEAD:
    # tuning.kvcache_pages_ahead).
    # Index values are checked here, not on the host (no device sync): a sequence whose length
    # or left padding is out of range (end outside [0, capacity], lp outside [0, end], a
    # contiguous cache's row outside [0, num_blocks)) reads no key; a page id outside
    # [0, num_blocks) masks its keys. Both are recorded in ERR (lanekit.check_errors()).
    if EVEN_D:  # D fills its block: see EVEN_D above fwd._flash_attn_fwd_kernel
        D = BLOCK_D
        Dv = BLOCK_DV
    pid = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    m_block = pid // num_splits
    split = pid % num_splits
    # The sequence's keys: cache positions [lp, end), key j at position lp + j.
    end = tl.load(SeqLens + b) + s_new      # the lengths before an append of s_new tokens
    lp = 0
    if HAS_LEFTPAD:
        lp = tl.load(LeftPad + b)
    seq_ok = (end >= 0) & (end <= capacity) & (lp >= 0) & (lp <= end)
    if PAGES == 0:
        if HAS_TABLE:
            row = tl.load(BlockTable + b * stride_btb)
            seq_ok = seq_ok & (row >= 0) & (row < num_blocks)
    end = tl.where(seq_ok, end, 0)
    lp = tl.where(seq_ok, lp, 0)
    tl.atomic_or(ERR, LEN_BIT, mask=(seq_ok == 0) & (pid == 0) & (hk == 0))
    Sk = end - lp
    if HAS_NEW:
        if (pid == 0) & seq_ok:   # a sequence out of range appends nothing (and reads no key)
            _kvcache_append(K, V, KNew, VNew, BlockTable + b * stride_btb, b, hk, end - s_new, s_new, capacity,
                            num_blocks, stride_kp, stride_kn, stride_kh, stride_kd, stride_vp, stride_vn, stride_vh,
                            stride_vd, stride_knb, stride_knt, stride_knh, stride_knd, stride_vnb, stride_vnt,
                            stride_vnh, stride_vnd, page_size, page_shift, D, Dv, ERR, SLOT_BIT,
                            PAGES, HAS_TABLE, POW2_PAGE, BLOCK_N, BLOCK_D, BLOCK_DV)

    r = m_block * BLOCK_M + tl.arange(0, BLOCK_M)                                 # [BLOCK_M]
    i = r // GROUP
    h = hk * GROUP + (r % GROUP)
    row_in = i < Sq
    pos = i + (Sk - Sq)                      # query i sits at key position i + Sk - Sq
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * stride_qb + i.to(tl.int64)[:, None] * stride_qm + h[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=row_in[:, None] & (offs_d[None, :] < D), other=0.0)
    slope_log2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slope_log2 = tl.load(Alibi + b * stride_ab + h * stride_ah, mask=row_in, other=0.0) * 1.4426950408889634

    first, s_lo, s_hi = _kvcache_key_range(m_block, split, Sq, Sk, GROUP, window_left, window_right, num_splits,
                                           BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    kv_hi = s_hi                        # the loop over the cache's keys ends here
    if HAS_NEW:                         # ... before the new keys, which the second loop reads
        kv_hi = tl.minimum(s_hi, Sk - s_new)
    bt_row = BlockTable + b * stride_btb
    k_base, v_base, ks_base, vs_base = _kvcache_bases(
        K, V, KScale, VScale, bt_row, b, hk, lp, stride_kp, stride_kn, stride_kh, stride_vp, stride_vn,
        stride_vh, stride_ksp, stride_ksn, stride_ksh, stride_vsp, stride_vsn, stride_vsh, PAGES, HAS_TABLE)
    # Paged caches: the loop loads each next block's pages a step ahead (see PAGES == 1 below).
    if PAGES == 1:
        next_page = tl.load(bt_row + s_lo // page_size, mask=s_lo < kv_hi, other=0).to(tl.int64)
    elif PAGES == 2 and PAGES_AHEAD:  # tuning.kvcache_pages_ahead
        next_pages = _block_page_ids(bt_row, s_lo, first, kv_hi, lp, page_size, page_shift, POW2_PAGE, PAGE,
                                     BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    qk_descale = 1.0
    v_descale = 1.0
    if HAS_DESCALE:  # FlashAttention-3's descales of (sequence b, KV head hk)
        qk_descale = tl.load(DescQ + b * stride_dqb + hk * stride_dqh) * tl.load(DescK + b * stride_dkb + hk * stride_dkh)
        v_descale = tl.load(DescV + b * stride_dvb + hk * stride_dvh)
    bad_pages = tl.zeros([BLOCK_N], dtype=tl.int32)
    for start_n in range(s_lo, kv_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)                                   # [BLOCK_N]
        n_in = (offs_n >= first) & (offs_n < kv_hi)
        if PAGES == 0:
            k_off, v_off, ks_off, vs_off = _contiguous_offsets(offs_n, stride_kn, stride_vn, stride_ksn, stride_vsn)
        elif PAGES == 1:
            # This block's page was loaded a step ago (a block past the run loads nothing). Its
            # K and V addresses then wait on no load of this step, and Triton's pipeliner gives
            # them num_stages - 1 blocks of lookahead instead of (num_stages - 1) // 2.
            page = next_page
            next_n = start_n + BLOCK_N
            next_page = tl.load(bt_row + next_n // page_size, mask=next_n < kv_hi, other=0).to(tl.int64)
            page_ok = (page >= 0) & (page < num_blocks)
            page = tl.where(page_ok, page, 0)
            bad_pages = tl.maximum(bad_pages, (n_in & (page_ok == 0)).to(tl.int32))
            n_in = tl.where(page_ok, n_in, False)   # (not n_in & page_ok: a tensor & scalar bool is not
            #                                        boolean in Triton 3.9's interpreter, and masks must be)
            k_off, v_off, ks_off, vs_off = _whole_page_offsets(
                page, start_n, page_size, stride_kp, stride_kn, stride_vp, stride_vn,
                stride_ksp, stride_ksn, stride_vsp, stride_vsn, BLOCK_N)
        else:
            if PAGES_AHEAD:
                pages = next_pages
                next_pages = _block_page_ids(bt_row, start_n + BLOCK_N, first, kv_hi, lp, page_size, page_shift,
                                             POW2_PAGE, PAGE, BLOCK_N)
            else:
                pages = _block_page_ids(bt_row, start_n, first, kv_hi, lp, page_size, page_shift, POW2_PAGE, PAGE,
                                        BLOCK_N)
            pages, n_in, bad = _valid_pages(pages, n_in, num_blocks)
            bad_pages = tl.maximum(bad_pages, bad.to(tl.int32))
            k_off, v_off, ks_off, vs_off = _key_page_offsets(
                pages, offs_n, lp, page_size, stride_kp, stride_kn, stride_vp, stride_vn,
                stride_ksp, stride_ksn, stride_vsp, stride_vsn, BLOCK_N, POW2_PAGE, PAGE)
        acc, l_i, m_i = _kvcache_step(
            acc, l_i, m_i, q, k_base, v_base, ks_base, vs_base, k_off, v_off, ks_off, vs_off,
            offs_n, n_in, offs_d, offs_dv, row_in, pos, slope_log2, stride_kd, stride_vd,
            sm_scale_log2, softcap_scale, softcap_log2, D, Dv, window_left, window_right,
            HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, QUANTIZED, INPUT_PRECISION,
            qk_descale, HAS_DESCALE, PV_FP16)
    _record(ERR, PAGE_BIT, bad_pages > 0)
    if HAS_NEW:   # the new keys [Sk - s_new, Sk) of this split's range, token t at row t of KNew, VNew
        new_lo = Sk - s_new
        kn_base = KNew + b * stride_knb + hk * stride_knh
        vn_base = VNew + b * stride_vnb + hk * stride_vnh
        # (not software-pipelined: a decode step's new keys are one block, and the pipeline's
        # buffers would cost the main loop registers)
        for start_n in tl.range(tl.maximum(s_lo, new_lo // BLOCK_N * BLOCK_N), s_hi, BLOCK_N, num_stages=1):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_in = (offs_n >= first) & (offs_n >= new_lo) & (offs_n < s_hi)
            t = (offs_n - new_lo).to(tl.int64)
            acc, l_i, m_i = _kvcache_step(
                acc, l_i, m_i, q, kn_base, vn_base, ks_base, vs_base, t * stride_knt, t * stride_vnt, t, t,
                offs_n, n_in, offs_d, offs_dv, row_in, pos, slope_log2, stride_knd, stride_vnd,
                sm_scale_log2, softcap_scale, softcap_log2, D, Dv, window_left, window_right,
                HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, False, INPUT_PRECISION,
                qk_descale, HAS_DESCALE, PV_FP16)

    _kvcache_store(Out, Lse, acc, l_i, m_i, split, b, i, h, row_in, offs_dv, Dv,
                   stride_os, stride_ob, stride_om, stride_oh, stride_od,
                   stride_ls, stride_lb, stride_lh, stride_lm, Sinks, v_descale, HAS_SINKS, HAS_DESCALE)


@triton.jit
def _merge_splits_kernel(
    OutP, LseP, Out, Lse,
    stride_ps, stride_pb, stride_pm, stride_ph, stride_pd,
    stride_ls, stride_lb, stride_lh, stride_lm,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_lob, stride_loh, stride_lom,
    num_splits, Dv,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
    Sinks=None, HAS_SINKS: tl.constexpr = False,
):
    # Row (b, i, h) of the output from its num_splits partials: weights exp(lse_s - max lse); a
    # partial with LSE -inf saw no key and weighs 0. All partials empty: out 0, lse -inf. The
    # value's features in chunks of BLOCK_DV (one chunk for flash_attn_with_kvcache's Dv <= 256;
    # MLA's 512 in several, so that BLOCK_S x BLOCK_DV partials stay in registers).
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_in = offs_s < num_splits
    lse = tl.load(LseP + offs_s.to(tl.int64) * stride_ls + b * stride_lb + h * stride_lh + i * stride_lm,
                  mask=s_in, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:  # head h's sink joins the merged denominator, once
        sink = tl.load(Sinks + h).to(tl.float32)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)                                                      # [BLOCK_S]
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.exp(sink - m_safe)
    o_rows = OutP + offs_s.to(tl.int64)[:, None] * stride_ps + b * stride_pb + i * stride_pm + h * stride_ph
    for d0 in range(0, Dv, BLOCK_DV):
        offs_d = d0 + tl.arange(0, BLOCK_DV)
        o = tl.load(o_rows + offs_d[None, :] * stride_pd, mask=(w[:, None] > 0) & (offs_d[None, :] < Dv),
                    other=0.0)                                                    # [BLOCK_S, BLOCK_DV]
        out = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
        tl.store(Out + b * stride_ob + i * stride_om + h * stride_oh + offs_d * stride_od,
                 out.to(Out.dtype.element_ty), mask=offs_d < Dv)
    tl.store(Lse + b * stride_lob + h * stride_loh + i * stride_lom,
             tl.where(total == 0.0, float("-inf"), m_safe + tl.log(tl.where(total == 0.0, 1.0, total))))


def _new_strides(k_new, v_new) -> dict:
    names = ("stride_knb", "stride_knt", "stride_knh", "stride_knd", "stride_vnb", "stride_vnt", "stride_vnh",
             "stride_vnd")
    return dict(zip(names, (*k_new.stride(), *v_new.stride()) if k_new is not None else (0,) * 8))


def flash_attn_kvcache(
    *,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    seqlens: torch.Tensor,
    leftpad: torch.Tensor | None,
    k_cache_scale: torch.Tensor | None,
    v_cache_scale: torch.Tensor | None,
    softmax_scale: float,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    num_splits: int,
    max_seqlen_k: int | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    s_new: int = 0,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, Sq, Hq, D) over a paged cache (num_blocks, page_size, Hkv, D), already
    validated: sequence b's keys are cache positions leftpad[b] .. seqlens[b] (int32, (B,)), found
    through ``block_table`` (B, max_pages) int32, or with None a contiguous cache whose row b is
    sequence b's (B_cache, S_cache, Hkv, D) (no table to build and read). A quantized cache (int8 /
    e4m3 codes) comes with its (num_blocks, page_size, Hkv) fp32 scales. Returns out (B, Sq, Hq,
    Dv) in q's dtype and lse (B, Hq, Sq) fp32. ``num_splits`` >= 1 splits each row's keys across that many programs;
    ``max_seqlen_k``, the most keys a sequence holds (None: unknown), picks the tile. ``sinks``
    (Hq,) fp32 and an fp8/int8 q over a cache of its dtype with (B, Hkv) descales and
    ``out_dtype``: as ``fwd.flash_attn_fwd`` (``common.quant_args``). ``s_new``: tokens just
    appended, added to every seqlens[b] in the kernel. ``k_new``, ``v_new`` (B, s_new, Hkv, D / Dv)
    in the cache's dtype (unquantized caches): the tokens to append, which the kernel writes at
    positions seqlens[b] + t itself (no append launch before it) while it reads them from here.
    """
    fused = k_new is not None and k_new.shape[1] > 0
    if fused and k_cache_scale is not None:
        raise ValueError("k_new: the fused append takes an unquantized cache (codes are appended by kv_cache's kernel)")
    key = (meta(q), meta(k_cache), meta(v_cache), meta(block_table), meta(seqlens), meta(leftpad),
           meta(k_cache_scale), meta(v_cache_scale), meta(alibi_slopes), softmax_scale, window_size, softcap,
           num_splits, max_seqlen_k, out_dtype, s_new, meta(k_new), meta(v_new), triton_interpreted(), compiling())
    plan = _KVCACHE_PLANS.get(key)
    if plan is None:
        plan = remember(_KVCACHE_PLANS, key, _kvcache_plan(
            q, k_cache, v_cache, block_table, seqlens, leftpad, k_cache_scale, v_cache_scale, softmax_scale,
            window_size, softcap, alibi_slopes, num_splits, max_seqlen_k, out_dtype, s_new, k_new, v_new))
    out = alloc.empty(plan.out_shape, dtype=plan.out_dtype, device=q.device)
    lse = alloc.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
    if plan.grid is None:
        return out, lse
    if num_splits > 1:
        part = torch.empty(plan.part_shape, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(plan.part_lse_shape, dtype=torch.float32, device=q.device)
        dest, dest_lse = part, part_lse
    else:
        dest, dest_lse = out, lse
    # sinks join in the kernel when unsplit, else in the merge
    quant = quant_args(q, v_cache, sinks if num_splits == 1 else None, q_descale, k_descale, v_descale)
    quantized = k_cache_scale is not None
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        launch(_flash_attn_kvcache_kernel, plan.grid,
            q, k_cache, v_cache,
            k_cache_scale if quantized else q, v_cache_scale if quantized else q,
            block_table if block_table is not None else seqlens, seqlens,
            leftpad if leftpad is not None else seqlens,
            alibi_slopes if alibi_slopes is not None else q, dest, dest_lse,
            *plan.args,
            **plan.constexprs, **quant, **plan.options,
            capacity=plan.capacity, num_blocks=k_cache.shape[0], ERR=errors.error_flag(q.device),
            LEN_BIT=BAD_SEQLENS, PAGE_BIT=BAD_PAGE, s_new=plan.s_new,
            KNew=k_new if fused else q, VNew=v_new if fused else q,
            **plan.new_strides, SLOT_BIT=BAD_SLOT if fused else 0, HAS_NEW=fused,
        )
        if num_splits > 1:
            launch(_merge_splits_kernel, plan.merge_grid,
                part, part_lse, out, lse, *plan.merge_args,
                **plan.merge_constexprs, num_warps=4,
                **({"Sinks": sinks.contiguous(), "HAS_SINKS": True} if sinks is not None else {}),
            )
    return out, lse


class _KVCachePlan(NamedTuple):
    """A decode launch's metadata for one signature (flash_attn_kvcache's key): the outputs'
    shapes and dtype, the grid (None: nothing to launch), the kernel's arguments after its
    tensors (``args``), its constexprs and compile options, the fused append's strides; with
    num_splits > 1 the partial results' shapes and the merge kernel's grid and arguments."""
    out_shape: tuple
    lse_shape: tuple
    out_dtype: torch.dtype
    grid: tuple | None
    args: tuple = ()
    constexprs: dict = {}
    options: dict = {}
    capacity: int = 0
    s_new: int = 0
    new_strides: dict = {}
    part_shape: tuple = ()
    part_lse_shape: tuple = ()
    merge_grid: tuple = ()
    merge_args: tuple = ()
    merge_constexprs: dict = {}


_KVCACHE_PLANS: dict = {}


def _kvcache_plan(q, k_cache, v_cache, block_table, seqlens, leftpad, k_cache_scale, v_cache_scale, softmax_scale,
                  window_size, softcap, alibi_slopes, num_splits, max_seqlen_k, out_dtype, s_new, k_new,
                  v_new) -> _KVCachePlan:
    """flash_attn_kvcache's launch metadata, from its tensors' metadata and its scalars alone."""
    B, Sq, Hq, D = q.shape
    Hkv, Dv = k_cache.shape[2], v_cache.shape[3]
    group, page_size = Hq // Hkv, k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if block_table is not None else page_size
    out_shape, lse_shape, out_dtype = (B, Sq, Hq, Dv), (B, Hq, Sq), out_dtype or q.dtype
    if B * Sq * Hq * Dv == 0:
        return _KVCachePlan(out_shape, lse_shape, out_dtype, None)
    _check_grid(B, Hkv, "KV heads")
    block_d, block_dv = _block(D), _block(Dv)
    if q.dtype in QUANT_DTYPES:  # 8-bit q k^T needs k >= 32 (NVIDIA)
        block_d = max(block_d, MIN_K_8BIT)
    fp32, bucket = q.dtype == torch.float32, max(block_d, block_dv)

    cfg, layout = tuning.kvcache_tile(q.device, bucket, fp32=fp32, page_size=page_size,
                                      one_page=block_table is None or block_table.shape[1] == 1,
                                      leftpad=leftpad is not None, max_keys=max_seqlen_k,
                                      interpreted=triton_interpreted())
    # Rows are (query, head) pairs: decode (Sq * group <= 16) takes the smallest tile tl.dot allows.
    block_m = tuning.kvcache_block_m(cfg, Sq * group)
    m_blocks = cdiv(Sq * group, block_m)
    left, right = window_size
    part_shape, part_lse_shape = (num_splits, B, Sq, Hq, Dv), (num_splits, B, Hq, Sq)
    if num_splits > 1:
        o_strides, l_strides = contiguous_strides(part_shape), contiguous_strides(part_lse_shape)
    else:
        o_strides, l_strides = (0, *contiguous_strides(out_shape)), (0, *contiguous_strides(lse_shape))
    quantized = k_cache_scale is not None
    fused = k_new is not None and k_new.shape[1] > 0
    scale_strides = (*k_cache_scale.stride(), *v_cache_scale.stride()) if quantized else (0,) * 6
    args = (*q.stride(), *k_cache.stride(), *v_cache.stride(), *scale_strides,
            block_table.stride(0) if block_table is not None else 0,
            *(alibi_slopes.stride() if alibi_slopes is not None else (0, 0)),
            *o_strides, *l_strides,
            Sq, group, D, Dv, page_size, page_size.bit_length() - 1, left, right, num_splits,
            softmax_scale * LOG2E,
            softmax_scale / softcap if softcap > 0 else 0.0,
            softcap * LOG2E)
    constexprs = dict(
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, HAS_SOFTCAP=softcap > 0,
        HAS_ALIBI=alibi_slopes is not None, HAS_LEFTPAD=leftpad is not None, QUANTIZED=quantized,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else None, EVEN_D=(D == block_d and Dv == block_dv),
        HAS_TABLE=block_table is not None, PAGES=layout.pages, POW2_PAGE=layout.pow2_page, PAGE=layout.page,
        PAGES_AHEAD=layout.pages_ahead)
    merge_args = (*contiguous_strides(part_shape), *contiguous_strides(part_lse_shape), *contiguous_strides(out_shape),
                  *contiguous_strides(lse_shape), num_splits, Dv)
    return _KVCachePlan(
        out_shape, lse_shape, out_dtype, (m_blocks * num_splits, Hkv, B), args, constexprs, cfg.options(),
        capacity, k_new.shape[1] if fused else s_new, _new_strides(k_new if fused else None, v_new if fused else None),
        part_shape, part_lse_shape, (Sq, Hq, B), merge_args,
        dict(BLOCK_S=max(2, next_power_of_2(num_splits)), BLOCK_DV=block_dv))
