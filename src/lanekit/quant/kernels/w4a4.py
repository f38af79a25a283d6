"""SVDQuant's activation pass (W4A4): rows of x to signed int4 codes per group of 64 columns,
with the low-rank branch's down projection fused (nunchaku's ``quantize_w4a4_act_fuse_lora``).

``_w4a4_act_kernel``: a program takes BLOCK_M rows and, along grid axis 1, BLOCK_R columns of the
low-rank activation h = x @ lora_down (fp32, 16-bit products through tl.dot). The programs of the
first R column block also quantize: xs = x / smooth (fp32 division rounded to x's dtype),
s = amax(|xs|) / 7 (fp32, correctly rounded, then rounded to x's dtype: the stored scale), codes =
round half to even of xs / s with that stored s, clamped to [-8, 7], two to an int8 (element 2i in
the low nibble). A group holding a NaN or inf gets scale NaN and codes 0 (the NaN-visible rule);
an all-zero group (or one whose scale underflows to 0) scale 0 and codes 0. The oracle is
``lanekit.reference.quant.quantize_w4a4_act``. Offsets int64, rows past M masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.common.numerics import finite_abs, quant_scale, quantize
from lanekit.quant import tuning
from lanekit.runtime.alloc import empty
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.launch import launch

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

GROUP = 64          # SVDQuant's int4 group along K (nunchaku: 64)
INT8 = tl.constexpr(1)   # common.numerics.quantize's QUANT: round half to even, NaN -> 0


@triton.jit
def _w4a4_act_kernel(X, SMOOTH, DOWN, QA, AS, LA, M, K, R,
                     stride_xm, stride_xk, stride_sk, stride_dk, stride_dr,
                     stride_qm, stride_qk, stride_ag, stride_am, stride_lm, stride_lr,
                     HAS_SMOOTH: tl.constexpr, HAS_LORA: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_r = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_k = tl.arange(0, GROUP).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    offs_b = tl.arange(0, GROUP // 2).to(tl.int64)
    m_mask = offs_m < M
    r_mask = offs_r < R
    dtype = X.dtype.element_ty
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k32 in range(0, K, GROUP):
        k0 = tl.cast(k32, tl.int64)
        k = k0 + offs_k
        x = tl.load(X + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=m_mask[:, None], other=0.0)                                   # [BLOCK_M, GROUP]
        if HAS_LORA:
            d = tl.load(DOWN + k[:, None] * stride_dk + offs_r[None, :] * stride_dr,
                        mask=r_mask[None, :], other=0.0)                               # [GROUP, BLOCK_R]
            h = tl.dot(x, d, h)                                                        # x unsmoothed
        if pid_r == 0:
            xs = x.to(tl.float32)
            if HAS_SMOOTH:
                sm = tl.load(SMOOTH + k * stride_sk).to(tl.float32)
                xs = tl.math.div_rn(xs, sm[None, :]).to(dtype).to(tl.float32)        # rounded to x's dtype
            amax = tl.max(finite_abs(xs), axis=1)                                      # [BLOCK_M]
            s = quant_scale(amax, 7.0, 0.0).to(dtype)                                  # the stored scale
            sf = s.to(tl.float32)
            ok = sf > 0                                                                # not 0, not NaN
            q = quantize(tl.math.div_rn(xs, tl.where(ok, sf, 1.0)[:, None]), 7.0, INT8, CLAMP=False)
            q = tl.where(ok[:, None], tl.minimum(tl.maximum(q, -8.0), 7.0), 0.0)
            lo, hi = tl.split(tl.reshape(q.to(tl.int32), (BLOCK_M, GROUP // 2, 2)))    # [BLOCK_M, GROUP / 2]
            byte = (lo & 0xF) | ((hi & 0xF) << 4)
            byte = tl.where(byte >= 128, byte - 256, byte).to(tl.int8)
            kb = k0 // 2 + offs_b
            tl.store(QA + offs_m[:, None] * stride_qm + kb[None, :] * stride_qk, byte, mask=m_mask[:, None])
            tl.store(AS + (k0 // GROUP) * stride_ag + offs_m * stride_am, s, mask=m_mask)
    if HAS_LORA:
        tl.store(LA + offs_m[:, None] * stride_lm + offs_r[None, :] * stride_lr, h,
                 mask=m_mask[:, None] & r_mask[None, :])


def quantize_w4a4_act_fwd(x, smooth, lora_down):
    """(codes int8 (M, K / 2), scales (K / 64, M) in x's dtype, h fp32 (M, R)) for x (M, K),
    smooth (K,) or None, lora_down (K, R) or None (h then (M, 0)); shapes checked by the api."""
    M, K = x.shape
    R = lora_down.shape[1] if lora_down is not None else 0
    qa = empty((M, K // 2), dtype=torch.int8, device=x.device)
    scales = empty((K // GROUP, M), dtype=x.dtype, device=x.device)
    h = empty((M, R), dtype=torch.float32, device=x.device)
    if M == 0:
        return qa, scales, h
    if K == 0:
        h.zero_()
        return qa, scales, h
    cfg = tuning.w4a4_act_config(x.device, R)
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(R, cfg.block_r) if R else 1)
    d = lora_down if R else x
    launch(_w4a4_act_kernel, grid,
           x, smooth if smooth is not None else x, d, qa, scales, h, M, K, R,
           *x.stride(), smooth.stride(0) if smooth is not None else 0, *(d.stride() if R else (0, 0)),
           *qa.stride(), *scales.stride(), *(h.stride() if R else (0, 0)),
           HAS_SMOOTH=smooth is not None, HAS_LORA=R > 0, BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_r,
           GROUP=GROUP, num_warps=cfg.num_warps, enable_fp_fusion=False)
    return qa, scales, h
