"""Triton numerics several families share: tanh and sigmoid without libdevice, the rounding of
int8 and fp8 codes, a NaN-propagating max, and exact power-of-two scale helpers. Each matches its
oracle in ``lanekit.reference.numerics`` (or PyTorch's own function) bit for bit where the docstring
says so. Families import these; no family imports another family's private kernel helpers."""

import triton
import triton.language as tl


@triton.jit
def sigmoid(x):
    # 1 / (1 + e^-x) with exp2; e^-x overflows to +inf for x < -88, giving exactly 0
    return 1.0 / (1.0 + tl.math.exp2(x * -1.4426950408889634))


@triton.jit
def tanh(x):
    # No libdevice call, so the same on every target and in the interpreter. 1 - 2 / (e^2x + 1) is
    # exact at +-inf but its absolute error (~1e-7) swamps tanh(x) ~ x near 0: below |x| = 1/8 the
    # odd Taylor series to x^7 is used (truncation error < 2e-10).
    x2 = x * x
    small = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    big = 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)
    return tl.where(tl.abs(x) < 0.125, small, big)


@triton.jit
def quantize(x, qmax, QUANT: tl.constexpr, CLAMP: tl.constexpr = True):
    """x / scale to the code format: int8 rounds to nearest even and clamps to [-128, 127], a NaN
    to 0; fp8 clamps to +-qmax (a NaN stays NaN: :func:`cast_codes` gives its code), and the cast
    rounds to nearest even. CLAMP=False: x known in range."""
    if QUANT == 1:
        # round to nearest even: adding and subtracting 1.5 * 2^23 leaves an fp32 |x| < 2^22
        # rounded to an integer by the hardware's own rounding (the launcher forbids contraction)
        r = (x + 12582912.0) - 12582912.0
        if CLAMP:
            r = tl.minimum(tl.maximum(r, -128.0), 127.0)
        return tl.where(x == x, r, 0.0)           # NaN: code 0 (int8 has no NaN; the scale carries it)
    if CLAMP:
        # the hardware's min and max drop a NaN: kept explicitly (its code: see cast_codes)
        x = tl.where(x == x, tl.minimum(tl.maximum(x, -qmax), qmax), float("nan"))
    return x


@triton.jit
def cast_codes(q, DTYPE: tl.constexpr, QUANT: tl.constexpr):
    """:func:`quantize`'s q as ``DTYPE`` codes; fp8 (QUANT 2): a NaN's code is 0x7F (e4m3fn's
    NaN, and e5m2's all-ones NaN), whatever its sign and the target's conversion, as
    reference.numerics.to_codes. QUANT 0 or 1: a plain cast."""
    c = q.to(DTYPE)
    if QUANT == 2:
        c = tl.where(q == q, c.to(tl.int8, bitcast=True), 0x7F).to(DTYPE, bitcast=True)
    return c


@triton.jit
def finite_abs(x):
    """|x| with NaN and +-inf as +inf: a max over it (an atomic max too) is +inf exactly where a
    value is not finite. The hardware's max drops a NaN; a NaN is never compared here."""
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, float("inf"))


@triton.jit
def quant_scale(amax, qmax, zero):
    """The dynamic scale of a group from its max of :func:`finite_abs`: amax / qmax correctly
    rounded; ``zero`` for an all-zero group; NaN for amax +inf (a NaN or inf in the group: the
    NaN-visible rule, docs/semantics.md). As reference.numerics.quant_scale."""
    s = tl.where(amax > 0, tl.math.div_rn(amax, qmax), zero)
    return tl.where(amax < float("inf"), s, float("nan"))


@triton.jit
def max_nan(x, y):
    return tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def unit_exponent(m):
    """The k in [-126, 126] for which fp32 m >= 0 times 2^k lies in [1, 2) (k = 126 for 0 and
    subnormal m, -126 for m >= 2^126 and NaN), from m's exponent bits; as
    reference.numerics.unit_exponent."""
    e = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.where(e == 0, 126, tl.minimum(tl.maximum(127 - e, -126), 126))


@triton.jit
def power_of_two(k):
    """2^k in fp32 for int32 k in [-126, 127], from its exponent bits."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def reciprocal_power(p):
    """1 / p for a power of two p = 2^k, k in [-126, 126] (exponent field k + 127 -> 127 - k).
    (Its two callers could take _power_of_two(-k) instead, k being at hand: tried on 2026-12-03,
    the same tests passed natively, but the fast path read 0.3% slower on the H200, `benchmarks.ab`
    qk_norm_rope_quant e4m3 3467-3471 GB/s against 3478-3479, sm90 registers moving by 2; kept.)"""
    return ((254 << 23) - p.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_scale(e):
    """An OCP MX e8m0 scale byte (int32 0..255) as fp32: 2^(e - 127), 0xFF NaN (OCP MX v1.0);
    e = 0 (2^-127) is fp32's subnormal 0x00400000. As reference.gemm.e8m0."""
    bits = tl.where(e == 0, 0x00400000, e << 23)
    return tl.where(e == 255, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def e2m1_in(code, dtype: tl.constexpr):
    """The value of an e2m1 code (int32 0..15) in dtype (bf16, fp16 or fp32), exactly, built as its bit
    pattern with integer operations (no int-to-float conversion, no float arithmetic): exponent
    bits e and mantissa bit m land in the 16-bit format's fields with the exponent rebiased (a
    normal e2m1 value is 2^(e - 1) (1 + m / 2)); the two subnormals (e = 0: 0 and 0.5) are
    selected; the sign is bit 3: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code 8 is -0.0),
    as reference.numerics.e2m1."""
    half: tl.constexpr = tl.bfloat16 if dtype == tl.bfloat16 else tl.float16     # fp32: by fp16, exactly
    if half == tl.bfloat16:
        one_half = 0x3F00        # 0.5: with (e, m) added above it, e = 1 lands on 1.0 (0x3F80)
        shift = 6                # e2m1's (e, m) bits to bf16's exponent and mantissa top
    else:
        one_half = 0x3800        # fp16 (1 << 10)
        shift = 9
    normal = (code & 7) * (1 << shift) + one_half
    bits = tl.where((code & 6) == 0, (code & 1) * one_half, normal) | ((code & 8) << 12)
    return bits.to(tl.int16).to(half, bitcast=True).to(dtype)


@triton.jit
def _nibbles_along_rows(byte):
    """Bytes [R, C] (int32 0..255) -> their nibbles [2R, C]: row 2i byte i's low nibble, row
    2i + 1 its high one."""
    R: tl.constexpr = byte.shape[0]
    C: tl.constexpr = byte.shape[1]
    word = tl.reshape(tl.broadcast_to(byte[:, None, :], (R, 2, C)), (2 * R, C))   # each byte twice
    shift = (tl.arange(0, 2 * R) % 2) * 4
    return (word >> shift[:, None]) & 0xF


@triton.jit
def e2m1_pairs_in(byte, dtype: tl.constexpr):
    """MXFP4 bytes [R, C] (int32 0..255), two e2m1 codes each along R, element 2i in the low
    nibble (gpt-oss's and OCP MX's packing), as their values [2R, C] in dtype (bf16 or fp16: every
    e2m1 value is exact in either), by :func:`e2m1_in`: row 2i from byte i's low nibble, row
    2i + 1 from its high one. The B operand of the MXFP4 GEMMs (lanekit.gemm's mxfp4_linear, lanekit.moe's
    fused_moe with use_mxfp4_w4a16)."""
    return e2m1_in(_nibbles_along_rows(byte), dtype)
