"""The GEMM family's kernels: one portable scaled GEMM and a per-row quantize pass.

- ``_scaled_mm_kernel``: C = (A * scale_a) @ (B * scale_b) + bias, A (M, K), B (K, N), any
  strides, int64 offsets. Operands fp8 (e4m3 / e5m2) or int8, or (WIDEN_B) 16-bit A with int8 B
  widened in the load (W8A16). fp8 accumulates in fp32 (``max_num_imprecise_acc=IMPRECISE_ACC``: sm90's fp8
  wgmma otherwise keeps fewer bits in its accumulator; a tuning row's imprecise_acc > 0 lets that
  many products of K be summed in the tensor core's accumulator before each promotion, for 16-bit
  outputs only: an fp32 output's tolerance is 16 fp32 steps), int8 in int32 (exact). Scales, by
  SCHEME: EPILOGUE, a's (M,) and b's (N,) applied after the sum (a stride of 0 makes either one
  per tensor); BLOCK, a per 1 x 128 of K, b per 128 x 128 (DeepSeek-V3), one scale each per K step
  (block_k divides 128); MX, one e8m0 exponent per 32 of K for each row of a and column of b
  (OCP MX; a K step of 32). Then bias (N,) and the cast to C's dtype. Masks on every partial tile:
  no scale or bias is read past M or N. Where the output tiles leave processors idle (decode),
  fp8 and W8A16 split K among programs (``gemm.tuning.split_k``; SPLIT): each writes its scaled
  fp32 partial sum, and ``_split_k_sum`` adds them in split order with the bias, rounding once.
  int8 x int8 is never split (its int32 sum is exact; fp32 partials would not be).
- ``_quant_rows_kernel``: rows of x (R, C) to int8 or fp8 codes, dynamic (per row or per group of
  columns: scale = amax / qmax, correctly rounded) or static (one given scale): the activation
  quantization of the linears.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.common.numerics import cast_codes, e8m0_scale, finite_abs, quant_scale, quantize
from lanekit.gemm import tuning
from lanekit.runtime.alloc import empty
from lanekit.runtime.launch import launch
from lanekit.runtime.lanes import triton_interpreted

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

# scale schemes (constexpr SCHEME)
EPILOGUE, BLOCK, MX = 0, 1, 2
INT8, FP8 = 1, 2          # common.numerics.quantize's QUANT


@triton.jit
def _swizzle(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    size = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size
    pid_n = (pid % width) // size
    return pid_m, pid_n


@triton.jit
def _scaled_mm_kernel(A, B, SA, SB, BIAS, C, WS, M, N, K, SPLIT_K,
                      stride_am, stride_ak, stride_bk, stride_bn,
                      stride_sam, stride_sak, stride_sbk, stride_sbn, stride_cm, stride_cn,
                      SCHEME: tl.constexpr, IS_INT: tl.constexpr, WIDEN_B: tl.constexpr,
                      HAS_SA: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, IMPRECISE_ACC: tl.constexpr, SPLIT: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1)              # this program's share of K (SPLIT: _split_k_sum adds them)
    pid_m, pid_n = _swizzle(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    m_mask = offs_m < M
    n_mask = offs_n < N
    span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K                           # K of this split
    k_lo = pid_k * span
    a_ptrs = A + offs_m[:, None] * stride_am + (k_lo + offs_k)[None, :] * stride_ak
    b_ptrs = B + (k_lo + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn
    if IS_INT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(K, k_lo + span), BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if WIDEN_B:      # int8 codes are exact in bf16 / fp16
            b = b.to(A.dtype.element_ty)
        if SCHEME == 1:  # 128 x 128 blocks: this K step lies in group k0 // 128
            kb = k0 // 128
            sa = tl.load(SA + offs_m * stride_sam + kb * stride_sak, mask=m_mask, other=0.0)
            sb = tl.load(SB + kb * stride_sbk + (offs_n // 128) * stride_sbn, mask=n_mask, other=0.0)
            acc += tl.dot(a, b, max_num_imprecise_acc=IMPRECISE_ACC) * sa[:, None] * sb[None, :]
        elif SCHEME == 2:  # MX: one e8m0 exponent per 32 of K, this step's
            kb = k0 // 32
            ea = tl.load(SA + offs_m * stride_sam + kb * stride_sak, mask=m_mask, other=127)
            eb = tl.load(SB + kb * stride_sbk + offs_n * stride_sbn, mask=n_mask, other=127)
            sa = e8m0_scale(ea.to(tl.int32))
            sb = e8m0_scale(eb.to(tl.int32))
            acc += tl.dot(a, b, max_num_imprecise_acc=IMPRECISE_ACC) * sa[:, None] * sb[None, :]
        elif IS_INT:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE_ACC)
        a_ptrs += BLOCK_K * tl.cast(stride_ak, tl.int64)
        b_ptrs += BLOCK_K * tl.cast(stride_bk, tl.int64)
    out = acc.to(tl.float32)
    if SCHEME == 0:
        if HAS_SA:
            sa = tl.load(SA + offs_m * stride_sam, mask=m_mask, other=0.0)
            out = out * sa[:, None]
        sb = tl.load(SB + offs_n * stride_sbn, mask=n_mask, other=0.0)
        out = out * sb[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:    # this split's scaled fp32 partial sum, for _split_k_sum (bias there)
        tl.store(WS + (tl.cast(pid_k, tl.int64) * M + offs_m[:, None]) * N + offs_n[None, :], out, mask=mask)
    else:
        if HAS_BIAS:
            bias = tl.load(BIAS + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            out = out + bias[None, :]
        c_ptrs = C + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, out.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _split_k_sum(WS, BIAS, Y, M, N, SPLIT_K, stride_ym, stride_yn, HAS_BIAS: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Y = the SPLIT_K partial sums of WS (SPLIT_K, M, N) fp32, added in split order (the same bits
    every run), plus bias, rounded once."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = idx < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, SPLIT_K):
        acc += tl.load(WS + tl.cast(k, tl.int64) * M * N + idx, mask=mask, other=0.0)
    n = idx % N
    if HAS_BIAS:
        acc += tl.load(BIAS + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + (idx // N) * stride_ym + n * stride_yn, acc.to(Y.dtype.element_ty), mask=mask)


SPLIT_K_SUM_BLOCK = 1024      # elements a program of _split_k_sum adds: a memory-bound pass


def _workspace(split: int, M: int, N: int, out):
    """Where a split K's fp32 partial sums go, (split, M, N); with no split, out (the kernel writes
    out itself and never this)."""
    return empty((split, M, N), dtype=torch.float32, device=out.device) if split > 1 else out


def _sum_splits(ws, split: int, out, bias, M: int, N: int) -> None:
    """out = the splits' partial sums plus bias, rounded once (nothing to do with no split)."""
    if split > 1:
        launch(_split_k_sum, (triton.cdiv(M * N, SPLIT_K_SUM_BLOCK),), ws, bias if bias is not None else ws,
               out, M, N, split, *out.stride(), HAS_BIAS=bias is not None, BLOCK=SPLIT_K_SUM_BLOCK)


def scaled_mm_fwd(a, b, scale_a, scale_b, bias, out_dtype, scheme, *, widen_b=False):
    """C (M, N) in out_dtype. scale_a: (M,) view with its row stride (stride 0: per tensor), or
    None (W8A16); scale_b (N,) likewise; BLOCK: scale_a (M, ceil(K/128)), scale_b
    (ceil(K/128), ceil(N/128)); MX: uint8 scale_a (M, K/32), scale_b (K/32, N). Shapes are
    checked by lanekit.gemm's api."""
    M, K = a.shape
    N = b.shape[1]
    out = empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:      # nothing to read: zeros plus bias, no launch over an empty operand
        out.zero_()
        if bias is not None:
            out += bias.to(out_dtype)
        return out
    cfg = tuning.gemm_config(a.device, M, mx=scheme == MX)
    has_sa = scale_a is not None
    sa = scale_a if has_sa else scale_b
    if scheme == EPILOGUE:
        sa_strides = (sa.stride(0) if has_sa else 0, 0)
        sb_strides = (0, scale_b.stride(0))
    else:
        sa_strides, sb_strides = sa.stride(), scale_b.stride()
    bias = bias.contiguous() if bias is not None else None      # read at BIAS + n: a strided view as its copy
    bias_t = bias if bias is not None else scale_b
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    is_int = a.dtype == torch.int8
    # decode's few output tiles share K among programs (fp32 partial sums; int8's exact int32 sum
    # is never split)
    split = 1 if is_int else tuning.split_k(a.device, tiles, triton.cdiv(K, cfg.block_k))
    ws = _workspace(split, M, N, out)
    _scaled_mm_kernel[(tiles, split)](
        a, b, sa, scale_b, bias_t, out, ws, M, N, K, split, *a.stride(), *b.stride(), *sa_strides,
        *sb_strides, *out.stride(), SCHEME=scheme, IS_INT=is_int,
        WIDEN_B=widen_b, HAS_SA=has_sa, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        IMPRECISE_ACC=cfg.imprecise_acc if out_dtype != torch.float32 else 0, SPLIT=split > 1, **cfg.options())
    _sum_splits(ws, split, out, bias, M, N)
    return out


@triton.jit
def _quant_rows_kernel(X, Q, S, stride_xm, stride_xk, stride_qm, stride_qk, stride_sm, stride_sg,
                       C, group, qmax, zero_scale, QUANT: tl.constexpr, STATIC: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Program (row, group of columns): STATIC: S holds the one scale; else scale = amax / qmax
    (``zero_scale`` for an all-zero group: 0 for int8, vLLM's, whose codes are then 0; 1 for fp8),
    stored at S[row, g]; codes = quantize(x / scale), both divisions correctly rounded."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    start = g * group
    end = tl.minimum(start + group, C)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    if STATIC:
        scale = tl.load(S).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(start, end, BLOCK):
            x = tl.load(X + row * stride_xm + (c0 + offs) * stride_xk, mask=offs < end - c0, other=0.0)
            acc = tl.maximum(acc, finite_abs(x.to(tl.float32)))
        amax = tl.max(acc, axis=0)
        scale = quant_scale(amax, qmax, zero_scale)   # NaN for a group holding a NaN or inf
        tl.store(S + row * stride_sm + g * stride_sg, scale)
    for c0 in range(start, end, BLOCK):
        mask = offs < end - c0
        x = tl.load(X + row * stride_xm + (c0 + offs) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        y = tl.math.div_rn(x, tl.where(scale == 0, 1.0, scale))
        codes = quantize(y, qmax, QUANT)
        codes = tl.where(scale == 0, 0.0, codes)
        tl.store(Q + row * stride_qm + (c0 + offs) * stride_qk, cast_codes(codes, Q.dtype.element_ty, QUANT),
                 mask=mask)


def quant_rows(x, dtype, group, static_scale=None):
    """Codes of x (R, C) in ``dtype`` (int8 or e4m3) and fp32 scales: dynamic per group of
    ``group`` columns (R, ceil(C / group)), or static: the given (1,) scale."""
    R, C = x.shape
    codes = empty((R, C), dtype=dtype, device=x.device)
    is_int = dtype == torch.int8
    qmax = 127.0 if is_int else torch.finfo(dtype).max
    if static_scale is not None:
        scale, groups, group = static_scale.reshape(1).to(torch.float32), 1, C
        s_strides = (0, 0)
    else:
        groups = triton.cdiv(C, group) if C else 0
        scale = empty((R, groups), dtype=torch.float32, device=x.device)
        s_strides = scale.stride()
    if R and C:
        block = min(tuning.QUANT_BLOCK, triton.next_power_of_2(max(min(group, C), 16)))
        _quant_rows_kernel[(R, groups)](
            x, codes, scale, *x.stride(), *codes.stride(), *s_strides, C, group, qmax,
            0.0 if is_int else 1.0, QUANT=INT8 if is_int else FP8,
            STATIC=static_scale is not None, BLOCK=block, num_warps=tuning.QUANT_WARPS)
    return codes, scale
