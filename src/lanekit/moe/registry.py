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
from lanekit.testing import CODES, EXACT, Tolerance, every_other, generator, randn
from lanekit.testing import noncontiguous as _noncontiguous
from lanekit.testing import with_output_grads
from lanekit.testing import noncontiguous

# ---- routing: topk_softmax, grouped_topk ----

# The routing weights: fp32 scores (a softmax: exp, a sum over E, a division), then for
# renormalize a sum of topk and a division.
ROUTING = Tolerance(
    name="moe_routing",
    ulps=1.0,
    fp32_ulps=8.0,
    reason=(
        "fp32 weights from an fp32 softmax over E (exp, a sum of E terms, a division) or sigmoid, "
        "then maybe a renormalizing sum and division and the scaling factor: measured up to 2.2 "
        "fp32 steps at E = 72 to 512; eight steps"
    ),
)


def gating_logits(g: torch.Generator, M: int, E: int, dtype, *, ties: bool = False) -> torch.Tensor:
    """(M, E) router logits whose scores stay apart: each row a permutation of (k - E/2) / 16,
    exact in bf16 up to E = 256 and in fp16 and fp32 up to 512 (so every lane and the float64
    oracle choose the same experts). ``ties``: row t has its experts in blocks of t + 1 equal
    logits instead (row 0 all distinct, the last row's largest logits equal in pairs and more)."""
    rows = []
    for t in range(M):
        k = torch.randperm(E, generator=g).float()
        if ties:
            k = torch.div(k, t + 1, rounding_mode="floor")
        rows.append((k - E // 2) / 16)
    x = torch.stack(rows) if M else torch.empty((0, E))
    cast = x.to(dtype)
    if not torch.equal(cast.double(), x.double()):
        raise ValueError(f"gating_logits: E = {E} is not exact in {dtype}")
    return cast


def topk_softmax_case(name, device, *, M, E, topk, dtype=torch.bfloat16, renormalize=False,
                      ties=False, noncontiguous=False) -> Sample:
    x = gating_logits(generator(name), M, E, dtype, ties=ties)
    if noncontiguous:
        x = _noncontiguous(x)
    return Sample(name, dict(gating_output=x.to(device), topk=topk, renormalize=renormalize))


def _topk_softmax_samples(device):
    yield topk_softmax_case("decode M1 E256 topk8", device, M=1, E=256, topk=8)
    yield topk_softmax_case("M3 E64 topk8 fp32 renormalize", device, M=3, E=64, topk=8,
                            dtype=torch.float32, renormalize=True)
    yield topk_softmax_case("M17 E512 topk6 fp16 renormalize", device, M=17, E=512, topk=6,
                            dtype=torch.float16, renormalize=True)
    yield topk_softmax_case("E1 M5 topk1", device, M=5, E=1, topk=1)
    yield topk_softmax_case("M9 E72 topk3, gating_output non-contiguous", device, M=9, E=72, topk=3,
                            noncontiguous=True)
    yield topk_softmax_case("ties: blocks of equal logits, M4 E16 topk4", device, M=4, E=16, topk=4,
                            ties=True)
    yield topk_softmax_case("M0 E8 topk2", device, M=0, E=8, topk=2)


def grouped_topk_case(name, device, *, M, E, topk, groups, topk_group, scoring_func="softmax",
                      bias=False, renormalize=False, scale=1.0, ties=False,
                      dtype=torch.bfloat16) -> Sample:
    g = generator(name)
    x = gating_logits(g, M, E, dtype, ties=ties)
    b = (torch.randperm(E, generator=g).float() / 1024).to(device) if bias else None
    return Sample(name, dict(gating_output=x.to(device), topk=topk, num_expert_group=groups,
                             topk_group=topk_group, renormalize=renormalize,
                             scoring_func=scoring_func, e_score_correction_bias=b,
                             routed_scaling_factor=scale))


def _grouped_topk_samples(device):
    yield grouped_topk_case("DeepSeek-V3 decode: E256 8 groups keep 4 topk8 sigmoid bias x2.5", device,
                            M=1, E=256, topk=8, groups=8, topk_group=4, scoring_func="sigmoid",
                            bias=True, renormalize=True, scale=2.5)
    yield grouped_topk_case("M3 E64 8 groups keep 3 topk6 softmax", device, M=3, E=64, topk=6,
                            groups=8, topk_group=3, dtype=torch.float32)
    yield grouped_topk_case("M5 E72 4 groups of 18 keep 2 topk4 softmax bias renormalize", device,
                            M=5, E=72, topk=4, groups=4, topk_group=2, bias=True, renormalize=True)
    yield grouped_topk_case("M4 E16 groups of one expert keep 4 topk2 sigmoid bias", device, M=4,
                            E=16, topk=2, groups=16, topk_group=4, scoring_func="sigmoid", bias=True)
    yield grouped_topk_case("ties: blocks of equal logits, M4 E32 4 groups keep 2 topk4", device,
                            M=4, E=32, topk=4, groups=4, topk_group=2, ties=True)
    yield grouped_topk_case("E1 M3 one group topk1", device, M=3, E=1, topk=1, groups=1, topk_group=1)



register(Op(
    name="topk_softmax", family="moe", oracle="lanekit.reference.moe:topk_softmax",
    lanes={"triton": "lanekit.moe.op:topk_softmax_triton", "reference": "lanekit.moe.op:topk_softmax_reference"},
    samples=_topk_softmax_samples, outputs=(("topk_weights", ROUTING), ("topk_ids", CODES)),
    doc="vLLM's softmax routing: fp32 softmax, top-k by repeated arg-max (ties: the lower id)",
))
register(Op(
    name="grouped_topk", family="moe", oracle="lanekit.reference.moe:grouped_topk",
    lanes={"triton": "lanekit.moe.op:grouped_topk_triton", "reference": "lanekit.moe.op:grouped_topk_reference"},
    samples=_grouped_topk_samples, outputs=(("topk_weights", ROUTING), ("topk_ids", CODES)),
    doc="DeepSeek-V3's group-limited routing (softmax or sigmoid, correction bias, scaling)",
))


# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----

def routed_ids(g: torch.Generator, M: int, topk: int, E: int, *, experts: int | None = None) -> torch.Tensor:
    """(M, topk) int32: each token's topk distinct experts, drawn from the first ``experts`` of
    the E (all by default; fewer leaves the rest with no token)."""
    pool = experts or E
    return torch.stack([torch.randperm(pool, generator=g)[:topk] for _ in range(M)]).to(torch.int32) \
        if M else torch.empty((0, topk), dtype=torch.int32)


def align_case(name, device, *, M, topk, E, block_size, experts=None, expert_map=False,
               strided=False) -> Sample:
    """A ``moe_align_block_size`` sample. ``expert_map``: the even experts here (local id e / 2),
    the odd ones remote (-1). ``strided``: topk_ids a column slice of a wider (M, 2 topk) tensor."""
    g = generator(name)
    ids = routed_ids(g, M, topk, E, experts=experts)
    if strided:
        ids = torch.cat([ids, ids], dim=1)[:, :topk]
    emap = None
    if expert_map:
        e = torch.arange(E)
        emap = torch.where(e % 2 == 0, e // 2, -1).to(torch.int32).to(device)
    return Sample(name, dict(topk_ids=ids.to(device), block_size=block_size, num_experts=E,
                             expert_map=emap))


def _align_samples(device):
    yield align_case("decode M1 E256 topk8 block 16", device, M=1, topk=8, E=256, block_size=16)
    yield align_case("M3 E64 topk8 block 64", device, M=3, topk=8, E=64, block_size=64)
    yield align_case("M8 E256 topk8 block 128: the largest one-program tile", device, M=8, topk=8,
                     E=256, block_size=128)
    yield align_case("M3 E64 topk8, half the experts remote (expert_map)", device, M=3, topk=8, E=64,
                     block_size=16, expert_map=True)
    yield align_case("E1 M17 topk1 block 16", device, M=17, topk=1, E=1, block_size=16)
    yield align_case("M9 E16 topk2 block 4, experts 5.. with no token", device, M=9, topk=2, E=16,
                     block_size=4, experts=5)
    yield align_case("M7 E5 topk3 block 1, topk_ids a column slice", device, M=7, topk=3, E=5,
                     block_size=1, strided=True)
    yield align_case("M0 E8 topk2", device, M=0, topk=2, E=8, block_size=16)
    yield align_case("M300 E100 topk4 block 32 (chunked sort), expert_map", device, M=300, topk=4,
                     E=100, block_size=32, expert_map=True)
    yield align_case("M40 E1024 topk8 block 16 (chunked sort, 2048 bins)", device, M=40, topk=8,
                     E=1024, block_size=16)


_ALIGN_MOE = "lanekit.moe.op"
_ALIGN_REF = "lanekit.reference.moe"

register(Op(
    name="moe_align_block_size", family="moe", oracle=f"{_ALIGN_REF}:moe_align_block_size",
    lanes={"triton": f"{_ALIGN_MOE}:moe_align_block_size_triton",
           "reference": f"{_ALIGN_MOE}:moe_align_block_size_reference"},
    samples=_align_samples,
    outputs=(("sorted_token_ids", CODES), ("expert_ids", CODES), ("num_tokens_post_padded", CODES)),
    doc="vLLM's align of routed slots by expert, each run padded to the block size (bit for bit)",
))


# The combine's weighted sum of topk rows, in fp32 in slot order, rounded once.
COMBINE = Tolerance(
    name="moe_combine",
    ulps=1.0,
    fp32_ulps=4.0,
    reason=(
        "a sum of topk weighted rows in fp32, rounded once: 16-bit outputs within one step "
        "(measured 0.5); fp32 outputs carry topk roundings of partial sums that may exceed the "
        "result (measured up to 0.4 steps at topk 2 and 8); four steps"
    ),
)


COMBINE_BWD = Tolerance(
    name="moe_combine_bwd",
    ulps=1.0,
    fp32_ulps=16.0,
    reason=(
        "d topk_weights is a dot product over K in fp32 (blocks in order): measured up to 1.4 "
        "fp32 steps at K = 7168; sixteen steps. 16-bit gradients are one rounding"
    ),
)


def dispatch_case(name, device, *, M, topk, E, K, dtype=torch.bfloat16, experts=None,
                  noncontiguous=False) -> Sample:
    g = generator(name)
    ids = routed_ids(g, M, topk, E, experts=experts)
    x = randn(M, K, dtype=dtype, device=device, generator=g)
    if noncontiguous:
        x, ids = _noncontiguous(x), _noncontiguous(ids)
    return Sample(name, dict(x=x, topk_ids=ids.to(device), num_experts=E))


def _dispatch_samples(device):
    yield dispatch_case("decode M1 E256 topk8 K7168", device, M=1, topk=8, E=256, K=7168)
    yield dispatch_case("M3 E64 topk8 K200", device, M=3, topk=8, E=64, K=200)
    yield dispatch_case("M8 E256 topk8 K2048: the largest one-program tile, rows by a launch", device,
                        M=8, topk=8, E=256, K=2048)
    yield dispatch_case("M5 E8 topk2 K72 fp32, experts 3.. with no token", device, M=5, topk=2, E=8,
                        K=72, dtype=torch.float32, experts=3)
    yield dispatch_case("E1 M9 topk1 K40 fp16", device, M=9, topk=1, E=1, K=40, dtype=torch.float16)
    yield dispatch_case("M6 E16 topk4 K96, x and topk_ids non-contiguous", device, M=6, topk=4, E=16,
                        K=96, noncontiguous=True)
    yield dispatch_case("M300 E100 topk4 K16 (chunked sort, gather launch)", device, M=300, topk=4,
                        E=100, K=16)
    yield dispatch_case("M0 E8 topk2 K64", device, M=0, topk=2, E=8, K=64)


def combine_case(name, device, *, M, topk, E, K, dtype=torch.bfloat16, extra_rows=0,
                 noncontiguous=False) -> Sample:
    """y holds M * topk (+ extra_rows) expert outputs; inv_permuted_idx is a dispatch's."""
    g = generator(name)
    ids = routed_ids(g, M, topk, E)
    inv = torch.sort(ids.reshape(-1).long(), stable=True).indices.argsort().view(M, topk).to(torch.int32)
    y = randn(M * topk + extra_rows, K, dtype=dtype, device=device, generator=g)
    if noncontiguous:
        y = _noncontiguous(y)
    weights = torch.rand(M, topk, generator=g).to(device)
    return Sample(name, dict(y=y, topk_weights=weights, inv_permuted_idx=inv.to(device)))


def _combine_samples(device):
    yield combine_case("decode M1 topk8 K7168", device, M=1, topk=8, E=256, K=7168)
    yield combine_case("M3 E64 topk8 K200", device, M=3, topk=8, E=64, K=200)
    yield combine_case("M5 topk8 K72 fp32", device, M=5, topk=8, E=16, K=72, dtype=torch.float32)
    yield combine_case("M7 topk2 K33 fp16, y with 5 rows past the slots", device, M=7, topk=2, E=4,
                       K=33, dtype=torch.float16, extra_rows=5)
    yield combine_case("E1 M4 topk1 K64, y non-contiguous", device, M=4, topk=1, E=1, K=64,
                       noncontiguous=True)


register(Op(
    name="moe_dispatch", family="moe", oracle=f"{_ALIGN_REF}:moe_dispatch",
    lanes={"triton": f"{_ALIGN_MOE}:moe_dispatch_triton", "reference": f"{_ALIGN_MOE}:moe_dispatch_reference"},
    samples=_dispatch_samples,
    outputs=(("permuted", EXACT), ("offs", CODES), ("inv_permuted_idx", CODES)),
    doc="The rows of x gathered in expert order (exact), grouped_mm's offs, the inverse permutation",
))
register(Op(
    name="moe_combine", family="moe", oracle=f"{_ALIGN_REF}:moe_combine",
    lanes={"triton": f"{_ALIGN_MOE}:moe_combine_triton", "reference": f"{_ALIGN_MOE}:moe_combine_reference"},
    samples=_combine_samples, outputs=(("out", COMBINE),),
    doc="The weighted sum of each token's expert rows, fp32 in slot order, rounded once",
))



def _dispatch_backward_samples(device):
    """The forward's samples but the chunked one (its sort is the forward's; its backward is a
    combine, which the others cover)."""
    samples = (s for s in _dispatch_samples(device) if s.kwargs["x"].shape[0] <= 64)
    return with_output_grads(samples,
                             lambda kw: {"dpermuted": ((kw["topk_ids"].numel(), kw["x"].shape[1]), kw["x"])})


def _combine_backward_samples(device):
    return with_output_grads(_combine_samples(device),
                             lambda kw: {"dout": ((kw["topk_weights"].shape[0], kw["y"].shape[1]), kw["y"])})


register(Op(
    name="moe_dispatch.backward", family="moe", oracle=f"{_ALIGN_REF}:moe_dispatch_backward",
    lanes={"triton": f"{_ALIGN_MOE}:moe_dispatch_backward_triton",
           "reference": f"{_ALIGN_MOE}:moe_dispatch_backward_reference"},
    samples=_dispatch_backward_samples, outputs=(("dx", COMBINE),),
    doc="Gradient of moe_dispatch in x (by autograd): each token's rows summed in slot order",
))
register(Op(
    name="moe_combine.backward", family="moe", oracle=f"{_ALIGN_REF}:moe_combine_backward",
    lanes={"triton": f"{_ALIGN_MOE}:moe_combine_backward_triton",
           "reference": f"{_ALIGN_MOE}:moe_combine_backward_reference"},
    samples=_combine_backward_samples, outputs=(("dy", COMBINE), ("dtopk_weights", COMBINE_BWD)),
    doc="Gradients of moe_combine (by autograd): dy rows, d topk_weights (fp32 dot over K)",
))


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


def fused_moe_bwd_case(name, device, *, M, E, topk, K, N, dtype=torch.bfloat16, activation="silu",
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
    yield fused_moe_bwd_case("M5 E4 topk2 K48 N32, expert 3 gets no token", device, M=5, E=4, topk=2, K=48, N=32,
                         unused=(3,))
    yield fused_moe_bwd_case("M1 E8 topk2 (decode) gelu", device, M=1, E=8, topk=2, K=32, N=16, activation="gelu")
    yield fused_moe_bwd_case("M3 E64 topk8 K32 N16", device, M=3, E=64, topk=8, K=32, N=16)
    yield fused_moe_bwd_case("K200 N72 E3 topk2 M6", device, M=6, E=3, topk=2, K=200, N=72)
    yield fused_moe_bwd_case("E1 topk1 M7 fp16", device, M=7, E=1, topk=1, K=40, N=24, dtype=torch.float16)
    yield fused_moe_bwd_case("expert_map: 4 of 8 experts here, M6 topk2", device, M=6, E=4, topk=2, K=48, N=32,
                         remote=True)
    yield fused_moe_bwd_case("router weight on the input, topk1 M9 E4 gelu", device, M=9, E=4, topk=1, K=48, N=32,
                         activation="gelu", on_input=True)
    yield fused_moe_bwd_case("fp32 M4 E3 topk2", device, M=4, E=3, topk=2, K=48, N=40, dtype=torch.float32)


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



# -- fused_moe --

FUSED_MOE = Tolerance(
    name="fused_moe",
    ulps=2.0,
    reason=(
        "the kernels round the expert MLP's intermediate act(gate) * up to the activation dtype "
        "between the two GEMMs (as vLLM does), the oracle does not: measured up to 1.05 steps "
        "over 144 bf16/fp16 silu/gelu cases (K 200, N 72; top-2 to top-8), where the same "
        "computation by PyTorch in the activation dtype errs by up to 3.2 steps; two steps, "
        "within FlashAttention's rule (no more than twice PyTorch's error)"
    ),
)


def fused_moe_case(name, device, *, M, K, N, E, topk, dtype=torch.bfloat16, activation="silu",
                   on_input=False, remote_half=False, idle_expert=None, equal_weights=False,
                   weights_dtype=torch.float32, transposed_weights=False, strided_x=False,
                   strided_map=False) -> Sample:
    """A ``fused_moe`` sample from readable parameters. Routing is the top-k of a softmax over
    random logits (E_global = 2E with ``remote_half``: the odd global experts live elsewhere);
    ``idle_expert`` gets no token; ``equal_weights`` gives every slot 1 / topk;
    ``transposed_weights`` passes w1 and w2 as transposed views (strides other than packed),
    ``strided_x`` x as every other row of a buffer; ``strided_map`` (with ``remote_half``) the
    expert_map as a view of every other element."""
    g = generator(name)
    x = randn(M, K, dtype=dtype, device=device, generator=g)
    if strided_x:
        x = noncontiguous(x)
    w1 = randn(E, 2 * N, K, dtype=dtype, device=device, generator=g, scale=K ** -0.5)
    w2 = randn(E, K, N, dtype=dtype, device=device, generator=g, scale=N ** -0.5)
    if transposed_weights:
        w1 = w1.transpose(1, 2).contiguous().transpose(1, 2)
        w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    num_global = 2 * E if remote_half else E
    logits = randn(M, num_global, dtype=torch.float32, device="cpu", generator=g, scale=3.0)
    if idle_expert is not None:
        logits[:, idle_expert] = -float("inf")
    scores, ids = torch.sort(torch.softmax(logits, -1), dim=-1, descending=True, stable=True)
    weights, ids = scores[:, :topk], ids[:, :topk].to(torch.int32)
    if equal_weights:
        weights = torch.full_like(weights, 1.0 / topk)
    expert_map = None
    if remote_half:
        local = torch.full((num_global,), -1, dtype=torch.int32)
        local[0::2] = torch.arange(E, dtype=torch.int32)
        expert_map = every_other(local.to(device)) if strided_map else local.to(device)
    return Sample(name, dict(hidden_states=x, w1=w1, w2=w2, topk_weights=weights.to(weights_dtype).to(device),
                             topk_ids=ids.to(device), activation=activation,
                             apply_router_weight_on_input=on_input, expert_map=expert_map))


def _fused_moe_samples(device):
    yield fused_moe_case("M 1 (decode), E 8 top-2", device, M=1, K=64, N=32, E=8, topk=2)
    yield fused_moe_case("M 3, E 64 top-8", device, M=3, K=64, N=32, E=64, topk=8)
    yield fused_moe_case("K 200, N 72, M 17, E 8 top-2", device, M=17, K=200, N=72, E=8, topk=2)
    yield fused_moe_case("E 1 top-1, M 5", device, M=5, K=48, N=40, E=1, topk=1)
    yield fused_moe_case("expert 2 of 4 gets no token, M 9 top-2", device, M=9, K=64, N=32, E=4,
                         topk=2, idle_expert=2)
    yield fused_moe_case("equal top-k weights, M 6 top-4", device, M=6, K=64, N=32, E=8, topk=4,
                         equal_weights=True)
    yield fused_moe_case("expert_map: half the experts remote, M 11 top-3", device, M=11, K=64, N=32,
                         E=4, topk=3, remote_half=True)
    yield fused_moe_case("expert_map a strided view, half remote, M 11 top-3", device, M=11, K=64, N=32,
                         E=4, topk=3, remote_half=True, strided_map=True)
    yield fused_moe_case("router weight on the input, top-1, M 7", device, M=7, K=64, N=48, E=4,
                         topk=1, on_input=True)
    yield fused_moe_case("gelu, M 13 top-2", device, M=13, K=80, N=40, E=4, topk=2, activation="gelu")
    yield fused_moe_case("fp16, routing weights in fp16, M 10 top-2", device, M=10, K=96, N=64,
                         E=4, topk=2, dtype=torch.float16, weights_dtype=torch.float16)
    yield fused_moe_case("transposed w1 and w2 views, strided x, M 8 top-2", device, M=8, K=64, N=32,
                         E=4, topk=2, transposed_weights=True, strided_x=True)
    yield fused_moe_case("M 300 (the prefill tiles), K 144, N 48, E 4 top-2", device, M=300, K=144, N=48,
                         E=4, topk=2)
    yield fused_moe_case("M 300, K 136, N 40 (unaligned: the smaller tiles)", device, M=300, K=136,
                         N=40, E=4, topk=2)
    yield fused_moe_case("M 0", device, M=0, K=64, N=32, E=4, topk=2)


register(Op(
    name="fused_moe", family="moe", oracle="lanekit.reference.moe:fused_moe",
    lanes={"triton": "lanekit.moe.op:fused_moe_triton", "reference": "lanekit.moe.op:fused_moe_reference"},
    samples=_fused_moe_samples, outputs=(("out", FUSED_MOE),),
    doc="vLLM's fused_experts: act(x w1_gate) * (x w1_up) w2 per routed expert, weighted sum per token",
))


# -- fused_moe, quantized experts (fp8 W8A8, int8 W8A16) --

FUSED_MOE_QUANT = Tolerance(
    name="fused_moe_quant",
    ulps=2.0,
    reason=(
        "against the oracle of the same quantization (fused_moe_quantized: the same e4m3/int8 "
        "codes of x, the weights and the bf16-rounded intermediate, dequantized exactly): the "
        "kernels differ only by their fp32 accumulation, which can move the intermediate's bf16 "
        "rounding, and with it an e4m3 code, in rare cases. Measured 0.50 steps (the output's own "
        "rounding; the reference lane too) on every "
        "registered sample interpreted (all four schemes, K 200 N 72, top-8, remote experts, "
        "static scales, M 300); two steps as fused_moe's, for the GPU's other summation order"
    ),
)

_QUANT_SCHEMES = {
    # scheme: (fused_moe keywords)
    "fp8 per tensor": dict(use_fp8_w8a8=True),
    "fp8 per token x channel": dict(use_fp8_w8a8=True, per_channel_quant=True),
    "fp8 128x128 blocks": dict(use_fp8_w8a8=True, block_shape=[128, 128]),
    "int8 W8A16": dict(use_int8_w8a16=True),
}


def quantize_weight(w: torch.Tensor, scheme: str):
    """Codes and scales of expert weights w (E, rows, cols) for a scheme of _QUANT_SCHEMES (as a
    checkpoint stores them: scale = amax / qmax per expert, output channel or 128 x 128 block).
    One expert at a time: the fp32 temporaries of a whole DeepSeek-V3 layer (256 experts) would
    take tens of GiB."""
    parts = [_quantize_expert(w[e], scheme) for e in range(w.shape[0])]
    return torch.stack([c for c, _ in parts]), torch.stack([s for _, s in parts])


def _quantize_expert(w: torch.Tensor, scheme: str):
    """quantize_weight for one expert's (rows, cols)."""
    from lanekit.reference.numerics import QUANT_MAX, to_codes

    R, C = w.shape
    dtype = torch.int8 if scheme == "int8 W8A16" else torch.float8_e4m3fn
    wf = w.float()
    if scheme == "fp8 128x128 blocks":
        rb, cb = -(-R // 128), -(-C // 128)
        p = torch.nn.functional.pad(wf, (0, cb * 128 - C, 0, rb * 128 - R)).view(rb, 128, cb, 128)
        scale = p.abs().amax((1, 3)) / QUANT_MAX[dtype]
        codes = to_codes(p / scale[:, None, :, None], dtype).view(rb * 128, cb * 128)[:R, :C]
        return codes.contiguous(), scale
    if scheme == "fp8 per tensor":
        scale = wf.abs().amax() / QUANT_MAX[dtype]
        return to_codes(wf / scale, dtype), scale
    scale = wf.abs().amax(1, keepdim=True) / QUANT_MAX[dtype]
    return to_codes(wf / scale, dtype), scale


def fused_moe_quant_case(name, device, *, scheme, static_scales=False, **case) -> Sample:
    """A quantized ``fused_moe`` sample: :func:`fused_moe_case`'s (bf16 unless told), its weights
    quantized per ``scheme`` (a key of _QUANT_SCHEMES); ``static_scales`` (per tensor): a1_scale
    and a2_scale given (x's amax / 448, and 0.01: some intermediate values saturate)."""
    kw = dict(fused_moe_case(name, device, **case).kwargs)
    w1, s1 = quantize_weight(kw["w1"], scheme)
    w2, s2 = quantize_weight(kw["w2"], scheme)
    kw.update(w1=w1, w2=w2, w1_scale=s1, w2_scale=s2, use_fp8_w8a8=False, use_int8_w8a16=False,
              per_channel_quant=False, block_shape=None, a1_scale=None, a2_scale=None,
              intermediate_dtype=kw["hidden_states"].dtype)
    kw.update(_QUANT_SCHEMES[scheme])
    if static_scales:
        x = kw["hidden_states"].float()
        kw["a1_scale"] = (x.abs().amax() / 448).reshape(1)
        kw["a2_scale"] = torch.full((1,), 0.01, dtype=torch.float32, device=device)
    return Sample(name, kw)


def _fused_moe_quant_samples(device):
    for scheme in _QUANT_SCHEMES:
        yield fused_moe_quant_case(f"{scheme}: M 1 (decode), E 8 top-2", device, scheme=scheme, M=1,
                                   K=64, N=32, E=8, topk=2)
        yield fused_moe_quant_case(f"{scheme}: M 3, E 64 top-8", device, scheme=scheme, M=3, K=64,
                                   N=32, E=64, topk=8)
        yield fused_moe_quant_case(f"{scheme}: K 200, N 72, M 17 top-2", device, scheme=scheme, M=17,
                                   K=200, N=72, E=8, topk=2)
        yield fused_moe_quant_case(f"{scheme}: K 272, N 160 (partial 128 blocks), M 6", device,
                                   scheme=scheme, M=6, K=272, N=160, E=2, topk=2)
        yield fused_moe_quant_case(f"{scheme}: expert 2 of 4 gets no token, M 9", device, scheme=scheme,
                                   M=9, K=64, N=32, E=4, topk=2, idle_expert=2)
        yield fused_moe_quant_case(f"{scheme}: expert_map, half remote, M 11 top-3", device,
                                   scheme=scheme, M=11, K=64, N=32, E=4, topk=3, remote_half=True)
        yield fused_moe_quant_case(f"{scheme}: E 1 top-1, M 5", device, scheme=scheme, M=5, K=48,
                                   N=40, E=1, topk=1)
    yield fused_moe_quant_case("fp8 per tensor: expert_map a strided view, half remote, M 11 top-3", device,
                               scheme="fp8 per tensor", M=11, K=64, N=32, E=4, topk=3, remote_half=True,
                               strided_map=True)
    yield fused_moe_quant_case("fp8 per tensor: static a1/a2 scales, M 8", device,
                               scheme="fp8 per tensor", static_scales=True, M=8, K=64, N=32, E=4, topk=2)
    yield fused_moe_quant_case("fp8 128x128 blocks: router weight on the input, gelu, M 7", device,
                               scheme="fp8 128x128 blocks", M=7, K=64, N=48, E=4, topk=1, on_input=True,
                               activation="gelu")
    yield fused_moe_quant_case("fp8 128x128 blocks: fp16, M 10", device, scheme="fp8 128x128 blocks",
                               M=10, K=96, N=64, E=4, topk=2, dtype=torch.float16)
    yield fused_moe_quant_case("int8 W8A16: fp16, M 10", device, scheme="int8 W8A16", M=10, K=96,
                               N=64, E=4, topk=2, dtype=torch.float16)
    yield fused_moe_quant_case("fp8 128x128 blocks: M 300 (the prefill tiles), K 256, N 128", device,
                               scheme="fp8 128x128 blocks", M=300, K=256, N=128, E=4, topk=2)
    yield fused_moe_quant_case("fp8 per tensor: M 0", device, scheme="fp8 per tensor", M=0, K=64,
                               N=32, E=4, topk=2)
    yield fused_moe_quant_case("fp8 128x128 blocks: M 0", device, scheme="fp8 128x128 blocks", M=0,
                               K=64, N=32, E=4, topk=2)


register(Op(
    name="fused_moe_quant", family="moe", oracle="lanekit.reference.moe:fused_moe",
    lanes={"triton": "lanekit.moe.op:fused_moe_quant_triton",
           "reference": "lanekit.moe.op:fused_moe_quant_reference"},
    samples=_fused_moe_quant_samples, outputs=(("out", FUSED_MOE_QUANT),),
    doc="fused_moe with quantized experts: fp8 e4m3 W8A8 (per tensor, per token x channel, 128x128 "
        "blocks; activations quantized on the fly) and int8 W8A16 (per-channel)",
))


# -- fused_moe, MXFP4 experts (use_mxfp4_w4a16: gpt-oss's experts) --

FUSED_MOE_MXFP4 = Tolerance(
    name="fused_moe_mxfp4",
    ulps=2.0,
    reason=(
        "against the oracle of the same weights (fused_moe_mxfp4: the e2m1 codes times their e8m0 "
        "scales, exactly, and the x-dtype-rounded intermediate): the kernels differ only by their "
        "fp32 summation (per 32 of K, then scaled), which can move the intermediate's 16-bit "
        "rounding by one step in rare cases. Measured 0.50 steps (the output's own rounding; the "
        "reference lane too) on every registered sample interpreted; two steps as fused_moe's and "
        "fused_moe_quant's, for the GPU's other summation order"
    ),
)


def mxfp4_expert_weights(E, R, C, device, g, zero_row=None):
    """Random MXFP4 expert weights as a checkpoint stores them: codes (E, R, C/2) uint8 (two e2m1
    codes a byte, element 2i low) and e8m0 bytes (E, R, C/32), sized so that a row times a unit
    vector is O(1) (e2m1's rms is ~3.3: scale ~ 1 / (3.3 sqrt(C))); every row's last group of 32
    gets the largest scale (two steps above the others'); ``zero_row`` (expert 0's row): codes 0
    and scale byte 0 (2^-127, e8m0's smallest: no zero scale exists)."""
    codes = torch.randint(0, 16, (E, R, C), generator=g)
    base = 127 - max(1, round(torch.log2(torch.tensor(3.3 * C ** 0.5)).item()))
    scale = base - torch.randint(0, 3, (E, R, C // 32), generator=g)
    scale[..., -1] = base + 2
    if zero_row is not None:
        codes[0, zero_row] = 0
        scale[0, zero_row] = 0
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed.to(device), scale.to(torch.uint8).to(device)


def fused_moe_mxfp4_case(name, device, *, zero_row=None, **case) -> Sample:
    """An MXFP4 ``fused_moe`` sample: :func:`fused_moe_case`'s routing and x, its weights replaced
    by :func:`mxfp4_expert_weights` (K and N multiples of 32)."""
    kw = dict(fused_moe_case(name, device, **case).kwargs)
    g = generator(name, "mxfp4")
    E, K, N = kw["w1"].shape[0], case["K"], case["N"]
    w1, s1 = mxfp4_expert_weights(E, 2 * N, K, device, g, zero_row)
    w2, s2 = mxfp4_expert_weights(E, K, N, device, g, zero_row)
    kw.update(w1=w1, w2=w2, w1_scale=s1, w2_scale=s2, intermediate_dtype=kw["hidden_states"].dtype)
    return Sample(name, kw)


def _fused_moe_mxfp4_samples(device):
    yield fused_moe_mxfp4_case("M 1 (decode), K 32 (one scale group), E 8 top-2", device, M=1, K=32,
                               N=32, E=8, topk=2)
    yield fused_moe_mxfp4_case("M 17, K 96, N 160 (past the tile), a zero weight row, top-2", device,
                               M=17, K=96, N=160, E=4, topk=2, zero_row=5)
    yield fused_moe_mxfp4_case("expert 2 of 4 gets no token, M 9 top-2", device, M=9, K=64, N=32,
                               E=4, topk=2, idle_expert=2)
    yield fused_moe_mxfp4_case("expert_map, half remote, M 11 top-3", device, M=11, K=64, N=32, E=4,
                               topk=3, remote_half=True)
    yield fused_moe_mxfp4_case("expert_map a strided view, half remote, M 11 top-3", device, M=11, K=64, N=32,
                               E=4, topk=3, remote_half=True, strided_map=True)
    yield fused_moe_mxfp4_case("fp16, gelu, M 10 top-2", device, M=10, K=64, N=64, E=4, topk=2,
                               dtype=torch.float16, activation="gelu")
    yield fused_moe_mxfp4_case("router weight on the input, top-1, M 7", device, M=7, K=64, N=96,
                               E=4, topk=1, on_input=True)
    yield fused_moe_mxfp4_case("M 300 (the prefill tiles), K 128, N 64", device, M=300, K=128, N=64,
                               E=4, topk=2)
    yield fused_moe_mxfp4_case("M 0", device, M=0, K=64, N=32, E=4, topk=2)


register(Op(
    name="fused_moe_mxfp4", family="moe", oracle="lanekit.reference.moe:fused_moe_mxfp4",
    lanes={"triton": "lanekit.moe.op:fused_moe_mxfp4_triton",
           "reference": "lanekit.moe.op:fused_moe_mxfp4_reference"},
    samples=_fused_moe_mxfp4_samples, outputs=(("out", FUSED_MOE_MXFP4),),
    doc="fused_moe with MXFP4 experts (gpt-oss's: e2m1 codes, an e8m0 scale per 32; bf16/fp16 "
        "activations; vLLM's mxfp4_w4a16), dequantized in the GEMMs' B loads",
))
