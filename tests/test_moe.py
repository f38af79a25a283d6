"""The mixture-of-experts family against its oracles (lanekit.reference.moe), on every lane, with
the project's tolerance rule; the cases the MoE issue names, each a test."""

from __future__ import annotations

import pytest
import torch

import lanekit
from lanekit.reference import moe as ref
from lanekit.runtime import errors


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

from lanekit.moe import grouped_mm  # noqa: E402
from lanekit.moe import op as moe_op  # noqa: E402
from lanekit.moe import tuning as moe_tuning  # noqa: E402
from lanekit.moe.registry import (FUSED_MOE_BWD, FUSED_MOE_DTOPK, GROUPED_MM, GROUPED_MM_DB,  # noqa: E402
                                  fused_moe_case, grouped_mm_case)
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


@pytest.mark.parametrize("case", list(BAD_OFFS), ids=list(BAD_OFFS))
def test_grouped_mm_invalid_offs_are_clamped_and_recorded(device, case):
    errors.check_errors()
    a = randn(10, 32, dtype=torch.bfloat16, device=device)
    b = randn(3, 32, 16, dtype=torch.bfloat16, device=device, scale=0.2)
    offs = torch.tensor(BAD_OFFS[case], dtype=torch.int32, device=device)
    a_guarded = torch.cat([a, torch.full((16, 32), float("nan"), dtype=a.dtype, device=device)])[:10]
    with poisoned_outputs():
        out = grouped_mm(a_guarded, b, offs, lane="triton")
    assert torch.isfinite(out).all()              # no row read past a (NaN there), every row written
    assert_close(out, _clamped_oracle(a, b, offs), GROUPED_MM)
    with pytest.raises(ValueError, match="grouped_mm: offs not non-decreasing"):
        lanekit.check_errors()


@pytest.mark.parametrize("case", ["decreasing", "past M_total"])
def test_grouped_mm_gradients_with_invalid_offs_stay_in_bounds(device, case):
    """The weights' gradient kernel clamps offs as the forward does: every group's rows inside a."""
    errors.check_errors()
    a = randn(10, 32, dtype=torch.bfloat16, device=device)
    b = randn(3, 32, 16, dtype=torch.bfloat16, device=device, scale=0.2)
    offs = torch.tensor(BAD_OFFS[case], dtype=torch.int32, device=device)
    dout = randn(10, 16, dtype=torch.bfloat16, device=device)
    leaves = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    with poisoned_outputs():
        grouped_mm(*leaves, offs, lane="triton").backward(dout)
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
    """The gradients of fused_moe through the stand-in forward op whose autograd is fused_moe_bwd,
    and those of torch.autograd of the oracle in float64."""
    names = ("hidden_states", "w1", "w2", "topk_weights")
    leaves = {n: kw[n].detach().clone().requires_grad_() for n in names}
    rest = (kw["topk_ids"], kw["activation"], kw["apply_router_weight_on_input"], kw["expert_map"])
    out = moe_op._fused_moe_standin_op(*leaves.values(), *rest)
    dout = randn(*out.shape, dtype=out.dtype, device=device, generator=torch.Generator().manual_seed(seed))
    with poisoned_outputs():
        out.backward(dout)
    oracle = ref.fused_moe_backward(f64(dout), *(f64(kw[n]) for n in names), *rest)
    return [leaves[n].grad for n in names], oracle


@pytest.mark.parametrize("case", list(FUSED_MOE_BWD_CASES), ids=list(FUSED_MOE_BWD_CASES))
def test_fused_moe_backward_matches_autograd_of_the_oracle(device, case):
    kw = fused_moe_case(case, device, **FUSED_MOE_BWD_CASES[case]).kwargs
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
    kw = fused_moe_case("fp32", device, M=4, E=3, topk=2, K=48, N=40, dtype=torch.float32).kwargs
    ours, oracle = _train_step(kw, device)
    for g, r in zip(ours, oracle):
        assert_close(g, r, FUSED_MOE_BWD)        # sixteen fp32 steps, d topk_weights included


def test_fused_moe_backward_is_deterministic(device):
    kw = fused_moe_case("twice", device, M=6, E=4, topk=2, K=48, N=32).kwargs
    first, _ = _train_step(kw, device)
    second, _ = _train_step(kw, device)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_fused_moe_backward_compiles_with_torch_compile(device):
    """The backward's custom op has a fake: a training step through the stand-in forward compiles
    as one graph."""
    kw = fused_moe_case("compiled", device, M=4, E=3, topk=2, K=32, N=16).kwargs
    rest = (kw["topk_ids"], kw["activation"], kw["apply_router_weight_on_input"], kw["expert_map"])

    def step(x, w1, w2, weights):
        out = moe_op._fused_moe_standin_op(x, w1, w2, weights, *rest)
        return torch.autograd.grad(out.float().square().sum(), (x, w1, w2, weights))

    leaves = [kw[n].detach().clone().requires_grad_() for n in ("hidden_states", "w1", "w2", "topk_weights")]
    compiled = torch.compile(step, backend="aot_eager")
    for ours, eager in zip(compiled(*leaves), step(*leaves)):
        assert torch.equal(ours, eager)
