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


# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----


def _gemm():
    from lanekit.moe.kernels import gemm  # imported on first use: see runtime.lanes

    return gemm


@_custom_op("lanekit::grouped_mm")
def _grouped_mm_op(a: Tensor, b: Tensor, offs: Tensor, out_dtype: torch.dtype) -> Tensor:
    from lanekit.runtime.alloc import empty

    out = empty((a.shape[0], b.shape[2]), dtype=out_dtype, device=a.device)
    return _gemm().grouped_mm_fwd(a=a, b=b, offs=offs, out=out)


@_grouped_mm_op.register_fake
def _(a, b, offs, out_dtype):
    return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype)


@_custom_op("lanekit::grouped_mm_bwd")
def _grouped_mm_bwd_op(a: Tensor, grad: Tensor, offs: Tensor, num_groups: int, out_dtype: torch.dtype) -> Tensor:
    """d b (E, K, N): each group's a^T @ grad."""
    from lanekit.runtime.alloc import empty

    db = empty((num_groups, a.shape[1], grad.shape[1]), dtype=out_dtype, device=a.device)
    return _gemm().grouped_mm_bwd(a=a, grad=grad, offs=offs, db=db)


@_grouped_mm_bwd_op.register_fake
def _(a, grad, offs, num_groups, out_dtype):
    return a.new_empty((num_groups, a.shape[1], grad.shape[1]), dtype=out_dtype)


def _grouped_mm_setup(ctx, inputs, output):
    a, b, offs, _ = inputs
    ctx.save_for_backward(a, b, offs)


def _grouped_mm_backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    da = db = None
    if ctx.needs_input_grad[0]:   # grad @ b[e]^T: b's transpose as a view, no copy
        da = _grouped_mm_op(grad, b.transpose(1, 2), offs, a.dtype)
    if ctx.needs_input_grad[1]:
        db = _grouped_mm_bwd_op(a, grad, offs, b.shape[0], b.dtype)
    return da, db, None, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_mm_triton(*, a, b, offs, out_dtype):
    return _call(_grouped_mm_op, a, b, offs, out_dtype, inputs=(a, b))


def grouped_mm_reference(*, a, b, offs, out_dtype):
    """The oracle in float64 (a sync: it reads offs), rounded once to out_dtype."""
    return ref.grouped_mm(a.to(torch.float64), b.to(torch.float64), offs).to(out_dtype)


def _grads(forward, dout, wrt, **kwargs):
    """The gradients of ``forward(**kwargs)`` with respect to the inputs named in ``wrt``."""
    leaves = {name: kwargs[name].detach().requires_grad_() for name in wrt}
    out = forward(**{**kwargs, **leaves})
    return torch.autograd.grad(out, tuple(leaves.values()), dout)


def _grouped_mm_backward_lane(forward, in_f64: bool):
    """The backward lane of grouped_mm through ``forward`` (bound here, not looked up per call),
    in float64 rounded back to the inputs' dtypes with ``in_f64``."""
    def backward(*, dout, **kwargs):
        if not in_f64:
            return _grads(forward, dout, ("a", "b"), **kwargs)
        da, db = _grads(forward, dout.to(torch.float64), ("a", "b"), **{**kwargs, "out_dtype": torch.float64})
        return da.to(kwargs["a"].dtype), db.to(kwargs["b"].dtype)
    return backward


grouped_mm_backward_triton = _grouped_mm_backward_lane(grouped_mm_triton, in_f64=False)
grouped_mm_backward_reference = _grouped_mm_backward_lane(grouped_mm_reference, in_f64=True)


# ---- fused_moe backward: the gradients of fused_moe, composed of the grouped GEMM's kernels ----

_FUSED_MOE_GRADS = ("hidden_states", "w1", "w2", "topk_weights")


@_custom_op("lanekit::fused_moe_bwd")
def _fused_moe_bwd_op(dout: Tensor, hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
                      topk_ids: Tensor, activation: str, apply_router_weight_on_input: bool,
                      expert_map: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _gemm().fused_moe_bwd(
        dout=dout, hidden_states=hidden_states, w1=w1, w2=w2, topk_weights=topk_weights,
        topk_ids=topk_ids, activation=activation,
        apply_router_weight_on_input=apply_router_weight_on_input, expert_map=expert_map)


@_fused_moe_bwd_op.register_fake
def _(dout, hidden_states, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input,
      expert_map):
    return tuple(t.new_empty(t.shape) for t in (hidden_states, w1, w2, topk_weights))


def fused_moe_bwd(*, dout, hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
                  apply_router_weight_on_input=False, expert_map=None):
    """(d hidden_states (M, K), d w1 (E, 2N, K), d w2 (E, K, N), d topk_weights (M, topk)): the
    gradients of ``fused_moe`` (vLLM's ``fused_experts``, the oracle ``lanekit.reference.moe.
    fused_moe``) for the output's gradient ``dout`` (M, K), on the Triton kernels of the grouped
    GEMM (``lanekit.moe.kernels.gemm.fused_moe_bwd``), through a custom op (torch.compile-safe).
    Takes the arguments fused_moe validated; d topk_ids has no gradient. The autograd of the
    fused_moe forward op calls this."""
    return _fused_moe_bwd_op(dout, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                             apply_router_weight_on_input, expert_map)


def fused_moe_backward_triton(*, dout, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                              apply_router_weight_on_input, expert_map):
    return _fused_moe_bwd_op.direct(dout, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                                    apply_router_weight_on_input, expert_map)


def fused_moe_backward_reference(*, dout, hidden_states, w1, w2, topk_weights, **kwargs):
    """torch.autograd of the oracle in float64, rounded to each input's dtype."""
    inputs = dict(hidden_states=hidden_states, w1=w1, w2=w2, topk_weights=topk_weights)
    grads = _grads(ref.fused_moe, dout.to(torch.float64), _FUSED_MOE_GRADS,
                   **{k: v.to(torch.float64) for k, v in inputs.items()}, **kwargs)
    return tuple(g.to(inputs[name].dtype) for g, name in zip(grads, _FUSED_MOE_GRADS))


@_custom_op("lanekit::fused_moe_reference_standin")
def _fused_moe_standin_op(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
                          topk_ids: Tensor, activation: str, apply_router_weight_on_input: bool,
                          expert_map: Tensor | None) -> Tensor:
    """A STAND-IN for fused_moe's forward op (helper C's kernel; the lead registers fused_moe_bwd as
    its autograd at merge): the oracle in float64, rounded to hidden_states' dtype, with
    fused_moe_bwd as its autograd, so that tests can train through the backward before the merge."""
    f64 = torch.float64
    out = ref.fused_moe(hidden_states.to(f64), w1.to(f64), w2.to(f64), topk_weights.to(f64), topk_ids,
                        activation, apply_router_weight_on_input, expert_map)
    return out.to(hidden_states.dtype)


@_fused_moe_standin_op.register_fake
def _(hidden_states, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input, expert_map):
    return hidden_states.new_empty(hidden_states.shape)


def _fused_moe_standin_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5], inputs[7])
    ctx.scalars = inputs[5:7]


def _fused_moe_standin_backward(ctx, dout):
    hidden_states, w1, w2, topk_weights, topk_ids, expert_map = ctx.saved_tensors
    grads = _fused_moe_bwd_op(dout, hidden_states, w1, w2, topk_weights, topk_ids, *ctx.scalars, expert_map)
    return (*grads, None, None, None, None)


_fused_moe_standin_op.register_autograd(_fused_moe_standin_backward, setup_context=_fused_moe_standin_setup)
