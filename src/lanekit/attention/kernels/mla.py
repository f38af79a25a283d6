"""MLA decode over a paged latent cache (flash_mla_with_kvcache), and its launcher, flash_mla_kvcache.

Every query head reads the same cached row (512 latent + 64 rope features in DeepSeek V3), so the
kernel is laid out for reuse rather than for streaming: one program takes a block of BLOCK_H rows
of (query, head) pairs (row r = i * GROUP + g: query i, head hk * GROUP + g) of one sequence and
one split of its keys, loads each block of BLOCK_N cached rows once, and runs both products on it
from the same tile: scores = q_nope . latent^T + q_pe . rope^T ([BLOCK_H, BLOCK_N], the D = 576 dot
in its two chunks, 512 + 64), then out += P . latent ([BLOCK_H, 512]), with an online softmax in
fp32 between them. At H = 128 that is 2 * 128 * (576 + 512) FLOPs per 1152-byte bf16 row, above the
H200's ridge point: the tensor cores, not the memory, set the pace (docs/tuning/mla.md).

Keys are split across ``num_splits`` programs (split-KV); the partials (out normalized, LSE) are
merged by decode's ``_merge_splits_kernel`` in chunks of the 512-wide value. The block table and
cache_seqlens are device values that are never read back: a page id outside [0, num_blocks) or a
length outside [0, max_pages * page_size] is masked in the kernel (the keys it names are not read
and count for nothing) and recorded in the device-side error flag (lanekit.check_errors()).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from lanekit.attention import tuning
from lanekit.attention.kernels.common import LOG2E, _check_grid
from lanekit.attention.kernels.decode import _merge_splits_kernel
from lanekit.runtime import alloc, errors
from lanekit.runtime.lanes import triton_interpreted

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

# The device-side error flash_mla_with_kvcache records (lanekit.runtime.errors).
BAD_MLA_INDEX = errors.register(
    "flash_mla_with_kvcache: a cache_seqlens value outside [0, max_pages * page_size] (clamped into it), "
    "or a block_table page id outside [0, num_blocks) where a sequence has tokens (those keys were not "
    "read and counted for nothing)")


@triton.jit
def _mla_pages(bt_row, start, s_hi, num_blocks, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    # Keys start .. start + BLOCK_N - 1 of one sequence: their pages (int64; 0 where not live),
    # whether each is a key before s_hi, and whether its page id is in [0, num_blocks).
    offs_n = start + tl.arange(0, BLOCK_N)
    n_in = offs_n < s_hi
    page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_in, other=0).to(tl.int64)
    page_ok = (page >= 0) & (page < num_blocks)
    return tl.where(n_in & page_ok, page, 0), n_in, page_ok


@triton.jit(do_not_specialize=["Sq", "GROUP", "num_blocks", "max_pages", "num_splits", "m_blocks", "stride_btb"])
def _flash_mla_kvcache_kernel(
    Q, KV, Scale, BlockTable, SeqLens, Out, Lse, Flag,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kp, stride_kn, stride_kh, stride_kd,
    stride_sp, stride_sn, stride_sh,
    stride_btb,
    stride_os, stride_ob, stride_om, stride_oh, stride_od,
    stride_ls, stride_lb, stride_lh, stride_lm,
    Sq, GROUP, num_blocks, max_pages, num_splits, m_blocks, bad_bit,
    sm_scale_log2,
    DV: tl.constexpr, D_ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr,
    IS_CAUSAL: tl.constexpr, QUANTIZED: tl.constexpr,
):
    # Grid: (m_blocks * num_splits, Hkv, B), the row blocks of one split adjacent, so that the
    # programs reading the same keys (H = 128: two blocks of 64 heads) run side by side and the
    # second read of a cached row comes from L2.
    pid = tl.program_id(0)
    m_block = pid % m_blocks
    split = pid // m_blocks
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    seqlen = tl.load(SeqLens + b).to(tl.int64)
    capacity = max_pages.to(tl.int64) * PAGE_SIZE
    bad_len = (seqlen < 0) | (seqlen > capacity)
    Sk = tl.minimum(tl.maximum(seqlen, 0), capacity)

    r = m_block * BLOCK_H + tl.arange(0, BLOCK_H)                                  # [BLOCK_H]
    i = r // GROUP
    h = hk * GROUP + (r % GROUP)
    row_in = i < Sq
    pos = i + (Sk - Sq)                      # query i sits at key position i + Sk - Sq
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_R)
    q_row = Q + b * stride_qb + i.to(tl.int64) * stride_qm + h * stride_qh          # [BLOCK_H]
    q_nope = tl.load(q_row[:, None] + offs_v[None, :] * stride_qd,
                     mask=row_in[:, None] & (offs_v[None, :] < DV), other=0.0)      # [BLOCK_H, BLOCK_DV]
    if D_ROPE > 0:
        q_pe = tl.load(q_row[:, None] + (DV + offs_r)[None, :] * stride_qd,
                       mask=row_in[:, None] & (offs_r[None, :] < D_ROPE), other=0.0)  # [BLOCK_H, BLOCK_R]

    # This split's keys [s_lo, s_hi): the block's visible keys [0, hi) in num_splits runs of
    # whole blocks (causal: hi stops after the last row's query position).
    hi = Sk
    if IS_CAUSAL:
        i_last = tl.minimum((m_block * BLOCK_H + BLOCK_H - 1) // GROUP, Sq - 1)
        hi = tl.minimum(tl.maximum(i_last + (Sk - Sq) + 1, 0), Sk)
    per_split = tl.cdiv(tl.cdiv(hi, BLOCK_N), num_splits)
    s_lo = split * per_split * BLOCK_N
    s_hi = tl.minimum(s_lo + per_split * BLOCK_N, hi)

    bt_row = BlockTable + b * stride_btb
    kv_head = KV + hk * stride_kh
    # each block's pages are loaded a step ahead of the cache loads that need them, so that those
    # wait on no load of their own step (as decode's PAGES_AHEAD)
    next_pages, next_in, next_ok = _mla_pages(bt_row, s_lo, s_hi, num_blocks, PAGE_SIZE, BLOCK_N)
    bad_keys = tl.zeros([BLOCK_N], dtype=tl.int32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for start_n in range(s_lo, s_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)                                     # [BLOCK_N]
        page, n_in, page_ok = next_pages, next_in, next_ok
        next_pages, next_in, next_ok = _mla_pages(bt_row, start_n + BLOCK_N, s_hi, num_blocks, PAGE_SIZE, BLOCK_N)
        live = n_in & page_ok
        bad_keys = tl.maximum(bad_keys, (n_in & ~page_ok).to(tl.int32))
        row = page * stride_kp + (offs_n % PAGE_SIZE).to(tl.int64) * stride_kn          # [BLOCK_N] int64
        kv = tl.load(kv_head + row[:, None] + offs_v[None, :] * stride_kd,
                     mask=live[:, None] & (offs_v[None, :] < DV), other=0.0)          # [BLOCK_N, BLOCK_DV]
        kv = kv.to(Q.dtype.element_ty)       # codes are exact in 16 bits; values already are
        s = tl.dot(q_nope, tl.trans(kv))                                              # [BLOCK_H, BLOCK_N]
        if D_ROPE > 0:  # the rope chunk accumulates into the same scores (no second tile of them)
            k_pe = tl.load(kv_head + row[:, None] + (DV + offs_r)[None, :] * stride_kd,
                           mask=live[:, None] & (offs_r[None, :] < D_ROPE), other=0.0)
            s = tl.dot(q_pe, tl.trans(k_pe.to(Q.dtype.element_ty)), s)
        if QUANTIZED:
            scale = tl.load(Scale + page * stride_sp + (offs_n % PAGE_SIZE).to(tl.int64) * stride_sn
                            + hk * stride_sh, mask=live, other=0.0)                    # [BLOCK_N]
            s = s * scale[None, :]
        keep = row_in[:, None] & live[None, :]
        if IS_CAUSAL:
            keep = keep & (offs_n[None, :] <= pos[:, None])
        s = tl.where(keep, s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANTIZED:
            p = p * scale[None, :]
        # rescaled, then accumulated into by the product itself: no second [BLOCK_H, BLOCK_DV] tile
        acc = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None])
        m_i = m_new

    bad = bad_len | (tl.max(bad_keys, 0) > 0)
    tl.atomic_or(Flag, bad_bit, mask=bad)
    # the rows' normalized output and natural-log LSE into split ``split``'s partials (or the
    # output itself, unsplit); a row that saw no key gets 0 and -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    i64 = i.to(tl.int64)
    split = split.to(tl.int64)                # the partials may pass 2^31 elements
    tl.store(Out + split * stride_os + b * stride_ob + i64[:, None] * stride_om + h[:, None] * stride_oh
             + offs_v[None, :] * stride_od, out.to(Out.dtype.element_ty),
             mask=row_in[:, None] & (offs_v[None, :] < DV))
    tl.store(Lse + split * stride_ls + b * stride_lb + h * stride_lh + i64 * stride_lm, lse, mask=row_in)


def flash_mla_kvcache(
    *,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool,
    k_cache_scale: torch.Tensor | None,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode of q (B, Sq, H, D) over a paged cache (num_blocks, page_size, Hkv, D), already
    validated (metadata only: the index values are masked in the kernel). V is the first
    ``head_dim_v`` features of each cached row; a cache of codes (int8, e4m3, e5m2) comes with its
    (num_blocks, page_size, Hkv) fp32 scales. ``num_splits`` >= 1 splits each sequence's keys
    across that many programs, merged by their LSEs. Returns out (B, Sq, H, head_dim_v) in q's
    dtype and lse (B, H, Sq) fp32, natural log."""
    B, Sq, H, D = q.shape
    num_blocks, page_size, Hkv, _ = k_cache.shape
    group, Dv = H // Hkv, head_dim_v
    out = alloc.empty((B, Sq, H, Dv), dtype=q.dtype, device=q.device)
    lse = alloc.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    _check_grid(B, Hkv, "KV heads")
    cfg = tuning.mla_tile(q.device, Sq * group, interpreted=triton_interpreted())
    block_h = tuning.mla_block_h(cfg, Sq * group)
    m_blocks = triton.cdiv(Sq * group, block_h)
    block_dv = tuning.head_dim_block(Dv)
    block_r = tuning.head_dim_block(D - Dv) if D > Dv else 16
    if num_splits > 1:
        part = torch.empty((num_splits, B, Sq, H, Dv), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_splits, B, H, Sq), dtype=torch.float32, device=q.device)
        dest, dest_lse = part, part_lse
        o_strides, l_strides = part.stride(), part_lse.stride()
    else:
        dest, dest_lse = out, lse
        o_strides, l_strides = (0, *out.stride()), (0, *lse.stride())
    quantized = k_cache_scale is not None
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _flash_mla_kvcache_kernel[(m_blocks * num_splits, Hkv, B)](
            q, k_cache, k_cache_scale if quantized else q, block_table, cache_seqlens, dest, dest_lse,
            errors.error_flag(q.device),
            *q.stride(), *k_cache.stride(), *(k_cache_scale.stride() if quantized else (0, 0, 0)),
            block_table.stride(0), *o_strides, *l_strides,
            Sq, group, num_blocks, block_table.shape[1], num_splits, m_blocks, BAD_MLA_INDEX,
            softmax_scale * LOG2E,
            DV=Dv, D_ROPE=D - Dv, PAGE_SIZE=page_size,
            BLOCK_H=block_h, BLOCK_N=cfg.block_n, BLOCK_DV=block_dv, BLOCK_R=block_r,
            IS_CAUSAL=causal, QUANTIZED=quantized, **cfg.options(),
        )
        if num_splits > 1:
            _merge_splits_kernel[(Sq, H, B)](
                part, part_lse, out, lse, *part.stride(), *part_lse.stride(), *out.stride(), *lse.stride(),
                num_splits, Dv, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
                BLOCK_DV=min(block_dv, tuning.MLA_MERGE_CHUNK), num_warps=4,
            )
    return out, lse
