"""Triton kernels of the paged KV cache, and their launchers.

- ``_scatter_kv_kernel``: rows (token n, head h) of new keys or values written at their slots of a
  paged cache (reshape_and_cache), or at row n of a dense output (quantize_kv); quantized per row
  on the way when the destination holds int8 or fp8 e4m3 codes.
- ``_gather_kv_kernel``: rows read back from the pages a block table lists into a dense
  (B, S, H, D) output padded with zeros (gather_cache), or from a dense input (dequantize_kv);
  dequantized on the way (codes * scale) when the source holds codes.
- ``_merge_attn_states_kernel``: two attention partials combined by their LSEs.

One program moves a tile of rows of D features (``tuning.KV_CACHE``); every grid is one-dimensional
(batch entries and row blocks flattened), so no grid axis limit applies; all offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.common.numerics import cast_codes as _cast_codes, finite_abs as _finite_abs, quant_scale as _quant_scale
from lanekit.common.numerics import quantize as _quantize  # the same rounding as qk_norm_rope_quant's codes
from lanekit.kv_cache import tuning
from lanekit.runtime import errors
from lanekit.runtime.alloc import empty
from lanekit.runtime.host import cdiv, next_power_of_2
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.launch import launch

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

# Slots and pages are not read back per call (DESIGN.md's hot path): the kernels skip what is
# out of range and record it here, for lanekit.check_errors().
BAD_SLOT = errors.register(
    "kv_cache: a slot at or past num_blocks * page_size (slot_mapping, or an append's cache_seqlens "
    "and block_table): that token was not written")
BAD_GATHER = errors.register(
    "gather_cache: a cache_seqlens value outside [0, max_pages * page_size] or a used page outside "
    "[0, num_blocks): those positions were not read and came back 0; or a length past max_seqlen: "
    "its tokens past max_seqlen were left out")

QUANT_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 2}   # _quantize's QUANT: 1 int8, 2 fp8
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@triton.jit
def _scatter_rows(
    X, SLOTS, SCALE_IN, CACHE, SCALE_OUT,
    stride_xn, stride_xh, stride_xd, stride_slot, stride_in, stride_ih,
    stride_cb, stride_cp, stride_ch, stride_cd, stride_sb, stride_sp, stride_sh,
    N, H, D, page_size, qmax,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SLOTS: tl.constexpr,
    QUANT: tl.constexpr, HAS_SCALE_IN: tl.constexpr,
    num_slots, ERR, ERR_BIT,
    TABLE, SEQLENS, stride_tb, s_new, width, APPEND: tl.constexpr, APPEND_TABLE: tl.constexpr,
):
    # One program: BLOCK_R rows r = n * H + h of x (N, H, D). Row (n, h) goes to slot s = SLOTS[n]
    # (page s // page_size, offset s % page_size), head h; without SLOTS, s = n. QUANT: 0 copy,
    # 1 int8, 2 fp8 e4m3, each step exactly rounded (the launcher turns off fused multiply-adds).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    n = rows // H
    h = rows % H
    in_range = n < N
    if APPEND:
        # flash_attn_with_kvcache's append: token n = (b, t) of x (B * s_new, H, D) goes to
        # position SEQLENS[b] + t of row b of TABLE (B, width) (without APPEND_TABLE, page b);
        # a position outside the row, or a negative page, gets slot num_slots (recorded below)
        seq = n // s_new
        pos = tl.load(SEQLENS + seq, mask=in_range, other=0).to(tl.int64) + n % s_new
        ok = in_range & (pos >= 0) & (pos < width * page_size)
        if APPEND_TABLE:
            pg = tl.load(TABLE + seq * stride_tb + pos // page_size, mask=ok, other=0).to(tl.int64)
        else:
            pg = seq
        slot = tl.where(ok & (pg >= 0), pg * page_size + pos % page_size, num_slots)
    elif HAS_SLOTS:
        slot = tl.load(SLOTS + n * stride_slot, mask=in_range, other=-1).to(tl.int64)
    else:
        slot = n
    live = in_range & (slot >= 0)                                    # a negative slot is padding
    if HAS_SLOTS or APPEND:  # a slot past the cache is skipped and recorded, never written
        bad = live & (slot >= num_slots)
        tl.atomic_or(ERR, ERR_BIT, mask=tl.max(bad.to(tl.int32), 0) > 0)
        live = live & (slot < num_slots)
    slot = tl.where(live, slot, 0)
    page = slot // page_size
    off = slot % page_size
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = live[:, None] & (offs_d < D)[None, :]                     # [BLOCK_R, BLOCK_D]
    x_rows = X + n * stride_xn + h * stride_xh
    x = tl.load(x_rows[:, None] + offs_d[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
    if QUANT:
        if HAS_SCALE_IN:
            scale = tl.load(SCALE_IN + n * stride_in + h * stride_ih, mask=live, other=1.0).to(tl.float32)
        else:
            amax = tl.max(_finite_abs(x), axis=1)
            scale = _quant_scale(amax, qmax, 1.0)                    # NaN for a row holding a NaN or inf
        tl.store(SCALE_OUT + page * stride_sb + off * stride_sp + h * stride_sh, scale, mask=live)
        x = _quantize(tl.math.div_rn(x, scale[:, None]), qmax, QUANT)
    c_rows = CACHE + page * stride_cb + off * stride_cp + h * stride_ch
    tl.store(c_rows[:, None] + offs_d[None, :] * stride_cd, _cast_codes(x, CACHE.dtype.element_ty, QUANT), mask=mask)


@triton.jit
def _scatter_kv_kernel(
    X, SLOTS, SCALE_IN, CACHE, SCALE_OUT,
    stride_xn, stride_xh, stride_xd, stride_slot, stride_in, stride_ih,
    stride_cb, stride_cp, stride_ch, stride_cd, stride_sb, stride_sp, stride_sh,
    N, H, D, page_size, qmax,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SLOTS: tl.constexpr,
    QUANT: tl.constexpr, HAS_SCALE_IN: tl.constexpr,
    num_slots, ERR, ERR_BIT,
    TABLE, SEQLENS, stride_tb, s_new, width, APPEND: tl.constexpr, APPEND_TABLE: tl.constexpr,
    X2, SCALE_IN2, CACHE2, SCALE_OUT2,
    stride_x2n, stride_x2h, stride_x2d, stride_in2, stride_i2h,
    stride_c2b, stride_c2p, stride_c2h, stride_c2d, stride_s2b, stride_s2p, stride_s2h, D2,
    PAIR: tl.constexpr,
):
    # Grid (row blocks, 1), or with PAIR (row blocks, 2): program_id(1) 1 writes the second
    # tensor (values, beside the keys) at the same slots, so that keys and values take one launch.
    second = tl.program_id(1) == 1
    if PAIR:
        if second:
            _scatter_rows(X2, SLOTS, SCALE_IN2, CACHE2, SCALE_OUT2,
                          stride_x2n, stride_x2h, stride_x2d, stride_slot, stride_in2, stride_i2h,
                          stride_c2b, stride_c2p, stride_c2h, stride_c2d, stride_s2b, stride_s2p, stride_s2h,
                          N, H, D2, page_size, qmax, BLOCK_R, BLOCK_D, HAS_SLOTS, QUANT, HAS_SCALE_IN,
                          num_slots, ERR, ERR_BIT, TABLE, SEQLENS, stride_tb, s_new, width, APPEND, APPEND_TABLE)
    if not (PAIR and second):
        _scatter_rows(X, SLOTS, SCALE_IN, CACHE, SCALE_OUT,
                      stride_xn, stride_xh, stride_xd, stride_slot, stride_in, stride_ih,
                      stride_cb, stride_cp, stride_ch, stride_cd, stride_sb, stride_sp, stride_sh,
                      N, H, D, page_size, qmax, BLOCK_R, BLOCK_D, HAS_SLOTS, QUANT, HAS_SCALE_IN,
                      num_slots, ERR, ERR_BIT, TABLE, SEQLENS, stride_tb, s_new, width, APPEND, APPEND_TABLE)


@triton.jit
def _gather_kv_kernel(
    CACHE, SCALE, BLOCK_TABLE, SEQLENS, OUT,
    stride_cb, stride_cp, stride_ch, stride_cd, stride_sb, stride_sp, stride_sh,
    stride_tb, stride_tp, stride_ob, stride_os, stride_oh, stride_od,
    S, H, D, page_size, blocks_per_seq, blocks_per_row,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_TABLE: tl.constexpr,
    DEQUANT: tl.constexpr,
    num_blocks, ERR, ERR_BIT,
):
    # One program: BLOCK_R rows r = s * H + h of sequence b's output (S, H, D). Position s of a
    # live token (s < SEQLENS[b]) is in page BLOCK_TABLE[b, s // page_size] at offset
    # s % page_size; without a table, page s // page_size itself. Rows past the sequence are 0:
    # their pages are never read.
    pid = tl.program_id(0).to(tl.int64)
    b = pid // blocks_per_seq
    rows = (pid % blocks_per_seq) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    s = rows // H
    h = rows % H
    in_out = s < S
    page_idx = s // page_size
    if HAS_TABLE:
        # a length outside [0, max_pages * page_size] reads nothing; a page outside the pool is
        # not read (zeros); both recorded in ERR
        n = tl.load(SEQLENS + b).to(tl.int64)
        n_ok = (n >= 0) & (n <= blocks_per_row * page_size)
        live = tl.where(n_ok, in_out & (s < n), False)   # (not & n_ok: a tensor & scalar bool is not
        #                                               boolean in Triton 3.9's interpreter; masks must be)
        page = tl.load(BLOCK_TABLE + b * stride_tb + page_idx * stride_tp, mask=live, other=0).to(tl.int64)
        page_ok = (page >= 0) & (page < num_blocks)
        bad = (live & (page_ok == 0)) | (in_out & ((n_ok == 0) | (n > S)))
        tl.atomic_or(ERR, ERR_BIT, mask=tl.max(bad.to(tl.int32), 0) > 0)
        live = live & page_ok
        page = tl.where(page_ok, page, 0)
    else:
        live = in_out
        page = page_idx
    off = s % page_size
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_in = (offs_d < D)[None, :]
    c_rows = CACHE + page * stride_cb + off * stride_cp + h * stride_ch
    x = tl.load(c_rows[:, None] + offs_d[None, :] * stride_cd, mask=live[:, None] & d_in,
                other=0.0).to(tl.float32)                            # [BLOCK_R, BLOCK_D]
    if DEQUANT:
        scale = tl.load(SCALE + page * stride_sb + off * stride_sp + h * stride_sh, mask=live, other=0.0)
        x = x * scale[:, None]
    o_rows = OUT + b * stride_ob + s * stride_os + h * stride_oh
    tl.store(o_rows[:, None] + offs_d[None, :] * stride_od, x.to(OUT.dtype.element_ty),
             mask=in_out[:, None] & d_in)


@triton.jit
def _merge_attn_states_kernel(
    OA, LA, OB, LB, OUT, LSE,
    stride_ab, stride_as, stride_ah, stride_ad, stride_bb, stride_bs, stride_bh, stride_bd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lab, stride_lah, stride_las, stride_lbb, stride_lbh, stride_lbs,
    stride_lob, stride_loh, stride_los,
    S, H, D, blocks_per_seq,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program: BLOCK_R rows r = s * H + h of batch entry b. Weights e^(lse_x - lse), formed
    # from the larger LSE m so that neither exponent overflows; +inf (FlashAttention 2's LSE of a
    # row with no key) counts as -inf; a partial of weight 0 is not read into the sum (0 * NaN).
    pid = tl.program_id(0).to(tl.int64)
    b = pid // blocks_per_seq
    rows = (pid % blocks_per_seq) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    s = rows // H
    h = rows % H
    in_out = s < S
    la = tl.load(LA + b * stride_lab + h * stride_lah + s * stride_las, mask=in_out, other=float("-inf"))
    lb = tl.load(LB + b * stride_lbb + h * stride_lbh + s * stride_lbs, mask=in_out, other=float("-inf"))
    la = tl.where(la == float("inf"), float("-inf"), la)
    lb = tl.where(lb == float("inf"), float("-inf"), lb)
    m = tl.maximum(la, lb)
    empty = m == float("-inf")                                       # neither partial saw a key
    m = tl.where(empty, 0.0, m)
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    total = tl.where(empty, 1.0, wa + wb)
    lse = tl.where(empty, float("-inf"), m + tl.log(total))
    tl.store(LSE + b * stride_lob + h * stride_loh + s * stride_los, lse, mask=in_out)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_in = (offs_d < D)[None, :]
    a_ptr = (OA + b * stride_ab + s * stride_as + h * stride_ah)[:, None] + offs_d[None, :] * stride_ad
    b_ptr = (OB + b * stride_bb + s * stride_bs + h * stride_bh)[:, None] + offs_d[None, :] * stride_bd
    use_a = (in_out & (wa > 0))[:, None] & d_in
    use_b = (in_out & (wb > 0))[:, None] & d_in
    oa = tl.load(a_ptr, mask=use_a, other=0.0).to(tl.float32)       # [BLOCK_R, BLOCK_D]
    ob = tl.load(b_ptr, mask=use_b, other=0.0).to(tl.float32)
    out = (oa * wa[:, None] + ob * wb[:, None]) / total[:, None]
    o_ptr = (OUT + b * stride_ob + s * stride_os + h * stride_oh)[:, None] + offs_d[None, :] * stride_od
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=in_out[:, None] & d_in)


def _tiles(rows: int, D: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for rows of D features."""
    cfg = tuning.kv_cache_config(device)
    block_d = next_power_of_2(max(D, 1))
    block_r = min(max(1, cfg.tile // block_d), next_power_of_2(max(rows, 1)))
    return block_r, block_d, cfg.num_warps


def _pairs(x, cache, scale_in, scale_out, second) -> bool:
    """Whether ``second`` (x2, cache2, scale_in2, scale_out2) can share x's launch: the same rows
    and dtypes, scales given alike (else it takes a launch of its own)."""
    x2, cache2, scale_in2, scale_out2 = second
    return (x2.shape[:-1] == x.shape[:-1] and x2.dtype == x.dtype and cache2.dtype == cache.dtype
            and cache2.shape[1] == cache.shape[1] and (scale_in2 is None) == (scale_in is None)
            and (scale_out2 is None) == (scale_out is None))


def _scatter(x, cache, slots, scale_in, scale_out, append, second):
    """Launch _scatter_kv_kernel over x (N, H, D) and, with ``second`` (x2 (N, H, D2), cache2,
    scale_in2, scale_out2), over x2 too in the same launch. ``append``: None, or (table, seqlens,
    s_new) for flash_attn_with_kvcache's append (slots computed in the kernel)."""
    N, H, D = x.shape
    D2 = second[0].shape[2] if second is not None else 0
    quant = QUANT_CODES.get(cache.dtype, 0)
    block_r, block_d, num_warps = _tiles(N * H, max(D, D2), x.device)
    table, seqlens, s_new = append if append is not None else (None, None, 1)
    x2, cache2, scale_in2, scale_out2 = second if second is not None else (None, None, None, None)
    launch(_scatter_kv_kernel, (cdiv(N * H, block_r), 2 if second is not None else 1),
        x, slots, scale_in, cache, scale_out,
        *x.stride(), slots.stride(0) if slots is not None else 0,
        *(scale_in.stride() if scale_in is not None else (0, 0)),
        *cache.stride(), *(scale_out.stride() if scale_out is not None else (0, 0, 0)),
        N, H, D, cache.shape[1], QMAX.get(cache.dtype, 0.0),
        BLOCK_R=block_r, BLOCK_D=block_d, HAS_SLOTS=slots is not None, QUANT=quant,
        HAS_SCALE_IN=scale_in is not None, num_warps=num_warps,
        num_slots=cache.shape[0] * cache.shape[1], ERR=errors.error_flag(x.device), ERR_BIT=BAD_SLOT,
        TABLE=table, SEQLENS=seqlens, stride_tb=table.stride(0) if table is not None else 0, s_new=s_new,
        width=table.shape[1] if table is not None else 1, APPEND=append is not None,
        APPEND_TABLE=table is not None,
        X2=x2, SCALE_IN2=scale_in2, CACHE2=cache2, SCALE_OUT2=scale_out2,
        **_second_strides(x2, scale_in2, cache2, scale_out2), D2=D2, PAIR=second is not None,
        # the quantized path is specified as exactly rounded steps: no fused multiply-adds
        **({"enable_fp_fusion": False} if quant else {}),
    )


def _second_strides(x2, scale_in2, cache2, scale_out2) -> dict:
    names = ("stride_x2n", "stride_x2h", "stride_x2d", "stride_in2", "stride_i2h", "stride_c2b", "stride_c2p",
             "stride_c2h", "stride_c2d", "stride_s2b", "stride_s2p", "stride_s2h")
    strides = ((*x2.stride(), *(scale_in2.stride() if scale_in2 is not None else (0, 0)), *cache2.stride(),
                *(scale_out2.stride() if scale_out2 is not None else (0, 0, 0)))
               if x2 is not None else (0,) * len(names))
    return dict(zip(names, strides))


def scatter_kv(*, x, cache, slots=None, scale_in=None, scale_out=None, second=None):
    """Write x (N, H, D) into cache (num_blocks, page_size, H, D), row (n, h) at slot slots[n]
    (skipped when negative), or at page n, offset 0, when slots is None. When the cache holds int8
    or e4m3 codes, each row is quantized by its scale: scale_in[n, h] ((N, H), any strides,
    broadcast views too) or amax / qmax; the scale goes to scale_out (num_blocks, page_size, H) fp32.
    ``second``: (x2, cache2, scale_in2, scale_out2), written alike at the same slots (values beside
    keys), in the same launch where they pair up. In place; returns nothing."""
    N, H, D = x.shape
    if second is not None and not _pairs(x, cache, scale_in, scale_out, second):
        scatter_kv(x=second[0], cache=second[1], slots=slots, scale_in=second[2], scale_out=second[3])
        second = None
    if N * H == 0 or D + (second[0].shape[2] if second is not None else 0) == 0:
        return
    _scatter(x, cache, slots, scale_in, scale_out, None, second)


def append_kv(*, x, cache, table, seqlens, scale_out=None, second=None):
    """flash_attn_with_kvcache's append: x (B, S_new, H, D) written at positions seqlens[b] + t
    of sequence b, through table (B, max_pages) int32 into a paged cache (num_blocks, page_size,
    H, D), or with table None into row b of a contiguous cache (B_cache, S_cache, H, D); the
    slots are computed in the kernel (no index tensor built, no value read back): a position
    outside the row or a page outside the pool is not written and is recorded (BAD_SLOT).
    Quantized into a codes cache as :func:`scatter_kv`. ``second``: (x2, cache2, scale_out2),
    the values beside the keys, appended alike in the same launch where they pair up. In place;
    returns nothing."""
    B, S_new, H, D = x.shape
    rows = x.reshape(B * S_new, H, D) if x.is_contiguous() else x.flatten(0, 1)
    if second is not None:
        x2, cache2, scale_out2 = second
        second = (x2.reshape(B * S_new, H, x2.shape[3]) if x2.is_contiguous() else x2.flatten(0, 1),
                  cache2, None, scale_out2)
        if not _pairs(rows, cache, None, scale_out, second):
            append_kv(x=x2, cache=cache2, table=table, seqlens=seqlens, scale_out=scale_out2)
            second = None
    if B * S_new * H == 0 or D + (second[0].shape[2] if second is not None else 0) == 0:
        return
    _scatter(rows, cache, None, None, scale_out, (table, seqlens, S_new), second)


def gather_kv(*, cache, scale=None, block_table=None, seqlens=None, max_seqlen, dtype):
    """Read a (B, max_seqlen, H, D) tensor of ``dtype`` out of cache (num_blocks, page_size, H, D):
    position s of sequence b from page block_table[b, s // page_size] (B = block_table's rows),
    zeros from seqlens[b] on; without a table, B = 1 and position s is page s // page_size.
    With ``scale`` (num_blocks, page_size, H) fp32 the cache holds codes: codes * scale."""
    _, page_size, H, D = cache.shape
    B = block_table.shape[0] if block_table is not None else 1
    out = empty((B, max_seqlen, H, D), dtype=dtype, device=cache.device)
    rows = max_seqlen * H
    if B * rows * D == 0:
        return out
    block_r, block_d, num_warps = _tiles(rows, D, cache.device)
    blocks_per_seq = cdiv(rows, block_r)
    launch(_gather_kv_kernel, (B * blocks_per_seq,),
        cache, scale, block_table, seqlens, out,
        *cache.stride(), *(scale.stride() if scale is not None else (0, 0, 0)),
        *(block_table.stride() if block_table is not None else (0, 0)), *out.stride(),
        max_seqlen, H, D, page_size, blocks_per_seq, block_table.shape[1] if block_table is not None else 0,
        BLOCK_R=block_r, BLOCK_D=block_d, HAS_TABLE=block_table is not None,
        DEQUANT=scale is not None, num_warps=num_warps,
        num_blocks=cache.shape[0], ERR=errors.error_flag(cache.device), ERR_BIT=BAD_GATHER,
    )
    return out


def quantize_kv_fwd(*, x, dtype, scale=None):
    """Codes of x (R, D) in ``dtype`` (int8 or e4m3) and their scales (R,) fp32: amax / qmax per
    row, or the given ``scale`` (R,), any strides. Returns (codes (R, D), scale (R,))."""
    R, D = x.shape
    codes = empty((R, D), dtype=dtype, device=x.device)
    scale_out = empty((R,), dtype=torch.float32, device=x.device)
    scatter_kv(x=x.unsqueeze(1), cache=codes.view(R, 1, 1, D),
               scale_in=scale.unsqueeze(1) if scale is not None else None,
               scale_out=scale_out.view(R, 1, 1))
    return codes, scale_out


def dequantize_kv_fwd(*, codes, scale, dtype):
    """codes (R, D) * scale (R,) in fp32, rounded to ``dtype``: (R, D)."""
    R, D = codes.shape
    out = gather_kv(cache=codes[:, None, None, :], scale=scale[:, None, None], max_seqlen=R, dtype=dtype)
    return out.view(R, D)


def merge_attn_states_fwd(*, out_a, lse_a, out_b, lse_b):
    """out (B, Sq, H, D) in out_a's dtype and lse (B, H, Sq) fp32 of the two partials."""
    B, S, H, D = out_a.shape
    out = empty((B, S, H, D), dtype=out_a.dtype, device=out_a.device)
    lse = empty((B, H, S), dtype=torch.float32, device=out_a.device)
    rows = S * H
    if B * rows == 0:
        return out, lse
    block_r, block_d, num_warps = _tiles(rows, D, out_a.device)
    blocks_per_seq = cdiv(rows, block_r)
    launch(_merge_attn_states_kernel, (B * blocks_per_seq,),
        out_a, lse_a, out_b, lse_b, out, lse,
        *out_a.stride(), *out_b.stride(), *out.stride(), *lse_a.stride(), *lse_b.stride(), *lse.stride(),
        S, H, D, blocks_per_seq, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps,
    )
    return out, lse
