"""The quant family against its oracles (lanekit.reference.quant): every registered sample on
the Triton lane with outputs poisoned, codes and scales equal to the oracle's bit for bit;
the semantics the issue names (saturation, zero rows, static scales with a sign, e5m2's range,
the rounding point of silu_and_mul_quant_fp8), and hostile inputs."""

from __future__ import annotations

import pytest
import torch

import lanekit.quant as quant
from lanekit.families import get_op
from lanekit.reference import quant as ref
from lanekit.reference.numerics import QUANT_MAX
from lanekit.testing import (assert_close, assert_same_bits, generator, noncontiguous, poisoned_outputs, randn,
                             registered_cases, upcast)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = ["quantize_fp8", "quantize_int8", "dequantize_fp8", "dequantize_int8", "silu_and_mul_quant_fp8",
       "hadamard_quantize_int8", "hadamard_dequantize_int8", "stochastic_round_fp8"]


@pytest.mark.parametrize("name,sample", registered_cases(map(get_op, OPS), DEVICE))
def test_samples_match_the_oracle(name, sample):
    op = get_op(name)
    expected = op.reference()(**{k: upcast(v) for k, v in sample.kwargs.items()})
    expected = expected if isinstance(expected, tuple) else (expected,)
    with poisoned_outputs():
        out = op.lane("triton")(**sample.kwargs)
    out = out if isinstance(out, tuple) else (out,)
    for (output, tol), o, r in zip(op.outputs, out, expected):
        assert_close(o, r, tol)


def _x(R, C, dtype=torch.bfloat16, seed="x", scale=1.0):
    return randn(R, C, dtype=dtype, device=DEVICE, generator=generator(f"{seed} {R} {C}"), scale=scale)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("granularity", ["tensor", "token", "group"])
def test_fp8_dynamic_scale_and_saturation(dtype, granularity):
    x = _x(7, 300, torch.float32, scale=10.0)
    codes, scale = quant.quantize_fp8(x, dtype, granularity=granularity)
    qmax = QUANT_MAX[dtype]
    c = codes.float()
    assert torch.isfinite(c).all()
    assert c.abs().max() == qmax        # the amax of every group maps to +-qmax exactly
    # a static scale far too small saturates, never inf / NaN
    tiny = torch.full_like(scale, 1e-30)
    codes, _ = quant.quantize_fp8(x, dtype, scale=tiny, granularity=granularity)
    assert torch.isfinite(codes.float()).all() and codes.float().abs().max() == qmax


def test_e5m2_max_is_57344():
    assert QUANT_MAX[torch.float8_e5m2] == 57344.0 == torch.finfo(torch.float8_e5m2).max


def test_zero_rows_conventions():
    x = _x(4, 100)
    x[2] = 0
    codes, scale = quant.quantize_fp8(x, granularity="token")
    assert scale[2].item() == 1.0 and (codes[2].float() == 0).all()      # fp8: scale 1
    codes, scale = quant.quantize_int8(x, granularity="token")
    assert scale[2].item() == 0.0 and (codes[2] == 0).all()               # int8: scale 0, codes 0
    assert torch.isfinite(scale).all()


def test_int8_round_half_to_even_and_negative_static_scale():
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, 300.0, -300.0, 127.5]], device=DEVICE)
    codes, s = quant.quantize_int8(x, scale=torch.ones(1, 1, device=DEVICE))
    assert codes.tolist() == [[0, 2, 2, 0, -2, 127, -128, 127]]
    codes, s = quant.quantize_int8(x, scale=-torch.ones(1, 1, device=DEVICE))
    assert codes.tolist() == [[0, -2, -2, 0, 2, -128, 127, -128]]
    assert s.item() == -1.0


def test_dequantize_inverts_within_a_code():
    x = _x(5, 257, torch.float32)
    for gran in ("tensor", "token", "group"):
        codes, s = quant.quantize_int8(x, granularity=gran, group_size=64)
        y = quant.dequantize_int8(codes, s, gran, 64)
        step = s.max().item()
        assert (y - x).abs().max().item() <= 0.5 * step * (1 + 1e-6)


def test_silu_and_mul_rounds_the_intermediate_to_x_dtype():
    x = _x(3, 256, torch.bfloat16, scale=3.0)
    codes, s = quant.silu_and_mul_quant_fp8(x)
    g, u = x[:, :128].double(), x[:, 128:].double()
    h = (g * torch.sigmoid(g) * u).to(torch.bfloat16)
    want, ws = quant.quantize_fp8(h, granularity="token", lane="reference")
    assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8)) and torch.equal(s, ws)


def test_noncontiguous_equals_contiguous():
    x = _x(9, 129)
    a = quant.quantize_fp8(x, granularity="group", group_size=32)
    b = quant.quantize_fp8(noncontiguous(x), granularity="group", group_size=32)
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("call,error,match", [
    (lambda x: quant.quantize_fp8(x.int()), TypeError, "x: expected dtype"),
    (lambda x: quant.quantize_fp8(x[0]), ValueError, "x: expected 2 dimensions"),
    (lambda x: quant.quantize_fp8(x, torch.int8), TypeError, "dtype"),
    (lambda x: quant.quantize_fp8(x, granularity="row"), ValueError, "granularity"),
    (lambda x: quant.quantize_fp8(x, granularity="group", group_size=0), ValueError, "group_size"),
    (lambda x: quant.quantize_fp8(x, scale=torch.ones(2, device=x.device)), ValueError, "scale"),
    (lambda x: quant.quantize_fp8(x, scale=torch.ones(1, dtype=torch.float16, device=x.device)),
     TypeError, "scale"),
    (lambda x: quant.quantize_int8(x, scale=torch.ones(4, 2, device=x.device)), ValueError, "scale"),
    (lambda x: quant.quantize_int8([1.0]), TypeError, "x: expected a torch.Tensor"),
    (lambda x: quant.dequantize_int8(x, torch.ones(4, 1, device=x.device)), TypeError, "codes"),
    (lambda x: quant.dequantize_fp8(x.to(torch.float8_e4m3fn), torch.ones(1, device=x.device),
                                    output_dtype=torch.int8), TypeError, "output_dtype"),
    (lambda x: quant.silu_and_mul_quant_fp8(x[:, :7]), ValueError, "even width"),
    (lambda x: quant.silu_and_mul_quant_fp8(x.float()), TypeError, "x: expected dtype"),
    (lambda x: quant.silu_and_mul_quant_fp8(x, granularity="tensor"), ValueError, "scale"),
    (lambda x: quant.quantize_fp8(x, lane="nope"), ValueError, "lane"),
])
def test_bad_arguments_are_refused(call, error, match):
    x = _x(4, 8)
    with pytest.raises(error, match=match):
        call(x)


def test_reference_oracle_matches_numerics_quantize_groups():
    from lanekit.reference.numerics import quantize_groups

    x = _x(6, 200, torch.float32).cpu()
    for group, gran in ((None, "tensor"), (200, "token"), (64, "group")):
        a = quantize_groups(x, group)
        b = ref.quantize_fp8(x, granularity=gran, group_size=64)
        assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
        assert torch.equal(a[1].reshape(-1), b[1].reshape(-1))


def test_hadamard_is_orthonormal_and_round_trips():
    x = _x(3, 100, torch.float32)
    codes, s = quant.hadamard_quantize_int8(x)
    assert codes.shape == (3, 128) and s.shape == (3, 1)
    y = quant.hadamard_dequantize_int8(codes, s, 100)
    # the rotation keeps the 2-norm: the error is at most half a code per rotated column
    err = (y - x).norm(dim=1)
    assert (err <= 0.5 * s.squeeze(1) * 128 ** 0.5 * (1 + 1e-5)).all()


def test_hadamard_bad_arguments():
    x = _x(2, 9000)
    with pytest.raises(ValueError, match="K <= 8192"):
        quant.hadamard_quantize_int8(x)
    codes = torch.zeros(2, 64, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="codes: expected"):
        quant.hadamard_dequantize_int8(codes, torch.ones(2, 1, device=DEVICE), 100)
    with pytest.raises(ValueError, match="scale"):
        quant.hadamard_dequantize_int8(codes, torch.ones(2, device=DEVICE), 64)


def _neighbours(x, dtype):
    """The two fp8 values around each fp32 x (lo <= x <= hi), from round-down and round-up
    searches over the format's finite values."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    vals = torch.unique(vals[torch.isfinite(vals)])
    idx = torch.searchsorted(vals, x.cpu().float().contiguous(), right=True)
    lo = vals[(idx - 1).clamp(0, len(vals) - 1)]
    hi = vals[idx.clamp(0, len(vals) - 1)]
    exact = lo == x.cpu()
    return lo, torch.where(exact, lo, hi)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_stochastic_round_neighbours_reproducible_unbiased(dtype):
    qmax = QUANT_MAX[dtype]
    C, n = 48, 3000
    base = randn(1, C, dtype=torch.float32, device="cpu", generator=generator("sr")) * \
        torch.logspace(-8, 4, C, base=2.0)
    x = base.expand(n, C).contiguous().to(DEVICE)
    codes = quant.stochastic_round_fp8(x, dtype, seed=99, offset=12345)
    c = codes.float().cpu()
    lo, hi = _neighbours(base.clamp(-qmax, qmax), dtype)
    # always one of the two neighbours of x, never inf or NaN
    assert ((c == lo) | (c == hi)).all()
    # both neighbours occur where x is not a code (a fixed rounding would pick one)
    inexact = (lo != hi).squeeze(0)
    assert ((c == lo) & inexact).any(0).sum() >= inexact.sum() - 2
    assert ((c == hi) & inexact).any(0).sum() >= inexact.sum() - 2
    # unbiased: the mean of n independent draws is x within 5 standard deviations
    step = (hi - lo).squeeze(0)
    err = (c.double().mean(0) - base.squeeze(0).double()).abs()
    assert (err <= 5 * 0.5 * step.double() / n ** 0.5 + step.double() * 2 ** -24 + 1e-30).all()
    # reproducible from (seed, offset); another offset or seed draws other numbers
    again = quant.stochastic_round_fp8(x, dtype, seed=99, offset=12345)
    assert torch.equal(again.view(torch.uint8), codes.view(torch.uint8))
    other = quant.stochastic_round_fp8(x, dtype, seed=99, offset=12346)
    assert not torch.equal(other.view(torch.uint8), codes.view(torch.uint8))
    other = quant.stochastic_round_fp8(x, dtype, seed=100, offset=12345)
    assert not torch.equal(other.view(torch.uint8), codes.view(torch.uint8))


def test_stochastic_round_saturates_and_keeps_codes():
    x = torch.tensor([[1e30, -1e30, 448.0, 1.25, -0.0, 2.0 ** -9]], device=DEVICE)
    c = quant.stochastic_round_fp8(x, seed=3).float().cpu()
    assert c.tolist() == [[448.0, -448.0, 448.0, 1.25, 0.0, 2.0 ** -9]]


def test_stochastic_round_bad_arguments():
    x = _x(2, 8)
    with pytest.raises(TypeError, match="seed"):
        quant.stochastic_round_fp8(x, seed=1.5)
    with pytest.raises(ValueError, match="offset"):
        quant.stochastic_round_fp8(x, offset=-1)
    with pytest.raises(ValueError, match="seed"):
        quant.stochastic_round_fp8(x, seed=2 ** 63)


def test_custom_ops_pass_opcheck():
    from lanekit.quant import op

    x = _x(5, 40)
    cases = [
        (op._quantize_op, (x, torch.float8_e4m3fn, None, "group", 16)),
        (op._quantize_op, (x, torch.int8, None, "token", 128)),
        (op._silu_and_mul_quant_op, (x, torch.float8_e5m2, None, "token", 128)),
        (op._hadamard_quant_op, (x,)),
        (op._stochastic_round_op, (x, torch.float8_e4m3fn, 3, 7)),
    ]
    codes, s = quant.quantize_int8(x)
    cases.append((op._dequantize_op, (codes, s, "token", 128, torch.bfloat16)))
    for o, args in cases:
        torch.library.opcheck(o, args, test_utils=("test_schema", "test_faketensor"))


# ---- the NaN-visible rule (docs/semantics.md): a group holding a NaN or inf keeps it visible ----

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAN, INF = float("nan"), float("inf")


def _hostile(R=4, C=40, dtype=torch.bfloat16):
    """Rows: 0 finite, 1 a NaN, 2 a +inf, 3 a -inf (with a negative NaN-free rest)."""
    x = _x(R, C, dtype, seed="hostile")
    x[1, 3], x[2, 7], x[3, C - 1] = NAN, INF, -INF
    return x


def _both_lanes(fn, **kwargs):
    out = {lane: fn(lane=lane, **kwargs) for lane in ("triton", "reference")}
    return [o if isinstance(o, tuple) else (o,) for o in (out["triton"], out["reference"])]


def _nan_code(dtype):
    return torch.tensor([0x7F], dtype=torch.uint8).view(dtype)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("granularity", ["tensor", "token", "group"])
def test_fp8_a_nan_or_inf_gives_a_nan_scale_and_nan_codes_on_both_lanes(dtype, granularity):
    x = _hostile()
    (codes, scale), (rc, rs) = _both_lanes(quant.quantize_fp8, x=x, dtype=dtype, granularity=granularity,
                                           group_size=16)
    assert_same_bits(codes, rc, "codes")
    assert_same_bits(scale, rs, "scale")
    bad_rows = slice(None) if granularity == "tensor" else slice(1, 4)
    assert torch.isnan(scale[bad_rows].reshape(3 if granularity != "tensor" else 1, -1)).any(-1).all()
    nan = codes.view(torch.uint8) == 0x7F
    if granularity == "tensor":
        assert nan.all()
    elif granularity == "token":
        assert nan[1:].all() and not nan[0].any() and torch.isfinite(scale[0]).all()
    else:   # groups of 16: only the group with the NaN or inf
        assert nan[1, :16].all() and not nan[1, 16:].any() and nan[2, :16].all() and nan[3, 32:].all()
        assert torch.isnan(scale[1, 0]) and torch.isfinite(scale[1, 1:]).all()
    # dequantized: NaN exactly where the rule put it
    y = quant.dequantize_fp8(codes, scale, granularity, 16)
    assert torch.equal(torch.isnan(y), nan)


@pytest.mark.parametrize("granularity", ["tensor", "token", "group"])
def test_int8_a_nan_or_inf_gives_a_nan_scale_and_zero_codes_on_both_lanes(granularity):
    x = _hostile()
    (codes, scale), (rc, rs) = _both_lanes(quant.quantize_int8, x=x, granularity=granularity, group_size=16)
    assert_same_bits(codes, rc, "codes")
    assert_same_bits(scale, rs, "scale")
    if granularity == "token":
        assert torch.isnan(scale[1:]).all() and (codes[1:] == 0).all() and torch.isfinite(scale[0]).all()
        assert codes[0].abs().max() == 127
    y = quant.dequantize_int8(codes, scale, granularity, 16)
    per_column = scale.reshape(1, 1).expand(4, 40) if granularity == "tensor" else \
        torch.repeat_interleave(scale, 16 if granularity == "group" else 40, 1)[:, :40]
    assert torch.equal(torch.isnan(y), torch.isnan(per_column)) and torch.isnan(y).any()


@pytest.mark.parametrize("dtype", [E4M3, E5M2, torch.int8])
def test_static_scales_a_nan_gives_the_nan_code_and_inf_saturates(dtype):
    x = _hostile(C=8)
    scale = torch.tensor([0.01], device=DEVICE)
    fn = quant.quantize_int8 if dtype == torch.int8 else quant.quantize_fp8
    kw = dict(granularity="tensor") if dtype == torch.int8 else dict(dtype=dtype)
    (codes, s), (rc, _) = _both_lanes(fn, x=x, scale=scale, **kw)
    assert_same_bits(codes, rc, "codes")
    assert s.item() == 0.01 or torch.equal(s, scale.reshape(1))
    qmax = QUANT_MAX[dtype]
    if dtype == torch.int8:     # no NaN in int8: a NaN's code is 0 (documented), inf saturates
        assert codes[1, 3] == 0 and codes[2, 7] == 127 and codes[3, 7] == -128
    else:
        assert codes.view(torch.uint8)[1, 3] == 0x7F
        assert (codes.view(torch.uint8) == 0x7F).sum() == 1
        assert codes[2, 7].float() == qmax and codes[3, 7].float() == -qmax
    # a NaN static scale: every fp8 code NaN, every int8 code 0
    (codes, _), (rc, _) = _both_lanes(fn, x=x, scale=torch.tensor([NAN], device=DEVICE), **kw)
    assert_same_bits(codes, rc, "codes")
    assert (codes == 0).all() if dtype == torch.int8 else (codes.view(torch.uint8) == 0x7F).all()


@pytest.mark.parametrize("granularity,scale", [("token", None), ("group", None), ("tensor", 0.01)])
def test_silu_and_mul_quant_a_nan_or_inf_in_gate_or_up_stays_visible(granularity, scale):
    x = _x(4, 64, seed="silu hostile")
    x[1, 3] = NAN         # gate
    x[2, 40] = INF        # up: h = +-inf
    x[3, 5] = -INF        # gate -inf: silu(-inf) * up = -inf * 0 = NaN
    s = None if scale is None else torch.tensor([scale], device=DEVICE)
    (codes, sc), (rc, rs) = _both_lanes(quant.silu_and_mul_quant_fp8, x=x, scale=s, granularity=granularity,
                                        group_size=16)
    assert_same_bits(codes, rc, "codes")
    assert_same_bits(sc, rs, "scale")
    nan = codes.view(torch.uint8) == 0x7F
    if scale is None:
        assert torch.isnan(sc[1:, 0]).all() and nan[1:, :16].all() and not nan[0].any()
    else:                 # static: the NaN products alone are NaN codes; the inf one saturates
        assert nan[1, 3] and nan[3, 5] and codes[2, 8].float().abs() == 448 and nan.sum() == 2


def test_hadamard_quantize_a_nan_or_inf_row_gets_a_nan_scale_and_zero_codes():
    x = _hostile(C=24)
    (codes, scale), (rc, rs) = _both_lanes(quant.hadamard_quantize_int8, x=x)
    assert_same_bits(codes, rc, "codes")
    assert_same_bits(scale, rs, "scale")
    assert torch.isnan(scale[1:]).all() and (codes[1:] == 0).all() and torch.isfinite(scale[0]).all()
    y = quant.hadamard_dequantize_int8(codes, scale, 24)
    assert torch.isnan(y[1:]).all() and torch.isfinite(y[0]).all()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_stochastic_round_nan_in_nan_out_and_inf_saturates(dtype):
    x = _hostile(C=16, dtype=torch.float32)
    x[0, 0] = -NAN
    (codes,), (rc,) = _both_lanes(quant.stochastic_round_fp8, x=x, dtype=dtype, seed=5, offset=2)
    assert_same_bits(codes, rc, "codes")
    nan = codes.view(torch.uint8) == 0x7F
    assert nan[1, 3] and nan[0, 0] and nan.sum() == 2
    assert codes[2, 7].float() == QUANT_MAX[dtype] and codes[3, 15].float() == -QUANT_MAX[dtype]
