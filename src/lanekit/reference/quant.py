"""Oracles of the quant family (``lanekit.quant``): fp8 and int8 quantization of rows, per
tensor, per token (row) or per group of columns, and the matching dequantization.

Codes are specified bit for bit: every step is one correctly rounded fp32 operation on x's
values (exact in fp32 for fp16, bf16 and fp32 inputs): amax, scale = amax / qmax, x / scale,
then the format's rounding (round half to even) with saturation (:func:`reference.numerics.to_codes`).
Divisions are tensor by tensor: PyTorch's CUDA division by a Python scalar multiplies by the
reciprocal, which is not the correctly rounded quotient.
"""

from __future__ import annotations

import torch

from lanekit.reference.numerics import FP8_NAN_CODE, QUANT_MAX, finite_amax, quant_scale, to_codes


def _group_of(granularity: str, C: int, group_size: int) -> int:
    return C if granularity in ("tensor", "token") else group_size


def _groups(x: torch.Tensor, group: int):
    """x (R, C) zero-extended to (R, G, group), G = ceil(C / group)."""
    R, C = x.shape
    G = -(-C // group) if C else 0
    return torch.nn.functional.pad(x, (0, G * group - C)).view(R, G, group), G


def _quantize(x, dtype, scale, granularity, group_size, zero_scale):
    x = x.to(torch.float32)
    R, C = x.shape
    qmax = QUANT_MAX[dtype]
    if scale is None:
        if granularity == "tensor":
            amax = finite_amax(x).reshape(1, 1) if x.numel() else torch.zeros(1, 1, device=x.device)
        elif granularity == "token":
            amax = finite_amax(x, -1, keepdim=True) if C else torch.zeros(R, 1, device=x.device)
        else:
            g, _ = _groups(x, _group_of(granularity, C, group_size))
            amax = finite_amax(g, -1) if g.numel() else torch.zeros(R, g.shape[1], device=x.device)
        s = quant_scale(amax, qmax, zero_scale)     # NaN for a group holding a NaN or inf
    else:
        s = scale.to(torch.float32).reshape(1, 1) if granularity == "tensor" else scale.to(torch.float32)
    group = C if granularity == "tensor" else _group_of(granularity, C, group_size)
    g, G = _groups(x, max(group, 1))
    full = s.expand(R, G) if granularity == "tensor" else s
    q = g / full.unsqueeze(-1)
    if dtype == torch.int8:
        q = torch.where(full.unsqueeze(-1) == 0, torch.zeros_like(q), q)   # a zero scale: codes 0
    codes = to_codes(q, dtype).view(R, G * max(group, 1))[:, :C]
    return codes, (s.reshape(1) if granularity == "tensor" else s)


def quantize_fp8(x: torch.Tensor, dtype=torch.float8_e4m3fn, scale=None, granularity="tensor",
                 group_size=128):
    """Symmetric fp8 codes of x (R, C) and their fp32 scales: (1,) per tensor, (R, 1) per token,
    (R, ceil(C / group_size)) per group. Dynamic (``scale`` None): scale = amax / qmax (448 for
    e4m3, 57344 for e5m2), 1 for an all-zero group (``reference.numerics.quantize_groups``'s
    convention); static: the given scale. codes = x / scale saturated at +-qmax, rounded half to
    even. A group holding a NaN or inf: scale NaN, codes 0x7F (NaN); static: a NaN's code 0x7F,
    +-inf saturated (docs/semantics.md, "Non-finite values"). vLLM's ``scaled_fp8_quant`` /
    ``per_token_group_quant_fp8``."""
    return _quantize(x, dtype, scale, granularity, group_size, 1.0)


def quantize_int8(x: torch.Tensor, scale=None, granularity="token", group_size=128):
    """Symmetric int8 codes of x (R, C): round half to even of x / scale clamped to [-128, 127];
    dynamic scale amax / 127, 0 for an all-zero group (whose codes are 0); a given scale is used
    as it is (its sign included; a zero scale gives codes 0). A group holding a NaN or inf: scale
    NaN, codes 0; static: a NaN's code 0, +-inf saturated. vLLM's ``scaled_int8_quant``
    (symmetric)."""
    return _quantize(x, torch.int8, scale, granularity, group_size, 0.0)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, granularity="tensor", group_size=128,
               output_dtype=torch.float32):
    """codes (R, C) times their scale, in float64 (the caller rounds to ``output_dtype``)."""
    R, C = codes.shape
    c = codes.to(torch.float64)
    s = scale.to(torch.float64)
    if granularity == "tensor":
        return c * s.reshape(1, 1)
    if granularity == "token":
        return c * s.reshape(R, 1)
    cols = torch.arange(C, device=codes.device) // group_size
    return c * s[:, cols]


def silu_and_mul_quant_fp8(x: torch.Tensor, dtype=torch.float8_e4m3fn, scale=None,
                           granularity="token", group_size=128, intermediate_dtype=None):
    """SwiGLU of x (R, 2N) (gate = x[:, :N], up = x[:, N:]), h = silu(gate) * up in float64
    rounded to ``intermediate_dtype`` (x's dtype by default: the output of an unfused
    ``silu_and_mul``), then :func:`quantize_fp8` of h: per token ((R, 1) scales), per group
    ((R, ceil(N / group_size))), or static per tensor (``scale`` given, granularity "tensor")."""
    N = x.shape[-1] // 2
    g, u = x[:, :N].to(torch.float64), x[:, N:].to(torch.float64)
    h = (g * torch.sigmoid(g) * u).to(intermediate_dtype or x.dtype)
    return quantize_fp8(h, dtype, scale, granularity, group_size)


def _wht_fp32(x: torch.Tensor) -> torch.Tensor:
    """The normalized Walsh-Hadamard transform of fp32 rows x (R, KP), KP a power of two, in
    the kernel's steps: stages h = 1, 2, 4, ...: (a, b) h apart -> (a + b, a - b), each
    correctly rounded in fp32, then times fp32(1 / sqrt(KP))."""
    R, KP = x.shape
    h = 1
    while h < KP:
        v = x.view(R, KP // (2 * h), 2, h)
        a, b = v[:, :, 0], v[:, :, 1]
        x = torch.stack((a + b, a - b), dim=2).reshape(R, KP)
        h *= 2
    norm = torch.tensor(1.0 / KP ** 0.5, dtype=torch.float32)
    return x * norm


def hadamard_quantize_int8(x: torch.Tensor):
    """Rows of x (R, K) zero-extended to KP = the next power of two, rotated by the normalized
    Walsh-Hadamard transform (:func:`_wht_fp32`, fp32 steps the kernel takes), then
    :func:`quantize_int8` per token. Returns (codes int8 (R, KP), scale fp32 (R, 1))."""
    R, K = x.shape
    KP = 1 << max(K - 1, 0).bit_length()
    y = torch.nn.functional.pad(x.to(torch.float32), (0, KP - K))
    return quantize_int8(_wht_fp32(y), None, "token")


def hadamard_dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, K: int, output_dtype=torch.float32):
    """The inverse: (codes * scale) rotated back by the normalized transform (its own inverse),
    the first K columns; float64."""
    R, KP = codes.shape
    y = codes.to(torch.float64) * scale.to(torch.float64).reshape(R, 1)
    h = 1
    while h < KP:
        v = y.view(R, KP // (2 * h), 2, h)
        a, b = v[:, :, 0], v[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).reshape(R, KP)
        h *= 2
    return (y / KP ** 0.5)[:, :K]


_FP8_FORMAT = {torch.float8_e4m3fn: (448.0, 3, -6), torch.float8_e5m2: (57344.0, 2, -14)}
_M32 = 0xFFFFFFFF


def philox_randint(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """Triton's ``tl.randint(seed, counters)`` (Philox 4x32, 10 rounds; int64 counters: low
    word c0, high word c1; key: the seed's low and high words): the first output word, as
    int64 in [0, 2^32). Plain integer arithmetic (numpy uint64: products of 32-bit words are
    exact)."""
    import numpy as np

    c = counters.detach().cpu().to(torch.int64).numpy().astype(np.uint64)
    m = np.uint64(_M32)
    c0, c1 = c & m, (c >> np.uint64(32)) & m
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    s = seed & 0xFFFFFFFFFFFFFFFF
    k0, k1 = np.uint64(s & _M32), np.uint64((s >> 32) & _M32)
    A, B = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        p0, p2 = B * c2, A * c0            # < 2^64: exact
        n0 = (p0 >> np.uint64(32)) ^ c1 ^ k0
        n2 = (p2 >> np.uint64(32)) ^ c3 ^ k1
        c1, c3 = p0 & m, p2 & m
        c0, c2 = n0 & m, n2 & m
        k0 = np.uint64((int(k0) + 0x9E3779B9) & _M32)
        k1 = np.uint64((int(k1) + 0xBB67AE85) & _M32)
    return torch.from_numpy(c0.astype(np.int64)).to(counters.device)


def stochastic_round_fp8(x: torch.Tensor, dtype=torch.float8_e4m3fn, seed: int = 0, offset: int = 0):
    """Each fp32 value of x (R, C) to one of its two neighbours in ``dtype``, the upper (in
    magnitude) with probability (|x| - lo) / step, step the fp8 spacing at |x|; saturated at
    +-qmax. The uniform draw is the top 24 bits of Philox's word at counter offset + row * C +
    col (:func:`philox_randint`), up when it is < frac * 2^24 (so P(up) is frac rounded up to
    a multiple of 2^-24). Returns codes in ``dtype`` (R, C)."""
    qmax, mbits, emin = _FP8_FORMAT[dtype]
    x = x.to(torch.float32)
    R, C = x.shape
    e = ((x.view(torch.int32) >> 23) & 0xFF) - 127
    E = e.clamp(min=emin)
    a = x.abs() * torch.pow(2.0, (mbits - E).clamp(max=127).to(torch.float64)).to(torch.float32)
    lo = torch.floor(a)
    counters = offset + torch.arange(R * C, dtype=torch.int64, device=x.device).view(R, C)
    r = philox_randint(seed, counters)
    up = (r >> 8).to(torch.float32) < (a - lo) * 16777216.0
    step = torch.pow(2.0, (E - mbits).clamp(max=127).to(torch.float64)).to(torch.float32)
    v = torch.minimum((lo + up.to(torch.float32)) * step, torch.full_like(lo, qmax))
    codes = torch.where(torch.signbit(x), -v, v).to(dtype).view(torch.uint8)   # x's sign, -0 included
    nan = torch.full_like(codes, FP8_NAN_CODE)
    return torch.where(torch.isnan(x), nan, codes).view(dtype)   # NaN: the NaN code (+-inf saturate)


# ---- SVDQuant's W4A4: signed int4 codes per group of 64 along K, 16-bit scales ----
# (Li et al., "SVDQuant: Absorbing Outliers by Low-Rank Components for 4-Bit Diffusion Models",
# ICLR 2025; MIT Han lab's nunchaku: quantize_w4a4_act / quantize_w4a4_wgt. docs/semantics.md,
# "SVDQuant W4A4".)

W4A4_GROUP = 64
W4A4_QMAX = 7.0


def pack_w4a4(codes: torch.Tensor) -> torch.Tensor:
    """Signed int4 codes (..., K) in [-8, 7] two to an int8 (..., K / 2): element 2i in the low
    nibble, 2i + 1 in the high one, each as its 4-bit two's complement."""
    c = codes.to(torch.int64) & 0xF
    byte = c[..., 0::2] | (c[..., 1::2] << 4)
    return torch.where(byte >= 128, byte - 256, byte).to(torch.int8)


def unpack_w4a4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_w4a4`: int8 (..., K / 2) -> signed codes int8 (..., K)."""
    b = packed.to(torch.int64) & 0xFF
    nib = torch.stack((b & 0xF, b >> 4), -1).reshape(*b.shape[:-1], b.shape[-1] * 2)
    return torch.where(nib >= 8, nib - 16, nib).to(torch.int8)


def quantize_w4a4_act(x: torch.Tensor, smooth: torch.Tensor | None = None, dtype: torch.dtype | None = None):
    """SVDQuant's activation quantization of x (M, K), K a multiple of 64, ``dtype`` the 16-bit
    format (bf16 or fp16) x's values are in (x's own dtype when None; the checks pass float64
    copies). Every step is one correctly rounded operation:

    - smoothing: xs = x / smooth in fp32, rounded to ``dtype`` (nunchaku divides in 16 bits);
    - per row and group of 64 columns: s = amax(|xs|) / 7 in fp32, rounded to ``dtype``: the
      stored scale; NaN for a group holding a NaN or inf (the NaN-visible rule), 0 for an
      all-zero group;
    - codes = round half to even of xs / s, with the stored (rounded) s, clamped to [-8, 7];
      0 where s is 0 or NaN.

    Returns (codes packed by :func:`pack_w4a4`, int8 (M, K / 2); scales (K / 64, M) in ``dtype``,
    nunchaku's ascales layout)."""
    dtype = dtype or x.dtype
    xs = x.to(torch.float64)
    if smooth is not None:
        xs = (xs / smooth.to(torch.float64)).to(torch.float32).to(dtype).to(torch.float64)
    M, K = xs.shape
    g = xs.reshape(M, K // W4A4_GROUP, W4A4_GROUP)
    s = quant_scale(finite_amax(g, -1), W4A4_QMAX, 0.0).to(torch.float32).to(dtype)        # (M, G)
    sd = s.to(torch.float64).unsqueeze(-1)
    ok = sd > 0                                                                            # not 0, not NaN
    codes = torch.where(ok, torch.round(g / torch.where(ok, sd, 1.0)).clamp(-8, 7), 0.0)   # ties to even
    return pack_w4a4(codes.reshape(M, K)), s.t().contiguous()


def quantize_w4a4_wgt(w: torch.Tensor, dtype: torch.dtype | None = None):
    """SVDQuant's weight quantization of w (N, K): :func:`quantize_w4a4_act` without smoothing.
    Returns (qweight int8 (N, K / 2), wscales (K / 64, N) in ``dtype``)."""
    return quantize_w4a4_act(w, None, dtype)


def dequantize_w4a4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Codes (R, K / 2) times their scales (K / 64, R), float64 (R, K)."""
    s = scales.to(torch.float64).t().repeat_interleave(W4A4_GROUP, 1)
    return unpack_w4a4(packed).to(torch.float64) * s
