"""4-bit GEMMs on the int8 dot (issue 33): quantize_w4a8's three modes and w4a8_linear (int4
weights, int8 activations), int4_mm (int4 x int4), and quantize_linears(model, "w4a8"), against
their oracles (lanekit.reference.gemm, reference.numerics.quantize_w4a8) on the Triton lane
(interpreted on the CPU) and the reference lane. The issue's cases are each a test: the last
group's scale the largest, an all-zero weight row, K = 32, M = 1 and M = 17, the nibble order
against hand-packed bytes; and the W4A8 rules: a more negative peak does not widen the scale, the
codes and the correction come from the stored (rounded) scale."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lanekit import gemm, quant
from lanekit.families import get_op
from lanekit.gemm import op as gop
from lanekit.gemm import registry as greg
from lanekit.integrations import quantize_linears
from lanekit.integrations.quantize import QuantizedLinear
from lanekit.reference import gemm as ref
from lanekit.testing import assert_close, on_device, poisoned_outputs, registered_cases, upcast

OPS = ["w4a8_linear", "int4_mm"]
LANES = ["triton", "reference"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("name, sample", registered_cases(map(get_op, OPS), DEVICE))
def test_registered_samples_match_the_oracle(name, sample, lane):
    op = get_op(name)
    want = op.reference()(**{k: upcast(v) for k, v in sample.kwargs.items()})
    with poisoned_outputs():
        out = op.lane(lane)(**sample.kwargs)
    assert_close(out, want, greg.GEMM)


# ---- the nibble order, against bytes packed by hand ----

@pytest.mark.parametrize("lane", LANES)
def test_int4_mm_low_nibble_first_and_twos_complement(lane):
    a = torch.zeros(1, 16, dtype=torch.uint8)          # A (1, 32)
    a[0, 0], a[0, 1], a[0, 15] = 0x7F, 0x80, 0x19
    # elements: 0 <- 0xF = -1, 1 <- 0x7 = 7, 2 <- 0x0 = 0, 3 <- 0x8 = -8, ..., 30 <- 0x9 = -7, 31 <- 0x1 = 1
    want = [0.0] * 32
    want[0], want[1], want[3], want[30], want[31] = -1, 7, -8, -7, 1
    b = torch.zeros(16, 32, dtype=torch.uint8)         # B (32, 32) = the identity, packed along K
    for n in range(32):
        b[n // 2, n] = 0x01 if n % 2 == 0 else 0x10
    a, b, one = a.to(DEVICE), b.to(DEVICE), torch.ones(1, device=DEVICE)
    y = gemm.int4_mm(a, b, one, one, out_dtype=torch.float32, lane=lane)
    assert y.tolist() == [want]
    # int8 bytes are the same bits
    assert torch.equal(gemm.int4_mm(a.view(torch.int8), b.view(torch.int8), one, one, torch.float32, lane=lane), y)


@pytest.mark.parametrize("lane", LANES)
def test_w4a8_qweight_low_nibble_first_codes_minus_eight(lane):
    qweight = torch.full((2, 16), 0x88, dtype=torch.uint8)     # W (2, 32): every code 8, weight 0
    qweight[0, 0], qweight[0, 1] = 0x2F, 0x90     # codes 15, 2, 0, 9: weights 7, -6, -8, 1
    qweight[1, 15] = 0x3C                         # codes 12, 3 at K 30, 31: weights 4, -5
    x = torch.zeros(6, 32, dtype=torch.bfloat16)
    for row, k in enumerate([0, 1, 2, 3, 30, 31]):
        x[row, k] = 1
    ones = torch.ones(2, 1, dtype=torch.float32, device=DEVICE)
    y = gemm.w4a8_linear(x.to(DEVICE), qweight.to(DEVICE), ones, torch.ones(2, device=DEVICE), group_size=32,
                         lane=lane)
    assert y.float().tolist() == [[7, 0], [-6, 0], [-8, 0], [1, 0], [0, 4], [0, -5]]


# ---- quantize_w4a8: the modes ----

def _effective(scales, channel):
    return channel[:, None] * scales.float()


def test_a_more_negative_peak_does_not_widen_the_scale():
    # mode 2: a group lying wholly below 0 keeps its own range: (max - min) / 15, not (0 - min) / 15
    w = torch.linspace(-1.0, -0.25, 32).reshape(1, 32)
    qw, s, ch, corr = quant.quantize_w4a8(w, mode=2, group_size=32, scale_dtype=torch.float32)
    e = _effective(s, ch)
    assert torch.allclose(e, torch.tensor([[0.05]]), rtol=1e-6)
    W = ref.w4a8_weight(qw, s, ch, corr, 32)
    assert W.min() >= -1.0 - 1e-6 and W.max() <= -0.25 + 1e-6 and (W - w).abs().max() <= 0.025 + 1e-6
    # modes 0 and 1: abs-max / 7 whichever sign the peak has; the negative peak's code is -7, not -8
    for peak in (-1.0, 1.0):
        w = torch.zeros(1, 32)
        w[0, 3], w[0, 9] = peak, -0.5 * peak
        for mode in (0, 1):
            qw, s, ch, corr = quant.quantize_w4a8(w, mode=mode, group_size=32, scale_dtype=torch.float32)
            assert corr is None
            assert _effective(s, ch).item() == pytest.approx(1 / 7, rel=1e-6)
            assert quant.unpack_int4(qw)[0, 3].item() - 8 == (7 if peak > 0 else -7)


@pytest.mark.parametrize("mode", [1, 2])
def test_codes_and_correction_come_from_the_stored_e4m3_scale(mode):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 128, generator=g) * 0.02 + (0.01 if mode == 2 else 0.0)
    qw, s, ch, corr = quant.quantize_w4a8(w, mode=mode, group_size=32, scale_dtype=E4M3)
    assert s.dtype == E4M3 and ch.dtype == torch.float32
    e = _effective(s, ch)                                  # the stored scale, in fp32
    codes = quant.unpack_int4(qw).to(torch.float32).reshape(64, 4, 32)
    wg = w.reshape(64, 4, 32)
    if mode == 2:
        lo = wg.amin(-1)
        want = torch.round((wg - lo[..., None]) / e[..., None]).clamp(0, 15)
        span = (wg.amax(-1) - lo) / 15
        unrounded = torch.round((wg - lo[..., None]) / span[..., None]).clamp(0, 15)
        assert torch.equal(corr, lo + 8 * e)                # the correction from the stored scale too
    else:
        want = torch.round(wg / e[..., None]).clamp(-8, 7) + 8
        span = wg.abs().amax(-1) / 7
        unrounded = torch.round(wg / span[..., None]).clamp(-8, 7) + 8
    assert torch.equal(codes, want)
    assert not torch.equal(codes, unrounded)               # the rounding of the scale moved some codes
    assert not torch.equal(e, span)


@pytest.mark.parametrize("mode, scale_dtype", [(0, torch.float32), (1, torch.float32), (2, torch.float32),
                                               (0, torch.float16), (1, E4M3), (2, E4M3)])
def test_dequantized_weight_is_within_half_a_step(mode, scale_dtype):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(16, 96, generator=g) * 0.02
    qw, s, ch, corr = quant.quantize_w4a8(w, mode=mode, group_size=32, scale_dtype=scale_dtype)
    W = ref.w4a8_weight(qw, s, ch, corr, 32)
    e = _effective(s, ch).double().repeat_interleave(32, 1)
    # half a step of the stored scale; where e4m3 or fp16 rounded the scale down, the peak
    # clamps to the last code: at most 1/16 of the span (e4m3's relative step) more
    slack = 0.5 if scale_dtype == torch.float32 else 0.5 + 8 / 16
    assert ((W - w.double()).abs() <= e * slack + 1e-7).all()


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_an_all_zero_weight_row_gives_zero_not_nan(mode, lane):
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(2)) * 0.02
    w[3] = 0
    sd = torch.float16 if mode == 0 else E4M3
    qw, s, ch, corr = quant.quantize_w4a8(w.to(DEVICE), mode=mode, group_size=32, scale_dtype=sd)
    assert not torch.isnan(s.float()).any() and s[3].float().eq(0).all()
    assert ch[3] == (1 if mode == 0 else 0)
    assert (quant.unpack_int4(qw)[3] == (0 if mode == 2 else 8)).all()
    x = torch.randn(5, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    x[0, 7] = 3e38                 # a huge activation times a zero weight still gives 0
    bias = torch.randn(8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    y = gemm.w4a8_linear(x.to(DEVICE), qw, s, ch, corr, group_size=32, bias=bias, lane=lane)
    assert not torch.isnan(y).any()
    assert torch.equal(y[:, 3], bias[3].expand(5))


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("mode", [1, 2])
def test_the_last_groups_scale_the_largest_is_applied_to_the_last_group_only(mode, lane):
    K, N, group = 128, 16, 32
    g = torch.Generator().manual_seed(11)
    w = torch.randn(N, K, generator=g) * 0.01
    w[:, -group:] *= 16
    qw, s, ch, corr = quant.quantize_w4a8(w.to(DEVICE), mode=mode, group_size=group, scale_dtype=E4M3)
    assert (s[:, -1].float() == 448).all() and (s[:, :-1].float() < 448).all()
    W = ref.w4a8_weight(qw, s, ch, corr, group)
    for cols in (slice(K - group, K), slice(0, group)):     # only the last group's, then the first's
        x = torch.zeros(3, K, dtype=torch.bfloat16, device=DEVICE)
        x[:, cols] = torch.randn(3, group, generator=g).bfloat16().to(DEVICE)
        with poisoned_outputs():
            y = gemm.w4a8_linear(x, qw, s, ch, corr, group_size=group, lane=lane)
        want = ref.w4a8_linear(upcast(x), qw, s, ch, corr, group)
        assert_close(y, want, greg.GEMM)
        xq, xs = ref.quantize_int8_rows(x)
        assert torch.allclose(want, (xq.double() * xs.double()[:, None])[:, cols] @ W[:, cols].t())


def _w4a8(mode, M, K, N, group, name, **kw):
    sd = torch.float16 if mode == 0 else E4M3
    return greg.w4a8_case(name, DEVICE, lead=(M,), K=K, N=N, group=group, mode=mode, scale_dtype=sd, bias=True,
                          **kw).kwargs


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("M, K, group", [(1, 256, 128), (17, 256, 64), (3, 32, 32)],
                         ids=["M1 (decode)", "M17", "K32 (one atom)"])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_public_w4a8_linear_at_the_issues_shapes(mode, M, K, group, lane):
    kw = _w4a8(mode, M, K, 24, group, f"w4a8 {mode} {M} {K}")
    with poisoned_outputs():
        y = gemm.w4a8_linear(**kw, lane=lane)
    assert y.shape == (M, 24) and y.dtype == torch.bfloat16
    assert_close(y, ref.w4a8_linear(**{k: upcast(v) for k, v in kw.items()}), greg.GEMM)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("M, K", [(1, 64), (17, 96), (3, 32)], ids=["M1 (decode)", "M17", "K32 (one atom)"])
def test_public_int4_mm_at_the_issues_shapes(M, K, lane):
    kw = greg.int4_case(f"int4 {M} {K}", DEVICE, M=M, K=K, N=24, bias=True).kwargs
    with poisoned_outputs():
        y = gemm.int4_mm(kw["a"], kw["b"], kw["scale_a"], kw["scale_b"], bias=kw["bias"], lane=lane)
    assert y.shape == (M, 24) and y.dtype == torch.bfloat16
    assert_close(y, ref.int4_mm(**{k: upcast(v) for k, v in kw.items()}), greg.GEMM)


def test_int4_mm_is_exact_in_int32():
    g = torch.Generator().manual_seed(9)
    a = torch.randint(0, 256, (5, 64), generator=g, dtype=torch.uint8)        # K = 128
    b = torch.randint(0, 256, (64, 7), generator=g, dtype=torch.uint8)
    one = torch.ones(1, device=DEVICE)
    y = gemm.int4_mm(a.to(DEVICE), b.to(DEVICE), one, one, torch.float32, lane="triton")
    A, B = ref.int4_values(a, 1).to(torch.int64), ref.int4_values(b, 0).to(torch.int64)     # int64 @: on the CPU
    assert torch.equal(y.cpu(), (A @ B).to(torch.float32))


def test_w4a8_per_channel_group_minus_one_is_one_group_of_k():
    kw = _w4a8(1, 5, 64, 16, 64, "per channel")
    assert torch.equal(gemm.w4a8_linear(**{**kw, "group_size": -1}), gemm.w4a8_linear(**kw))


@pytest.mark.parametrize("lane", LANES)
def test_k_zero_with_group_minus_one_quantizes_and_multiplies_to_zeros_plus_bias(lane):
    # quantize_w4a8 refused it ("expected a multiple of 32 dividing K = 0 (or -1), got -1") where
    # w4a8_linear takes it
    qweight, scales, channel, _ = quant.quantize_w4a8(torch.randn(8, 0, device=DEVICE), mode=1, group_size=-1)
    assert qweight.shape == (8, 0) and scales.shape == (8, 0) and channel.shape == (8,)
    bias = torch.randn(8, dtype=torch.bfloat16).to(DEVICE)
    y = gemm.w4a8_linear(torch.randn(3, 0, dtype=torch.bfloat16, device=DEVICE), qweight, scales, channel, None,
                         -1, bias, lane=lane)
    assert torch.equal(y, bias.expand(3, 8))


def test_w4a8_linear_agrees_with_w8a8_on_the_int8_weights_it_holds():
    """Mode 0 with one group and fp32 scales is a per-channel int8 weight with codes in -8..7:
    w4a8_linear and w8a8_linear then compute the same thing."""
    kw = _w4a8(0, 6, 64, 16, 64, "as w8a8")
    codes = quant.unpack_int4(kw["qweight"]).to(torch.int8) - 8
    s = kw["scales"].float().reshape(-1)
    y = gemm.w4a8_linear(kw["x"], kw["qweight"], kw["scales"].float(), kw["channel_scale"], group_size=64)
    assert_close(y, ref.w8a8_linear(upcast(kw["x"]), codes, s.double()), greg.GEMM)


# ---- hostile inputs: a TypeError or ValueError naming the argument, nothing launched ----

@pytest.fixture
def no_launch(monkeypatch):
    from lanekit.gemm import kernels
    from lanekit.gemm.kernels import w4a8

    def refuse(*a, **k):
        raise AssertionError("launched on bad input")

    monkeypatch.setattr(w4a8, "launch", refuse)
    monkeypatch.setattr(kernels, "quant_rows", refuse)       # the activations' quantize pass


def _good():
    return dict(_w4a8(2, 4, 64, 16, 32, "good"))


@pytest.mark.parametrize("change, error, match", [
    (dict(x=torch.zeros(4, 64, dtype=torch.int8)), TypeError, "x:"),
    (dict(qweight=torch.zeros(16, 32, dtype=torch.int8)), TypeError, "qweight"),
    (dict(qweight=torch.zeros(16, 64, dtype=torch.uint8)), ValueError, "qweight"),
    (dict(group_size=48), ValueError, "group_size"),
    (dict(group_size=16, scales=torch.ones(16, 4)), ValueError, "group_size: expected a multiple of 32"),
    (dict(group_size=32.0), TypeError, "group_size"),
    (dict(scales=torch.ones(16, 2, dtype=torch.int32)), TypeError, "scales"),
    (dict(scales=torch.ones(16, 1)), ValueError, "scales"),
    (dict(channel_scale=torch.ones(16, dtype=torch.float16)), TypeError, "channel_scale"),
    (dict(channel_scale=torch.ones(15)), ValueError, "channel_scale"),
    (dict(correction=torch.ones(16, 2, dtype=torch.float16)), TypeError, "correction"),
    (dict(correction=torch.ones(2, 16)), ValueError, "correction"),
    (dict(bias=torch.ones(15, dtype=torch.bfloat16)), ValueError, "bias"),
    (dict(bias=torch.ones(16, dtype=torch.float16)), TypeError, "bias"),
    (dict(scales=torch.ones(16, 2, device="meta")), ValueError, "scales"),
])
def test_w4a8_linear_rejects(change, error, match, no_launch):
    kw = _good()
    kw.update(on_device(change, DEVICE))
    with pytest.raises(error, match=match):
        gemm.w4a8_linear(**kw, lane="triton")


def test_w4a8_k_not_a_multiple_of_group_size_is_refused_not_padded(no_launch):
    kw = _w4a8(1, 2, 96, 16, 32, "K96")
    with pytest.raises(ValueError, match="group_size 64 with K = 96"):
        gemm.w4a8_linear(**{**kw, "group_size": 64, "scales": kw["scales"][:, :1], "correction": None},
                         lane="triton")


@pytest.mark.parametrize("change, error, match", [
    (dict(a=torch.zeros(4, 24, dtype=torch.uint8)), ValueError, "multiple of 32"),
    (dict(a=torch.zeros(4, 8, dtype=torch.uint8), b=torch.zeros(8, 6, dtype=torch.uint8)), ValueError,
     r"a: expected K = 2 \* a.shape\[1\] a multiple of 32 \(two int4 codes a byte\), got a \(4, 8\), "
     "K = 16"),
    (dict(a=torch.zeros(4, 16, dtype=torch.int32)), TypeError, "a:"),
    (dict(b=torch.zeros(16, 6, dtype=torch.float16)), TypeError, "b:"),
    (dict(b=torch.zeros(32, 6, dtype=torch.uint8)), ValueError, "b:"),
    (dict(scale_a=torch.ones(3, 1)), ValueError, "scale_a"),
    (dict(scale_b=torch.ones(1, 6, dtype=torch.float16)), TypeError, "scale_b"),
    (dict(out_dtype=torch.int32), TypeError, "out_dtype"),
    (dict(bias=torch.ones(5, dtype=torch.bfloat16)), ValueError, "bias"),
])
def test_int4_mm_rejects(change, error, match, no_launch):
    kw = on_device(dict(a=torch.zeros(4, 16, dtype=torch.uint8), b=torch.zeros(16, 6, dtype=torch.uint8),
                        scale_a=torch.ones(4, 1), scale_b=torch.ones(1, 6)), DEVICE)
    kw.update(on_device(change, DEVICE))
    with pytest.raises(error, match=match):
        gemm.int4_mm(**kw, lane="triton")


@pytest.mark.parametrize("call, error, match", [
    (lambda w: quant.quantize_w4a8(w, mode=3), ValueError, "mode"),
    (lambda w: quant.quantize_w4a8(w, mode=1.0), TypeError, "mode"),
    (lambda w: quant.quantize_w4a8(w, mode=True), TypeError, "mode"),
    (lambda w: quant.quantize_w4a8(w, mode=0), ValueError, "scale_dtype"),      # e4m3 default
    (lambda w: quant.quantize_w4a8(w, scale_dtype=torch.int8), TypeError, "scale_dtype"),
    (lambda w: quant.quantize_w4a8(w, group_size=48), ValueError, "group_size"),
    (lambda w: quant.quantize_w4a8(w, group_size=16), ValueError, "group_size"),
    (lambda w: quant.quantize_w4a8(w, group_size="32"), TypeError, "group_size"),
    (lambda w: quant.quantize_w4a8(w.to(torch.int32)), TypeError, "w:"),
    (lambda w: quant.quantize_w4a8(w[0]), ValueError, "w:"),
    (lambda w: quant.quantize_w4a8(torch.where(w > 0, w, float("nan")), group_size=32), ValueError,
     "w: expected finite"),
])
def test_quantize_w4a8_rejects(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(8, 64))


def test_custom_ops_pass_torch_library_opcheck():
    """The fake (meta) functions and schemas are right: what torch.compile relies on."""
    # fp16 scales: opcheck's schema test multiplies the arguments, which e4m3 does not take on a CPU
    kw = greg.w4a8_case("opcheck", DEVICE, lead=(3,), K=64, N=16, mode=2, scale_dtype=torch.float16,
                        bias=True).kwargs
    codes, s = ref.quantize_int8_rows(kw["x"])
    torch.library.opcheck(gop._w4a8_op, (codes, s, kw["qweight"], kw["scales"], kw["channel_scale"],
                                         kw["correction"], kw["bias"], 32, torch.bfloat16))
    m = greg.int4_case("opcheck", DEVICE, M=3, K=64, N=16, bias=True).kwargs
    torch.library.opcheck(gop._int4_mm_op, (m["a"], m["b"], m["scale_a"].reshape(-1),
                                            m["scale_b"].reshape(-1), m["bias"], torch.bfloat16))


# ---- quantize_linears(model, "w4a8") ----

def _mlp(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 40, bias=False))
    for m in model:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
    return model.to(dtype).to(DEVICE).eval()


@pytest.mark.parametrize("lane", LANES)
def test_quantize_linears_w4a8_matches_the_float64_path(lane):
    x = torch.randn(17, 64, generator=torch.Generator().manual_seed(1)).bfloat16().to(DEVICE)
    model = _mlp(torch.bfloat16)
    with torch.no_grad():
        want_float = model(x).float()
        quantize_linears(model, "w4a8", lane=lane)
        got = model(x)
    first, second = model[0], model[2]
    assert isinstance(first, QuantizedLinear) and isinstance(second, QuantizedLinear)
    assert first.scheme == "w4a8" and first.scales.dtype == E4M3 and first.group_size == 64
    assert second.group_size == 32          # K = 96: the largest of 128, 64, 32 dividing it
    # each layer against the float64 oracle on the same input
    h = first(x)
    assert_close(h, ref.w4a8_linear(upcast(x), first.weight, first.scales, first.channel_scale,
                                    None, first.group_size, upcast(first.bias)), greg.GEMM)
    h = torch.relu(h)
    assert_close(got, ref.w4a8_linear(upcast(h), second.weight, second.scales, second.channel_scale, None,
                                      second.group_size, None), greg.GEMM)
    cos = nn.functional.cosine_similarity(got.float().reshape(-1), want_float.reshape(-1), dim=0).item()
    assert cos >= 0.99, f"w4a8: cosine {cos:.5f} to the bf16 model"


def test_quantize_linears_w4a8_refuses_k_not_a_multiple_of_32_before_any_swap():
    model = nn.Sequential(nn.Linear(64, 8), nn.Linear(8, 4))
    with pytest.raises(ValueError, match="w4a8"):
        quantize_linears(model, "w4a8")
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], nn.Linear)


@pytest.mark.parametrize("lane", LANES)
def test_every_e4m3_scale_byte_decodes_exactly(lane):
    """The kernel decodes e4m3 scales from their bits (no fp8 type on sm80 or gfx942): every byte,
    subnormals and negatives included, gives torch's value; 0x7F and 0xFF give NaN."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    scales = bits.view(E4M3).reshape(256, 1)
    qweight = torch.full((256, 16), 0x88, dtype=torch.uint8)
    qweight[:, 0] = 0x89                          # element 0: code 9, weight 1 * scale
    x = torch.zeros(1, 32)
    x[0, 0] = 127.0                               # its int8 code 127, scale 1
    y = gemm.w4a8_linear(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), torch.ones(256, device=DEVICE),
                         group_size=32, lane=lane).cpu()
    want = scales.float().reshape(1, 256) * 127
    nan = torch.isnan(want)
    assert nan.sum() == 2 and torch.isnan(y[nan]).all()
    assert torch.equal(y[~nan], want[~nan])


@pytest.mark.parametrize("lane", LANES)
def test_strided_scales_correction_and_bias_are_read_through_their_strides(lane):
    kw = _w4a8(2, 5, 64, 24, 32, "strided")
    want = ref.w4a8_linear(**{k: upcast(v) for k, v in kw.items()})
    wide = lambda t: torch.stack([t, torch.full_like(t, 100)], -1).select(-1, 0)     # every other element
    strided = {**kw, "channel_scale": wide(kw["channel_scale"]), "bias": wide(kw["bias"]),
               "scales": wide(kw["scales"]), "correction": wide(kw["correction"])}
    assert not strided["channel_scale"].is_contiguous() and not strided["bias"].is_contiguous()
    assert_close(gemm.w4a8_linear(**strided, lane=lane), want, greg.GEMM)
    m = greg.int4_case("strided", DEVICE, M=5, K=64, N=24, bias=True).kwargs
    sb = torch.stack([m["scale_b"], m["scale_b"]], -1).select(-1, 0)
    bias = torch.stack([m["bias"], m["bias"] * 0 + 1e4], -1).select(-1, 0)
    y = gemm.int4_mm(m["a"], m["b"], m["scale_a"], sb, bias=bias, lane=lane)
    assert_close(y, ref.int4_mm(**{k: upcast(v) for k, v in m.items()}), greg.GEMM)
