"""Triton kernels for attention, and their launchers.

The forward is FlashAttention-2's algorithm: one program per (query block, head, batch) keeps a
running max and sum of the scores in fp32 and rescales its accumulator as it walks the key blocks
(Dao, "FlashAttention-2", 2023). Scores live in the log2 domain (exp2 is the native instruction).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from lanekit.common.numerics import tanh as _tanh

from lanekit.runtime import alloc, tuning
from lanekit.runtime.lanes import triton_interpreted

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

LOG2E = 1.4426950408889634
MAX_GRID_YZ = 65535  # CUDA's limit on grid dimensions 1 and 2 (heads, batch)


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
    lo, hi,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr, INT64_TILES: tl.constexpr,
    PAGED: tl.constexpr,
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
            k_off, v_off = _paged_rows(bt_row, offs_n, n_in, page_size, stride_kpage, stride_kn,
                                       stride_vpage, stride_vn)
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
        if HAS_SOFTCAP:
            s = softcap_log2 * _tanh(qk * softcap_scale)
        else:
            s = qk * sm_scale_log2

        # keep: inside the window and the mask; the additive terms (ALiBi, bias) go in b, log2 units
        keep = offs_m[:, None] < Sq
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
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _varlen_bounds(CuSeqQ, CuSeqK, b):
    # Sequence b of a packed batch: its first query row and query count, its first key row
    # (unused with a block table, whose pages place the keys) and key count. Starts are int64.
    q_lo = tl.load(CuSeqQ + b)
    Sq = tl.load(CuSeqQ + b + 1) - q_lo
    k_lo = tl.load(CuSeqK + b)
    Sk = tl.load(CuSeqK + b + 1) - k_lo
    return q_lo.to(tl.int64), Sq, k_lo.to(tl.int64), Sk


@triton.jit
def _page_ids(bt_row, offs_n, n_in, page_size, page_shift=0, POW2_PAGE: tl.constexpr = False):
    # The pages bt_row[n // page_size] of keys offs_n (>= 0) of one sequence, as stored (int32);
    # keys past the sequence (not n_in) read none and get page 0, masked by the caller.
    # POW2_PAGE: page_size == 2^page_shift, so a shift instead of an integer division by a runtime
    # value (about 20 instructions per key on sm90).
    if POW2_PAGE:
        return tl.load(bt_row + (offs_n >> page_shift), mask=n_in, other=0)
    return tl.load(bt_row + offs_n // page_size, mask=n_in, other=0)


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
def _page_offsets(page, offs_n, page_size, stride_page, stride_n, POW2_PAGE: tl.constexpr = False):
    # Offsets of keys offs_n in their pages ``page`` of a paged cache (num_blocks, page_size, H,
    # D): row n % page_size of the page; int64, as a page's offset may pass 2^31.
    if POW2_PAGE:
        row = (offs_n & (page_size - 1)).to(tl.int64)
    else:
        row = (offs_n % page_size).to(tl.int64)
    return page.to(tl.int64) * stride_page + row * stride_n


@triton.jit
def _paged_rows(bt_row, offs_n, n_in, page_size, stride_kpage, stride_kn, stride_vpage, stride_vn):
    # K's and V's offsets of keys offs_n of one sequence in a paged cache (see _page_ids).
    page = _page_ids(bt_row, offs_n, n_in, page_size)
    return (_page_offsets(page, offs_n, page_size, stride_kpage, stride_kn),
            _page_offsets(page, offs_n, page_size, stride_vpage, stride_vn))


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
    # [lo, full_lo) masked (empty without a left window), [full_lo, full_hi) unmasked,
    # [full_hi, hi) masked
    if HAS_LEFT:
        acc, l_i, m_i = _flash_attn_fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, bias_base, mask_base, rng_base,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, stride_mm, stride_mn,
            offs_m, offs_m_local, offs_d, offs_dv, pos_m, slope_log2, sm_scale_log2, softcap_scale,
            softcap_log2, Sq, Sk, D, Dv, window_left, window_right, dropout_p, seed, rng_stride,
            bt_row, page_size, stride_kb, stride_vb, lo, full_lo,
            BLOCK_N, True, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_MASK,
            HAS_DROPOUT, INPUT_PRECISION, INT64_TILES, PAGED)
    acc, l_i, m_i = _flash_attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, bias_base, mask_base, rng_base,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, stride_mm, stride_mn,
        offs_m, offs_m_local, offs_d, offs_dv, pos_m, slope_log2, sm_scale_log2, softcap_scale,
        softcap_log2, Sq, Sk, D, Dv, window_left, window_right, dropout_p, seed, rng_stride,
        bt_row, page_size, stride_kb, stride_vb, full_lo, full_hi,
        BLOCK_N, False, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_MASK,
        HAS_DROPOUT, INPUT_PRECISION, INT64_TILES, PAGED)
    acc, l_i, m_i = _flash_attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, bias_base, mask_base, rng_base,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, stride_mm, stride_mn,
        offs_m, offs_m_local, offs_d, offs_dv, pos_m, slope_log2, sm_scale_log2, softcap_scale,
        softcap_log2, Sq, Sk, D, Dv, window_left, window_right, dropout_p, seed, rng_stride,
        bt_row, page_size, stride_kb, stride_vb, full_hi, hi,
        BLOCK_N, True, EVEN_D, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_MASK,
        HAS_DROPOUT, INPUT_PRECISION, INT64_TILES, PAGED)

    empty = l_i == 0.0                                                           # no visible key
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    if HAS_DROPOUT:
        out = out * (1.0 / (1.0 - dropout_p))
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    m_in = offs_m < Sq
    o_ptrs = (Out + b * stride_ob + h * stride_oh + (q_start + start_m64) * stride_om
              + offs_m_local[:, None] * stride_om + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_in[:, None] & (offs_dv[None, :] < Dv))
    tl.store(Lse + row0 + offs_m, lse, mask=m_in)


def _strides4(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    return tuple(t.stride()) if t is not None else (0, 0, 0, 0)


def _block(d: int) -> int:
    return tuning.head_dim_block(d)


def _strides_bthd(t: torch.Tensor, varlen: bool, paged: bool = False) -> tuple[int, int, int, int]:
    """Strides of a (B, S, H, D) operand: a packed (total, H, D) one has batch stride 0; a paged
    cache (num_blocks, page_size, H, D) passes its page stride in the batch slot."""
    if varlen and not paged:
        return (0, *t.stride())
    return tuple(t.stride())


def _tile(table: dict, device: torch.device, bucket: int) -> tuning.TileConfig:
    """The tile row for this device's architecture and head-dim bucket; the interpreter's own."""
    return tuning.INTERPRETER if triton_interpreted() else tuning.lookup(table, device, bucket)


def _check_grid(B: int, H: int, heads: str = "heads") -> None:
    if B > MAX_GRID_YZ or H > MAX_GRID_YZ:
        raise ValueError(f"q: the Triton lane runs at most {MAX_GRID_YZ} batches and {heads} "
                         f"(grid dimensions 1 and 2), got B={B}, {'Hq' if heads == 'heads' else 'Hkv'}={H}")


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
    """
    varlen = cu_seqlens_q is not None
    paged = block_table is not None
    if varlen:
        total_q, Hq, D = q.shape
        B, Sq, Sk = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        out = alloc.empty((total_q, Hq, v.shape[-1]), dtype=q.dtype, device=q.device)
        lse = alloc.empty((Hq, total_q), dtype=torch.float32, device=q.device)
        stride_lb, stride_lh, rng_stride = 0, total_q, Sk
    else:
        B, Sq, Hq, D = q.shape
        Sk = k.shape[1]
        out = alloc.empty((B, Sq, Hq, v.shape[3]), dtype=q.dtype, device=q.device)
        lse = alloc.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
        stride_lb, stride_lh, rng_stride = Hq * Sq, Sq, Sk
    Hkv, Dv = k.shape[-2], v.shape[-1]
    if out.numel() == 0 or B == 0 or Sq == 0:
        return out, lse
    _check_grid(B, Hq)

    block_d, block_dv = _block(D), _block(Dv)
    table = tuning.FLASH_ATTN_FWD_FP32 if q.dtype == torch.float32 else tuning.FLASH_ATTN_FWD
    cfg = _tile(table, q.device, max(block_d, block_dv))
    left, right = window_size
    # The mask is read as bytes: a bool tensor views as uint8 without a copy.
    mask = attn_mask.view(torch.uint8) if attn_mask is not None else None
    # Tile offsets (row within a block times a stride) are int32 unless some stride is so large
    # that they would overflow; the block's own start is always int64.
    tile_strides = [*q.stride(), *k.stride(), *v.stride(), *_strides4(attn_bias), *_strides4(mask)]
    int64_tiles = max(tile_strides) * max(cfg.block_m, cfg.block_n, block_d, block_dv) >= 2**31
    grid = (triton.cdiv(Sq, cfg.block_m), Hq, B)
    # Triton launches on the current device: make it q's.
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _flash_attn_fwd_kernel[grid](
            q, k, v, out, lse,
            attn_bias if attn_bias is not None else q,
            mask if mask is not None else q,
            alibi_slopes if alibi_slopes is not None else q,
            cu_seqlens_q if varlen else q, cu_seqlens_k if varlen else q,
            block_table if paged else q,
            *_strides_bthd(q, varlen), *_strides_bthd(k, varlen, paged), *_strides_bthd(v, varlen, paged),
            *_strides_bthd(out, varlen),
            *_strides4(attn_bias), *_strides4(mask),
            *(alibi_slopes.stride() if alibi_slopes is not None else (0, 0)),
            stride_lb, stride_lh, block_table.stride(0) if paged else 0,
            Hq, Hq // Hkv, Sq, Sk, D, Dv,
            softmax_scale * LOG2E,
            softmax_scale / softcap if softcap > 0 else 0.0,
            softcap * LOG2E,
            left, right, dropout_p, seed, offset, rng_stride, k.shape[1] if paged else 1,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
            EVEN_D=(D == block_d and Dv == block_dv),
            HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, HAS_SOFTCAP=softcap > 0,
            HAS_ALIBI=alibi_slopes is not None, HAS_BIAS=attn_bias is not None,
            HAS_MASK=mask is not None, HAS_DROPOUT=dropout_p > 0,
            INPUT_PRECISION="ieee" if q.dtype == torch.float32 else None, INT64_TILES=int64_tiles,
            IS_VARLEN=varlen, PAGED=paged,
            **cfg.options(),
        )
    return out, lse


# --------------------------------------------------------------------------------------------
# Backward (FlashAttention-2's algorithm). The probabilities are recomputed from the forward's
# LSE; with z the score after scale, softcap, ALiBi and bias, and P = softmax(z):
#   dV = P^T dO,  dP = dO V^T,  dZ = P * (dP - Delta),  Delta_i = sum_d dO_id O_id - dLSE_i,
#   dX = dZ * (1 - tanh^2) under softcap (X = q k^T * scale),  dQ = scale dX K,  dK = scale dX^T Q.
# With dropout, dV and dP use the dropped-and-rescaled P, regenerated from the forward's seed.
# One kernel computes Delta. One computes dK and dV per key block, walking the query blocks (and,
# for GQA, every query head sharing its KV head, so dK and dV are never summed across programs).
# One computes dQ per query block, walking the key blocks. That recomputes P and dP (7 matrix
# products where FlashAttention-2 does 5 and adds dQ up with atomics), but on the H200 it ran
# faster than fp32 atomic adds of dQ from the dK/dV kernel (263 vs 243 TFLOP/s forward+backward,
# D=128 causal; 320 vs 290 at D=64), whose extra accumulator spilled registers. No atomics, so
# the gradients are deterministic.
# As in the forward, only tiles that cross a window edge or the end of a sequence apply the
# masks: elsewhere a row past the end has LSE +inf (so P = 0) and a key past the end is zero.
# --------------------------------------------------------------------------------------------


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
    if EVEN_D:  # D fills its block: see EVEN_D above _flash_attn_fwd_kernel
        D = BLOCK_D
        Dv = BLOCK_DV
    # One program: key block pid_n of KV head hk in batch b. Tiles are transposed, keys as rows
    # ([BLOCK_N, BLOCK_M]), so that P^T and dS^T feed the dot products without a transpose.
    pid_n = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    start_n = pid_n * BLOCK_N
    start_n64 = start_n.to(tl.int64)
    q_start = 0
    k_start = 0
    if IS_VARLEN:
        q_start, Sq, k_start, Sk = _varlen_bounds(CuSeqQ, CuSeqK, b)
        if start_n >= Sk:
            return
    offs_n_local = tl.arange(0, BLOCK_N)
    offs_m_local = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    if INT64_TILES:
        offs_n_local = offs_n_local.to(tl.int64)
        offs_m_local = offs_m_local.to(tl.int64)
        offs_d = offs_d.to(tl.int64)
        offs_dv = offs_dv.to(tl.int64)
    offs_n = start_n + offs_n_local                                                 # [BLOCK_N]
    n_in = offs_n < Sk
    k = tl.load(K + b * stride_kb + hk * stride_kh + (k_start + start_n64) * stride_kn
                + offs_n_local[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=n_in[:, None] & (offs_d[None, :] < D), other=0.0)             # [BLOCK_N, BLOCK_D]
    v = tl.load(V + b * stride_vb + hk * stride_vh + (k_start + start_n64) * stride_vn
                + offs_n_local[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=n_in[:, None] & (offs_dv[None, :] < Dv), other=0.0)           # [BLOCK_N, BLOCK_DV]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # Query blocks that see this key block: [m_lo, m_hi). Inside it, [full_lo, full_hi) needs no
    # bound or window mask (none when this key block runs past Sk); the blocks on either side do.
    shift = Sk - Sq                                # query i sits at key position i + shift
    m_lo = 0
    m_hi = Sq
    if HAS_RIGHT:
        m_lo = tl.maximum(start_n - window_right - shift, 0) // BLOCK_M * BLOCK_M
    if HAS_LEFT:
        m_hi = tl.minimum(tl.maximum(start_n + BLOCK_N + window_left - shift, 0), Sq)
    full_lo = m_lo
    if HAS_RIGHT:
        full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - window_right - shift, 0), BLOCK_M) * BLOCK_M
        full_lo = tl.minimum(tl.maximum(full_lo, m_lo), m_hi)
    full_hi = Sq // BLOCK_M * BLOCK_M
    if HAS_LEFT:
        full_hi = tl.minimum(full_hi, tl.maximum(start_n + window_left - shift + 1, 0) // BLOCK_M * BLOCK_M)
    full_hi = tl.where(start_n + BLOCK_N > Sk, full_lo, tl.maximum(full_hi, full_lo))
    h0 = hk * GROUP                                # the first query head on this KV head
    q_base = Q + b * stride_qb + h0 * stride_qh + q_start * stride_qm
    do_base = DOut + b * stride_dob + h0 * stride_doh + q_start * stride_dom
    bias_base = Bias + b * stride_bb + h0 * stride_bh + start_n64 * stride_bn
    mask_base = Mask + b * stride_mb + h0 * stride_mh + start_n64 * stride_mn
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

    dk_ptrs = (DK + b * stride_dkb + hk * stride_dkh + (k_start + start_n64) * stride_dkn
               + offs_n_local[:, None] * stride_dkn + offs_d[None, :] * stride_dkd)
    dv_ptrs = (DV + b * stride_dvb + hk * stride_dvh + (k_start + start_n64) * stride_dvn
               + offs_n_local[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd)
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
    if EVEN_D:  # D fills its block: see EVEN_D above _flash_attn_fwd_kernel
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
    q_start = 0
    k_start = 0
    if IS_VARLEN:
        q_start, Sq, k_start, Sk = _varlen_bounds(CuSeqQ, CuSeqK, b)
        if start_m >= Sq:
            return
    offs_m_local = tl.arange(0, BLOCK_M)
    offs_n_local = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    if INT64_TILES:
        offs_m_local = offs_m_local.to(tl.int64)
        offs_n_local = offs_n_local.to(tl.int64)
        offs_d = offs_d.to(tl.int64)
        offs_dv = offs_dv.to(tl.int64)
    offs_m = start_m + offs_m_local                                                 # [BLOCK_M]
    m_in = offs_m < Sq
    q = tl.load(Q + b * stride_qb + h * stride_qh + (q_start + start_m64) * stride_qm
                + offs_m_local[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=m_in[:, None] & (offs_d[None, :] < D), other=0.0)             # [BLOCK_M, BLOCK_D]
    do = tl.load(DOut + b * stride_dob + h * stride_doh + (q_start + start_m64) * stride_dom
                 + offs_m_local[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                 mask=m_in[:, None] & (offs_dv[None, :] < Dv), other=0.0)          # [BLOCK_M, BLOCK_DV]
    row_base = b * stride_lb + h * stride_lh + q_start                              # LSE row of (b, h, 0)
    lse2 = tl.load(Lse2 + row_base + offs_m, mask=m_in, other=float("inf"))
    delta = tl.load(Delta + row_base + offs_m, mask=m_in, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh + k_start * stride_kn
    v_base = V + b * stride_vb + hk * stride_vh + k_start * stride_vn
    bias_base = Bias + b * stride_bb + h * stride_bh + start_m64 * stride_bm
    mask_base = Mask + b * stride_mb + h * stride_mh + start_m64 * stride_mm
    rng_base = rng_offset + (row_base + start_m64) * rng_stride
    slope_log2 = 0.0
    if HAS_ALIBI:
        slope_log2 = tl.load(Alibi + b * stride_ab + h * stride_ah).to(tl.float32) * 1.4426950408889634

    # Key blocks this query block sees: [lo, hi), and inside it [full_lo, full_hi) without masks
    # (none when this query block runs past Sq), as in the forward.
    shift = Sk - Sq
    lo = 0
    hi = Sk
    if HAS_LEFT:
        lo = tl.maximum(start_m + shift - window_left, 0) // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + shift + window_right, 0), Sk)
    full_lo = lo
    if HAS_LEFT:
        full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + shift - window_left, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = Sk // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        full_hi = tl.minimum(full_hi, tl.maximum(start_m + shift + window_right + 1, 0) // BLOCK_N * BLOCK_N)
    full_hi = tl.where(start_m + BLOCK_M > Sq, full_lo, tl.maximum(full_hi, full_lo))
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
    tl.store(DQ + b * stride_dqb + h * stride_dqh + (q_start + start_m64) * stride_dqm
             + offs_m_local[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
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
    if varlen:
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
            _flash_attn_bwd_preprocess_kernel[(triton.cdiv(rows, pre_m), Hq, rows_out.shape[0])](
                rows_out, rows_dout, lse, dlse if dlse is not None else lse, delta, lse2,
                *rows_out.stride(), *rows_dout.stride(), Hq, rows, Dv,
                BLOCK_M=pre_m, BLOCK_DV=block_dv, HAS_DLSE=dlse is not None,
            )
        if Sk > 0:
            _flash_attn_bwd_dkdv_kernel[(triton.cdiv(Sk, cfg_kv.block_n), Hkv, B)](
                q, k, v, dout, lse2, delta, dk, dv, dbias if dbias is not None else q, *operands,
                *_strides_bthd(q, varlen), *_strides_bthd(k, varlen), *_strides_bthd(v, varlen),
                *_strides_bthd(dout, varlen), *_strides_bthd(dk, varlen), *_strides_bthd(dv, varlen),
                *operand_strides, *scalars,
                BLOCK_M=cfg_kv.block_m, BLOCK_N=cfg_kv.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
                HAS_DBIAS=bias_grad, **common,
                **cfg_kv.options(),
            )
        if Sq > 0:
            _flash_attn_bwd_dq_kernel[(triton.cdiv(Sq, cfg_q.block_m), Hq, B)](
                q, k, v, dout, lse2, delta, dq, *operands,
                *_strides_bthd(q, varlen), *_strides_bthd(k, varlen), *_strides_bthd(v, varlen),
                *_strides_bthd(dout, varlen), *_strides_bthd(dq, varlen),
                *operand_strides, *scalars,
                BLOCK_M=cfg_q.block_m, BLOCK_N=cfg_q.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
                **common,
                **cfg_q.options(),
            )
    return dq, dk, dv, dbias


# --------------------------------------------------------------------------------------------
# Attention over a KV cache (flash_attn_with_kvcache): decode and chunked prefill. One program
# handles BLOCK_M rows of (query, head) pairs of one KV head, row r = i * GROUP + g for query i
# and query head hk * GROUP + g, so that the GROUP heads sharing a KV head read each key once
# (decode has one query: a tile of GROUP rows instead of one). The cache is read through a page
# table: a contiguous cache (B_cache, S_cache, H, D) is one page of S_cache rows per sequence,
# and with no table (HAS_TABLE false) sequence b reads row b, so that no table is built for it
# (a kernel launch: 1% of decode at 4k keys on the H200). Keys are split across ``num_splits``
# programs (split-KV, FlashDecoding); each writes its normalized partial output and LSE, and a
# second kernel merges them by their LSEs.
# --------------------------------------------------------------------------------------------


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
):
    # PAGES: how keys find their page. 0: the whole sequence is one page (a contiguous cache),
    # looked up once; 1: pages hold whole key blocks (page_size a multiple of BLOCK_N, no left
    # padding), one lookup per block; 2: any page_size, one lookup per key (POW2_PAGE: page_size
    # is 2^page_shift), or, where PAGE is not 0, blocks hold whole pages (page_size == PAGE, a
    # power of two dividing BLOCK_N, no left padding), one lookup per page. Pages are loaded a
    # block ahead of the K and V loads that need them (with PAGES 2 only where PAGES_AHEAD:
    # tuning.kvcache_pages_ahead).
    if EVEN_D:  # D fills its block: see EVEN_D above _flash_attn_fwd_kernel
        D = BLOCK_D
        Dv = BLOCK_DV
    pid = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    m_block = pid // num_splits
    split = pid % num_splits
    # The sequence's keys: cache positions [lp, end), key j at position lp + j.
    end = tl.load(SeqLens + b)
    lp = 0
    if HAS_LEFTPAD:
        lp = tl.load(LeftPad + b)
    Sk = end - lp

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

    # Keys these rows can see, [lo, hi), cut into num_splits runs of whole blocks; this program
    # takes run ``split`` (possibly empty).
    i_first = (m_block * BLOCK_M) // GROUP
    i_last = tl.minimum((m_block * BLOCK_M + BLOCK_M - 1) // GROUP, Sq - 1)
    lo = 0
    hi = Sk
    if HAS_LEFT:
        lo = tl.maximum(i_first + (Sk - Sq) - window_left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(i_last + (Sk - Sq) + window_right + 1, 0), Sk)
    first = lo                               # no row sees a key before this one: never loaded
    lo = lo // BLOCK_N * BLOCK_N
    blocks = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    per_split = tl.cdiv(blocks, num_splits)
    s_lo = lo + split * per_split * BLOCK_N
    s_hi = tl.minimum(s_lo + per_split * BLOCK_N, hi)

    bt_row = BlockTable + b * stride_btb
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
    # Paged caches: the loop loads each next block's pages a step ahead (see PAGES == 1 below).
    if PAGES == 1:
        next_page = tl.load(bt_row + s_lo // page_size, mask=s_lo < s_hi, other=0).to(tl.int64)
    elif PAGES == 2 and PAGES_AHEAD:  # tuning.kvcache_pages_ahead
        next_pages = _block_page_ids(bt_row, s_lo, first, s_hi, lp, page_size, page_shift, POW2_PAGE, PAGE,
                                     BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start_n in range(s_lo, s_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)                                   # [BLOCK_N]
        n_in = (offs_n >= first) & (offs_n < s_hi)
        if PAGES == 0:
            k_off = offs_n.to(tl.int64) * stride_kn
            v_off = offs_n.to(tl.int64) * stride_vn
            ks_off = offs_n.to(tl.int64) * stride_ksn
            vs_off = offs_n.to(tl.int64) * stride_vsn
        elif PAGES == 1:
            # This block's page was loaded a step ago (a block past the run loads nothing). Its
            # K and V addresses then wait on no load of this step, and Triton's pipeliner gives
            # them num_stages - 1 blocks of lookahead instead of (num_stages - 1) // 2.
            page = next_page
            next_n = start_n + BLOCK_N
            next_page = tl.load(bt_row + next_n // page_size, mask=next_n < s_hi, other=0).to(tl.int64)
            in_page = (start_n % page_size + tl.arange(0, BLOCK_N)).to(tl.int64)
            k_off = page * stride_kp + in_page * stride_kn
            v_off = page * stride_vp + in_page * stride_vn
            ks_off = page * stride_ksp + in_page * stride_ksn
            vs_off = page * stride_vsp + in_page * stride_vsn
        else:
            if PAGES_AHEAD:
                pages = next_pages
                next_pages = _block_page_ids(bt_row, start_n + BLOCK_N, first, s_hi, lp, page_size, page_shift,
                                             POW2_PAGE, PAGE, BLOCK_N)
            else:
                pages = _block_page_ids(bt_row, start_n, first, s_hi, lp, page_size, page_shift, POW2_PAGE, PAGE,
                                        BLOCK_N)
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
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    i64 = i.to(tl.int64)
    tl.store(Out + split * stride_os + b * stride_ob + i64[:, None] * stride_om + h[:, None] * stride_oh
             + offs_dv[None, :] * stride_od, out.to(Out.dtype.element_ty),
             mask=row_in[:, None] & (offs_dv[None, :] < Dv))
    tl.store(Lse + split * stride_ls + b * stride_lb + h * stride_lh + i64 * stride_lm, lse, mask=row_in)


@triton.jit
def _merge_splits_kernel(
    OutP, LseP, Out, Lse,
    stride_ps, stride_pb, stride_pm, stride_ph, stride_pd,
    stride_ls, stride_lb, stride_lh, stride_lm,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_lob, stride_loh, stride_lom,
    num_splits, Dv,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # Row (b, i, h) of the output from its num_splits partials: weights exp(lse_s - max lse); a
    # partial with LSE -inf saw no key and weighs 0. All partials empty: out 0, lse -inf.
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_DV)
    s_in = offs_s < num_splits
    lse = tl.load(LseP + offs_s * stride_ls + b * stride_lb + h * stride_lh + i * stride_lm,
                  mask=s_in, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)                                                      # [BLOCK_S]
    total = tl.sum(w, 0)
    o = tl.load(OutP + offs_s[:, None] * stride_ps + b * stride_pb + i * stride_pm + h * stride_ph
                + offs_d[None, :] * stride_pd, mask=(w[:, None] > 0) & (offs_d[None, :] < Dv), other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + b * stride_ob + i * stride_om + h * stride_oh + offs_d * stride_od,
             out.to(Out.dtype.element_ty), mask=offs_d < Dv)
    tl.store(Lse + b * stride_lob + h * stride_loh + i * stride_lom,
             tl.where(total == 0.0, float("-inf"), m_safe + tl.log(total)))


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, Sq, Hq, D) over a paged cache (num_blocks, page_size, Hkv, D), already
    validated: sequence b's keys are cache positions leftpad[b] .. seqlens[b] (int32, (B,)), found
    through ``block_table`` (B, max_pages) int32, or with None a contiguous cache whose row b is
    sequence b's (B_cache, S_cache, Hkv, D) (no table to build and read). A quantized cache (int8 /
    e4m3 codes) comes with its (num_blocks, page_size, Hkv) fp32 scales. Returns out (B, Sq, Hq,
    Dv) in q's dtype and lse (B, Hq, Sq) fp32. ``num_splits`` >= 1 splits each row's keys across that many programs;
    ``max_seqlen_k``, the most keys a sequence holds (None: unknown), picks the tile.
    """
    B, Sq, Hq, D = q.shape
    Hkv, Dv = k_cache.shape[2], v_cache.shape[3]
    group, page_size = Hq // Hkv, k_cache.shape[1]
    out = alloc.empty((B, Sq, Hq, Dv), dtype=q.dtype, device=q.device)
    lse = alloc.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    _check_grid(B, Hkv, "KV heads")
    block_d, block_dv = _block(D), _block(Dv)
    fp32, bucket = q.dtype == torch.float32, max(block_d, block_dv)

    cfg, layout = tuning.kvcache_tile(q.device, bucket, fp32=fp32, page_size=page_size,
                                      one_page=block_table is None or block_table.shape[1] == 1,
                                      leftpad=leftpad is not None, max_keys=max_seqlen_k,
                                      interpreted=triton_interpreted())
    # Rows are (query, head) pairs: decode (Sq * group <= 16) takes the smallest tile tl.dot allows.
    block_m = tuning.kvcache_block_m(cfg, Sq * group)
    m_blocks = triton.cdiv(Sq * group, block_m)
    left, right = window_size
    if num_splits > 1:
        part = torch.empty((num_splits, B, Sq, Hq, Dv), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_splits, B, Hq, Sq), dtype=torch.float32, device=q.device)
        dest, dest_lse = part, part_lse
        o_strides, l_strides = part.stride(), part_lse.stride()
    else:
        dest, dest_lse = out, lse
        o_strides, l_strides = (0, *out.stride()), (0, *lse.stride())
    quantized = k_cache_scale is not None
    scale_strides = (*k_cache_scale.stride(), *v_cache_scale.stride()) if quantized else (0,) * 6
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _flash_attn_kvcache_kernel[(m_blocks * num_splits, Hkv, B)](
            q, k_cache, v_cache,
            k_cache_scale if quantized else q, v_cache_scale if quantized else q,
            block_table if block_table is not None else seqlens, seqlens,
            leftpad if leftpad is not None else seqlens,
            alibi_slopes if alibi_slopes is not None else q, dest, dest_lse,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *scale_strides,
            block_table.stride(0) if block_table is not None else 0,
            *(alibi_slopes.stride() if alibi_slopes is not None else (0, 0)),
            *o_strides, *l_strides,
            Sq, group, D, Dv, page_size, page_size.bit_length() - 1, left, right, num_splits,
            softmax_scale * LOG2E,
            softmax_scale / softcap if softcap > 0 else 0.0,
            softcap * LOG2E,
            BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
            HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, HAS_SOFTCAP=softcap > 0,
            HAS_ALIBI=alibi_slopes is not None, HAS_LEFTPAD=leftpad is not None, QUANTIZED=quantized,
            INPUT_PRECISION="ieee" if q.dtype == torch.float32 else None, EVEN_D=(D == block_d and Dv == block_dv),
            HAS_TABLE=block_table is not None, PAGES=layout.pages, POW2_PAGE=layout.pow2_page, PAGE=layout.page,
            PAGES_AHEAD=layout.pages_ahead, **cfg.options(),
        )
        if num_splits > 1:
            _merge_splits_kernel[(Sq, Hq, B)](
                part, part_lse, out, lse, *part.stride(), *part_lse.stride(), *out.stride(), *lse.stride(),
                num_splits, Dv, BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_DV=block_dv,
                num_warps=4,
            )
    return out, lse
