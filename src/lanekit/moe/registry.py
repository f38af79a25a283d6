"""The mixture-of-experts family's registry entries: sample builders, tolerances, and the
``register`` calls of its ops.

Each sample is in the lanes' normalized form (the keyword arguments of ``lanekit.moe.op``'s lane
functions); its values come from a generator seeded by its name. Routing samples keep their
scores apart (no two within a few fp32 steps unless exactly equal), so that the float64 oracle
and the fp32 kernels choose the same experts.
"""

from __future__ import annotations

import torch

from lanekit.runtime.registry import Op, Sample, register
from lanekit.testing import CODES, EXACT, Tolerance, generator, randn
from lanekit.testing import with_output_grads

# ---- routing: topk_softmax, grouped_topk ----


# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----


# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----

GROUPED_MM = Tolerance(
    name="grouped_mm",
    ulps=1.0,
    fp32_ulps=8.0,
    reason=(
        "16-bit outputs are one rounding of an fp32 sum over K: one step (measured 0.5 on d a). fp32 "
        "outputs carry the fp32 sum's rounding, in an order the tile decides: measured up to 2.3 "
        "steps at K = 96 and 200; eight steps"
    ),
)
GROUPED_MM_DB = Tolerance(
    name="grouped_mm_db",
    ulps=1.0,
    fp32_ulps=16.0,
    reason=(
        "d b is an fp32 sum over a group's rows, rounded once: one step for 16-bit (measured 0.5); "
        "fp32 measured 1.3 steps over 21 rows; sixteen leaves room for groups of thousands of rows"
    ),
)
FUSED_MOE_BWD = Tolerance(
    name="fused_moe_bwd",
    ulps=2.0,
    fp32_ulps=16.0,
    reason=(
        "the backward recomputes the forward's intermediates h = x W1^T and act(gate) * up, and "
        "the output gradient's d act and d h, rounded to the activation dtype as the forward's "
        "kernels round them (the oracle keeps them exact), then sums over rows and slots in fp32: "
        "measured up to 1.18 steps for bf16 and fp16 gradients; two. fp32 inputs: four roundings "
        "of fp32 sums in a row, measured 4.3 steps; sixteen"
    ),
)
FUSED_MOE_DTOPK = Tolerance(
    name="fused_moe_dtopk",
    ulps=2.0,
    fp32_ulps=196608.0,
    reason=(
        "d topk_weights is fp32 whatever the activations' dtype: dout . y over K, with y computed "
        "from the intermediate act(gate) * up rounded to bf16 or fp16 as the forward rounds it, so "
        "its error is the intermediate's: measured up to 1.5 bf16 steps (98858 fp32 steps, one bf16 "
        "step being 2^16 of them); three bf16 steps (196608 fp32 steps). tests/test_moe.py holds "
        "fp32 inputs to sixteen fp32 steps (measured 4.3)"
    ),
)


def _offs_of(counts, device) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def grouped_mm_case(name, device, *, counts, K, N, dtype=torch.bfloat16, out_dtype=None,
                    b_transposed=False, noncontiguous_a=False) -> Sample:
    """A grouped_mm sample: group e holds counts[e] rows. b_transposed: b the (E, K, N) transpose of
    an (E, N, K) tensor, as models store weights; noncontiguous_a: a's rows twice its width apart."""
    g = generator(name)
    E, M = len(counts), sum(counts)
    a = randn(M, K, dtype=dtype, device=device, generator=g)
    if noncontiguous_a:
        a = randn(M, 2 * K, dtype=dtype, device=device, generator=g)[:, :K]
    scale = K ** -0.5
    if b_transposed:
        b = randn(E, N, K, dtype=dtype, device=device, generator=g, scale=scale).transpose(1, 2)
    else:
        b = randn(E, K, N, dtype=dtype, device=device, generator=g, scale=scale)
    return Sample(name, dict(a=a, b=b, offs=_offs_of(counts, device), out_dtype=out_dtype or dtype))


def _grouped_mm_samples(device):
    f16, f32 = torch.float16, torch.float32
    yield grouped_mm_case("E4 rows 9,0,17,11 K48 N40, group 1 empty", device, counts=[9, 0, 17, 11], K=48, N=40)
    yield grouped_mm_case("M_total 1 of E8 (decode)", device, counts=[0, 0, 0, 1, 0, 0, 0, 0], K=64, N=48)
    yield grouped_mm_case("E64, 24 rows (M=3, topk 8) K32 N16", device,
                          counts=[1 if e % 3 == 0 else 0 for e in range(64)][:64], K=32, N=16)
    yield grouped_mm_case("K200 N72 E3 rows 5,30,2", device, counts=[5, 30, 2], K=200, N=72)
    yield grouped_mm_case("E1 rows 17 fp16", device, counts=[17], K=40, N=24, dtype=f16)
    yield grouped_mm_case("b transposed (E, N, K) weights, a non-contiguous", device, counts=[7, 12, 0, 3], K=64,
                          N=48, b_transposed=True, noncontiguous_a=True)
    yield grouped_mm_case("bf16 in, fp32 out K200 N72", device, counts=[13, 4], K=200, N=72, out_dtype=f32)
    yield grouped_mm_case("fp32 K96 N40", device, counts=[3, 0, 21], K=96, N=40, dtype=f32)
    yield grouped_mm_case("M_total 0: every group empty", device, counts=[0, 0, 0], K=32, N=16)
    # average rows of a group past 128: the GPUs' large tiles (lanekit export compiles this launch)
    yield grouped_mm_case("E2 rows 300,212 K64 N128 (large tiles)", device, counts=[300, 212], K=64, N=128)


def _grouped_mm_douts(kw):
    return {"dout": ((kw["a"].shape[0], kw["b"].shape[2]), kw["a"].new_empty(0, dtype=kw["out_dtype"]))}


def fused_moe_case(name, device, *, M, E, topk, K, N, dtype=torch.bfloat16, activation="silu",
                   on_input=False, remote=False, unused=()) -> Sample:
    """A fused_moe backward sample: M tokens each routed to topk distinct experts (never those in
    ``unused``), w1 (E, 2N, K), w2 (E, K, N) at 1/sqrt(fan-in); ``remote``: 2E global experts of which
    every other one is here (expert_map maps the rest to -1)."""
    g = generator(name)
    E_global = 2 * E if remote else E
    pool = [e for e in range(E_global) if e not in unused]
    ids = torch.stack([torch.tensor(pool)[torch.randperm(len(pool), generator=g)[:topk]] for _ in range(M)])
    logits = torch.randn(M, topk, generator=g)
    kw = dict(
        hidden_states=randn(M, K, dtype=dtype, device=device, generator=g),
        w1=randn(E, 2 * N, K, dtype=dtype, device=device, generator=g, scale=K ** -0.5),
        w2=randn(E, K, N, dtype=dtype, device=device, generator=g, scale=N ** -0.5),
        topk_weights=torch.softmax(logits, -1).to(device),
        topk_ids=ids.to(torch.int32).to(device),
        activation=activation, apply_router_weight_on_input=on_input, expert_map=None)
    if remote:
        local = torch.full((E_global,), -1, dtype=torch.int32)
        local[::2] = torch.arange(E, dtype=torch.int32)
        kw["expert_map"] = local.to(device)
    return Sample(name, kw)


def _fused_moe_bwd_samples(device):
    yield fused_moe_case("M5 E4 topk2 K48 N32, expert 3 gets no token", device, M=5, E=4, topk=2, K=48, N=32,
                         unused=(3,))
    yield fused_moe_case("M1 E8 topk2 (decode) gelu", device, M=1, E=8, topk=2, K=32, N=16, activation="gelu")
    yield fused_moe_case("M3 E64 topk8 K32 N16", device, M=3, E=64, topk=8, K=32, N=16)
    yield fused_moe_case("K200 N72 E3 topk2 M6", device, M=6, E=3, topk=2, K=200, N=72)
    yield fused_moe_case("E1 topk1 M7 fp16", device, M=7, E=1, topk=1, K=40, N=24, dtype=torch.float16)
    yield fused_moe_case("expert_map: 4 of 8 experts here, M6 topk2", device, M=6, E=4, topk=2, K=48, N=32,
                         remote=True)
    yield fused_moe_case("router weight on the input, topk1 M9 E4 gelu", device, M=9, E=4, topk=1, K=48, N=32,
                         activation="gelu", on_input=True)
    yield fused_moe_case("fp32 M4 E3 topk2", device, M=4, E=3, topk=2, K=48, N=40, dtype=torch.float32)


def _fused_moe_douts(kw):
    return {"dout": (kw["hidden_states"].shape, kw["hidden_states"])}


_MOE = "lanekit.moe.op"
_MOE_REF = "lanekit.reference.moe"

register(Op(
    name="grouped_mm", family="moe", oracle=f"{_MOE_REF}:grouped_mm",
    lanes={"triton": f"{_MOE}:grouped_mm_triton", "reference": f"{_MOE}:grouped_mm_reference"},
    samples=_grouped_mm_samples, outputs=(("out", GROUPED_MM),),
    doc="(M_total, K) @ (E, K, N) by int32 group ends offs: torch.nn.functional.grouped_mm",
))
register(Op(
    name="grouped_mm.backward", family="moe", oracle=f"{_MOE_REF}:grouped_mm_backward",
    lanes={"triton": f"{_MOE}:grouped_mm_backward_triton", "reference": f"{_MOE}:grouped_mm_backward_reference"},
    samples=lambda device: with_output_grads(_grouped_mm_samples(device), _grouped_mm_douts),
    outputs=(("da", GROUPED_MM), ("db", GROUPED_MM_DB)),
    doc="Gradients of grouped_mm: d a (grouped_mm of dout and b's transpose), d b (a^T dout per group)",
))
register(Op(
    name="fused_moe.backward", family="moe", oracle=f"{_MOE_REF}:fused_moe_backward",
    lanes={"triton": f"{_MOE}:fused_moe_backward_triton", "reference": f"{_MOE}:fused_moe_backward_reference"},
    samples=lambda device: with_output_grads(_fused_moe_bwd_samples(device), _fused_moe_douts),
    outputs=(("dhidden_states", FUSED_MOE_BWD), ("dw1", FUSED_MOE_BWD), ("dw2", FUSED_MOE_BWD),
             ("dtopk_weights", FUSED_MOE_DTOPK)),
    doc="Gradients of fused_moe (vLLM's fused_experts): dX, dW1, dW2, d topk_weights, on the grouped GEMM",
))
