"""The mixture-of-experts family against its oracles (lanekit.reference.moe), on every lane, with
the project's tolerance rule; the cases the MoE issue names, each a test."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import lanekit
from lanekit.reference import moe as ref
from lanekit.runtime import errors
from lanekit.moe import registry as moe_registry, tuning as moe_tuning
from lanekit.testing import CODES, assert_close, generator, poisoned_outputs, randn


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


@pytest.mark.parametrize("path", ["one program", "chunked"])
def test_align_ids_out_of_range_are_dropped_and_recorded(device, path, request):
    if path == "chunked":
        request.getfixturevalue("chunked")
    errors.check_errors()
    ids = _ids(9, 2, 6, "bad ids", device=device)
    ids[0, 1], ids[4, 0], ids[8, 1] = 6, -1, 1 << 30
    with poisoned_outputs():
        out = lanekit.moe.moe_align_block_size(ids, 4, 6, lane="triton")
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
    if lane == "triton":
        assert torch.equal(out, expected)
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


@pytest.mark.parametrize("path", ["one program", "chunked"])
def test_dispatch_ids_out_of_range_go_last_and_are_recorded(device, path, request):
    if path == "chunked":
        request.getfixturevalue("chunked")
    errors.check_errors()
    x, ids, _ = _routed(6, 2, 5, 16, device=device, seed="bad dispatch")
    ids[1, 0], ids[4, 1] = 5, -3
    with poisoned_outputs():
        permuted, offs, inv = lanekit.moe.moe_dispatch(x, ids, 5, lane="triton")
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


def test_combine_rows_out_of_range_contribute_nothing_and_are_recorded(device):
    errors.check_errors()
    g = generator("bad rows")
    y = randn(6, 40, dtype=torch.float32, device=device, generator=g).requires_grad_()
    w = torch.rand(2, 3, generator=g).to(device).requires_grad_()
    inv = torch.tensor([[0, 6, 2], [-1, 4, 5]], dtype=torch.int32, device=device)
    with poisoned_outputs():
        out = lanekit.moe.moe_combine(y, w, inv, lane="triton")
    ok = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.float32, device=device)
    expected = ref.moe_combine(y.double(), (w * ok).double(), inv.clamp(0, 5))
    assert_close(out, expected, moe_registry.COMBINE)
    with pytest.raises(ValueError, match="inv_permuted_idx entry outside"):
        lanekit.check_errors()
    out.sum().backward()
    assert w.grad[0, 1] == 0 and w.grad[1, 0] == 0
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
