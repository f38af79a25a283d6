"""The mixture-of-experts lanes, and the custom ops that make the Triton lane opaque to
torch.compile (and give fused_moe and grouped_mm their autograd).

Every lane takes the normalized keyword arguments that the public functions produce after
validation; the reference lanes run the oracles of ``lanekit.reference.moe``.
"""

from __future__ import annotations

import torch

from lanekit.reference import moe as ref
from lanekit.runtime import errors as _errors
from lanekit.runtime.custom_ops import call as _call
from lanekit.runtime.custom_ops import custom_op as _custom_op

Tensor = torch.Tensor

# The reference lanes follow the kernels' rule for device-resident indices: an index out of range
# is never used (the same result as the Triton lane) and is recorded in the device's error flag.
# These are the kernels' messages (lanekit.moe.kernels.align, transport, gemm, fused), registered
# here too so that the reference lanes need no Triton import; register() gives one bit a message.
_BAD_EXPERT = _errors.register(
    "moe: a topk_ids entry outside [0, num_experts) (never used as an address: the align dropped "
    "it, the dispatch placed it after every expert's rows)")
_BAD_ROW = _errors.register(
    "moe: an inv_permuted_idx entry outside [0, rows of y) (never used as an address: that slot "
    "contributed nothing to the combine)")
_BAD_OFFS = _errors.register(
    "grouped_mm: offs not non-decreasing, negative, or not ending at M_total (each group's rows were "
    "clamped to [the previous groups' largest end, M_total]; rows past the clamped last end are zero)")
_BAD_EXPERT_ID = _errors.register(
    "fused_moe: an id of topk_ids outside [0, E) (E: expert_map's length when given), or an "
    "expert_map entry outside [-1, E_local): that slot counted zero, nothing was read for it")


def _record(bit: int, bad: Tensor) -> None:
    """OR ``bit`` into the error flag of bad's device if any of ``bad`` is True (no host read;
    nothing on the meta device, which has no values and whose flag check_errors could not read)."""
    if bad.numel() and bad.device.type != "meta":
        _errors.error_flag(bad.device).bitwise_or_(bad.any().to(torch.int32) * bit)

# ---- routing: topk_softmax, grouped_topk ----

def _routing_kernels():
    from lanekit.moe.kernels import routing

    return routing


@_custom_op("lanekit::topk_softmax")
def _topk_softmax_op(gating_output: Tensor, topk: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    return _routing_kernels().topk_softmax_fwd(gating_output=gating_output, topk=topk,
                                               renormalize=renormalize)


@_topk_softmax_op.register_fake
def _(gating_output, topk, renormalize):
    M = gating_output.shape[0]
    return (gating_output.new_empty((M, topk), dtype=torch.float32),
            gating_output.new_empty((M, topk), dtype=torch.int32))


@_custom_op("lanekit::grouped_topk")
def _grouped_topk_op(gating_output: Tensor, topk: int, num_expert_group: int, topk_group: int,
                     renormalize: bool, scoring_func: str, e_score_correction_bias: Tensor | None,
                     routed_scaling_factor: float) -> tuple[Tensor, Tensor]:
    return _routing_kernels().grouped_topk_fwd(
        gating_output=gating_output, topk=topk, num_expert_group=num_expert_group,
        topk_group=topk_group, renormalize=renormalize, scoring_func=scoring_func,
        e_score_correction_bias=e_score_correction_bias, routed_scaling_factor=routed_scaling_factor)


@_grouped_topk_op.register_fake
def _(gating_output, topk, num_expert_group, topk_group, renormalize, scoring_func,
      e_score_correction_bias, routed_scaling_factor):
    M = gating_output.shape[0]
    return (gating_output.new_empty((M, topk), dtype=torch.float32),
            gating_output.new_empty((M, topk), dtype=torch.int32))


def _routing_weights_grad(gating_output, ids, dweights, sigmoid, renormalize, scale):
    """d gating_output of the weights (M, topk) = scale * (renormalized) scores[ids], the ids held
    fixed: autograd of those few torch ops, recomputed in fp32 (the kernels' compute dtype)."""
    with torch.enable_grad():
        x = gating_output.detach().float().requires_grad_()
        scores = torch.sigmoid(x) if sigmoid else torch.softmax(x, dim=-1)
        weights = scores.gather(1, ids.long())
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        (dx,) = torch.autograd.grad(weights * scale, x, dweights.float())
    return dx.to(gating_output.dtype)


def _topk_softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1])
    ctx.renormalize = inputs[2]


def _topk_softmax_backward(ctx, dweights, dids):
    x, ids = ctx.saved_tensors
    return _routing_weights_grad(x, ids, dweights, False, ctx.renormalize, 1.0), None, None


_topk_softmax_op.register_autograd(_topk_softmax_backward, setup_context=_topk_softmax_setup)


def _grouped_topk_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1])
    ctx.sigmoid, ctx.renormalize, ctx.scale = inputs[5] == "sigmoid", inputs[4], inputs[7]


def _grouped_topk_backward(ctx, dweights, dids):
    x, ids = ctx.saved_tensors
    dx = _routing_weights_grad(x, ids, dweights, ctx.sigmoid, ctx.renormalize, ctx.scale)
    return dx, None, None, None, None, None, None, None     # the bias chooses, it does not weigh


_grouped_topk_op.register_autograd(_grouped_topk_backward, setup_context=_grouped_topk_setup)


def topk_softmax_triton(*, gating_output, topk, renormalize=False):
    return _call(_topk_softmax_op, gating_output, topk, renormalize, inputs=(gating_output,))


def topk_softmax_reference(*, gating_output, topk, renormalize=False):
    """The oracle in float64, the weights rounded to fp32 (the kernels' output dtype)."""
    weights, ids = ref.topk_softmax(gating_output.to(torch.float64), topk, renormalize)
    return weights.to(torch.float32), ids


def grouped_topk_triton(*, gating_output, topk, num_expert_group, topk_group, renormalize=False,
                        scoring_func="softmax", e_score_correction_bias=None, routed_scaling_factor=1.0):
    return _call(_grouped_topk_op, gating_output, topk, num_expert_group, topk_group, renormalize,
                 scoring_func, e_score_correction_bias, float(routed_scaling_factor), inputs=(gating_output,))


def grouped_topk_reference(*, gating_output, topk, num_expert_group, topk_group, renormalize=False,
                           scoring_func="softmax", e_score_correction_bias=None,
                           routed_scaling_factor=1.0):
    bias = e_score_correction_bias.to(torch.float64) if e_score_correction_bias is not None else None
    weights, ids = ref.grouped_topk(gating_output.to(torch.float64), topk, num_expert_group, topk_group,
                                    renormalize, scoring_func, bias, routed_scaling_factor)
    return weights.to(torch.float32), ids



# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----

def _align_kernels():
    from lanekit.moe.kernels import align  # imported on first use: see runtime.lanes

    return align


@_custom_op("lanekit::moe_align_block_size")
def _moe_align_op(topk_ids: Tensor, block_size: int, num_experts: int,
                  expert_map: Tensor | None) -> Tensor:
    """The three results in one int32 buffer (one allocation: host time on the decode path)."""
    return _align_kernels().moe_align_block_size_fwd(topk_ids=topk_ids, block_size=block_size,
                                                     num_experts=num_experts, expert_map=expert_map)


@_moe_align_op.register_fake
def _(topk_ids, block_size, num_experts, expert_map):
    padded, blocks = _align_kernels().align_lengths(topk_ids.numel(), block_size, num_experts)
    return topk_ids.new_empty((padded + blocks + 1,))


def moe_align_block_size_triton(*, topk_ids, block_size, num_experts, expert_map=None):
    out = _call(_moe_align_op, topk_ids, block_size, num_experts, expert_map)
    align = _align_kernels()
    return align.split_align_output(out, *align.align_lengths(topk_ids.numel(), block_size, num_experts))


def moe_align_block_size_reference(*, topk_ids, block_size, num_experts, expert_map=None):
    _record(_BAD_EXPERT, (topk_ids < 0) | (topk_ids >= num_experts))    # the oracle drops them
    return ref.moe_align_block_size(topk_ids, block_size, num_experts, expert_map)


def _transport_kernels():
    from lanekit.moe.kernels import transport

    return transport


@_custom_op("lanekit::moe_dispatch")
def _moe_dispatch_op(x: Tensor, topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """(permuted, one int32 buffer of inv_permuted_idx then offs: one allocation for the two)."""
    return _transport_kernels().moe_dispatch_fwd(x=x, topk_ids=topk_ids, num_experts=num_experts)


@_moe_dispatch_op.register_fake
def _(x, topk_ids, num_experts):
    return x.new_empty((topk_ids.numel(), x.shape[1])), topk_ids.new_empty((topk_ids.numel() + num_experts,))


@_custom_op("lanekit::moe_combine")
def _moe_combine_op(y: Tensor, topk_weights: Tensor | None, inv_permuted_idx: Tensor,
                    out_dtype: torch.dtype) -> Tensor:
    return _transport_kernels().moe_combine_fwd(y=y, topk_weights=topk_weights,
                                                inv_permuted_idx=inv_permuted_idx, out_dtype=out_dtype)


@_moe_combine_op.register_fake
def _(y, topk_weights, inv_permuted_idx, out_dtype):
    return y.new_empty((inv_permuted_idx.shape[0], y.shape[1]), dtype=out_dtype)


@_custom_op("lanekit::moe_combine_bwd")
def _moe_combine_bwd_op(dout: Tensor, y: Tensor, topk_weights: Tensor,
                        inv_permuted_idx: Tensor) -> tuple[Tensor, Tensor]:
    return _transport_kernels().moe_combine_bwd(dout=dout, y=y, topk_weights=topk_weights,
                                                inv_permuted_idx=inv_permuted_idx)


@_moe_combine_bwd_op.register_fake
def _(dout, y, topk_weights, inv_permuted_idx):
    return y.new_empty(y.shape), topk_weights.new_empty(topk_weights.shape)


def _dispatch_setup(ctx, inputs, output):
    x, topk_ids, _ = inputs
    _, order = output
    ctx.save_for_backward(order)
    ctx.x_dtype, ctx.routing = x.dtype, tuple(topk_ids.shape)


def _dispatch_backward(ctx, dpermuted, dorder):
    (order,) = ctx.saved_tensors
    inv, _ = _align_kernels().split_order(order, *ctx.routing)
    # each token's rows summed in slot order: a combine with every weight 1
    return _moe_combine_op(dpermuted, None, inv, ctx.x_dtype), None, None


_moe_dispatch_op.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


def _combine_setup(ctx, inputs, output):
    y, topk_weights, inv, _ = inputs
    ctx.save_for_backward(y, topk_weights, inv)


def _combine_backward(ctx, dout):
    y, topk_weights, inv = ctx.saved_tensors
    dy, dw = _moe_combine_bwd_op(dout, y, topk_weights, inv)
    return dy, dw, None, None


_moe_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)


def moe_dispatch_triton(*, x, topk_ids, num_experts):
    permuted, order = _call(_moe_dispatch_op, x, topk_ids, num_experts, inputs=(x,))
    inv, offs = _align_kernels().split_order(order, *topk_ids.shape)
    return permuted, offs, inv


def _ids_last(topk_ids, num_experts):
    """topk_ids with each id outside [0, num_experts) recorded and replaced by num_experts: the
    kernel's place for it, after every expert's rows."""
    bad = (topk_ids < 0) | (topk_ids >= num_experts)
    _record(_BAD_EXPERT, bad)
    return topk_ids.masked_fill(bad, num_experts)


def moe_dispatch_reference(*, x, topk_ids, num_experts):
    permuted, offs, inv = ref.moe_dispatch(x, _ids_last(topk_ids, num_experts), num_experts + 1)
    return permuted, offs[:num_experts], inv


def moe_combine_triton(*, y, topk_weights, inv_permuted_idx):
    return _call(_moe_combine_op, y, topk_weights, inv_permuted_idx, y.dtype, inputs=(y, topk_weights))


def _grads(forward, wrt, douts, **kwargs):
    """Gradients of ``forward``'s outputs (paired with douts) in the tensors named by wrt, by autograd."""
    leaves = {k: kwargs[k].detach().clone().requires_grad_() for k in wrt}
    outs = forward(**{**kwargs, **leaves})
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(o, d) for o, d in zip(outs, douts) if d is not None]
    torch.autograd.backward([o for o, _ in pairs], [d for _, d in pairs])
    return tuple(leaves[k].grad for k in wrt)


def moe_dispatch_backward_triton(*, x, topk_ids, num_experts, dpermuted):
    return _grads(moe_dispatch_triton, ("x",), (dpermuted,), x=x, topk_ids=topk_ids, num_experts=num_experts)[0]


def moe_dispatch_backward_reference(*, x, topk_ids, num_experts, dpermuted):
    return ref.moe_dispatch_backward(x, _ids_last(topk_ids, num_experts), num_experts + 1,
                                     dpermuted.to(torch.float64)).to(x.dtype)


def moe_combine_backward_triton(*, y, topk_weights, inv_permuted_idx, dout):
    return _grads(moe_combine_triton, ("y", "topk_weights"), (dout,), y=y, topk_weights=topk_weights,
                  inv_permuted_idx=inv_permuted_idx)


def _rows_in_range(y, inv_permuted_idx):
    """(y with a zero row appended, inv_permuted_idx with each entry outside [0, R) recorded and
    pointed at that row): such a slot contributes nothing, as in the kernel."""
    R = y.shape[0]
    bad = (inv_permuted_idx < 0) | (inv_permuted_idx >= R)
    _record(_BAD_ROW, bad)
    return torch.cat([y, y.new_zeros((1, y.shape[1]))]), inv_permuted_idx.masked_fill(bad, R)


def moe_combine_backward_reference(*, y, topk_weights, inv_permuted_idx, dout):
    y_ext, inv = _rows_in_range(y.to(torch.float64), inv_permuted_idx)
    dy, dw = ref.moe_combine_backward(y_ext, topk_weights.to(torch.float64), inv, dout.to(torch.float64))
    return dy[:y.shape[0]].to(y.dtype), dw.to(topk_weights.dtype)


def moe_combine_reference(*, y, topk_weights, inv_permuted_idx):
    """The oracle in float64 (the weights unrounded, as the kernel's fp32 sum takes them), rounded
    once to y's dtype."""
    y_ext, inv = _rows_in_range(y.to(torch.float64), inv_permuted_idx)
    return ref.moe_combine(y_ext, topk_weights.to(torch.float64), inv).to(y.dtype)



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
    """The oracle in float64 (a sync: it reads offs), rounded once to out_dtype. Invalid offs
    are recorded and clamped as the kernel clamps them: each end the running max of the ends so
    far, within [0, M_total]."""
    M = a.shape[0]
    _record(_BAD_OFFS, (offs[1:] < offs[:-1]).any() | (offs < 0).any() | (offs[-1:] != M))
    ends = offs.long().clamp(0, M).cummax(0).values.to(torch.int32)
    return ref.grouped_mm(a.to(torch.float64), b.to(torch.float64), ends).to(out_dtype)


def _grads_of(forward, dout, wrt, **kwargs):
    """The gradients of ``forward(**kwargs)`` with respect to the inputs named in ``wrt``."""
    leaves = {name: kwargs[name].detach().requires_grad_() for name in wrt}
    out = forward(**{**kwargs, **leaves})
    return torch.autograd.grad(out, tuple(leaves.values()), dout)


def _grouped_mm_backward_lane(forward, in_f64: bool):
    """The backward lane of grouped_mm through ``forward`` (bound here, not looked up per call),
    in float64 rounded back to the inputs' dtypes with ``in_f64``."""
    def backward(*, dout, **kwargs):
        if not in_f64:
            return _grads_of(forward, dout, ("a", "b"), **kwargs)
        da, db = _grads_of(forward, dout.to(torch.float64), ("a", "b"), **{**kwargs, "out_dtype": torch.float64})
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


def _fused_ids(w1, kw):
    """kw with topk_ids and expert_map recorded if out of range and made safe to index: an id
    outside [0, E_global) or one that expert_map sends outside [-1, E) counts zero, as in the
    kernels (the oracle skips every local id outside [0, E))."""
    ids, emap, E = kw["topk_ids"], kw.get("expert_map"), w1.shape[0]
    num_global = E if emap is None else emap.shape[0]
    bad = ((ids < 0) | (ids >= num_global)).reshape(-1)
    if emap is not None:
        bad = torch.cat([bad, ((emap < -1) | (emap >= E)).reshape(-1)])
        emap = torch.cat([emap, emap.new_full((1,), -1)])       # where the bad ids go: no expert
    _record(_BAD_EXPERT_ID, bad)
    ids = ids.masked_fill((ids < 0) | (ids >= num_global), num_global if emap is not None else -1)
    return {**kw, "topk_ids": ids, "expert_map": emap}


def fused_moe_backward_reference(*, dout, hidden_states, w1, w2, topk_weights, **kwargs):
    """torch.autograd of the oracle in float64, rounded to each input's dtype."""
    kwargs = _fused_ids(w1, kwargs)
    inputs = dict(hidden_states=hidden_states, w1=w1, w2=w2, topk_weights=topk_weights)
    grads = _grads_of(ref.fused_moe, dout.to(torch.float64), _FUSED_MOE_GRADS,
                   **{k: v.to(torch.float64) for k, v in inputs.items()}, **kwargs)
    return tuple(g.to(inputs[name].dtype) for g, name in zip(grads, _FUSED_MOE_GRADS))


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


def _fused_moe_setup(ctx, inputs, output):
    hidden_states, w1, w2, topk_weights, topk_ids, activation, on_input, expert_map = inputs
    ctx.save_for_backward(hidden_states, w1, w2, topk_weights, topk_ids, expert_map)
    ctx.scalars = (activation, on_input)


def _fused_moe_backward(ctx, dout):
    """d hidden_states, d w1, d w2, d topk_weights by ``fused_moe_bwd`` (the grouped GEMM's kernels;
    the forward's intermediates recomputed)."""
    hidden_states, w1, w2, topk_weights, topk_ids, expert_map = ctx.saved_tensors
    grads = _fused_moe_bwd_op(dout, hidden_states, w1, w2, topk_weights, topk_ids, *ctx.scalars, expert_map)
    return (*grads, None, None, None, None)


_fused_moe_op.register_autograd(_fused_moe_backward, setup_context=_fused_moe_setup)


def fused_moe_triton(*, hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
                     apply_router_weight_on_input=False, expert_map=None):
    return _call(_fused_moe_op, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                 apply_router_weight_on_input, expert_map,
                 inputs=(hidden_states, w1, w2, topk_weights))


def fused_moe_reference(*, hidden_states, **kw):
    """The oracle in float64, rounded to hidden_states' dtype."""
    kw = _fused_ids(kw["w1"], kw)
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
    kw = _fused_ids(kw["w1"], kw)
    kw = {k: v.to(torch.float64) if isinstance(v, Tensor) and v.is_floating_point() else v
          for k, v in kw.items()}
    return ref.fused_moe(hidden_states.to(torch.float64), **kw,
                         intermediate_dtype=intermediate_dtype or hidden_states.dtype).to(hidden_states.dtype)


# -- fused_moe, MXFP4 experts (use_mxfp4_w4a16) --

def _fused_mxfp4_kernels():
    from lanekit.moe.kernels import fused_mxfp4  # imported on first use: see runtime.lanes

    return fused_mxfp4


@_custom_op("lanekit::fused_moe_mxfp4")
def _fused_moe_mxfp4_op(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
                        topk_ids: Tensor, activation: str, apply_router_weight_on_input: bool,
                        expert_map: Tensor | None, w1_scale: Tensor, w2_scale: Tensor) -> Tensor:
    from lanekit.runtime.alloc import empty

    out = empty(hidden_states.shape, dtype=hidden_states.dtype, device=hidden_states.device)
    return _fused_mxfp4_kernels().fused_moe_mxfp4_fwd(
        hidden_states=hidden_states, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
        activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
        expert_map=expert_map, out=out, w1_scale=w1_scale, w2_scale=w2_scale)


@_fused_moe_mxfp4_op.register_fake
def _(hidden_states, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input,
      expert_map, w1_scale, w2_scale):
    return hidden_states.new_empty(hidden_states.shape)


# Inference only, as the fp8/int8 experts: no autograd is registered; the public function refuses
# inputs that require grad. Weights (E, 2N, K/2), (E, K, N/2) uint8; scales uint8 e8m0.
def fused_moe_mxfp4_triton(*, hidden_states, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale,
                           activation="silu", apply_router_weight_on_input=False, expert_map=None,
                           intermediate_dtype=None):
    # intermediate_dtype: the oracle's knob; the kernels round the intermediate to x's dtype
    return _call(_fused_moe_mxfp4_op, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                 apply_router_weight_on_input, expert_map, w1_scale, w2_scale)


def fused_moe_mxfp4_reference(*, hidden_states, intermediate_dtype=None, **kw):
    """The oracle in float64 (the e2m1 codes and e8m0 scales exactly), the intermediate rounded to
    hidden_states' dtype where the kernels round it; the result rounded to that dtype."""
    kw = _fused_ids(kw["w1"], kw)
    kw = {k: v.to(torch.float64) if isinstance(v, Tensor) and v.is_floating_point() else v
          for k, v in kw.items()}
    return ref.fused_moe_mxfp4(hidden_states.to(torch.float64), **kw,
                               intermediate_dtype=intermediate_dtype or hidden_states.dtype).to(hidden_states.dtype)
