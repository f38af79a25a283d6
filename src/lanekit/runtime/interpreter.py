"""Fixes for Triton's interpreter, applied when lanekit's kernels run interpreted.

Triton's interpreter (3.6.0 through 3.9.0 at least) gets these things wrong that the GPU gets right:
- It stores bf16 tensors as their uint16 bit patterns and multiplies those integers in ``tl.dot``:
  every bf16 matrix product it computes is garbage (fp8 operands likewise, as uint8 patterns). :func:`fix_bf16_dot` wraps ``create_dot`` so
  bf16 operands are widened to fp32 first, which is exact, and what the GPU's bf16 tensor-core
  product accumulating in fp32 computes too.
- Its casts to bf16 and to fp8 truncate the mantissa (or round half up without carrying into the
  exponent), where the GPU rounds to nearest even: up to one step of error where the GPU has half.
  Its casts of integers to bf16 store the value where the bit pattern belongs (int8 codes came
  out as NaN), and its casts from fp8 to bf16 read the fp8 bit pattern as a number. :func:`fix_float_casts` makes those casts round to nearest even, through PyTorch's
  own casts.
- Its casts from bf16 to fp32 (and so to fp64 and fp16) decode bf16's subnormals wrongly (its
  bit-by-bit decoder lands them on the wrong exponent: 1.01e-39 read as 4.4e-39; found by the
  norms' samples of rows near bf16's smallest normal, 2026-12-07). A bf16 is the top half of an
  fp32, so :func:`fix_float_casts` widens it by its bits, exactly, as the GPU does.
- Its bf16 arithmetic (``a - b`` of two bf16 tensors) adds and subtracts the bit patterns as
  integers. :func:`fix_bf16_arithmetic` computes on the values (the 4-bit linears' dequantization
  subtracts in bf16, 2026-12-07).
:func:`fix_interpreter` applies them all. Only the interpreter is touched; compiled kernels are not.
"""

from __future__ import annotations

import numpy as np


def _bf16_values(bits) -> np.ndarray:
    """The fp32 values of bf16 bit patterns (uint16, as the interpreter holds bf16): exactly, a bf16
    being the top half of an fp32."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def fix_bf16_dot() -> None:
    """Make the interpreter's ``tl.dot`` correct for bf16 operands (idempotent)."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_lanekit_bf16", False):
        return
    original = builder.create_dot

    import torch

    fp8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}

    def _widen(handle):
        if handle.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_bf16_values(handle.data), tl.float32)
        if handle.dtype.scalar in fp8:    # fp8 bit patterns: decoded exactly (fused_moe's W8A8)
            codes = torch.from_numpy(np.ascontiguousarray(handle.data).view(np.uint8))
            values = codes.view(fp8[handle.dtype.scalar]).float().numpy().reshape(np.shape(handle.data))
            return interpreter.TensorHandle(values, tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, _widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._lanekit_bf16 = True
    builder.create_dot = create_dot


def fix_float_casts() -> None:
    """Make the interpreter's casts to bf16 and fp8 round to nearest even, as the GPU does
    (idempotent)."""
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "_lanekit_rne", False):
        return
    narrow = {tl.bfloat16: (torch.bfloat16, np.uint16), tl.float8e4nv: (torch.float8_e4m3fn, np.uint8),
              tl.float8e5: (torch.float8_e5m2, np.uint8)}
    original_cast, original_fp_to_fp = builder.cast_impl, builder.create_fp_to_fp
    original_si, original_ui = builder.create_si_to_fp, builder.create_ui_to_fp

    def _round(src, dst_type):
        dst = dst_type.scalar
        if dst not in narrow or not (src.dtype.scalar.is_floating() or src.dtype.scalar.is_int()):
            return None
        data = src.data
        if src.dtype.scalar == tl.bfloat16:  # stored as bit patterns: widen exactly first
            data = _bf16_values(data)
        elif src.dtype.scalar in narrow:     # fp8 bit patterns: decode exactly first
            codes = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8))
            data = codes.view(narrow[src.dtype.scalar][0]).float().numpy().reshape(np.shape(data))
        torch_dtype, bits = narrow[dst]
        out = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch_dtype)
        out = out.view(torch.uint8 if bits == np.uint8 else torch.int16).numpy().view(bits)
        return interpreter.TensorHandle(out.reshape(np.shape(data)), dst)

    def _widen_bf16(src, dst_type):
        """bf16 to a wider float (fp32, fp64) or fp16: exactly to fp32 by the bits (subnormals
        included), then numpy's cast (exact, or rounding to nearest even for fp16)."""
        dst = dst_type.scalar
        if src.dtype.scalar != tl.bfloat16 or dst not in (tl.float32, tl.float64, tl.float16):
            return None
        data = _bf16_values(src.data)
        np_dst = {tl.float32: np.float32, tl.float64: np.float64, tl.float16: np.float16}[dst]
        return interpreter.TensorHandle(data.astype(np_dst), dst)

    def cast_impl(self, src, dst_type):
        out = _round(src, dst_type)
        if out is None:
            out = _widen_bf16(src, dst_type)
        return out if out is not None else original_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        out = _round(src, dst_type)
        if out is None:
            out = _widen_bf16(src, dst_type)
        return out if out is not None else original_fp_to_fp(self, src, dst_type, rounding_mode)

    def create_si_to_fp(self, src, dst_type):
        out = _round(src, dst_type)
        return out if out is not None else original_si(self, src, dst_type)

    def create_ui_to_fp(self, src, dst_type):
        out = _round(src, dst_type)
        return out if out is not None else original_ui(self, src, dst_type)

    cast_impl._lanekit_rne = True
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    builder.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    builder.create_si_to_fp = create_si_to_fp
    builder.create_ui_to_fp = create_ui_to_fp


def fix_bf16_arithmetic() -> None:
    """Make the interpreter's bf16 add, subtract, multiply and divide compute on the values, in
    fp32, rounded once to nearest even, as the GPU's bf16 instructions do (idempotent)."""
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_fsub, "_lanekit_bf16", False):
        return

    def wrap(name, op):
        original = getattr(builder, name)

        def create(self, lhs, rhs):
            if lhs.dtype.scalar != tl.bfloat16:
                return original(self, lhs, rhs)
            result = np.asarray(op(_bf16_values(lhs.data), _bf16_values(rhs.data)), dtype=np.float32)
            bits = torch.from_numpy(np.ascontiguousarray(result)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(bits.numpy().view(np.uint16).reshape(result.shape), tl.bfloat16)

        create._lanekit_bf16 = True
        setattr(builder, name, create)

    for name, op in (("create_fadd", np.add), ("create_fsub", np.subtract), ("create_fmul", np.multiply),
                     ("create_fdiv", np.divide)):
        wrap(name, op)


def fix_interpreter() -> None:
    """Every fix above (idempotent)."""
    fix_bf16_dot()
    fix_float_casts()
    fix_bf16_arithmetic()
