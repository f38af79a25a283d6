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



# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----
