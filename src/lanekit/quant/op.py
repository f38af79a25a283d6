"""The quant family's lanes, and the custom ops that make the Triton lane opaque to
torch.compile. Every lane takes the normalized keyword arguments that ``lanekit.quant.api``
produces after validation; the reference lanes run the oracles of ``lanekit.reference.quant``.
"""

from __future__ import annotations

import torch

from lanekit.reference import quant as ref
from lanekit.runtime.custom_ops import call as _call
from lanekit.runtime.custom_ops import custom_op as _custom_op

Tensor = torch.Tensor


def _kernels():
    from lanekit.quant.kernels import quantize  # imported on first use: see runtime.lanes

    return quantize


def _scale_shape(x, granularity, group_size):
    R, C = x.shape
    if granularity == "tensor":
        return (1,)
    if granularity == "token":
        return (R, 1)
    return (R, -(-C // group_size))


# ---- quantize_fp8, quantize_int8 ----

@_custom_op("lanekit::quantize")
def _quantize_op(x: Tensor, dtype: torch.dtype, scale: Tensor | None, granularity: str,
                 group_size: int) -> tuple[Tensor, Tensor]:
    return _kernels().quantize_fwd(x=x, dtype=dtype, scale=scale, granularity=granularity,
                                   group_size=group_size)


@_quantize_op.register_fake
def _(x, dtype, scale, granularity, group_size):
    return (x.new_empty(x.shape, dtype=dtype),
            x.new_empty(_scale_shape(x, granularity, group_size), dtype=torch.float32))


def quantize_fp8_triton(*, x, dtype, scale, granularity, group_size):
    return _call(_quantize_op, x, dtype, scale, granularity, group_size)


def quantize_fp8_reference(*, x, dtype, scale, granularity, group_size):
    return ref.quantize_fp8(x, dtype, scale, granularity, group_size)


def quantize_int8_triton(*, x, scale, granularity, group_size):
    return _call(_quantize_op, x, torch.int8, scale, granularity, group_size)


def quantize_int8_reference(*, x, scale, granularity, group_size):
    return ref.quantize_int8(x, scale, granularity, group_size)


# ---- dequantize_fp8, dequantize_int8 ----

@_custom_op("lanekit::dequantize")
def _dequantize_op(codes: Tensor, scale: Tensor, granularity: str, group_size: int,
                   output_dtype: torch.dtype) -> Tensor:
    return _kernels().dequantize_fwd(codes=codes, scale=scale, granularity=granularity,
                                     group_size=group_size, output_dtype=output_dtype)


@_dequantize_op.register_fake
def _(codes, scale, granularity, group_size, output_dtype):
    return codes.new_empty(codes.shape, dtype=output_dtype)


def dequantize_triton(*, codes, scale, granularity, group_size, output_dtype):
    return _call(_dequantize_op, codes, scale, granularity, group_size, output_dtype)


def dequantize_reference(*, codes, scale, granularity, group_size, output_dtype):
    """The oracle in float64, rounded once to ``output_dtype``."""
    return ref.dequantize(codes, scale, granularity, group_size, output_dtype).to(output_dtype)


# ---- silu_and_mul_quant_fp8 ----

@_custom_op("lanekit::silu_and_mul_quant_fp8")
def _silu_and_mul_quant_op(x: Tensor, dtype: torch.dtype, scale: Tensor | None, granularity: str,
                           group_size: int) -> tuple[Tensor, Tensor]:
    from lanekit.quant.kernels import silu_mul

    return silu_mul.silu_and_mul_quant_fp8_fwd(x=x, dtype=dtype, scale=scale,
                                               granularity=granularity, group_size=group_size)


@_silu_and_mul_quant_op.register_fake
def _(x, dtype, scale, granularity, group_size):
    R, N = x.shape[0], x.shape[1] // 2
    shape = (1,) if granularity == "tensor" else (R, 1) if granularity == "token" else (R, -(-N // group_size))
    return x.new_empty((R, N), dtype=dtype), x.new_empty(shape, dtype=torch.float32)


def silu_and_mul_quant_fp8_triton(*, x, dtype, scale, granularity, group_size, intermediate_dtype):
    # intermediate_dtype is x's dtype (the kernel rounds h to it); named for the float64 oracle
    return _call(_silu_and_mul_quant_op, x, dtype, scale, granularity, group_size)


def silu_and_mul_quant_fp8_reference(*, x, dtype, scale, granularity, group_size, intermediate_dtype):
    """The oracle, the intermediate rounded to ``intermediate_dtype`` (x's dtype)."""
    return ref.silu_and_mul_quant_fp8(x, dtype, scale, granularity, group_size, intermediate_dtype)


# ---- hadamard_quantize_int8, hadamard_dequantize_int8 ----

def _hadamard():
    from lanekit.quant.kernels import hadamard

    return hadamard


def _pow2(K):
    return 1 << max(K - 1, 0).bit_length()


@_custom_op("lanekit::hadamard_quantize_int8")
def _hadamard_quant_op(x: Tensor) -> tuple[Tensor, Tensor]:
    return _hadamard().hadamard_quantize_int8_fwd(x=x)


@_hadamard_quant_op.register_fake
def _(x):
    R, K = x.shape
    return x.new_empty((R, _pow2(K)), dtype=torch.int8), x.new_empty((R, 1), dtype=torch.float32)


def hadamard_quantize_int8_triton(*, x):
    return _call(_hadamard_quant_op, x)


def hadamard_quantize_int8_reference(*, x):
    return ref.hadamard_quantize_int8(x)


@_custom_op("lanekit::hadamard_dequantize_int8")
def _hadamard_dequant_op(codes: Tensor, scale: Tensor, K: int, output_dtype: torch.dtype) -> Tensor:
    return _hadamard().hadamard_dequantize_int8_fwd(codes=codes, scale=scale, K=K, output_dtype=output_dtype)


@_hadamard_dequant_op.register_fake
def _(codes, scale, K, output_dtype):
    return codes.new_empty((codes.shape[0], K), dtype=output_dtype)


def hadamard_dequantize_int8_triton(*, codes, scale, K, output_dtype):
    return _call(_hadamard_dequant_op, codes, scale, K, output_dtype)


def hadamard_dequantize_int8_reference(*, codes, scale, K, output_dtype):
    return ref.hadamard_dequantize_int8(codes, scale, K, output_dtype).to(output_dtype)


# ---- stochastic_round_fp8 ----

@_custom_op("lanekit::stochastic_round_fp8")
def _stochastic_round_op(x: Tensor, dtype: torch.dtype, seed: int, offset: int) -> Tensor:
    from lanekit.quant.kernels import stochastic

    return stochastic.stochastic_round_fp8_fwd(x=x, dtype=dtype, seed=seed, offset=offset)


@_stochastic_round_op.register_fake
def _(x, dtype, seed, offset):
    return x.new_empty(x.shape, dtype=dtype)


def stochastic_round_fp8_triton(*, x, dtype, seed, offset):
    return _call(_stochastic_round_op, x, dtype, seed, offset)


def stochastic_round_fp8_reference(*, x, dtype, seed, offset):
    return ref.stochastic_round_fp8(x, dtype, seed, offset)


# ---- SVDQuant W4A4: the activation pass (and the weight's, the same rule) ----

@_custom_op("lanekit::quantize_w4a4_act")
def _w4a4_act_op(x: Tensor, smooth: Tensor | None, lora_down: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    from lanekit.quant.kernels import w4a4

    return w4a4.quantize_w4a4_act_fwd(x, smooth, lora_down)


@_w4a4_act_op.register_fake
def _(x, smooth, lora_down):
    M, K = x.shape
    R = lora_down.shape[1] if lora_down is not None else 0
    return (x.new_empty((M, K // 2), dtype=torch.int8), x.new_empty((K // 64, M)),
            x.new_empty((M, R), dtype=torch.float32))


def quantize_w4a4_act_fuse_lora(x: Tensor, smooth: Tensor | None, lora_down: Tensor | None):
    """The Triton pass for x (M, K): (codes int8 (M, K / 2), scales (K / 64, M) in x's dtype,
    h = x @ lora_down fp32 (M, R)); lanekit.gemm's svdquant_w4a4_linear runs it before its GEMM."""
    return _call(_w4a4_act_op, x, smooth, lora_down)


def quantize_w4a4_act_triton(*, x, smooth=None, dtype=None):
    codes, scales, _ = quantize_w4a4_act_fuse_lora(x, smooth, None)
    return codes, scales


def quantize_w4a4_act_reference(*, x, smooth=None, dtype=None):
    return ref.quantize_w4a4_act(x, smooth, dtype or x.dtype)
