"""Fixes for Triton's interpreter, applied when lanekit's kernels run interpreted.

Triton's interpreter (3.6.0 through 3.9.0 at least) stores bf16 tensors as their uint16 bit
patterns and multiplies those integers in ``tl.dot``: every bf16 matrix product it computes is
garbage. :func:`fix_bf16_dot` wraps the interpreter's ``create_dot`` so bf16 operands are widened
to fp32 first, which is exact, and what the GPU's bf16 tensor-core product accumulates in fp32
computes too. :func:`fix_bf16_cast` makes its fp32 to bf16 conversion round to nearest even, as
the GPU's does, instead of truncating. Only the interpreter is touched; compiled kernels are not
affected.
"""

from __future__ import annotations

import numpy as np


def fix_bf16_dot() -> None:
    """Make the interpreter's ``tl.dot`` correct for bf16 operands (idempotent)."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_lanekit_bf16", False):
        return
    original = builder.create_dot

    def _widen(handle):
        if handle.dtype.scalar == tl.bfloat16:
            bits = handle.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, _widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._lanekit_bf16 = True
    builder.create_dot = create_dot


def fix_bf16_cast() -> None:
    """Make the interpreter round fp32 to bf16 to nearest even, as the GPU does (idempotent).

    Triton's interpreter (3.6.0) converts fp32 to bf16 by dropping the low 16 bits (rounding toward
    zero), so a stored bf16 result errs by up to one step where the GPU's conversion errs by half a
    step at most. This wraps ``cast_impl`` for that one conversion; NaN stays NaN and values past
    the largest bf16 round to infinity, as on the GPU.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "_lanekit_bf16", False):
        return
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
            return interpreter.TensorHandle(rounded.reshape(np.shape(src.data)), tl.bfloat16)
        return original(self, src, dst_type)

    cast_impl._lanekit_bf16 = True
    builder.cast_impl = cast_impl
