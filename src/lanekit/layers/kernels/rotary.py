"""RoPE: ``_rotary_kernel`` rotates the rotary pairs of (token, head) rows of D features, tokens of
a batch entry or of a packed (varlen) sequence at their positions (position ids, a sequence offset
or the token's index). ``_rotary_tokens`` and ``_rotary_pairs`` serve the q-and-k kernels too."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.layers import tuning
from lanekit.runtime import errors
from lanekit.runtime.host import cdiv, next_power_of_2
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.launch import launch

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

# Positions are not read back per call when they come from the device (position_ids, a
# seqlen_offsets tensor, flash_attn_with_kvcache's cache_seqlens): one outside cos/sin's rows
# reads no cos/sin (the row's rotated features come out 0) and is recorded for check_errors().
BAD_POSITION = errors.register(
    "rotary: a position (position_ids, seqlen_offsets or cache_seqlens plus the token's index) "
    "outside cos/sin's rows [0, S_ro): its rotated features were written as 0")


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
def _rotary_rows(
    X, OUT, COS, SIN, POS, CU_SEQLENS, SEQ_OFFSETS, b, pid_s, pid_h,
    stride_xb, stride_xs, stride_xh, stride_xd, stride_ob, stride_os, stride_oh, stride_od,
    stride_cs, stride_cd, stride_ss, stride_sd, stride_pb, stride_ps, S, H, D, ROT_START, HALF,
    seq_offset, n_pos, ERR, ERR_BIT,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_REST: tl.constexpr, INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
    WRITE_REST: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_POS_IDS: tl.constexpr,
    HAS_OFFSET_TENSOR: tl.constexpr,
):
    # BLOCK_S tokens x BLOCK_H heads (blocks pid_s, pid_h) of batch entry b, as BLOCK_S * BLOCK_H
    # rows of D features (a token's heads are adjacent in memory, so the rows are too). Each row
    # is handled in three pieces: the rotary pairs' first members a, their second members b, and
    # the features outside the rotary range (HAS_REST), which pass through.
    offs_r = tl.arange(0, BLOCK_S * BLOCK_H)
    offs_s = pid_s * BLOCK_S + offs_r // BLOCK_H
    h = pid_h * BLOCK_H + offs_r % BLOCK_H
    tok, in_seq, pos = _rotary_tokens(b, offs_s, CU_SEQLENS, POS, SEQ_OFFSETS, seq_offset, S,
                                      stride_pb, stride_ps, IS_VARLEN, HAS_POS_IDS, HAS_OFFSET_TENSOR)
    row_mask = in_seq & (h < H)
    x_rows = (X + b * stride_xb + tok * stride_xs + h * stride_xh)[:, None]   # [ROWS, 1]
    o_rows = (OUT + b * stride_ob + tok * stride_os + h * stride_oh)[:, None]
    offs_i = tl.arange(0, BLOCK_HALF).to(tl.int64)
    da, db = _rotary_pairs(offs_i, ROT_START, HALF, INTERLEAVED)
    pair_mask = row_mask[:, None] & (offs_i < HALF)[None, :]                  # [ROWS, BLOCK_HALF]
    if HAS_POS_IDS or HAS_OFFSET_TENSOR:  # positions from the device: bounds checked here
        pos_ok = (pos >= 0) & (pos < n_pos)
        tl.atomic_or(ERR, ERR_BIT, mask=tl.max((row_mask & (pos_ok == 0)).to(tl.int32), 0) > 0)
        pos = tl.where(pos_ok, pos, 0)
        cs_mask = pair_mask & pos_ok[:, None]
    else:
        cs_mask = pair_mask
    a = tl.load(x_rows + da[None, :] * stride_xd, mask=pair_mask, other=0.0).to(tl.float32)
    bb = tl.load(x_rows + db[None, :] * stride_xd, mask=pair_mask, other=0.0).to(tl.float32)
    cos = tl.load(COS + pos[:, None] * stride_cs + offs_i[None, :] * stride_cd, mask=cs_mask,
                  other=0.0).to(tl.float32)
    sin = tl.load(SIN + pos[:, None] * stride_ss + offs_i[None, :] * stride_sd, mask=cs_mask,
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
    n_pos, ERR, ERR_BIT,
):
    # One program: BLOCK_S tokens x BLOCK_H heads of one batch entry (_rotary_rows).
    _rotary_rows(X, OUT, COS, SIN, POS, CU_SEQLENS, SEQ_OFFSETS, tl.program_id(1).to(tl.int64),
                 tl.program_id(0).to(tl.int64), tl.program_id(2).to(tl.int64),
                 stride_xb, stride_xs, stride_xh, stride_xd, stride_ob, stride_os, stride_oh, stride_od,
                 stride_cs, stride_cd, stride_ss, stride_sd, stride_pb, stride_ps, S, H, D, ROT_START, HALF,
                 seq_offset, n_pos, ERR, ERR_BIT, BLOCK_S, BLOCK_H, BLOCK_HALF, BLOCK_D, HAS_REST, INTERLEAVED,
                 CONJUGATE, WRITE_REST, IS_VARLEN, HAS_POS_IDS, HAS_OFFSET_TENSOR)


@triton.jit
def _rotary_qk_kernel(
    Q, K, QOUT, KOUT, COS, SIN, POS, SEQ_OFFSETS,
    stride_qb, stride_qs, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
    stride_qob, stride_qos, stride_qoh, stride_qod, stride_kob, stride_kos, stride_koh, stride_kod,
    stride_cs, stride_cd, stride_ss, stride_sd, stride_pb, stride_ps, S, HQ, HK, D, HALF,
    seq_offset, q_blocks, n_pos, ERR, ERR_BIT,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_REST: tl.constexpr, INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
    HAS_POS_IDS: tl.constexpr, HAS_OFFSET_TENSOR: tl.constexpr,
):
    # q and k in one launch: head blocks [0, q_blocks) of grid axis 2 rotate q's heads, the rest
    # k's; one set of positions (cos/sin rows) serves both.
    b = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(2).to(tl.int64)
    if pid_h < q_blocks:
        _rotary_rows(Q, QOUT, COS, SIN, POS, SEQ_OFFSETS, SEQ_OFFSETS, b, pid_s, pid_h,
                     stride_qb, stride_qs, stride_qh, stride_qd, stride_qob, stride_qos, stride_qoh, stride_qod,
                     stride_cs, stride_cd, stride_ss, stride_sd, stride_pb, stride_ps, S, HQ, D, 0, HALF,
                     seq_offset, n_pos, ERR, ERR_BIT, BLOCK_S, BLOCK_H, BLOCK_HALF, BLOCK_D, HAS_REST,
                     INTERLEAVED, CONJUGATE, True, False, HAS_POS_IDS, HAS_OFFSET_TENSOR)
    else:
        _rotary_rows(K, KOUT, COS, SIN, POS, SEQ_OFFSETS, SEQ_OFFSETS, b, pid_s, pid_h - q_blocks,
                     stride_kb, stride_ks, stride_kh, stride_kd, stride_kob, stride_kos, stride_koh, stride_kod,
                     stride_cs, stride_cd, stride_ss, stride_sd, stride_pb, stride_ps, S, HK, D, 0, HALF,
                     seq_offset, n_pos, ERR, ERR_BIT, BLOCK_S, BLOCK_H, BLOCK_HALF, BLOCK_D, HAS_REST,
                     INTERLEAVED, CONJUGATE, True, False, HAS_POS_IDS, HAS_OFFSET_TENSOR)


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
    block_h = min(next_power_of_2(H), cfg.block_rows)   # a token's heads first, then tokens
    block_s = max(1, cfg.block_rows // block_h)
    grid = (cdiv(S, block_s), B, cdiv(H, block_h))
    launch(_rotary_kernel, grid,
        x4, o4, cos, sin, pos, cu_seqlens, seqlen_offsets if offsets_tensor else None,
        *x_strides, *o_strides, *cos.stride(), *sin.stride(), *pos_strides,
        S, H, D, rot_start, half, 0 if offsets_tensor else int(seqlen_offsets),
        BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_HALF=next_power_of_2(max(half, 1)),
        BLOCK_D=next_power_of_2(D), HAS_REST=rotary_dim < D, INTERLEAVED=interleaved,
        CONJUGATE=conjugate, WRITE_REST=out.data_ptr() != x.data_ptr(),
        IS_VARLEN=varlen, HAS_POS_IDS=pos is not None, HAS_OFFSET_TENSOR=offsets_tensor,
        num_warps=cfg.num_warps,
        n_pos=cos.shape[0], ERR=errors.error_flag(x.device), ERR_BIT=BAD_POSITION,
    )
    return out


def rotary_qk_fwd(*, q, k, q_out, k_out, cos, sin, rotary_dim, interleaved=False, conjugate=False,
                  position_ids=None, seqlen_offsets=0):
    """Rotate q (B, S, Hq, D) and k (B, S, Hkv, D) into q_out and k_out in one launch: features
    [0, rotary_dim) of every head at its token's position (position_ids (B, S) or (1, S), else the
    token's index plus seqlen_offsets, an int or a (B,) tensor); the rest copied. Returns nothing."""
    B, S, Hq, D = q.shape
    Hk = k.shape[2]
    if B == 0 or S == 0 or Hq + Hk == 0:
        return
    pos = position_ids
    pos_strides = (0, 0) if pos is None else (pos.stride(0) if pos.shape[0] > 1 else 0, pos.stride(1))
    offsets_tensor = isinstance(seqlen_offsets, torch.Tensor)
    cfg = tuning.rotary_config(q.device)
    half = rotary_dim // 2
    block_h = min(next_power_of_2(max(Hq, Hk)), cfg.block_rows)
    block_s = max(1, cfg.block_rows // block_h)
    q_blocks = cdiv(Hq, block_h)
    grid = (cdiv(S, block_s), B, q_blocks + cdiv(Hk, block_h))
    launch(_rotary_qk_kernel, grid,
        q, k, q_out, k_out, cos, sin, pos, seqlen_offsets if offsets_tensor else None,
        *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(), *cos.stride(), *sin.stride(),
        *pos_strides, S, Hq, Hk, D, half, 0 if offsets_tensor else int(seqlen_offsets), q_blocks,
        cos.shape[0], errors.error_flag(q.device), BAD_POSITION,
        BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_HALF=next_power_of_2(max(half, 1)),
        BLOCK_D=next_power_of_2(D), HAS_REST=rotary_dim < D, INTERLEAVED=interleaved,
        CONJUGATE=conjugate, HAS_POS_IDS=pos is not None, HAS_OFFSET_TENSOR=offsets_tensor,
        num_warps=cfg.num_warps,
    )
