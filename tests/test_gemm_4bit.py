"""4-bit weights (issue 33, part A): w4a16_linear in AWQ's and GPTQ's layouts, mxfp4_linear in
gpt-oss's, and pack_int4 / unpack_int4, against their oracles (lanekit.reference.gemm) on the
Triton lane (interpreted on the CPU) and the reference lane. The issue's cases are each a test:
the last group's scale the largest, an all-zero weight row with scale 0, K = 32, M = 1 and
M = 17, and the nibble order checked against hand-packed tensors."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from lanekit import gemm, quant
from lanekit.common.numerics import e2m1_in
from lanekit.families import get_op
from lanekit.gemm import op as gop
from lanekit.gemm import registry as greg
from lanekit.gemm.kernels.weight_only import _small_ints
from lanekit.reference import gemm as ref
from lanekit.reference.numerics import e2m1
from lanekit.runtime import errors
from lanekit.testing import assert_close, on_device, poisoned_outputs, registered_cases, upcast

OPS = ["w4a16_linear", "mxfp4_linear"]
LANES = ["triton", "reference"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("name, sample", registered_cases(map(get_op, OPS), DEVICE))
def test_registered_samples_match_the_oracle(name, sample, lane):
    op = get_op(name)
    want = op.reference()(**{k: upcast(v) for k, v in sample.kwargs.items()})
    with poisoned_outputs():
        out = op.lane(lane)(**sample.kwargs)
    assert_close(out, want, greg.GEMM)


# ---- the dequantization's 16-bit arithmetic ----

@triton.jit
def _small_ints_kernel(Q, Z, OUT, DTYPE: tl.constexpr):
    i = tl.arange(0, 512)
    m = i < 17 * 16
    tl.store(OUT + i, _small_ints(tl.load(Q + i, mask=m, other=0), tl.load(Z + i, mask=m, other=0), DTYPE), mask=m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_code_minus_zero_is_exact_in_16_bits_for_every_code_and_zero(dtype):
    """weight_only._small_ints builds q - z from bit patterns and a 16-bit subtraction (no int-to-
    float conversion): every code 0..15 against every zero point 0..16, in each activation dtype."""
    q = torch.arange(16, dtype=torch.int32, device=DEVICE).repeat(17)
    z = torch.arange(17, dtype=torch.int32, device=DEVICE).repeat_interleave(16)
    out = torch.full((17 * 16,), float("nan"), dtype=dtype, device=DEVICE)
    _small_ints_kernel[(1,)](q, z, out, tl.bfloat16 if dtype == torch.bfloat16 else tl.float16)
    assert torch.equal(out.float().cpu(), (q - z).float().cpu())


@triton.jit
def _e2m1_kernel(CODES, OUT, DTYPE: tl.constexpr):
    i = tl.arange(0, 16)
    tl.store(OUT + i, e2m1_in(tl.load(CODES + i), DTYPE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_e2m1_codes_built_from_their_bits_are_the_reference_values(dtype):
    """numerics.e2m1_in (the MXFP4 operands' dequantization, integer operations only): all 16 codes,
    the subnormal 0.5 and the sign of -0 (code 8) included."""
    codes = torch.arange(16, dtype=torch.int32, device=DEVICE)
    out = torch.full((16,), float("nan"), dtype=dtype, device=DEVICE)
    _e2m1_kernel[(1,)](codes, out, {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(dtype, tl.float32))
    want = e2m1(codes.cpu()).to(torch.float64)
    assert torch.equal(out.cpu().double(), want) and torch.equal(out.cpu().double().signbit(), want.signbit())


# ---- the nibble order, against tensors packed by hand ----

WORD = 0x1234ABCD       # nibbles, bits 0-3 first: D C B A 4 3 2 1 = 13 12 11 10 4 3 2 1
SEQUENTIAL = [13, 12, 11, 10, 4, 3, 2, 1]
AWQ = [13, 4, 12, 3, 11, 2, 10, 1]     # column j in nibble (0, 4, 1, 5, 2, 6, 3, 7)[j]


def _word(v=WORD):
    return torch.tensor([v], dtype=torch.int64).to(torch.int32)


def test_unpack_int4_nibble_order_written_out():
    assert quant.unpack_int4(_word()).tolist() == SEQUENTIAL
    assert quant.unpack_int4(_word(), order="awq").tolist() == AWQ
    # uint8: element 2i in the low nibble (gpt-oss's blocks)
    assert quant.unpack_int4(torch.tensor([0x2F, 0x90], dtype=torch.uint8)).tolist() == [15, 2, 0, 9]
    # the sign bit of the int32 is nibble 7's high bit: 0xF0000000 reads -268435456
    assert quant.unpack_int4(_word(0xF0000000)).tolist() == [0] * 7 + [15]


def test_pack_int4_writes_the_hand_packed_words():
    assert quant.pack_int4(torch.tensor(SEQUENTIAL)).tolist() == _word().tolist()
    assert quant.pack_int4(torch.tensor(AWQ), order="awq").tolist() == _word().tolist()
    # AutoAWQ's packing map fills nibble i with column (0, 2, 4, 6, 1, 3, 5, 7)[i]
    assert quant.pack_int4(torch.arange(8), order="awq").item() == 0x75316420
    assert quant.pack_int4(torch.full((8,), 15)).item() == -1
    assert quant.pack_int4(torch.tensor([[15, 2, 0, 9]]), dtype=torch.uint8).tolist() == [[0x2F, 0x90]]


@pytest.mark.parametrize("order, dtype, dim", [("sequential", torch.int32, 0), ("sequential", torch.int32, 1),
                                                ("awq", torch.int32, 1), ("awq", torch.int32, 0),
                                                ("sequential", torch.uint8, 1), ("sequential", torch.uint8, 0)])
def test_pack_unpack_round_trip_exactly(order, dtype, dim):
    codes = torch.randint(0, 16, (24, 40), generator=torch.Generator().manual_seed(3))
    packed = quant.pack_int4(codes, dim, order, dtype)
    assert packed.dtype == dtype and packed.shape[dim] == codes.shape[dim] // (8 if dtype == torch.int32 else 2)
    assert torch.equal(quant.unpack_int4(packed, dim, order), codes.to(torch.uint8))
    assert torch.equal(quant.pack_int4(quant.unpack_int4(packed, dim, order), dim, order, dtype), packed)


@pytest.mark.parametrize("lane", LANES)
def test_awq_layout_puts_column_j_in_nibble_awq_order(lane):
    # qweight (K, N / 8) = (32, 1): every row the hand-packed word; no zeros (8), scales 1
    qweight = _word().repeat(32, 1).to(DEVICE)
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    x[0, 0], x[1, 31] = 1, 2
    y = gemm.w4a16_linear(x.to(DEVICE), qweight, torch.ones(1, 8, dtype=torch.float16, device=DEVICE),
                          group_size=32, lane=lane)
    want = torch.tensor(AWQ, dtype=torch.float32) - 8
    assert torch.equal(y.float().cpu(), torch.stack([want, 2 * want]))


@pytest.mark.parametrize("lane", LANES)
def test_gptq_layout_puts_row_8e_plus_j_of_k_in_nibble_j_and_zeros_stored_minus_one(lane):
    # qweight (K / 8, N) = (4, 8): column 0 of the first word the hand-packed word, the rest 0;
    # qzeros (1, 1): column 0 stores 7 (zero 8), column 1 stores 15 (zero 16), the others 0 (zero 1)
    qweight = torch.zeros(4, 8, dtype=torch.int32)
    qweight[0, 0] = _word().item()
    qzeros = _word(0x000000F7).reshape(1, 1)
    x = torch.eye(32, dtype=torch.bfloat16)[:8]       # x row k picks W's row k
    y = gemm.w4a16_linear(x.to(DEVICE), qweight.to(DEVICE), torch.ones(1, 8, dtype=torch.float16, device=DEVICE),
                          qzeros.to(DEVICE), group_size=32, layout="gptq", lane=lane)
    assert y[:, 0].float().tolist() == [v - 8 for v in SEQUENTIAL]
    assert y[:, 1].float().tolist() == [-16.0] * 8
    assert y[:, 2:].float().unique().tolist() == [-1.0]


@pytest.mark.parametrize("lane", LANES)
def test_mxfp4_low_nibble_is_the_first_element_and_e8m0_scales_by_powers_of_two(lane):
    w = torch.zeros(2, 16, dtype=torch.uint8)     # (N, K / 2): K = 32
    w[0, 0] = 0x2F          # element 0: code 15 = -6.0, element 1: code 2 = 1.0
    w[1, 15] = 0x7B         # element 30: code 11 = -1.5, element 31: code 7 = 6.0
    scale = torch.tensor([[128], [125]], dtype=torch.uint8)      # 2 and 1/4
    x = torch.zeros(3, 32, dtype=torch.bfloat16)
    x[0, 0], x[1, 1], x[2, 30], x[2, 31] = 1, 1, 1, 1
    y = gemm.mxfp4_linear(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), lane=lane)
    assert y.float().tolist() == [[-12.0, 0.0], [2.0, 0.0], [0.0, 4.5 / 4]]


# ---- the issue's cases ----

@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_the_last_groups_scale_the_largest_is_applied_to_the_last_group_only(layout, lane):
    K, N, group = 256, 16, 64
    g = torch.Generator().manual_seed(11)
    q = torch.randint(0, 16, (K, N), generator=g)
    s = torch.full((K // group, N), 0.01)
    s[-1] = 4.0
    dim, order = (1, "awq") if layout == "awq" else (0, "sequential")
    packed, scales = quant.pack_int4(q, dim, order).to(DEVICE), s.half().to(DEVICE)
    x = torch.zeros(1, K, dtype=torch.bfloat16, device=DEVICE)
    x[0, -group:] = 1          # only the last group's rows of K
    y = gemm.w4a16_linear(x, packed, scales, group_size=group, layout=layout, lane=lane)
    want = ((q[-group:] - 8) * 4.0).sum(0).float()
    assert torch.equal(y.float().cpu(), want.bfloat16().float().reshape(1, N))
    x[0] = 0
    x[0, 0] = 1                # the first row of K: the first group's scale
    y = gemm.w4a16_linear(x, packed, scales, group_size=group, layout=layout, lane=lane)
    assert_close(y, ((q[0] - 8) * torch.tensor(0.01).half().double()).reshape(1, N).to(DEVICE), greg.GEMM)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_an_all_zero_weight_row_with_scale_zero_gives_zero_not_nan(layout, lane):
    s = greg.w4_case("zero row", DEVICE, lead=(4,), K=128, N=16, group=32, layout=layout, zero_row=True,
                     bias=True)
    kw = dict(s.kwargs)
    kw["x"] = kw["x"].clone()
    kw["x"][0, 5] = 1e30        # a large activation times scale 0 still gives 0
    y = gemm.w4a16_linear(**kw, lane=lane)
    assert not torch.isnan(y).any()
    assert torch.equal(y[:, 0], kw["bias"][0].expand(4))


@pytest.mark.parametrize("lane", LANES)
def test_mxfp4_all_zero_row_gives_zero_not_nan(lane):
    kw = greg.mxfp4_case("zero row", DEVICE, lead=(4,), K=64, N=8, zero_row=True).kwargs
    y = gemm.mxfp4_linear(kw["x"], kw["w_fp4"], kw["w_scale"], lane=lane)
    assert not torch.isnan(y).any() and (y[:, 0] == 0).all()


def _w4(layout, M, K, N, group, name):
    s = greg.w4_case(name, DEVICE, lead=(M,), K=K, N=N, group=group, layout=layout, bias=True)
    return s.kwargs


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("M, K, group", [(1, 256, 128), (17, 256, 128), (3, 32, 32)],
                         ids=["M1 (decode)", "M17", "K32 (one atom)"])
@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_public_w4a16_linear_at_the_issues_shapes(layout, M, K, group, lane):
    kw = _w4(layout, M, K, 24, group, f"{layout} {M} {K}")
    with poisoned_outputs():
        y = gemm.w4a16_linear(**kw, lane=lane)
    assert y.shape == (M, 24) and y.dtype == torch.bfloat16
    assert_close(y, ref.w4a16_linear(**{k: upcast(v) for k, v in kw.items()}), greg.GEMM)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("M, K", [(1, 64), (17, 96), (3, 32)], ids=["M1 (decode)", "M17", "K32 (one block)"])
def test_public_mxfp4_linear_at_the_issues_shapes(M, K, lane):
    kw = greg.mxfp4_case(f"mx {M} {K}", DEVICE, lead=(M,), K=K, N=24, bias=True).kwargs
    w, s = kw["w_fp4"], kw["w_scale"]
    with poisoned_outputs():
        y = gemm.mxfp4_linear(kw["x"], w, s, kw["bias"], lane=lane)
    assert_close(y, ref.mxfp4_linear(upcast(kw["x"]), w, s, upcast(kw["bias"])), greg.GEMM)


def test_mxfp4_takes_gpt_oss_blocks_and_e8m0_dtype():
    kw = greg.mxfp4_case("blocks", DEVICE, lead=(5,), K=96, N=8).kwargs
    x, w, s = kw["x"], kw["w_fp4"], kw["w_scale"]
    flat = gemm.mxfp4_linear(x, w, s)
    assert torch.equal(gemm.mxfp4_linear(x, w.reshape(8, 3, 16), s), flat)
    if hasattr(torch, "float8_e8m0fnu"):
        assert torch.equal(gemm.mxfp4_linear(x, w, s.view(torch.float8_e8m0fnu)), flat)


@pytest.mark.parametrize("lane", LANES)
def test_mxfp4_nan_scale_makes_its_column_nan_and_no_other(lane):
    kw = greg.mxfp4_case("nan", DEVICE, lead=(3,), K=64, N=6).kwargs
    kw["w_scale"] = kw["w_scale"].clone()
    kw["w_scale"][2, 1] = 255
    y = gemm.mxfp4_linear(kw["x"], kw["w_fp4"], kw["w_scale"], lane=lane)
    assert torch.isnan(y[:, 2]).all() and not torch.isnan(y[:, [0, 1, 3, 4, 5]]).any()


def test_per_channel_group_minus_one_is_one_group_of_k():
    kw = _w4("awq", 5, 100, 16, 100, "per channel")
    y = gemm.w4a16_linear(**{**kw, "group_size": -1})
    assert torch.equal(y, gemm.w4a16_linear(**kw))


def test_act_order_g_idx_in_order_equals_no_g_idx():
    kw = _w4("gptq", 6, 128, 16, 32, "g_idx in order")
    y = gemm.w4a16_linear(**{**kw, "g_idx": torch.arange(128, dtype=torch.int32, device=DEVICE) // 32}, lane="triton")
    assert_close(y, ref.w4a16_linear(**{k: upcast(v) for k, v in kw.items()}), greg.GEMM)


def test_a_g_idx_out_of_range_on_the_kernel_is_masked_and_recorded():
    kw = greg.w4_case("bad g_idx", DEVICE, lead=(2,), K=64, N=16, group=32, layout="gptq", g_idx=True).kwargs
    bad = kw["g_idx"].clone()
    bad[5] = 7
    y = gop.w4a16_linear_triton(**{**kw, "g_idx": bad})        # the lane, past the api's host check
    x = kw["x"].clone()
    x[:, 5] = 0               # the row the kernel left out
    assert_close(y, ref.w4a16_linear(**{k: upcast(v) for k, v in {**kw, "x": x}.items()}), greg.GEMM)
    with pytest.raises(ValueError, match="g_idx"):
        errors.check_errors()


# ---- hostile inputs: a TypeError or ValueError naming the argument, nothing launched ----

@pytest.fixture
def no_launch(monkeypatch):
    from lanekit.gemm.kernels import weight_only

    def refuse(*a, **k):
        raise AssertionError("launched on bad input")

    monkeypatch.setattr(weight_only, "launch", refuse)


def _good(layout="awq"):
    return dict(_w4(layout, 4, 64, 16, 32, f"good {layout}"))


@pytest.mark.parametrize("change, error, match", [
    (dict(x=torch.zeros(4, 64)), TypeError, "x:"),
    (dict(qweight=torch.zeros(64, 2, dtype=torch.int64)), TypeError, "qweight"),
    (dict(qweight=torch.zeros(63, 2, dtype=torch.int32)), ValueError, "qweight"),
    (dict(layout="marlin"), ValueError, "layout"),
    (dict(group_size=48), ValueError, "group_size: expected a divisor of K"),
    (dict(group_size=0), ValueError, "group_size"),
    (dict(group_size=32.0), TypeError, "group_size"),
    (dict(scales=torch.ones(2, 16, dtype=torch.int32)), TypeError, "scales"),
    (dict(scales=torch.ones(1, 16, dtype=torch.float16)), ValueError, "scales"),
    (dict(zeros=torch.zeros(2, 1, dtype=torch.int16)), TypeError, "zeros"),
    (dict(zeros=torch.zeros(2, 1, dtype=torch.int32)), ValueError, "zeros"),
    (dict(bias=torch.ones(15, dtype=torch.bfloat16)), ValueError, "bias"),
    (dict(bias=torch.ones(16, dtype=torch.float16)), TypeError, "bias"),
    (dict(g_idx=torch.zeros(64, dtype=torch.int32)), ValueError, "g_idx"),
    (dict(scales=torch.ones(2, 16, dtype=torch.float16, device="meta")), ValueError, "scales"),
])
def test_w4a16_linear_rejects(change, error, match, no_launch):
    kw = _good()
    kw.update(on_device(change, DEVICE))
    with pytest.raises(error, match=match):
        gemm.w4a16_linear(**kw, lane="triton")


@pytest.mark.parametrize("change, error, match", [
    (dict(qweight=torch.zeros(7, 16, dtype=torch.int32)), ValueError, "qweight"),
    (dict(g_idx=torch.zeros(63, dtype=torch.int32)), ValueError, "g_idx"),
    (dict(g_idx=torch.full((64,), 2, dtype=torch.int32)), ValueError, r"g_idx: expected groups in \[0, 2\)"),
    (dict(g_idx=torch.zeros(64)), TypeError, "g_idx"),
    (dict(group_size=4, scales=torch.ones(16, 16, dtype=torch.float16)), ValueError, "multiple of 8"),
])
def test_w4a16_linear_rejects_gptq(change, error, match, no_launch, monkeypatch):
    # g_idx's values are read on the host for CPU tensors or in the debug mode, which this asks for
    # (on a GPU the kernel masks a bad one and records it: test_a_g_idx_out_of_range_...)
    monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")
    kw = _good("gptq")
    kw.update(on_device(change, DEVICE))
    with pytest.raises(error, match=match):
        gemm.w4a16_linear(**kw, lane="triton")


def test_k_not_a_multiple_of_group_size_is_refused_not_padded(no_launch):
    kw = _w4("awq", 2, 96, 16, 32, "K96")
    with pytest.raises(ValueError, match="group_size 64 with K = 96"):
        gemm.w4a16_linear(**{**kw, "group_size": 64, "scales": kw["scales"][:2]}, lane="triton")


@pytest.mark.parametrize("change, error, match", [
    (dict(x=torch.zeros(4, 48, dtype=torch.bfloat16)), ValueError, "multiple of 32"),
    (dict(x=torch.zeros(4, 64, dtype=torch.float32)), TypeError, "x:"),
    (dict(w_fp4=torch.zeros(8, 32, dtype=torch.int8)), TypeError, "w_fp4"),
    (dict(w_fp4=torch.zeros(8, 64, dtype=torch.uint8)), ValueError, "w_fp4"),
    (dict(w_fp4=torch.zeros(8, 2, 32, dtype=torch.uint8)), ValueError, "w_fp4"),
    (dict(w_scale_e8m0=torch.zeros(8, 2)), TypeError, "w_scale_e8m0"),
    (dict(w_scale_e8m0=torch.zeros(8, 1, dtype=torch.uint8)), ValueError, "w_scale_e8m0"),
    (dict(bias=torch.ones(7, dtype=torch.bfloat16)), ValueError, "bias"),
])
def test_mxfp4_linear_rejects(change, error, match, no_launch):
    kw = dict(x=torch.zeros(4, 64, dtype=torch.bfloat16), w_fp4=torch.zeros(8, 32, dtype=torch.uint8),
              w_scale_e8m0=torch.full((8, 2), 127, dtype=torch.uint8))
    kw = on_device({**kw, **change}, DEVICE)
    with pytest.raises(error, match=match):
        gemm.mxfp4_linear(**kw, lane="triton")


@pytest.mark.parametrize("call, error, match", [
    (lambda: quant.pack_int4(torch.tensor([0, 16] + [0] * 6)), ValueError, "0..15"),
    (lambda: quant.pack_int4(torch.tensor([-1] + [0] * 7)), ValueError, "0..15"),
    (lambda: quant.pack_int4(torch.zeros(6, dtype=torch.int64)), ValueError, "multiple of 8"),
    (lambda: quant.pack_int4(torch.zeros(8)), TypeError, "codes"),
    (lambda: quant.pack_int4(torch.zeros(8, dtype=torch.int64), order="awq", dtype=torch.uint8), ValueError, "order"),
    (lambda: quant.pack_int4(torch.zeros(8, dtype=torch.int64), dtype=torch.int16), TypeError, "dtype"),
    (lambda: quant.pack_int4(torch.zeros(8, dtype=torch.int64), dim=1), ValueError, "dim"),
    (lambda: quant.unpack_int4(torch.zeros(8, dtype=torch.int64)), TypeError, "packed"),
    (lambda: quant.unpack_int4(torch.zeros(8, dtype=torch.int32), order="gptq"), ValueError, "order"),
])
def test_pack_int4_rejects(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_custom_ops_pass_torch_library_opcheck():
    """The fake (meta) functions and schemas are right: what torch.compile relies on."""
    kw = greg.w4_case("opcheck", DEVICE, lead=(3,), K=64, N=16, group=32, layout="gptq", g_idx=True,
                      bias=True).kwargs
    # with x and bias requiring grad: the registered autograd is checked too
    x, bias = kw["x"].detach().requires_grad_(), kw["bias"].detach().requires_grad_()
    torch.library.opcheck(gop._w4a16_op, (x, kw["qweight"], kw["scales"], kw["zeros"], kw["g_idx"], bias, 32,
                                          "gptq"))
    m = greg.mxfp4_case("opcheck", DEVICE, lead=(3,), K=64, N=16, bias=True).kwargs
    torch.library.opcheck(gop._mxfp4_op, (m["x"].detach().requires_grad_(), m["w_fp4"], m["w_scale"],
                                          m["bias"].detach().requires_grad_()))
    w = greg.linear_case("opcheck", DEVICE, lead=(3,), K=64, N=16, wdtype=torch.int8, bias=True).kwargs
    torch.library.opcheck(gop._w8a16_op, (w["x"].detach().requires_grad_(), w["weight"], w["weight_scale"],
                                          w["bias"].detach().requires_grad_()))


def _every_other(t, fill):
    """t's values as a view of every other element of a wider tensor (the rest ``fill``)."""
    return torch.stack([t, fill if isinstance(fill, torch.Tensor) else torch.full_like(t, fill)], -1).select(-1, 0)


@pytest.mark.parametrize("lane", LANES)
def test_strided_and_expanded_bias_and_g_idx_are_read_by_their_strides(lane):
    # the kernels read bias[n] at BIAS + n and g_idx[k] at G_IDX + k: a strided view was read as
    # contiguous (the neighbours' values) and an expanded one (stride 0) past its one element
    kw = greg.w4_case("strided g_idx bias", DEVICE, lead=(5,), K=128, N=24, group=32, layout="gptq", g_idx=True,
                      bias=True).kwargs
    want = ref.w4a16_linear(**{k: upcast(v) for k, v in kw.items()})
    strided = {**kw, "bias": _every_other(kw["bias"], 1e4), "g_idx": _every_other(kw["g_idx"], 3 - kw["g_idx"])}
    assert not strided["bias"].is_contiguous() and not strided["g_idx"].is_contiguous()
    with poisoned_outputs():
        assert_close(gemm.w4a16_linear(**strided, lane=lane), want, greg.GEMM)
    expanded = {**kw, "bias": torch.full((1,), 0.5, dtype=torch.bfloat16, device=DEVICE).expand(24),
                "g_idx": torch.full((1,), 2, dtype=torch.int32, device=DEVICE).expand(128)}
    with poisoned_outputs():
        y = gemm.w4a16_linear(**expanded, lane=lane)
    assert_close(y, ref.w4a16_linear(**{k: upcast(v) for k, v in expanded.items()}), greg.GEMM)
    mx = greg.mxfp4_case("strided bias", DEVICE, lead=(5,), K=64, N=24, bias=True).kwargs
    for bias in (_every_other(mx["bias"], 1e4), torch.full((1,), 0.5, dtype=torch.bfloat16, device=DEVICE).expand(24)):
        with poisoned_outputs():
            y = gemm.mxfp4_linear(mx["x"], mx["w_fp4"], mx["w_scale"], bias, lane=lane)
        assert_close(y, ref.mxfp4_linear(upcast(mx["x"]), mx["w_fp4"], mx["w_scale"], upcast(bias)), greg.GEMM)


# ---- the backward: differentiable in x and bias (QLoRA's adapters train beside frozen weights) ----

def _grads(fn, kw, dy):
    """(dx, dbias) of fn(**kw) with x and bias requiring grad, for the output gradient dy."""
    x, bias = kw["x"].detach().requires_grad_(), kw["bias"].detach().requires_grad_()
    with poisoned_outputs():
        return torch.autograd.grad(fn(**{**kw, "x": x, "bias": bias}), (x, bias), dy)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("op", ["w4a16 awq", "w4a16 gptq act-order", "mxfp4"])
def test_dx_and_dbias_match_the_float64_oracle(op, lane):
    if op == "mxfp4":
        kw = greg.mxfp4_case("grad", DEVICE, lead=(2, 3), K=96, N=24, bias=True).kwargs
        kw = {"x": kw["x"], "w_fp4": kw["w_fp4"], "w_scale_e8m0": kw["w_scale"], "bias": kw["bias"]}
        fn, oracle = gemm.mxfp4_linear, ref.mxfp4_linear
        ref_kw = {"w_fp4": kw["w_fp4"], "w_scale": kw["w_scale_e8m0"]}
    else:
        layout = op.split()[1]
        kw = dict(greg.w4_case("grad", DEVICE, lead=(2, 3), K=128, N=24, group=32, layout=layout,
                               g_idx="act-order" in op, bias=True).kwargs)
        fn, oracle = gemm.w4a16_linear, ref.w4a16_linear
        ref_kw = {k: v for k, v in kw.items() if k not in ("x", "bias")}
    dy = torch.randn(2, 3, 24, generator=torch.Generator().manual_seed(4)).to(kw["x"].dtype).to(DEVICE)
    dx, dbias = _grads(lambda **a: fn(**a, lane=lane), kw, dy)
    x64, b64 = upcast(kw["x"]).requires_grad_(), upcast(kw["bias"]).requires_grad_()
    want = torch.autograd.grad(oracle(x64, **ref_kw, bias=b64), (x64, b64), upcast(dy))
    assert dx.dtype == kw["x"].dtype and dbias.dtype == kw["bias"].dtype
    assert_close(dx, want[0], greg.GEMM)
    assert_close(dbias, want[1], greg.GEMM)


def test_triton_lane_refuses_scales_that_require_grad_before_launching(no_launch):
    kw = _good("gptq")
    with pytest.raises(ValueError, match="scales: expected a tensor that does not require grad"):
        gemm.w4a16_linear(**{**kw, "scales": kw["scales"].clone().requires_grad_()}, lane="triton")


def test_scales_that_require_grad_are_taken_under_no_grad():
    kw = _good("gptq")
    with torch.no_grad(), poisoned_outputs():       # no gradient asked: nothing to refuse
        y = gemm.w4a16_linear(**{**kw, "scales": kw["scales"].clone().requires_grad_()}, lane="triton")
    assert_close(y, ref.w4a16_linear(**{k: upcast(v) for k, v in kw.items()}), greg.GEMM)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("op", ["w4a16 fp32 scale 1e38", "mxfp4 e8m0 scale 2^127"])
def test_dx_stays_finite_where_the_weight_passes_fp32s_range(op, lane):
    # W = code * scale past 2^128 (inf in fp32) while x and dy are small enough for finite y and
    # dx: a backward that built W in fp32 gave inf, and NaN (0 * inf) where dy is 0
    if op.startswith("mxfp4"):
        kw = dict(greg.mxfp4_case("grad big", DEVICE, lead=(2,), K=64, N=8).kwargs)
        kw["w_scale_e8m0"] = kw.pop("w_scale").clone()
        kw["w_scale_e8m0"][0, 0] = 254
        fn = gemm.mxfp4_linear
    else:
        kw = dict(greg.w4_case("grad big", DEVICE, lead=(2,), K=64, N=8, group=32, layout="gptq",
                               scale_dtype=torch.float32).kwargs)
        kw["scales"] = kw["scales"].clone()
        kw["scales"][:, 0] = 1e38
        fn = gemm.w4a16_linear
    x = (kw.pop("x").float() * 1e-3).to(torch.bfloat16).requires_grad_()
    dy = torch.full((2, 8), 1e-3).to(torch.bfloat16).to(DEVICE)
    dy[1, 0] = 0
    with poisoned_outputs():
        (dx,) = torch.autograd.grad(fn(x, **kw, lane=lane), x, dy)
    x64 = upcast(x.detach()).requires_grad_()
    ref_kw = {("w_scale" if k == "w_scale_e8m0" else k): v for k, v in kw.items() if k != "bias"}
    oracle = ref.mxfp4_linear if op.startswith("mxfp4") else ref.w4a16_linear
    (want,) = torch.autograd.grad(oracle(x64, **ref_kw), x64, upcast(dy))
    assert torch.isfinite(want.to(torch.bfloat16)).all()
    assert torch.isfinite(dx).all()
    assert_close(dx, want, greg.GEMM)
