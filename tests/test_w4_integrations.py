"""Issue 33's integrations: ``quantize_linears`` with the 4-bit schemes "w4a16" (AWQ's layout) and
"mxfp4" (gpt-oss's), ``load_quantized_linears`` for AutoAWQ and GPTQ (v1 and v2) state dicts,
and MXFP4 expert weights in ``fused_moe`` (``use_mxfp4_w4a16``). Values against float64 oracles
(the weight dequantized exactly, then F.linear or the fused_moe oracle) with the project's
tolerance rule, on the Triton lane (interpreted on the CPU) and the reference lane."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lanekit.gemm import registry as greg
from lanekit.integrations import load_quantized_linears, quantize_linears
from lanekit.integrations.quantize import Int4Linear, Mxfp4Linear, quantize_int4_awq, quantize_mxfp4
from lanekit.reference import gemm as ref
from lanekit.reference.numerics import pack_int4
from lanekit.testing import assert_close, poisoned_outputs

LANES = ["triton", "reference"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _mlp(dtype, K=64, H=96, N=40, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(K, H), nn.SiLU(), nn.Linear(H, N, bias=False)).to(dtype).to(DEVICE).eval()


def _x(M, K, dtype, seed=1):
    return torch.randn(M, K, generator=_gen(seed)).to(dtype).to(DEVICE)


def _oracle_linear(x, w_kn, bias):
    """x (M, K) @ W (K, N) + bias in float64, rounded once to x's dtype."""
    y = x.to(torch.float64) @ w_kn.to(torch.float64)
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(x.dtype)


# ---- quantize_linears: "w4a16" and "mxfp4" ----

@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M", [1, 17])
def test_w4a16_quantized_layers_match_their_dequantized_weight(lane, dtype, M):
    model = _mlp(dtype)
    quantize_linears(model, "w4a16", group_size=32, lane=lane)
    first, second = model[0], model[2]
    assert isinstance(first, Int4Linear) and isinstance(second, Int4Linear)
    x = _x(M, 64, dtype)
    for layer in (first, second):
        w = ref.w4_weight(layer.qweight, layer.scales.to(torch.float64), layer.qzeros, layer.group_size, "awq")
        xin = x if layer is first else _x(M, 96, dtype, seed=2)
        with poisoned_outputs():
            got = layer(xin)
        assert_close(got, _oracle_linear(xin, w, layer.bias), greg.GEMM)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("M", [1, 17])
def test_mxfp4_quantized_layers_match_their_dequantized_weight(lane, M):
    model = _mlp(torch.bfloat16)
    quantize_linears(model, "mxfp4", lane=lane)
    for layer, K in ((model[0], 64), (model[2], 96)):
        assert isinstance(layer, Mxfp4Linear)
        x = _x(M, K, torch.bfloat16, seed=K)
        w = ref.mxfp4_weight(layer.weight, layer.weight_scale)            # (N, K)
        with poisoned_outputs():
            got = layer(x)
        assert_close(got, _oracle_linear(x, w.t(), layer.bias), greg.GEMM)


def test_w4a16_quantization_error_is_within_half_a_step():
    w = torch.randn(16, 64, generator=_gen(3)).to(torch.bfloat16)
    w[3] = 0                                           # an all-zero row: scale 0, weights 0, no NaN
    w[5, 32:] *= 50                                    # the last group's scale the largest
    qweight, qzeros, scales = quantize_int4_awq(w, 32)
    deq = ref.w4_weight(qweight, scales.to(torch.float64), qzeros, 32, "awq").t()     # (N, K)
    step = scales.to(torch.float64).t().repeat_interleave(32, 1)
    assert not deq.isnan().any()
    assert torch.equal(deq[3], torch.zeros(64, dtype=torch.float64))
    assert scales[1, 5] == scales[:, 5].max() and scales[1, 5] > 10 * scales[0, 5]
    assert bool(((deq - w.double()).abs() <= step / 2 + 1e-12).all())


def test_mxfp4_quantization_rounds_to_the_nearest_e2m1_value():
    # one block of 32: amax 6 gives scale 2^0; the values are e2m1's and the midpoints between them
    vals = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -5.0, 0.5, 1.0, 1.5, 2.0, 3.0,
                         4.0, -6.0, 0.1, 0.3, 2.2, 2.6, 4.9, 5.1] + [0.0] * 8).reshape(1, 32)
    w_fp4, w_scale = quantize_mxfp4(vals)
    assert w_scale.tolist() == [[127]]
    got = ref.mxfp4_weight(w_fp4, w_scale)[0, :24].tolist()
    # ties to the even mantissa: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    assert got == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -4.0, 0.5, 1.0, 1.5, 2.0, 3.0,
                   4.0, -6.0, 0.0, 0.5, 2.0, 3.0, 4.0, 6.0]
    # amax 13: floor(log2 13) - 2 = 1, scale 2^1 (byte 128); 13 / 2 = 6.5 saturates at 6; zero block: byte 127
    w = torch.zeros(2, 32)
    w[0, 0] = 13.0
    w_fp4, w_scale = quantize_mxfp4(w)
    assert w_scale.tolist() == [[128], [127]] and ref.mxfp4_weight(w_fp4, w_scale)[0, 0].item() == 12.0
    assert ref.mxfp4_weight(w_fp4, w_scale)[1].abs().sum().item() == 0.0


@pytest.mark.parametrize("scheme, bound", [("w4a16", 0.99), ("mxfp4", 0.97)])
def test_tiny_llama_logits_stay_close(scheme, bound):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, initializer_range=0.02,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(3, 96, (1, 5), generator=_gen(1))
    with torch.no_grad():
        want = model(ids).logits.float()
        quantize_linears(model, scheme, group_size=32, lane="reference")
        got = model(ids).logits.float()
    kind = Int4Linear if scheme == "w4a16" else Mxfp4Linear
    assert sum(isinstance(m, kind) for m in model.modules()) == 2 * 7
    cos = F.cosine_similarity(got.reshape(-1), want.reshape(-1), dim=0).item()
    assert cos >= bound, f"{scheme}: cosine {cos:.5f} < {bound}"


def test_layers_the_format_cannot_hold_are_refused_by_name_before_any_swap():
    model = nn.Sequential(nn.Linear(64, 16), nn.Linear(16, 12))
    with pytest.raises(ValueError, match=r"^1: .*out_features a multiple of 8"):
        quantize_linears(model, "w4a16", group_size=16)
    with pytest.raises(ValueError, match=r"^0: group_size: expected a divisor of K = 64"):
        quantize_linears(model, "w4a16", group_size=48)
    with pytest.raises(ValueError, match=r"^1: .*multiple of 32"):
        quantize_linears(model, "mxfp4")
    assert all(isinstance(m, nn.Linear) for m in model)



@pytest.mark.parametrize("change, error, match", [
    (dict(skip="lm_head"), TypeError, r"^skip: expected a tuple or list of str .* write \('lm_head',\)"),
    (dict(lane="gpu"), ValueError, r"^lane: expected one of"),
    (dict(group_size=32.0), TypeError, r"^group_size: expected an int >= 1, or -1 .* got float 32\.0"),
    (dict(group_size=True), TypeError, r"^group_size: expected an int .* got bool"),
    (dict(group_size=0), ValueError, r"^group_size: expected an int >= 1, or -1"),
    (dict(scheme="w4a16", nan=True), ValueError, r"^0: weight: expected finite values, got a NaN or inf"),
    (dict(scheme="mxfp4", nan=True), ValueError, r"^0: weight: expected finite values, got a NaN or inf"),
], ids=["skip a str", "unknown lane", "group_size float", "group_size bool", "group_size 0", "w4a16 NaN weight",
        "mxfp4 NaN weight"])
def test_quantize_linears_refuses_bad_arguments_before_any_swap(change, error, match):
    # each once passed and failed later (lane, group_size: at the first forward), matched every
    # layer whose name holds a letter of "lm_head" (skip), or (mxfp4) dropped a NaN weight silently
    change = dict(change)
    model = _mlp(torch.bfloat16)
    if change.pop("nan", False):
        with torch.no_grad():
            model[0].weight[3, 5] = float("nan")
    scheme = change.pop("scheme", "w4a16")
    with pytest.raises(error, match=match):
        quantize_linears(model, scheme, **{"group_size": 32, **change})
    assert isinstance(model[0], nn.Linear) and isinstance(model[2], nn.Linear)
    with pytest.raises(TypeError, match=r"^model: expected a torch\.nn\.Module, got dict"):
        quantize_linears({"0": model[0]}, "w4a16")


def test_quantize_linears_w4a16_group_size_minus_one_is_one_group_of_k():
    model = _mlp(torch.bfloat16)
    quantize_linears(model, "w4a16", group_size=-1)
    assert model[0].group_size == 64 and model[0].scales.shape == (1, 96)
    x = _x(3, 64, torch.bfloat16)
    assert model(x).shape == (3, 40)


# ---- load_quantized_linears: AWQ and GPTQ state dicts made by hand ----

K_, N_, G_ = 64, 16, 32


def _codes(seed):
    g = _gen(seed)
    q = torch.randint(0, 16, (K_, N_), generator=g)                # (K, N)
    z = torch.randint(1, 16, (K_ // G_, N_), generator=g)          # >= 1: v1 stores z - 1
    s = (torch.rand(K_ // G_, N_, generator=g) * 0.02 + 0.001).to(torch.float16)
    s[-1] *= 4                                                     # the last group's scale the largest
    return q, z, s


def _dequantized(q, z, s, g_idx=None):
    g = g_idx.long() if g_idx is not None else torch.arange(K_) // G_
    return (q - z[g]).double() * s.double()[g]                     # (K, N)


def _model(bias=True):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(K_, N_, bias=bias)).to(torch.float16).to(DEVICE)


def _awq_state(q, z, s):
    return {"0.qweight": pack_int4(q, dim=1, order="awq"), "0.qzeros": pack_int4(z, dim=1, order="awq"),
            "0.scales": s}


def _gptq_state(q, z, s, g_idx, v1=True):
    return {"0.qweight": pack_int4(q, dim=0), "0.qzeros": pack_int4(z - 1 if v1 else z, dim=1),
            "0.scales": s, "0.g_idx": g_idx.to(torch.int32)}


def _act_order():
    return torch.randperm(K_, generator=_gen(9)) % (K_ // G_)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_hand_packed_words_load_in_the_documented_nibble_order(lane, fmt):
    # AWQ: columns 0..7 with codes 0..7 pack to 0x75316420 (AutoAWQ's order_map 0, 2, 4, 6, 1, 3, 5, 7
    # fills nibble i with column order_map[i]); GPTQ: rows 0..7 of K with codes 0..7, nibble j = row j,
    # pack to 0x76543210. Scales 1; zero points: AWQ's stored 0 is 0, GPTQ v1's stored 0 is z = 1.
    qweight = torch.zeros((K_, N_ // 8) if fmt == "awq" else (K_ // 8, N_), dtype=torch.int32)
    qweight[0, 0] = 0x75316420 if fmt == "awq" else 0x76543210
    state = {"0.qweight": qweight, "0.scales": torch.ones(K_ // G_, N_, dtype=torch.float16),
             "0.qzeros": torch.zeros((K_ // G_, N_ // 8), dtype=torch.int32)}
    model = load_quantized_linears(_model(bias=False), state, format=fmt, lane=lane)
    eye = torch.eye(K_, dtype=torch.float16, device=DEVICE)[:8]     # x = rows of the identity: y[k] = W[k, :]
    got = model(eye)
    if fmt == "awq":
        want = torch.zeros(8, N_, dtype=torch.float16)
        want[0, :8] = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.float16)     # W[0, n] = n
    else:
        want = torch.full((8, N_), -1.0, dtype=torch.float16)                         # codes 0, z = 1
        want[:, 0] = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 6], dtype=torch.float16)     # W[k, 0] = k - 1
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("fmt, act_order", [("awq", False), ("gptq", False), ("gptq", True),
                                            ("gptq_v2", False), ("gptq_v2", True)])
@pytest.mark.parametrize("M", [1, 17])
def test_hand_made_state_dicts_load_and_match_dequantize_then_linear(lane, fmt, act_order, M):
    q, z, s = _codes(4)
    g_idx = _act_order() if act_order else torch.arange(K_) // G_
    state = _awq_state(q, z, s) if fmt == "awq" else _gptq_state(q, z, s, g_idx, v1=fmt == "gptq")
    model = _model()
    bias = model[0].bias.detach().clone()
    load_quantized_linears(model, {k: v.to(DEVICE) for k, v in state.items()}, format=fmt, lane=lane)
    layer = model[0]
    assert isinstance(layer, Int4Linear) and (layer.g_idx is not None) == act_order
    x = _x(M, K_, torch.float16)
    with poisoned_outputs():
        got = model(x)
    want = _oracle_linear(x, _dequantized(q, z, s, g_idx if act_order else None).to(DEVICE), bias)
    assert_close(got, want, greg.GEMM)


@pytest.mark.parametrize("lane", LANES)
def test_gptq_v2_with_a_zero_point_of_zero_loads_through_awqs_layout(lane):
    q, z, s = _codes(5)
    z[0, 3] = 0                                   # v1 cannot store z - 1 = -1
    state = _gptq_state(q, z, s, torch.arange(K_) // G_, v1=False)
    model = load_quantized_linears(_model(bias=False), state, format="gptq_v2", lane=lane)
    assert model[0].layout == "awq"
    x = _x(17, K_, torch.float16)
    assert_close(model(x), _oracle_linear(x, _dequantized(q, z, s).to(DEVICE), None), greg.GEMM)


def test_gptq_v1_symmetric_checkpoint_stores_seven_for_zero_eight():
    q, _, s = _codes(6)
    state = {"0.qweight": pack_int4(q, dim=0), "0.scales": s,
             "0.qzeros": torch.full((K_ // G_, N_ // 8), 0x77777777, dtype=torch.int32)}
    model = load_quantized_linears(_model(bias=False), state, format="gptq", lane="reference")
    x = _x(3, K_, torch.float16)
    want = _oracle_linear(x, ((q - 8).double() * s.double().repeat_interleave(G_, 0)).to(DEVICE), None)
    assert_close(model(x), want, greg.GEMM)


def test_linears_without_qweight_are_left_alone():
    q, z, s = _codes(7)
    model = nn.Sequential(nn.Linear(K_, N_), nn.Linear(N_, 8)).to(torch.float16)
    load_quantized_linears(model, _awq_state(q, z, s), format="awq")
    assert isinstance(model[0], Int4Linear) and type(model[1]) is nn.Linear


@pytest.mark.parametrize("fmt, drop, match", [
    ("awq", "0.qzeros", r"'0\.qzeros'"), ("awq", "0.scales", r"'0\.scales'"),
    ("gptq", "0.qzeros", r"'0\.qzeros'"),
])
def test_a_missing_key_is_named(fmt, drop, match):
    q, z, s = _codes(8)
    state = _awq_state(q, z, s) if fmt == "awq" else _gptq_state(q, z, s, torch.arange(K_) // G_)
    del state[drop]
    model = _model()
    with pytest.raises(ValueError, match=match):
        load_quantized_linears(model, state, format=fmt)
    assert type(model[0]) is nn.Linear


@pytest.mark.parametrize("key, value, match", [
    ("0.qweight", torch.zeros(K_ // 8, N_, dtype=torch.int32), r"0\.qweight: expected shape \(64, 2\)"),
    ("0.qzeros", torch.zeros(K_ // G_, N_, dtype=torch.int32), r"0\.qzeros: expected shape \(2, 2\)"),
    ("0.scales", torch.zeros(3, N_, dtype=torch.float16), r"0\.scales: expected \(K / group_size, N\)"),
    ("0.scales", torch.zeros(K_ // G_, N_ + 1, dtype=torch.float16), r"0\.scales: expected shape \(2, 16\)"),
])
def test_a_wrong_shape_is_named_with_expected_and_got(key, value, match):
    q, z, s = _codes(8)
    state = _awq_state(q, z, s)
    state[key] = value
    with pytest.raises(ValueError, match=match):
        load_quantized_linears(_model(), state, format="awq")


def test_wrong_dtype_format_or_group_size_are_refused():
    q, z, s = _codes(8)
    state = _awq_state(q, z, s)
    with pytest.raises(TypeError, match=r"0\.qweight: expected dtype torch\.int32"):
        load_quantized_linears(_model(), {**state, "0.qweight": state["0.qweight"].to(torch.int64)})
    with pytest.raises(ValueError, match="format"):
        load_quantized_linears(_model(), state, format="exl2")
    want = r"0\.scales: expected shape \(4, 16\) \(\(K / group_size, N\) with group_size 16\)"
    with pytest.raises(ValueError, match=want):
        load_quantized_linears(_model(), state, format="awq", group_size=16)
    gstate = _gptq_state(q, z, s, torch.arange(K_) // G_)
    with pytest.raises(ValueError, match=r"0\.g_idx: expected shape \(64,\)"):
        load_quantized_linears(_model(), {**gstate, "0.g_idx": gstate["0.g_idx"][:32]}, format="gptq")
    with pytest.raises(ValueError, match="qweight"):
        load_quantized_linears(_model(), {"x.qweight": state["0.qweight"]})



def test_load_refuses_bad_arguments_and_values_at_load_not_at_the_first_forward():
    q, z, s = _codes(8)
    state = _awq_state(q, z, s)
    for kwargs, error, match in [
        (dict(state_dict=None), TypeError, r"^state_dict: expected a mapping of names to tensors, got NoneType"),
        (dict(group_size=32.0), TypeError, r"^group_size: expected an int >= 1, or -1"),
        (dict(group_size=-2), ValueError, r"^group_size: expected an int >= 1, or -1"),
        (dict(lane="gpu"), ValueError, r"^lane: expected one of"),
        (dict(state_dict={**state, "1.qweight": state["0.qweight"]}), ValueError,
         r"^state_dict: expected each '<name>\.qweight' to name an nn\.Linear of the model, got \['1\.qweight'\]"),
    ]:
        model = _model()
        with pytest.raises(error, match=match):
            load_quantized_linears(model, **{"state_dict": state, "format": "awq", **kwargs})
        assert type(model[0]) is nn.Linear
    g_idx = torch.arange(K_) // G_
    g_idx[5] = K_ // G_                                            # a group past the last
    model = _model()
    with pytest.raises(ValueError, match=r"^0\.g_idx: expected groups in \[0, 2\) \(K / group_size\), got 2"):
        load_quantized_linears(model, _gptq_state(q, z, s, g_idx), format="gptq")
    assert type(model[0]) is nn.Linear


# ---- fused_moe with MXFP4 experts (use_mxfp4_w4a16) ----

from lanekit import moe  # noqa: E402
from lanekit.families import get_op  # noqa: E402
from lanekit.moe import registry as mreg  # noqa: E402
from lanekit.reference import moe as mref  # noqa: E402
from lanekit.testing import upcast  # noqa: E402


def _moe_cases():
    for s in get_op("fused_moe_mxfp4").samples(DEVICE):
        yield pytest.param(s, id=s.name)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("sample", list(_moe_cases()))
def test_fused_moe_mxfp4_samples_match_the_oracle(sample, lane):
    op = get_op("fused_moe_mxfp4")
    want = op.reference()(**{k: upcast(v) for k, v in sample.kwargs.items()})
    with poisoned_outputs():
        out = op.lane(lane)(**sample.kwargs)
    assert_close(out, want, mreg.FUSED_MOE_MXFP4)


def test_mxfp4_expert_weights_decode_in_the_documented_nibble_order():
    # byte 0x2F: element 0 = 0xF (-6), element 1 = 0x2 (1.0); byte 0x90: 0x0 (0), 0x9 (-0.5)
    w = torch.zeros(1, 2, 16, dtype=torch.uint8)
    w[0, 0, 0], w[0, 0, 1] = 0x2F, 0x90
    scale = torch.tensor([[[128], [127]]], dtype=torch.uint8)          # 2^1, 2^0
    got = mref.mxfp4_experts(w, scale)
    assert got[0, 0, :4].tolist() == [-12.0, 2.0, 0.0, -1.0] and got[0, 0, 4:].abs().sum() == 0
    assert got[0, 1].abs().sum() == 0


def _moe_sample(name="M 17, K 96, N 160 (past the tile), a zero weight row, top-2"):
    return next(s for s in get_op("fused_moe_mxfp4").samples(DEVICE) if s.name == name).kwargs


def _public(kw, **over):
    args = dict(hidden_states=kw["hidden_states"], w1=kw["w1"], w2=kw["w2"], topk_weights=kw["topk_weights"],
                topk_ids=kw["topk_ids"], activation=kw["activation"], expert_map=kw["expert_map"],
                apply_router_weight_on_input=kw["apply_router_weight_on_input"], use_mxfp4_w4a16=True,
                w1_scale=kw["w1_scale"], w2_scale=kw["w2_scale"])
    args.update(over)
    return args


@pytest.mark.parametrize("lane", LANES)
def test_fused_moe_public_function_takes_gpt_oss_blocks_and_e8m0_scales(lane):
    kw = _moe_sample()
    want = get_op("fused_moe_mxfp4").reference()(**{k: upcast(v) for k, v in kw.items()})
    E, two_n, half_k = kw["w1"].shape
    _, K, half_n = kw["w2"].shape
    e8m0 = getattr(torch, "float8_e8m0fnu", torch.uint8)
    blocks = dict(w1=kw["w1"].reshape(E, two_n, half_k // 16, 16), w2=kw["w2"].reshape(E, K, half_n // 16, 16),
                  w1_scale=kw["w1_scale"].view(e8m0), w2_scale=kw["w2_scale"].view(e8m0))
    for over in ({}, blocks):
        with poisoned_outputs():
            out = moe.fused_moe(**_public(kw, **over), lane=lane)
        assert_close(out, want, mreg.FUSED_MOE_MXFP4)


@pytest.mark.parametrize("lane", LANES)
def test_a_nan_scale_poisons_only_the_tokens_routed_to_its_expert(lane):
    kw = dict(_moe_sample("expert 2 of 4 gets no token, M 9 top-2"))
    w1_scale = kw["w1_scale"].clone()
    w1_scale[1, 0, 0] = 255                                  # e8m0's NaN, expert 1's first gate row
    out = moe.fused_moe(**_public(kw, w1_scale=w1_scale), lane=lane)
    routed = (kw["topk_ids"] == 1).any(1)
    assert routed.any() and (~routed).any()
    assert out[routed].isnan().all(1).all() and not out[~routed].isnan().any()


@pytest.mark.parametrize("over, exc, match", [
    (dict(use_fp8_w8a8=True), ValueError, "use_fp8_w8a8: expected it unset with use_mxfp4_w4a16"),
    (dict(block_shape=[128, 128]), ValueError, "block_shape: expected it unset"),
    (dict(w1_scale=None), ValueError, "w1_scale: expected the e8m0 scales"),
    (dict(w2_scale="w2s[:, :, :1]"), ValueError, r"w2_scale: expected shape \(4, 96, 5\)"),
    (dict(w1="w1.float"), TypeError, "w1: expected dtype"),
    (dict(w1_scale="w1s.float"), TypeError, "w1_scale: expected dtype"),
    (dict(w2="w2[:, :, :8]"), ValueError, r"w2: expected shape \(4, 96, 80\)"),
    (dict(hidden_states="x[:, :80]"), ValueError, "hidden_states: expected K a multiple of 32"),
])
def test_fused_moe_mxfp4_bad_arguments_are_refused(over, exc, match):
    kw = _moe_sample()
    named = {"w2s[:, :, :1]": kw["w2_scale"][:, :, :1], "w1.float": kw["w1"].float(),
             "w1s.float": kw["w1_scale"].float(), "w2[:, :, :8]": kw["w2"][:, :, :8],
             "x[:, :80]": kw["hidden_states"][:, :80]}
    over = {k: named.get(v, v) if isinstance(v, str) else v for k, v in over.items()}
    with pytest.raises(exc, match=match):
        moe.fused_moe(**_public(kw, **over), lane="reference")


def test_fused_moe_mxfp4_is_inference_only():
    kw = _moe_sample()
    x = kw["hidden_states"].clone().requires_grad_(True)
    with pytest.raises(ValueError, match="hidden_states: expected no requires_grad with MXFP4 experts"):
        moe.fused_moe(**_public(kw, hidden_states=x), lane="triton")
    with torch.no_grad():
        assert moe.fused_moe(**_public(kw, hidden_states=x), lane="reference").shape == x.shape


@pytest.mark.parametrize("lane", LANES)
def test_fused_moe_mxfp4_out_of_range_ids_are_masked_and_reported(lane):
    import lanekit
    from lanekit.runtime import errors

    errors.check_errors()
    kw = dict(_moe_sample("M 1 (decode), K 32 (one scale group), E 8 top-2"))
    kw.update(hidden_states=torch.cat([kw["hidden_states"]] * 3), topk_weights=torch.cat([kw["topk_weights"]] * 3),
              topk_ids=torch.tensor([[1, 8], [-3, 2], [5, 99]], dtype=torch.int32, device=DEVICE))
    with poisoned_outputs():
        out = moe.fused_moe(**_public(kw), lane=lane)
    # the oracle with the bad slots' weights zeroed (their ids sent to a valid expert)
    safe = dict(kw, topk_ids=kw["topk_ids"].clamp(0, 7),
                topk_weights=torch.where((kw["topk_ids"] >= 0) & (kw["topk_ids"] < 8), kw["topk_weights"], 0.0))
    want = get_op("fused_moe_mxfp4").reference()(**{k: upcast(v) for k, v in safe.items()})
    assert not out.isnan().any()
    assert_close(out, want, mreg.FUSED_MOE_MXFP4)
    with pytest.raises(ValueError, match="fused_moe: an id of topk_ids outside"):
        lanekit.check_errors()
    errors.check_errors()


def test_fused_moe_mxfp4_checks_ids_eagerly_when_asked(monkeypatch):
    from lanekit.runtime import errors

    monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")
    errors.check_errors()
    kw = dict(_moe_sample("M 1 (decode), K 32 (one scale group), E 8 top-2"))
    kw["topk_ids"] = torch.tensor([[1, 8]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"topk_ids: expected ids in \[0, 8\)"):
        moe.fused_moe(**_public(kw), lane="triton")
    errors.check_errors()
