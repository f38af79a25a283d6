"""Expert parallelism (lanekit.moe.distributed) on the CPU over gloo: groups of 2 and 4 processes
(torch.multiprocessing), and a world of one in this process. The sharded layer's output and
gradients (x, the local experts' weights, the router weights) against the unsharded float64 oracle
(lanekit.reference.moe) with the project's rule, as tests/test_moe.py holds fused_moe.

One world of 4 processes is started once (a module fixture; starting a process costs seconds):
the 2-rank cases run on its subgroup of ranks 0 and 1 (a group other than the default one), the
4-rank cases on the whole world; the ranks save what they computed and each test checks one case
here, against the oracle.

On GPUs, ``LANEKIT_EP_BACKEND=nccl`` runs the same ranks over NCCL, rank r on cuda:r, as many ranks
as there are GPUs up to 4 (NCCL takes one GPU a rank): the cases of more ranks are skipped and say
so. The world-of-one tests stay on gloo in this process."""

from __future__ import annotations

import datetime
import fcntl
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import lanekit
from lanekit.moe import distributed as ep
from lanekit.moe.registry import FUSED_MOE, FUSED_MOE_BWD, FUSED_MOE_DTOPK
from lanekit.reference import moe as ref
from lanekit.runtime.lanes import triton_interpreted
from lanekit.testing import assert_close, compare, generator, poisoned_outputs, randn

BACKEND = os.environ.get("LANEKIT_EP_BACKEND", "gloo")
WORLD = min(4, torch.cuda.device_count()) if BACKEND == "nccl" else 4   # the ranks the fixture starts

# world: ranks; M: tokens per rank; E experts (E / world on each rank), topk, K hidden, N intermediate;
# layer: the whole EPMoE (router included) instead of dispatch + fused_moe + combine on given routing;
# avoid: experts no token picks; lane: the local ops' lane.
CASES = {
    "2 ranks, M 5 and 2, rank 1 receives nothing": dict(world=2, M=(5, 2), E=4, avoid=(2, 3)),
    "2 ranks, M 0 on rank 1": dict(world=2, M=(6, 0), E=4),
    "2 ranks, layer, M 7 and 4": dict(world=2, M=(7, 4), E=4, layer=True),
    "2 ranks, layer, triton lane (interpreted)": dict(world=2, M=(3, 2), E=4, layer=True, lane="triton"),
    "4 ranks, M 5 3 0 7, rank 2's experts and expert 1 idle": dict(world=4, M=(5, 3, 0, 7), E=8,
                                                                    avoid=(1, 4, 5)),
    "4 ranks, layer, M 6 1 4 2, top-3": dict(world=4, M=(6, 1, 4, 2), E=8, topk=3, layer=True),
}
# A dispatch that loses one row (rank 0's first received row zeroed): the checks must catch it.
LOSSY = "2 ranks, a lost row"
CASES[LOSSY] = dict(world=2, M=(4, 3), E=4, lose_a_row=True)


def _spec(name):
    c = dict(topk=2, K=32, N=16, layer=False, avoid=(), lane="reference", lose_a_row=False)
    return {**c, **CASES[name]}


def _problem(name):
    """The whole (unsharded) problem of a case, the same in every process."""
    c = _spec(name)
    g = generator(name)
    M, E, K, N, topk = sum(c["M"]), c["E"], c["K"], c["N"], c["topk"]
    p = dict(x=randn(M, K, dtype=torch.bfloat16, device="cpu", generator=g),
             w1=randn(E, 2 * N, K, dtype=torch.bfloat16, device="cpu", generator=g, scale=K ** -0.5),
             w2=randn(E, K, N, dtype=torch.bfloat16, device="cpu", generator=g, scale=N ** -0.5),
             router=randn(E, K, dtype=torch.bfloat16, device="cpu", generator=g, scale=2.0))
    pool = torch.tensor([e for e in range(E) if e not in c["avoid"]])
    p["ids"] = torch.stack([pool[torch.randperm(len(pool), generator=g)[:topk]] for _ in range(M)]).int()
    p["weights"] = torch.softmax(torch.randn(M, topk, generator=g), -1)
    p["dout"] = randn(M, K, dtype=torch.bfloat16, device="cpu", generator=g)
    return c, p


def _rows(c, rank):
    start = sum(c["M"][:rank])
    return slice(start, start + c["M"][rank])


# ---- what each rank runs ----

def _device(rank):
    return torch.device(f"cuda:{rank}") if BACKEND == "nccl" else torch.device("cpu")


def _experts(received, w1, w2, handle, lane):
    if received.shape[0] == 0:
        return received * 0 + (w1.sum() + w2.sum()) * 0
    ones = torch.ones(received.shape[0], 1, device=received.device)
    return lanekit.moe.fused_moe(received, w1, w2, ones, handle.expert_ids, expert_map=handle.expert_map,
                                 lane=lane)


def _sharded(name, rank, world, group):
    c, p = _problem(name)
    p = {k: v.to(_device(rank)) for k, v in p.items()}
    rows, El = _rows(c, rank), c["E"] // world
    x = p["x"][rows].clone().requires_grad_()
    if c["layer"]:
        layer = ep.EPMoE.from_full(p["router"], p["w1"], p["w2"], c["topk"], group, renormalize=True,
                                   lane=c["lane"])
        out = layer(x)
        out.backward(p["dout"][rows])
        return dict(out=out, dx=x.grad, dw1=layer.w1.grad, dw2=layer.w2.grad, drouter=layer.router.grad)
    weights = p["weights"][rows].clone().requires_grad_()
    w1, w2 = (p[n][rank * El:(rank + 1) * El].clone().requires_grad_() for n in ("w1", "w2"))
    received, counts, handle = ep.ep_dispatch(x, p["ids"][rows], weights, group, c["E"], lane=c["lane"])
    if c["lose_a_row"] and rank == 0:
        received = torch.cat([received[:1] * 0, received[1:]])
    out = ep.ep_combine(_experts(received, w1, w2, handle, c["lane"]), handle)
    out.backward(p["dout"][rows])
    return dict(out=out, dx=x.grad, dw1=w1.grad, dw2=w2.grad, dweights=weights.grad,
                received=received.detach(), counts=counts, expert_ids=handle.expert_ids)


def _bad_calls(rank, group):
    """Errors that need a world of several ranks: each message, or None where nothing was raised."""
    msgs = {}
    device = _device(rank)
    x = torch.zeros(2, 32 if rank == 0 else 16, dtype=torch.bfloat16, device=device)
    ids, weights = torch.zeros(2, 1, dtype=torch.int32, device=device), torch.ones(2, 1, device=device)
    for what, call in (("E not a multiple of the world", lambda: ep.ep_dispatch(x, ids, weights, group, 3)),
                       ("K differs between ranks", lambda: ep.ep_dispatch(x, ids, weights, group, 4))):
        try:
            call()
            msgs[what] = None
        except ValueError as e:
            msgs[what] = str(e)
    return msgs


def _rank_main(rank, world, init, out_dir):
    if BACKEND == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(BACKEND, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        pair = dist.new_group([0, 1])        # every rank takes part in making it
        with poisoned_outputs():             # what a kernel or an all-to-all leaves unwritten is NaN
            _run_cases(rank, pair, out_dir)
        if rank < 2:
            torch.save(_bad_calls(rank, pair), Path(out_dir) / f"errors.{rank}.pt")
    finally:
        dist.destroy_process_group()


def _lane_runs(c) -> bool:
    """Whether a case's lane can run here: gloo's ranks hold CPU tensors, which the Triton lane
    runs only under Triton's interpreter (a GPU machine runs Triton natively)."""
    return c["lane"] != "triton" or BACKEND != "gloo" or triton_interpreted()


def _run_cases(rank, pair, out_dir):
    for name, c in CASES.items():
        if rank >= c["world"] or c["world"] > WORLD or not _lane_runs(_spec(name)):
            continue
        try:
            group = pair if c["world"] == 2 else None
            res = {k: v.detach().cpu() for k, v in _sharded(name, rank, c["world"], group).items()}
        except Exception:
            res = {"error": traceback.format_exc()}
        torch.save(res, Path(out_dir) / f"{name}.{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The folder where the 4 ranks saved every case's results (rank r's as <case>.<r>.pt). Under
    pytest-xdist the workers share one run (the session's temporary root, a lock): the ranks are
    started once per session, not once per worker."""
    if WORLD < 2:
        pytest.skip(f"ranks over {BACKEND} take a GPU each: this machine has {WORLD}")
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out_dir = root / "moe-ep-ranks"
    with open(root / "moe-ep-ranks.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out_dir / "done").exists():
            out_dir.mkdir(exist_ok=True)
            mp.spawn(_rank_main, args=(WORLD, f"file://{out_dir / 'store'}", str(out_dir)), nprocs=WORLD, join=True)
            (out_dir / "done").touch()
    return out_dir


def _results(ranks, name):
    c = _spec(name)
    if c["world"] > WORLD:
        pytest.skip(f"{c['world']} ranks over {BACKEND} need {c['world']} GPUs, this machine has {WORLD}")
    if not _lane_runs(c):
        pytest.skip("the Triton lane on gloo's CPU tensors needs Triton's interpreter; this machine runs "
                    "Triton natively (LANEKIT_EP_BACKEND=nccl runs the case on its GPUs)")
    res = [torch.load(ranks / f"{name}.{r}.pt") for r in range(c["world"])]
    errors = [r["error"] for r in res if "error" in r]
    assert not errors, errors[0]
    return res


# ---- the oracle: the unsharded block in float64 ----

def _oracle(name):
    c, p = _problem(name)
    f64 = {k: v.double().requires_grad_() for k, v in p.items() if k in ("x", "w1", "w2", "router", "weights")}
    if c["layer"]:
        weights, ids = ref.topk_softmax(f64["x"] @ f64["router"].t(), c["topk"], renormalize=True)
        logits32 = p["x"].float() @ p["router"].float().t()
        assert torch.equal(ids, ref.topk_softmax(logits32.double(), c["topk"], True)[1]), \
            "the case's routing is not clear of ties: fp32 and fp64 logits pick other experts"
    else:
        weights, ids = f64["weights"], p["ids"]
    out = ref.fused_moe(f64["x"], f64["w1"], f64["w2"], weights, ids)
    out.backward(p["dout"].double())
    return c, out.detach(), {k: v.grad for k, v in f64.items()}, ids


@pytest.mark.parametrize("name", [n for n in CASES if n != LOSSY])
def test_sharded_output_and_gradients_equal_the_unsharded_oracle(ranks, name):
    res = _results(ranks, name)
    c, out, grads, ids = _oracle(name)
    El = c["E"] // c["world"]
    for rank, r in enumerate(res):
        rows, experts = _rows(c, rank), slice(rank * El, (rank + 1) * El)
        assert r["out"].dtype == torch.bfloat16 and r["out"].shape == (c["M"][rank], c["K"])
        assert_close(r["out"], out[rows], FUSED_MOE)
        assert_close(r["dx"], grads["x"][rows], FUSED_MOE_BWD)
        assert_close(r["dw1"], grads["w1"][experts], FUSED_MOE_BWD)
        assert_close(r["dw2"], grads["w2"][experts], FUSED_MOE_BWD)
        if c["layer"]:
            continue
        assert_close(r["dweights"], grads["weights"][rows], FUSED_MOE_DTOPK)
    if c["layer"]:      # the router is replicated: its gradient is the sum over the ranks
        assert_close(sum(r["drouter"].double() for r in res).bfloat16(), grads["router"], FUSED_MOE_BWD)


@pytest.mark.parametrize("name", [n for n in CASES if not _spec(n)["layer"] and n != LOSSY])
def test_dispatch_delivers_rows_expert_major_then_by_source(ranks, name):
    """Rank r receives, for each local expert, the rows of every source rank in turn, each source's
    in flat slot order (t * topk + s): exact copies of x."""
    res = _results(ranks, name)
    c, p = _problem(name)
    El = c["E"] // c["world"]
    idle = 0
    for rank, r in enumerate(res):
        want, counts = [], []
        for e in range(rank * El, (rank + 1) * El):
            mine = [p["x"][_rows(c, s)][(p["ids"][_rows(c, s)] == e).nonzero()[:, 0]] for s in range(c["world"])]
            want += mine
            counts.append(sum(len(m) for m in mine))
        assert r["counts"].tolist() == counts
        assert torch.equal(r["received"], torch.cat(want).reshape(-1, c["K"]))
        assert r["expert_ids"].shape == (sum(counts), 1)
        assert r["expert_ids"][:, 0].tolist() == [rank * El + i for i, n in enumerate(counts) for _ in range(n)]
        idle += sum(counts) == 0
    assert idle == (name != "2 ranks, M 0 on rank 1")     # the case's rank that receives nothing


def test_a_lost_row_fails_the_checks(ranks):
    """The case whose rank 0 zeroes its first received row (a token's slot lost in transit): the
    same checks as above must fail for it, or they could not catch a dispatch that drops a row."""
    res = _results(ranks, LOSSY)
    c, out, grads, _ = _oracle(LOSSY)
    assert res[0]["received"].shape[0] > 0
    passed = [compare(r[key], want[_rows(c, rank)], tol).ok for rank, r in enumerate(res)
              for key, want, tol in (("out", out, FUSED_MOE), ("dx", grads["x"], FUSED_MOE_BWD))]
    assert not all(passed)


def test_errors_that_need_several_ranks_are_raised_on_every_rank(ranks):
    for rank in range(2):
        msgs = torch.load(ranks / f"errors.{rank}.pt")
        assert "num_experts: expected a multiple of the group's size 2" in msgs["E not a multiple of the world"]
        assert "x: expected the same K and dtype on every rank" in msgs["K differs between ranks"]
        assert "[32, 16]" in msgs["K differs between ranks"]


# ---- a world of one, in this process ----

@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with poisoned_outputs():             # what a kernel or an all-to-all leaves unwritten is NaN
            yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_world_of_one_is_the_unsharded_layer(world_of_one):
    name = "2 ranks, layer, M 7 and 4"      # its problem, run whole on one rank
    c, p = _problem(name)
    layer = ep.EPMoE.from_full(p["router"], p["w1"], p["w2"], c["topk"], world_of_one, lane="reference")
    x = p["x"].clone().requires_grad_()
    out = layer(x)
    out.backward(p["dout"])
    _, want, grads, _ = _oracle(name)
    assert_close(out, want, FUSED_MOE)
    for got, key in ((x.grad, "x"), (layer.w1.grad, "w1"), (layer.w2.grad, "w2"), (layer.router.grad, "router")):
        assert_close(got, grads[key], FUSED_MOE_BWD)
    out3 = layer(p["x"].view(1, -1, c["K"]))             # (..., K) as a transformers block takes it
    assert out3.shape == (1, sum(c["M"]), c["K"]) and torch.equal(out3[0], out)


def test_a_layer_whose_experts_receive_nothing_gets_zero_gradients(world_of_one):
    """No row for this rank's experts (here: no token at all): the weights' gradients are zeros, not
    None, so that the rank's backward runs its all-to-alls with the others'."""
    c, p = _problem("2 ranks, layer, M 7 and 4")
    layer = ep.EPMoE.from_full(p["router"], p["w1"], p["w2"], c["topk"], world_of_one)
    x = p["x"][:0].clone().requires_grad_()
    out = layer(x)
    out.backward(torch.zeros_like(out))
    assert out.shape == (0, c["K"]) and x.grad.shape == (0, c["K"])
    for w in (layer.w1, layer.w2, layer.router):
        assert w.grad is not None and torch.equal(w.grad, torch.zeros_like(w))


def test_the_counts_are_grouped_mms_groups(world_of_one):
    """The received rows are expert-major and counts gives each local expert's rows: grouped_mm +
    SwiGLU + grouped_mm on them, then ep_combine, is the block (the intermediate rounded once)."""
    name = "2 ranks, M 0 on rank 1"          # its problem, run whole on one rank
    c, p = _problem(name)
    rows, counts, handle = ep.ep_dispatch(p["x"], p["ids"], p["weights"], world_of_one, c["E"])
    offs, N = counts.cumsum(0).int(), c["N"]
    h = lanekit.moe.grouped_mm(rows, p["w1"].transpose(1, 2), offs, out_dtype=torch.float32)
    y = lanekit.moe.grouped_mm((F.silu(h[:, :N]) * h[:, N:]).bfloat16(), p["w2"].transpose(1, 2), offs)
    _, want, _, _ = _oracle(name)
    assert_close(ep.ep_combine(y, handle), want, FUSED_MOE)


def _call(world_of_one, **changes):
    kw = dict(x=torch.zeros(3, 8, dtype=torch.bfloat16), topk_ids=torch.zeros(3, 2, dtype=torch.int32),
              topk_weights=torch.ones(3, 2), group=world_of_one, num_experts=4)
    kw["topk_ids"][:, 1] = 1
    return ep.ep_dispatch(**{**kw, **changes})


@pytest.mark.parametrize("changes, error, match", [
    (dict(x=torch.zeros(3, 8, dtype=torch.int32)), TypeError, "x: expected dtype"),
    (dict(x=torch.zeros(3, 8, 1, dtype=torch.bfloat16)), ValueError, "x: expected 2 dimensions"),
    (dict(topk_ids=torch.zeros(3, 2)), TypeError, "topk_ids: expected dtype"),
    (dict(topk_ids=torch.zeros(4, 2, dtype=torch.int32)), ValueError, r"topk_ids: expected \(3, topk\)"),
    (dict(topk_weights=torch.ones(3, 1)), ValueError, "topk_weights: expected shape"),
    (dict(topk_ids=torch.tensor([[0, 4]] * 3, dtype=torch.int32)), ValueError, r"expert ids in \[0, 4\), got 4"),
    (dict(topk_ids=torch.tensor([[-1, 0]] * 3, dtype=torch.int32)), ValueError, "got -1"),
    (dict(num_experts=None), ValueError, "num_experts: expected the global number"),
    (dict(num_experts=2.0), TypeError, "num_experts"),
    (dict(group="world"), TypeError, "group: expected a torch.distributed.ProcessGroup"),
], ids=["x int", "x 3-d", "ids float", "ids rows", "weights shape", "id past E", "negative id",
        "no num_experts", "num_experts float", "group a str"])
def test_bad_arguments_raise_before_any_communication(world_of_one, changes, error, match):
    with pytest.raises(error, match=match):
        _call(world_of_one, **changes)


def test_combine_checks_its_rows_and_handle(world_of_one):
    received, counts, handle = _call(world_of_one)
    assert counts.tolist() == [3, 3, 0, 0] and received.shape == (6, 8)
    with pytest.raises(ValueError, match=r"y: expected shape \(6, 8\)"):
        ep.ep_combine(received[:5], handle)
    with pytest.raises(TypeError, match="y: expected dtype"):
        ep.ep_combine(received.float(), handle)
    with pytest.raises(TypeError, match="handle: expected the EPHandle"):
        ep.ep_combine(received, (counts,))
    assert torch.equal(ep.ep_combine(received + 1, handle), torch.full((3, 8), 2.0, dtype=torch.bfloat16))


def test_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="group: expected an initialised torch.distributed process group"):
        ep.ep_dispatch(torch.zeros(1, 4, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int32),
                       torch.ones(1, 1), None, 2)


def test_the_ep_benchmark_runs_its_path_and_checks_it_over_gloo():
    """benchmarks.moe_ep times the layer on GPUs only: its whole path (routing, dispatch, local
    experts, combine) runs here at tiny shapes, each rank's output checked against the unsharded
    fused_moe, and every routed slot is received by exactly one rank."""
    from benchmarks import moe_ep

    rows = moe_ep.run(2, smoke=True, cuda=False, iters=1)
    assert [r["rank"] for r in rows] == [0, 1] and all(r["checked"] for r in rows)
    slots = sum(r["M"] for r in rows) * moe_ep.SMOKE["topk"]
    assert sum(r["sent_rows"] for r in rows) == sum(r["received_rows"] for r in rows) == slots


def test_the_layer_refuses_a_bad_dtype_lane_or_x_at_the_call(world_of_one):
    # each once passed construction and failed at the first forward, naming fused_moe's
    # hidden_states or with torch's own errors (a RuntimeError of F.linear, an IndexError)
    with pytest.raises(TypeError, match=r"^dtype: expected one of \['torch.bfloat16', 'torch.float16'\]"):
        ep.EPMoE(32, 16, 4, 2, world_of_one, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"^dtype: expected"):
        ep.EPMoE(32, 16, 4, 2, world_of_one, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"^lane: expected one of"):
        ep.EPMoE(32, 16, 4, 2, world_of_one, lane="gpu")
    _, p = _problem("2 ranks, layer, M 7 and 4")
    with pytest.raises(TypeError, match=r"^router: expected dtype"):
        ep.EPMoE.from_full(p["router"].float(), p["w1"].float(), p["w2"].float(), 2, world_of_one)
    layer = ep.EPMoE.from_full(p["router"], p["w1"], p["w2"], 2, world_of_one)
    for x in (p["x"][:, :16], p["x"][0, 0]):
        with pytest.raises(ValueError, match=r"^x: expected \(\.\.\., K\) with K = 32 \(the layer's hidden_size\)"):
            layer(x)
    layer.float()                                                  # parameters cast after construction
    with pytest.raises(TypeError, match=r"^x: expected dtype in \['torch.bfloat16', 'torch.float16', 'torch.float64'\], "
                                        r"got torch.float32"):
        layer(p["x"].float())
