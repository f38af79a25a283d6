"""``silu_and_mul_quant_fp8``: SwiGLU of x (R, 2N) (first half gate, second up, vLLM's
``silu_and_mul`` layout) fused with fp8 quantization of the product. Program (row, group):
pass 1 the group's amax of h = silu(gate) * up (computed in fp32, rounded to x's dtype, the
rounding of an unfused silu_and_mul), pass 2 h again, div_rn by the scale, saturated, cast.
Static per-tensor scale: one pass. int64 offsets, strides passed."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.common.numerics import cast_codes, finite_abs, quant_scale, quantize, sigmoid
from lanekit.quant import tuning
from lanekit.runtime.alloc import empty
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.tuning import arch_row

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

QMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@triton.jit
def _h(X, row, cols, mask, stride_xm, stride_xk, N):
    base = X + row * stride_xm
    g = tl.load(base + cols * stride_xk, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(base + (cols + N) * stride_xk, mask=mask, other=0.0).to(tl.float32)
    # the intermediate rounded to x's dtype (as silu_and_mul's output), then widened exactly
    return (g * sigmoid(g) * u).to(X.dtype.element_ty).to(tl.float32)


@triton.jit
def _silu_and_mul_quant_kernel(X, Q, S, stride_xm, stride_xk, stride_qm, stride_qk, stride_sm,
                               stride_sk, N, group, QMAX: tl.constexpr, STATIC: tl.constexpr,
                               BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1).to(tl.int64)
    start = grp * group
    end = tl.minimum(start + group, N)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    if STATIC:
        scale = tl.load(S).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(start, end, BLOCK):
            h = _h(X, row, c0 + offs, offs < end - c0, stride_xm, stride_xk, N)
            acc = tl.maximum(acc, finite_abs(h))
        amax = tl.max(acc, axis=0)
        scale = quant_scale(amax, QMAX, 1.0)          # NaN for a group holding a NaN or inf
        tl.store(S + row * stride_sm + grp * stride_sk, scale)
    for c0 in range(start, end, BLOCK):
        mask = offs < end - c0
        h = _h(X, row, c0 + offs, mask, stride_xm, stride_xk, N)
        q = quantize(tl.math.div_rn(h, scale), QMAX, 2)
        tl.store(Q + row * stride_qm + (c0 + offs) * stride_qk, cast_codes(q, Q.dtype.element_ty, 2), mask=mask)


def silu_and_mul_quant_fp8_fwd(*, x, dtype, scale, granularity, group_size):
    R, C = x.shape
    N = C // 2
    device = x.device
    codes = empty((R, N), dtype=dtype, device=device)
    group = group_size if granularity == "group" else N
    G = triton.cdiv(N, group) if N else 0
    if scale is not None:
        s, s_strides = scale.to(torch.float32), (0, 0)
    else:
        s = empty((R, G if granularity == "group" else 1), dtype=torch.float32, device=device)
        s_strides = s.stride()
        if not N:
            s.fill_(1.0)
    if R and N:
        block = min(arch_row(tuning.QUANT_BLOCK, device), triton.next_power_of_2(max(min(group, N), 16)))
        _silu_and_mul_quant_kernel[(R, G)](
            x, codes, s, *x.stride(), *codes.stride(), *s_strides, N, group, QMAX=QMAX[dtype],
            STATIC=scale is not None, BLOCK=block, num_warps=arch_row(tuning.QUANT_WARPS, device))
    return codes, s
