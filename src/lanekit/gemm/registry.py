"""The GEMM family's registry entries: sample builders, tolerances, and the ``register`` calls.

Each sample is in the lanes' normalized form (the keyword arguments of ``lanekit.gemm.op``'s lane
functions); its values come from a generator seeded by its name. Odd shapes (13 x 27 x 41,
17 x 23 x 96, K = 100, 300, 700) split every tile; M = 1, K = 0, M = 0 and non-contiguous
operands (b as the transpose of an (N, K) weight, torch._scaled_mm's layout, and b row-major).
"""

from __future__ import annotations

import torch

from lanekit.reference.numerics import pack_int4, quantize_w4a8
from lanekit.reference.quant import quantize_w4a4_wgt
from lanekit.runtime.registry import Op, Sample, register
from lanekit.testing import Tolerance, every_other, generator, noncontiguous, randn

# One step at max |ref| for 16-bit outputs: the sum is in fp32 (or exact int32) and rounded once.
GEMM = Tolerance(
    name="gemm",
    ulps=1.0,
    fp32_ulps=16.0,
    reason=(
        "8-bit operands dequantized exactly, products summed in fp32 (int8: int32, exact) and "
        "scaled in fp32, rounded once: within one step of bf16/fp16 at max |ref|; fp32 outputs "
        "carry the fp32 sum's rounding over K terms (and per K step scaling for blocks and MX): "
        "16 fp32 steps"
    ),
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def codes(g, shape, dtype, device):
    """Random codes of ``dtype``: int8 uniform over [-128, 127]; fp8 normal values cast (e5m2
    spread wider to use its range)."""
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8).to(device)
    scale = 16.0 if dtype == E5M2 else 4.0
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def _scales(g, shape, device):
    n = 1
    for d in shape:
        n *= d
    return (torch.rand(n, generator=g) * 0.02 + 0.005).reshape(shape).to(device)


def _b(g, K, N, dtype, device, layout):
    """b (K, N): "weight" the transpose of an (N, K) contiguous tensor (torch._scaled_mm's
    column-major b), "row" row-major, "strided" every other row of a wider buffer."""
    if layout == "weight":
        return codes(g, (N, K), dtype, device).t()
    b = codes(g, (K, N), dtype, device)
    return noncontiguous(b) if layout == "strided" else b


def mm_case(name, device, *, M, K, N, dtype=E4M3, b_dtype=None, scales="row", bias=False,
            out_dtype=torch.bfloat16, layout="weight", a_strided=False) -> Sample:
    g = generator(name)
    a = codes(g, (M, K), dtype, device)
    if a_strided:
        a = noncontiguous(a)
    b = _b(g, K, N, b_dtype or dtype, device, layout)
    cdiv = lambda x: -(-x // 128)
    if scales == "tensor":
        sa, sb = _scales(g, (), device), _scales(g, (1,), device)
    elif scales == "row":
        sa, sb = _scales(g, (M, 1), device), _scales(g, (1, N), device)
    else:
        sa, sb = _scales(g, (M, cdiv(K)), device), _scales(g, (cdiv(K), cdiv(N)), device)
    kw = dict(a=a, b=b, scale_a=sa, scale_b=sb, bias=None, out_dtype=out_dtype)
    if bias:
        kw["bias"] = randn(N, dtype=out_dtype, device=device, generator=g)
    return Sample(name, kw)


def _scaled_mm_samples(device):
    yield mm_case("13x27x41 per tensor", device, M=13, K=41, N=27, scales="tensor")
    yield mm_case("17x23x96 rowwise fp16 bias", device, M=17, K=96, N=23, bias=True,
                  out_dtype=torch.float16)
    yield mm_case("K100 rowwise e5m2 fp32", device, M=9, K=100, N=40, dtype=E5M2, out_dtype=torch.float32)
    yield mm_case("K100 e5m2 per tensor", device, M=9, K=100, N=40, dtype=E5M2, scales="tensor")
    yield mm_case("K300 128x128 blocks bias", device, M=20, K=300, N=150, scales="block", bias=True)
    yield mm_case("K700 128x128 blocks fp32", device, M=5, K=700, N=33, scales="block", out_dtype=torch.float32)
    yield mm_case("K300 rowwise, a and b non-contiguous", device, M=11, K=300, N=19, layout="strided",
                  a_strided=True)
    yield mm_case("M1 rowwise bias (decode)", device, M=1, K=128, N=70, bias=True)
    yield mm_case("M1 K512 N24 per tensor fp32 bias, K split (decode)", device, M=1, K=512, N=24,
                  scales="tensor", bias=True, out_dtype=torch.float32)
    yield mm_case("M2 K384 N24 128x128 blocks bias, K split", device, M=2, K=384, N=24, scales="block", bias=True)
    yield mm_case("K0 rowwise bias: zeros plus bias", device, M=3, K=0, N=5, bias=True)
    yield mm_case("K0 blocks", device, M=3, K=0, N=5, scales="block")
    yield mm_case("M0", device, M=0, K=32, N=8)


def _int8_mm_samples(device):
    yield mm_case("13x27x41 per tensor", device, M=13, K=41, N=27, dtype=torch.int8, scales="tensor")
    yield mm_case("17x23x96 rowwise fp16 bias", device, M=17, K=96, N=23, dtype=torch.int8, bias=True,
                  out_dtype=torch.float16)
    yield mm_case("K300 rowwise fp32", device, M=9, K=300, N=40, dtype=torch.int8, out_dtype=torch.float32)
    yield mm_case("K700 rowwise, b row-major non-contiguous", device, M=6, K=700, N=21, dtype=torch.int8,
                  layout="strided", a_strided=True)
    yield mm_case("M1 rowwise bias", device, M=1, K=100, N=70, dtype=torch.int8, bias=True)
    yield mm_case("K0 bias", device, M=3, K=0, N=5, dtype=torch.int8, bias=True)


def mx_case(name, device, *, M, K, N, out_dtype=torch.bfloat16, nan=False, layout="weight") -> Sample:
    g = generator(name)
    a = codes(g, (M, K), E4M3, device)
    b = _b(g, K, N, E4M3, device, layout)
    ea = torch.randint(121, 130, (M, K // 32), generator=g, dtype=torch.uint8)
    eb = torch.randint(121, 130, (K // 32, N), generator=g, dtype=torch.uint8)
    if nan and M and K:
        ea[0, 0] = 255
    return Sample(name, dict(a=a, a_scale=ea.to(device), b=b, b_scale=eb.to(device), out_dtype=out_dtype))


def _mx_mm_samples(device):
    yield mx_case("13x27x64", device, M=13, K=64, N=27)
    yield mx_case("17x23x96 fp16", device, M=17, K=96, N=23, out_dtype=torch.float16)
    yield mx_case("K320 fp32, b row-major non-contiguous", device, M=7, K=320, N=40,
                  out_dtype=torch.float32, layout="strided")
    yield mx_case("M1 K704", device, M=1, K=704, N=33)
    yield mx_case("M1 K256 N24, K split (decode)", device, M=1, K=256, N=24)
    yield mx_case("K0", device, M=3, K=0, N=5)


def _x(g, shape, dtype, device, *, zero_row=False, strided=False):
    x = randn(*shape, dtype=dtype, device="cpu", generator=g)
    if zero_row:
        x.reshape(-1, shape[-1])[0] = 0
    x = x.to(device)
    return noncontiguous(x) if strided else x


def linear_case(name, device, *, lead, K, N, wdtype, dtype=torch.bfloat16, bias=False, static=False,
                zero_row=False, strided=False, block=False, tensor_scale=False) -> Sample:
    g = generator(name)
    x = _x(g, (*lead, K), dtype, device, zero_row=zero_row, strided=strided)
    w = codes(g, (N, K), wdtype, device)
    if block:
        ws = _scales(g, (-(-N // 128), -(-K // 128)), device)
    else:
        ws = _scales(g, (1,) if tensor_scale else (N,), device)
    kw = dict(x=x, weight=w, weight_scale=ws, bias=None)
    if bias:
        kw["bias"] = randn(N, dtype=dtype, device=device, generator=g)
    if wdtype != torch.int8 or "x_scale" in name or static:
        kw["x_scale"] = _scales(g, (1,), device) * 100 if static else None
    if wdtype != torch.int8:
        kw["block_size"] = (128, 128) if block else None
    return Sample(name, kw)


def _w8a8_samples(device):
    i8 = torch.int8
    yield linear_case("13x27x41", device, lead=(13,), K=41, N=27, wdtype=i8)
    yield linear_case("(3, 5) x 96 -> 23 fp16 bias, a zero row", device, lead=(3, 5), K=96, N=23,
                      wdtype=i8, dtype=torch.float16, bias=True, zero_row=True)
    yield linear_case("K300 static x_scale fp32", device, lead=(9,), K=300, N=40, wdtype=i8,
                      dtype=torch.float32, static=True)
    yield linear_case("K700 x non-contiguous", device, lead=(6,), K=700, N=21, wdtype=i8, strided=True)
    yield linear_case("M1 K100 bias", device, lead=(1,), K=100, N=70, wdtype=i8, bias=True)
    yield linear_case("K0 bias", device, lead=(3,), K=0, N=5, wdtype=i8, bias=True)
    yield linear_case("M0", device, lead=(0,), K=16, N=5, wdtype=i8)


def _fp8_linear_samples(device):
    yield linear_case("13x27x41 per token", device, lead=(13,), K=41, N=27, wdtype=E4M3)
    yield linear_case("(3, 5) x 96 -> 23 fp16 bias, a zero row", device, lead=(3, 5), K=96, N=23,
                      wdtype=E4M3, dtype=torch.float16, bias=True, zero_row=True)
    yield linear_case("K300 static x_scale, weight per tensor", device, lead=(9,), K=300, N=40,
                      wdtype=E4M3, static=True, tensor_scale=True)
    yield linear_case("K300 128x128 blocks bias, a zero row", device, lead=(20,), K=300, N=150,
                      wdtype=E4M3, block=True, bias=True, zero_row=True)
    yield linear_case("K700 128x128 blocks fp32, x non-contiguous", device, lead=(5,), K=700, N=33,
                      wdtype=E4M3, dtype=torch.float32, block=True, strided=True)
    yield linear_case("M1 K100", device, lead=(1,), K=100, N=70, wdtype=E4M3)
    yield linear_case("K0 bias", device, lead=(3,), K=0, N=5, wdtype=E4M3, bias=True)


def _w8a16_samples(device):
    i8 = torch.int8
    yield linear_case("13x27x41", device, lead=(13,), K=41, N=27, wdtype=i8)
    yield linear_case("(3, 5) x 96 -> 23 fp16 bias", device, lead=(3, 5), K=96, N=23, wdtype=i8,
                      dtype=torch.float16, bias=True)
    yield linear_case("K300", device, lead=(9,), K=300, N=40, wdtype=i8)
    yield linear_case("K700 x non-contiguous", device, lead=(6,), K=700, N=21, wdtype=i8, strided=True)
    yield linear_case("M1 K100 bias (decode)", device, lead=(1,), K=100, N=70, wdtype=i8, bias=True)
    yield linear_case("M1 K256 N24 fp16 bias, K split (decode)", device, lead=(1,), K=256, N=24, wdtype=i8,
                      dtype=torch.float16, bias=True)
    yield linear_case("K0 bias", device, lead=(3,), K=0, N=5, wdtype=i8, bias=True)


def w4_case(name, device, *, lead, K, N, group=128, layout="awq", zeros=True, g_idx=False, bias=False,
            dtype=torch.bfloat16, scale_dtype=torch.float16, last_group_largest=False, zero_row=False,
            strided=False, strided_vectors=False) -> Sample:
    """An AWQ or GPTQ checkpoint's tensors for W (K, N): codes, zero points (stored as the
    layout stores them) and scales drawn at random, packed with reference.numerics.pack_int4.
    last_group_largest: the last group's scales 8 times the others'; zero_row: output channel 0
    all zero (codes equal to the zero point) with scale 0 (no NaN may come of it);
    strided_vectors: g_idx and bias as views of every other element."""
    g = generator(name)
    x = _x(g, (*lead, K), dtype, device, strided=strided)
    G = K // group if K else 0
    q = torch.randint(0, 16, (K, N), generator=g)
    stored = torch.randint(0, 16, (G, N), generator=g)      # gptq: z - 1
    z = stored + (1 if layout == "gptq" else 0) if zeros else torch.full((G, N), 8)
    s = torch.rand(G, N, generator=g) * 0.02 + 0.005
    if last_group_largest and G:
        s[-1] *= 8
    rows = torch.arange(K) // group
    if g_idx:       # act-order: each group's rows scattered over K (GPTQ's desc_act)
        rows = rows[torch.randperm(K, generator=g)]
    if zero_row and K:
        q[:, 0] = z[rows, 0]
        s[:, 0] = 0
    dim, order = (1, "awq") if layout == "awq" else (0, "sequential")
    kw = dict(x=x, qweight=pack_int4(q, dim, order).to(device), scales=s.to(scale_dtype).to(device),
              zeros=pack_int4(stored, 1, order).to(device) if zeros else None, group_size=group,
              layout=layout, g_idx=rows.to(torch.int32).to(device) if g_idx else None, bias=None)
    if bias:
        kw["bias"] = randn(N, dtype=dtype, device=device, generator=g)
    if strided_vectors:
        kw.update({k: every_other(kw[k]) for k in ("bias", "g_idx") if kw[k] is not None})
    return Sample(name, kw)


def _w4a16_samples(device):
    yield w4_case("M1 K128 N64 awq (decode)", device, lead=(1,), K=128, N=64)
    yield w4_case("M17 K256 N40 awq g64 bias, the last group's scale the largest", device, lead=(17,),
                  K=256, N=40, group=64, bias=True, last_group_largest=True)
    yield w4_case("K32 one atom awq g32", device, lead=(5,), K=32, N=24, group=32)
    yield w4_case("(3, 5) K256 N72 gptq fp16, channel 0 all zero with scale 0", device, lead=(3, 5),
                  K=256, N=72, layout="gptq", dtype=torch.float16, zero_row=True)
    yield w4_case("M17 K256 N40 gptq g64 act-order g_idx bias", device, lead=(17,), K=256, N=40, group=64,
                  layout="gptq", g_idx=True, bias=True, last_group_largest=True)
    yield w4_case("M17 K256 N40 gptq g64 act-order, g_idx and bias strided views", device, lead=(17,), K=256,
                  N=40, group=64, layout="gptq", g_idx=True, bias=True, strided_vectors=True)
    yield w4_case("M1 K64 N24 gptq g32 act-order, channel 0 zero", device, lead=(1,), K=64, N=24, group=32,
                  layout="gptq", g_idx=True, zero_row=True)
    yield w4_case("M9 K96 N20 gptq symmetric (no zeros) g32 bf16 scales", device, lead=(9,), K=96, N=20,
                  group=32, layout="gptq", zeros=False, scale_dtype=torch.bfloat16)
    yield w4_case("M7 K100 N48 awq per channel (one group of K = 100)", device, lead=(7,), K=100, N=48,
                  group=100)
    yield w4_case("M9 K192 N48 awq g64 fp32 scales, x non-contiguous", device, lead=(9,), K=192, N=48,
                  group=64, scale_dtype=torch.float32, strided=True)
    yield w4_case("M70 K128 N72 gptq g32 (the prefill row)", device, lead=(70,), K=128, N=72, group=32,
                  layout="gptq")
    # decode over one tile of columns with many K steps: K split among programs (gemm.tuning.split_k),
    # their partial sums added by a second launch, bias there
    yield w4_case("M1 K256 N24 awq g32 bias, K split (decode)", device, lead=(1,), K=256, N=24, group=32,
                  bias=True, last_group_largest=True)
    yield w4_case("M2 K256 N24 gptq g32 act-order, K split (decode)", device, lead=(2,), K=256, N=24, group=32,
                  layout="gptq", g_idx=True, bias=True)
    yield w4_case("K0 bias", device, lead=(3,), K=0, N=16, bias=True)
    yield w4_case("M0", device, lead=(0,), K=64, N=16, group=32)


def mxfp4_case(name, device, *, lead, K, N, dtype=torch.bfloat16, bias=False, last_block_largest=False,
               zero_row=False, strided=False) -> Sample:
    """MXFP4 weight (N, K): e2m1 codes drawn at random, two to a byte (low nibble first), e8m0
    exponents 2^-8..2^0. last_block_largest: each row's last block 2^3, above all the others;
    zero_row: row 0 all +0 codes with the least scale (2^-127); strided: x and w non-contiguous,
    bias a view of every other element."""
    g = generator(name)
    x = _x(g, (*lead, K), dtype, device, strided=strided)
    codes = torch.randint(0, 16, (N, K), generator=g)
    e = torch.randint(119, 128, (N, K // 32), generator=g)
    if last_block_largest and K:
        e[:, -1] = 130
    if zero_row and K:
        codes[0] = 0
        e[0] = 0
    w = pack_int4(codes, 1, dtype=torch.uint8)
    kw = dict(x=x, w_fp4=(noncontiguous(w) if strided else w).to(device),
              w_scale=e.to(torch.uint8).to(device), bias=None)
    if bias:
        kw["bias"] = randn(N, dtype=dtype, device=device, generator=g)
        if strided:
            kw["bias"] = every_other(kw["bias"])
    return Sample(name, kw)


def _mxfp4_samples(device):
    yield mxfp4_case("M1 K64 N48 (decode)", device, lead=(1,), K=64, N=48)
    yield mxfp4_case("M17 K96 N40 fp16 bias, the last block's scale the largest", device, lead=(17,), K=96,
                     N=40, dtype=torch.float16, bias=True, last_block_largest=True)
    yield mxfp4_case("K32 one block", device, lead=(5,), K=32, N=24)
    yield mxfp4_case("(3, 5) K128 N72, row 0 all zero with the least scale", device, lead=(3, 5), K=128,
                     N=72, zero_row=True)
    yield mxfp4_case("M9 K160 N33, x and w non-contiguous", device, lead=(9,), K=160, N=33, strided=True)
    yield mxfp4_case("M17 K96 N40 fp16, x, w and bias non-contiguous", device, lead=(17,), K=96, N=40,
                     dtype=torch.float16, bias=True, strided=True)
    yield mxfp4_case("M70 K64 N72 (the prefill row)", device, lead=(70,), K=64, N=72)
    yield mxfp4_case("M1 K256 N24 bias, K split (decode)", device, lead=(1,), K=256, N=24, bias=True,
                     last_block_largest=True)
    yield mxfp4_case("M0", device, lead=(0,), K=64, N=16)


_REF, _OP = "lanekit.reference.gemm", "lanekit.gemm.op"


def _register(name, samples, doc):
    register(Op(name=name, family="gemm", oracle=f"{_REF}:{name}",
                lanes={"triton": f"{_OP}:{name}_triton", "reference": f"{_OP}:{name}_reference"},
                samples=samples, outputs=(("out", GEMM),), doc=doc))


_register("scaled_mm", _scaled_mm_samples,
          "torch._scaled_mm's fp8 matmul (per tensor, rowwise) and 128x128 block scales; fp32 sums")
_register("int8_mm", _int8_mm_samples, "int8 x int8 summed exactly in int32, then scaled (per tensor, rowwise)")
_register("mx_mm", _mx_mm_samples, "MXFP8 (OCP MX): e4m3 elements, an e8m0 scale per 32 along K")
_register("w8a8_linear", _w8a8_samples,
          "vLLM's W8A8 int8 linear: per-token (or static) int8 activation quant, per-channel weights")
_register("fp8_linear", _fp8_linear_samples,
          "vLLM's fp8 linear: per-token, static or 1x128-group e4m3 activations, per-channel/tensor/block weights")
_register("w8a16_linear", _w8a16_samples, "int8 weights widened in the load, 16-bit activations")
_register("w4a16_linear", _w4a16_samples,
          "AWQ/GPTQ int4 weights (group scales, zeros, act-order g_idx) dequantized in the K loop, 16-bit x")
_register("mxfp4_linear", _mxfp4_samples,
          "OCP MXFP4 weights (e2m1, an e8m0 scale per 32 along K; gpt-oss's layout), 16-bit x")


# ---- W4A8 and int4 x int4 (the int8 dot) ----

def w4a8_case(name, device, *, lead, K, N, group=32, mode=1, scale_dtype=torch.float8_e4m3fn,
              dtype=torch.bfloat16, bias=False, zero_row=False, last_group_largest=False,
              strided=False) -> Sample:
    """A weight (N, K) drawn at std 0.02 and quantized by reference.numerics.quantize_w4a8.
    last_group_largest: each row's last group 8 times the others (its scale the largest);
    zero_row: row 0 all zero (its scales 0: no NaN may come of it)."""
    g = generator(name)
    x = _x(g, (*lead, K), dtype, device, strided=strided)
    w = torch.randn(N, K, generator=g) * 0.02
    if mode == 2 and K:
        w += torch.randn(N, 1, generator=g) * 0.01          # off-centre rows: the zero point matters
    if last_group_largest and K:
        w[:, -group:] *= 8
    if zero_row and K:
        w[0] = 0
    qweight, scales, channel, correction = quantize_w4a8(w, mode, group, scale_dtype)
    kw = dict(x=x, qweight=qweight.to(device), scales=scales.to(device), channel_scale=channel.to(device),
              correction=None if correction is None else correction.to(device), group_size=group, bias=None)
    if bias:
        kw["bias"] = randn(N, dtype=dtype, device=device, generator=g)
    return Sample(name, kw)


def _w4a8_samples(device):
    yield w4a8_case("M1 K32 N24 mode 1 e4m3 (decode, one atom)", device, lead=(1,), K=32, N=24)
    yield w4a8_case("M17 K128 N40 mode 2 e4m3 g32 bias, the last group's scale the largest", device,
                    lead=(17,), K=128, N=40, mode=2, bias=True, last_group_largest=True)
    yield w4a8_case("(3, 5) K64 N72 mode 0 fp16 scales, row 0 all zero", device, lead=(3, 5), K=64, N=72,
                    mode=0, scale_dtype=torch.float16, dtype=torch.float16, zero_row=True)
    yield w4a8_case("M9 K96 N33 mode 1 bf16 scales, x non-contiguous", device, lead=(9,), K=96, N=33,
                    scale_dtype=torch.bfloat16, strided=True)
    yield w4a8_case("M17 K256 N40 mode 2 g128 fp32 x, row 0 all zero", device, lead=(17,), K=256, N=40,
                    group=128, mode=2, dtype=torch.float32, zero_row=True)
    yield w4a8_case("M70 K64 N72 mode 1 g64 fp32 scales bias (the prefill row)", device, lead=(70,), K=64,
                    N=72, group=64, scale_dtype=torch.float32, bias=True)
    yield w4a8_case("K0 bias", device, lead=(3,), K=0, N=16, bias=True)
    yield w4a8_case("M0", device, lead=(0,), K=64, N=16)


def int4_case(name, device, *, M, K, N, scales="row", bias=False, out_dtype=torch.bfloat16, layout="weight",
              a_strided=False, dtype=torch.uint8) -> Sample:
    """Packed signed int4 operands (every byte value drawn: all nibbles -8..7): a (M, K/2);
    b (K/2, N) as the transpose of an (N, K/2) weight ("weight"), row-major ("row") or every other
    row of a wider buffer ("strided")."""
    g = generator(name)
    a = torch.randint(0, 256, (M, K // 2), generator=g, dtype=torch.uint8).view(dtype).to(device)
    if a_strided:
        a = noncontiguous(a)
    if layout == "weight":
        b = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8).view(dtype).to(device).t()
    else:
        b = torch.randint(0, 256, (K // 2, N), generator=g, dtype=torch.uint8).view(dtype).to(device)
        b = noncontiguous(b) if layout == "strided" else b
    sa, sb = (_scales(g, (), device), _scales(g, (1,), device)) if scales == "tensor" else \
        (_scales(g, (M, 1), device), _scales(g, (1, N), device))
    kw = dict(a=a, b=b, scale_a=sa, scale_b=sb, bias=None, out_dtype=out_dtype)
    if bias:
        kw["bias"] = randn(N, dtype=out_dtype, device=device, generator=g)
    return Sample(name, kw)


def _int4_mm_samples(device):
    yield int4_case("M1 K32 N24 per tensor (decode, one atom)", device, M=1, K=32, N=24, scales="tensor")
    yield int4_case("M17 K64 N40 rowwise fp16 bias", device, M=17, K=64, N=40, bias=True,
                    out_dtype=torch.float16)
    yield int4_case("M9 K96 N33 rowwise fp32, int8 bytes, b row-major", device, M=9, K=96, N=33,
                    out_dtype=torch.float32, layout="row", dtype=torch.int8)
    yield int4_case("M13 K160 N21 a and b non-contiguous", device, M=13, K=160, N=21, layout="strided",
                    a_strided=True)
    yield int4_case("M70 K128 N72 (the prefill row)", device, M=70, K=128, N=72)
    yield int4_case("K0 bias", device, M=3, K=0, N=5, bias=True)
    yield int4_case("M0", device, M=0, K=32, N=8)


_register("w4a8_linear", _w4a8_samples,
          "int4 weights (quantize_w4a8's modes: group scales, fp8 e4m3 relative scales, mode 2's correction), "
          "int8 activations per token, on the int8 dot")
_register("int4_mm", _int4_mm_samples, "signed int4 x int4 unpacked to int8, summed exactly in int32, then scaled")


# ---- SVDQuant W4A4 with its low-rank branch ----

def svdquant_case(name, device, *, lead, K, N, R, dtype=torch.bfloat16, smooth=None, bias=None,
                  last_group_largest=False, zero_row=False, zero_token=False, strided=False) -> Sample:
    """W (N, K) drawn at random and quantized by the oracle's quantize_w4a4_wgt (codes in [-7, 7]),
    x, lora_down (K, R) and lora_up (N, R) at random. smooth: None, "x" (x's dtype) or "fp32",
    factors in [0.5, 2]; bias: None, "x" or "fp32". last_group_largest: the last group's weight
    scales 8 times what they were (above every other group's); zero_row: output channel 0 all
    zero codes with scale 0 (no NaN may come of it); zero_token: x's first token all zero (its
    activation scales 0); strided: x non-contiguous, bias a view of every other element."""
    g = generator(name)
    x = _x(g, (*lead, K), dtype, "cpu")
    if zero_token:
        x.reshape(-1, K)[0] = 0
    qweight, wscales = quantize_w4a4_wgt(randn(N, K, dtype=dtype, device="cpu", generator=g))
    if last_group_largest and K:
        wscales[-1] = wscales.max(0).values * 8
    if zero_row:
        qweight[0] = 0
        wscales[:, 0] = 0
    kw = dict(x=noncontiguous(x.to(device)) if strided else x.to(device), qweight=qweight.to(device),
              wscales=wscales.to(device),
              lora_down=randn(K, R, dtype=dtype, device=device, generator=g, scale=0.1),
              lora_up=randn(N, R, dtype=dtype, device=device, generator=g, scale=0.1),
              smooth=None, bias=None, dtype=dtype)
    if smooth:
        s = torch.rand(K, generator=g) * 1.5 + 0.5
        kw["smooth"] = s.to(dtype if smooth == "x" else torch.float32).to(device)
    if bias:
        kw["bias"] = randn(N, dtype=dtype if bias == "x" else torch.float32, device=device, generator=g)
        if strided:
            kw["bias"] = every_other(kw["bias"])
    return Sample(name, kw)


def _svdquant_samples(device):
    yield svdquant_case("M1 K64 N40 rank16 (decode, one group)", device, lead=(1,), K=64, N=40, R=16)
    yield svdquant_case("M17 K256 N72 rank32 fp16 smooth bias, the last group's scale the largest", device,
                        lead=(17,), K=256, N=72, R=32, dtype=torch.float16, smooth="x", bias="x",
                        last_group_largest=True)
    yield svdquant_case("(3, 5) K128 N24 rank16, weight row 0 zero with scale 0, token 0 zero", device,
                        lead=(3, 5), K=128, N=24, R=16, zero_row=True, zero_token=True)
    yield svdquant_case("M9 K192 N33 rank48 fp32 smooth, x non-contiguous", device, lead=(9,), K=192, N=33,
                        R=48, smooth="fp32", strided=True)
    yield svdquant_case("M17 K256 N72 rank32 fp16 smooth, x and bias non-contiguous", device, lead=(17,), K=256,
                        N=72, R=32, dtype=torch.float16, smooth="x", bias="x", strided=True)
    yield svdquant_case("M70 K128 N72 rank32 smooth fp32 bias (the prefill row)", device, lead=(70,), K=128,
                        N=72, R=32, smooth="x", bias="fp32")
    yield svdquant_case("M17 K128 N40 rank128 smooth (two low-rank column blocks in the activation pass)", device,
                        lead=(17,), K=128, N=40, R=128, smooth="x")
    yield svdquant_case("M5 K128 N16 rank0 (no low-rank branch)", device, lead=(5,), K=128, N=16, R=0)
    yield svdquant_case("K0 rank16 bias", device, lead=(3,), K=0, N=16, R=16, bias="x")
    yield svdquant_case("M0", device, lead=(0,), K=64, N=16, R=16)


_register("svdquant_w4a4_linear", _svdquant_samples,
          "SVDQuant W4A4: int4 x int4 per group of 64 (int8 dot, int32 sums), 16-bit scales, a low-rank branch")
