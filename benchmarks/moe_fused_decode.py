"""fused_moe at decode sizes (M = 1 and 16 tokens), bf16, in GB/s of the expert weights the
routing touches (each routed expert's w1 and w2 read once: 3 N K bf16 values per distinct
expert), so that it reads against the copy bandwidth the runner measures: the issue's bar is
>= 80% of it. Timed from CUDA graphs (the GPU's time). Peers: the grouped_mm pipeline of
benchmarks.moe_fused. Only launches without a host sync can be captured: lanekit's kernels with
the align done once ("lanekit kernels"); the public fused_moe joins them once its align is a
Triton kernel (the oracle's align, a stand-in until then, syncs), and the per-expert loop, which
syncs, is in benchmarks.moe_fused.
"""

from __future__ import annotations

import torch

from benchmarks import moe_fused as _prefill

UNIT = "GB/s"
CUDA_GRAPHS = True
TOKENS = (1, 16)


def cases(quick: bool = False):
    for model, shape in _prefill.MODELS.items():
        if quick and model != "qwen3-30b-a3b":
            continue
        for M in TOKENS:
            yield dict(model=model, M=M, **shape)


def name(c) -> str:
    return f"fused_moe decode {c['model']} M={c['M']}"


def bytes_moved(c) -> float:
    _, ids = _prefill.routing(c["M"], c["E"], c["topk"])
    experts = torch.unique(ids).numel()
    return 2.0 * experts * 3 * c["N"] * c["K"]


make_inputs = _prefill.make_inputs
check = _prefill.check


def runners(c, *inputs):
    kernels = _prefill.kernels_only(*inputs)
    return {
        "lanekit kernels": kernels,
        "grouped_mm pipeline": lambda: _prefill.grouped_mm_pipeline(*inputs),
    }
