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

# ---- routing: topk_softmax, grouped_topk ----


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


_MOE = "lanekit.moe.op"
_REF = "lanekit.reference.moe"

register(Op(
    name="moe_align_block_size", family="moe", oracle=f"{_REF}:moe_align_block_size",
    lanes={"triton": f"{_MOE}:moe_align_block_size_triton",
           "reference": f"{_MOE}:moe_align_block_size_reference"},
    samples=_align_samples,
    outputs=(("sorted_token_ids", CODES), ("expert_ids", CODES), ("num_tokens_post_padded", CODES)),
    doc="vLLM's align of routed slots by expert, each run padded to the block size (bit for bit)",
))



# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----
