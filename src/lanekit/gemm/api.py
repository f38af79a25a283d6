"""The GEMM family's public functions: 8-bit matmuls with their scales, and the quantized linears.

Each checks its arguments (a TypeError or ValueError naming the argument, what was expected and
what came; nothing is launched on bad input), then runs the chosen lane (``lane=`` on the call,
then LANEKIT_LANE, then the device: ``lanekit.runtime.lanes.select_lane``).
"""

from __future__ import annotations

import torch

from lanekit.gemm import op as _op
from lanekit.runtime import validate as _v
from lanekit.runtime.lanes import select_lane as _select_lane

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = _op.BLOCK
MX_GROUP = 32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _lane(t: torch.Tensor, lane: str | None) -> str:
    return _select_lane(t.device, lane)


def _out_dtype(out_dtype):
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {[str(d) for d in OUT_DTYPES]}, got {out_dtype}")


def _operands(a, b, dtypes, what: str):
    _v.tensor("a", a, dtypes=dtypes, ndim=2)
    _v.tensor("b", b, dtypes=dtypes, ndim=2, like=a, like_name="a")
    if b.dtype != a.dtype:
        raise TypeError(f"b: expected the dtype of a ({a.dtype}), got {b.dtype} (mixed e4m3 x e5m2 "
                        "does not compile for gfx1201's fp8 WMMA in Triton 3.6)")
    if b.shape[0] != a.shape[1]:
        raise ValueError(f"b: expected shape ({a.shape[1]}, N) (K of a {tuple(a.shape)}), got {tuple(b.shape)}")
    return a.shape[0], a.shape[1], b.shape[1]


def _fp32_scale(name, s, like):
    _v.tensor(name, s, dtypes=(torch.float32,), like=like, like_name="a")


def _bias(bias, N, like, out_dtype):
    if bias is None:
        return
    _v.tensor("bias", bias, dtypes=(out_dtype, torch.float32), ndim=1, like=like, like_name="a")
    if bias.shape[0] != N:
        raise ValueError(f"bias: expected shape ({N},) (N), got {tuple(bias.shape)}")


def _check_scales(a, b, scale_a, scale_b, block_ok: bool):
    M, K = a.shape
    N = b.shape[1]
    _fp32_scale("scale_a", scale_a, a)
    _fp32_scale("scale_b", scale_b, a)
    if scale_a.numel() == 1 and scale_a.dim() <= 2 and scale_b.numel() == 1 and scale_b.dim() <= 2:
        return
    row_a = (scale_a.numel() == 1 and scale_a.dim() <= 2) or tuple(scale_a.shape) == (M, 1)
    row_b = (scale_b.numel() == 1 and scale_b.dim() <= 2) or tuple(scale_b.shape) == (1, N)
    if row_a and row_b:
        return
    blocks = (M, _cdiv(K, BLOCK)), (_cdiv(K, BLOCK), _cdiv(N, BLOCK))
    if block_ok and tuple(scale_a.shape) == blocks[0] and tuple(scale_b.shape) == blocks[1]:
        return
    expected = f"one element each, (M, 1) = ({M}, 1) and (1, N) = (1, {N})"
    if block_ok:
        expected += f", or 128 x 128 blocks {blocks[0]} and {blocks[1]}"
    name, got = ("scale_a", scale_a) if not (row_a or (block_ok and tuple(scale_a.shape) == blocks[0])) \
        else ("scale_b", scale_b)
    raise ValueError(f"{name}: expected {expected}, got scale_a {tuple(scale_a.shape)} and "
                     f"scale_b {tuple(scale_b.shape)} ({name} {tuple(got.shape)})")


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, *,
              lane: str | None = None) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) + bias for fp8 operands: ``torch._scaled_mm``'s contract,
    plus DeepSeek-V3's 128 x 128 block scales.

    a: (M, K) and b: (K, N), both float8_e4m3fn or both float8_e5m2 (not mixed), any
    strides (torch._scaled_mm wants b column-major, i.e. the transpose of an (N, K) contiguous
    weight: that layout and any other are taken). scale_a, scale_b: float32, by their shapes:

    - per tensor: one element each (shape (), (1,) or (1, 1));
    - rowwise: scale_a (M, 1) and scale_b (1, N) (either may be per tensor);
    - 128 x 128 blocks: scale_a (M, ceil(K/128)), one per row and 128 columns of K; scale_b
      (ceil(K/128), ceil(N/128)), one per 128 x 128 block of b (for a weight w (N, K) with
      DeepSeek-V3's scale (ceil(N/128), ceil(K/128)): b = w.t(), scale_b = scale.t()). Where a
      row and a block layout coincide (K <= 128, or N = 1) they mean the same scales.

    bias: (N,) in out_dtype or float32, or None. out_dtype: bfloat16, float16 or float32.
    Returns (M, N) in out_dtype. The products are summed in fp32 (sm90's fp8 wgmma accumulates
    with full fp32 precision here), the scales applied to the sum (per K step for blocks), the
    bias added in fp32, and the result rounded once. K = 0 gives zeros plus bias.

    Raises TypeError for a wrong dtype (operands, scales, bias, out_dtype) and ValueError for a
    wrong rank, shape or device.
    """
    _out_dtype(out_dtype)
    M, K, N = _operands(a, b, FP8, "fp8")
    _check_scales(a, b, scale_a, scale_b, block_ok=True)
    _bias(bias, N, a, out_dtype)
    fn = _op.scaled_mm_triton if _lane(a, lane) == "triton" else _op.scaled_mm_reference
    return fn(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)


def int8_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
            bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, *,
            lane: str | None = None) -> torch.Tensor:
    """(a @ b) * scale_a * scale_b + bias for int8 operands (vLLM's ``cutlass_scaled_mm`` on int8).

    a: (M, K) int8, b: (K, N) int8, any strides. The products are summed in int32, exactly (no
    overflow while K * 128 * 128 < 2^31, K < 131072), then converted to fp32 and scaled: scale_a
    float32 per tensor (one element) or per row (M, 1); scale_b per tensor or per column (1, N).
    bias: (N,) in out_dtype or float32, or None. Returns (M, N) in out_dtype (bfloat16, float16
    or float32). K = 0 gives zeros plus bias.

    Raises TypeError for a wrong dtype, ValueError for a wrong rank, shape or device.
    """
    _out_dtype(out_dtype)
    M, K, N = _operands(a, b, (torch.int8,), "int8")
    _check_scales(a, b, scale_a, scale_b, block_ok=False)
    _bias(bias, N, a, out_dtype)
    fn = _op.int8_mm_triton if _lane(a, lane) == "triton" else _op.int8_mm_reference
    return fn(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)


def mx_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
          out_dtype: torch.dtype = torch.bfloat16, *, lane: str | None = None) -> torch.Tensor:
    """MXFP8 matmul (OCP Microscaling Formats spec v1.0): a (M, K) and b (K, N) float8_e4m3fn
    elements, each 32 consecutive elements along K sharing one e8m0 scale.

    a_scale: (M, K/32) uint8 and b_scale: (K/32, N) uint8, the scales' biased exponents: scale
    2^(e - 127), e = 255 NaN (every product it touches is NaN). K must be a multiple of 32.
    Any strides. Products summed in fp32, each 32-wide step scaled by its two scales, the result
    rounded once to out_dtype (bfloat16, float16 or float32); K = 0 gives zeros.

    Raises TypeError for a wrong dtype, ValueError for a wrong rank, shape or device.
    """
    _out_dtype(out_dtype)
    M, K, N = _operands(a, b, (torch.float8_e4m3fn,), "e4m3")
    if K % MX_GROUP:
        raise ValueError(f"a: expected K a multiple of {MX_GROUP} (one e8m0 scale per 32 along K), got K = {K}")
    _v.tensor("a_scale", a_scale, dtypes=(torch.uint8,), ndim=2, like=a, like_name="a")
    _v.tensor("b_scale", b_scale, dtypes=(torch.uint8,), ndim=2, like=a, like_name="a")
    _v.shape("a_scale", a_scale, (M, K // MX_GROUP), "M, K / 32")
    _v.shape("b_scale", b_scale, (K // MX_GROUP, N), "K / 32, N")
    fn = _op.mx_mm_triton if _lane(a, lane) == "triton" else _op.mx_mm_reference
    return fn(a=a, a_scale=a_scale, b=b, b_scale=b_scale, out_dtype=out_dtype)


def _linear_args(x, weight, weight_dtypes, bias):
    _v.tensor("x", x, dtypes=ACT_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"x: expected (..., K), got shape {tuple(x.shape)}")
    _v.tensor("weight", weight, dtypes=weight_dtypes, ndim=2, like=x, like_name="x")
    K = x.shape[-1]
    if weight.shape[1] != K:
        raise ValueError(f"weight: expected shape (N, {K}) (K of x {tuple(x.shape)}), got {tuple(weight.shape)}")
    N = weight.shape[0]
    if bias is not None:
        _v.tensor("bias", bias, dtypes=(x.dtype, torch.float32), ndim=1, like=x, like_name="x")
        if bias.shape[0] != N:
            raise ValueError(f"bias: expected shape ({N},) (N), got {tuple(bias.shape)}")
    return N, K


def _channel_scale(name, s, N, x, *, tensor_ok: bool):
    _v.tensor(name, s, dtypes=(torch.float32,), like=x, like_name="x")
    shapes = [(N,), (N, 1)] + ([(1,), (), (1, 1)] if tensor_ok else [])
    if tuple(s.shape) not in shapes:
        raise ValueError(f"{name}: expected shape in {shapes} (per output channel"
                         f"{' or per tensor' if tensor_ok else ''}), got {tuple(s.shape)}")


def _static_scale(x_scale, x):
    if x_scale is None:
        return
    _v.tensor("x_scale", x_scale, dtypes=(torch.float32,), like=x, like_name="x")
    if x_scale.numel() != 1:
        raise ValueError(f"x_scale: expected one element (a static per-tensor scale), got shape {tuple(x_scale.shape)}")


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, x_scale: torch.Tensor | None = None, *,
                lane: str | None = None) -> torch.Tensor:
    """y = x @ weight.T with int8 activations and weights (vLLM's W8A8 int8 linear:
    ``scaled_int8_quant`` then ``cutlass_scaled_mm``).

    x: (..., K) bfloat16, float16 or float32, any strides. Its rows are quantized on the device:
    dynamic (x_scale None) per token, scale = amax / 127 (0 for an all-zero row, whose codes are
    0), codes = round half to even of x / scale clamped to [-128, 127], both divisions correctly
    rounded in fp32; or static: x_scale, one float32 element, used as given. weight: (N, K) int8
    codes; weight_scale: float32 (N,) or (N, 1) per output channel, or one element. The product is
    summed in int32 (exact), scaled by both scales in fp32, bias ((N,) in x's dtype or float32)
    added. Returns (..., N) in x's dtype.

    Raises TypeError for a wrong dtype, ValueError for a wrong rank, shape or device.
    """
    N, K = _linear_args(x, weight, (torch.int8,), bias)
    _channel_scale("weight_scale", weight_scale, N, x, tensor_ok=True)
    _static_scale(x_scale, x)
    fn = _op.w8a8_linear_triton if _lane(x, lane) == "triton" else _op.w8a8_linear_reference
    return fn(x=x, weight=weight, weight_scale=weight_scale, bias=bias, x_scale=x_scale)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
               block_size: list[int] | tuple[int, int] | None = None, *,
               lane: str | None = None) -> torch.Tensor:
    """y = x @ weight.T with fp8 e4m3 activations and weights (vLLM's ``Fp8LinearOp`` and its
    block-quantized variant ``w8a8_block_fp8_matmul``).

    x: (..., K) bfloat16, float16 or float32, any strides; quantized on the device to e4m3:
    dynamic per token (x_scale None; scale = amax / 448, 1 for an all-zero row; codes = x / scale
    saturated at +-448, rounded half to even), or static with x_scale (one float32 element). With
    ``block_size`` = [128, 128]: per 1 x 128 group of each row instead (DeepSeek-V3), and
    weight_scale per 128 x 128 block. weight: (N, K) float8_e4m3fn; weight_scale float32: (N,) or
    (N, 1) per channel, one element per tensor, or with block_size (ceil(N/128), ceil(K/128)).
    Sums in fp32; bias (N,) in x's dtype or float32. Returns (..., N) in x's dtype.

    Raises TypeError for a wrong dtype, ValueError for a wrong rank, shape, device or block_size.
    """
    N, K = _linear_args(x, weight, (torch.float8_e4m3fn,), bias)
    if block_size is not None:
        if (not isinstance(block_size, (list, tuple)) or not all(map(_v.is_int, block_size))
                or list(block_size) != [BLOCK, BLOCK]):   # [128.0, 128.0] too, as fused_moe's block_shape
            raise ValueError(f"block_size: expected [128, 128] or None, got {block_size!r}")
        if x_scale is not None:
            raise ValueError("x_scale: expected None with block_size (the activations are quantized "
                             "per 1 x 128 group), got a tensor")
        _v.tensor("weight_scale", weight_scale, dtypes=(torch.float32,), ndim=2, like=x, like_name="x")
        _v.shape("weight_scale", weight_scale, (_cdiv(N, BLOCK), _cdiv(K, BLOCK)), "ceil(N/128), ceil(K/128)")
        block_size = (BLOCK, BLOCK)
    else:
        _channel_scale("weight_scale", weight_scale, N, x, tensor_ok=True)
        _static_scale(x_scale, x)
    fn = _op.fp8_linear_triton if _lane(x, lane) == "triton" else _op.fp8_linear_reference
    return fn(x=x, weight=weight, weight_scale=weight_scale, bias=bias, x_scale=x_scale,
              block_size=block_size)


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, *, lane: str | None = None) -> torch.Tensor:
    """y = x @ (weight * weight_scale).T with int8 weights and 16-bit activations (vLLM's W8A16:
    the weight read as int8, half the bytes of bf16, and widened in the load, exactly).

    x: (..., K) bfloat16 or float16, any strides. weight: (N, K) int8 codes; weight_scale:
    float32 (N,) or (N, 1), per output channel. Sums in fp32, the channel scale applied to the
    sum, bias ((N,) in x's dtype or float32) added; returns (..., N) in x's dtype.

    Raises TypeError for a wrong dtype, ValueError for a wrong rank, shape or device.
    """
    _v.tensor("x", x, dtypes=(torch.bfloat16, torch.float16))
    N, K = _linear_args(x, weight, (torch.int8,), bias)
    _channel_scale("weight_scale", weight_scale, N, x, tensor_ok=False)
    fn = _op.w8a16_linear_triton if _lane(x, lane) == "triton" else _op.w8a16_linear_reference
    return fn(x=x, weight=weight, weight_scale=weight_scale, bias=bias)
