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
from lanekit.testing import noncontiguous

# ---- routing: topk_softmax, grouped_topk ----


# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----


# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----

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
                   weights_dtype=torch.float32, transposed_weights=False, strided_x=False) -> Sample:
    """A ``fused_moe`` sample from readable parameters. Routing is the top-k of a softmax over
    random logits (E_global = 2E with ``remote_half``: the odd global experts live elsewhere);
    ``idle_expert`` gets no token; ``equal_weights`` gives every slot 1 / topk;
    ``transposed_weights`` passes w1 and w2 as transposed views (strides other than packed),
    ``strided_x`` x as every other row of a buffer."""
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
        expert_map = local.to(device)
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
