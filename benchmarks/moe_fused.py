"""fused_moe at prefill sizes (M = 256 and 4096 tokens), bf16, in TFLOP/s of the expert MLPs'
GEMMs (6 M topk N K): lanekit beside a pipeline of torch's grouped_mm (sort by expert, gather,
grouped_mm, SwiGLU, grouped_mm, weighted sum: CUTLASS on sm90), the per-expert loop as
transformers writes it, and that loop under torch.compile. Shapes: Mixtral-8x7B, Qwen3-30B-A3B,
DeepSeek-V3 (E, topk, K, N). Timed eagerly (the per-expert loop syncs, so no CUDA graph; at these
sizes the host's launches are hidden behind the GPU's work). "lanekit kernels" reuses one align
(moe_align_block_size) across calls: the three kernels alone. The issue's bar: lanekit >= 1.0x
the grouped_mm pipeline.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import lanekit.moe as moe
from lanekit.moe.registry import FUSED_MOE
from lanekit.reference import moe as ref
from lanekit.testing import compare

UNIT = "TFLOP/s"
CUDA_GRAPHS = False
MODELS = {
    "mixtral-8x7b": dict(E=8, topk=2, K=4096, N=14336),
    "qwen3-30b-a3b": dict(E=128, topk=8, K=2048, N=768),
    "deepseek-v3": dict(E=256, topk=8, K=7168, N=2048),
}
TOKENS = (256, 4096)


def cases(quick: bool = False):
    for model, shape in MODELS.items():
        if quick and model != "qwen3-30b-a3b":
            continue
        for M in TOKENS:
            yield dict(model=model, M=M, **shape)


def name(c) -> str:
    return f"fused_moe {c['model']} M={c['M']}"


def flops(c) -> float:
    return 6.0 * c["M"] * c["topk"] * c["N"] * c["K"]


@functools.lru_cache(maxsize=None)
def routing(M: int, E: int, topk: int):
    """(topk_weights fp32, topk_ids int32) on the CPU: the top-k of a softmax over random logits,
    the same in every run (benchmarks.moe_fused_decode counts the experts they touch)."""
    g = torch.Generator().manual_seed(M * 1000 + E)
    return ref.topk_softmax(torch.randn(M, E, generator=g), topk)


def make_inputs(c, device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    M, E, K, N = c["M"], c["E"], c["K"], c["N"]
    x = torch.randn(M, K, generator=g, device=device, dtype=torch.bfloat16)
    w1 = torch.randn(E, 2 * N, K, generator=g, device=device, dtype=torch.bfloat16) * K ** -0.5
    w2 = torch.randn(E, K, N, generator=g, device=device, dtype=torch.bfloat16) * N ** -0.5
    weights, ids = (t.to(device) for t in routing(M, E, c["topk"]))
    return x, w1, w2, weights, ids


def kernels_only(x, w1, w2, weights, ids):
    """lanekit's three kernels with the align done once, outside the timed calls."""
    from lanekit.moe.kernels import fused

    aligned = fused._align(ids, fused.fused_moe_block_m(x, w1, w2), w1.shape[0], None)
    out = torch.empty_like(x)

    def run():
        return fused.fused_moe_fwd(hidden_states=x, w1=w1, w2=w2, topk_weights=weights, topk_ids=ids,
                                   activation="silu", apply_router_weight_on_input=False,
                                   expert_map=None, out=out, aligned=aligned)
    return run


def grouped_mm_pipeline(x, w1, w2, weights, ids):
    """Sort the M * topk slots by expert, gather x, grouped_mm, SwiGLU, grouped_mm, and the
    weighted sum back per token; no host sync."""
    M, topk = ids.shape
    E, N = w1.shape[0], w2.shape[2]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    h = F.grouped_mm(x[order // topk], w1.transpose(1, 2), offs=offs)
    y = F.grouped_mm(F.silu(h[:, :N]) * h[:, N:], w2.transpose(1, 2), offs=offs)
    rows = torch.empty_like(y)
    rows[order] = y
    return (rows.view(M, topk, -1).float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def expert_loop(x, w1, w2, weights, ids):
    """The per-expert loop as transformers' Mixtral / Qwen2-MoE blocks write it."""
    E, N = w1.shape[0], w2.shape[2]
    out = torch.zeros_like(x)
    mask = F.one_hot(ids.long(), num_classes=E).permute(2, 1, 0)      # (E, topk, M)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist():
        slot, token = torch.where(mask[e])
        h = x[token] @ w1[e].t()
        y = (F.silu(h[:, :N]) * h[:, N:]) @ w2[e].t()
        out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
    return out


def check(c, x, w1, w2, weights, ids) -> str | None:
    """lanekit against the float64 oracle on the first 8 tokens (their experts only); the
    kernels-only path equal to the public function bit for bit."""
    out = moe.fused_moe(x, w1, w2, weights, ids, lane="triton")
    if not torch.equal(out, kernels_only(x, w1, w2, weights, ids)()):
        return "the kernels with one align differ from fused_moe"
    t = slice(0, 8)
    used = torch.unique(ids[t].long())
    local = torch.full((w1.shape[0],), -1, dtype=torch.long, device=x.device)
    local[used] = torch.arange(used.numel(), device=x.device)
    expected = ref.fused_moe(x[t].double(), w1[used].double(), w2[used].double(), weights[t].double(),
                             local[ids[t].long()].int())
    result = compare(out[t], expected, FUSED_MOE)
    return None if result.ok else result.detail


def runners(c, *inputs):
    compiled = torch.compile(expert_loop)
    kernels = kernels_only(*inputs)
    return {
        "lanekit": lambda: moe.fused_moe(*inputs),
        "lanekit kernels": kernels,
        "grouped_mm pipeline": lambda: grouped_mm_pipeline(*inputs),
        "expert loop": lambda: expert_loop(*inputs),
        "expert loop compiled": lambda: compiled(*inputs),
    }
