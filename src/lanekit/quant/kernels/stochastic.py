"""``stochastic_round_fp8``: each fp32 value of x to one of its two fp8 neighbours, the upper
one with probability (x - lo) / (hi - lo), from a 24-bit uniform integer of Triton's Philox
(``tl.randint``, 10 rounds) at counter offset + (row * C + col). Steps: the fp8 spacing at |x|,
step = 2^(max(e, EMIN) - MBITS) (e: x's fp32 exponent); a = |x| / step (exact: a power of two);
lo = floor(a); up when (r >> 8) < (a - lo) * 2^24; |result| = min((lo + up) * step, qmax) with
x's sign (-0 for a negative x that rounds to 0): every step exact, so the oracle (which runs the same Philox) gives the same codes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.common.numerics import cast_codes, power_of_two
from lanekit.quant import tuning
from lanekit.runtime.alloc import empty
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.tuning import arch_row

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

# (qmax, mantissa bits, least normal exponent) of each format
FORMAT = {torch.float8_e4m3fn: (448.0, 3, -6), torch.float8_e5m2: (57344.0, 2, -14)}


@triton.jit
def _stochastic_round_kernel(X, Q, seed, offset, stride_xm, stride_xk, stride_qm, stride_qk, C,
                             QMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                             BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = cols < C
    x = tl.load(X + row * stride_xm + cols * stride_xk, mask=mask, other=0.0).to(tl.float32)
    xb = x.to(tl.int32, bitcast=True)
    e = ((xb >> 23) & 0xFF) - 127
    E = tl.maximum(e, EMIN)
    a = tl.abs(x) * power_of_two(tl.minimum(MBITS - E, 127))
    lo = tl.floor(a)
    r = tl.randint(seed, offset + row * C + cols)
    u = (r >> 8).to(tl.float32)                     # r is uint32: 24 uniform bits, exact in fp32
    up = u < (a - lo) * 16777216.0
    v = tl.minimum((lo + up.to(tl.float32)) * power_of_two(tl.minimum(E - MBITS, 127)), QMAX)
    v = (v.to(tl.int32, bitcast=True) | (xb & -2147483648)).to(tl.float32, bitcast=True)  # x's sign
    v = tl.where(x == x, v, float("nan"))          # the hardware's min drops a NaN: kept (+-inf saturate)
    tl.store(Q + row * stride_qm + cols * stride_qk, cast_codes(v, Q.dtype.element_ty, 2), mask=mask)


def stochastic_round_fp8_fwd(*, x, dtype, seed, offset):
    R, C = x.shape
    codes = empty((R, C), dtype=dtype, device=x.device)
    if R and C:
        qmax, mbits, emin = FORMAT[dtype]
        block = min(arch_row(tuning.QUANT_BLOCK, x.device), triton.next_power_of_2(max(C, 16)))
        _stochastic_round_kernel[(R, triton.cdiv(C, block))](
            x, codes, seed, offset, *x.stride(), *codes.stride(), C, QMAX=qmax, MBITS=mbits,
            EMIN=emin, BLOCK=block, num_warps=arch_row(tuning.QUANT_WARPS, x.device))
    return codes
