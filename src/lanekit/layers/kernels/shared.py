"""Helpers that several of the fused-layer kernels use: exact widening of loads to fp32, stores
with or without masks, PTX prefetches (NVIDIA), and the host's views of rows and their strides."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lanekit.common.numerics import power_of_two, unit_exponent


@triton.jit
def _to_f32(v):
    """v in fp32, exactly. bf16 is widened by moving its bits to the top of the word, one integer
    instruction an element: Triton's own conversion extracts a register's upper bf16 with a byte
    permute and then shifts it (two, on sm90: `python -m benchmarks.sass`)."""
    if v.dtype == tl.bfloat16:
        return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def _row_scale(amax, eps):
    """p = 2^k, the power of two that brings amax (a row's max |x|, >= 0) into [1, 2), with k at
    most (99 + k_eps) // 2 (eps * 2^k_eps in [1, 2)) so that eps * p^2 stays below about 2^101:
    a row smaller than that is eps's. The norms take their statistics of x * p where fp32's sum
    of squares of x would over- or underflow: exact, and rstd(x p, eps p^2) = rstd(x, eps) / p.
    NaN or inf amax: 2^-126."""
    eps = tl.zeros_like(amax) + eps       # fp32 [amax's shape] (eps may reach here a Python float)
    k = tl.minimum(unit_exponent(amax), (99 + unit_exponent(eps)) // 2)
    return power_of_two(k)


@triton.jit
def _load_f32(ptr, mask, EVEN: tl.constexpr):
    if EVEN:
        return _to_f32(tl.load(ptr))
    return _to_f32(tl.load(ptr, mask=mask, other=0.0))


@triton.jit
def _store(ptr, value, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr, value)
    else:
        tl.store(ptr, value, mask=mask)


@triton.jit
def _prefetch_rows(rows, row_mask, n, stride, LINES: tl.constexpr, STEP: tl.constexpr,
                   LEVEL: tl.constexpr):
    """Asks for the cache lines of features [0, n) of each row (pointers [ROWS], rows with
    row_mask only) to be brought into LEVEL, "L1" or "L2", STEP features a line, LINES lines a
    row: PTX's prefetch, a hint that holds no register and reads nothing into one (NVIDIA only:
    layers.tuning.ROTARY asks for it in NVIDIA rows alone)."""
    offs = tl.arange(0, LINES) * STEP
    ptrs = (rows[:, None] + offs[None, :] * stride).to(tl.int64, bitcast=True)
    mask = (row_mask[:, None] & (offs < n)[None, :]).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global." + LEVEL + " [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, mask], dtype=tl.int32, is_pure=False, pack=1)


def _rows(t: torch.Tensor | None, N: int) -> torch.Tensor | None:
    """t as (rows, N): a view when the leading dims allow one, else a copy."""
    return None if t is None else t.reshape(math.prod(t.shape[:-1]), N)


def _strides(t: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if t is None else (t.stride(0), t.stride(1))


def _stride(t: torch.Tensor | None) -> int:
    """The stride of a (N,) parameter (0 when absent, or when expanded from one value)."""
    return 0 if t is None else t.stride(0)
