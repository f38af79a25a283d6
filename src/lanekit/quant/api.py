"""Public quantize functions: validated, dispatched to a lane.

Shapes: x (R, C), R rows (tokens) of C columns. Scales are fp32: (1,) per tensor, (R, 1) per
token, (R, ceil(C / group_size)) per group of ``group_size`` columns (the last one partial), as
vLLM's ``scaled_fp8_quant`` and ``per_token_group_quant_fp8`` return them. Codes are specified
bit for bit (``lanekit.reference.quant``): amax, amax / qmax and x / scale are each one correctly
rounded fp32 operation, then the format's round half to even with saturation.
"""

from __future__ import annotations

import torch

from lanekit.quant import op as _lanes
from lanekit.reference import numerics as _numerics
from lanekit.runtime.validate import int_at_least as _int_at_least
from lanekit.runtime.validate import is_int as _v_is_int
from lanekit.runtime.validate import lane_for as _lane_for
from lanekit.runtime.validate import shape as _shape
from lanekit.runtime.validate import tensor as _tensor

__all__ = ["quantize_fp8", "quantize_int8", "dequantize_fp8", "dequantize_int8", "pack_int4", "unpack_int4",
           "quantize_w4a4_act", "quantize_w4a4_wgt"]

_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_GRANULARITIES = ("tensor", "token", "group")
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _granularity(granularity, group_size):
    if granularity not in _GRANULARITIES:
        raise ValueError(f"granularity: expected one of {list(_GRANULARITIES)}, got {granularity!r}")
    return _int_at_least("group_size", group_size, 1)


def _scale_shape(x, granularity, group_size):
    R, C = x.shape
    return {"tensor": (1,), "token": (R, 1), "group": (R, -(-C // group_size))}[granularity]


def _given_scale(scale, x, granularity, group_size):
    if scale is None:
        return None
    _tensor("scale", scale, dtypes=(torch.float32,), like=x, like_name="x")
    expected = _scale_shape(x, granularity, group_size)
    if granularity == "tensor" and scale.numel() == 1:
        return scale.reshape(1)
    _shape("scale", scale, expected, f"the {granularity} scales of x {tuple(x.shape)}")
    return scale


def _x(x, lane):
    _tensor("x", x, dtypes=_X_DTYPES, ndim=2)
    return _lane_for(x, lane, "x")


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                 scale: torch.Tensor | None = None, granularity: str = "tensor",
                 group_size: int = 128, *, lane: str | None = None):
    """Symmetric fp8 quantization of the rows of x: ``x ~ codes * scale``.

    Dynamic (``scale`` None): per scale's group of values, scale = amax / qmax (qmax = 448 for
    e4m3fn, 57344 for e5m2; amax the largest |x| of the group), 1 for an all-zero group (the
    project's convention, ``reference.numerics.quantize_groups``; its codes are 0). Static: the
    given scale as it is. codes = x / scale, correctly rounded in fp32, saturated at +-qmax and
    rounded half to even to ``dtype``: finite x never gives inf or NaN codes. A NaN or inf stays
    visible (docs/semantics.md, "Non-finite values"): a dynamic group holding one gets scale NaN
    and every code the NaN code 0x7F; with a static scale a NaN gets 0x7F and +-inf saturates.

    Arguments:
        x: (R, C) fp16, bf16 or fp32 (fp64 on the reference lane only), any strides.
        dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        scale: None (dynamic) or an fp32 tensor on x's device: one element for "tensor", (R, 1)
            for "token", (R, ceil(C / group_size)) for "group".
        granularity: "tensor" (one scale; dynamic: a global amax, two passes), "token" (one per
            row) or "group" (one per ``group_size`` columns of a row, the last group partial).
        group_size: an int >= 1, used by "group".
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        codes: (R, C) in ``dtype``, contiguous.
        scale: fp32, (1,), (R, 1) or (R, ceil(C / group_size)); the given one when static.

    Raises:
        TypeError: x or scale not a tensor or of an unsupported dtype; dtype not an fp8 dtype.
        ValueError: x not 2-d; scale on another device or of the wrong shape; an unknown
            granularity; group_size < 1; an unknown lane.

    Source: vLLM's ``scaled_fp8_quant`` (per tensor, per token) and ``per_token_group_quant_fp8``
    (per group, column-major scales not offered); the formats: OCP 8-bit floating point (OFP8).
    """
    chosen = _x(x, lane)
    if dtype not in _FP8:
        raise TypeError(f"dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    group_size = _granularity(granularity, group_size)
    scale = _given_scale(scale, x, granularity, group_size)
    return getattr(_lanes, f"quantize_fp8_{chosen}")(x=x, dtype=dtype, scale=scale,
                                                    granularity=granularity, group_size=group_size)


def quantize_int8(x: torch.Tensor, scale: torch.Tensor | None = None, granularity: str = "token",
                  group_size: int = 128, *, lane: str | None = None):
    """Symmetric int8 quantization of the rows of x: ``x ~ codes * scale``.

    codes = round half to even of x / scale (correctly rounded fp32), clamped to [-128, 127].
    Dynamic (``scale`` None): scale = amax / 127 of each group; an all-zero group gets scale 0
    and codes 0 (never NaN). Static: the given scale as it is, its sign included; where it is 0
    the codes are 0. A group holding a NaN or inf gets scale NaN and codes 0 (int8 has no NaN:
    the scale carries it, so dequantizing gives NaN); with a static scale a NaN's code is 0 (it is
    lost: use a dynamic scale to keep it) and +-inf saturates (docs/semantics.md, "Non-finite
    values").

    Arguments:
        x: (R, C) fp16, bf16 or fp32 (fp64 on the reference lane only), any strides.
        scale: None (dynamic) or fp32 on x's device: one element for "tensor", (R, 1) for
            "token", (R, ceil(C / group_size)) for "group".
        granularity: "tensor", "token" (default, vLLM's per-token int8) or "group".
        group_size: an int >= 1, used by "group".
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        codes: (R, C) int8, contiguous.
        scale: fp32 of the shape above; the given one when static.

    Raises:
        TypeError: x or scale not a tensor or of an unsupported dtype.
        ValueError: x not 2-d; scale on another device or of the wrong shape; an unknown
            granularity; group_size < 1; an unknown lane.

    Source: vLLM's ``scaled_int8_quant`` (symmetric; its azp variant is not offered).
    """
    chosen = _x(x, lane)
    group_size = _granularity(granularity, group_size)
    scale = _given_scale(scale, x, granularity, group_size)
    return getattr(_lanes, f"quantize_int8_{chosen}")(x=x, scale=scale, granularity=granularity,
                                                     group_size=group_size)


def _dequantize(codes, scale, granularity, group_size, output_dtype, lane, dtypes):
    _tensor("codes", codes, dtypes=dtypes, ndim=2)
    group_size = _granularity(granularity, group_size)
    _tensor("scale", scale, dtypes=(torch.float32,), like=codes, like_name="codes")
    if granularity == "tensor" and scale.numel() == 1:
        scale = scale.reshape(1)
    else:
        _shape("scale", scale, _scale_shape(codes, granularity, group_size),
               f"the {granularity} scales of codes {tuple(codes.shape)}")
    if output_dtype not in _OUT_DTYPES:
        raise TypeError(f"output_dtype: expected one of {[str(d) for d in _OUT_DTYPES]}, got {output_dtype}")
    chosen = _lane_for(codes, lane, "codes")
    return getattr(_lanes, f"dequantize_{chosen}")(codes=codes, scale=scale, granularity=granularity,
                                                  group_size=group_size, output_dtype=output_dtype)


_DEQ_DOC = """codes times their scale: ``y = codes * scale`` (fp32 product, rounded once to
    ``output_dtype``), the inverse of :func:`{quant}` up to its rounding.

    Arguments:
        codes: (R, C) {codes}, any strides.
        scale: fp32 on codes' device: one element for "tensor", (R, 1) for "token",
            (R, ceil(C / group_size)) for "group".
        granularity: "tensor", "token" or "group"; group_size: an int >= 1 ("group").
        output_dtype: torch.float32 (default), torch.bfloat16 or torch.float16.
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        (R, C) in output_dtype, contiguous.

    Raises:
        TypeError: a non-tensor or an unsupported dtype (codes, scale, output_dtype).
        ValueError: codes not 2-d; scale on another device or of the wrong shape; an unknown
            granularity; group_size < 1; an unknown lane.

    Source: the dequantization of vLLM's fp8 / int8 schemes (``torch._scaled_mm``'s scale_a).
    """


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, granularity: str = "tensor",
                   group_size: int = 128, output_dtype: torch.dtype = torch.float32, *,
                   lane: str | None = None):
    return _dequantize(codes, scale, granularity, group_size, output_dtype, lane, _FP8)


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, granularity: str = "token",
                    group_size: int = 128, output_dtype: torch.dtype = torch.float32, *,
                    lane: str | None = None):
    return _dequantize(codes, scale, granularity, group_size, output_dtype, lane, (torch.int8,))


dequantize_fp8.__doc__ = "fp8 " + _DEQ_DOC.format(quant="quantize_fp8", codes="torch.float8_e4m3fn or torch.float8_e5m2")
dequantize_int8.__doc__ = "int8 " + _DEQ_DOC.format(quant="quantize_int8", codes="int8")


__all__ += ["silu_and_mul_quant_fp8"]


def silu_and_mul_quant_fp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                           scale: torch.Tensor | None = None, granularity: str = "token",
                           group_size: int = 128, *, lane: str | None = None):
    """SwiGLU fused with fp8 quantization: ``h = silu(x[:, :N]) * x[:, N:]``, then fp8 codes of h.

    vLLM's ``silu_and_mul`` layout: the first half of each row is the gate, the second the up
    projection. Where it is rounded: h is computed in fp32 from x's values and rounded once to
    x's dtype (exactly what an unfused ``silu_and_mul`` returns), then quantized as
    :func:`quantize_fp8` quantizes it: dynamic per token (scale amax / qmax of the row's N
    values, 1 for an all-zero row) or per group of ``group_size`` columns, or static per tensor
    (``scale`` given, ``granularity`` "tensor"). The oracle rounds float64 h to x's dtype at
    the same point. A group whose h holds a NaN or inf (from x, or h overflowing x's dtype) gets
    scale NaN and NaN codes, as in :func:`quantize_fp8`. (The fp32 silu of the kernel differs from float64 by a few fp32 steps,
    which changes h only where it lies within them of a rounding boundary of x's dtype.)

    Arguments:
        x: (R, 2N) fp16 or bf16 (fp64 on the reference lane only), any strides. (fp32 is not
            taken: its intermediate would be the kernel's fp32 silu, not correctly rounded, so
            its codes could not be specified bit for bit.)
        dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        scale: None (dynamic), or for granularity "tensor" a one-element fp32 tensor on x's device.
        granularity: "token" (default; vLLM's per-token dynamic quant), "group" (dynamic, per
            ``group_size`` columns of h) or "tensor" (static only: scale required).
        group_size: an int >= 1, used by "group" (128: DeepSeek-V3's block quant).
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        codes: (R, N) in ``dtype``; scale: fp32 (R, 1), (R, ceil(N / group_size)), or the given (1,).

    Raises:
        TypeError: x or scale not a tensor or of an unsupported dtype; dtype not an fp8 dtype.
        ValueError: x not 2-d or of odd width; granularity "tensor" without a scale or a scale
            with another granularity; scale on another device or not of one element; an unknown
            granularity; group_size < 1; an unknown lane.

    Source: vLLM's ``silu_and_mul`` (``vllm._custom_ops``) followed by ``scaled_fp8_quant`` /
    ``per_token_group_quant_fp8``, fused as vLLM's ``silu_and_mul_quant`` and
    ``silu_and_mul_per_token_group_quant`` do.
    """
    _tensor("x", x, dtypes=(torch.float16, torch.bfloat16, torch.float64), ndim=2)
    chosen = _lane_for(x, lane, "x")
    if x.shape[1] % 2:
        raise ValueError(f"x: expected (R, 2N), an even width, got shape {tuple(x.shape)}")
    if dtype not in _FP8:
        raise TypeError(f"dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    group_size = _granularity(granularity, group_size)
    if (granularity == "tensor") != (scale is not None):
        raise ValueError("scale: expected a static scale with granularity 'tensor' and none with 'token' "
                         f"or 'group' (dynamic), got granularity {granularity!r} and "
                         f"{'a' if scale is not None else 'no'} scale")
    if scale is not None:
        _tensor("scale", scale, dtypes=(torch.float32,), like=x, like_name="x")
        if scale.numel() != 1:
            raise ValueError(f"scale: expected one element (a per-tensor scale), got shape {tuple(scale.shape)}")
        scale = scale.reshape(1)
    return getattr(_lanes, f"silu_and_mul_quant_fp8_{chosen}")(
        x=x, dtype=dtype, scale=scale, granularity=granularity, group_size=group_size,
        intermediate_dtype=torch.float32 if x.dtype == torch.float64 else x.dtype)


__all__ += ["hadamard_quantize_int8", "hadamard_dequantize_int8"]


def _max_width():
    from lanekit.quant import tuning

    return tuning.HADAMARD_MAX_WIDTH


def hadamard_quantize_int8(x: torch.Tensor, *, lane: str | None = None):
    """Rows rotated by a normalized Walsh-Hadamard transform, then per-token int8 (QuaRot /
    SpinQuant-style outlier smoothing before an int8 GEMM).

    Each row of x is zero-extended to KP = the next power of two >= K (1 for K = 0) and
    multiplied by H_KP / sqrt(KP) (Sylvester's order: H_2 = [[1, 1], [1, -1]], H_2n = H_2 (x)
    H_n). Steps (the oracle takes the same ones, so the codes are specified bit for bit):
    log2(KP) butterfly stages in fp32, pairs h = 1, 2, 4, ... apart -> (a + b, a - b), then one
    fp32 multiply by fp32(1 / sqrt(KP)); then :func:`quantize_int8` per token of the rotated
    row (scale amax / 127, 0 and codes 0 for an all-zero row; NaN and codes 0 for a row holding a
    NaN or inf, which the rotation spreads over the whole row). The whole rotated width is
    stored: a GEMM against weights rotated the same way needs all KP columns.

    Arguments:
        x: (R, K) fp16, bf16 or fp32 (fp64 on the reference lane only), any strides;
            K <= 8192 (one row's rotation sits in one program's registers).
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        codes: (R, KP) int8; scale: (R, 1) fp32.

    Raises:
        TypeError: x not a tensor or of an unsupported dtype.
        ValueError: x not 2-d or K > 8192; an unknown lane.

    Source: the transform of QuaRot (Ashkboos et al., 2024) and of the Hadamard kernels of
    fast-hadamard-transform; int8 as vLLM's ``scaled_int8_quant``.
    """
    chosen = _x(x, lane)
    if x.shape[1] > _max_width():
        raise ValueError(f"x: expected (R, K) with K <= {_max_width()}, got shape {tuple(x.shape)}")
    return getattr(_lanes, f"hadamard_quantize_int8_{chosen}")(x=x)


def hadamard_dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, K: int,
                             output_dtype: torch.dtype = torch.float32, *, lane: str | None = None):
    """The inverse of :func:`hadamard_quantize_int8`: (codes * scale) rotated back by the
    same normalized transform (H_KP / sqrt(KP) is its own inverse), the first K columns.

    Arguments:
        codes: (R, KP) int8, KP a power of two <= 8192, any strides.
        scale: (R, 1) fp32 on codes' device.
        K: the original width, an int in [0, KP] with KP the next power of two >= K.
        output_dtype: torch.float32 (default), torch.bfloat16 or torch.float16.
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        (R, K) in output_dtype: fp32 steps (log2(KP) butterflies, one multiply), rounded once.

    Raises:
        TypeError: a non-tensor or an unsupported dtype; K not an int.
        ValueError: codes not 2-d or of a width not KP = next power of two of K; scale of the
            wrong shape or device; an unknown lane.
    """
    _tensor("codes", codes, dtypes=(torch.int8,), ndim=2)
    R, KP = codes.shape
    K = _int_at_least("K", K, 0)
    want = 1 << max(K - 1, 0).bit_length()
    if KP != want or KP > _max_width():
        raise ValueError(f"codes: expected (R, {want}) (the next power of two >= K = {K}, at most "
                         f"{_max_width()}), got shape {tuple(codes.shape)}")
    _tensor("scale", scale, dtypes=(torch.float32,), like=codes, like_name="codes")
    _shape("scale", scale, (R, 1), "one scale per row of codes")
    if output_dtype not in _OUT_DTYPES:
        raise TypeError(f"output_dtype: expected one of {[str(d) for d in _OUT_DTYPES]}, got {output_dtype}")
    chosen = _lane_for(codes, lane, "codes")
    return getattr(_lanes, f"hadamard_dequantize_int8_{chosen}")(codes=codes, scale=scale, K=K,
                                                                output_dtype=output_dtype)


__all__ += ["stochastic_round_fp8"]


def stochastic_round_fp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, seed: int = 0,
                         offset: int = 0, *, lane: str | None = None):
    """Unbiased stochastic rounding of x's values to fp8 (no scale: x is already scaled).

    Each value v (x's exact value in fp32; no detour through a 16-bit format) becomes one of its
    two fp8 neighbours lo <= |v| < lo + step (step: the format's spacing at |v|, the subnormal
    spacing below the least normal), the upper one with probability (|v| - lo) / step rounded
    up to a multiple of 2^-24, so E[result] = v within 2^-24 * step; values already in the
    format are unchanged. Saturating: |v| >= qmax gives +-qmax (448 e4m3fn, 57344 e5m2), never
    inf or NaN for finite x; ``+-inf`` gives +-qmax; a NaN gives the NaN code 0x7F. The
    sign is x's (a negative value rounded to zero gives -0).

    The uniform draws are reproducible: the top 24 bits of Triton's Philox 4x32-10
    (``tl.randint``) keyed by ``seed`` at counter ``offset + row * C + col`` (the logical
    row-major index, whatever x's strides): equal (seed, offset) give equal codes on every
    device and lane; a caller advancing ``offset`` by R * C per call draws fresh numbers.

    Arguments:
        x: (R, C) fp16, bf16 or fp32 (fp64 on the reference lane only), any strides.
        dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        seed: an int in [0, 2^63).
        offset: an int >= 0 with offset + R * C < 2^63.
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        codes: (R, C) in ``dtype``.

    Raises:
        TypeError: x not a tensor or of an unsupported dtype; dtype not fp8; seed or offset not
            an int.
        ValueError: x not 2-d; seed or offset out of range; an unknown lane.

    Source: stochastic rounding as in Gupta et al. 2015 ("Deep learning with limited numerical
    precision") and the OCP MX spec's note on it; the generator is Triton's ``tl.randint``.
    """
    chosen = _x(x, lane)
    if dtype not in _FP8:
        raise TypeError(f"dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    seed = _int_at_least("seed", seed, 0)
    offset = _int_at_least("offset", offset, 0)
    if seed >= 2 ** 63:
        raise ValueError(f"seed: expected an int in [0, 2^63), got {seed}")
    if offset + x.numel() >= 2 ** 63:
        raise ValueError(f"offset: expected offset + R * C < 2^63, got {offset} with {x.numel()} values")
    return getattr(_lanes, f"stochastic_round_fp8_{chosen}")(x=x, dtype=dtype, seed=seed, offset=offset)


# ---- 4-bit codes: packing and unpacking (load-time helpers, plain PyTorch on any device) ----

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _int4_args(t, name, dim, order, dtype):
    if order not in _numerics.INT4_ORDERS:
        raise ValueError(f"order: expected one of {list(_numerics.INT4_ORDERS)}, got {order!r}")
    if dtype not in _numerics.PACK:
        raise TypeError(f"dtype: expected torch.int32 (eight codes an element) or torch.uint8 (two), got {dtype}")
    if order == "awq" and dtype != torch.int32:
        raise ValueError(f"order: expected 'sequential' with dtype {dtype} (AWQ's order is of eight "
                         "nibbles in an int32), got 'awq'")
    if not _v_is_int(dim):
        raise TypeError(f"dim: expected an int, got {type(dim).__name__}")
    if t.dim() == 0 or not -t.dim() <= int(dim) < t.dim():
        raise ValueError(f"dim: expected a dimension of {name} (shape {tuple(t.shape)}), got {dim}")
    return int(dim) % t.dim()


def pack_int4(codes: torch.Tensor, dim: int = -1, order: str = "sequential",
              dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Pack 4-bit codes (integers 0..15) along ``dim``: eight to an int32 or two to a uint8.

    Element 8e + j of ``dim`` goes to nibble j (bits 4j .. 4j + 3) of packed element e, or with
    ``order="awq"`` to nibble (0, 4, 1, 5, 2, 6, 3, 7)[j]: AWQ's order, the inverse of the map
    (0, 2, 4, 6, 1, 3, 5, 7) with which AutoAWQ's ``WQLinear_GEMM.from_linear`` fills nibble i.
    For uint8, element 2e + 1 goes to the high nibble (MXFP4's and gpt-oss's order). The packed
    int32 holds the same 32 bits, read as signed. The checkpoints' tensors, from codes Q (K, N)
    of W (K, N) = x's right operand and zero points Z (K / group_size, N):

    - AWQ: ``qweight = pack_int4(Q, 1, "awq")`` (K, N / 8), ``qzeros = pack_int4(Z, 1, "awq")``;
    - GPTQ: ``qweight = pack_int4(Q, 0)`` (K / 8, N), ``qzeros = pack_int4(Z - 1, 1)``
      (GPTQ stores zero - 1);
    - MXFP4 (gpt-oss): ``blocks = pack_int4(codes (N, K), 1, dtype=torch.uint8)`` (N, K / 2).

    Arguments:
        codes: integer tensor (uint8, int8, int16, int32, int64), values in 0..15, any device;
            its size along ``dim`` a multiple of 8 (int32) or 2 (uint8).
        dim: the dimension packed. order: "sequential" or "awq" (int32 only).
        dtype: torch.int32 or torch.uint8.

    Returns: ``dtype``, ``dim`` eight (two) times shorter; :func:`unpack_int4` gives codes back
    exactly.

    Raises: TypeError for a wrong type or dtype; ValueError for a wrong dim, order, size, or a
    value outside 0..15 (read on the host: a sync on a GPU; this runs once, at load).

    Source: the layouts of AutoAWQ's and GPTQ's checkpoints (docs/semantics.md, "4-bit weights").
    """
    _tensor("codes", codes, dtypes=_INT_DTYPES)
    d = _int4_args(codes, "codes", dim, order, dtype)
    per = _numerics.PACK[dtype]
    if codes.shape[d] % per:
        raise ValueError(f"codes: expected size along dim {dim} a multiple of {per} ({per} codes to a "
                         f"{dtype}), got shape {tuple(codes.shape)}")
    if codes.numel():
        lo, hi = int(codes.min()), int(codes.max())
        if lo < 0 or hi > 15:
            raise ValueError(f"codes: expected values in 0..15, got {lo if lo < 0 else hi}")
    return _numerics.pack_int4(codes, d, order, dtype)


def unpack_int4(packed: torch.Tensor, dim: int = -1, order: str = "sequential") -> torch.Tensor:
    """The 4-bit codes (uint8, 0..15) of ``packed`` (int32: eight an element; uint8: two), along
    ``dim``, which grows eight (two) times: the inverse of :func:`pack_int4` with the same dim
    and order ("awq": AWQ's nibble order, int32 only).

    Raises: TypeError for a packed dtype other than int32 or uint8; ValueError for a wrong dim
    or order.

    Source: the layouts of AutoAWQ's and GPTQ's checkpoints (docs/semantics.md, "4-bit weights").
    """
    _tensor("packed", packed, dtypes=tuple(_numerics.PACK))
    d = _int4_args(packed, "packed", dim, order, packed.dtype)
    return _numerics.unpack_int4(packed, d, order)


# ---- W4A8 weights: 4-bit codes with group scales (a load-time helper, plain PyTorch) ----

__all__ += ["quantize_w4a8"]

_W4A8_MIN_GROUP = 32


def quantize_w4a8(w: torch.Tensor, mode: int = 1, group_size: int = 128,
                  scale_dtype: torch.dtype = torch.float8_e4m3fn):
    """Quantize a linear's weight w (N, K) to 4-bit codes with group scales, for
    :func:`lanekit.gemm.w4a8_linear` (8-bit activations).

    Modes (each group: ``group_size`` consecutive elements of a row along K):

    - 0: symmetric abs-max, one level: the group's scale amax / 7 stored in ``scale_dtype``
      (absolute scales: float32, bfloat16 or float16; e4m3 is refused, its normal range starts
      at 2^-6, above typical weight scales); channel_scale all ones.
    - 1: symmetric abs-max, two levels: span = amax / 7; channel_scale = the row's largest span
      / 448 (fp32); the group's scale stored relative to it (span / channel_scale, at most 448)
      in ``scale_dtype``, default float8_e4m3fn.
    - 2: asymmetric, two levels as mode 1 with span = (max - min) / 15 over the group's own
      values (the range is not widened to include 0, so a group lying below 0, a more negative
      peak included, keeps its own range), codes 0..15 from min, and a correction (fp32) so that
      W = scale * (code - 8) + correction.

    Symmetric scales are amax / 7 whichever sign the peak has: a negative peak gets code -7, not
    -8, and a more negative peak never widens the scale past amax / 7. The codes (and mode 2's
    correction) are chosen from the stored scale, rounded to ``scale_dtype`` and multiplied by
    channel_scale in fp32 (e), not from the fp32 span: code = clamp(round(w / e), -8, 7) + 8, or
    clamp(round((w - min) / e), 0, 15) with correction = min + 8 e. A group (or row) whose
    scale is 0 (all zero; mode 2: constant) gets code 8 (mode 2: 0, the correction being the
    constant), never NaN. Every step is one correctly rounded fp32 operation, round half to even.

    Arguments:
        w: (N, K) float32, bfloat16 or float16, finite, any device.
        mode: 0, 1 or 2.
        group_size: a multiple of 32 dividing K, or -1 (one group of all K).
        scale_dtype: torch.float8_e4m3fn (default), float16, bfloat16 or float32.

    Returns:
        qweight: (N, K / 2) uint8, codes two a byte, element 2i of a row in the low nibble
            (``pack_int4(codes, 1, dtype=torch.uint8)``).
        scales: (N, K / group_size) in scale_dtype.
        channel_scale: (N,) float32.
        correction: (N, K / group_size) float32 for mode 2, else None.
        Dequantized: W[n, k] = channel_scale[n] * scales[n, k // group_size] * (code - 8)
        (+ correction[n, k // group_size]).

    Raises:
        TypeError: w not a float tensor of those dtypes; scale_dtype or mode of a wrong type.
        ValueError: w not 2-d, or holding a NaN or inf (read on the host: a load-time helper);
            an unknown mode; group_size not a multiple of 32 dividing K; mode 0 with e4m3.

    Source: the two-level scales (per-channel fp32 times a per-group fp8 e4m3 scale) and the
    asymmetric mode with (max - min) / 15 and a correction term follow Comfy-Org's comfy-kitchen
    W4A8 (``quantize_w4a8_int8_weight``, without its rotation and codebook); comfy-kitchen chooses
    the codes from the fp32 scale, lanekit from the stored one (issue 33). docs/semantics.md, "W4A8".
    """
    _tensor("w", w, dtypes=(torch.float32, torch.bfloat16, torch.float16), ndim=2)
    if not _v_is_int(mode) or isinstance(mode, bool):
        raise TypeError(f"mode: expected an int (0, 1 or 2), got {type(mode).__name__}")
    if int(mode) not in _numerics.W4A8_MODES:
        raise ValueError(f"mode: expected 0, 1 or 2, got {mode}")
    if scale_dtype not in _numerics.W4A8_SCALE_DTYPES:
        raise TypeError(f"scale_dtype: expected one of {[str(d) for d in _numerics.W4A8_SCALE_DTYPES]}, "
                        f"got {scale_dtype}")
    if int(mode) == 0 and scale_dtype == torch.float8_e4m3fn:
        raise ValueError("scale_dtype: expected float32, bfloat16 or float16 with mode 0 (absolute group "
                         "scales fall below e4m3's normal range), got torch.float8_e4m3fn; mode 1 stores "
                         "e4m3 scales relative to a per-channel scale")
    K = w.shape[1]
    if not _v_is_int(group_size):
        raise TypeError(f"group_size: expected an int, got {type(group_size).__name__}")
    group = (K or _W4A8_MIN_GROUP) if int(group_size) == -1 else int(group_size)   # K = 0: no group at all
    if group < 1 or group % _W4A8_MIN_GROUP or K % group:
        raise ValueError(f"group_size: expected a multiple of {_W4A8_MIN_GROUP} dividing K = {K} (or -1), "
                         f"got {group_size}")
    if w.numel() and not bool(torch.isfinite(w).all()):
        raise ValueError("w: expected finite values, got a NaN or inf")
    return _numerics.quantize_w4a8(w, int(mode), group, scale_dtype)


# ---- SVDQuant W4A4: signed int4 codes per group of 64 along K (lanekit.gemm.svdquant_w4a4_linear) ----

W4A4_GROUP = 64
_W4A4_DTYPES = (torch.bfloat16, torch.float16)


def _w4a4_rows(name, t):
    _tensor(name, t, dtypes=_W4A4_DTYPES, ndim=2)
    if t.shape[1] % W4A4_GROUP:
        raise ValueError(f"{name}: expected K (the last dim) a multiple of {W4A4_GROUP} (SVDQuant's int4 "
                         f"group), got shape {tuple(t.shape)}")


def _w4a4(x, smooth, lane):
    fn = getattr(_lanes, f"quantize_w4a4_act_{_lane_for(x, lane, 'x')}")
    return fn(x=x, smooth=smooth, dtype=x.dtype)


def quantize_w4a4_act(x: torch.Tensor, smooth: torch.Tensor | None = None, *, lane: str | None = None):
    """SVDQuant's 4-bit activations: the rows of x, smoothed, to signed int4 codes per group of 64
    columns with a 16-bit scale each (nunchaku's ``quantize_w4a4_act``; the pass that
    ``lanekit.gemm.svdquant_w4a4_linear`` runs before its GEMM, there fused with x @ lora_down).

    Every step is one correctly rounded operation, so the Triton lane's codes and scales equal the
    oracle's (``lanekit.reference.quant.quantize_w4a4_act``) bit for bit:

    - xs = x / smooth, divided in fp32 and rounded to x's dtype (nunchaku divides in 16 bits);
    - per row and group of 64: s = max |xs| / 7 in fp32, rounded to x's dtype: the stored scale;
    - codes = round half to even of xs / s **with the stored (rounded) s** (nunchaku takes the fp32
      scale's reciprocal here), clamped to [-8, 7]. An all-zero group (or one whose scale
      underflows to 0) gets scale 0 and codes 0; a group holding a NaN or inf gets scale NaN and
      codes 0 (docs/semantics.md, "Non-finite values").

    Arguments:
        x: (M, K) bfloat16 or float16, K a multiple of 64, any strides.
        smooth: None, or (K,) in x's dtype or float32: SVDQuant's per-channel smoothing factor,
            x is divided by it (nunchaku's ``smooth_factor``).
        lane: "triton" or "reference"; default triton for GPU tensors, reference otherwise.

    Returns:
        (codes, ascales): codes int8 (M, K / 2), two signed int4 codes a byte, element 2i in the
        low nibble (4-bit two's complement); ascales (K / 64, M) in x's dtype (nunchaku's layout:
        group first). Dequantized: codes * ascales.T repeated over each group.

    Raises:
        TypeError for a wrong type or dtype; ValueError for a wrong rank, K not a multiple of 64,
        a smooth of the wrong shape or device.

    Sources: Li et al., "SVDQuant: Absorbing Outliers by Low-Rank Components for 4-Bit Diffusion
    Models" (ICLR 2025); MIT Han lab's nunchaku (``quantize_w4a4_act``, ``SVDQW4A4Linear``);
    docs/semantics.md, "SVDQuant W4A4".
    """
    _w4a4_rows("x", x)
    if smooth is not None:
        _tensor("smooth", smooth, dtypes=(x.dtype, torch.float32), ndim=1, like=x, like_name="x")
        _shape("smooth", smooth, (x.shape[1],), "K: one factor per column of x")
    return _w4a4(x, smooth, lane)


def quantize_w4a4_wgt(w: torch.Tensor, *, lane: str | None = None):
    """SVDQuant's 4-bit weight: the rows of a linear's weight w (N, K) to signed int4 codes per group
    of 64 along K with a 16-bit scale each, by the rule of :func:`quantize_w4a4_act` without
    smoothing (nunchaku's ``quantize_w4a4_wgt``): s = max |w| / 7 rounded to w's dtype, codes =
    round half to even of w / s with that stored s, clamped to [-8, 7]; a zero group: s = 0,
    codes 0. In SVDQuant, w is the residual: the smoothed weight (column k of W times smooth[k])
    minus its low-rank part (the caller's decomposition: this function quantizes what it gets).

    Arguments:
        w: (N, K) bfloat16 or float16, K a multiple of 64.
        lane: "triton" or "reference".

    Returns:
        (qweight int8 (N, K / 2), element 2i in the low nibble; wscales (K / 64, N) in w's dtype):
        ``lanekit.gemm.svdquant_w4a4_linear``'s qweight and wscales.

    Raises: TypeError for a wrong type or dtype; ValueError for a wrong rank or K not a multiple
    of 64.

    Sources: as :func:`quantize_w4a4_act`.
    """
    _w4a4_rows("w", w)
    return _w4a4(w, None, lane)
