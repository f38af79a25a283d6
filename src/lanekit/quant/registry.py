"""The quant family's registry entries: sample builders, tolerances, and the ``register`` calls
of its ops. Each sample is in the lanes' normalized form (the keyword arguments of
``lanekit.quant.op``'s lane functions); its values come from a generator seeded by its name."""

from __future__ import annotations

import torch

from lanekit.reference import quant as _ref
from lanekit.runtime.registry import Op, Sample, register
from lanekit.testing import CODES, EXACT, Tolerance, generator, noncontiguous, randn

SCALES = Tolerance(
    name="quant_scale",
    ulps=0.0,
    codes=True,
    reason="a dynamic scale is amax / qmax, one correctly rounded fp32 division of an exact amax "
           "(a static one is returned as given): equal to the oracle's bit for bit",
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _x(name, R, C, dtype, *, zero_rows=(), spread=False, noncontig=False, scale=1.0):
    g = generator(name)
    x = randn(R, C, dtype=torch.float32, device="cpu", generator=g, scale=scale)
    if spread:      # rows of very different magnitudes: 2^-20 ... 2^20
        x = x * torch.pow(2.0, torch.linspace(-20, 20, max(R, 1))[:R]).unsqueeze(1)
    for r in zero_rows:
        x[r] = 0
    x = x.to(dtype)
    return noncontiguous(x) if noncontig else x


def _shapes():
    """(tag, R, C, x dtype, options) of the samples every quantize op takes."""
    return [
        ("13x27 bf16", 13, 27, torch.bfloat16, {}),
        ("17x96 fp16", 17, 96, torch.float16, {}),
        ("5x100 fp32 spread", 5, 100, torch.float32, {"spread": True}),
        ("3x300 bf16, row 1 zero", 3, 300, torch.bfloat16, {"zero_rows": (1,)}),
        ("1x700 bf16", 1, 700, torch.bfloat16, {}),
        ("9x129 fp32 non-contiguous", 9, 129, torch.float32, {"noncontig": True}),
        ("4x64 bf16 all zero", 4, 64, torch.bfloat16, {"zero_rows": (0, 1, 2, 3)}),
        ("0x96 bf16", 0, 96, torch.bfloat16, {}),
        ("6x0 bf16", 6, 0, torch.bfloat16, {}),
    ]


def _static_scale(g, x, granularity, group_size, qmax, sign=1.0):
    R, C = x.shape
    shape = {"tensor": (1,), "token": (R, 1), "group": (R, -(-C // group_size))}[granularity]
    return sign * (torch.rand(shape, generator=g) * 0.02 + 0.001).to(torch.float32)


def _quant_samples(device, fp8: bool):
    dtypes = (E4M3, E5M2) if fp8 else (torch.int8,)
    for tag, R, C, xdtype, opts in _shapes():
        for dtype in dtypes:
            for granularity in ("tensor", "token", "group"):
                for group_size in ((128, 32) if granularity == "group" else (128,)):
                    name = f"{tag} {dtype} {granularity}" + (f" {group_size}" if granularity == "group" else "")
                    x = _x(name, R, C, xdtype, **opts).to(device)
                    kw = dict(x=x, scale=None, granularity=granularity, group_size=group_size)
                    if fp8:
                        kw["dtype"] = dtype
                    yield Sample(name + " dynamic", kw)
                    if tag.startswith(("13x27", "3x300", "9x129")):
                        sign = -1.0 if (not fp8 and tag.startswith("3x300")) else 1.0
                        s = _static_scale(generator(name, "scale "), x, granularity, group_size, 0, sign)
                        yield Sample(name + (" static, negative scale" if sign < 0 else " static")
                                     + (" (saturating)" if fp8 else ""), {**kw, "scale": s.to(device)})
    # saturation and huge values: finite inputs near fp32's max never give inf or NaN codes
    for dtype in dtypes:
        x = torch.tensor([[3.0e38, -3.0e38, 1.0, 0.0], [65504.0, -1e-30, 7.0, -7.0]], dtype=torch.float32)
        kw = dict(x=x.to(device), scale=torch.tensor([1e-3], dtype=torch.float32, device=device),
                  granularity="tensor", group_size=128)
        if fp8:
            kw["dtype"] = dtype
        yield Sample(f"saturation: static 1e-3 on +-3e38 {dtype}", kw)
        yield Sample(f"fp32 max-ish values dynamic per token {dtype}",
                     {**kw, "scale": None, "granularity": "token"})


def _quant_fp8_samples(device):
    yield from _quant_samples(device, True)


def _quant_int8_samples(device):
    yield from _quant_samples(device, False)


def _dequant_samples(device, fp8: bool):
    dtypes = (E4M3, E5M2) if fp8 else (torch.int8,)
    for tag, R, C, xdtype, opts in _shapes():
        for dtype in dtypes:
            for granularity in ("tensor", "token", "group"):
                for out_dtype in ((torch.float32, torch.bfloat16) if tag.startswith("13x27") else (torch.float32,)):
                    name = f"{tag} {dtype} {granularity} -> {out_dtype}"
                    x = _x(name, R, C, xdtype, **opts)
                    if fp8:
                        codes, s = _ref.quantize_fp8(x, dtype, None, granularity, 32)
                    else:
                        codes, s = _ref.quantize_int8(x, None, granularity, 32)
                    if opts.get("noncontig"):
                        codes = noncontiguous(codes)
                    yield Sample(name, dict(codes=codes.to(device), scale=s.to(device),
                                            granularity=granularity, group_size=32, output_dtype=out_dtype))


register(Op(
    name="quantize_fp8", family="quant", oracle="lanekit.reference.quant:quantize_fp8",
    lanes={"triton": "lanekit.quant.op:quantize_fp8_triton",
           "reference": "lanekit.quant.op:quantize_fp8_reference"},
    samples=_quant_fp8_samples, outputs=(("codes", CODES), ("scale", SCALES)),
    doc="vLLM's scaled_fp8_quant / per_token_group_quant_fp8: e4m3fn or e5m2 codes, dynamic or static",
))
register(Op(
    name="quantize_int8", family="quant", oracle="lanekit.reference.quant:quantize_int8",
    lanes={"triton": "lanekit.quant.op:quantize_int8_triton",
           "reference": "lanekit.quant.op:quantize_int8_reference"},
    samples=_quant_int8_samples, outputs=(("codes", CODES), ("scale", SCALES)),
    doc="vLLM's scaled_int8_quant (symmetric): round half to even, clamped to [-128, 127]",
))
register(Op(
    name="dequantize_fp8", family="quant", oracle="lanekit.reference.quant:dequantize",
    lanes={"triton": "lanekit.quant.op:dequantize_triton",
           "reference": "lanekit.quant.op:dequantize_reference"},
    samples=lambda device: _dequant_samples(device, True), outputs=(("y", EXACT),),
    doc="fp8 codes times their scales (per tensor, token or group)",
))
register(Op(
    name="dequantize_int8", family="quant", oracle="lanekit.reference.quant:dequantize",
    lanes={"triton": "lanekit.quant.op:dequantize_triton",
           "reference": "lanekit.quant.op:dequantize_reference"},
    samples=lambda device: _dequant_samples(device, False), outputs=(("y", EXACT),),
    doc="int8 codes times their scales (per tensor, token or group)",
))


def _silu_samples(device):
    for tag, R, C, xdtype, opts in [
        ("13x54 bf16", 13, 54, torch.bfloat16, {}),
        ("17x192 fp16", 17, 192, torch.float16, {}),
        ("3x600 bf16, row 1 zero", 3, 600, torch.bfloat16, {"zero_rows": (1,)}),
        ("1x1400 bf16", 1, 1400, torch.bfloat16, {}),
        ("9x258 fp16 non-contiguous", 9, 258, torch.float16, {"noncontig": True}),
        ("0x96 bf16", 0, 96, torch.bfloat16, {}),
        ("6x0 bf16", 6, 0, torch.bfloat16, {}),
    ]:
        for dtype in (E4M3, E5M2):
            for granularity, scale in (("token", False), ("group", False), ("tensor", True)):
                name = f"silu_and_mul {tag} {dtype} {granularity}"
                x = _x(name, R, C, xdtype, scale=3.0, **opts).to(device)
                s = torch.tensor([0.004], dtype=torch.float32, device=device) if scale else None
                yield Sample(name, dict(x=x, dtype=dtype, scale=s, granularity=granularity,
                                        group_size=128, intermediate_dtype=xdtype))


register(Op(
    name="silu_and_mul_quant_fp8", family="quant", oracle="lanekit.reference.quant:silu_and_mul_quant_fp8",
    lanes={"triton": "lanekit.quant.op:silu_and_mul_quant_fp8_triton",
           "reference": "lanekit.quant.op:silu_and_mul_quant_fp8_reference"},
    samples=_silu_samples, outputs=(("codes", CODES), ("scale", SCALES)),
    doc="vLLM's silu_and_mul (first half gate) rounded to x's dtype, then fp8 per token / group / static",
))


HADAMARD_DEQUANT = Tolerance(
    name="hadamard_dequant",
    ulps=1.0,
    fp32_ulps=8.0,
    reason="fp32 output after log2(KP) <= 13 fp32 butterfly stages and a multiply: measured up "
           "to 0.5 fp32 steps on the samples and 1.4 on N(0, 1) rows at KP = 32 to 1024 "
           "(interpreter); eight steps",
)

_HADAMARD_SHAPES = [
    ("13x27 bf16", 13, 27, torch.bfloat16, {}),
    ("17x96 fp16", 17, 96, torch.float16, {}),
    ("5x100 fp32 spread", 5, 100, torch.float32, {"spread": True}),
    ("3x300 bf16, row 1 zero", 3, 300, torch.bfloat16, {"zero_rows": (1,)}),
    ("1x700 bf16", 1, 700, torch.bfloat16, {}),
    ("9x129 fp32 non-contiguous", 9, 129, torch.float32, {"noncontig": True}),
    ("4x1 bf16", 4, 1, torch.bfloat16, {}),
    ("0x96 bf16", 0, 96, torch.bfloat16, {}),
    ("6x0 bf16", 6, 0, torch.bfloat16, {}),
]


def _hadamard_samples(device):
    for tag, R, C, xdtype, opts in _HADAMARD_SHAPES:
        name = f"hadamard {tag}"
        yield Sample(name, dict(x=_x(name, R, C, xdtype, **opts).to(device)))


def _hadamard_dequant_samples(device):
    for tag, R, C, xdtype, opts in _HADAMARD_SHAPES:
        for out_dtype in ((torch.float32, torch.bfloat16) if tag.startswith("13x27") else (torch.float32,)):
            name = f"hadamard dequant {tag} -> {out_dtype}"
            codes, s = _ref.hadamard_quantize_int8(_x(name, R, C, xdtype, **opts))
            if opts.get("noncontig"):
                codes = noncontiguous(codes)
            yield Sample(name, dict(codes=codes.to(device), scale=s.to(device), K=C, output_dtype=out_dtype))


register(Op(
    name="hadamard_quantize_int8", family="quant", oracle="lanekit.reference.quant:hadamard_quantize_int8",
    lanes={"triton": "lanekit.quant.op:hadamard_quantize_int8_triton",
           "reference": "lanekit.quant.op:hadamard_quantize_int8_reference"},
    samples=_hadamard_samples, outputs=(("codes", CODES), ("scale", SCALES)),
    doc="rows rotated by H / sqrt(KP) (zero-extended to a power of two), then per-token int8",
))
register(Op(
    name="hadamard_dequantize_int8", family="quant", oracle="lanekit.reference.quant:hadamard_dequantize_int8",
    lanes={"triton": "lanekit.quant.op:hadamard_dequantize_int8_triton",
           "reference": "lanekit.quant.op:hadamard_dequantize_int8_reference"},
    samples=_hadamard_dequant_samples, outputs=(("y", HADAMARD_DEQUANT),),
    doc="the inverse rotation of hadamard_quantize_int8's codes times their scales",
))


def _stochastic_samples(device):
    for tag, R, C, xdtype, opts in _shapes():
        for dtype in (E4M3, E5M2):
            name = f"stochastic {tag} {dtype}"
            x = _x(name, R, C, xdtype, **opts)
            if R and C and xdtype == torch.float32:
                # values across the format: subnormals, normals, beyond qmax, exact codes
                x = x * torch.logspace(-10, 6, C, base=2.0 if dtype == E4M3 else 4.0)
            yield Sample(name, dict(x=x.to(device), dtype=dtype, seed=1234567890123 if R % 2 else 7,
                                    offset=2 ** 33 + 5 if R % 2 else 0))


register(Op(
    name="stochastic_round_fp8", family="quant", oracle="lanekit.reference.quant:stochastic_round_fp8",
    lanes={"triton": "lanekit.quant.op:stochastic_round_fp8_triton",
           "reference": "lanekit.quant.op:stochastic_round_fp8_reference"},
    samples=_stochastic_samples, outputs=(("codes", CODES),),
    doc="unbiased stochastic rounding to fp8 from Philox (tl.randint) at offset + row * C + col",
))


# ---- SVDQuant W4A4's activation pass ----

def _w4a4_samples(device):
    """x (M, K), K a multiple of 64; smooth in x's dtype or fp32; zero rows and zero groups; values
    on exact ties of the stored scale (a group whose max is 7: scale 1, x = k + 0.5)."""
    shapes = [
        ("13x64 bf16", 13, 64, torch.bfloat16, None, {}),
        ("17x256 fp16 smooth", 17, 256, torch.float16, "x", {}),
        ("1x192 bf16 smooth fp32", 1, 192, torch.bfloat16, "fp32", {}),
        ("4x128 bf16, row 1 zero", 4, 128, torch.bfloat16, None, {"zero_rows": (1,)}),
        ("9x128 fp16 non-contiguous", 9, 128, torch.float16, None, {"noncontig": True}),
        ("0x64 bf16", 0, 64, torch.bfloat16, None, {}),
    ]
    for tag, R, C, dtype, smooth, opts in shapes:
        name = f"w4a4 {tag}"
        x = _x(name, R, C, dtype, **opts)
        s = None
        if smooth:
            s = (torch.rand(C, generator=generator(name, "smooth ")) * 1.5 + 0.5)
            s = s.to(dtype if smooth == "x" else torch.float32).to(device)
        yield Sample(name, dict(x=x.to(device), smooth=s, dtype=dtype))
    # group 0 of each row: max 7 (scale exactly 1) and every k + 0.5 in [-6.5, 6.5]; group 1 all zero
    ties = torch.zeros(2, 128)
    ties[:, :14] = torch.arange(-6.5, 7.0)
    ties[0, 14] = 7.0
    ties[1, 20] = -7.0
    yield Sample("w4a4 ties k + 0.5 on a scale of 1, a zero group", dict(x=ties.to(torch.bfloat16).to(device),
                                                                          smooth=None, dtype=torch.bfloat16))


register(Op(
    name="quantize_w4a4_act", family="quant", oracle="lanekit.reference.quant:quantize_w4a4_act",
    lanes={"triton": "lanekit.quant.op:quantize_w4a4_act_triton",
           "reference": "lanekit.quant.op:quantize_w4a4_act_reference"},
    samples=_w4a4_samples, outputs=(("codes", CODES), ("scale", SCALES)),
    doc="SVDQuant's activations: signed int4 per 64 columns, scale amax / 7 rounded to x's dtype first",
))
