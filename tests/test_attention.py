"""flash_attn_func forward: the pinned behaviours, against the float64 oracle.

Every registered sample is checked on every lane by tests/test_check.py (lanekit.check).
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lanekit
from lanekit import check
from lanekit.attention.registry import ATTENTION_FWD, attention_case
from lanekit.families import get_op
from lanekit.reference import attention as ref
from lanekit.testing import assert_close, poisoned_outputs, randn, upcast

OP = get_op("flash_attn_func")


def call(q, k, v, **kw):
    with poisoned_outputs():
        return lanekit.flash_attn_func(q, k, v, lane="triton", **kw)


def qkv(B, Sq, Sk, Hq, Hkv, D, device, dtype=torch.float16, seed=0, Dv=None):
    g = torch.Generator().manual_seed(seed)
    return (randn(B, Sq, Hq, D, dtype=dtype, device=device, generator=g),
            randn(B, Sk, Hkv, D, dtype=dtype, device=device, generator=g),
            randn(B, Sk, Hkv, Dv or D, dtype=dtype, device=device, generator=g))


def test_causal_sq_longer_than_sk_first_rows_are_exactly_zero(device):
    q, k, v = qkv(1, 2048, 1024, 1, 1, 16, device)
    out, lse, _ = call(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out[:, :1024], torch.zeros_like(out[:, :1024]))
    assert torch.isneginf(lse[..., :1024]).all()
    ref_out, ref_lse = ref.flash_attn(*map(upcast, (q, k, v)), softmax_scale=16 ** -0.5, window_size=(-1, 0))
    assert_close(out, ref_out, ATTENTION_FWD)
    assert_close(lse, ref_lse, "lse")


def test_huge_negative_bias_on_every_key_changes_nothing(device):
    q, k, v = qkv(1, 40, 70, 2, 2, 64, device, dtype=torch.bfloat16)
    plain = call(q, k, v)
    biased = call(q, k, v, attn_bias=torch.full((70,), -1e6, device=device))
    ref_out, _ = ref.flash_attn(*map(upcast, (q, k, v)), softmax_scale=64 ** -0.5)
    assert biased.abs().amax() > 0.1  # not zeros
    assert_close(biased, ref_out, ATTENTION_FWD)
    assert_close(plain, ref_out, ATTENTION_FWD)


def test_window_4_0_single_query_sees_keys_32_to_36(device):
    Sk = 37
    q, k, _ = qkv(1, 1, Sk, 1, 1, 64, device, dtype=torch.float32)
    v = torch.eye(Sk, 64, dtype=torch.float32, device=device)[None, :, None, :]  # v_j = e_j
    out = call(q, k, v.contiguous(), window_size=(4, 0))
    seen = torch.nonzero(out[0, 0, 0] > 0).flatten().tolist()
    assert seen == [32, 33, 34, 35, 36]
    assert math.isclose(out[0, 0, 0].sum().item(), 1.0, rel_tol=1e-5)


def test_head_dim_72_writes_every_output_column(device):
    q, k, v = qkv(2, 33, 45, 4, 2, 72, device, dtype=torch.bfloat16)
    out = call(q, k, v)
    assert out.shape == (2, 33, 4, 72)
    assert not torch.isnan(out).any()
    assert_close(out, ref.flash_attn(*map(upcast, (q, k, v)), softmax_scale=72 ** -0.5)[0], ATTENTION_FWD)


def test_transposed_kv_views_match_their_contiguous_copies(device):
    g = torch.Generator().manual_seed(3)
    q = randn(2, 29, 4, 80, dtype=torch.float16, device=device, generator=g)
    k = randn(2, 2, 61, 80, dtype=torch.float16, device=device, generator=g).transpose(1, 2)
    v = randn(2, 2, 61, 80, dtype=torch.float16, device=device, generator=g).transpose(1, 2)
    assert not k.is_contiguous() and not v.is_contiguous()
    assert torch.equal(call(q, k, v, causal=True), call(q, k.contiguous(), v.contiguous(), causal=True))


@pytest.mark.parametrize("dims", [(1, 16), (17, 32), (33, 64), (65, 128), (129, 192), (193, 256)],
                         ids=lambda d: f"D{d[0]}-{d[1]}")
def test_every_head_dim_from_1_to_256(dims, device):
    # Views into storage padded to 256 columns keep every stride the same, so that on the GPU the
    # dims of one power-of-two bucket share one compiled kernel.
    g = torch.Generator().manual_seed(dims[0])
    store = [randn(1, n, 2, 256, dtype=torch.float16, device=device, generator=g) for n in (3, 5, 5)]
    for D in range(dims[0], dims[1] + 1):
        q, k, v = (t[..., :D] for t in store)
        out = call(q, k[:, :, :1], v[:, :, :1], causal=True)
        expected, _ = ref.flash_attn(*map(upcast, (q, k[:, :, :1], v[:, :, :1])), softmax_scale=D ** -0.5,
                                     window_size=(-1, 0))
        assert_close(out, expected, ATTENTION_FWD)


def test_value_head_dim_may_differ(device):
    q, k, v = qkv(1, 24, 40, 4, 4, 192, device, Dv=128)
    out = call(q, k, v, causal=True)
    assert out.shape == (1, 24, 4, 128)
    assert_close(out, ref.flash_attn(*map(upcast, (q, k, v)), softmax_scale=192 ** -0.5,
                                     window_size=(-1, 0))[0], ATTENTION_FWD)


def test_bias_gets_added_after_scaling(device):
    q, k, v = qkv(1, 9, 13, 1, 1, 32, device, dtype=torch.float32)
    bias = torch.randn(9, 13, device=device)
    out = call(q, k, v, softmax_scale=0.3, attn_bias=bias)
    scores = (q[0, :, 0].double() @ k[0, :, 0].double().T) * 0.3 + bias.double()
    expected = torch.softmax(scores, -1) @ v[0, :, 0].double()
    assert_close(out[0, :, 0], expected, ATTENTION_FWD)


def test_fully_masked_rows_give_zero_and_neg_inf_lse(device):
    q, k, v = qkv(1, 6, 10, 2, 2, 16, device)
    mask = torch.ones(6, 10, dtype=torch.bool, device=device)
    mask[2] = False
    out, lse, _ = call(q, k, v, attn_mask=mask, return_attn_probs=True)
    assert torch.equal(out[0, 2], torch.zeros_like(out[0, 2]))
    assert torch.isneginf(lse[0, :, 2]).all()
    assert not torch.isnan(out).any()


def test_dropout_same_seed_same_mask_and_matches_oracle(device):
    q, k, v = qkv(1, 20, 30, 2, 1, 32, device)
    a = call(q, k, v, dropout_p=0.3, dropout_seed=7, dropout_offset=5)
    b = call(q, k, v, dropout_p=0.3, dropout_seed=7, dropout_offset=5)
    c = call(q, k, v, dropout_p=0.3, dropout_seed=8, dropout_offset=5)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    expected, _ = ref.flash_attn(*map(upcast, (q, k, v)), softmax_scale=32 ** -0.5, dropout_p=0.3,
                                 seed=7, offset=5)
    assert_close(a, expected, ATTENTION_FWD)


def test_dropout_default_seed_follows_torch_manual_seed(device):
    q, k, v = qkv(1, 8, 8, 1, 1, 16, device)
    torch.manual_seed(11)
    a = call(q, k, v, dropout_p=0.5)
    torch.manual_seed(11)
    b = call(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b)


def test_reference_lane_is_the_oracle_in_the_input_dtype():
    q, k, v = qkv(2, 7, 9, 4, 2, 24, "cpu", dtype=torch.bfloat16)
    out, lse, _ = lanekit.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, lane="reference")
    expected, expected_lse = ref.flash_attn(*map(upcast, (q, k, v)), softmax_scale=24 ** -0.5, window_size=(-1, 0))
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.equal(out, expected.to(torch.bfloat16))
    assert torch.equal(lse, expected_lse.float())


def test_cpu_tensors_default_to_the_reference_lane(monkeypatch):
    monkeypatch.delenv("LANEKIT_LANE", raising=False)
    q, k, v = qkv(1, 4, 4, 1, 1, 8, "cpu", dtype=torch.float32)
    calls = []
    original = OP.lane("reference")
    monkeypatch.setattr("lanekit.attention.op.flash_attn_reference",
                        lambda **kw: calls.append(1) or original(**kw))
    lanekit.flash_attn_func(q, k, v)
    assert calls == [1]


def test_lanekit_lane_variable_and_argument_choose_the_lane(monkeypatch):
    q, k, v = qkv(1, 4, 4, 1, 1, 8, "cpu", dtype=torch.float32)
    monkeypatch.setenv("LANEKIT_LANE", "bogus")
    with pytest.raises(ValueError, match="LANEKIT_LANE"):
        lanekit.flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match="lane: expected one of"):
        lanekit.flash_attn_func(q, k, v, lane="cuda")
    monkeypatch.setenv("LANEKIT_LANE", "reference")
    assert torch.equal(lanekit.flash_attn_func(q, k, v), lanekit.flash_attn_func(q, k, v, lane="reference"))


def test_float64_runs_on_the_reference_lane_only(device):
    q, k, v = qkv(1, 5, 6, 2, 1, 8, device, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64 runs on the reference lane only"):
        lanekit.flash_attn_func(q, k, v, lane="triton")
    out = lanekit.flash_attn_func(q, k, v, causal=True, lane="reference")
    expected, _ = ref.flash_attn(q, k, v, softmax_scale=8 ** -0.5, window_size=(-1, 0))
    assert out.dtype == torch.float64 and torch.equal(out, expected)


def test_reference_lane_is_differentiable():
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 5, 6, 2, 1, 8, "cpu", dtype=torch.float32))
    out = lanekit.flash_attn_func(q, k, v, causal=True, lane="reference")
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


BAD_INPUTS = {
    "q rank": (dict(q=(1, 4, 2)), ValueError, "q: expected 4 dimensions"),
    "q dtype": (dict(dtype=torch.int32), TypeError, "q: expected dtype"),
    "k dtype": (dict(k_dtype=torch.float32), TypeError, "k: expected the dtype of q"),
    "Hq not multiple of Hkv": (dict(Hq=6, Hkv=4), ValueError, "divides Hq=6"),
    "head dim 257": (dict(D=257), ValueError, "head dim: expected 1..256, got 257"),
    "head dims differ": (dict(k_D=32), ValueError, "k: expected head dim"),
    "window below -1": (dict(window_size=(-2, 0)), ValueError, "window_size: expected values >= -1"),
    "window not ints": (dict(window_size=(1.5, 0)), TypeError, "window_size"),
    "bias not broadcastable": (dict(attn_bias=(3, 5)), ValueError, "attn_bias: expected a shape broadcastable"),
    "mask not bool": (dict(attn_mask_float=True), TypeError, "attn_mask: expected dtype"),
    "dropout 1": (dict(dropout_p=1.0), ValueError, "dropout_p"),
    "softcap negative": (dict(softcap=-1.0), ValueError, "softcap"),
    "alibi shape": (dict(alibi=(3,)), ValueError, "alibi_slopes: expected shape"),
    "alibi dtype": (dict(alibi_f16=True), TypeError, "alibi_slopes: expected dtype"),
    "batch mismatch": (dict(k_B=2), ValueError, "expected batch size"),
    "not a tensor": (dict(q_list=True), TypeError, "q: expected a torch.Tensor"),
    "sparse": (dict(q_sparse=True), TypeError, r"q: expected a dense \(strided\) tensor, got layout torch.sparse_coo"),
    "no query heads": (dict(Hq=0), ValueError, "q: expected at least one head"),
    "scale is a bool": (dict(softmax_scale=True), TypeError, r"softmax_scale: expected a finite float .* got bool"),
    "scale is a str": (dict(softmax_scale="0.1"), TypeError, r"softmax_scale: expected a finite float .* got str"),
    "dropout a str": (dict(dropout_p="0.1"), TypeError, r"dropout_p: expected a float in \[0, 1\), got str"),
    "softcap a str": (dict(softcap="1"), TypeError, "softcap: expected a finite float >= 0, got str"),
    "scale an int past float's range": (dict(softmax_scale=10**400), ValueError, "softmax_scale: expected a finite"),
    "scale beyond fp32": (dict(softmax_scale=1e300), ValueError, "softmax_scale"),
    "causal not a bool": (dict(causal="yes"), TypeError, "causal: expected a bool"),
    "causal an int": (dict(causal=1), TypeError, "causal: expected a bool, got int"),
    "deterministic not a bool": (dict(deterministic="x"), TypeError, "deterministic: expected a bool, got str"),
    "return_attn_probs not a bool": (dict(return_attn_probs="no"), TypeError, "return_attn_probs: expected a bool"),
    "dropout_seed a float": (dict(dropout_seed=1.0), TypeError, "dropout_seed: expected an int"),
    "dropout_offset negative": (dict(dropout_offset=-1), ValueError, "dropout_offset: expected an int in"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_raises_a_clear_error_and_launches_nothing(case, device, monkeypatch):
    spec, exc, message = BAD_INPUTS[case]
    Hq, Hkv, D = spec.get("Hq", 2), spec.get("Hkv", 2), spec.get("D", 16)
    dtype = spec.get("dtype", torch.float16)
    q = torch.randn(*spec.get("q", (1, 4, Hq, D)), device=device).to(dtype)
    k = torch.randn(spec.get("k_B", 1), 5, Hkv, spec.get("k_D", D), device=device).to(spec.get("k_dtype", dtype))
    v = torch.randn(1, 5, Hkv, D, device=device).to(dtype)
    kw = {}
    for key in ("window_size", "dropout_p", "softcap", "softmax_scale", "causal", "deterministic",
                "return_attn_probs", "dropout_seed", "dropout_offset"):
        if key in spec:
            kw[key] = spec[key]
    if "attn_bias" in spec:
        kw["attn_bias"] = torch.zeros(spec["attn_bias"], device=device)
    if spec.get("attn_mask_float"):
        kw["attn_mask"] = torch.ones(4, 5, device=device)
    if "alibi" in spec:
        kw["alibi_slopes"] = torch.ones(spec["alibi"], device=device)
    if spec.get("alibi_f16"):
        kw["alibi_slopes"] = torch.ones(Hq, device=device, dtype=torch.float16)
    if spec.get("q_list"):
        q = q.tolist()
    if spec.get("q_sparse"):
        q = q.to_sparse()
    snapshot = [t.clone() for t in (k, v)]

    def no_launch(**_):
        raise AssertionError("a lane ran on bad input")

    monkeypatch.setattr("lanekit.attention.op.flash_attn_triton", no_launch)
    monkeypatch.setattr("lanekit.attention.op.flash_attn_reference", no_launch)
    with pytest.raises(exc, match=message):
        lanekit.flash_attn_func(q, k, v, **kw)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, (k, v)))


# (a good value, a bad one equal to it in Python: 1 == True == 1.0, with the same hash)
EQUAL_BUT_REFUSED = {
    "causal 1 after True": ("causal", True, 1, TypeError, "causal: expected a bool, got int"),
    "deterministic 0 after False": ("deterministic", False, 0, TypeError, "deterministic: expected a bool"),
    "return_attn_probs 0 after False": ("return_attn_probs", False, 0, TypeError, "return_attn_probs: expected"),
    "window (1.0, 0) after (1, 0)": ("window_size", (1, 0), (1.0, 0), TypeError, "window_size"),
    "scale True after 1": ("softmax_scale", 1, True, TypeError, "softmax_scale: expected a finite float .* got bool"),
    "dropout False after 0.0": ("dropout_p", 0.0, False, TypeError, "dropout_p: expected a float .* got bool"),
}


@pytest.mark.parametrize("case", list(EQUAL_BUT_REFUSED), ids=list(EQUAL_BUT_REFUSED))
def test_a_signature_that_passed_its_checks_lets_no_equal_but_bad_one_through(case, device):
    # The checks of a signature seen before are skipped (runtime.signature): a bad value equal to
    # a good one (1 == True) is another signature, and raises as on a first call.
    name, good, bad, exc, message = EQUAL_BUT_REFUSED[case]
    q, k, v = qkv(1, 4, 5, 2, 2, 16, device)
    lanekit.flash_attn_func(q, k, v, **{name: good})
    with pytest.raises(exc, match=message):
        lanekit.flash_attn_func(q, k, v, **{name: bad})


def test_a_checked_signature_still_refuses_float64_on_the_triton_lane_and_other_devices(device):
    q, k, v = qkv(1, 4, 5, 2, 2, 16, device, dtype=torch.float32)
    lanekit.flash_attn_func(q, k, v, lane="reference")
    lanekit.flash_attn_func(q.double(), k.double(), v.double(), lane="reference")
    with pytest.raises(TypeError, match="float64 runs on the reference lane only"):
        lanekit.flash_attn_func(q.double(), k.double(), v.double(), lane="triton")
    with pytest.raises(ValueError, match="lane: expected one of"):
        lanekit.flash_attn_func(q, k, v, lane="gpu")
    with pytest.raises(ValueError, match="k: expected the device of q"):
        lanekit.flash_attn_func(q, k.to("meta"), v, lane="reference")


def test_numpy_and_0d_tensor_ints_and_bools_are_taken_as_python_ones(device):
    q, k, v = qkv(1, 5, 7, 2, 1, 16, device, dtype=torch.float32)
    want = lanekit.flash_attn_func(q, k, v, 0.1, None, True, (3, 0), return_attn_probs=True, dropout_seed=5,
                                   dropout_offset=2)
    got = lanekit.flash_attn_func(q, k, v, 0.1, None, np.bool_(True), (np.int64(3), torch.tensor(0)),
                                  deterministic=torch.tensor(False), return_attn_probs=np.bool_(True),
                                  dropout_seed=np.uint32(5), dropout_offset=torch.tensor(2))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] is None


# Every example compiles a kernel variant on the GPU (seconds each): a dozen keeps the run short.
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    Sq=st.integers(0, 40), Sk=st.integers(0, 40), group=st.sampled_from([1, 2, 3]), Hkv=st.integers(1, 2),
    D=st.integers(1, 130), dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    causal=st.booleans(), left=st.integers(-1, 12), right=st.integers(-1, 12),
    softcap=st.sampled_from([0.0, 5.0]), alibi=st.sampled_from([None, "head", "batch"]),
    bias=st.booleans(), mask=st.booleans(),
)
def test_random_configurations_match_the_oracle(device, Sq, Sk, group, Hkv, D, dtype, causal, left, right,
                                                softcap, alibi, bias, mask):
    sample = attention_case(
        f"prop {Sq} {Sk} {group} {Hkv} {D} {dtype} {causal} {left} {right} {softcap} {alibi} {bias} {mask}",
        device, B=2, Sq=Sq, Sk=Sk, Hq=group * Hkv, Hkv=Hkv, D=D, dtype=dtype, causal=causal,
        window_size=(left, right), softcap=softcap, alibi=alibi,
        bias_shape=(1, group * Hkv, Sq, Sk) if bias else None, mask_shape=(2, 1, Sq, Sk) if mask else None,
    )
    result = check.check_sample(OP, "triton", sample)
    assert result.ok, result.detail


@pytest.mark.parametrize("window", [(8, 3), (-1, -1)], ids=["window(8,3)", "no window"])
@pytest.mark.parametrize("D", [48, 64])
def test_fp32_head_dims_48_and_64_with_every_feature_match_the_oracle(D, window, device):
    """fp32 at D in (32, 64] takes a tile of its own on NVIDIA (the generic one spilled; the
    interpreter runs its own tile): a bias, a mask, ALiBi, softcap and dropout on at once, with and
    without a window, at lengths that leave partial row and key blocks and unmasked interior ones."""
    sample = attention_case(f"fp32 d{D} every feature {window}", device, B=2, Sq=97, Sk=129, Hq=2, D=D,
                            dtype=torch.float32, bias_shape=(1, 2, 97, 129), mask_shape=(2, 1, 1, 129),
                            alibi="batch", softcap=30.0, window_size=window, dropout_p=0.2, seed=1234)
    result = check.check_sample(OP, "triton", sample)
    assert result.ok, result.detail


@pytest.mark.parametrize("window", [(-1, 2**31 - 1), (2**31 - 1, -1), (2**63, 2**64), (40, 40)],
                         ids=["right 2^31-1", "left 2^31-1", "beyond int64", "past both ends"])
def test_windows_past_every_key_are_unbounded(window, device):
    q, k, v = qkv(1, 20, 10, 1, 1, 16, device)
    assert torch.equal(call(q, k, v, window_size=window), call(q, k, v))
    assert torch.equal(lanekit.flash_attn_func(q, k, v, window_size=window, lane="reference"),
                       lanekit.flash_attn_func(q, k, v, lane="reference"))


def test_strides_past_int32_tiles_use_int64_offsets(device):
    # A mask row stride S with S * BLOCK_M >= 2^31: the tile offsets must not wrap (2.1 GB of bools).
    S = 143_165_584
    storage = torch.zeros(15 * S + 8, dtype=torch.bool, device=device)
    mask = storage.as_strided((1, 1, 16, 8), (0, 0, S, 1))
    mask[:] = torch.rand(16, 8, generator=torch.Generator().manual_seed(0)).to(device) > 0.3
    q, k, v = qkv(1, 16, 8, 1, 1, 16, device)
    out = call(q, k, v, attn_mask=mask)
    expected, _ = ref.flash_attn(*map(upcast, (q, k, v)), softmax_scale=0.25, attn_mask=mask.clone())
    assert_close(out, expected, ATTENTION_FWD)


@pytest.mark.parametrize("softcap", [50.0, 1e3, 1e5])
def test_large_softcaps_stay_accurate_in_fp32(softcap, device):
    q, k, v = qkv(1, 17, 29, 1, 1, 32, device, dtype=torch.float32)
    out, lse, _ = call(q, k, v, softcap=softcap, return_attn_probs=True)
    expected, expected_lse = ref.flash_attn(*map(upcast, (q, k, v)), softmax_scale=32 ** -0.5, softcap=softcap)
    assert_close(out, expected, ATTENTION_FWD)
    assert_close(lse, expected_lse, "lse")


def test_oracle_normalizes_rows_with_a_huge_constant_bias():
    q, k, v = qkv(1, 6, 10, 1, 1, 16, "cpu", dtype=torch.float32)
    out = lanekit.flash_attn_func(q, k, v, attn_bias=torch.full((10,), -1e20), lane="reference")
    lo, hi = v.amin(dim=1, keepdim=True), v.amax(dim=1, keepdim=True)
    assert ((out >= lo - 1e-6) & (out <= hi + 1e-6)).all()  # a convex combination of the values


def test_empty_batch_over_the_grid_limit_launches_nothing(device):
    q = torch.zeros(70000, 0, 1, 16, dtype=torch.float16, device=device)
    k = v = torch.zeros(70000, 3, 1, 16, dtype=torch.float16, device=device)
    assert call(q, k, v).shape == (70000, 0, 1, 16)


# ---- masked keys' values must be finite (issue 37; docs/semantics.md, "Non-finite values") ----

def _nan_rows(out):
    """The query rows (of the first batch entry and head's layout flattened) holding a NaN."""
    return torch.isnan(out.float().cpu()).flatten(2).any(-1) if out.dim() == 4 else \
        torch.isnan(out.float().cpu()).flatten(1).any(-1)


def _qkv(device, S=40, seed=37):
    g = torch.Generator().manual_seed(seed)
    return [randn(1, S, 2, 16, dtype=torch.bfloat16, device=device, generator=g) for _ in range(3)]


@pytest.mark.parametrize("lane", ["triton", "reference"])
def test_a_nan_in_a_masked_value_row_makes_masked_queries_nan_as_flashattention_and_sdpa(device, lane):
    """Not skipped (the kernels are left as FlashAttention's): 0 * NaN in P @ V. Pinned where both
    lanes agree whatever the tiles: key 1 (in every causal tile's first block) hidden from query 0
    by causal, and a key hidden from every query by attn_mask. A NaN in a masked *key* is harmless:
    only the queries that see it turn NaN."""
    q, k, v = _qkv(device)
    v_nan = v.clone()
    v_nan[0, 1] = float("nan")
    out = lanekit.flash_attn_func(q, k, v_nan, causal=True, lane=lane)
    assert _nan_rows(out)[0, 0], "query 0 cannot see key 1, yet 0 * NaN reaches it"
    assert _nan_rows(out)[0].all()
    mask = torch.ones(1, 1, 40, 40, dtype=torch.bool, device=device)
    mask[..., 20] = False
    v_nan = v.clone()
    v_nan[0, 20] = float("nan")
    out = lanekit.flash_attn_func(q, k, v_nan, attn_mask=mask, lane=lane)
    assert _nan_rows(out).all(), "a NaN value under a mask reaches every query"
    # NaN keys: the score becomes -inf before the softmax where masked
    k_nan = k.clone()
    k_nan[0, 20] = float("nan")
    assert not _nan_rows(lanekit.flash_attn_func(q, k_nan, v, attn_mask=mask, lane=lane)).any()
    seen = _nan_rows(lanekit.flash_attn_func(q, k_nan, v, causal=True, lane=lane))[0]
    assert torch.equal(seen, torch.arange(40) >= 20)
    seen = _nan_rows(lanekit.flash_attn_func(q, k_nan, v, window_size=(4, 0), lane=lane))[0]
    assert torch.equal(seen, (torch.arange(40) >= 20) & (torch.arange(40) <= 24))


@pytest.mark.parametrize("lane", ["triton", "reference"])
def test_varlen_and_kvcache_a_nan_value_masked_by_causal_reaches_the_query_but_unread_keys_do_not(device, lane):
    g = torch.Generator().manual_seed(38)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    q, k, v = (randn(12, 2, 16, dtype=torch.bfloat16, device=device, generator=g) for _ in range(3))
    v[6] = float("nan")            # sequence 1's key 1: hidden from its query 0 by causal
    out = lanekit.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, lane=lane)
    assert torch.equal(_nan_rows(out), torch.arange(12) >= 5), "sequence 0 never reads sequence 1's keys"
    kc, vc = (randn(2, 64, 2, 16, dtype=torch.bfloat16, device=device, generator=g) for _ in range(2))
    q = randn(2, 3, 2, 16, dtype=torch.bfloat16, device=device, generator=g)
    seqlens = torch.tensor([10, 30], dtype=torch.int32, device=device)
    vc_nan = vc.clone()
    vc_nan[:, 40:] = float("nan")   # past every live token: never read
    out = lanekit.flash_attn_with_kvcache(q, kc, vc_nan, cache_seqlens=seqlens, causal=True, lane=lane)
    assert not _nan_rows(out).any()
    vc_nan = vc.clone()
    vc_nan[0, 9] = float("nan")     # sequence 0's last key: hidden from its queries 0 and 1
    out = lanekit.flash_attn_with_kvcache(q, kc, vc_nan, cache_seqlens=seqlens, causal=True, lane=lane)
    assert _nan_rows(out)[0].all() and not _nan_rows(out)[1].any()
