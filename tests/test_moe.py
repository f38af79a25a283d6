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
