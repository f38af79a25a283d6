"""4-bit weight-only linears: the weight's codes are unpacked and dequantized in the K loop, in
registers, then multiplied with 16-bit activations by ``tl.dot`` (sums in fp32).

- ``_w4a16_kernel``: y = x @ W + bias, W (K, N) from an AWQ or GPTQ int4 checkpoint,
  W[k, n] = (q[k, n] - z[g, n]) * s[g, n]. Without g_idx the codes minus zero (integers in
  [-16, 15], exact in fp16/bf16, built from bit patterns: ``_small_ints``) are multiplied in 16
  bits and summed in fp32, and the group's scale multiplies that partial sum, so the result is the
  exact product summed in fp32 (no dequantized weight is rounded to 16 bits): per K step where
  the steps fill each group (``FLAT``: group_size a multiple of the K step, one loop the compiler
  pipelines), else per group, each group a run of K steps. With GPTQ's act-order g_idx the group
  changes within a K step: the weight (q - z) * s (exact in fp32) is split into a 16-bit value and
  its 16-bit remainder, each multiplied by tl.dot: the weight then carries 16 + 8 significant bits
  (bf16), not 8.
- ``_mxfp4_linear_kernel``: y = x @ W.T + bias, W (N, K) OCP MXFP4: e2m1 codes two to a byte
  (element 2i in the low nibble), one e8m0 scale per 32 of K; a K step of 32 (one scale per
  column a step) whose e2m1 values (exact in 16 bits) are multiplied and the product scaled.

Layouts and their sources: lanekit.reference.gemm (w4_weight, mxfp4_weight) and
docs/semantics.md. All offsets int64; masks on every partial tile; an out-of-range g_idx value is
masked (its row of K adds nothing) and recorded in the device error flag (runtime.errors).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lanekit.common.numerics import e2m1_pairs_in, e8m0_scale
from lanekit.gemm import tuning
from lanekit.gemm.kernels.scaled_mm import _sum_splits, _swizzle, _workspace
from lanekit.runtime import errors
from lanekit.runtime.alloc import empty
from lanekit.runtime.launch import launch
from lanekit.runtime.lanes import triton_interpreted

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

BAD_G_IDX = errors.register(
    "w4a16_linear: a g_idx value outside [0, K / group_size) (that row of K was left out of the sum)")


@triton.jit
def _awq_shift(n):
    """The bit offset of column n within its int32 in AWQ's order (nibble (n % 8) // 2 + 4 (n % 2))."""
    j = n % 8
    return ((j // 2) + (j % 2) * 4) * 4


@triton.jit
def _zero_points(Z, g, offs_n, n_mask, stride_zg, stride_zn,
                 AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr, ZERO_OFFSET: tl.constexpr):
    """Zero points of rows g of the zeros (packed along N, eight to an int32): g scalar -> [BLOCK_N],
    g [BLOCK_K, 1] -> [BLOCK_K, BLOCK_N]. Without zeros: 8 (symmetric)."""
    if HAS_ZEROS:
        j = (offs_n % 8).to(tl.int32)      # int32 shifts: an int64 one made the codes, and their conversion, int64
        if AWQ:
            shift = _awq_shift(j)
        else:
            shift = j * 4
        word = tl.load(Z + g * stride_zg + (offs_n // 8) * stride_zn, mask=n_mask, other=0)
        return ((word >> shift) & 0xF) + ZERO_OFFSET
    else:
        return tl.full(offs_n.shape, 8, tl.int32)


@triton.jit
def _small_ints(q, z, dtype: tl.constexpr):
    """q - z in dtype (bf16 or fp16), exactly, for int32 codes q in [0, 15] and zero points z in
    [0, 16], with no int-to-float conversion (one per element bound the K loop on sm90): q's bits
    ORed into those of c (128 for bf16, 1024 for fp16, whose exponent makes every value from c to
    c + 31 exact) are c + q, from which c + z (z's row, built the same way) is subtracted in 16 bits."""
    c = 0x4300 if dtype == tl.bfloat16 else 0x6400
    return (q | c).to(tl.int16).to(dtype, bitcast=True) - (z + c).to(tl.int16).to(dtype, bitcast=True)


@triton.jit
def _repeat_rows(w, R: tl.constexpr):
    """[A, B] -> [A * R, B]: each row R times (packed words spread over the codes they hold)."""
    return tl.reshape(tl.broadcast_to(w[:, None, :], (w.shape[0], R, w.shape[1])), (w.shape[0] * R, w.shape[1]))


@triton.jit
def _repeat_cols(w, R: tl.constexpr):
    """[A, B] -> [A, B * R]: each column R times."""
    return tl.reshape(tl.broadcast_to(w[:, :, None], (w.shape[0], w.shape[1], R)), (w.shape[0], w.shape[1] * R))


@triton.jit
def _code_words(QW, k0, pid_n, K, N, stride_qk, stride_qn, AWQ: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where the int32 words holding the 4-bit codes q[k0 + i, pid_n * BLOCK_N + j] are: (pointers,
    the words' rows inside K, their columns inside N, the pointers' move to the next K step).
    AWQ: (K, N/8), columns packed in AWQ's order, [BLOCK_K, BLOCK_N / 8]; GPTQ: (K/8, N), row 8e + j
    in nibble j (k0 a multiple of 8), [BLOCK_K / 8, BLOCK_N]."""
    if AWQ:
        k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        pn = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8).to(tl.int64)
        return (QW + k[:, None] * stride_qk + pn[None, :] * stride_qn, (k < K)[:, None], (pn < N // 8)[None, :],
                BLOCK_K * tl.cast(stride_qk, tl.int64))
    else:
        pk = k0 // 8 + tl.arange(0, BLOCK_K // 8).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        return (QW + pk[:, None] * stride_qk + offs_n[None, :] * stride_qn, (pk < K // 8)[:, None],
                (offs_n < N)[None, :], (BLOCK_K // 8) * tl.cast(stride_qk, tl.int64))


@triton.jit
def _codes(QW, k0, pid_n, K, N, stride_qk, stride_qn, AWQ: tl.constexpr,
           BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The 4-bit codes q[k0 + i, pid_n * BLOCK_N + j]: [BLOCK_K, BLOCK_N] int32, each int32 word
    loaded once (:func:`_code_words`). Rows past K and columns past N read 0."""
    ptrs, k_ok, n_ok, _ = _code_words(QW, k0, pid_n, K, N, stride_qk, stride_qn, AWQ, BLOCK_K, BLOCK_N)
    return _unpack(tl.load(ptrs, mask=k_ok & n_ok, other=0), AWQ, BLOCK_K, BLOCK_N)


@triton.jit
def _unpack(word, AWQ: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] int32 codes held by a tile of packed words: AWQ's [BLOCK_K, BLOCK_N / 8]
    (columns in AWQ's order) or GPTQ's [BLOCK_K / 8, BLOCK_N] (row 8e + j in nibble j)."""
    if AWQ:
        return (_repeat_cols(word, 8) >> _awq_shift(tl.arange(0, BLOCK_N))[None, :]) & 0xF     # (BLOCK_N % 8 == 0)
    else:
        shift = (tl.arange(0, BLOCK_K) % 8) * 4
        return (_repeat_rows(word, 8) >> shift[:, None]) & 0xF


@triton.jit
def _w4a16_kernel(X, QW, S, Z, G_IDX, BIAS, Y, WS, ERR, M, N, K, group_size, num_groups, SPLIT_K,
                  stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn,
                  stride_zg, stride_zn, stride_ym, stride_yn, ERR_BIT,
                  AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr, ZERO_OFFSET: tl.constexpr,
                  HAS_G_IDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, SPLIT: tl.constexpr, FLAT: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1)              # this program's share of K (SPLIT_K > 1: _split_k_sum adds them)
    pid_m, pid_n = _swizzle(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    m_mask = offs_m < M
    n_mask = offs_n < N
    dtype = X.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_G_IDX:
        span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K                       # K steps of this split
        for k0 in range(pid_k * span, tl.minimum(K, (pid_k + 1) * span), BLOCK_K):
            k = k0 + offs_k
            k_mask = k < K
            a = tl.load(X + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)          # [BLOCK_M, BLOCK_K]
            g = tl.load(G_IDX + k, mask=k_mask, other=0).to(tl.int64)               # [BLOCK_K]
            ok = k_mask & (g >= 0) & (g < num_groups)
            bad = tl.max((k_mask & (ok == 0)).to(tl.int32), axis=0)
            tl.atomic_or(ERR, ERR_BIT, mask=bad > 0)
            g = tl.where(ok, g, 0)
            mask = ok[:, None] & n_mask[None, :]
            q = _codes(QW, k0, pid_n, K, N, stride_qk, stride_qn, AWQ, BLOCK_K, BLOCK_N)  # [BLOCK_K, BLOCK_N]
            z = _zero_points(Z, g[:, None], offs_n[None, :], mask, stride_zg, stride_zn,
                             AWQ, HAS_ZEROS, ZERO_OFFSET)
            s = tl.load(S + g[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=mask, other=0.0)
            w = (q - z).to(tl.float32) * s.to(tl.float32)                            # exact in fp32
            hi = w.to(dtype)
            lo = (w - hi.to(tl.float32)).to(dtype)                                   # what hi rounded off
            acc = tl.dot(a, hi, acc)
            acc = tl.dot(a, lo, acc)
    elif FLAT:
        # K steps that never straddle two groups (BLOCK_K divides group_size), in one loop that the
        # compiler pipelines: each step's exact integer-code product scaled by its group's scale
        steps = K // BLOCK_K
        per_split = tl.cdiv(steps, SPLIT_K)                                          # steps of this split
        first = pid_k * per_split
        k_first = tl.cast(first, tl.int64) * BLOCK_K
        a_ptrs = X + offs_m[:, None] * stride_xm + (k_first + offs_k)[None, :] * stride_xk
        q_ptrs, _, q_mask, q_step = _code_words(QW, k_first, pid_n, K, N, stride_qk, stride_qn, AWQ,
                                                BLOCK_K, BLOCK_N)                  # (the steps cover K exactly)
        for step in range(first, tl.minimum(steps, first + per_split)):
            g = tl.cast(step, tl.int64) * BLOCK_K // group_size
            s = tl.load(S + g * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
            z = _zero_points(Z, g, offs_n, n_mask, stride_zg, stride_zn, AWQ, HAS_ZEROS, ZERO_OFFSET)
            a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
            word = tl.load(q_ptrs, mask=q_mask, other=0)
            acc += tl.dot(a, _small_ints(_unpack(word, AWQ, BLOCK_K, BLOCK_N), z[None, :], dtype)) * s[None, :]
            a_ptrs += BLOCK_K * tl.cast(stride_xk, tl.int64)
            q_ptrs += q_step
    else:
        per_split = tl.cdiv(num_groups, SPLIT_K)                                     # groups of this split
        for g in range(pid_k * per_split, tl.minimum(num_groups, (pid_k + 1) * per_split)):
            s = tl.load(S + g * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
            z = _zero_points(Z, g, offs_n, n_mask, stride_zg, stride_zn, AWQ, HAS_ZEROS, ZERO_OFFSET)
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            end = (g + 1) * group_size
            for k0 in range(g * group_size, end, BLOCK_K):
                k = k0 + offs_k
                k_mask = k < end
                a = tl.load(X + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                            mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                q = _codes(QW, k0, pid_n, K, N, stride_qk, stride_qn, AWQ, BLOCK_K, BLOCK_N)
                b = _small_ints(q, z[None, :], dtype)                                    # [-16, 15]: exact
                part = tl.dot(a, b, part)
            acc += part * s[None, :]                                                  # the group's scale, once
    _finish(acc, BIAS, Y, WS, pid_k, M, N, offs_m, offs_n, m_mask, n_mask, stride_ym, stride_yn, HAS_BIAS, SPLIT)


@triton.jit
def _finish(acc, BIAS, Y, WS, pid_k, M, N, offs_m, offs_n, m_mask, n_mask, stride_ym, stride_yn,
            HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """The tile's fp32 sum plus bias, rounded once into Y; or, with K split (SPLIT, a constexpr so
    that a kernel holds one of the two epilogues: both in one spilled on sm80), this split's
    partial sum into the workspace WS (SPLIT_K, M, N) fp32, for _split_k_sum."""
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        tl.store(WS + (tl.cast(pid_k, tl.int64) * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, acc.to(Y.dtype.element_ty),
                 mask=mask)


def w4a16_linear_fwd(x, qweight, scales, zeros, g_idx, bias, group_size: int, layout: str):
    """y (M, N) in x's dtype for x (M, K); the checkpoint's tensors as lanekit.gemm's api checked
    them (group_size resolved: K for per-channel)."""
    M, K = x.shape
    N = scales.shape[1]
    out = empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:      # the empty sum: zeros plus bias, no launch over empty operands
        out.zero_()
        if bias is not None:
            out += bias.to(x.dtype)
        return out
    cfg = tuning.w4a16_config(x.device, M, group_size, K, act_order=g_idx is not None)
    z = zeros if zeros is not None else qweight
    # the kernel reads g_idx[k] and bias[n] at G_IDX + k and BIAS + n: strided views as their copies
    g_idx = g_idx.contiguous() if g_idx is not None else None
    bias = bias.contiguous() if bias is not None else None
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    flat = g_idx is None and group_size % cfg.block_k == 0
    # what a split divides: K steps, or (groups not a multiple of the step) whole groups
    steps = triton.cdiv(K, cfg.block_k) if g_idx is not None or flat else K // group_size
    split = tuning.split_k(x.device, tiles, steps)
    ws = _workspace(split, M, N, out)
    launch(_w4a16_kernel, (tiles, split),
           x, qweight, scales, z, g_idx if g_idx is not None else qweight,
           bias if bias is not None else scales, out, ws, errors.error_flag(x.device), M, N, K, group_size,
           K // group_size, split, *x.stride(), *qweight.stride(), *scales.stride(),
           *(zeros.stride() if zeros is not None else (0, 0)), *out.stride(), BAD_G_IDX,
           AWQ=layout == "awq", HAS_ZEROS=zeros is not None, ZERO_OFFSET=1 if layout == "gptq" else 0,
           HAS_G_IDX=g_idx is not None, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
           BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SPLIT=split > 1, FLAT=flat,
           **cfg.options())
    _sum_splits(ws, split, out, bias, M, N)
    return out


@triton.jit
def _mxfp4_linear_kernel(X, W, S, BIAS, Y, WS, M, N, K, SPLIT_K, stride_xm, stride_xk, stride_wn, stride_wk,
                         stride_sn, stride_sk, stride_ym, stride_yn, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, SPLIT: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1)              # this program's share of K (SPLIT_K > 1: _split_k_sum adds them)
    pid_m, pid_n = _swizzle(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K                           # K steps of this split
    for k0 in range(pid_k * span, tl.minimum(K, (pid_k + 1) * span), BLOCK_K):   # 32: one e8m0 scale a step
        k = k0 + offs_k
        a = tl.load(X + offs_m[:, None] * stride_xm + k[None, :] * stride_xk, mask=m_mask[:, None], other=0.0)
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2).to(tl.int64)
        byte = tl.load(W + offs_n[None, :] * stride_wn + kb[:, None] * stride_wk,
                       mask=n_mask[None, :], other=0).to(tl.int32)                   # [BLOCK_K / 2, BLOCK_N]
        b = e2m1_pairs_in(byte, X.dtype.element_ty)     # [BLOCK_K, BLOCK_N], exact in 16 bits
        e = tl.load(S + offs_n * stride_sn + (k0 // BLOCK_K) * stride_sk, mask=n_mask, other=127)
        acc += tl.dot(a, b) * e8m0_scale(e.to(tl.int32))[None, :]
    _finish(acc, BIAS, Y, WS, pid_k, M, N, offs_m, offs_n, m_mask, n_mask, stride_ym, stride_yn, HAS_BIAS, SPLIT)


def mxfp4_linear_fwd(x, w_fp4, w_scale, bias):
    """y (M, N) in x's dtype for x (M, K), w_fp4 (N, K/2) uint8, w_scale (N, K/32) uint8."""
    M, K = x.shape
    N = w_fp4.shape[0]
    out = empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.zero_()
        if bias is not None:
            out += bias.to(x.dtype)
        return out
    cfg = tuning.mxfp4_config(x.device, M)
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    split = tuning.split_k(x.device, tiles, triton.cdiv(K, cfg.block_k))
    bias = bias.contiguous() if bias is not None else None      # read at BIAS + n: a strided view as its copy
    ws = _workspace(split, M, N, out)
    launch(_mxfp4_linear_kernel, (tiles, split),
           x, w_fp4, w_scale, bias if bias is not None else x, out, ws, M, N, K, split, *x.stride(),
           *w_fp4.stride(), *w_scale.stride(), *out.stride(), HAS_BIAS=bias is not None,
           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
           SPLIT=split > 1, **cfg.options())
    _sum_splits(ws, split, out, bias, M, N)
    return out
