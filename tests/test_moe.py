"""The mixture-of-experts family against its oracles (lanekit.reference.moe), on every lane, with
the project's tolerance rule; the cases the MoE issue names, each a test."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import lanekit
from lanekit.reference import moe as ref
from lanekit.runtime import errors
from lanekit.moe import registry as moe_registry
from lanekit.moe import tuning as moe_tuning
from lanekit.testing import CODES, assert_close, generator, poisoned_outputs, randn
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

ROUTE_LANES = ["triton", "reference"]


def _logits(M, E, dtype=torch.bfloat16, device="cpu", ties=False, seed="logits"):
    return moe_registry.gating_logits(generator(f"{seed} {M} {E}"), M, E, dtype, ties=ties).to(device)


TOPK_CASES = {
    "decode M=1 E=256 topk=8": dict(M=1, E=256, topk=8),
    "M=3 E=64 topk=8 renormalize": dict(M=3, E=64, topk=8, renormalize=True),
    "E=512 fp16": dict(M=5, E=512, topk=6, dtype=torch.float16),
    "E=1": dict(M=4, E=1, topk=1),
}


@pytest.mark.parametrize("lane", ROUTE_LANES)
@pytest.mark.parametrize("case", TOPK_CASES)
def test_topk_softmax_matches_the_oracle(device, lane, case):
    c = dict(TOPK_CASES[case])
    x = _logits(c.pop("M"), c.pop("E"), c.pop("dtype", torch.bfloat16), device)
    with poisoned_outputs():
        weights, ids = lanekit.moe.topk_softmax(x, **c, lane=lane)
    r_weights, r_ids = ref.topk_softmax(x.double(), c["topk"], c.get("renormalize", False))
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert_close(ids, r_ids, CODES)
    assert_close(weights, r_weights, moe_registry.ROUTING)
    if c.get("renormalize"):
        assert torch.allclose(weights.sum(-1), torch.ones_like(weights[:, 0]))


@pytest.mark.parametrize("lane", ROUTE_LANES)
def test_topk_softmax_equal_weights_go_to_the_lower_expert_id(device, lane):
    x = torch.zeros(3, 12, device=device)
    x[1, [2, 5, 7, 11]] = 1.5                       # four equal maxima
    x[2, [9, 3]] = 2.0
    x[2, [4, 8]] = 1.0
    weights, ids = lanekit.moe.topk_softmax(x, 4, lane=lane)
    assert ids.tolist() == [[0, 1, 2, 3], [2, 5, 7, 11], [3, 9, 4, 8]]
    assert weights[0].eq(weights[0, 0]).all() and weights[1].eq(weights[1, 0]).all()
    assert weights[2, 0] == weights[2, 1] and weights[2, 2] == weights[2, 3]


@pytest.mark.parametrize("lane", ROUTE_LANES)
def test_topk_softmax_weights_are_vllms_softmax_scores(device, lane):
    """Without renormalize the weights are the softmax probabilities themselves (vLLM's
    topk_softmax), not a softmax over the chosen logits."""
    x = _logits(2, 8, torch.float32, device)
    weights, ids = lanekit.moe.topk_softmax(x, 2, lane=lane)
    assert_close(weights, torch.softmax(x.double(), -1).gather(1, ids.long()), moe_registry.ROUTING)


GROUPED_CASES = {
    "DeepSeek-V3 sigmoid bias x2.5": dict(M=3, E=256, topk=8, num_expert_group=8, topk_group=4,
                                          renormalize=True, scoring_func="sigmoid", bias=True,
                                          routed_scaling_factor=2.5),
    "softmax no bias": dict(M=4, E=64, topk=6, num_expert_group=8, topk_group=3),
    "groups of 18 experts": dict(M=2, E=72, topk=4, num_expert_group=4, topk_group=2, bias=True),
    "E=1": dict(M=3, E=1, topk=1, num_expert_group=1, topk_group=1),
}


def _grouped_inputs(device, c):
    c = dict(c)
    x = _logits(c.pop("M"), c["E"], torch.float32, device, seed="grouped")
    bias = None
    if c.pop("bias", False):
        bias = (torch.randperm(c["E"], generator=generator("bias")).float() / 1024).to(device)
    c.pop("E")
    return x, bias, c


@pytest.mark.parametrize("lane", ROUTE_LANES)
@pytest.mark.parametrize("case", GROUPED_CASES)
def test_grouped_topk_matches_the_oracle(device, lane, case):
    x, bias, c = _grouped_inputs(device, GROUPED_CASES[case])
    with poisoned_outputs():
        weights, ids = lanekit.moe.grouped_topk(x, e_score_correction_bias=bias, **c, lane=lane)
    r_weights, r_ids = ref.grouped_topk(x.double(), e_score_correction_bias=bias.double() if bias is not None else None, **c)
    assert_close(ids, r_ids, CODES)
    assert_close(weights, r_weights, moe_registry.ROUTING)
    groups = ids.long() // (x.shape[1] // c["num_expert_group"])
    assert all(len(set(row)) <= c["topk_group"] for row in groups.tolist())


@pytest.mark.parametrize("lane", ROUTE_LANES)
def test_grouped_topk_bias_chooses_but_does_not_weigh(device, lane):
    x = torch.zeros(1, 8, device=device)
    x[0, 0] = 3.0                                   # the best score ...
    bias = torch.zeros(8, device=device)
    bias[[4, 5]] = 10.0                             # ... loses to group 2's two biased experts
    weights, ids = lanekit.moe.grouped_topk(x, 2, 4, 1, scoring_func="sigmoid",
                                            e_score_correction_bias=bias, lane=lane)
    assert ids.tolist() == [[4, 5]]                # sigmoid(0) + 10 each, equal: the lower id first
    assert_close(weights, torch.full((1, 2), 0.5, dtype=torch.float64), moe_registry.ROUTING)


@pytest.mark.parametrize("lane", ROUTE_LANES)
def test_grouped_topk_equal_group_scores_keep_the_lower_group(device, lane):
    x = torch.zeros(1, 16, device=device)
    x[0, [1, 5, 13]] = 2.0                          # groups 0, 1 and 3 tie at their best
    weights, ids = lanekit.moe.grouped_topk(x, 2, 4, 2, lane=lane)
    assert ids.tolist() == [[1, 5]]


@pytest.mark.parametrize("lane", ROUTE_LANES)
@pytest.mark.parametrize("topk_group, topk", [(2, 3), (3, 5), (4, 8)])
def test_grouped_topk_with_minus_inf_choice_scores_takes_no_expert_or_group_twice(device, lane, topk_group, topk):
    # the kernel marked what it took with -inf, which a -inf biased score ties: it took expert 0
    # twice ([1, 0, 0]) and could keep one group twice
    x = _logits(3, 8, torch.float32, device, seed="minus inf bias")
    bias = torch.full((8,), float("-inf"), device=device)
    bias[1] = 0.0
    weights, ids = lanekit.moe.grouped_topk(x, topk, 4, topk_group, False, "sigmoid", bias, lane=lane)
    r_weights, r_ids = ref.grouped_topk(x.double(), topk, 4, topk_group, False, "sigmoid", bias.double())
    assert all(len(set(row)) == topk for row in ids.tolist())
    assert torch.equal(ids.cpu(), r_ids.cpu())
    assert_close(weights, r_weights, moe_registry.ROUTING)


@pytest.mark.parametrize("routing", ["topk_softmax", "topk_softmax renormalize", "grouped_topk sigmoid bias"])
def test_routing_weights_have_the_same_gradient_on_both_lanes(device, routing):
    # the Triton lane's weights had no grad_fn: a router trained on the GPU got no gradient, on
    # the CPU (the reference lane, plain torch) it did
    grads = []
    for lane in ROUTE_LANES:
        x = _logits(5, 16, torch.bfloat16, device, seed="router grad").requires_grad_()
        if routing.startswith("topk_softmax"):
            weights, _ = lanekit.moe.topk_softmax(x, 4, renormalize=routing.endswith("renormalize"), lane=lane)
        else:
            bias = torch.zeros(16, device=device)
            weights, _ = lanekit.moe.grouped_topk(x, 4, 4, 2, True, "sigmoid", bias, 2.5, lane=lane)
        (weights * torch.arange(20.0, device=device).view(5, 4)).sum().backward()
        grads.append(x.grad)
    assert grads[0] is not None and bool(grads[0].abs().sum() > 0)
    assert_close(grads[0], grads[1].double(), moe_registry.ROUTING)


@pytest.mark.parametrize("lane", ROUTE_LANES)
@pytest.mark.parametrize("routing", ["topk_softmax", "grouped_topk softmax", "grouped_topk sigmoid bias"])
def test_routing_of_nan_logits_gives_the_oracles_in_range_ids(device, lane, routing):
    # NaN never equals a row's max: the kernels' argmax returned the id E (out of range) for it
    x = _logits(4, 16, torch.float32, device, seed="nan logits")
    x[0, 3], x[1, :], x[2, 5], x[3, :] = float("nan"), float("nan"), float("inf"), float("-inf")
    # a row of -inf: torch.softmax (the oracle's) gives NaN scores; the kernel gave weights 0
    if routing == "topk_softmax":
        kw = dict(topk=3, renormalize=True)
        weights, ids = lanekit.moe.topk_softmax(x, **kw, lane=lane)
        r_weights, r_ids = ref.topk_softmax(x.double(), 3, True)
    else:
        sigmoid = routing.endswith("bias")
        bias = torch.zeros(16, device=device) if sigmoid else None
        kw = dict(scoring_func="sigmoid" if sigmoid else "softmax", e_score_correction_bias=bias)
        weights, ids = lanekit.moe.grouped_topk(x, 4, 4, 2, **kw, lane=lane)
        r_weights, r_ids = ref.grouped_topk(x.double(), 4, 4, 2, False, kw["scoring_func"],
                                            None if bias is None else bias.double())
    assert bool(((ids >= 0) & (ids < 16)).all())
    assert all(len(set(row)) == ids.shape[1] for row in ids.tolist())
    assert torch.equal(ids.cpu(), r_ids.cpu())
    assert torch.equal(weights.isnan().cpu(), r_weights.isnan().cpu())


def test_routing_flags_and_ints_follow_the_one_rule(device):
    # NumPy and 0-d tensor bools and ints are Python's; an int or a str for a flag is a TypeError
    import numpy as np

    x = _logits(3, 8, torch.float32, device)
    want = lanekit.moe.topk_softmax(x, 2, renormalize=True)
    for got in (lanekit.moe.topk_softmax(x, np.int64(2), renormalize=np.bool_(True)),
                lanekit.moe.topk_softmax(x, torch.tensor(2), renormalize=torch.tensor(True))):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for flag in (1, "no", None):
        with pytest.raises(TypeError, match="^renormalize: expected a bool"):
            lanekit.moe.topk_softmax(x, 2, renormalize=flag)
    h, w1, w2 = (torch.zeros(*shape, dtype=torch.bfloat16, device=device) for shape in ((3, 16), (8, 4, 16), (8, 16, 2)))
    for name in ("apply_router_weight_on_input", "use_fp8_w8a8", "per_channel_quant"):
        with pytest.raises(TypeError, match=f"^{name}: expected a bool, got str"):
            lanekit.moe.fused_moe(h, w1, w2, *want, **{name: "no"})


@pytest.mark.parametrize("lane", ROUTE_LANES)
def test_routing_rejects_bad_input_before_any_launch(device, lane):
    x = _logits(3, 8, torch.float32, device)
    topk_softmax, grouped = lanekit.moe.topk_softmax, lanekit.moe.grouped_topk
    _assert_rejected(lambda: topk_softmax(x, 9, lane=lane), ValueError, r"topk: expected an int in \[1, E = 8\]", x)
    _assert_rejected(lambda: topk_softmax(x, 0, lane=lane), ValueError, "topk", x)
    _assert_rejected(lambda: topk_softmax(x, 2.0, lane=lane), TypeError, "topk", x)
    _assert_rejected(lambda: topk_softmax(x, 2, renormalize=1, lane=lane), TypeError, "renormalize", x)
    _assert_rejected(lambda: topk_softmax(x.int(), 2, lane=lane), TypeError, "gating_output", x)
    _assert_rejected(lambda: topk_softmax(x[0], 2, lane=lane), ValueError, "gating_output: expected 2 dim", x)
    wide = torch.zeros(2, 513, device=device)
    _assert_rejected(lambda: topk_softmax(wide, 2, lane=lane), ValueError, "E <= 512", wide)
    _assert_rejected(lambda: grouped(x, 9, 2, 1, lane=lane), ValueError, "topk", x)
    _assert_rejected(lambda: grouped(x, 2, 3, 1, lane=lane), ValueError, "num_expert_group: expected a divisor", x)
    _assert_rejected(lambda: grouped(x, 2, 4, 5, lane=lane), ValueError, "topk_group", x)
    _assert_rejected(lambda: grouped(x, 5, 4, 2, lane=lane), ValueError, "experts of the kept groups", x)
    _assert_rejected(lambda: grouped(x, 2, 4, 2, scoring_func="relu", lane=lane), ValueError, "scoring_func", x)
    bias = torch.zeros(7, device=device)
    _assert_rejected(lambda: grouped(x, 2, 4, 2, e_score_correction_bias=bias, lane=lane), ValueError,
                     r"e_score_correction_bias: expected shape \(8,\)", x, bias)
    _assert_rejected(lambda: grouped(x, 2, 4, 2, routed_scaling_factor=float("nan"), lane=lane), ValueError,
                     "routed_scaling_factor", x)


def test_routing_then_align_compiles_with_torch_compile(device):
    x = _logits(3, 16, torch.float32, device, seed="compile")

    def route(x):
        weights, ids = lanekit.moe.topk_softmax(x, 2, True, lane="triton")
        return weights, lanekit.moe.moe_align_block_size(ids, 4, 16, lane="triton")

    compiled = torch.compile(route, fullgraph=True, backend="eager" if device == "cpu" else "inductor")
    (w1, a1), (w2, a2) = compiled(x), route(x)
    assert torch.equal(w1, w2) and all(torch.equal(p, q) for p, q in zip(a1, a2))



# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----

LANES = ["triton", "reference"]


def _ids(M, topk, E, seed="ids", experts=None, device="cpu"):
    return moe_registry.routed_ids(generator(seed), M, topk, E, experts=experts).to(device)


def _half_remote(E, device):
    e = torch.arange(E)
    return torch.where(e % 2 == 0, e // 2, -1).to(torch.int32).to(device)


@pytest.fixture
def chunked(monkeypatch):
    """The align and dispatch sorts on their chunked path (count, scan, scatter) even for small M,
    with chunks of 32 flat indices."""
    row = moe_tuning.ALIGN["generic"]
    monkeypatch.setitem(moe_tuning.ALIGN, "generic", dataclasses.replace(row, one_program_tile=0, chunk=32))


ALIGN_CASES = {
    "decode M=1 E=256 topk=8": dict(M=1, topk=8, E=256, block_size=16),
    "M=3 E=64 topk=8": dict(M=3, topk=8, E=64, block_size=16),
    "experts 4.. with no token": dict(M=6, topk=2, E=12, block_size=4, experts=4),
    "E=1": dict(M=5, topk=1, E=1, block_size=16),
    "expert_map with half the experts remote": dict(M=3, topk=8, E=64, block_size=32, expert_map=True),
    "block_size 1": dict(M=4, topk=3, E=6, block_size=1),
}


def _align_inputs(device, M, topk, E, block_size, experts=None, expert_map=False):
    ids = _ids(M, topk, E, f"align {M} {topk} {E}", experts, device)
    return ids, block_size, E, (_half_remote(E, device) if expert_map else None)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("case", ALIGN_CASES)
def test_align_block_size_is_the_oracle_bit_for_bit(device, lane, case):
    ids, block_size, E, emap = _align_inputs(device, **ALIGN_CASES[case])
    with poisoned_outputs():
        out = lanekit.moe.moe_align_block_size(ids, block_size, E, emap, lane=lane)
    expected = ref.moe_align_block_size(ids, block_size, E, emap)
    for o, r in zip(out, expected):
        assert_close(o, r, CODES)
    sorted_ids, expert_ids, post = out
    used = int(post[0])
    assert used % block_size == 0 and bool((sorted_ids[used:] == ids.numel()).all())
    if emap is not None:  # a block's expert is local, -1 (remote) or, past the last block, emap[0]
        assert set(expert_ids.tolist()) <= set(emap.tolist())


def test_align_experts_with_no_token_take_no_block(device):
    ids = torch.tensor([[3, 1], [3, 5]], dtype=torch.int32, device=device)
    sorted_ids, expert_ids, post = lanekit.moe.moe_align_block_size(ids, 4, 8, lane="triton")
    S = 4   # the sentinel M * topk
    assert sorted_ids.tolist()[:12] == [1, S, S, S, 0, 2, S, S, 3, S, S, S]
    assert expert_ids.tolist()[:3] == [1, 3, 5] and post.tolist() == [12]
    assert all(e == 0 for e in expert_ids.tolist()[3:])


def test_align_chunked_sort_gives_the_one_programs_order(device, chunked):
    ids = _ids(40, 4, 8, "chunked", device=device)
    ids[5, 1] = 9                       # an id out of range lands in a middle chunk
    emap = _half_remote(8, device)
    with poisoned_outputs():
        out = lanekit.moe.moe_align_block_size(ids, 8, 8, emap, lane="triton")
    for o, r in zip(out, ref.moe_align_block_size(ids, 8, 8, emap)):
        assert_close(o, r, CODES)
    with pytest.raises(ValueError, match="topk_ids entry outside"):
        lanekit.check_errors()


@pytest.mark.parametrize("path", ["one program", "chunked", "reference lane"])
def test_align_ids_out_of_range_are_dropped_and_recorded(device, path, request):
    if path == "chunked":
        request.getfixturevalue("chunked")
    errors.check_errors()
    ids = _ids(9, 2, 6, "bad ids", device=device)
    ids[0, 1], ids[4, 0], ids[8, 1] = 6, -1, 1 << 30
    with poisoned_outputs():
        out = lanekit.moe.moe_align_block_size(ids, 4, 6, lane="reference" if path == "reference lane" else "triton")
    # dropped: the result is the oracle's, which takes an id outside [0, E) into no expert
    for o, r in zip(out, ref.moe_align_block_size(ids, 4, 6)):
        assert_close(o, r, CODES)
    assert not bool(((out[0] < 0) | (out[0] > ids.numel())).any())
    assert {0 * 2 + 1, 4 * 2, 8 * 2 + 1}.isdisjoint(out[0].tolist())
    with pytest.raises(ValueError, match="topk_ids entry outside"):
        lanekit.check_errors()
    errors.check_errors()               # cleared


@pytest.mark.parametrize("lane", LANES)
def test_align_checks_ids_on_the_host_with_lanekit_check_indices(device, lane, monkeypatch):
    monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")
    ids = _ids(3, 2, 4, "eager", device=device)
    ids[2, 0] = 4
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[0, 4\), got 4"):
        lanekit.moe.moe_align_block_size(ids, 16, 4, lane=lane)
    errors.check_errors()               # nothing was launched, nothing recorded


def _assert_rejected(fn, error, match, *inputs):
    before = [t.clone() for t in inputs]
    with pytest.raises(error, match=match):
        fn()
    assert all(torch.equal(a, b) for a, b in zip(before, inputs))


@pytest.mark.parametrize("lane", LANES)
def test_align_rejects_bad_input_before_any_launch(device, lane):
    ids = _ids(3, 2, 4, "bad input", device=device)
    align = lanekit.moe.moe_align_block_size
    _assert_rejected(lambda: align(ids, 16, 1, lane=lane), ValueError, r"topk <= num_experts = 1", ids)
    _assert_rejected(lambda: align(ids.long(), 16, 4, lane=lane), TypeError, "topk_ids: expected dtype", ids)
    _assert_rejected(lambda: align(ids[0], 16, 4, lane=lane), ValueError, "topk_ids: expected 2 dim", ids)
    _assert_rejected(lambda: align(ids, 0, 4, lane=lane), ValueError, "block_size: expected an int >= 1", ids)
    _assert_rejected(lambda: align(ids, 16.0, 4, lane=lane), TypeError, "block_size", ids)
    _assert_rejected(lambda: align(ids, True, 4, lane=lane), TypeError, "block_size", ids)
    _assert_rejected(lambda: align(ids, 16, 0, lane=lane), ValueError, "num_experts", ids)
    # an int32 position would wrap (and the output would need 8 GiB): refused before allocating
    _assert_rejected(lambda: align(ids, 1 << 30, 4, lane=lane), ValueError,
                     r"block_size: expected max_num_tokens_padded .* below 2\^31", ids)
    _assert_rejected(lambda: align(ids, 16, 1025, lane=lane), ValueError, r"num_experts: expected an int in \[1, 1024\]", ids)
    emap = torch.zeros(5, dtype=torch.int32, device=device)
    _assert_rejected(lambda: align(ids, 16, 4, emap, lane=lane), ValueError, r"expert_map: expected shape \(4,\)", ids, emap)
    _assert_rejected(lambda: align(ids, 16, 4, emap[:4].float(), lane=lane), TypeError, "expert_map", ids)
    _assert_rejected(lambda: align(ids, 16, 4, lane="cuda"), ValueError, "lane", ids)



def _routed(M, topk, E, K, dtype=torch.bfloat16, device="cpu", seed="transport"):
    g = generator(f"{seed} {M} {topk} {E} {K}")
    ids = moe_registry.routed_ids(g, M, topk, E).to(device)
    x = randn(M, K, dtype=dtype, device=device, generator=g)
    w = torch.rand(M, topk, generator=g).to(device)
    return x, ids, w


TRANSPORT_CASES = {
    "decode M=1 E=256 topk=8": dict(M=1, topk=8, E=256, K=7168),
    "M=3 E=64 topk=8 K=200": dict(M=3, topk=8, E=64, K=200),
    "K=72 fp32": dict(M=5, topk=2, E=8, K=72, dtype=torch.float32),
    "E=1": dict(M=4, topk=1, E=1, K=40, dtype=torch.float16),
}


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("case", TRANSPORT_CASES)
def test_dispatch_then_combine_is_the_oracle_and_feeds_grouped_mm(device, lane, case):
    c = TRANSPORT_CASES[case]
    x, ids, w = _routed(**c, device=device)
    with poisoned_outputs():
        permuted, offs, inv = lanekit.moe.moe_dispatch(x, ids, c["E"], lane=lane)
        out = lanekit.moe.moe_combine(permuted, w, inv, lane=lane)
    r_permuted, r_offs, r_inv = ref.moe_dispatch(x, ids, c["E"])
    assert torch.equal(permuted, r_permuted)
    assert_close(offs, r_offs, CODES)
    assert_close(inv, r_inv, CODES)
    assert_close(out, ref.moe_combine(permuted.double(), w.double(), inv), moe_registry.COMBINE)
    # offs are grouped_mm's: expert e's rows offs[e-1]:offs[e] all hold its tokens
    start = 0
    for e, end in enumerate(offs.tolist()):
        slots = inv.reshape(-1).long()
        tokens_here = sorted(int(i) for i in (slots >= start).logical_and(slots < end).nonzero().reshape(-1))
        assert bool((ids.reshape(-1)[tokens_here] == e).all()) and len(tokens_here) == end - start
        start = end


def test_an_expert_with_no_token_has_an_empty_group(device):
    x, _, _ = _routed(3, 2, 6, 16, device=device)
    ids = torch.tensor([[4, 0], [0, 2], [4, 2]], dtype=torch.int32, device=device)
    permuted, offs, inv = lanekit.moe.moe_dispatch(x, ids, 6, lane="triton")
    assert offs.tolist() == [2, 2, 4, 4, 6, 6]
    assert inv.tolist() == [[4, 0], [1, 2], [5, 3]]
    assert torch.equal(permuted, x[[0, 1, 1, 2, 0, 2]])


@pytest.mark.parametrize("lane", LANES)
def test_combine_sums_in_slot_order_the_same_bits_every_run(device, lane):
    g = generator("combine order")
    M, topk, K = 4, 8, 96
    y = randn(M * topk, K, dtype=torch.float32, device=device, generator=g, scale=1e4)
    y[::2] *= 1e-4                                     # terms of very different sizes: order matters
    w = torch.rand(M, topk, generator=g).to(device)
    inv = torch.randperm(M * topk, generator=g).view(M, topk).to(torch.int32).to(device)
    out = lanekit.moe.moe_combine(y, w, inv, lane=lane)
    expected = torch.zeros(M, K, dtype=torch.float32, device=device)
    for s in range(topk):                             # fp32, s = 0, 1, ..., as documented
        expected += w[:, s:s + 1] * y[inv[:, s].long()]
    if lane == "triton" and device == "cpu":      # a GPU may fuse each multiply-add (one rounding less)
        assert torch.equal(out, expected)
    assert_close(out, ref.moe_combine(y.double(), w.double(), inv), moe_registry.COMBINE)
    assert torch.equal(lanekit.moe.moe_combine(y, w, inv, lane=lane), out)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dispatch_and_combine_gradients_match_the_oracles(device, lane, dtype):
    x, ids, w = _routed(5, 4, 16, 72, dtype=dtype, device=device, seed="grads")
    g = generator("douts")
    x_leaf = x.clone().requires_grad_()
    permuted, _, inv = lanekit.moe.moe_dispatch(x_leaf, ids, 16, lane=lane)
    dpermuted = randn(*permuted.shape, dtype=dtype, device=device, generator=g)
    permuted.backward(dpermuted)
    y = randn(*permuted.shape, dtype=dtype, device=device, generator=g)
    y_leaf, w_leaf = y.clone().requires_grad_(), w.clone().requires_grad_()
    out = lanekit.moe.moe_combine(y_leaf, w_leaf, inv, lane=lane)
    dout = randn(*out.shape, dtype=dtype, device=device, generator=g)
    out.backward(dout)

    x64, y64, w64 = (t.double().requires_grad_() for t in (x, y, w))
    r_permuted, _, r_inv = ref.moe_dispatch(x64, ids, 16)
    r_permuted.backward(dpermuted.double())
    ref.moe_combine(y64, w64, r_inv).backward(dout.double())
    assert_close(x_leaf.grad, x64.grad, moe_registry.COMBINE)      # each token's rows summed
    assert_close(y_leaf.grad, y64.grad, moe_registry.COMBINE)
    assert_close(w_leaf.grad, w64.grad, moe_registry.COMBINE_BWD)


def test_combine_gradient_of_y_rows_no_slot_names_is_zero(device):
    g = generator("unnamed rows")
    y = randn(10, 24, dtype=torch.float32, device=device, generator=g).requires_grad_()
    w = torch.rand(2, 3, generator=g).to(device)
    inv = torch.tensor([[0, 4, 2], [7, 1, 5]], dtype=torch.int32, device=device)
    lanekit.moe.moe_combine(y, w, inv, lane="triton").sum().backward()
    named = [0, 4, 2, 7, 1, 5]
    assert bool((y.grad[[3, 6, 8, 9]] == 0).all())
    assert torch.equal(y.grad[named], w.reshape(-1, 1).expand(6, 24))


def test_dispatch_and_combine_compile_with_torch_compile(device):
    x, ids, w = _routed(3, 2, 4, 32, dtype=torch.float32, device=device, seed="compile")

    def moe(x, ids, w):
        permuted, _, inv = lanekit.moe.moe_dispatch(x, ids, 4, lane="triton")
        return lanekit.moe.moe_combine(permuted * 3, w, inv, lane="triton")

    compiled = torch.compile(moe, fullgraph=True, backend="eager" if device == "cpu" else "inductor")
    assert torch.equal(compiled(x, ids, w), moe(x, ids, w))


@pytest.mark.parametrize("path", ["one program", "chunked", "reference lane"])
def test_dispatch_ids_out_of_range_go_last_and_are_recorded(device, path, request):
    # the reference lane raised bincount's RuntimeError on the -3 (and sorted it first)
    if path == "chunked":
        request.getfixturevalue("chunked")
    errors.check_errors()
    x, ids, _ = _routed(6, 2, 5, 16, device=device, seed="bad dispatch")
    ids[1, 0], ids[4, 1] = 5, -3
    with poisoned_outputs():
        permuted, offs, inv = lanekit.moe.moe_dispatch(x, ids, 5, lane="reference" if path == "reference lane" else "triton")
    assert int(offs[-1]) == 10 and inv[1, 0] == 10 and inv[4, 1] == 11     # after every expert
    assert sorted(inv.reshape(-1).tolist()) == list(range(12))                # every row written once
    order = torch.empty(12, dtype=torch.long, device=device)
    order[inv.reshape(-1).long()] = torch.arange(12, device=device)
    assert torch.equal(permuted, x[order // 2])
    valid_ids = ids.reshape(-1)[order[:10]].long()
    assert bool((valid_ids[1:] >= valid_ids[:-1]).all())                       # by expert,
    same = valid_ids[1:] == valid_ids[:-1]
    assert bool((order[1:10][same] > order[:9][same]).all())                  # then by flat index
    assert offs.tolist() == torch.bincount(valid_ids, minlength=5).cumsum(0).tolist()
    with pytest.raises(ValueError, match="topk_ids entry outside"):
        lanekit.check_errors()


@pytest.mark.parametrize("lane", LANES)
def test_combine_rows_out_of_range_contribute_nothing_and_are_recorded(device, lane):
    # the reference lane raised an IndexError on the 6 and read the last row for the -1
    errors.check_errors()
    g = generator("bad rows")
    y = randn(6, 40, dtype=torch.float32, device=device, generator=g).requires_grad_()
    w = torch.rand(2, 3, generator=g).to(device).requires_grad_()
    inv = torch.tensor([[0, 6, 2], [-1, 4, 5]], dtype=torch.int32, device=device)
    with poisoned_outputs():
        out = lanekit.moe.moe_combine(y, w, inv, lane=lane)
    ok = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.float32, device=device)
    expected = ref.moe_combine(y.double(), (w * ok).double(), inv.clamp(0, 5))
    assert_close(out, expected, moe_registry.COMBINE)
    with pytest.raises(ValueError, match="inv_permuted_idx entry outside"):
        lanekit.check_errors()
    out.sum().backward()
    assert w.grad[0, 1] == 0 and w.grad[1, 0] == 0
    if lane == "triton":            # the backward kernel reads inv again (the reference: autograd)
        with pytest.raises(ValueError, match="inv_permuted_idx entry outside"):
            lanekit.check_errors()


@pytest.mark.parametrize("lane", LANES)
def test_transport_checks_indices_on_the_host_with_lanekit_check_indices(device, lane, monkeypatch):
    monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")
    x, ids, w = _routed(3, 2, 4, 16, device=device, seed="eager transport")
    bad = ids.clone()
    bad[0, 0] = -1
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[0, 4\), got -1"):
        lanekit.moe.moe_dispatch(x, bad, 4, lane=lane)
    inv = torch.tensor([[0, 1], [2, 3], [4, 6]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"inv_permuted_idx: expected rows of y in \[0, 6\), got 6"):
        lanekit.moe.moe_combine(x.repeat(2, 1), w, inv, lane=lane)
    errors.check_errors()


@pytest.mark.parametrize("lane", LANES)
def test_transport_rejects_bad_input_before_any_launch(device, lane):
    x, ids, w = _routed(3, 2, 4, 16, device=device, seed="bad transport")
    dispatch, combine = lanekit.moe.moe_dispatch, lanekit.moe.moe_combine
    _assert_rejected(lambda: dispatch(x, ids, 1, lane=lane), ValueError, "topk <= num_experts = 1", x, ids)
    _assert_rejected(lambda: dispatch(x[:2], ids, 4, lane=lane), ValueError, r"expected \(2, topk\)", x, ids)
    _assert_rejected(lambda: dispatch(x.int(), ids, 4, lane=lane), TypeError, "x: expected dtype", x, ids)
    _assert_rejected(lambda: dispatch(x[0], ids, 4, lane=lane), ValueError, "x: expected 2 dim", x, ids)
    _assert_rejected(lambda: dispatch(x, ids.long(), 4, lane=lane), TypeError, "topk_ids", x, ids)
    _assert_rejected(lambda: dispatch(x, ids, 4.0, lane=lane), TypeError, "num_experts", x, ids)
    inv = torch.arange(6, dtype=torch.int32, device=device).view(3, 2)
    y = x.repeat(2, 1)
    _assert_rejected(lambda: combine(y, w, inv[:2], lane=lane), ValueError, "inv_permuted_idx: expected shape", y, w)
    _assert_rejected(lambda: combine(y, w, inv.long(), lane=lane), TypeError, "inv_permuted_idx", y, w)
    _assert_rejected(lambda: combine(y, w.int(), inv, lane=lane), TypeError, "topk_weights", y, w)
    _assert_rejected(lambda: combine(y[0], w, inv, lane=lane), ValueError, "y: expected 2 dim", y, w)
    if lane == "triton":
        _assert_rejected(lambda: combine(y.double(), w, inv, lane=lane), TypeError, "reference lane", y, w)


# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----

from lanekit.moe import grouped_mm  # noqa: E402
from lanekit.moe import op as moe_op  # noqa: E402
from lanekit.moe import tuning as moe_tuning  # noqa: E402
from lanekit.moe.registry import (FUSED_MOE_BWD, FUSED_MOE_DTOPK, GROUPED_MM, GROUPED_MM_DB,  # noqa: E402
                                  fused_moe_bwd_case, grouped_mm_case)
from lanekit.testing import assert_close, poisoned_outputs, randn  # noqa: E402

LANES = ["triton", "reference"]


def f64(t):
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


GROUPED_MM_CASES = {
    "an expert with no rows": dict(counts=[9, 0, 17, 11], K=48, N=40),
    "M_total 1 (decode)": dict(counts=[0, 0, 1, 0], K=64, N=48),
    "M3 x topk 8 over E64": dict(counts=[1 if e % 3 == 0 else 0 for e in range(64)], K=32, N=16),
    "K200 N72": dict(counts=[5, 30, 2], K=200, N=72),
    "E1": dict(counts=[17], K=40, N=24),
    "b the transpose of (E, N, K) weights, fp16": dict(counts=[7, 12, 0, 3], K=64, N=48, b_transposed=True,
                                                       dtype=torch.float16),
    "fp32 out of bf16": dict(counts=[13, 4], K=200, N=72, out_dtype=torch.float32),
}


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("case", list(GROUPED_MM_CASES), ids=list(GROUPED_MM_CASES))
def test_grouped_mm_matches_the_oracle(device, lane, case):
    kw = grouped_mm_case(case, device, **GROUPED_MM_CASES[case]).kwargs
    with poisoned_outputs():
        out = grouped_mm(kw["a"], kw["b"], kw["offs"], kw["out_dtype"], lane=lane)
    assert out.dtype == kw["out_dtype"]
    assert_close(out, ref.grouped_mm(f64(kw["a"]), f64(kw["b"]), kw["offs"]), GROUPED_MM, dtype=out.dtype)
    errors.check_errors()


@pytest.mark.parametrize("seed", range(4))
def test_grouped_mm_random_groups_with_small_swizzled_tiles(device, seed, monkeypatch):
    """Random group sizes (empty ones, ones of several tiles) under 16-row tiles swizzled in pairs:
    every program finds its group and tile on the device, and every row is written once."""
    if device == "cpu":
        monkeypatch.setattr(moe_tuning, "INTERPRETER_GEMM", moe_tuning.GemmConfig(16, 16, 16, 2, 1, 1))
    g = torch.Generator().manual_seed(seed)
    E = [1, 3, 8, 5][seed]
    counts = torch.randint(0, 40, (E,), generator=g).tolist()
    counts[seed % E] = 0
    kw = grouped_mm_case(f"random {seed}", device, counts=counts, K=48, N=40).kwargs
    with poisoned_outputs():
        out = grouped_mm(kw["a"], kw["b"], kw["offs"], lane="triton")
    assert_close(out, ref.grouped_mm(f64(kw["a"]), f64(kw["b"]), kw["offs"]), GROUPED_MM)
    errors.check_errors()


def test_grouped_mm_agrees_with_torchs_grouped_mm(device):
    kw = grouped_mm_case("torch peer", device, counts=[9, 0, 17, 11], K=64, N=48).kwargs
    theirs = torch.nn.functional.grouped_mm(kw["a"], kw["b"], offs=kw["offs"])
    ours = grouped_mm(kw["a"], kw["b"], kw["offs"], lane="triton")
    oracle = ref.grouped_mm(f64(kw["a"]), f64(kw["b"]), kw["offs"])
    assert_close(theirs, oracle, GROUPED_MM)
    assert_close(ours, oracle, GROUPED_MM)
    assert_close(ours, f64(theirs), GROUPED_MM)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("case", ["an expert with no rows", "K200 N72", "b the transpose of (E, N, K) weights, fp16",
                                  "fp32 out of bf16"])
def test_grouped_mm_gradients_match_the_oracles(device, lane, case):
    kw = grouped_mm_case(case, device, **GROUPED_MM_CASES[case]).kwargs
    a, b = (kw[n].detach().clone().requires_grad_() for n in ("a", "b"))
    dout = randn(a.shape[0], b.shape[2], dtype=kw["out_dtype"], device=device, generator=torch.Generator().manual_seed(1))
    with poisoned_outputs():
        grouped_mm(a, b, kw["offs"], kw["out_dtype"], lane=lane).backward(dout)
    da, db = ref.grouped_mm_backward(f64(kw["a"]), f64(kw["b"]), kw["offs"], f64(dout))
    assert_close(a.grad, da, GROUPED_MM)
    assert_close(b.grad, db, GROUPED_MM_DB)
    empty = (kw["offs"].diff(prepend=kw["offs"].new_zeros(1)) == 0).nonzero().flatten()
    assert torch.equal(b.grad[empty], torch.zeros_like(b.grad[empty]))    # a group of no rows: zeros


def test_grouped_mm_gradients_of_a_non_contiguous_output_gradient(device):
    """dout as a strided view (a column slice of a wider buffer): both gradient kernels take its
    strides."""
    kw = grouped_mm_case("strided dout", device, counts=[6, 0, 11], K=48, N=40).kwargs
    a, b = (kw[n].detach().clone().requires_grad_() for n in ("a", "b"))
    wide = randn(17, 80, dtype=torch.bfloat16, device=device, generator=torch.Generator().manual_seed(3))
    dout = wide[:, 20:60]
    grouped_mm(a, b, kw["offs"], lane="triton").backward(dout)
    da, db = ref.grouped_mm_backward(f64(kw["a"]), f64(kw["b"]), kw["offs"], f64(dout))
    assert_close(a.grad, da, GROUPED_MM)
    assert_close(b.grad, db, GROUPED_MM_DB)


def test_grouped_mm_reads_transposed_weights_in_place(device, monkeypatch):
    """b = w.transpose(1, 2) reaches the kernel as that view (its strides), not as a copy."""
    from lanekit.moe.kernels import gemm

    kw = grouped_mm_case("strides", device, counts=[3, 5], K=32, N=16, b_transposed=True).kwargs
    seen = []
    original = gemm.grouped_mm_fwd
    monkeypatch.setattr(gemm, "grouped_mm_fwd", lambda **k: seen.append(k["b"]) or original(**k))
    grouped_mm(kw["a"], kw["b"], kw["offs"], lane="triton")
    assert seen[0].data_ptr() == kw["b"].data_ptr() and seen[0].stride() == kw["b"].stride()


def test_grouped_mm_compiles_with_torch_compile(device):
    kw = grouped_mm_case("compiled", device, counts=[3, 0, 6], K=32, N=24).kwargs
    a = kw["a"].detach().clone().requires_grad_()

    def step(a, b, offs):
        return grouped_mm(a, b, offs, lane="triton").float().square().sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(a, kw["b"], kw["offs"])
    loss.backward()
    a2 = kw["a"].detach().clone().requires_grad_()
    step(a2, kw["b"], kw["offs"]).backward()
    assert torch.equal(loss, step(kw["a"], kw["b"], kw["offs"]))
    assert torch.equal(a.grad, a2.grad)


def _bad(device):
    a = randn(10, 32, dtype=torch.bfloat16, device=device)
    b = randn(2, 32, 16, dtype=torch.bfloat16, device=device)
    offs = torch.tensor([4, 10], dtype=torch.int32, device=device)
    return a, b, offs


BAD_GROUPED_MM = {
    "a 3-D": (lambda a, b, o: (a[None], b, o, None), ValueError, "a: expected 2 dimensions"),
    "a int8": (lambda a, b, o: (a.to(torch.int8), b, o, None), TypeError, "a: expected dtype"),
    "b another dtype": (lambda a, b, o: (a, b.half(), o, None), TypeError, "b: expected the dtype of a"),
    "b 2-D": (lambda a, b, o: (a, b[0], o, None), ValueError, "b: expected 3 dimensions"),
    "K differs": (lambda a, b, o: (a, b[:, :16], o, None), ValueError, r"b: expected shape \(E, K=32, N\)"),
    "offs int64": (lambda a, b, o: (a, b, o.long(), None), TypeError, "offs: expected dtype"),
    "offs not (E,)": (lambda a, b, o: (a, b, o[:1], None), ValueError, r"offs: expected shape \(2,\)"),
    "no group": (lambda a, b, o: (a, b[:0], o[:0], None), ValueError, "b: expected at least one group"),
    "out_dtype fp16 from bf16": (lambda a, b, o: (a, b, o, torch.float16), TypeError, "out_dtype: expected"),
    "a fp64 on the triton lane": (lambda a, b, o: (a.double(), b.double(), o, None), TypeError, "float64"),
}


@pytest.mark.parametrize("case", list(BAD_GROUPED_MM), ids=list(BAD_GROUPED_MM))
def test_grouped_mm_bad_input_raises_before_any_launch(device, case, monkeypatch):
    from lanekit.moe.kernels import gemm

    make, error, match = BAD_GROUPED_MM[case]
    args = make(*_bad(device))
    before = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
    monkeypatch.setattr(gemm, "grouped_mm_fwd", lambda **k: pytest.fail("launched on bad input"))
    with pytest.raises(error, match=match):
        grouped_mm(*args, lane="triton")
    for t, t0 in zip(args, before):
        if isinstance(t, torch.Tensor):
            assert torch.equal(t, t0)


def _clamped_oracle(a, b, offs):
    """The rule for invalid offs: each end the running max of the ends so far, clamped to
    [0, M_total]; rows past the last end zero."""
    ends = offs.long().clamp(0, a.shape[0]).cummax(0).values.to(torch.int32)
    out = ref.grouped_mm(f64(a), f64(b), ends)
    return out


BAD_OFFS = {"decreasing": [6, 3, 10], "past M_total": [4, 8, 25], "short of M_total": [2, 5, 7],
            "negative": [-3, 4, 10]}


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("case", list(BAD_OFFS), ids=list(BAD_OFFS))
def test_grouped_mm_invalid_offs_are_clamped_and_recorded(device, case, lane):
    # the reference lane sliced a[start:end] with the raw offs (a negative end counted from the
    # back, a decreasing one overwrote rows) and recorded nothing
    errors.check_errors()
    a = randn(10, 32, dtype=torch.bfloat16, device=device)
    b = randn(3, 32, 16, dtype=torch.bfloat16, device=device, scale=0.2)
    offs = torch.tensor(BAD_OFFS[case], dtype=torch.int32, device=device)
    a_guarded = torch.cat([a, torch.full((16, 32), float("nan"), dtype=a.dtype, device=device)])[:10]
    with poisoned_outputs():
        out = grouped_mm(a_guarded, b, offs, lane=lane)
    assert torch.isfinite(out).all()              # no row read past a (NaN there), every row written
    assert_close(out, _clamped_oracle(a, b, offs), GROUPED_MM)
    with pytest.raises(ValueError, match="grouped_mm: offs not non-decreasing"):
        lanekit.check_errors()


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("case", ["decreasing", "past M_total"])
def test_grouped_mm_gradients_with_invalid_offs_stay_in_bounds(device, case, lane):
    """The weights' gradient kernel clamps offs as the forward does: every group's rows inside a."""
    errors.check_errors()
    a = randn(10, 32, dtype=torch.bfloat16, device=device)
    b = randn(3, 32, 16, dtype=torch.bfloat16, device=device, scale=0.2)
    offs = torch.tensor(BAD_OFFS[case], dtype=torch.int32, device=device)
    dout = randn(10, 16, dtype=torch.bfloat16, device=device)
    leaves = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    with poisoned_outputs():
        grouped_mm(*leaves, offs, lane=lane).backward(dout)
    ends = offs.long().clamp(0, 10).cummax(0).values.to(torch.int32)
    da, db = ref.grouped_mm_backward(f64(a), f64(b), ends, f64(dout))
    assert_close(leaves[0].grad, da, GROUPED_MM)
    assert_close(leaves[1].grad, db, GROUPED_MM_DB)
    with pytest.raises(ValueError, match="grouped_mm: offs not non-decreasing"):
        lanekit.check_errors()


@pytest.mark.parametrize("case", list(BAD_OFFS), ids=list(BAD_OFFS))
def test_grouped_mm_invalid_offs_raise_eagerly_with_check_indices(device, case, monkeypatch):
    monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")
    a, b, _ = _bad(device)
    offs = torch.tensor(BAD_OFFS[case][:2], dtype=torch.int32, device=device)
    offs[-1] = {"decreasing": 10, "past M_total": 25, "short of M_total": 7, "negative": 10}[case]
    if case == "decreasing":
        offs[0] = 11
    if case == "negative":
        offs[0] = -1
    with pytest.raises(ValueError, match="offs: expected non-decreasing"):
        grouped_mm(a, b, offs, lane="triton")
    errors.check_errors()


def test_grouped_mm_config_comes_from_a_tuned_file_else_from_shared_memory(tmp_path, monkeypatch):
    import json

    from lanekit.runtime.tuning import compiling_for

    name = moe_tuning.config_file_name("grouped_mm", "sm90", torch.bfloat16, 8, 4096, 14336)
    row = dict(block_m=64, block_n=256, block_k=64, group_m=4, num_warps=8, num_stages=3)
    (tmp_path / name).write_text(json.dumps({"configs": {"16": dict(row, block_m=16), "512": row}}))
    monkeypatch.setattr(moe_tuning, "CONFIG_DIR", tmp_path)
    moe_tuning.clear_config_cache()
    cuda = torch.device("cuda")
    with compiling_for("sm90"):
        assert moe_tuning.grouped_mm_config(cuda, E=8, K=4096, N=14336, M=600, dtype=torch.bfloat16).block_n == 256
        assert moe_tuning.grouped_mm_config(cuda, E=8, K=4096, N=14336, M=20, dtype=torch.bfloat16).block_m == 16
        default = moe_tuning.grouped_mm_config(cuda, E=8, K=4096, N=14336, M=4096, dtype=torch.float16)
        assert (default.block_m, default.block_n, default.num_stages) == (128, 128, 4)   # 227 KiB: 4 stages
    with compiling_for("gfx942"):
        amd = moe_tuning.grouped_mm_config(cuda, E=8, K=4096, N=14336, M=4096, dtype=torch.bfloat16)
        assert (amd.block_m, amd.num_stages) == (128, 2)                                  # 64 KiB: 2 stages
    moe_tuning.clear_config_cache()



@pytest.mark.bigmem
@pytest.mark.skipif(not torch.cuda.is_available(), reason="more than 2^31 elements needs GPU memory")
def test_grouped_mm_beyond_2_to_the_31_elements(device):
    """int64 offsets: the last rows of a 2^31 + 64 K-element a, and of its gradient d a, are right;
    d b reduces over rows past 2^31 elements too."""
    K, N = 1024, 16
    rows = 2 ** 31 // K + 64
    a = torch.empty(rows, K, dtype=torch.bfloat16, device=device).normal_()
    b = randn(2, K, N, dtype=torch.bfloat16, device=device, scale=K ** -0.5)
    offs = torch.tensor([rows - 100, rows], dtype=torch.int32, device=device)
    out = grouped_mm(a, b, offs)
    tail = slice(rows - 100, rows)
    assert_close(out[tail], f64(a[tail]) @ f64(b[1]), GROUPED_MM)
    dout = randn(rows, N, dtype=torch.bfloat16, device=device)
    db = moe_op._grouped_mm_bwd_op(a, dout, offs, 2, torch.bfloat16)
    assert_close(db[1], f64(a[tail]).t() @ f64(dout[tail]), GROUPED_MM_DB)
    errors.check_errors()


# ---- fused_moe backward ----

FUSED_MOE_BWD_CASES = {
    "an expert with no token": dict(M=5, E=4, topk=2, K=48, N=32, unused=(3,)),
    "E1": dict(M=7, E=1, topk=1, K=40, N=24),
    "K200 N72": dict(M=6, E=3, topk=2, K=200, N=72),
    "expert_map with half the experts remote": dict(M=6, E=4, topk=2, K=48, N=32, remote=True),
    "M3 E64 topk8 gelu": dict(M=3, E=64, topk=8, K=32, N=16, activation="gelu"),
    "router weight on the input": dict(M=9, E=4, topk=1, K=48, N=32, on_input=True),
}


def _train_step(kw, device, seed=2):
    """The gradients of the public fused_moe on the Triton lane (its custom op's autograd is
    fused_moe_bwd), and those of torch.autograd of the oracle in float64."""
    names = ("hidden_states", "w1", "w2", "topk_weights")
    leaves = {n: kw[n].detach().clone().requires_grad_() for n in names}
    rest = (kw["topk_ids"], kw["activation"], kw["apply_router_weight_on_input"], kw["expert_map"])
    out = lanekit.moe.fused_moe(*leaves.values(), kw["topk_ids"], activation=kw["activation"],
                                apply_router_weight_on_input=kw["apply_router_weight_on_input"],
                                expert_map=kw["expert_map"], lane="triton")
    dout = randn(*out.shape, dtype=out.dtype, device=device, generator=torch.Generator().manual_seed(seed))
    with poisoned_outputs():
        out.backward(dout)
    oracle = ref.fused_moe_backward(f64(dout), *(f64(kw[n]) for n in names), *rest)
    return [leaves[n].grad for n in names], oracle


@pytest.mark.parametrize("case", list(FUSED_MOE_BWD_CASES), ids=list(FUSED_MOE_BWD_CASES))
def test_fused_moe_backward_matches_autograd_of_the_oracle(device, case):
    kw = fused_moe_bwd_case(case, device, **FUSED_MOE_BWD_CASES[case]).kwargs
    ours, oracle = _train_step(kw, device)
    for name, g, r, tol in zip(("dx", "dw1", "dw2", "dtopk_weights"), ours, oracle,
                               (FUSED_MOE_BWD, FUSED_MOE_BWD, FUSED_MOE_BWD, FUSED_MOE_DTOPK)):
        assert g.dtype == (torch.float32 if name == "dtopk_weights" else kw["hidden_states"].dtype), name
        assert_close(g, r, tol)
    if kw["expert_map"] is not None or FUSED_MOE_BWD_CASES[case].get("unused"):
        routed = kw["topk_ids"].long().unique()
        here = kw["expert_map"].long()[routed] if kw["expert_map"] is not None else routed
        idle = torch.ones(kw["w1"].shape[0], dtype=torch.bool, device=device)
        idle[here[here >= 0]] = False
        assert idle.any() or kw["expert_map"] is not None
        assert torch.equal(ours[1][idle], torch.zeros_like(ours[1][idle]))   # an expert with no token: 0
        assert torch.equal(ours[2][idle], torch.zeros_like(ours[2][idle]))
    if kw["expert_map"] is not None:        # slots on remote experts: no gradient for their weight
        remote = kw["expert_map"][kw["topk_ids"].long()] < 0
        assert remote.any() and torch.equal(ours[3][remote], torch.zeros_like(ours[3][remote]))


def test_fused_moe_backward_in_fp32_is_within_fp32_steps(device):
    """fused_moe's forward takes 16-bit activations; its backward's kernels also take fp32 (the
    registry's fp32 sample), checked here through the backward op alone."""
    kw = fused_moe_bwd_case("fp32", device, M=4, E=3, topk=2, K=48, N=40, dtype=torch.float32).kwargs
    names = ("hidden_states", "w1", "w2", "topk_weights")
    rest = (kw["topk_ids"], kw["activation"], kw["apply_router_weight_on_input"], kw["expert_map"])
    dout = randn(*kw["hidden_states"].shape, dtype=torch.float32, device=device,
                 generator=torch.Generator().manual_seed(2))
    ours = moe_op.fused_moe_bwd(dout=dout, **{n: kw[n] for n in names}, topk_ids=kw["topk_ids"],
                                activation=kw["activation"],
                                apply_router_weight_on_input=kw["apply_router_weight_on_input"],
                                expert_map=kw["expert_map"])
    oracle = ref.fused_moe_backward(f64(dout), *(f64(kw[n]) for n in names), *rest)
    for g, r in zip(ours, oracle):
        assert_close(g, r, FUSED_MOE_BWD)        # sixteen fp32 steps, d topk_weights included


def test_fused_moe_backward_is_deterministic(device):
    kw = fused_moe_bwd_case("twice", device, M=6, E=4, topk=2, K=48, N=32).kwargs
    first, _ = _train_step(kw, device)
    second, _ = _train_step(kw, device)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_fused_moe_backward_compiles_with_torch_compile(device):
    """The forward's and the backward's custom ops have fakes: a training step through fused_moe's
    op compiles as one graph."""
    kw = fused_moe_bwd_case("compiled", device, M=4, E=3, topk=2, K=32, N=16).kwargs
    rest = (kw["topk_ids"], kw["activation"], kw["apply_router_weight_on_input"], kw["expert_map"])

    def step(x, w1, w2, weights):
        out = moe_op._fused_moe_op(x, w1, w2, weights, *rest)
        return torch.autograd.grad(out.float().square().sum(), (x, w1, w2, weights))

    leaves = [kw[n].detach().clone().requires_grad_() for n in ("hidden_states", "w1", "w2", "topk_weights")]
    compiled = torch.compile(step, backend="aot_eager")
    for ours, eager in zip(compiled(*leaves), step(*leaves)):
        assert torch.equal(ours, eager)



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


@pytest.mark.parametrize("lane", LANES)
def test_fused_moe_out_of_range_ids_are_masked_and_reported(device, lane):
    from lanekit.moe.registry import FUSED_MOE

    errors.check_errors()
    kw = _bad_ids(device)
    with poisoned_outputs():
        out = lanekit.moe.fused_moe(**kw, lane=lane)
    # the oracle's loop over experts 0..E-1 never meets the bad ids: their slots count zero
    assert_close(out, _fused_oracle(kw), FUSED_MOE)
    with pytest.raises(ValueError, match="fused_moe: an id of topk_ids outside"):
        lanekit.check_errors()
    errors.check_errors()   # cleared


@pytest.mark.parametrize("lane", LANES)
def test_fused_moe_expert_map_entries_out_of_range_are_masked_and_reported(device, lane):
    errors.check_errors()
    kw = _fused_sample("expert_map, half the experts remote", device)
    emap = kw["expert_map"].clone()
    emap[kw["topk_ids"][0, 0].long()] = 7          # w1 holds 4 local experts
    kw["expert_map"] = emap
    with poisoned_outputs():
        out = lanekit.moe.fused_moe(**kw, lane=lane)
    assert not torch.isnan(out).any()
    expected = _fused_oracle(dict(kw, expert_map=torch.where(emap == 7, -1, emap)))
    from lanekit.moe.registry import FUSED_MOE
    assert_close(out, expected, FUSED_MOE)
    with pytest.raises(ValueError, match="expert_map entry outside"):
        lanekit.check_errors()


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "fp8 blocks"])
def test_fused_moe_ids_outside_expert_map_are_masked_and_reported(device, lane, quantized):
    # the reference lane indexed expert_map with them: an IndexError for 8, expert_map[-1] for -1
    from lanekit.moe.registry import FUSED_MOE, FUSED_MOE_QUANT

    errors.check_errors()
    if quantized:
        kw = _quant_sample("fp8 128x128 blocks", "expert_map, half the experts remote", device)
    else:
        kw = _fused_sample("expert_map, half the experts remote", device)
    E_global = kw["expert_map"].shape[0]
    ids = kw["topk_ids"].clone()
    ids[0, 0], ids[-1, -1] = E_global, -1
    kw["topk_ids"] = ids
    with poisoned_outputs():
        out = lanekit.moe.fused_moe(**(_public(kw) if quantized else kw), lane=lane)
    assert not torch.isnan(out).any()
    remote = dict(kw, expert_map=torch.cat([kw["expert_map"], kw["expert_map"].new_full((1,), -1)]),
                  topk_ids=torch.where((ids < 0) | (ids >= E_global), E_global, ids))
    expected = _quant_oracle(remote) if quantized else _fused_oracle(remote)
    assert_close(out, expected, FUSED_MOE_QUANT if quantized else FUSED_MOE)
    with pytest.raises(ValueError, match="fused_moe: an id of topk_ids outside"):
        lanekit.check_errors()


def test_reference_lanes_record_the_kernels_error_bits():
    from lanekit.moe import op
    from lanekit.moe.kernels import align, fused, gemm, transport

    assert (op._BAD_EXPERT, op._BAD_ROW, op._BAD_OFFS, op._BAD_EXPERT_ID) == (
        align.BAD_EXPERT, transport.BAD_ROW, gemm.BAD_OFFS, fused.BAD_EXPERT_ID)


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
        # was "topk_ids: expected 1 <= topk <= 0", naming the wrong argument
        "no experts": (lambda kw: dict(kw, w1=kw["w1"][:0], w2=kw["w2"][:0]), ValueError,
                       r"w1: expected .* at least one expert \(E >= 1\), got shape \(0, 64, 64\)"),
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


@pytest.mark.parametrize("lane", LANES)
def test_fused_moe_quantized_out_of_range_ids_are_masked_and_reported(device, lane):
    from lanekit.moe.registry import FUSED_MOE_QUANT

    errors.check_errors()
    kw = _quant_sample("fp8 128x128 blocks", "decode M 1, E 8 top-2", device)
    kw = dict(kw, hidden_states=torch.cat([kw["hidden_states"]] * 3), topk_weights=torch.cat([kw["topk_weights"]] * 3))
    kw["topk_ids"] = torch.tensor([[1, 8], [-3, 2], [5, 99]], dtype=torch.int32, device=device)
    with poisoned_outputs():
        out = lanekit.moe.fused_moe(**_public(kw), lane=lane)
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
        # these named hidden_states, or (the scales) were accepted and silently got no gradient
        "topk_weights requiring grad": (lambda kw: dict(kw, topk_weights=kw["topk_weights"].clone().requires_grad_()),
                                        ValueError, "topk_weights: expected no requires_grad"),
        "fp8 codes requiring grad": (lambda kw: dict(kw, w1=kw["w1"].clone().requires_grad_()), ValueError,
                                     "w1: expected no requires_grad"),
        "a weight scale requiring grad": (lambda kw: dict(kw, w2_scale=kw["w2_scale"].clone().requires_grad_()),
                                          ValueError, "w2_scale: expected no requires_grad"),
        # a float block shape was accepted (128.0 == 128)
        "block_shape of floats": (lambda kw: dict(kw, block_shape=[128.0, 128.0]), ValueError,
                                  r"block_shape: expected \[128, 128\]"),
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


# ---- the NaN-visible rule (docs/semantics.md) in fused_moe's fp8 activation quantization ----

@pytest.mark.parametrize("group", [None, 128, 200], ids=["per tensor", "per 128 columns", "per row"])
def test_activation_quantization_keeps_a_nan_or_inf_visible(device, group):
    from lanekit.moe.kernels import fused_quant as fq
    from lanekit.reference.numerics import quantize_groups
    from lanekit.testing import assert_same_bits

    x = (torch.randn(5, 200, generator=torch.Generator().manual_seed(37)) * 3).to(torch.bfloat16)
    x[1, 3], x[2, 150], x[3, 199] = float("nan"), float("inf"), float("-inf")
    x = x.to(device)
    scheme = fq.PER_TENSOR if group is None else fq.BLOCK if group == 128 else fq.PER_CHANNEL
    codes, scale = fq._quantize_rows(x, scheme, None)
    ref_codes, ref_scale = quantize_groups(x, group)
    assert_same_bits(codes, ref_codes, "codes")
    assert_same_bits(scale.reshape(ref_scale.shape), ref_scale, "scale")
    nan_codes = codes.cpu().view(torch.uint8) == 0x7F
    if group is None:       # one scale: the whole tensor
        assert torch.isnan(scale).all() and nan_codes.all()
    else:
        assert nan_codes[1:4].any(-1).all() and not nan_codes[[0, 4]].any()


@pytest.mark.parametrize("lane", ["triton", "reference"])
@pytest.mark.parametrize("scheme", ["fp8 per token x channel", "fp8 128x128 blocks"])
def test_fused_moe_fp8_a_nan_token_gives_a_nan_output_row_and_no_other(device, scheme, lane):
    from lanekit.moe.registry import FUSED_MOE_QUANT

    kw = _quant_sample(scheme, "K 200, N 72", device)
    x = kw["hidden_states"].clone()
    x[3, 7] = float("nan")
    x[5, 100] = float("inf")
    kw["hidden_states"] = x
    out = lanekit.moe.fused_moe(**_public(kw), lane=lane)
    want = _quant_oracle(kw)
    bad = torch.zeros(x.shape[0], dtype=torch.bool)
    bad[[3, 5]] = True
    assert torch.isnan(out.cpu()[bad]).all() and torch.isnan(want.cpu()[bad]).all()
    assert_close(out[~bad.to(out.device)], want[~bad.to(want.device)], FUSED_MOE_QUANT)


@pytest.mark.parametrize("kind", ["bf16", "fp8 per tensor", "mxfp4"])
def test_fused_moe_strided_expert_map_is_read_as_its_values(device, kind):
    # the sum kernel read expert_map[e] at EXPERT_MAP + e (the align copied it contiguous): a
    # strided view mapped slots to its neighbours' entries, garbage experts included
    from lanekit.moe import registry as mreg

    case = dict(M=11, K=64, N=32, E=4, topk=3, remote_half=True)
    if kind == "bf16":
        kw = mreg.fused_moe_case("strided map", device, **case).kwargs
    elif kind == "mxfp4":
        kw = mreg.fused_moe_mxfp4_case("strided map", device, **case).kwargs
        kw = {**{k: v for k, v in kw.items() if k != "intermediate_dtype"}, "use_mxfp4_w4a16": True}
    else:
        kw = mreg.fused_moe_quant_case("strided map", device, scheme=kind, **case).kwargs
        kw = {k: v for k, v in kw.items() if k != "intermediate_dtype"}
    emap = kw["expert_map"]
    strided = torch.stack([emap, torch.full_like(emap, 99)], -1).select(-1, 0)   # every other element
    assert not strided.is_contiguous() and torch.equal(strided, emap)
    with contextlib.suppress(ValueError):
        lanekit.check_errors()      # what earlier tests left
    with poisoned_outputs():
        want = lanekit.moe.fused_moe(**kw, lane="triton")
        got = lanekit.moe.fused_moe(**{**kw, "expert_map": strided}, lane="triton")
    assert torch.equal(got, want)
    lanekit.check_errors()          # nothing recorded: every entry of the map is in range
