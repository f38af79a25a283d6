"""The GEMM family against its oracles (lanekit.reference.gemm), on the Triton lane (interpreted
on the CPU) and the reference lane, with the project's tolerance rule, outputs poisoned; the
issue's edge cases (K = 0, partial tiles, M = 1) and hostile inputs, each a test."""

from __future__ import annotations

import pytest
import torch

from lanekit import gemm
from lanekit.families import get_op
from lanekit.gemm import registry as greg
from lanekit.gemm.kernels import quant_rows
from lanekit.reference import gemm as ref
from lanekit.reference.numerics import quantize_groups
from lanekit.testing import CODES, assert_close, generator, poisoned_outputs, registered_cases, upcast

OPS = ["scaled_mm", "int8_mm", "mx_mm", "w8a8_linear", "fp8_linear", "w8a16_linear"]
LANES = ["triton", "reference"]
# the registered samples and the kernel-level tests run where the Triton lane runs: the GPU when
# there is one (natively), else the CPU (interpreted); public-function tests stay on the CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("name, sample", registered_cases(map(get_op, OPS), DEVICE))
def test_registered_samples_match_the_oracle(name, sample, lane):
    op = get_op(name)
    refout = op.reference()(**{k: upcast(v) for k, v in sample.kwargs.items()})
    with poisoned_outputs():
        out = op.lane(lane)(**sample.kwargs)
    assert_close(out, refout, greg.GEMM)


def _fp8(shape, seed):
    return greg.codes(generator(seed), shape, E4M3, "cpu")


def test_public_scaled_mm_rowwise_on_column_major_b_and_bias():
    a, w = _fp8((13, 41), "a"), _fp8((27, 41), "w")
    sa, sb = torch.rand(13, 1) + 0.5, torch.rand(1, 27) + 0.5
    bias = torch.randn(27).bfloat16()
    with poisoned_outputs():
        out = gemm.scaled_mm(a, w.t(), sa, sb, bias=bias)
    assert out.dtype == torch.bfloat16 and out.shape == (13, 27)
    assert_close(out, ref.scaled_mm(a, w.t(), sa, sb, bias), greg.GEMM)


def test_k0_gives_zeros_plus_bias():
    a, b = torch.empty(4, 0, dtype=E4M3), torch.empty(0, 6, dtype=E4M3)
    bias = torch.randn(6).bfloat16()
    with poisoned_outputs():
        out = gemm.scaled_mm(a, b, torch.ones(()), torch.ones(()), bias=bias)
    assert torch.equal(out, bias.expand(4, 6))
    ai, bi = torch.empty(4, 0, dtype=torch.int8), torch.empty(0, 6, dtype=torch.int8)
    with poisoned_outputs():
        out = gemm.int8_mm(ai, bi, torch.ones(4, 1), torch.ones(1, 6), out_dtype=torch.float32)
    assert torch.equal(out, torch.zeros(4, 6))


def test_int8_mm_is_exact_in_int32():
    # the largest products: K * 128 * 128 exceeds fp16/bf16 and fp32's 24 bits only past K = 1024
    a = torch.full((3, 700), -128, dtype=torch.int8)
    b = torch.full((700, 5), -128, dtype=torch.int8)
    out = gemm.int8_mm(a, b, torch.ones(()), torch.ones(()), out_dtype=torch.float32)
    assert torch.equal(out, torch.full((3, 5), 700 * 16384.0))


def test_block_scales_are_applied_per_128_group():
    # scales that differ by powers of two per group: any group applied to another's K gives a
    # different result
    M, K, N = 5, 300, 150
    a, w = _fp8((M, K), "ba"), _fp8((N, K), "bw")
    sa = 2.0 ** torch.arange(M * 3, dtype=torch.float32).reshape(M, 3).remainder(5)
    sb = 2.0 ** torch.arange(6, dtype=torch.float32).reshape(3, 2).neg()
    with poisoned_outputs():
        out = gemm.scaled_mm(a, w.t(), sa, sb, out_dtype=torch.float32)
    assert_close(out, ref.scaled_mm(a, w.t(), sa, sb, scheme="block"), greg.GEMM)


def test_mx_nan_scale_gives_nan_rows_only():
    s = greg.mx_case("nan", "cpu", M=4, K=64, N=9, nan=True)
    out = gemm.mx_mm(**s.kwargs)
    assert torch.isnan(out[0]).all() and not torch.isnan(out[1:]).any()
    refout = ref.mx_mm(**s.kwargs)
    assert_close(out[1:], refout[1:], greg.GEMM)


def test_activation_codes_equal_the_oracles():
    x = torch.randn(9, 300).bfloat16()
    x[2] = 0
    x[4] = torch.tensor([127.0, 2.5, -2.5, -127.5, -128.0, 0.5, 1.5] + [0.0] * 293).bfloat16()
    x = x.to(DEVICE)
    codes, scale = quant_rows(x, torch.int8, 300)
    rc, rs = ref.quantize_int8_rows(x)
    assert_close(codes, rc, CODES)
    assert torch.equal(scale.reshape(-1), rs) and scale[2].item() == 0 and (codes[2] == 0).all()
    codes, scale = quant_rows(x, E4M3, 128)
    rc, rs = quantize_groups(x, 128, E4M3)
    assert_close(codes, rc, CODES)
    assert torch.equal(scale, rs)


def test_static_x_scale_is_used_as_given():
    x = torch.randn(4, 64).bfloat16()
    w = torch.randint(-128, 128, (8, 64), dtype=torch.int8)
    ws, xs = torch.rand(8) / 100, torch.tensor([0.03])
    with poisoned_outputs():
        out = gemm.w8a8_linear(x, w, ws, x_scale=xs)
    assert_close(out, ref.w8a8_linear(x, w, ws, None, xs), greg.GEMM)


def test_linear_keeps_leading_dims_and_dtype():
    x = torch.randn(2, 3, 96, dtype=torch.float16)
    w = torch.randint(-128, 128, (23, 96), dtype=torch.int8)
    out = gemm.w8a16_linear(x, w, torch.rand(23) / 100)
    assert out.shape == (2, 3, 23) and out.dtype == torch.float16


# ---- hostile inputs: every one a TypeError or ValueError naming the argument ----

def _mm_args():
    return dict(a=_fp8((4, 32), "ha"), b=_fp8((32, 6), "hb"), scale_a=torch.ones(4, 1), scale_b=torch.ones(1, 6))


@pytest.mark.parametrize("change, error, match", [
    (dict(a=torch.zeros(4, 32, dtype=torch.bfloat16)), TypeError, "a:"),
    (dict(b=torch.zeros(32, 6, dtype=torch.int8)), TypeError, "b:"),
    (dict(b=torch.zeros(31, 6, dtype=E4M3)), ValueError, "b:"),
    (dict(a=torch.zeros(4, 32, 1, dtype=E4M3)), ValueError, "a:"),
    (dict(scale_a=torch.ones(4, 1, dtype=torch.float16)), TypeError, "scale_a"),
    (dict(scale_a=torch.ones(3, 1)), ValueError, "scale_a"),
    (dict(scale_b=torch.ones(6, 1)), ValueError, "scale_b"),
    (dict(scale_b=torch.ones(1, 6, device="meta")), ValueError, "scale_b"),
    (dict(bias=torch.ones(5, dtype=torch.bfloat16)), ValueError, "bias"),
    (dict(bias=torch.ones(6, dtype=torch.float16)), TypeError, "bias"),
    (dict(out_dtype=torch.int32), TypeError, "out_dtype"),
])
def test_scaled_mm_rejects(change, error, match):
    kw = _mm_args()
    kw.update(change)
    with pytest.raises(error, match=match):
        gemm.scaled_mm(**kw)


def test_int8_mm_rejects_block_scales_and_fp8():
    a, b = torch.zeros(4, 300, dtype=torch.int8), torch.zeros(300, 6, dtype=torch.int8)
    with pytest.raises(ValueError, match="scale_a"):
        gemm.int8_mm(a, b, torch.ones(4, 3), torch.ones(3, 1))
    with pytest.raises(TypeError, match="a:"):
        gemm.int8_mm(a.to(E4M3), b, torch.ones(()), torch.ones(()))


def test_mx_mm_rejects():
    a, b = _fp8((4, 64), "ma"), _fp8((64, 6), "mb")
    ea, eb = torch.full((4, 2), 127, dtype=torch.uint8), torch.full((2, 6), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 32"):
        gemm.mx_mm(a[:, :40], ea, b[:40], eb)
    with pytest.raises(TypeError, match="a_scale"):
        gemm.mx_mm(a, ea.float(), b, eb)
    with pytest.raises(ValueError, match="b_scale"):
        gemm.mx_mm(a, ea, b, eb[:1])


def test_linears_reject():
    x = torch.randn(4, 64).bfloat16()
    w8 = torch.zeros(8, 64, dtype=torch.int8)
    with pytest.raises(TypeError, match="weight"):
        gemm.w8a8_linear(x, w8.to(E4M3), torch.ones(8))
    with pytest.raises(ValueError, match="weight"):
        gemm.w8a8_linear(x, torch.zeros(8, 63, dtype=torch.int8), torch.ones(8))
    with pytest.raises(ValueError, match="weight_scale"):
        gemm.w8a8_linear(x, w8, torch.ones(7))
    with pytest.raises(ValueError, match="x_scale"):
        gemm.w8a8_linear(x, w8, torch.ones(8), x_scale=torch.ones(4))
    with pytest.raises(TypeError, match="x:"):
        gemm.w8a16_linear(x.float(), w8, torch.ones(8))
    with pytest.raises(ValueError, match="weight_scale"):
        gemm.w8a16_linear(x, w8, torch.ones(()))
    w = torch.zeros(8, 64, dtype=E4M3)
    with pytest.raises(ValueError, match="block_size"):
        gemm.fp8_linear(x, w, torch.ones(1, 1), block_size=[64, 64])
    with pytest.raises(ValueError, match="block_size"):   # floats are not ints (fused_moe's block_shape alike)
        gemm.fp8_linear(x, w, torch.ones(1, 1), block_size=[128.0, 128.0])
    with pytest.raises(ValueError, match="weight_scale"):
        gemm.fp8_linear(x, w, torch.ones(8), block_size=[128, 128])
    with pytest.raises(ValueError, match="x_scale"):
        gemm.fp8_linear(x, w, torch.ones(1, 1), x_scale=torch.ones(1), block_size=[128, 128])
    with pytest.raises(ValueError, match="weight"):
        gemm.fp8_linear(x, w.to("meta"), torch.ones(8))


# ---- the NaN-visible rule (docs/semantics.md) in the linears' activation quantization ----

def _hostile_x(R=5, K=300):
    """Rows: 0 and 4 finite, 1 a NaN, 2 a +inf, 3 a -inf."""
    x = torch.randn(R, K, generator=torch.Generator().manual_seed(37)).bfloat16()
    x[1, 3], x[2, 130], x[3, K - 1] = float("nan"), float("inf"), float("-inf")
    return x


@pytest.mark.parametrize("dtype,group", [(torch.int8, 300), (E4M3, 300), (E4M3, 128)],
                         ids=["int8 per token", "e4m3 per token", "e4m3 per 1x128"])
def test_activation_quantization_keeps_a_nan_or_inf_row_visible(dtype, group):
    from lanekit.testing import assert_same_bits

    x = _hostile_x().to(DEVICE)
    codes, scale = quant_rows(x, dtype, group)
    if dtype == torch.int8:
        rc, rs = ref.quantize_int8_rows(x)
        rs = rs.reshape(-1, 1)
    else:
        rc, rs = quantize_groups(x, group, dtype)
    assert_same_bits(codes, rc, "codes")
    assert_same_bits(scale, rs, "scale")
    nan_scale = torch.isnan(scale.cpu())
    if group == 300:
        assert nan_scale.reshape(-1).tolist() == [False, True, True, True, False]
    else:   # only the 128-column groups holding the NaN or inf
        assert nan_scale.tolist() == [[False] * 3, [True, False, False], [False, True, False],
                                      [False, False, True], [False] * 3]
    bad = codes.cpu() == 0 if dtype == torch.int8 else codes.cpu().view(torch.uint8) == 0x7F
    cols = torch.repeat_interleave(nan_scale, group, 1)[:, :300]
    assert bad[cols].all() and (dtype == torch.int8 or not bad[~cols].any())
    # a static scale: the NaN value's code alone (fp8 NaN, int8 0), +-inf saturates
    codes, _ = quant_rows(x, dtype, 300, static_scale=torch.tensor([0.05], device=DEVICE))
    static = torch.tensor([0.05], device=DEVICE)
    rc, _ = (ref.quantize_int8_rows(x, static) if dtype == torch.int8 else quantize_groups(x, None, dtype, static))
    assert_same_bits(codes, rc, "static codes")


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("linear", ["w8a8", "fp8", "fp8 blocks"])
def test_a_nan_or_inf_token_makes_its_output_row_nan_and_no_other(linear, lane):
    x = _hostile_x().to(DEVICE)
    g = torch.Generator().manual_seed(5)
    if linear == "w8a8":
        w = torch.randint(-128, 128, (8, 300), dtype=torch.int8, generator=g).to(DEVICE)
        ws = (torch.rand(8, generator=g) / 100).to(DEVICE)
        out, want = gemm.w8a8_linear(x, w, ws, lane=lane), ref.w8a8_linear(x, w, ws)
    else:
        w = (torch.randn(8, 300, generator=g) * 100).to(E4M3).to(DEVICE)
        block = [128, 128] if linear == "fp8 blocks" else None
        ws = (torch.rand(1, 3, generator=g) / 100 if block else torch.rand(8, generator=g) / 100).to(DEVICE)
        out, want = gemm.fp8_linear(x, w, ws, block_size=block, lane=lane), \
            ref.fp8_linear(x, w, ws, block_size=block)
    assert torch.isnan(out[1:4]).all() and torch.isnan(want[1:4]).all()
    assert_close(out[[0, 4]], want[[0, 4]], greg.GEMM)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("K", [96, 0], ids=["K96", "K0"])
def test_w8a16_dx_and_dbias_match_the_float64_oracle(K, lane):
    # weight-only: differentiable in x and bias, the int8 weight and its scale constants (QLoRA)
    kw = greg.linear_case(f"grad {K}", DEVICE, lead=(3, 5), K=K, N=23, wdtype=torch.int8, bias=True).kwargs
    x, bias = kw["x"].detach().requires_grad_(), kw["bias"].detach().requires_grad_()
    dy = torch.randn(3, 5, 23, generator=torch.Generator().manual_seed(6)).to(x.dtype).to(DEVICE)
    with poisoned_outputs():
        dx, dbias = torch.autograd.grad(gemm.w8a16_linear(x, kw["weight"], kw["weight_scale"], bias, lane=lane),
                                        (x, bias), dy)
    x64, b64 = upcast(x).requires_grad_(), upcast(bias).requires_grad_()
    want = torch.autograd.grad(ref.w8a16_linear(x64, kw["weight"], kw["weight_scale"], b64), (x64, b64), upcast(dy))
    assert_close(dx, want[0], greg.GEMM)
    assert_close(dbias, want[1], greg.GEMM)
    scale = kw["weight_scale"].clone().requires_grad_()
    if lane == "triton":      # a constant on the Triton lane: refused, not left without a gradient
        with pytest.raises(ValueError, match="weight_scale: expected a tensor that does not require grad"):
            gemm.w8a16_linear(x, kw["weight"], scale, bias, lane=lane)


@pytest.mark.parametrize("lane", LANES)
def test_w8a16_dx_stays_finite_where_the_weight_passes_fp32s_range(lane):
    # 127 * 1e37 is past fp32's range: a backward that built W in fp32 gave inf, and NaN (0 * inf)
    # where dy is 0, while y and the oracle's dx are finite
    kw = greg.linear_case("grad big", DEVICE, lead=(2,), K=64, N=8, wdtype=torch.int8).kwargs
    scale = kw["weight_scale"].clone()
    scale[0] = 1e37
    x = (kw["x"].float() * 1e-3).to(torch.bfloat16).requires_grad_()
    dy = torch.full((2, 8), 1e-3).to(torch.bfloat16).to(DEVICE)
    dy[1, 0] = 0
    with poisoned_outputs():
        (dx,) = torch.autograd.grad(gemm.w8a16_linear(x, kw["weight"], scale, lane=lane), x, dy)
    x64 = upcast(x.detach()).requires_grad_()
    (want,) = torch.autograd.grad(ref.w8a16_linear(x64, kw["weight"], scale), x64, upcast(dy))
    assert torch.isfinite(dx).all()
    assert_close(dx, want, greg.GEMM)
