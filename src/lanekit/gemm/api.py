"""The GEMM family's public functions: 8-bit matmuls with their scales, and the quantized linears.

Each checks its arguments (a TypeError or ValueError naming the argument, what was expected and
what came; nothing is launched on bad input), then runs the chosen lane (``lane=`` on the call,
then LANEKIT_LANE, then the device: ``lanekit.runtime.lanes.select_lane``).
"""

from __future__ import annotations

import torch

from lanekit.gemm import op as _op
from lanekit.runtime import errors as _errors
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
    added. Returns (..., N) in x's dtype. Inference only: on the Triton lane the output carries no
    gradient (x's rounding to codes has none; to train beside quantized weights, use a weight-only
    linear: w8a16_linear, w4a16_linear, mxfp4_linear).

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
    Sums in fp32; bias (N,) in x's dtype or float32. Returns (..., N) in x's dtype. Inference
    only: on the Triton lane the output carries no gradient (see w8a8_linear).

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
    Differentiable in x and bias (dx = dy @ the dequantized weight, in fp32 on its columns
    rescaled exactly by powers of two, rounded once): the weight and its scale are constants.

    Raises TypeError for a wrong dtype, ValueError for a wrong rank, shape or device, or (Triton
    lane) a weight_scale that requires grad.
    """
    _v.tensor("x", x, dtypes=(torch.bfloat16, torch.float16))
    N, K = _linear_args(x, weight, (torch.int8,), bias)
    _channel_scale("weight_scale", weight_scale, N, x, tensor_ok=False)
    fn = _op.w8a16_linear_triton if _lane(x, lane) == "triton" else _op.w8a16_linear_reference
    return fn(x=x, weight=weight, weight_scale=weight_scale, bias=bias)


# ---- 4-bit weights ----

W4_LAYOUTS = ("awq", "gptq")
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _x16(x):
    _v.tensor("x", x, dtypes=(torch.bfloat16, torch.float16))
    if x.dim() < 1:
        raise ValueError(f"x: expected (..., K), got shape {tuple(x.shape)}")
    return x.shape[-1]


def _bias_n(bias, N, x):
    if bias is not None:
        _v.tensor("bias", bias, dtypes=(x.dtype, torch.float32), ndim=1, like=x, like_name="x")
        if bias.shape[0] != N:
            raise ValueError(f"bias: expected shape ({N},) (N), got {tuple(bias.shape)}")


def _w4_shapes(x, qweight, layout, K):
    if layout not in W4_LAYOUTS:
        raise ValueError(f"layout: expected one of {list(W4_LAYOUTS)}, got {layout!r}")
    _v.tensor("qweight", qweight, dtypes=(torch.int32,), ndim=2, like=x, like_name="x")
    if layout == "awq":      # (K, N / 8): eight columns of N to an int32
        if qweight.shape[0] != K:
            raise ValueError(f"qweight: expected AWQ's (K, N / 8) with K = {K} (x's last dim), got "
                             f"{tuple(qweight.shape)}")
        return qweight.shape[1] * 8
    if K % 8 or qweight.shape[0] * 8 != K:   # (K / 8, N): eight rows of K to an int32
        raise ValueError(f"qweight: expected GPTQ's (K / 8, N) with K = {K} (x's last dim, a multiple "
                         f"of 8), got {tuple(qweight.shape)}")
    return qweight.shape[1]


def _group_size(group_size, K):
    if not _v.is_int(group_size) or (int(group_size) < 1 and int(group_size) != -1):
        raise (TypeError if not _v.is_int(group_size) else ValueError)(
            f"group_size: expected an int >= 1, or -1 (one group of all K), got {group_size!r}")
    group = K if int(group_size) == -1 else int(group_size)
    if K and K % group:
        raise ValueError(f"group_size: expected a divisor of K, got group_size {group} with K = {K} "
                         f"(x's last dim); the last group would be partial, and partial groups are "
                         "refused, not padded")
    return group


def _g_idx(g_idx, layout, K, G, x):
    if g_idx is None:
        return None
    if layout != "gptq":
        raise ValueError(f"g_idx: expected None with layout {layout!r} (act-order is GPTQ's), got a tensor")
    _v.tensor("g_idx", g_idx, dtypes=(torch.int32, torch.int64), ndim=1, like=x, like_name="x")
    _v.shape("g_idx", g_idx, (K,), "K: the group of each row of K")
    if (g_idx.device.type == "cpu" or _errors.check_indices_eagerly()) and K:
        bad = (g_idx < 0) | (g_idx >= G)
        if bool(bad.any()):
            raise ValueError(f"g_idx: expected groups in [0, {G}) (K / group_size), got {int(g_idx[bad][0])}")
    return g_idx


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None = None, group_size: int = 128, layout: str = "awq",
                 bias: torch.Tensor | None = None, g_idx: torch.Tensor | None = None, *,
                 lane: str | None = None) -> torch.Tensor:
    """y = x @ W + bias with W (K, N) the int4 weight of an AWQ or GPTQ checkpoint, dequantized
    group-wise: W[k, n] = (q[k, n] - z[g, n]) * scales[g, n], g = k // group_size (or g_idx[k]).

    Arguments:
        x: (..., K) bfloat16 or float16, any strides.
        qweight: int32, the 4-bit codes q (0..15) eight to an element, as the checkpoint stores
            them (``lanekit.quant.pack_int4`` writes both):
            - layout "awq" (AutoAWQ's ``WQLinear_GEMM``): (K, N / 8), packed along N, column
              8e + j of N in nibble (0, 4, 1, 5, 2, 6, 3, 7)[j] of element e (bits 4i..4i+3 are
              nibble i): AWQ's order, from its packing map (0, 2, 4, 6, 1, 3, 5, 7);
            - layout "gptq" (AutoGPTQ's ``QuantLinear``): (K / 8, N), packed along K, row 8e + j
              of K in nibble j of element e. K and group_size must be multiples of 8.
        scales: (K / group_size, N) float16, bfloat16 or float32 (checkpoints: float16).
        zeros: None, or int32 (K / group_size, N / 8), the zero points packed along N: "awq" in
            AWQ's order, holding z; "gptq" in sequential order, holding z - 1 (GPTQ's stored
            offset: AutoGPTQ packs ``zeros - 1`` and its kernels add 1 back, so a stored 15
            means 16). None: every zero point 8 (symmetric 4-bit, GPTQ's sym=True).
        group_size: rows of K per scale: an int >= 1 dividing K, or -1 for one group (per output
            channel). K not a multiple of it is refused (ValueError), never padded.
        layout: "awq" or "gptq".
        bias: (N,) in x's dtype or float32, or None.
        g_idx: GPTQ's act-order: int32 or int64 (K,), the group of each row of K (layout "gptq"
            only). Values outside [0, K / group_size) are refused where they are checked on the
            host (CPU tensors, or LANEKIT_CHECK_INDICES=1); on a GPU such a row of K adds
            nothing and is recorded in the device error flag (``lanekit.runtime.errors``).
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        y: (..., N) in x's dtype. The exact products (codes minus zero times x, then times the
        scale) are summed in fp32 and rounded once (AWQ's and GPTQ's own kernels round the
        dequantized weight to fp16 first; lanekit does not). Differentiable in x and bias (dx =
        dy @ W.T in fp32 on W's exactly rescaled columns, rounded once; QLoRA's adapters need it): the
        codes, zeros and scales are constants.

    Raises:
        TypeError for a wrong type or dtype, ValueError for a wrong layout, rank, shape, device,
        group_size (K not a multiple of it), g_idx with layout "awq", or (Triton lane) scales
        that require grad.

    Sources: AutoAWQ's ``WQLinear_GEMM.from_linear`` and AutoGPTQ's ``QuantLinear.pack`` (the
    packing), vLLM's ``awq_triton`` and GPTQ kernels (the dequantization); docs/semantics.md.
    """
    K = _x16(x)
    N = _w4_shapes(x, qweight, layout, K)
    group = _group_size(group_size, K)
    if layout == "gptq" and group % 8:
        raise ValueError(f"group_size: expected a multiple of 8 with layout 'gptq' (eight rows of K to an "
                         f"int32: a group holds whole words), got {group}")
    G = K // group if group else 0
    _v.tensor("scales", scales, dtypes=SCALE_DTYPES, ndim=2, like=x, like_name="x")
    _v.shape("scales", scales, (G, N), "K / group_size, N")
    if zeros is not None:
        _v.tensor("zeros", zeros, dtypes=(torch.int32,), ndim=2, like=x, like_name="x")
        if N % 8:
            raise ValueError(f"zeros: expected None with N = {N} not a multiple of 8 (zeros pack eight "
                             f"columns of N to an int32), got a tensor")
        _v.shape("zeros", zeros, (G, N // 8), "K / group_size, N / 8")
    g_idx = _g_idx(g_idx, layout, K, G, x)
    _bias_n(bias, N, x)
    fn = _op.w4a16_linear_triton if _lane(x, lane) == "triton" else _op.w4a16_linear_reference
    return fn(x=x, qweight=qweight, scales=scales, zeros=zeros, group_size=group or 1, layout=layout,
              g_idx=g_idx, bias=bias)


def mxfp4_linear(x: torch.Tensor, w_fp4: torch.Tensor, w_scale_e8m0: torch.Tensor,
                 bias: torch.Tensor | None = None, *, lane: str | None = None) -> torch.Tensor:
    """y = x @ W.T + bias with W (N, K) an OCP MXFP4 weight (16-bit activations, 4-bit weights),
    in gpt-oss's layout.

    Arguments:
        x: (..., K) bfloat16 or float16, any strides; K a multiple of 32.
        w_fp4: uint8 (N, K / 2), or gpt-oss's blocks (N, K / 32, 16): e2m1 codes two to a byte,
            element 2i of a row in the low nibble, 2i + 1 in the high one (gpt-oss's
            ``_get_mxfp4_tensor``). e2m1 (OCP MX v1.0): sign,
            two exponent bits (bias 1), one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives.
        w_scale_e8m0: uint8 or float8_e8m0fnu (N, K / 32): the shared scale of each 32 elements
            of a row along K, 2^(e - 127); e = 255 is NaN (OCP MX v1.0; gpt-oss's own loader
            would give inf there), and every output it touches is NaN.
        bias: (N,) in x's dtype or float32, or None.
        lane: "triton" or "reference".

    Returns:
        y: (..., N) in x's dtype. The e2m1 values (exact in 16 bits) times x are summed in fp32
        per 32 of K, each partial sum times its scale, then rounded once. Differentiable in x
        and bias (dx = dy @ W in fp32 on W's exactly rescaled columns, rounded once).

    Raises:
        TypeError for a wrong type or dtype, ValueError for K not a multiple of 32 or a wrong
        rank, shape or device.

    Sources: OCP Microscaling Formats (MX) v1.0; openai/gpt-oss ``torch/weights.py``.
    """
    K = _x16(x)
    if K % MX_GROUP:
        raise ValueError(f"x: expected K a multiple of {MX_GROUP} (one e8m0 scale per 32 along K), got K = {K}")
    _v.tensor("w_fp4", w_fp4, dtypes=(torch.uint8,), ndim=(2, 3), like=x, like_name="x")
    N = w_fp4.shape[0]
    if w_fp4.dim() == 3:
        _v.shape("w_fp4", w_fp4, (N, K // MX_GROUP, MX_GROUP // 2), "N, K / 32, 16: gpt-oss's blocks")
        w_fp4 = w_fp4.reshape(N, K // 2)
    _v.shape("w_fp4", w_fp4, (N, K // 2), "N, K / 2: two e2m1 codes a byte")
    e8m0 = getattr(torch, "float8_e8m0fnu", torch.uint8)
    _v.tensor("w_scale_e8m0", w_scale_e8m0, dtypes=(torch.uint8, e8m0), ndim=2, like=x, like_name="x")
    _v.shape("w_scale_e8m0", w_scale_e8m0, (N, K // MX_GROUP), "N, K / 32")
    if w_scale_e8m0.dtype != torch.uint8:
        w_scale_e8m0 = w_scale_e8m0.view(torch.uint8)
    _bias_n(bias, N, x)
    fn = _op.mxfp4_linear_triton if _lane(x, lane) == "triton" else _op.mxfp4_linear_reference
    return fn(x=x, w_fp4=w_fp4, w_scale=w_scale_e8m0, bias=bias)


# ---- int4 x int8 (W4A8) and int4 x int4: the int8 dot ----

W4A8_MIN_GROUP = 32     # the int8 MMA's K: a group is a whole number of K steps
INT4_ATOM = 32          # int4_mm: K a multiple of this


def w4a8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, channel_scale: torch.Tensor,
                correction: torch.Tensor | None = None, group_size: int = 128,
                bias: torch.Tensor | None = None, *, lane: str | None = None) -> torch.Tensor:
    """y = x @ W.T + bias with 4-bit weights and 8-bit activations: the tensors of
    :func:`lanekit.quant.quantize_w4a8` (any of its modes), x quantized to int8 per token on the
    device, the int4 codes unpacked to int8 in registers and multiplied on the int8 dot.

    Arguments:
        x: (..., K) bfloat16, float16 or float32, any strides. Its rows are quantized as
            :func:`w8a8_linear` quantizes them (vLLM's ``scaled_int8_quant``: scale = amax / 127,
            0 for an all-zero row, codes round half to even, clamped to [-128, 127]).
        qweight: (N, K / 2) uint8, the weight's codes (0..15) two to a byte along K, element 2i of a
            row in the low nibble (``lanekit.quant.pack_int4(codes, 1, dtype=torch.uint8)``).
        scales: (N, K / group_size) float32, bfloat16, float16 or float8_e4m3fn: each group's
            scale (mode 0: absolute; modes 1 and 2: relative to channel_scale).
        channel_scale: (N,) float32, each output channel's scale (mode 0: ones).
        correction: (N, K / group_size) float32 or None: mode 2's per-group offset.
        group_size: rows of K per scale: a multiple of 32 dividing K, or -1 (one group of K).
        bias: (N,) in x's dtype or float32, or None.
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        y: (..., N) in x's dtype: W[n, k] = channel_scale[n] * scales[n, g] * (code - 8)
        (+ correction[n, g]), g = k // group_size. Each group's int32 sum of code products (exact)
        times the group's scale in fp32, the correction times the group's int32 sum of x's codes,
        then the channel and token scales, bias added in fp32, rounded once. Inference only: on
        the Triton lane the output carries no gradient (see w8a8_linear).

    Raises:
        TypeError for a wrong type or dtype; ValueError for a wrong rank, shape or device, or a
        group_size that is not a multiple of 32 dividing K (never padded).

    The int8 dot: IMMA (mma.sync / wgmma s8) on sm80 / sm90, mfma i8 on gfx942, wmma iu8 on
    gfx1151 / gfx1201 (Hopper and AMD have no int4 tensor cores).

    Source: the two-level scales (a per-channel fp32 scale times a per-group scale stored in fp8
    e4m3) and mode 2's correction follow Comfy-Org's comfy-kitchen W4A8 (``w4a8_int8_linear``,
    ``quantize_w4a8_int8_weight``, without its Hadamard rotation and codebook); QServe's W4A8
    (progressive group quantization) for the int4 codes on the int8 dot; docs/semantics.md, "W4A8".
    """
    _v.tensor("x", x, dtypes=ACT_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"x: expected (..., K), got shape {tuple(x.shape)}")
    K = x.shape[-1]
    _v.tensor("qweight", qweight, dtypes=(torch.uint8,), ndim=2, like=x, like_name="x")
    if K % 2 or qweight.shape[1] * 2 != K:
        raise ValueError(f"qweight: expected (N, K / 2) with K = {K} (x's last dim), two codes a byte, "
                         f"got {tuple(qweight.shape)}")
    N = qweight.shape[0]
    group = _group_size(group_size, K)
    if group % W4A8_MIN_GROUP and K:
        raise ValueError(f"group_size: expected a multiple of {W4A8_MIN_GROUP} (the int8 MMA's K), got {group}")
    G = K // group if group else 0
    _v.tensor("scales", scales, dtypes=SCALE_DTYPES + (torch.float8_e4m3fn,), ndim=2, like=x, like_name="x")
    _v.shape("scales", scales, (N, G), "N, K / group_size")
    _v.tensor("channel_scale", channel_scale, dtypes=(torch.float32,), ndim=1, like=x, like_name="x")
    _v.shape("channel_scale", channel_scale, (N,), "N")
    if correction is not None:
        _v.tensor("correction", correction, dtypes=(torch.float32,), ndim=2, like=x, like_name="x")
        _v.shape("correction", correction, (N, G), "N, K / group_size")
    _bias_n(bias, N, x)
    fn = _op.w4a8_linear_triton if _lane(x, lane) == "triton" else _op.w4a8_linear_reference
    return fn(x=x, qweight=qweight, scales=scales, channel_scale=channel_scale, correction=correction,
              group_size=group or W4A8_MIN_GROUP, bias=bias)


def int4_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
            out_dtype: torch.dtype | None = None, bias: torch.Tensor | None = None, *,
            lane: str | None = None) -> torch.Tensor:
    """(A @ B) * scale_a * scale_b + bias for signed int4 operands packed two to a byte, summed
    exactly in int32 (``int8_mm``'s contract at 4 bits; CUTLASS's ``int4b_t`` values).

    Arguments:
        a: (M, K / 2) int8 or uint8: A (M, K) packed along K, element 2i of a row in the low
            nibble (``lanekit.quant.pack_int4(A & 0xF, 1, dtype=torch.uint8)``).
        b: (K / 2, N) int8 or uint8: B (K, N) packed along K, element 2i of a column in the low
            nibble; any strides (b = w.t() of a weight w (N, K / 2) packed along its rows is taken).
            Each nibble is a two's complement int4: codes 8..15 are -8..-1.
        scale_a: float32, one element (per tensor) or (M, 1) (per row).
        scale_b: float32, one element (per tensor) or (1, N) (per column).
        out_dtype: bfloat16 (None: the default), float16 or float32.
        bias: (N,) in out_dtype or float32, or None.
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        (M, N) in out_dtype: the int32 sum (exact while K < 2^25) converted to fp32, times the
        scales, plus bias, rounded once.

    Raises:
        TypeError for a wrong dtype; ValueError for K = 2 * a.shape[1] not a multiple of 32, or a
        wrong rank, shape or device.

    Neither Hopper nor AMD has int4 tensor cores: the nibbles are unpacked to int8 in registers
    and multiplied by the int8 dot, IMMA (mma.sync / wgmma s8) on sm80 / sm90, mfma i8 on gfx942,
    wmma iu8 on gfx1151 / gfx1201; it reads half the bytes of int8_mm at the same speed of math.

    Source: vLLM's ``cutlass_scaled_mm`` (the scales), CUTLASS's int4b_t (two's complement
    nibbles); the low-nibble-first order of lanekit.quant.pack_int4.
    """
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    _out_dtype(out_dtype)
    _v.tensor("a", a, dtypes=(torch.int8, torch.uint8), ndim=2)
    _v.tensor("b", b, dtypes=(torch.int8, torch.uint8), ndim=2, like=a, like_name="a")
    K = 2 * a.shape[1]
    if K % INT4_ATOM:
        raise ValueError(f"a: expected K = 2 * a.shape[1] a multiple of {INT4_ATOM} (two int4 codes a byte), "
                         f"got a {tuple(a.shape)}, K = {K}")
    if b.shape[0] != a.shape[1]:
        raise ValueError(f"b: expected shape ({a.shape[1]}, N) (K / 2 packed rows, as a {tuple(a.shape)}), "
                         f"got {tuple(b.shape)}")
    _check_scales(a, b, scale_a, scale_b, block_ok=False)
    _bias(bias, b.shape[1], a, out_dtype)
    fn = _op.int4_mm_triton if _lane(a, lane) == "triton" else _op.int4_mm_reference
    return fn(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)


# ---- SVDQuant W4A4 with its low-rank branch ----

W4A4_GROUP = 64
W4A4_DTYPES = (torch.bfloat16, torch.float16)


def svdquant_w4a4_linear(x: torch.Tensor, qweight: torch.Tensor, wscales: torch.Tensor,
                         lora_down: torch.Tensor, lora_up: torch.Tensor, smooth: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None, *, lane: str | None = None) -> torch.Tensor:
    """SVDQuant's linear: 4-bit activations times 4-bit weights, plus a 16-bit low-rank branch,
    y = Q4(x / smooth) @ Q4(W).T + (x @ lora_down) @ lora_up.T + bias.

    Q4 is signed int4 per group of 64 along K with one 16-bit scale per row and group
    (``lanekit.quant.quantize_w4a4_act``, ``quantize_w4a4_wgt``): codes are round half to even of
    v / s where s = max |v| / 7 is the scale already rounded to its stored dtype; the linear
    reads the stored scales as they are and does not round them again. The activation is
    quantized on the device by a pass before the GEMM that also computes h = x @ lora_down (fp32
    sums); the low-rank branch takes x unsmoothed (as nunchaku: its lora_down has the smoothing
    folded in).

    Runs on: no GPU that Triton targets multiplies int4 in its tensor cores (Hopper has no int4
    MMA; AMD's CDNA 3 and RDNA have none that Triton reaches), so the nibbles are unpacked in
    registers to int8 and multiplied by the int8 tensor-core path, summed exactly in int32 per
    group of 64: wgmma s8 on sm90, mma.sync s8 on sm80, mfma i8 on gfx942, wmma iu8 on gfx1201
    and gfx1151. Each group's int32 sum times its two scales is added in fp32; the low-rank branch
    is two 16-bit tl.dot in the epilogue (h split into its 16-bit value and remainder); bias; one
    rounding to x's dtype.

    Arguments:
        x: (..., K) bfloat16 or float16, K a multiple of 64, any strides.
        qweight: int8 (N, K / 2): W's signed int4 codes, two a byte, element 2i of a row in the
            low nibble (4-bit two's complement), as ``lanekit.quant.quantize_w4a4_wgt`` returns
            them. nunchaku's checkpoints hold the same shape and dtype in a tile-permuted order for
            its MMA fragments: not read here (unpermute them first).
        wscales: (K / 64, N) bfloat16 or float16: W's scale per group of 64 along K and output
            channel (nunchaku's layout). A scale of 0 (an all-zero group) gives 0, never NaN.
        lora_down: (K, R) in x's dtype: the low-rank down projection (nunchaku's ``proj_down``).
        lora_up: (N, R) in x's dtype: the up projection (nunchaku's ``proj_up``). R >= 0 (0: no
            branch); nunchaku's ranks are multiples of 16 (16 to 128), any R is taken here.
        smooth: None, or (K,) in x's dtype or float32: SVDQuant's smoothing factor; x / smooth
            (divided in fp32, rounded to x's dtype) is what is quantized.
        bias: (N,) in x's dtype or float32, or None.
        lane: "triton" or "reference"; default triton for GPU tensors, reference otherwise.

    Returns:
        y: (..., N) in x's dtype: the exact int4 products summed in int32 per group, times the
        group's two scales in fp32, plus the low-rank branch summed in fp32, plus bias, rounded
        once. Inference only: on the Triton lane the output carries no gradient (see w8a8_linear).

    Raises:
        TypeError for a wrong type or dtype (lora_down or lora_up not in x's dtype included);
        ValueError for K not a multiple of 64, or a wrong rank, shape or device.

    Sources: Li et al., "SVDQuant: Absorbing Outliers by Low-Rank Components for 4-Bit Diffusion
    Models" (ICLR 2025); MIT Han lab's nunchaku (``SVDQW4A4Linear``, ``svdq_gemm_w4a4_cuda``,
    ``quantize_w4a4_act_fuse_lora``); docs/semantics.md, "SVDQuant W4A4".
    """
    _v.tensor("x", x, dtypes=W4A4_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"x: expected (..., K), got shape {tuple(x.shape)}")
    K = x.shape[-1]
    if K % W4A4_GROUP:
        raise ValueError(f"x: expected K (the last dim) a multiple of {W4A4_GROUP} (SVDQuant's int4 group), "
                         f"got K = {K}")
    _v.tensor("qweight", qweight, dtypes=(torch.int8,), ndim=2, like=x, like_name="x")
    if qweight.shape[1] * 2 != K:
        raise ValueError(f"qweight: expected (N, K / 2) with K = {K} (x's last dim; two int4 codes a byte), "
                         f"got {tuple(qweight.shape)}")
    N = qweight.shape[0]
    _v.tensor("wscales", wscales, dtypes=W4A4_DTYPES, ndim=2, like=x, like_name="x")
    _v.shape("wscales", wscales, (K // W4A4_GROUP, N), "K / 64, N")
    _v.tensor("lora_down", lora_down, dtypes=(x.dtype,), ndim=2, like=x, like_name="x")
    if lora_down.shape[0] != K:
        raise ValueError(f"lora_down: expected (K, R) with K = {K} (x's last dim), got {tuple(lora_down.shape)}")
    R = lora_down.shape[1]
    _v.tensor("lora_up", lora_up, dtypes=(x.dtype,), ndim=2, like=x, like_name="x")
    _v.shape("lora_up", lora_up, (N, R), "N, R: R = lora_down's columns")
    if smooth is not None:
        _v.tensor("smooth", smooth, dtypes=(x.dtype, torch.float32), ndim=1, like=x, like_name="x")
        _v.shape("smooth", smooth, (K,), "K: one factor per column of x")
    _bias_n(bias, N, x)
    fn = _op.svdquant_w4a4_linear_triton if _lane(x, lane) == "triton" else _op.svdquant_w4a4_linear_reference
    return fn(x=x, qweight=qweight, wscales=wscales, lora_down=lora_down, lora_up=lora_up, smooth=smooth,
              bias=bias, dtype=x.dtype)
