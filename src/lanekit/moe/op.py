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


# -- fused_moe, quantized experts (fp8 W8A8, int8 W8A16) --

def _fused_quant_kernels():
    from lanekit.moe.kernels import fused_quant  # imported on first use: see runtime.lanes

    return fused_quant


@_custom_op("lanekit::fused_moe_quant")
def _fused_moe_quant_op(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
                        topk_ids: Tensor, activation: str, apply_router_weight_on_input: bool,
                        expert_map: Tensor | None, use_fp8_w8a8: bool, per_channel_quant: bool,
                        block_shape: list[int] | None, w1_scale: Tensor, w2_scale: Tensor,
                        a1_scale: Tensor | None, a2_scale: Tensor | None) -> Tensor:
    from lanekit.runtime.alloc import empty

    out = empty(hidden_states.shape, dtype=hidden_states.dtype, device=hidden_states.device)
    return _fused_quant_kernels().fused_moe_quant_fwd(
        hidden_states=hidden_states, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
        activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
        expert_map=expert_map, out=out, use_fp8_w8a8=use_fp8_w8a8,
        per_channel_quant=per_channel_quant, block_shape=block_shape, w1_scale=w1_scale,
        w2_scale=w2_scale, a1_scale=a1_scale, a2_scale=a2_scale)


@_fused_moe_quant_op.register_fake
def _(hidden_states, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input,
      expert_map, use_fp8_w8a8, per_channel_quant, block_shape, w1_scale, w2_scale, a1_scale,
      a2_scale):
    return hidden_states.new_empty(hidden_states.shape)


# Inference only: no autograd is registered (a backward through it raises torch's error); the
# public function refuses inputs that require grad.
def fused_moe_quant_triton(*, hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
                           apply_router_weight_on_input=False, expert_map=None, use_fp8_w8a8=False,
                           use_int8_w8a16=False, per_channel_quant=False, block_shape=None,
                           w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None,
                           intermediate_dtype=None):
    # intermediate_dtype: the oracle's knob; the kernels round the intermediate to x's dtype
    return _call(_fused_moe_quant_op, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                 apply_router_weight_on_input, expert_map, bool(use_fp8_w8a8), bool(per_channel_quant),
                 None if block_shape is None else list(block_shape), w1_scale, w2_scale, a1_scale,
                 a2_scale)


def fused_moe_quant_reference(*, hidden_states, intermediate_dtype=None, **kw):
    """The oracle in float64 (codes and scales exactly), the intermediate rounded to
    hidden_states' dtype where the kernels round it; the result rounded to that dtype."""
    kw = {k: v.to(torch.float64) if isinstance(v, Tensor) and v.is_floating_point() else v
          for k, v in kw.items()}
    return ref.fused_moe(hidden_states.to(torch.float64), **kw,
                         intermediate_dtype=intermediate_dtype or hidden_states.dtype).to(hidden_states.dtype)
