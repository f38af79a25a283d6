"""A fix for Triton's interpreter, applied when lanekit's kernels run interpreted.

Triton's interpreter (3.6.0 through 3.9.0 at least) stores bf16 tensors as their uint16 bit
patterns and multiplies those integers in ``tl.dot``: every bf16 matrix product it computes is
garbage. :func:`fix_bf16_dot` wraps the interpreter's ``create_dot`` so bf16 operands are widened
to fp32 first, which is exact, and what the GPU's bf16 tensor-core product accumulates in fp32
computes too. Only the interpreter is touched; compiled kernels are not affected.
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
