"""SVDQuant's W4A4 GEMM with its low-rank branch (Li et al., ICLR 2025; MIT Han lab's nunchaku).

``_svdquant_w4a4_kernel``: y = sum over groups g of 64 along K of
as[g, m] * ws[g, n] * (qa[m, g] . qw[n, g]) + h @ lora_up.T + bias, where qa are the activation's
signed int4 codes and as its scales (``lanekit.quant``'s activation pass, run just before), qw and
ws the weight's, h = x @ lora_down in fp32 (that same pass). Neither NVIDIA's Hopper nor AMD's
CDNA 3 / RDNA have int4 tensor-core instructions that Triton reaches: the nibbles are unpacked in
registers to int8 (sign-extended) and multiplied by tl.dot's int8 path, summed exactly in int32
(wgmma / mma.sync s8 on NVIDIA, mfma i8 on gfx942, wmma iu8 on gfx1201 / gfx1151). One K step is
one group of 64: its exact int32 sum times the two stored scales (their product exact in fp32)
is added to an fp32 accumulator. The low-rank branch is a second pair of tl.dot in the epilogue:
h (fp32) split into its 16-bit value and its 16-bit remainder, each times lora_up in 16 bits
(nunchaku rounds h to 16 bits once; lanekit keeps about 16 more of its bits). Then bias and
one rounding to x's dtype. Offsets int64; rows past M and columns past N masked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lanekit.common.numerics import power_of_two, unit_exponent
from lanekit.gemm import tuning
from lanekit.gemm.kernels.scaled_mm import _swizzle
from lanekit.gemm.kernels.weight_only import _repeat_cols, _repeat_rows
from lanekit.runtime.alloc import empty
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.launch import launch

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

GROUP = 64


@triton.jit
def _signed_nibble(byte, shift):
    """The signed int4 at bit ``shift`` (0 or 4) of each int32 byte value, as int8."""
    return ((((byte >> shift) & 0xF) ^ 8) - 8).to(tl.int8)


@triton.jit
def _svdquant_w4a4_kernel(QA, AS, QW, WS, LA, UP, BIAS, Y, M, N, K, R,
                          stride_qam, stride_qak, stride_asg, stride_asm,
                          stride_qwn, stride_qwk, stride_wsg, stride_wsn,
                          stride_lam, stride_lar, stride_upn, stride_upr, stride_ym, stride_yn,
                          HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                          GROUP_M: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    pid_m, pid_n = _swizzle(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_b = tl.arange(0, GROUP // 2).to(tl.int64)
    shift = (tl.arange(0, GROUP) % 2) * 4                                              # element 2i: low nibble
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g32 in range(0, K // GROUP):
        g = tl.cast(g32, tl.int64)
        kb = g * (GROUP // 2) + offs_b
        pa = tl.load(QA + offs_m[:, None] * stride_qam + kb[None, :] * stride_qak,
                     mask=m_mask[:, None], other=0).to(tl.int32)                        # [BLOCK_M, GROUP / 2]
        a = _signed_nibble(_repeat_cols(pa, 2), shift[None, :])                        # [BLOCK_M, GROUP]
        pw = tl.load(QW + offs_n[None, :] * stride_qwn + kb[:, None] * stride_qwk,
                     mask=n_mask[None, :], other=0).to(tl.int32)                        # [GROUP / 2, BLOCK_N]
        b = _signed_nibble(_repeat_rows(pw, 2), shift[:, None])                        # [GROUP, BLOCK_N]
        part = tl.dot(a, b, out_dtype=tl.int32)                                        # exact
        sa = tl.load(AS + g * stride_asg + offs_m * stride_asm, mask=m_mask, other=0.0).to(tl.float32)
        sw = tl.load(WS + g * stride_wsg + offs_n * stride_wsn, mask=n_mask, other=0.0).to(tl.float32)
        acc += part.to(tl.float32) * (sa[:, None] * sw[None, :])                       # 16-bit x 16-bit: exact
    if HAS_LORA:
        dtype = UP.dtype.element_ty
        for r0 in range(0, R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
            r_mask = r < R
            h = tl.load(LA + offs_m[:, None] * stride_lam + r[None, :] * stride_lar,
                        mask=m_mask[:, None] & r_mask[None, :], other=0.0)            # [BLOCK_M, BLOCK_R] fp32
            u = tl.load(UP + offs_n[None, :] * stride_upn + r[:, None] * stride_upr,
                        mask=r_mask[:, None] & n_mask[None, :], other=0.0)            # [BLOCK_R, BLOCK_N]
            if dtype == tl.float16:
                # fp16 ends at 65504 and h = x @ lora_down grows with K: a row of h past 2^15 is
                # split as h * 2^k (k <= 0, exact) and its product taken times 2^-k, so that hi
                # never overflows to inf (a row within 2^15 has k = 0: the same sum as bf16's)
                k = tl.minimum(unit_exponent(tl.max(tl.abs(h), 1)) + 14, 0)           # [BLOCK_M]
                hs = h * power_of_two(k)[:, None]
                hi = hs.to(dtype)
                lo = (hs - hi.to(tl.float32)).to(dtype)
                part = tl.dot(lo, u, tl.dot(hi, u))
                acc += part * power_of_two(-k)[:, None]
            else:
                hi = h.to(dtype)
                lo = (h - hi.to(tl.float32)).to(dtype)                                 # what hi rounded off
                acc = tl.dot(hi, u, acc)
                acc = tl.dot(lo, u, acc)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, acc.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def svdquant_w4a4_fwd(qact, ascales, lora_act, qweight, wscales, lora_up, bias, out_dtype):
    """y (M, N) in out_dtype from the activation pass's codes (M, K / 2), scales (K / 64, M) and
    h (M, R) fp32, and the weight's codes (N, K / 2), wscales (K / 64, N), lora_up (N, R)."""
    M, K = qact.shape[0], qact.shape[1] * 2
    N = qweight.shape[0]
    R = lora_act.shape[1]
    out = empty((M, N), dtype=out_dtype, device=qact.device)
    if M == 0 or N == 0:
        return out
    cfg = tuning.svdquant_config(qact.device, M)
    block_r = tuning.svdquant_block_r(R)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    launch(_svdquant_w4a4_kernel, grid,     # bias[n] is read at BIAS + n: a strided view as its copy
           qact, ascales, qweight, wscales, lora_act, lora_up, bias.contiguous() if bias is not None else wscales,
           out,
           M, N, K, R, *qact.stride(), *ascales.stride(), *qweight.stride(), *wscales.stride(),
           *(lora_act.stride() if R else (0, 0)), *(lora_up.stride() if R else (0, 0)), *out.stride(),
           HAS_LORA=R > 0, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
           BLOCK_R=block_r, GROUP_M=cfg.group_m, GROUP=GROUP, **cfg.options())
    return out
