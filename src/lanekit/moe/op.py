"""The mixture-of-experts lanes, and the custom ops that make the Triton lane opaque to
torch.compile (and give fused_moe and grouped_mm their autograd).

Every lane takes the normalized keyword arguments that the public functions produce after
validation; the reference lanes run the oracles of ``lanekit.reference.moe``.
"""

from __future__ import annotations

import torch

from lanekit.reference import moe as ref
from lanekit.runtime.custom_ops import call as _call
from lanekit.runtime.custom_ops import custom_op as _custom_op

Tensor = torch.Tensor

# ---- routing: topk_softmax, grouped_topk ----


# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----


# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----

# -- fused_moe --

def _fused_kernels():
    from lanekit.moe.kernels import fused  # imported on first use: see runtime.lanes

    return fused


@_custom_op("lanekit::fused_moe")
def _fused_moe_op(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
                  topk_ids: Tensor, activation: str, apply_router_weight_on_input: bool,
                  expert_map: Tensor | None) -> Tensor:
    from lanekit.runtime.alloc import empty

    out = empty(hidden_states.shape, dtype=hidden_states.dtype, device=hidden_states.device)
    return _fused_kernels().fused_moe_fwd(
        hidden_states=hidden_states, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
        activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
        expert_map=expert_map, out=out)


@_fused_moe_op.register_fake
def _(hidden_states, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input,
      expert_map):
    return hidden_states.new_empty(hidden_states.shape)


# fused_moe's autograd: the lead registers helper B's fused_moe_bwd here at merge
# (``_fused_moe_op.register_autograd(backward, setup_context=setup)``); until then the Triton
# lane is forward only (a backward through it raises torch's "no autograd" error).


def fused_moe_triton(*, hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
                     apply_router_weight_on_input=False, expert_map=None):
    return _call(_fused_moe_op, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                 apply_router_weight_on_input, expert_map,
                 inputs=(hidden_states, w1, w2, topk_weights))


def fused_moe_reference(*, hidden_states, **kw):
    """The oracle in float64, rounded to hidden_states' dtype."""
    kw = {k: v.to(torch.float64) if isinstance(v, Tensor) and v.is_floating_point() else v
          for k, v in kw.items()}
    return ref.fused_moe(hidden_states.to(torch.float64), **kw).to(hidden_states.dtype)
