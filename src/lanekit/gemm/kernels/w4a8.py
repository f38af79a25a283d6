"""Int4 x int8 and int4 x int4 GEMMs on the int8 dot: the 4-bit codes are unpacked to int8 in
registers each K step and multiplied by ``tl.dot`` with int32 accumulation. Neither NVIDIA Hopper
nor AMD CDNA 3 / RDNA 4 has int4 tensor cores (sm80's mma.s4 is gone on sm90), so the dot is
IMMA (mma.sync / wgmma s8) on sm80 / sm90, mfma i8 on gfx942 and wmma iu8 on gfx1151 / gfx1201.

- ``_w4a8_linear_kernel``: y = (x_codes * x_scale) @ W.T + bias, x_codes (M, K) int8 per token
  (``scaled_mm.quant_rows``), W (N, K) from ``lanekit.quant.quantize_w4a8``: codes two to a byte
  (element 2i of a row in the low nibble), W[n, k] = channel[n] * rel[n, g] * (code - 8)
  (+ correction[n, g] in mode 2), g = k // group_size. Each group of K is a run of K steps whose
  int32 partial sum (exact) is scaled once by the group's fp32 scale (channel * rel); mode 2 adds
  the group's correction times the int32 sum of the row's activation codes over the group; the
  token's scale multiplies the whole sum.
- ``_int4_mm_kernel``: C = (A @ B) * scale_a * scale_b + bias, A (M, K) and B (K, N) signed int4
  (two's complement nibbles, -8..7) packed two to a byte along K, summed exactly in int32.

All offsets int64; masks on every partial tile (rows past M, columns past N).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.gemm import tuning
from lanekit.gemm.kernels.scaled_mm import _swizzle
from lanekit.gemm.kernels.weight_only import _repeat_cols, _repeat_rows
from lanekit.runtime.alloc import empty
from lanekit.runtime.launch import launch
from lanekit.runtime.lanes import triton_interpreted

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()


@triton.jit
def _e4m3_bits_to_fp32(b):
    """float8_e4m3fn bytes (int32 0..255) as fp32, exactly, from the bits (no fp8 load: sm80 and
    gfx942 have no OCP e4m3 type in Triton). 0x7F / 0xFF are NaN."""
    sign = tl.where((b & 0x80) != 0, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = ((e + 120) << 23) | (m << 20)                       # 2^(e - 7) * (1 + m / 8)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    v = tl.where((e == 15) & (m == 7), float("nan"), v)
    return sign * v


@triton.jit
def _load_scale(S, offs, mask, SCALE_E4M3: tl.constexpr):
    if SCALE_E4M3:
        return _e4m3_bits_to_fp32(tl.load(S + offs, mask=mask, other=0).to(tl.int32))
    else:
        return tl.load(S + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _signed_nibbles(byte, shift):
    """The nibble at ``shift`` (0 or 4) of int32 bytes as a signed int4 (-8..7)."""
    return (((byte >> shift) & 0xF) ^ 8) - 8


@triton.jit
def _w4a8_linear_kernel(XQ, XS, W, S, CH, CORR, BIAS, Y, M, N, K, group_size, num_groups,
                        stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg,
                        stride_cn, stride_cg, stride_ch, stride_bias, stride_ym, stride_yn,
                        SCALE_E4M3: tl.constexpr, HAS_CORR: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    pid_m, pid_n = _swizzle(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    half_k = tl.arange(0, BLOCK_K // 2).to(tl.int64)
    m_mask = offs_m < M
    n_mask = offs_n < N
    shift = ((offs_k % 2) * 4).to(tl.int32)                                          # element 2i: low nibble
    ch = tl.load(CH + offs_n * stride_ch, mask=n_mask, other=0.0)                    # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, num_groups):
        start = g * group_size
        end = start + group_size
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        xsum = tl.zeros((BLOCK_M,), dtype=tl.int32)
        for k0 in range(start, end, BLOCK_K):
            k = k0 + offs_k
            k_mask = k < end
            a = tl.load(XQ + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                        mask=m_mask[:, None] & k_mask[None, :], other=0)              # [BLOCK_M, BLOCK_K] int8
            kb = k0 // 2 + half_k
            byte = tl.load(W + offs_n[None, :] * stride_wn + kb[:, None] * stride_wk,
                           mask=(kb < end // 2)[:, None] & n_mask[None, :], other=0x88)  # code 8: weight 0
            byte = byte.to(tl.int32) & 0xFF                                           # [BLOCK_K / 2, BLOCK_N]
            b = ((_repeat_rows(byte, 2) >> shift[:, None]) & 0xF) - 8                 # [BLOCK_K, BLOCK_N]
            part = tl.dot(a, b.to(tl.int8), part, out_dtype=tl.int32)
            if HAS_CORR:
                xsum += tl.sum(a.to(tl.int32), axis=1)
        rel = _load_scale(S, offs_n * stride_sn + g * stride_sg, n_mask, SCALE_E4M3)   # [BLOCK_N]
        acc += part.to(tl.float32) * (ch * rel)[None, :]                              # the group's scale, once
        if HAS_CORR:        # one accumulator: a second [BLOCK_M, BLOCK_N] one spilled on sm90
            c = tl.load(CORR + offs_n * stride_cn + g * stride_cg, mask=n_mask, other=0.0)
            acc += xsum.to(tl.float32)[:, None] * c[None, :]
    xs = tl.load(XS + offs_m, mask=m_mask, other=0.0)
    out = acc * xs[:, None]
    if HAS_BIAS:
        out += tl.load(BIAS + offs_n * stride_bias, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, out.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def w4a8_linear_fwd(x_codes, x_scale, qweight, scales, channel_scale, correction, bias, group_size: int,
                    out_dtype):
    """y (M, N) in out_dtype for int8 x_codes (M, K) with fp32 x_scale (M,), qweight (N, K/2)
    uint8, scales (N, K/G) (fp32, fp16, bf16 or e4m3 as uint8 bits: SCALE_E4M3), channel_scale
    (N,) fp32, correction (N, K/G) fp32 or None; shapes checked by lanekit.gemm's api."""
    M, K = x_codes.shape
    N = qweight.shape[0]
    out = empty((M, N), dtype=out_dtype, device=x_codes.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.zero_()
        if bias is not None:
            out += bias.to(out_dtype)
        return out
    cfg = tuning.w4a8_config(x_codes.device, M, group_size, correction=correction is not None)
    e4m3 = scales.dtype == torch.float8_e4m3fn
    s = scales.view(torch.uint8) if e4m3 else scales
    c = correction if correction is not None else channel_scale.reshape(N, 1)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    launch(_w4a8_linear_kernel, grid,
           x_codes, x_scale, qweight, s, channel_scale, c, bias if bias is not None else channel_scale, out,
           M, N, K, group_size, K // group_size, *x_codes.stride(), *qweight.stride(), *s.stride(),
           *c.stride(), channel_scale.stride(0), bias.stride(0) if bias is not None else 0, *out.stride(),
           SCALE_E4M3=e4m3, HAS_CORR=correction is not None,
           HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
           GROUP_M=cfg.group_m, **cfg.options())
    return out


@triton.jit
def _int4_mm_kernel(A, B, SA, SB, BIAS, C, M, N, K,
                    stride_am, stride_ak, stride_bk, stride_bn, stride_sa, stride_sb, stride_bias, stride_cm,
                    stride_cn,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    pid_m, pid_n = _swizzle(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    half_k = tl.arange(0, BLOCK_K // 2).to(tl.int64)
    shift = ((tl.arange(0, BLOCK_K) % 2) * 4).to(tl.int32)                          # element 2i: low nibble
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // 2 + half_k
        kb_mask = kb < K // 2                        # a partial last step reads zero nibbles
        ab = tl.load(A + offs_m[:, None] * stride_am + kb[None, :] * stride_ak,
                     mask=m_mask[:, None] & kb_mask[None, :], other=0).to(tl.int32) & 0xFF  # [BLOCK_M, BLOCK_K / 2]
        bb = tl.load(B + kb[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                     mask=kb_mask[:, None] & n_mask[None, :], other=0).to(tl.int32) & 0xFF  # [BLOCK_K / 2, BLOCK_N]
        a = _signed_nibbles(_repeat_cols(ab, 2), shift[None, :])                       # [BLOCK_M, BLOCK_K]
        b = _signed_nibbles(_repeat_rows(bb, 2), shift[:, None])                       # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a.to(tl.int8), b.to(tl.int8), acc, out_dtype=tl.int32)
    sa = tl.load(SA + offs_m * stride_sa, mask=m_mask, other=0.0)
    sb = tl.load(SB + offs_n * stride_sb, mask=n_mask, other=0.0)
    out = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        out += tl.load(BIAS + offs_n * stride_bias, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(C + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, out.to(C.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def int4_mm_fwd(a, b, scale_a, scale_b, bias, out_dtype):
    """C (M, N) in out_dtype for packed a (M, K/2) and b (K/2, N) (int8 or uint8), scale_a (M,) and
    scale_b (N,) fp32 views (stride 0: per tensor)."""
    M, N = a.shape[0], b.shape[1]
    K = 2 * a.shape[1]
    out = empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.zero_()
        if bias is not None:
            out += bias.to(out_dtype)
        return out
    cfg = tuning.int4_mm_config(a.device, M)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    launch(_int4_mm_kernel, grid,
           a, b, scale_a, scale_b, bias if bias is not None else scale_b, out, M, N, K, *a.stride(),
           *b.stride(), scale_a.stride(0), scale_b.stride(0), bias.stride(0) if bias is not None else 0,
           *out.stride(), HAS_BIAS=bias is not None,
           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
           **cfg.options())
    return out
