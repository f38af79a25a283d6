"""The mixture-of-experts lanes, and the custom ops that make the Triton lane opaque to
torch.compile (and give fused_moe and grouped_mm their autograd).

Every lane takes the normalized keyword arguments that the public functions produce after
validation; the reference lanes run the oracles of ``lanekit.reference.moe``.
"""

from __future__ import annotations

import torch

from lanekit.reference import moe as ref
from lanekit.runtime.custom_ops import call as _call, custom_op as _custom_op

Tensor = torch.Tensor

# ---- routing: topk_softmax, grouped_topk ----


# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----

def _align_kernels():
    from lanekit.moe.kernels import align  # imported on first use: see runtime.lanes

    return align


@_custom_op("lanekit::moe_align_block_size")
def _moe_align_op(topk_ids: Tensor, block_size: int, num_experts: int,
                  expert_map: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    return _align_kernels().moe_align_block_size_fwd(topk_ids=topk_ids, block_size=block_size,
                                                     num_experts=num_experts, expert_map=expert_map)


@_moe_align_op.register_fake
def _(topk_ids, block_size, num_experts, expert_map):
    numel = topk_ids.numel()
    padded = numel + num_experts * (block_size - 1)
    padded = min(numel * block_size, padded) if numel < num_experts else padded
    return (topk_ids.new_empty((padded,)), topk_ids.new_empty(((padded + block_size - 1) // block_size,)),
            topk_ids.new_empty((1,)))


def moe_align_block_size_triton(*, topk_ids, block_size, num_experts, expert_map=None):
    return _call(_moe_align_op, topk_ids, block_size, num_experts, expert_map)


def moe_align_block_size_reference(*, topk_ids, block_size, num_experts, expert_map=None):
    return ref.moe_align_block_size(topk_ids, block_size, num_experts, expert_map)



# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----
