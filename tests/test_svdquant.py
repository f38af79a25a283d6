"""SVDQuant W4A4 (issue 33): lanekit.gemm.svdquant_w4a4_linear and lanekit.quant's
quantize_w4a4_act / quantize_w4a4_wgt, against their float64 oracles (lanekit.reference.gemm,
lanekit.reference.quant) on the Triton lane (interpreted on the CPU) and the reference lane.
The issue's cases are each a test: codes from the scale rounded to bf16, a tie x / s = k + 0.5
(half to even), an all-zero group (scale 0, no NaN), M = 1 and 17, K = 64, rank 16 and 32."""

from __future__ import annotations

import pytest
import torch

from lanekit import gemm, quant
from lanekit.families import get_op
from lanekit.gemm import registry as greg
from lanekit.quant import registry as qreg
from lanekit.reference import gemm as rgemm
from lanekit.reference import quant as rquant
from lanekit.testing import assert_close, assert_same_bits, poisoned_outputs, registered_cases, upcast

LANES = ["triton", "reference"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("name, sample",
                         registered_cases(map(get_op, ["svdquant_w4a4_linear", "quantize_w4a4_act"]), DEVICE))
def test_registered_samples_match_the_oracle(name, sample, lane):
    op = get_op(name)
    want = op.reference()(**{k: upcast(v) for k, v in sample.kwargs.items()})
    with poisoned_outputs():
        out = op.lane(lane)(**sample.kwargs)
    if name == "quantize_w4a4_act":
        assert_close(out[0], want[0], qreg.CODES)
        assert_close(out[1], want[1], qreg.SCALES)
    else:
        assert_close(out, want, greg.GEMM)


def _act(rows, K=64, dtype=BF16):
    """x (len(rows), K): each row's first values given, the rest zero."""
    x = torch.zeros(len(rows), K, dtype=torch.float64)
    for i, r in enumerate(rows):
        x[i, :len(r)] = torch.tensor(r, dtype=torch.float64)
    return x.to(dtype).to(DEVICE)


def _codes(qact):
    return rquant.unpack_w4a4(qact.cpu())


# ---- the cases ----

@pytest.mark.parametrize("lane", LANES)
def test_codes_come_from_the_scale_rounded_to_bf16(lane):
    # amax 1: 1 / 7 rounds to 0.142578125 in bf16 (fp32: 0.14285715). With the stored scale,
    # 0.2138671875 / s = 1.5 exactly (half to even: 2), 0.5 / s = 3.507 (4), 0.78515625 / s = 5.507
    # (6); the fp32 scale would give 1, 3 and 5.
    x = _act([[1.0, 0.5, 0.78515625, 0.2138671875, -0.5]])
    codes, scales = quant.quantize_w4a4_act(x, lane=lane)
    assert scales.dtype == BF16 and scales.shape == (1, 1)
    assert scales.item() == 0.142578125
    assert _codes(codes)[0, :5].tolist() == [7, 4, 6, 2, -4]
    assert _codes(codes)[0, 5:].unique().tolist() == [0]
    # the linear multiplies those codes by that stored scale: W all ones (codes 1, scale 1)
    qweight = rquant.pack_w4a4(torch.ones(3, 64)).to(DEVICE)
    wscales = torch.ones(1, 3, dtype=BF16, device=DEVICE)
    none = torch.zeros(64, 0, dtype=BF16, device=DEVICE), torch.zeros(3, 0, dtype=BF16, device=DEVICE)
    y = gemm.svdquant_w4a4_linear(x, qweight, wscales, *none, lane=lane)
    want = torch.tensor((7 + 4 + 6 + 2 - 4) * 0.142578125).to(BF16).item()     # the fp32 scale: 12 / 7
    assert y.float().cpu().tolist() == [[want] * 3]


@pytest.mark.parametrize("lane", LANES)
def test_a_tie_k_plus_half_rounds_to_even(lane):
    # amax 7: scale exactly 1, so x / s = x; every k + 0.5 in [-6.5, 6.5], then 7
    halves = [k + 0.5 for k in range(-7, 7)]
    codes, scales = quant.quantize_w4a4_act(_act([halves + [7.0]]), lane=lane)
    assert scales.item() == 1.0
    assert _codes(codes)[0, :15].tolist() == [-6, -6, -4, -4, -2, -2, 0, 0, 2, 2, 4, 4, 6, 6, 7]


@pytest.mark.parametrize("lane", LANES)
def test_an_all_zero_group_has_scale_zero_and_gives_no_nan(lane):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 128, generator=g).to(BF16)
    x[0, :64] = 0                 # token 0's first group
    x[1] = 0                      # token 1: both groups
    x = x.to(DEVICE)
    codes, scales = quant.quantize_w4a4_act(x, lane=lane)          # scales (K / 64, M)
    assert scales[:, 0].tolist() == [0.0, scales[1, 0].item()] and scales[1, 0].item() > 0
    assert scales[:, 1].tolist() == [0.0, 0.0]
    assert _codes(codes)[0, :64].unique().tolist() == [0] and _codes(codes)[1].unique().tolist() == [0]
    # the weight's first group all zero too (wscales 0), and output channel 0 all zero (scale 0)
    s = greg.svdquant_case("zero group", "cpu", lead=(3,), K=128, N=24, R=16, zero_row=True)
    kw = {k: v for k, v in s.kwargs.items() if k not in ("dtype", "smooth", "bias")}
    kw["x"] = x.cpu()
    kw["wscales"] = kw["wscales"].clone()
    kw["wscales"][0] = 0
    kw = {k: v.to(DEVICE) for k, v in kw.items()}
    with poisoned_outputs():
        y = gemm.svdquant_w4a4_linear(**kw, lane=lane)
    assert not torch.isnan(y).any()
    assert torch.equal(y[1].cpu(), torch.zeros(24, dtype=BF16))      # an all-zero token: exactly 0
    assert_close(y, rgemm.svdquant_w4a4_linear(**{k: upcast(v) for k, v in kw.items()}, dtype=BF16), greg.GEMM)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("M, K, R", [(1, 64, 16), (17, 64, 32), (1, 128, 32), (17, 192, 16)],
                         ids=lambda v: str(v))
def test_decode_and_odd_m_at_one_group_and_ranks_16_and_32(M, K, R, lane):
    s = greg.svdquant_case(f"M{M} K{K} R{R}", DEVICE, lead=(M,), K=K, N=40, R=R, smooth="x", bias="x")
    want = rgemm.svdquant_w4a4_linear(**{k: upcast(v) for k, v in s.kwargs.items()})
    kw = {k: v for k, v in s.kwargs.items() if k != "dtype"}
    with poisoned_outputs():
        y = gemm.svdquant_w4a4_linear(**kw, lane=lane)
    assert y.shape == (M, 40) and y.dtype == BF16
    assert_close(y, want, greg.GEMM)


# ---- the layouts, against tensors packed by hand ----

@pytest.mark.parametrize("lane", LANES)
def test_codes_pack_two_to_a_byte_low_nibble_first_in_twos_complement(lane):
    # scale 1 (amax 7): codes 1, -2, 7, -7 -> bytes 0xE1 (1 low, -2 = 0xE high), 0x97 (7, -7 = 0x9)
    codes, _ = quant.quantize_w4a4_act(_act([[1.0, -2.0, 7.0, -7.0]]), lane=lane)
    assert codes.dtype == torch.int8 and codes.shape == (1, 32)
    assert codes[0, :2].cpu().tolist() == [0xE1 - 256, 0x97 - 256]
    assert rquant.unpack_w4a4(torch.tensor([[0x08, 0x7F]], dtype=torch.int64).to(torch.int8)).tolist() \
        == [[-8, 0, -1, 7]]


@pytest.mark.parametrize("lane", LANES)
def test_the_linear_reads_qweight_low_nibble_first_and_sign_extends_minus_eight(lane):
    # W (2, 64): row 0 byte 0 = 0x08 (element 0: -8, element 1: 0), byte 1 = 0xF7 (element 2: 7,
    # element 3: -1); row 1 all zero. x: token i is 7 at column i (scale 1, code 7).
    qweight = torch.zeros(2, 32, dtype=torch.int8)
    qweight[0, 0], qweight[0, 1] = 0x08, 0xF7 - 256
    x = torch.zeros(4, 64, dtype=BF16)
    x[torch.arange(4), torch.arange(4)] = 7
    none = torch.zeros(64, 0, dtype=BF16), torch.zeros(2, 0, dtype=BF16)
    ws = torch.tensor([[0.5, 3.0]], dtype=BF16)
    y = gemm.svdquant_w4a4_linear(x.to(DEVICE), qweight.to(DEVICE), ws.to(DEVICE), *(t.to(DEVICE) for t in none),
                                  lane=lane)
    assert y.float().cpu().tolist() == [[7 * -8 * 0.5, 0.0], [0.0, 0.0], [7 * 7 * 0.5, 0.0], [7 * -1 * 0.5, 0.0]]


@pytest.mark.parametrize("lane", LANES)
def test_the_low_rank_branch_takes_x_unsmoothed_and_the_4bit_path_x_over_smooth(lane):
    g = torch.Generator().manual_seed(9)
    K, N, R = 128, 16, 16
    x = torch.randn(5, K, generator=g).to(BF16).to(DEVICE)
    down = (torch.randn(K, R, generator=g) * 0.1).to(BF16).to(DEVICE)
    up = (torch.randn(N, R, generator=g) * 0.1).to(BF16).to(DEVICE)
    zero_w = torch.zeros(N, K // 2, dtype=torch.int8, device=DEVICE), torch.zeros(K // 64, N, dtype=BF16, device=DEVICE)
    smooth = torch.full((K,), 4.0, dtype=BF16, device=DEVICE)
    y = gemm.svdquant_w4a4_linear(x, *zero_w, down, up, smooth, lane=lane)
    assert_close(y, (x.double() @ down.double()) @ up.double().t(), greg.GEMM)
    # the 4-bit path: a power-of-two smooth scales x / smooth's codes' scale, not the result
    qw, ws = quant.quantize_w4a4_wgt(torch.randn(N, K, generator=g).to(BF16).to(DEVICE), lane=lane)
    no_lora = torch.zeros(K, 0, dtype=BF16, device=DEVICE), torch.zeros(N, 0, dtype=BF16, device=DEVICE)
    plain = gemm.svdquant_w4a4_linear(x, qw, ws, *no_lora, lane=lane)
    smoothed = gemm.svdquant_w4a4_linear(x, qw, ws, *no_lora, smooth, lane=lane)
    assert torch.equal(smoothed.float() * 4, plain.float())


# ---- the weight quantizer ----

@pytest.mark.parametrize("lane", LANES)
def test_quantize_w4a4_wgt_is_the_activation_rule_without_smoothing_and_bounds_the_error(lane):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(33, 192, generator=g).to(torch.float16).to(DEVICE)
    qw, ws = quant.quantize_w4a4_wgt(w, lane=lane)
    assert qw.shape == (33, 96) and ws.shape == (3, 33) and ws.dtype == torch.float16
    rq, rs = rquant.quantize_w4a4_wgt(w.double().cpu(), torch.float16)
    assert torch.equal(qw.cpu(), rq) and torch.equal(ws.cpu(), rs)
    deq = rquant.dequantize_w4a4(qw.cpu(), ws.cpu())
    s = ws.double().cpu().t().repeat_interleave(64, 1)
    assert ((deq - w.double().cpu()).abs() <= 0.5 * s * (1 + 2 ** -9)).all()   # half a step of the stored scale


# ---- non-finite values (docs/semantics.md, "Non-finite values") ----

@pytest.mark.parametrize("lane", LANES)
def test_a_nan_in_a_token_makes_its_scale_and_output_row_nan(lane):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 128, generator=g).to(BF16)
    x[1, 70] = float("nan")
    x = x.to(DEVICE)
    codes, scales = quant.quantize_w4a4_act(x, lane=lane)
    rc, rs = rquant.quantize_w4a4_act(x.double().cpu(), None, BF16)
    assert_same_bits(codes.cpu(), rc, "codes")
    assert_same_bits(scales.cpu(), rs, "scales")
    assert torch.isnan(scales[1, 1]) and not torch.isnan(scales[1, 0]) and _codes(codes)[1, 64:].unique().tolist() == [0]
    s = greg.svdquant_case("nan", "cpu", lead=(3,), K=128, N=16, R=16)
    kw = {k: v.to(DEVICE) for k, v in s.kwargs.items() if isinstance(v, torch.Tensor)}
    kw["x"] = x
    y = gemm.svdquant_w4a4_linear(**kw, lane=lane)
    assert torch.isnan(y[1]).all() and not torch.isnan(y[0]).any() and not torch.isnan(y[2]).any()


# ---- bad input: a clear error naming the argument, nothing launched ----

def _good():
    s = greg.svdquant_case("errors", DEVICE, lead=(2,), K=128, N=16, R=16, smooth="x", bias="x")
    return {k: v for k, v in s.kwargs.items() if k != "dtype"}


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("change, error, words", [
    (dict(x=torch.zeros(2, 100, dtype=BF16)), ValueError, "x: expected K (the last dim) a multiple of 64"),
    (dict(x=torch.zeros(2, 128)), TypeError, "x"),
    (dict(qweight=torch.zeros(16, 64, dtype=torch.uint8)), TypeError, "qweight"),
    (dict(qweight=torch.zeros(16, 128, dtype=torch.int8)), ValueError, "qweight: expected (N, K / 2)"),
    (dict(wscales=torch.zeros(16, 2, dtype=BF16)), ValueError, "wscales: expected shape (2, 16)"),
    (dict(wscales=torch.zeros(2, 16)), TypeError, "wscales"),
    (dict(lora_down=torch.zeros(128, 16, dtype=torch.float16)), TypeError, "lora_down"),
    (dict(lora_down=torch.zeros(64, 16, dtype=BF16)), ValueError, "lora_down: expected (K, R)"),
    (dict(lora_up=torch.zeros(16, 8, dtype=BF16)), ValueError, "lora_up: expected shape (16, 16)"),
    (dict(smooth=torch.ones(64, dtype=BF16)), ValueError, "smooth: expected shape (128,)"),
    (dict(bias=torch.zeros(15, dtype=BF16)), ValueError, "bias: expected shape (16,)"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_arguments_are_refused_with_the_argument_named(change, error, words, lane):
    kw = {**_good(), **{k: v.to(DEVICE) for k, v in change.items()}}
    with pytest.raises(error, match=__import__("re").escape(words)):
        gemm.svdquant_w4a4_linear(**kw, lane=lane)


def test_the_quantizers_refuse_bad_arguments():
    with pytest.raises(ValueError, match=r"x: expected K \(the last dim\) a multiple of 64"):
        quant.quantize_w4a4_act(torch.zeros(2, 96, dtype=BF16))
    with pytest.raises(TypeError, match="x"):
        quant.quantize_w4a4_act(torch.zeros(2, 64, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"smooth: expected shape \(64,\)"):
        quant.quantize_w4a4_act(torch.zeros(2, 64, dtype=BF16), torch.ones(32, dtype=BF16))
    with pytest.raises(TypeError, match="smooth"):
        quant.quantize_w4a4_act(torch.zeros(2, 64, dtype=BF16), torch.ones(64, dtype=torch.float16))
    with pytest.raises(ValueError, match="w: expected"):
        quant.quantize_w4a4_wgt(torch.zeros(3, 100, dtype=BF16))
    with pytest.raises(ValueError, match="w: expected"):
        quant.quantize_w4a4_wgt(torch.zeros(64, dtype=BF16))


@pytest.mark.parametrize("lane", LANES)
def test_strided_and_expanded_bias_are_read_by_their_strides(lane):
    # the kernel reads bias[n] at BIAS + n: a strided view was read as contiguous (its neighbours'
    # values) and an expanded one (stride 0) past its one element
    kw = greg.svdquant_case("strided bias", DEVICE, lead=(5,), K=128, N=24, R=16, bias="fp32").kwargs
    for bias in (torch.stack([kw["bias"], kw["bias"] * 0 + 1e4], -1).select(-1, 0),
                 torch.full((1,), 0.5, device=DEVICE).expand(24)):
        args = {**kw, "bias": bias}
        want = rgemm.svdquant_w4a4_linear(**{k: upcast(v) for k, v in args.items()})
        with poisoned_outputs():
            y = gemm.svdquant_w4a4_linear(*(args[k] for k in ("x", "qweight", "wscales", "lora_down", "lora_up",
                                                                "smooth", "bias")), lane=lane)
        assert_close(y, want, greg.GEMM)


@pytest.mark.parametrize("lane", LANES)
def test_fp16_low_rank_activations_past_65504_stay_finite(lane):
    # h = x @ lora_down reaches ~2^17 (fp16 ends at 65504) while lora_up brings the output back to
    # O(100): the kernel once rounded h to fp16 (inf, then NaN); the oracle keeps it in float64
    s = greg.svdquant_case("fp16 large h", DEVICE, lead=(5,), K=128, N=24, R=16, dtype=torch.float16)
    kw = {k: v for k, v in s.kwargs.items() if k != "dtype"}
    kw["lora_down"] = kw["lora_down"] * 40000.0
    kw["lora_up"] = kw["lora_up"] / 40000.0
    want = rgemm.svdquant_w4a4_linear(**{k: upcast(v) for k, v in kw.items()}, dtype=torch.float16)
    h = upcast(kw["x"]) @ upcast(kw["lora_down"])
    assert h.abs().max() > 65504 and want.abs().max() < 1000
    with poisoned_outputs():
        y = gemm.svdquant_w4a4_linear(**kw, lane=lane)
    assert torch.isfinite(y).all()
    assert_close(y, want, greg.GEMM)
