"""The linear-attention lanes, and the custom ops that make the Triton lane opaque to torch.compile.

Every lane takes the normalized keyword arguments that the public functions produce after
validation (``scale`` a float, the normalized run's key sum ``initial_z`` apart from the state) and
returns a tuple of tensors: (o, final state) for simple GLA, (o, final state, final key sum) for
linear attention, an empty tensor for a state not asked for.

Two forward custom ops (the chunked and the step-by-step kernels, both ``(o, final state)`` of the
decayed recurrence, g None for plain linear attention) share one backward custom op: the chunked
backward, which computes the gradients of either, since both compute the same function. The
normalized form of linear attention is one run of the forward on the values with a column of ones
appended (that column's output is the denominator ``scale * q_t . z_t``, its state the key sum z),
then a division: its gradients come through the same ops; the backward then computes in fp32
(the gradient of the fp32 output is fp32), since dq's two parts cancel.
"""

from __future__ import annotations

import torch

from lanekit.reference import linear_attn as ref
from lanekit.runtime.custom_ops import call as _call, custom_op as _custom_op


def _sizes(q, v, initial_state, cu_seqlens):
    B, T, H, K = q.shape
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    return B, T, H, K, v.shape[3], N


def _forward(kernel, q, k, v, g, initial_state, cu_seqlens, scale, output_final_state, fp32_out):
    """A forward launcher's (o, final state), T = 0 (nothing to launch) handled here."""
    B, T, H, K, V, N = _sizes(q, v, initial_state, cu_seqlens)
    out_dtype = torch.float32 if fp32_out else q.dtype
    if T == 0:
        final = q.new_empty(0, dtype=torch.float32)
        if output_final_state:
            final = (initial_state.float().clone() if initial_state is not None
                     else q.new_zeros((N, H, K, V), dtype=torch.float32))
        return q.new_empty((B, 0, H, V), dtype=out_dtype), final
    return kernel(q=q, k=k, v=v, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens, scale=scale,
                  output_final_state=output_final_state, out_dtype=out_dtype)


def _forward_fake(q, k, v, g, initial_state, cu_seqlens, scale, output_final_state, fp32_out):
    B, T, H, K, V, N = _sizes(q, v, initial_state, cu_seqlens)
    return (q.new_empty((B, T, H, V), dtype=torch.float32 if fp32_out else q.dtype),
            q.new_empty((N, H, K, V) if output_final_state else (0,), dtype=torch.float32))


@_custom_op("lanekit::linear_attn_chunk_fwd")
def _chunk_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, scale: float, output_final_state: bool, fp32_out: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    from lanekit.linear_attn.kernels import chunk_fwd  # imported on first use: see runtime.lanes

    return _forward(chunk_fwd, q, k, v, g, initial_state, cu_seqlens, scale, output_final_state, fp32_out)


@_custom_op("lanekit::linear_attn_recurrent_fwd")
def _recurrent_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, scale: float, output_final_state: bool, fp32_out: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    from lanekit.linear_attn.kernels import recurrent_fwd

    return _forward(recurrent_fwd, q, k, v, g, initial_state, cu_seqlens, scale, output_final_state, fp32_out)


_chunk_fwd_op.register_fake(_forward_fake)
_recurrent_fwd_op.register_fake(_forward_fake)


@torch.library.custom_op("lanekit::linear_attn_chunk_bwd", mutates_args=())
def _chunk_bwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, do: torch.Tensor, dht: torch.Tensor | None, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from lanekit.linear_attn.kernels import chunk_bwd

    if q.shape[1] == 0:  # no token: the final state is the initial one
        dh0 = q.new_empty(0)
        if initial_state is not None:
            dh0 = dht.to(initial_state.dtype).clone() if dht is not None else torch.zeros_like(initial_state)
        dg = torch.empty_like(g) if g is not None else q.new_empty(0)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dg, dh0
    return chunk_bwd(q=q, k=k, v=v, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens, scale=scale,
                     do=do, dht=dht)


@_chunk_bwd_op.register_fake
def _(q, k, v, g, initial_state, cu_seqlens, do, dht, scale):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(g) if g is not None else q.new_empty(0),
            torch.empty_like(initial_state) if initial_state is not None else q.new_empty(0))


def _setup_context(ctx, inputs, output):
    q, k, v, g, initial_state, cu_seqlens, scale, output_final_state, fp32_out = inputs
    ctx.save_for_backward(q, k, v, g, initial_state, cu_seqlens)
    ctx.scale = scale
    ctx.has_final = output[1].numel() > 0


def _backward(ctx, do, dht):
    q, k, v, g, initial_state, cu_seqlens = ctx.saved_tensors
    if not ctx.has_final:
        dht = None
    dq, dk, dv, dg, dh0 = _chunk_bwd_op(q, k, v, g, initial_state, cu_seqlens, do, dht, ctx.scale)
    return (dq, dk, dv, dg if g is not None else None, dh0 if initial_state is not None else None,
            None, None, None, None)


_chunk_fwd_op.register_autograd(_backward, setup_context=_setup_context)
_recurrent_fwd_op.register_autograd(_backward, setup_context=_setup_context)

# ----------------------------------------------------------------------------------------- lanes


def _run(op, q, k, v, g, initial_state, cu_seqlens, scale, output_final_state, fp32_out=False):
    return _call(op, q, k, v, g, initial_state, cu_seqlens, float(scale), bool(output_final_state),
                 bool(fp32_out), inputs=(q, k, v, g, initial_state))


# The chunked kernels (the forward, and the backward of both lanes) take exp of differences of
# in-chunk cumulative sums of g: a g of -inf made inf - inf (NaN) and a huge negative one cancelled
# the decays of the tokens after it in its chunk (g = -1e30: every later output wrong). A decay
# exp(g) below exp(G_FLOOR) (1e-13) is zero at fp32's resolution, so g is floored there: no result
# moves beyond that, the sums stay finite, the gradient of a floored g is 0 (its true value is
# below 1e-13 of the others'), and NaN stays NaN.
G_FLOOR = -30.0


def _floored(g):
    return g.clamp(min=G_FLOOR) if g is not None else None


def chunk_simple_gla_triton(*, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
    return _run(_chunk_fwd_op, q, k, v, _floored(g), initial_state, cu_seqlens, scale, output_final_state)


def fused_recurrent_simple_gla_triton(*, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
    # the recurrent kernel takes any g (it multiplies by exp(g) step by step): floored only for the
    # chunked backward, so that decode without grad pays no extra launch
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, initial_state))
    return _run(_recurrent_fwd_op, q, k, v, _floored(g) if grad else g, initial_state, cu_seqlens, scale,
                output_final_state)


def _linear_attn(op, *, q, k, v, scale, initial_state, initial_z, output_final_state, normalize, cu_seqlens):
    if not normalize:
        o, final = _run(op, q, k, v, None, initial_state, cu_seqlens, scale, output_final_state)
        return o, final, q.new_empty(0, dtype=torch.float32)
    # One run on the values with a column of ones appended: its output column is the denominator
    # scale * q_t . z_t, its state column the key sum z. One run (not two) so that the backward sums
    # dq's two parts, which cancel (o_t does not change when q_t is scaled), in fp32 before rounding.
    V = v.shape[3]
    v1 = torch.cat((v, q.new_ones((*q.shape[:3], 1))), -1)                                 # (B, T, H, V + 1)
    h1 = None
    if initial_state is not None or initial_z is not None:
        N, H, K = (initial_state.shape[:3] if initial_state is not None
                   else (initial_z.shape[0], initial_z.shape[2], initial_z.shape[3]))
        s0 = initial_state.float() if initial_state is not None else q.new_zeros((N, H, K, V), dtype=torch.float32)
        z0 = initial_z[:, 0, :, :, None].float() if initial_z is not None else s0.new_zeros((N, H, K, 1))
        h1 = torch.cat((s0, z0), -1)                                                         # (N, H, K, V + 1)
    o1, final1 = _run(op, q, k, v1, None, h1, cu_seqlens, scale, output_final_state, fp32_out=True)
    o = (o1[..., :V] / (o1[..., V:] + ref.NORMALIZE_EPS)).to(q.dtype)
    if not output_final_state:
        empty = q.new_empty(0, dtype=torch.float32)
        return o, empty, empty
    return o, final1[..., :V], final1[..., V][:, None]                                      # z (N, 1, H, K)


def chunk_linear_attn_triton(**kw):
    return _linear_attn(_chunk_fwd_op, **kw)


def fused_recurrent_linear_attn_triton(**kw):
    return _linear_attn(_recurrent_fwd_op, **kw)


def _f64(kwargs: dict) -> dict:
    return {n: t.to(torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            for n, t in kwargs.items()}


def _cast(out, q):
    """The oracle's outputs in the lanes' dtypes: o in q's, states in fp32 (fp64 for fp64 inputs)."""
    state = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (out[0].to(q.dtype), *(t.to(state) for t in out[1:]))


def chunk_simple_gla_reference(**kw):
    """The oracle as a lane: computes in float64, returns o in q's dtype, the state in fp32."""
    return _cast(ref.chunk_simple_gla(**_f64(kw)), kw["q"])


def fused_recurrent_simple_gla_reference(**kw):
    return _cast(ref.fused_recurrent_simple_gla(**_f64(kw)), kw["q"])


def chunk_linear_attn_reference(**kw):
    return _cast(ref.chunk_linear_attn(**_f64(kw)), kw["q"])


def fused_recurrent_linear_attn_reference(**kw):
    return _cast(ref.fused_recurrent_linear_attn(**_f64(kw)), kw["q"])


# The backward as the registry checks it. The Triton lane: autograd through the custom ops, the
# way training reaches them. The reference lane: autograd through the float64 oracle. Both return
# the gradients of every differentiable input (reference.linear_attn.*_INPUTS order) in their
# inputs' dtypes, an empty tensor for an input that is None.


def _in_dtypes(grads, kw, names):
    return tuple(gr.to(kw[n].dtype) if kw.get(n) is not None else gr for gr, n in zip(grads, names))


def chunk_simple_gla_backward_triton(*, do, dht, **kw):
    return ref.gradients(chunk_simple_gla_triton, (do, dht), ref.SIMPLE_GLA_INPUTS, **kw)


def fused_recurrent_simple_gla_backward_triton(*, do, dht, **kw):
    return ref.gradients(fused_recurrent_simple_gla_triton, (do, dht), ref.SIMPLE_GLA_INPUTS, **kw)


def chunk_linear_attn_backward_triton(*, do, dht, dzt, **kw):
    return ref.gradients(chunk_linear_attn_triton, (do, dht, dzt), ref.LINEAR_ATTN_INPUTS, **kw)


def fused_recurrent_linear_attn_backward_triton(*, do, dht, dzt, **kw):
    return ref.gradients(fused_recurrent_linear_attn_triton, (do, dht, dzt), ref.LINEAR_ATTN_INPUTS, **kw)


def chunk_simple_gla_backward_reference(**kw):
    return _in_dtypes(ref.chunk_simple_gla_backward(**_f64(kw)), kw, ref.SIMPLE_GLA_INPUTS)


def fused_recurrent_simple_gla_backward_reference(**kw):
    return _in_dtypes(ref.fused_recurrent_simple_gla_backward(**_f64(kw)), kw, ref.SIMPLE_GLA_INPUTS)


def chunk_linear_attn_backward_reference(**kw):
    return _in_dtypes(ref.chunk_linear_attn_backward(**_f64(kw)), kw, ref.LINEAR_ATTN_INPUTS)


def fused_recurrent_linear_attn_backward_reference(**kw):
    return _in_dtypes(ref.fused_recurrent_linear_attn_backward(**_f64(kw)), kw, ref.LINEAR_ATTN_INPUTS)
