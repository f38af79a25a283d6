"""Numerics several families' oracles share: the codes of int8 and fp8 quantization (round half to
even, clamped), per-row symmetric quantization, and exact power-of-two scale helpers. Plain
PyTorch; the Triton counterparts are in ``lanekit.common.numerics``."""

from __future__ import annotations

import torch

QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


FP8_NAN_CODE = 0x7F   # e4m3fn's one NaN (sign clear); in e5m2, the all-ones NaN


def to_codes(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 x (already divided by its scale) as ``dtype`` codes: rounded to nearest, ties to even,
    clamped to the format's range (int8: [-128, 127]; e4m3: +-448; e5m2: +-57344; the cast
    rounding). A NaN's code: 0 in int8 (no NaN there: the scale carries it), 0x7F in fp8 (the
    NaN-visible rule, docs/semantics.md)."""
    nan = torch.isnan(x)
    if dtype == torch.int8:
        r = torch.round(x).clamp(-128, 127)                      # torch.round: ties to even
        return torch.where(nan, torch.zeros_like(r), r).to(torch.int8)
    codes = x.clamp(-QUANT_MAX[dtype], QUANT_MAX[dtype]).to(dtype)  # the cast rounds ties to even
    bits = torch.where(nan, torch.full_like(codes.view(torch.uint8), FP8_NAN_CODE), codes.view(torch.uint8))
    return bits.view(dtype)


def finite_amax(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """max |x| over ``dim`` (all of x when None), +inf where any value is NaN or +-inf."""
    a = x.abs()
    a = torch.where(a < float("inf"), a, torch.full_like(a, float("inf")))   # NaN -> inf
    return a.amax() if dim is None else a.amax(dim, keepdim=keepdim)


def quant_scale(amax: torch.Tensor, qmax: float, zero: float) -> torch.Tensor:
    """The dynamic scale from :func:`finite_amax`: amax / qmax correctly rounded in fp32, ``zero``
    for an all-zero group, NaN for amax +inf (a NaN or inf in the group: the NaN-visible rule)."""
    s = torch.where(amax > 0, amax / torch.full_like(amax, qmax), torch.full_like(amax, zero))
    return torch.where(amax < float("inf"), s, torch.full_like(s, float("nan")))


def quantize_per_head(v: torch.Tensor, dtype: torch.dtype):
    """Per-(token, head) symmetric quantization of float32 v (..., D): scale = amax / qmax (1 when
    the row is all zero, NaN when it holds a NaN or inf: :func:`quant_scale`), codes = :func:`to_codes` of v / scale. Every step is one correctly
    rounded fp32 operation. Returns (codes in ``dtype``, scale fp32 (...))."""
    # divided by tensors (in quant_scale too): PyTorch's CUDA kernels multiply by the reciprocal
    # of a Python scalar divisor, which is not the correctly rounded quotient
    scale = quant_scale(finite_amax(v, -1), QUANT_MAX[dtype], 1.0)
    return to_codes(v / scale.unsqueeze(-1), dtype), scale


def unit_exponent(m: torch.Tensor) -> torch.Tensor:
    """The k in [-126, 126] for which m * 2^k lies in [1, 2), for fp32 m >= 0, from m's exponent
    bits: k = 127 - e for the biased exponent e, clamped (k = 126 for 0 and subnormal m, -126 for
    m >= 2^126 and NaN). int32."""
    e = (m.view(torch.int32) >> 23) & 0xFF
    return torch.where(e == 0, 126, (127 - e).clamp(-126, 126)).to(torch.int32)


def power_of_two(k: torch.Tensor) -> torch.Tensor:
    """2^k in fp32 for int32 k in [-126, 127], from its exponent bits (exact)."""
    return ((k + 127) << 23).to(torch.int32).view(torch.float32)


def quantize_groups(x: torch.Tensor, group: int | None, dtype: torch.dtype = torch.float8_e4m3fn,
                    scale: torch.Tensor | None = None):
    """Dynamic symmetric quantization of the rows of x (R, C), every step one correctly rounded
    fp32 operation (vLLM's ``per_token_group_quant_fp8`` and ``scaled_fp8_quant``): the columns
    of each row in groups of ``group`` (the last one partial; ``group`` = C: per row), or the
    whole tensor (``group`` None). scale = amax / qmax of the group (fp32 amax of x's values; 1
    when the group is all zero; not rounded to a power of two), codes = :func:`to_codes` of
    x / scale (a group holding a NaN or inf: scale NaN, codes NaN, :func:`quant_scale`). A given
    ``scale`` (1,) is used as it is (static per-tensor). Returns (codes in
    ``dtype`` (R, C), scale fp32: (1,) per tensor, (R, ceil(C / group)) per group)."""
    x = x.to(torch.float32)
    R, C = x.shape
    qmax = QUANT_MAX[dtype]
    if scale is not None:
        return to_codes(x / scale.to(torch.float32).reshape(1, 1), dtype), scale.to(torch.float32).reshape(1)
    if group is None:
        amax = finite_amax(x).reshape(1) if x.numel() else torch.zeros(1, device=x.device)
        s = quant_scale(amax, qmax, 1.0)
        return to_codes(x / s.reshape(1, 1), dtype), s
    groups = -(-C // group)
    padded = torch.nn.functional.pad(x, (0, groups * group - C)).view(R, groups, group)
    s = quant_scale(finite_amax(padded, -1), qmax, 1.0)                 # (R, groups)
    codes = to_codes(padded / s.unsqueeze(-1), dtype).view(R, groups * group)[:, :C]
    return codes, s


# ---- 4-bit codes: int4 nibbles packed eight to an int32 (or two to a uint8), and OCP's e2m1 ----

# Where AWQ puts the eight columns col * 8 + j of one int32: AutoAWQ's WQLinear_GEMM.from_linear
# writes column col * 8 + order_map[i] into nibble i (bits 4i .. 4i + 3) with order_map
# (0, 2, 4, 6, 1, 3, 5, 7); so column j sits in nibble AWQ_NIBBLE[j] (AWQ's "reverse order",
# which vLLM's awq_triton unpacks with). Nibble j holds element j in every other layout here
# (GPTQ's qweight and qzeros, AutoGPTQ's QuantLinear.pack; the low nibble first in a uint8).
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)
INT4_ORDERS = ("sequential", "awq")
PACK = {torch.int32: 8, torch.uint8: 2}


def _nibbles(order: str, per: int, device) -> torch.Tensor:
    """The nibble of each of ``per`` consecutive elements, made on ``device`` by arithmetic (no
    copy from the host, so the unpacking can be captured in a CUDA graph): AWQ_NIBBLE[j] is
    (j % 2) * 4 + j // 2."""
    j = torch.arange(per, dtype=torch.int64, device=device)
    return (j % 2) * (per // 2) + j // 2 if order == "awq" else j


def unpack_int4(packed: torch.Tensor, dim: int = -1, order: str = "sequential") -> torch.Tensor:
    """The 4-bit codes (0..15, uint8) of ``packed`` (int32: eight per element; uint8: two),
    unpacked along ``dim``, which grows eight (two) times: element e * 8 + j of that dim is
    nibble j of packed element e (``order`` "awq": nibble AWQ_NIBBLE[j])."""
    per = PACK[packed.dtype]
    dim = dim % packed.dim()
    p = packed.movedim(dim, -1).to(torch.int64) & ((1 << (4 * per)) - 1)      # int32 as unsigned
    shifts = 4 * _nibbles(order, per, p.device)
    codes = (p.unsqueeze(-1) >> shifts) & 0xF                                   # (..., E, per)
    return codes.reshape(*p.shape[:-1], p.shape[-1] * per).movedim(-1, dim).to(torch.uint8)


def pack_int4(codes: torch.Tensor, dim: int = -1, order: str = "sequential",
              dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Integer codes in 0..15 packed along ``dim`` (its size a multiple of 8 for int32, 2 for
    uint8) into ``dtype``: the inverse of :func:`unpack_int4`, exactly."""
    per = PACK[dtype]
    dim = dim % codes.dim()
    c = codes.movedim(dim, -1).to(torch.int64)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    shifts = 4 * _nibbles(order, per, c.device)
    word = (c << shifts).sum(-1)                                                # disjoint bits: sum = or
    if dtype == torch.int32:
        word = torch.where(word >= 2**31, word - 2**32, word)                   # the same 32 bits, signed
    return word.to(dtype).movedim(-1, dim)


# OCP MX v1.0's FP4 (e2m1): sign, 2 exponent bits (bias 1), 1 mantissa bit; no inf or NaN.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The values of e2m1 codes (integers 0..15), exactly, in ``dtype``."""
    c = codes.to(torch.int64)
    e, m = (c >> 1) & 3, (c & 1).to(dtype)
    # by arithmetic rather than a table from the host (capturable in a CUDA graph): exponent 0
    # is subnormal, m / 2; else 2^(e - 1) * (1 + m / 2); bit 3 the sign (code 8 is -0.0)
    mag = torch.where(e == 0, m * 0.5, torch.exp2((e - 1).to(dtype)) * (1 + m * 0.5))
    return torch.where((c & 8) != 0, -mag, mag)


# ---- W4A8 weights (lanekit.quant.quantize_w4a8): 4-bit codes with group scales, three modes ----

W4A8_MODES = (0, 1, 2)
W4A8_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
# Modes 1 and 2 store each group's scale relative to its row's channel scale, the largest at this
# value: e4m3's largest finite number, so a relative scale uses e4m3's whole range (and fits the
# 16-bit dtypes too).
W4A8_REL_MAX = 448.0


def quantize_w4a8(w: torch.Tensor, mode: int, group_size: int, scale_dtype: torch.dtype):
    """W4A8 weight quantization of w (N, K) in groups of ``group_size`` along K (docs/semantics.md,
    "W4A8"). Every step is one correctly rounded fp32 operation:

    - span: mode 0 and 1 amax / 7 (symmetric abs-max, whichever sign the peak has); mode 2
      (max - min) / 15 over the group's own values (the range is not widened to include 0);
    - mode 0: channel = 1 and the stored scale = span in scale_dtype; modes 1 and 2: channel =
      max(span of the row) / 448 (fp32) and the stored scale = span / channel in scale_dtype (0
      where channel is 0);
    - the applied scale e = channel * float(stored) (fp32): the codes and the correction come
      from it, not from span; modes 0 and 1: code = clamp(round(w / e), -8, 7) + 8; mode 2:
      code = clamp(round((w - min) / e), 0, 15), correction = min + 8 e (fp32); e = 0 gives
      code 8 (modes 0, 1) or 0 (mode 2, where the group is constant and the correction is it).

    Dequantized: W[n, k] = channel[n] * stored[n, g] * (code - 8) (+ correction[n, g]).
    Returns (qweight uint8 (N, K/2), two codes a byte, element 2i in the low nibble;
    scales (N, K/G) scale_dtype; channel (N,) fp32; correction (N, K/G) fp32 or None)."""
    w = w.to(torch.float32)
    N, K = w.shape
    wg = w.reshape(N, K // group_size, group_size)
    lo = wg.amin(-1) if K else wg.new_zeros(N, 0)
    if mode == 2:
        span = (wg.amax(-1) - lo) / torch.full_like(lo, 15.0)
    else:
        span = wg.abs().amax(-1) / torch.full_like(lo, 7.0) if K else wg.new_zeros(N, 0)
    if mode == 0:
        channel = torch.ones(N, dtype=torch.float32, device=w.device)
        stored = span.to(scale_dtype)
    else:
        top = span.amax(-1) if K else w.new_zeros(N)
        channel = top / torch.full_like(top, W4A8_REL_MAX)
        safe = torch.where(channel > 0, channel, torch.ones_like(channel))
        stored = torch.where(channel[:, None] > 0, span / safe[:, None], torch.zeros_like(span)).to(scale_dtype)
    e = channel[:, None] * stored.to(torch.float32)                        # the scale the codes see
    live = (e > 0)[..., None]
    safe_e = torch.where(e > 0, e, torch.ones_like(e))[..., None]
    correction = None
    if mode == 2:
        u = torch.round((wg - lo[..., None]) / safe_e).clamp(0, 15)
        codes = torch.where(live, u, torch.zeros_like(u))
        correction = (lo + e * 8).contiguous()              # 8 e: exact
    else:
        q = torch.round(wg / safe_e).clamp(-8, 7)
        codes = torch.where(live, q, torch.zeros_like(q)) + 8
    qweight = pack_int4(codes.reshape(N, K).to(torch.int64), 1, dtype=torch.uint8)
    return qweight, stored.contiguous(), channel.contiguous(), correction
