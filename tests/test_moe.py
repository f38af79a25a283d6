"""The mixture-of-experts family against its oracles (lanekit.reference.moe), on every lane, with
the project's tolerance rule; the cases the MoE issue names, each a test."""

from __future__ import annotations

import pytest
import torch

import lanekit
from lanekit.reference import moe as ref
from lanekit.runtime import errors
from lanekit.testing import assert_close, poisoned_outputs, upcast


def test_device_errors_are_reported_once_and_cleared():
    bit = errors.register("test: an index out of range (masked)")
    assert errors.register("test: an index out of range (masked)") == bit
    flag = errors.error_flag(torch.device("cpu"))
    errors.check_errors()                       # nothing recorded: returns quietly
    flag |= bit
    with pytest.raises(ValueError, match="an index out of range"):
        lanekit.check_errors()
    assert int(flag.item()) == 0
    errors.check_errors()


# ---- routing: topk_softmax, grouped_topk ----


# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----


# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----

# -- fused_moe --

_FUSED_CASES = {
    "decode M 1, E 8 top-2": dict(M=1, K=64, N=32, E=8, topk=2),
    "M 3, E 64 top-8": dict(M=3, K=64, N=32, E=64, topk=8),
    "K 200, N 72": dict(M=17, K=200, N=72, E=8, topk=2),
    "E 1": dict(M=5, K=48, N=40, E=1, topk=1),
    "an expert with no token": dict(M=9, K=64, N=32, E=4, topk=2, idle_expert=2),
    "equal top-k weights": dict(M=6, K=64, N=32, E=8, topk=4, equal_weights=True),
    "expert_map, half the experts remote": dict(M=11, K=64, N=32, E=4, topk=3, remote_half=True),
    "router weight on the input, top-1": dict(M=7, K=64, N=48, E=4, topk=1, on_input=True),
    "gelu": dict(M=13, K=80, N=40, E=4, topk=2, activation="gelu"),
    "fp16": dict(M=10, K=96, N=64, E=4, topk=2, dtype=torch.float16),
    "topk_weights in bf16": dict(M=4, K=64, N=32, E=4, topk=2, weights_dtype=torch.bfloat16),
    "transposed weight views, strided x": dict(M=8, K=64, N=32, E=4, topk=2, transposed_weights=True,
                                               strided_x=True),
    "prefill tiles, M 300": dict(M=300, K=64, N=32, E=4, topk=2),
}


def _fused_sample(name, device):
    from lanekit.moe.registry import fused_moe_case

    return fused_moe_case(name, device, **_FUSED_CASES[name]).kwargs


def _fused_oracle(kw):
    return ref.fused_moe(**{k: upcast(v) for k, v in kw.items()})


@pytest.mark.parametrize("lane", ["triton", "reference"])
@pytest.mark.parametrize("case", list(_FUSED_CASES))
def test_fused_moe_matches_the_oracle(device, case, lane):
    from lanekit.moe.registry import FUSED_MOE

    kw = _fused_sample(case, device)
    before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    with poisoned_outputs():
        out = lanekit.moe.fused_moe(**kw, lane=lane)
    assert out.dtype == kw["hidden_states"].dtype and out.shape == kw["hidden_states"].shape
    assert_close(out, _fused_oracle(kw), FUSED_MOE)
    for k, v in before.items():
        assert torch.equal(kw[k], v), f"{k} was modified"


def test_fused_moe_rounds_only_the_intermediate(device):
    """The kernel's one rounding between the GEMMs is act(gate) * up to x's dtype: against the
    oracle with that one rounding added, it is within the project's one step."""
    kw = _fused_sample("K 200, N 72", device)
    x, w1, w2 = (upcast(kw[k]) for k in ("hidden_states", "w1", "w2"))
    N = w2.shape[2]
    out = torch.zeros_like(x)
    ids, weights = kw["topk_ids"].long(), upcast(kw["topk_weights"])
    for e in range(w1.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        h = x[token] @ w1[e].t()
        a = (torch.nn.functional.silu(h[:, :N]) * h[:, N:]).to(torch.bfloat16).double()
        out.index_add_(0, token, (a @ w2[e].t()) * weights[token, slot].unsqueeze(-1))
    with poisoned_outputs():
        ours = lanekit.moe.fused_moe(**kw, lane="triton")
    assert_close(ours, out, "exact")


def test_fused_moe_is_deterministic(device):
    kw = _fused_sample("M 3, E 64 top-8", device)
    first = lanekit.moe.fused_moe(**kw, lane="triton")
    assert torch.equal(first, lanekit.moe.fused_moe(**kw, lane="triton"))


def test_fused_moe_remote_experts_contribute_nothing(device):
    """With expert_map, the result is the sum over the local experts' slots only."""
    kw = _fused_sample("expert_map, half the experts remote", device)
    ids, emap = kw["topk_ids"].long(), kw["expert_map"].long()
    local_only = dict(kw, expert_map=None, topk_ids=emap[ids].clamp(min=0).int(),
                      topk_weights=torch.where(emap[ids] >= 0, kw["topk_weights"], 0.0))
    expected = _fused_oracle(local_only)
    assert (emap[ids] < 0).any() and (emap[ids] >= 0).any()
    with poisoned_outputs():
        ours = lanekit.moe.fused_moe(**kw, lane="triton")
    from lanekit.moe.registry import FUSED_MOE
    assert_close(ours, expected, FUSED_MOE)


def _bad_ids(device):
    kw = _fused_sample("decode M 1, E 8 top-2", device)
    kw = dict(kw, hidden_states=torch.cat([kw["hidden_states"]] * 3), topk_weights=torch.cat([kw["topk_weights"]] * 3))
    kw["topk_ids"] = torch.tensor([[1, 8], [-3, 2], [5, 99]], dtype=torch.int32, device=device)
    return kw


def test_fused_moe_out_of_range_ids_are_masked_and_reported(device):
    from lanekit.moe.registry import FUSED_MOE

    errors.check_errors()
    kw = _bad_ids(device)
    with poisoned_outputs():
        out = lanekit.moe.fused_moe(**kw, lane="triton")
    # the oracle's loop over experts 0..E-1 never meets the bad ids: their slots count zero
    assert_close(out, _fused_oracle(kw), FUSED_MOE)
    with pytest.raises(ValueError, match="fused_moe: an id of topk_ids outside"):
        lanekit.check_errors()
    errors.check_errors()   # cleared


def test_fused_moe_expert_map_entries_out_of_range_are_masked_and_reported(device):
    errors.check_errors()
    kw = _fused_sample("expert_map, half the experts remote", device)
    emap = kw["expert_map"].clone()
    emap[kw["topk_ids"][0, 0].long()] = 7          # w1 holds 4 local experts
    kw["expert_map"] = emap
    with poisoned_outputs():
        out = lanekit.moe.fused_moe(**kw, lane="triton")
    assert not torch.isnan(out).any()
    expected = _fused_oracle(dict(kw, expert_map=torch.where(emap == 7, -1, emap)))
    from lanekit.moe.registry import FUSED_MOE
    assert_close(out, expected, FUSED_MOE)
    with pytest.raises(ValueError, match="expert_map entry outside"):
        lanekit.check_errors()


def test_fused_moe_checks_ids_eagerly_when_asked(device, monkeypatch):
    monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")
    errors.check_errors()
    with pytest.raises(ValueError, match=r"topk_ids: expected ids in \[0, 8\)"):
        lanekit.moe.fused_moe(**_bad_ids(device), lane="triton")
    kw = _fused_sample("expert_map, half the experts remote", device)
    kw["expert_map"] = torch.where(kw["expert_map"] == 0, 4, kw["expert_map"])
    with pytest.raises(ValueError, match=r"expert_map: expected local ids in \[-1, 4\)"):
        lanekit.moe.fused_moe(**kw, lane="triton")
    errors.check_errors()   # nothing was launched, nothing recorded


def _fused_bad_inputs():
    bf16, f16 = torch.bfloat16, torch.float16

    def w1_odd(kw):
        return dict(kw, w1=kw["w1"][:, :-1])

    return {
        "topk > E": (lambda kw: dict(kw, topk_ids=torch.zeros(1, 9, dtype=torch.int32),
                                     topk_weights=torch.zeros(1, 9)), ValueError, "topk <= 8"),
        "E of w2 not w1's": (lambda kw: dict(kw, w2=kw["w2"][:7]), ValueError, "w2: expected E = 8"),
        "2N odd": (w1_odd, ValueError, "even 2N"),
        "K of w1 not x's": (lambda kw: dict(kw, w1=kw["w1"][:, :, :63]), ValueError, "w1: expected .* K = 64"),
        "N of w2 not half of w1's": (lambda kw: dict(kw, w2=kw["w2"][:, :, :31]), ValueError, r"w2: expected shape \(8, 64, 32\)"),
        "w1 of another dtype": (lambda kw: dict(kw, w1=kw["w1"].to(f16)), TypeError, "w1: expected the dtype of hidden_states"),
        "x fp32": (lambda kw: dict(kw, hidden_states=kw["hidden_states"].float()), TypeError, "hidden_states: expected dtype"),
        "topk_ids int64": (lambda kw: dict(kw, topk_ids=kw["topk_ids"].long()), TypeError, "topk_ids: expected dtype"),
        "topk_weights fp16 with bf16 x": (lambda kw: dict(kw, topk_weights=kw["topk_weights"].to(f16)), TypeError,
                                          "topk_weights: expected dtype"),
        "topk_weights of another shape": (lambda kw: dict(kw, topk_weights=kw["topk_weights"][:, :1]), ValueError,
                                          "topk_weights: expected shape"),
        "topk_ids of another M": (lambda kw: dict(kw, topk_ids=torch.cat([kw["topk_ids"]] * 2)), ValueError,
                                  "topk_ids: expected .* M = 1"),
        "weight on the input with topk 2": (lambda kw: dict(kw, apply_router_weight_on_input=True), ValueError,
                                            "topk = 1"),
        "unknown activation": (lambda kw: dict(kw, activation="relu"), ValueError, "activation"),
        "expert_map shorter than E": (lambda kw: dict(kw, expert_map=torch.arange(4, dtype=torch.int32)), ValueError,
                                      "E_global >= E = 8"),
        "expert_map int64": (lambda kw: dict(kw, expert_map=torch.arange(8)), TypeError, "expert_map: expected dtype"),
        "x 3-d": (lambda kw: dict(kw, hidden_states=kw["hidden_states"][None]), ValueError, "hidden_states: expected 2"),
    }


@pytest.mark.parametrize("case", list(_fused_bad_inputs()))
def test_fused_moe_rejects_bad_input_before_any_launch(case, monkeypatch):
    change, error, match = _fused_bad_inputs()[case]
    kw = change(_fused_sample("decode M 1, E 8 top-2", "cpu"))
    before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}

    def no_launch(**_):
        raise AssertionError("launched on bad input")

    from lanekit.moe import op
    monkeypatch.setattr(op, "fused_moe_triton", no_launch)
    monkeypatch.setattr(op, "fused_moe_reference", no_launch)
    with pytest.raises(error, match=match):
        lanekit.moe.fused_moe(**kw, lane="triton")
    for k, v in before.items():
        assert torch.equal(kw[k], v)


def test_fused_moe_custom_op_has_a_working_fake(device):
    from lanekit.moe.op import _fused_moe_op

    kw = _fused_sample("decode M 1, E 8 top-2", device)
    args = (kw["hidden_states"], kw["w1"], kw["w2"], kw["topk_weights"], kw["topk_ids"], "silu", False, None)
    torch.library.opcheck(_fused_moe_op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile of the Triton lane needs a GPU")
def test_fused_moe_under_torch_compile_fullgraph(device):
    kw = _fused_sample("K 200, N 72", device)
    eager = lanekit.moe.fused_moe(**kw)
    compiled = torch.compile(lambda **k: lanekit.moe.fused_moe(**k), fullgraph=True)(**kw)
    assert torch.equal(compiled, eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU with ~20 GB free")
def test_fused_moe_offsets_past_2_31_elements(device):
    """w1 of more than 2^31 elements (the last expert's rows past it) and per-slot rows past 2^31
    elements: int64 offsets. Checked on the last tokens, against the oracle on their experts."""
    from lanekit.moe.registry import FUSED_MOE

    E, N, K, topk = 65, 2048, 8192, 8
    M = 2 ** 31 // (topk * K) + 1
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=g)
    w1 = torch.randn(E, 2 * N, K, device=device, dtype=torch.bfloat16, generator=g) * K ** -0.5
    w2 = torch.randn(E, K, N, device=device, dtype=torch.bfloat16, generator=g) * N ** -0.5
    ids = torch.rand(M, E, device=device, generator=g).argsort(-1)[:, :topk].int()   # distinct per token
    ids[-1, 0] = E - 1
    weights = torch.softmax(torch.randn(M, topk, device=device, generator=g), -1)
    out = lanekit.moe.fused_moe(x, w1, w2, weights, ids)
    tail = slice(M - 2, M)
    used = torch.unique(ids[tail].long())
    local = torch.full((E,), -1, dtype=torch.long, device=device)
    local[used] = torch.arange(used.numel(), device=device)
    expected = ref.fused_moe(x[tail].double(), w1[used].double(), w2[used].double(), weights[tail].double(),
                             local[ids[tail].long()].int())
    assert_close(out[tail], expected, FUSED_MOE)


def test_fused_moe_grid_covers_every_block_when_each_expert_just_overflows_one(device):
    """BLOCK_M + 1 slots for each of 4 experts: two blocks each, as many as the grid's bound
    (slots // BLOCK_M + min(E, slots)) allows; every block must be computed."""
    from lanekit.moe import tuning
    from lanekit.moe.registry import FUSED_MOE, fused_moe_case

    block = tuning.fused_moe_config(torch.device(device), 64, 64, 32).block_m
    M = 2 * (block + 1)                      # top-2: 4 (block + 1) slots
    kw = fused_moe_case("every expert one slot past a block", device, M=M, K=64, N=32, E=4, topk=2).kwargs
    assert tuning.fused_moe_config(torch.device(device), M, 64, 32).block_m == block
    flat = torch.arange(4, dtype=torch.int32).repeat_interleave(block + 1)
    ids = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))].view(M, 2)
    kw["topk_ids"] = ids.to(device)
    with poisoned_outputs():
        out = lanekit.moe.fused_moe(**kw, lane="triton")
    assert_close(out, _fused_oracle(kw), FUSED_MOE)


def test_fused_moe_traces_under_torch_compile_through_its_fake(device):
    """fullgraph with aot_eager (no compiler needed): the custom op is traced through its fake
    and runs as itself."""
    kw = _fused_sample("K 200, N 72", device)
    eager = lanekit.moe.fused_moe(**kw, lane="triton")
    compiled = torch.compile(lambda **k: lanekit.moe.fused_moe(**k, lane="triton"), backend="aot_eager",
                             fullgraph=True)(**kw)
    assert torch.equal(compiled, eager)


# ---- quantized experts ----

_QUANT_CASES = {
    "decode M 1, E 8 top-2": dict(M=1, K=64, N=32, E=8, topk=2),
    "M 3, E 64 top-8": dict(M=3, K=64, N=32, E=64, topk=8),
    "K 200, N 72": dict(M=17, K=200, N=72, E=8, topk=2),
    "K 272, N 160: partial 128 blocks": dict(M=6, K=272, N=160, E=2, topk=2),
    "an expert with no token": dict(M=9, K=64, N=32, E=4, topk=2, idle_expert=2),
    "expert_map, half the experts remote": dict(M=11, K=64, N=32, E=4, topk=3, remote_half=True),
    "E 1": dict(M=5, K=48, N=40, E=1, topk=1),
}
_SCHEMES = ["fp8 per tensor", "fp8 per token x channel", "fp8 128x128 blocks", "int8 W8A16"]


def _quant_sample(scheme, case, device, **extra):
    from lanekit.moe.registry import fused_moe_quant_case

    return fused_moe_quant_case(f"{scheme}: {case}", device, scheme=scheme,
                                **dict(_QUANT_CASES[case], **extra)).kwargs


def _public(kw):
    """The sample's keywords that lanekit.moe.fused_moe takes (the oracle's intermediate_dtype out)."""
    return {k: v for k, v in kw.items() if k != "intermediate_dtype"}


def _quant_oracle(kw):
    return ref.fused_moe(**{k: upcast(v) for k, v in kw.items()})


@pytest.mark.parametrize("lane", ["triton", "reference"])
@pytest.mark.parametrize("case", list(_QUANT_CASES))
@pytest.mark.parametrize("scheme", _SCHEMES)
def test_fused_moe_quantized_matches_the_oracle(device, scheme, case, lane):
    from lanekit.moe.registry import FUSED_MOE_QUANT

    kw = _quant_sample(scheme, case, device)
    before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    with poisoned_outputs():
        out = lanekit.moe.fused_moe(**_public(kw), lane=lane)
    assert out.dtype == kw["hidden_states"].dtype and out.shape == kw["hidden_states"].shape
    assert_close(out, _quant_oracle(kw), FUSED_MOE_QUANT)
    for k, v in before.items():
        assert torch.equal(kw[k], v), f"{k} was modified"


@pytest.mark.parametrize("lane", ["triton", "reference"])
def test_fused_moe_fp8_static_per_tensor_scales(device, lane):
    from lanekit.moe.registry import FUSED_MOE_QUANT

    kw = _quant_sample("fp8 per tensor", "decode M 1, E 8 top-2", device, static_scales=True)
    assert kw["a1_scale"] is not None and kw["a2_scale"] is not None
    with poisoned_outputs():
        out = lanekit.moe.fused_moe(**_public(kw), lane=lane)
    assert_close(out, _quant_oracle(kw), FUSED_MOE_QUANT)


@pytest.mark.parametrize("scheme", _SCHEMES)
def test_fused_moe_quantized_is_close_to_the_unquantized_result(device, scheme):
    """A sanity bound on the quantization itself: within 10% of max |out| of the bf16 experts
    (e4m3 has 3 mantissa bits: ~6% per code at worst, averaging out over K and N)."""
    from lanekit.moe.registry import fused_moe_case

    kw = _quant_sample(scheme, "K 200, N 72", device)
    plain = fused_moe_case(f"{scheme}: K 200, N 72", device, **_QUANT_CASES["K 200, N 72"]).kwargs
    out = lanekit.moe.fused_moe(**_public(kw), lane="triton").double()
    exact = _fused_oracle(plain)
    assert (out - exact).abs().max() <= 0.1 * exact.abs().max()


@pytest.mark.parametrize("group", [None, 128, 200], ids=["per tensor", "per 128 columns", "per row"])
def test_activation_codes_equal_the_oracles(device, group):
    """The on-the-fly quantization's codes and scales, bit for bit (round half to even, saturated
    at +-448): x with exact e4m3 ties (1.0625 -> 1.0, 1.1875 -> 1.25 at scale 1) and values past
    448 * scale."""
    from lanekit.moe.kernels import fused_quant as fq
    from lanekit.reference.numerics import quantize_groups
    from lanekit.testing import CODES

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 200, generator=g) * 3).to(torch.bfloat16)
    x[0, :4] = torch.tensor([1.0625, 1.1875, -1.0625, 448.0])
    x[1] = 0.0                                          # an all-zero row: scale 1
    x = x.to(device)
    scheme = fq.PER_TENSOR if group is None else fq.BLOCK if group == 128 else fq.PER_CHANNEL
    static = torch.ones(1, device=device) if group is None else None
    codes, scale = fq._quantize_rows(x, scheme, static)
    ref_codes, ref_scale = quantize_groups(x, group, scale=static)
    assert_close(codes, ref_codes, CODES)
    assert torch.equal(scale.reshape(ref_scale.shape).cpu(), ref_scale.cpu())
    if group is None:
        assert codes[0, :4].float().tolist() == [1.0, 1.25, -1.0, 448.0]
        big, _ = fq._quantize_rows(x * 4, fq.PER_TENSOR, static)
        assert big.float().abs().max().item() == 448.0  # saturated, never NaN


def test_fused_moe_quantized_is_deterministic(device):
    kw = _public(_quant_sample("fp8 128x128 blocks", "M 3, E 64 top-8", device))
    assert torch.equal(lanekit.moe.fused_moe(**kw, lane="triton"), lanekit.moe.fused_moe(**kw, lane="triton"))


def test_fused_moe_quantized_out_of_range_ids_are_masked_and_reported(device):
    from lanekit.moe.registry import FUSED_MOE_QUANT

    errors.check_errors()
    kw = _quant_sample("fp8 128x128 blocks", "decode M 1, E 8 top-2", device)
    kw = dict(kw, hidden_states=torch.cat([kw["hidden_states"]] * 3), topk_weights=torch.cat([kw["topk_weights"]] * 3))
    kw["topk_ids"] = torch.tensor([[1, 8], [-3, 2], [5, 99]], dtype=torch.int32, device=device)
    with poisoned_outputs():
        out = lanekit.moe.fused_moe(**_public(kw), lane="triton")
    assert not torch.isnan(out).any()
    assert_close(out, _quant_oracle(kw), FUSED_MOE_QUANT)   # the oracle never meets the bad ids
    with pytest.raises(ValueError, match="fused_moe: an id of topk_ids outside"):
        lanekit.check_errors()
    errors.check_errors()


def test_fused_moe_quantized_checks_ids_eagerly_when_asked(device, monkeypatch):
    monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")
    errors.check_errors()
    kw = _quant_sample("fp8 per tensor", "decode M 1, E 8 top-2", device)
    kw["topk_ids"] = torch.tensor([[1, 8]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"topk_ids: expected ids in \[0, 8\)"):
        lanekit.moe.fused_moe(**_public(kw), lane="triton")
    errors.check_errors()   # nothing was launched, nothing recorded


def _quant_bad_inputs():
    def w1s(shape):
        return lambda kw: dict(kw, w1_scale=torch.ones(shape))

    return {
        "fp8 weights without scales": (lambda kw: dict(kw, w1_scale=None), ValueError, "w1_scale: expected the weights' scales"),
        "block w1_scale of the wrong shape": (w1s((8, 1, 2)), ValueError, r"w1_scale: expected shape \(8, 1, 1\)"),
        "block w2_scale of the wrong shape": (lambda kw: dict(kw, w2_scale=torch.ones(8, 2, 2)), ValueError,
                                              r"w2_scale: expected shape \(8, 1, 1\)"),
        "scale fp16": (lambda kw: dict(kw, w1_scale=kw["w1_scale"].half()), TypeError, "w1_scale: expected dtype"),
        "weights bf16 with use_fp8_w8a8": (lambda kw: dict(kw, w1=kw["w1"].to(torch.bfloat16)), TypeError,
                                           "w1: expected dtype"),
        "weights int8 with use_fp8_w8a8": (lambda kw: dict(kw, w2=kw["w2"].view(torch.int8)), TypeError,
                                           "w2: expected dtype"),
        "both schemes": (lambda kw: dict(kw, use_int8_w8a16=True), ValueError, "one quantization scheme"),
        "block_shape 64x64": (lambda kw: dict(kw, block_shape=[64, 64]), ValueError, r"block_shape: expected \[128, 128\]"),
        "block_shape with per_channel_quant": (lambda kw: dict(kw, per_channel_quant=True), ValueError,
                                               "block_shape: expected None with per_channel_quant"),
        "a1_scale with block scales": (lambda kw: dict(kw, a1_scale=torch.ones(1)), ValueError,
                                       "a1_scale: expected None"),
        "flag not a bool": (lambda kw: dict(kw, use_fp8_w8a8=1), TypeError, "use_fp8_w8a8: expected a bool"),
        "per-tensor w1_scale (E, 1)": (lambda kw: dict(kw, block_shape=None, w1_scale=torch.ones(8, 1),
                                                       w2_scale=torch.ones(8)), ValueError,
                                       r"w1_scale: expected shape \(8,\) or \(1,\)"),
        "per-tensor a2_scale (2,)": (lambda kw: dict(kw, block_shape=None, w1_scale=torch.ones(8), w2_scale=torch.ones(1),
                                                     a2_scale=torch.ones(2)), ValueError, r"a2_scale: expected shape \(1,\)"),
        "int8 W8A16 per-tensor scales": (lambda kw: dict(kw, use_fp8_w8a8=False, use_int8_w8a16=True, block_shape=None,
                                                         w1=kw["w1"].view(torch.int8), w2=kw["w2"].view(torch.int8),
                                                         w1_scale=torch.ones(8)), ValueError,
                                         r"w1_scale: expected shape \(8, 64, 1\)"),
        "scales without a scheme": (lambda kw: dict(kw, use_fp8_w8a8=False, block_shape=None,
                                                    w1=torch.zeros(8, 64, 64, dtype=torch.bfloat16),
                                                    w2=torch.zeros(8, 64, 32, dtype=torch.bfloat16)),
                                    ValueError, "expected no scales"),
        "x requiring grad": (lambda kw: dict(kw, hidden_states=kw["hidden_states"].clone().requires_grad_()),
                             ValueError, "inference only"),
    }


@pytest.mark.parametrize("case", list(_quant_bad_inputs()))
def test_fused_moe_quantized_rejects_bad_input_before_any_launch(case, monkeypatch):
    change, error, match = _quant_bad_inputs()[case]
    kw = change(_public(_quant_sample("fp8 128x128 blocks", "decode M 1, E 8 top-2", "cpu")))
    before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}

    def no_launch(**_):
        raise AssertionError("launched on bad input")

    from lanekit.moe import op
    for name in ("fused_moe_triton", "fused_moe_reference", "fused_moe_quant_triton", "fused_moe_quant_reference"):
        monkeypatch.setattr(op, name, no_launch)
    with pytest.raises(error, match=match):
        lanekit.moe.fused_moe(**kw, lane="triton")
    for k, v in before.items():
        assert torch.equal(kw[k], v)


def test_fused_moe_quant_custom_op_has_a_working_fake(device):
    from lanekit.moe.op import _fused_moe_quant_op

    kw = _quant_sample("fp8 128x128 blocks", "decode M 1, E 8 top-2", device)
    args = (kw["hidden_states"], kw["w1"], kw["w2"], kw["topk_weights"], kw["topk_ids"], "silu", False, None,
            True, False, [128, 128], kw["w1_scale"], kw["w2_scale"], None, None)
    # test_schema is left out: it multiplies the inputs, which PyTorch cannot do for e4m3 on the CPU
    torch.library.opcheck(_fused_moe_quant_op, args, test_utils=("test_faketensor",))


def test_fused_moe_quantized_traces_under_torch_compile_through_its_fake(device):
    kw = _public(_quant_sample("fp8 128x128 blocks", "K 200, N 72", device))
    eager = lanekit.moe.fused_moe(**kw, lane="triton")
    compiled = torch.compile(lambda **k: lanekit.moe.fused_moe(**k, lane="triton"), backend="aot_eager",
                             fullgraph=True)(**kw)
    assert torch.equal(compiled, eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the prefill tiles at a real model's shape need a GPU")
@pytest.mark.parametrize("scheme", _SCHEMES)
def test_fused_moe_quantized_at_qwen3_30b_shapes(device, scheme):
    """Qwen3-30B-A3B's experts (E 128 top-8, K 2048, N 768) at M 512: the prefill row (wgmma
    on sm90) against the oracle."""
    from lanekit.moe.registry import FUSED_MOE_QUANT, fused_moe_quant_case

    kw = fused_moe_quant_case(f"{scheme}: Qwen3-30B-A3B, M 512", device, scheme=scheme, M=512, K=2048,
                              N=768, E=128, topk=8).kwargs
    out = lanekit.moe.fused_moe(**_public(kw))
    assert_close(out, _quant_oracle(kw), FUSED_MOE_QUANT)
