"""The GEMM family's lanes, and the custom ops that make the Triton lane opaque to torch.compile.

Every lane takes the normalized keyword arguments that the public functions produce after
validation (``lanekit.gemm.api``); the reference lanes run the oracles of
``lanekit.reference.gemm`` in float64 and round once to the output dtype.
"""

from __future__ import annotations

import torch

from lanekit.reference import gemm as ref
from lanekit.runtime.custom_ops import call as _call
from lanekit.runtime.custom_ops import custom_op as _custom_op

Tensor = torch.Tensor
BLOCK = ref.BLOCK
SCHEMES = {"tensor": 0, "row": 0, "block": 1, "mx": 2}


def _kernels():
    from lanekit.gemm import kernels  # imported on first use: see runtime.lanes

    return kernels


scale_scheme = ref.scale_scheme


def _vector(scale: Tensor, n: int, along: int) -> Tensor:
    """A per-tensor (one element) or per-row/column scale as an (n,) view (stride 0 for one)."""
    if scale.numel() == 1 and n != 1:
        return scale.reshape(1).expand(n)
    return scale.reshape(-1) if scale.dim() < 2 else scale.select(along, 0)


@_custom_op("lanekit::scaled_mm")
def _scaled_mm_op(a: Tensor, b: Tensor, scale_a: Tensor | None, scale_b: Tensor,
                  bias: Tensor | None, out_dtype: torch.dtype, scheme: int, widen_b: bool) -> Tensor:
    return _kernels().scaled_mm_fwd(a, b, scale_a, scale_b, bias, out_dtype, scheme, widen_b=widen_b)


@_scaled_mm_op.register_fake
def _(a, b, scale_a, scale_b, bias, out_dtype, scheme, widen_b):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@_custom_op("lanekit::gemm_quant_rows")
def _quant_rows_op(x: Tensor, dtype: torch.dtype, group: int, static_scale: Tensor | None) -> tuple[Tensor, Tensor]:
    return _kernels().quant_rows(x, dtype, group, static_scale)


@_quant_rows_op.register_fake
def _(x, dtype, group, static_scale):
    R, C = x.shape
    shape = (1,) if static_scale is not None else (R, -(-C // group) if C else 0)
    return x.new_empty((R, C), dtype=dtype), x.new_empty(shape, dtype=torch.float32)


def _mm(a, b, scale_a, scale_b, bias, out_dtype, scheme, widen_b=False):
    if scheme in ("tensor", "row"):
        scale_a = None if scale_a is None else _vector(scale_a, a.shape[0], 1)
        scale_b = _vector(scale_b, b.shape[1], 0)
    return _call(_scaled_mm_op, a, b, scale_a, scale_b, bias, out_dtype, SCHEMES[scheme], widen_b)


def _round(y: Tensor, out_dtype) -> Tensor:
    return y.to(out_dtype)


# ---- scaled_mm, int8_mm, mx_mm ----

def scaled_mm_triton(*, a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16):
    return _mm(a, b, scale_a, scale_b, bias, out_dtype, scale_scheme(a, b, scale_a, scale_b))


def scaled_mm_reference(*, a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16):
    scheme = scale_scheme(a, b, scale_a, scale_b)
    return _round(ref.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, scheme), out_dtype)


def int8_mm_triton(*, a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16):
    return _mm(a, b, scale_a, scale_b, bias, out_dtype, "row")


def int8_mm_reference(*, a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16):
    return _round(ref.int8_mm(a, b, scale_a, scale_b, bias, out_dtype), out_dtype)


def mx_mm_triton(*, a, a_scale, b, b_scale, out_dtype=torch.bfloat16):
    return _mm(a, b, a_scale, b_scale, None, out_dtype, "mx")


def mx_mm_reference(*, a, a_scale, b, b_scale, out_dtype=torch.bfloat16):
    return _round(ref.mx_mm(a, a_scale, b, b_scale, out_dtype), out_dtype)


# ---- the linears ----

def _rows(x):
    return x.reshape(x.shape[:-1].numel(), x.shape[-1])


def w8a8_linear_triton(*, x, weight, weight_scale, bias=None, x_scale=None):
    lead, K = x.shape[:-1], x.shape[-1]
    codes, s = _call(_quant_rows_op, _rows(x), torch.int8, max(K, 1), x_scale)
    y = _mm(codes, weight.t(), s.reshape(-1, 1), weight_scale.reshape(1, -1), bias, x.dtype, "row")
    return y.reshape(*lead, weight.shape[0])


def w8a8_linear_reference(*, x, weight, weight_scale, bias=None, x_scale=None):
    return _round(ref.w8a8_linear(x, weight, weight_scale, bias, x_scale), x.dtype)


def fp8_linear_triton(*, x, weight, weight_scale, bias=None, x_scale=None, block_size=None):
    lead, K = x.shape[:-1], x.shape[-1]
    if block_size is not None:
        codes, s = _call(_quant_rows_op, _rows(x), torch.float8_e4m3fn, BLOCK, None)
        y = _mm(codes, weight.t(), s, weight_scale.t(), bias, x.dtype, "block")
    else:
        codes, s = _call(_quant_rows_op, _rows(x), torch.float8_e4m3fn, max(K, 1), x_scale)
        y = _mm(codes, weight.t(), s.reshape(-1, 1), weight_scale.reshape(1, -1), bias, x.dtype, "row")
    return y.reshape(*lead, weight.shape[0])


def fp8_linear_reference(*, x, weight, weight_scale, bias=None, x_scale=None, block_size=None):
    return _round(ref.fp8_linear(x, weight, weight_scale, bias, x_scale, block_size), x.dtype)


# ---- the weight-only linears' backward (w8a16, w4a16, mxfp4) ----
# Differentiable in x and bias, as the reference lanes are (QLoRA trains adapters beside frozen
# quantized weights and needs dx): dx = dy @ W, dbias the column sums of dy (in float64). W, the
# dequantized weight, is built in float64 (exact: codes times fp16, bf16, e8m0 or fp32 scales),
# only when dx is asked for; each of its columns k is brought by a power of two 2^-e[k] (exact)
# to a largest magnitude in [0.5, 1) and rounded to fp32, multiplied in fp32 (torch's TF32
# setting applies, as to F.linear's backward), and the product taken back by 2^e[k] in float64
# before one rounding to x's dtype. Built in fp32 as it stood, a weight past fp32's range (an
# e8m0 scale of 2^127 times e2m1 2 or more; a float scale of 2^124 times a code of 16) was inf and
# dx inf, or NaN (0 * inf where dy is 0), where the oracle's was finite (found by helper-24's
# review); a float64 matmul avoids that too, at a sixteenth of fp32's speed or less on consumer
# GPUs (RDNA) and without TF32 on NVIDIA's.
# The codes are integers and the scales a checkpoint's constants (buffers): the Triton lane refuses
# scales that require grad (_constant) rather than leave them without a gradient.


def _constant(name: str, t: Tensor | None) -> None:
    if t is not None and t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name}: expected a tensor that does not require grad (the Triton lane "
                         f"differentiates in x and bias; a quantized weight's {name} is a constant: detach "
                         f"it, or use lane='reference'), got one with requires_grad=True")


def _weight_only_autograd(op, bias_index: int, weight) -> None:
    """Register the backward above for a weight-only linear ``op`` whose input 0 is x and input
    ``bias_index`` the bias: ``weight(*inputs[1:])`` gives W (N, K) in float64, exactly, and is
    called only where dx is asked for."""
    def setup(ctx, inputs, output):
        rest = inputs[1:]
        ctx.save_for_backward(*(t if isinstance(t, Tensor) else None for t in rest))
        ctx.constants = [None if isinstance(t, Tensor) else t for t in rest]
        ctx.dtypes = (inputs[0].dtype, inputs[bias_index].dtype if inputs[bias_index] is not None else None)

    def backward(ctx, dy):
        rest = [t if c is None else c for t, c in zip(ctx.saved_tensors, ctx.constants)]
        grads = [None] * (len(rest) + 1)
        if ctx.needs_input_grad[0]:
            w = weight(*rest)
            e = torch.frexp(w.abs().amax(0)).exponent if w.numel() else w.new_zeros(w.shape[1], dtype=torch.int32)
            grads[0] = torch.ldexp((dy.float() @ torch.ldexp(w, -e).float()).double(), e).to(ctx.dtypes[0])
        if ctx.needs_input_grad[bias_index]:
            grads[bias_index] = dy.to(torch.float64).sum(0).to(ctx.dtypes[1])
        return tuple(grads)

    op.register_autograd(backward, setup_context=setup)


@_custom_op("lanekit::w8a16_linear")
def _w8a16_op(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None) -> Tensor:
    return _kernels().scaled_mm_fwd(x, weight.t(), None, weight_scale.reshape(-1), bias, x.dtype, SCHEMES["row"],
                                    widen_b=True)


@_w8a16_op.register_fake
def _(x, weight, weight_scale, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


_weight_only_autograd(_w8a16_op, 3, lambda weight, weight_scale, bias:
                      weight.to(torch.float64) * weight_scale.to(torch.float64).reshape(-1, 1))


def w8a16_linear_triton(*, x, weight, weight_scale, bias=None):
    _constant("weight_scale", weight_scale)
    lead = x.shape[:-1]
    y = _call(_w8a16_op, _rows(x), weight, weight_scale, bias, inputs=(x, bias))
    return y.reshape(*lead, weight.shape[0])


def w8a16_linear_reference(*, x, weight, weight_scale, bias=None):
    return _round(ref.w8a16_linear(x, weight, weight_scale, bias), x.dtype)


# ---- 4-bit weights ----

@_custom_op("lanekit::w4a16_linear")
def _w4a16_op(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, g_idx: Tensor | None,
              bias: Tensor | None, group_size: int, layout: str) -> Tensor:
    return _kernels().w4a16_linear_fwd(x, qweight, scales, zeros, g_idx, bias, group_size, layout)


@_w4a16_op.register_fake
def _(x, qweight, scales, zeros, g_idx, bias, group_size, layout):
    return x.new_empty((x.shape[0], scales.shape[1]))


@_custom_op("lanekit::mxfp4_linear")
def _mxfp4_op(x: Tensor, w_fp4: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    return _kernels().mxfp4_linear_fwd(x, w_fp4, w_scale, bias)


@_mxfp4_op.register_fake
def _(x, w_fp4, w_scale, bias):
    return x.new_empty((x.shape[0], w_fp4.shape[0]))


_weight_only_autograd(_w4a16_op, 5, lambda qweight, scales, zeros, g_idx, bias, group_size, layout:
                      ref.w4_weight(qweight, scales.to(torch.float64), zeros, group_size, layout, g_idx).t())
_weight_only_autograd(_mxfp4_op, 3, lambda w_fp4, w_scale, bias: ref.mxfp4_weight(w_fp4, w_scale, torch.float64))


def w4a16_linear_triton(*, x, qweight, scales, zeros=None, group_size=128, layout="awq", g_idx=None,
                        bias=None):
    _constant("scales", scales)
    lead = x.shape[:-1]
    y = _call(_w4a16_op, _rows(x), qweight, scales, zeros, g_idx, bias, group_size, layout, inputs=(x, bias))
    return y.reshape(*lead, scales.shape[1])


def w4a16_linear_reference(*, x, qweight, scales, zeros=None, group_size=128, layout="awq", g_idx=None,
                           bias=None):
    return _round(ref.w4a16_linear(x, qweight, scales, zeros, group_size, layout, g_idx, bias), x.dtype)


def mxfp4_linear_triton(*, x, w_fp4, w_scale, bias=None):
    lead = x.shape[:-1]
    y = _call(_mxfp4_op, _rows(x), w_fp4, w_scale, bias, inputs=(x, bias))
    return y.reshape(*lead, w_fp4.shape[0])


def mxfp4_linear_reference(*, x, w_fp4, w_scale, bias=None):
    return _round(ref.mxfp4_linear(x, w_fp4, w_scale, bias), x.dtype)


# ---- W4A8 and int4 x int4 (the int8 dot) ----

@_custom_op("lanekit::w4a8_linear")
def _w4a8_op(x_codes: Tensor, x_scale: Tensor, qweight: Tensor, scales: Tensor, channel_scale: Tensor,
             correction: Tensor | None, bias: Tensor | None, group_size: int, out_dtype: torch.dtype) -> Tensor:
    return _kernels().w4a8_linear_fwd(x_codes, x_scale, qweight, scales, channel_scale, correction, bias,
                                      group_size, out_dtype)


@_w4a8_op.register_fake
def _(x_codes, x_scale, qweight, scales, channel_scale, correction, bias, group_size, out_dtype):
    return x_codes.new_empty((x_codes.shape[0], qweight.shape[0]), dtype=out_dtype)


@_custom_op("lanekit::int4_mm")
def _int4_mm_op(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Tensor | None,
                out_dtype: torch.dtype) -> Tensor:
    return _kernels().int4_mm_fwd(a, b, scale_a, scale_b, bias, out_dtype)


@_int4_mm_op.register_fake
def _(a, b, scale_a, scale_b, bias, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def w4a8_linear_triton(*, x, qweight, scales, channel_scale, correction=None, group_size=128, bias=None):
    lead, K = x.shape[:-1], x.shape[-1]
    codes, s = _call(_quant_rows_op, _rows(x), torch.int8, max(K, 1), None)
    y = _call(_w4a8_op, codes, s.reshape(-1), qweight, scales, channel_scale, correction, bias, group_size,
              x.dtype)
    return y.reshape(*lead, qweight.shape[0])


def w4a8_linear_reference(*, x, qweight, scales, channel_scale, correction=None, group_size=128, bias=None):
    return _round(ref.w4a8_linear(x, qweight, scales, channel_scale, correction, group_size, bias), x.dtype)


def int4_mm_triton(*, a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16):
    return _call(_int4_mm_op, a, b, _vector(scale_a, a.shape[0], 1), _vector(scale_b, b.shape[1], 0), bias,
                 out_dtype)


def int4_mm_reference(*, a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16):
    return _round(ref.int4_mm(a, b, scale_a, scale_b, bias, out_dtype), out_dtype)


# ---- SVDQuant W4A4 with its low-rank branch ----

@_custom_op("lanekit::svdquant_w4a4_gemm")
def _svdquant_op(qact: Tensor, ascales: Tensor, lora_act: Tensor, qweight: Tensor, wscales: Tensor,
                 lora_up: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    return _kernels().svdquant_w4a4_fwd(qact, ascales, lora_act, qweight, wscales, lora_up, bias, out_dtype)


@_svdquant_op.register_fake
def _(qact, ascales, lora_act, qweight, wscales, lora_up, bias, out_dtype):
    return qact.new_empty((qact.shape[0], qweight.shape[0]), dtype=out_dtype)


def svdquant_w4a4_linear_triton(*, x, qweight, wscales, lora_down, lora_up, smooth=None, bias=None,
                                dtype=None):
    from lanekit.quant import op as qop      # the activation pass (the quant family's kernel)

    lead, K = x.shape[:-1], x.shape[-1]
    N = qweight.shape[0]
    x2 = _rows(x)
    if K == 0 or x2.shape[0] == 0:           # the empty sum, or no rows: nothing to launch
        return _round(ref.svdquant_w4a4_linear(x, qweight, wscales, lora_down, lora_up, smooth, bias), x.dtype)
    R = lora_down.shape[1]
    qact, ascales, h = qop.quantize_w4a4_act_fuse_lora(x2, smooth, lora_down if R else None)
    y = _call(_svdquant_op, qact, ascales, h, qweight, wscales, lora_up, bias, x.dtype)
    return y.reshape(*lead, N)


def svdquant_w4a4_linear_reference(*, x, qweight, wscales, lora_down, lora_up, smooth=None, bias=None,
                                   dtype=None):
    return _round(ref.svdquant_w4a4_linear(x, qweight, wscales, lora_down, lora_up, smooth, bias,
                                           dtype or x.dtype), x.dtype)
