"""The fused layers' lanes, and the custom ops that make the Triton lane opaque to torch.compile.

Each public function in ``lanekit.layers`` validates its arguments, then calls ``<op>_<lane>`` here
with keyword arguments. The Triton lanes go through ``torch.library`` custom ops with fakes and
autograd; the reference lanes run the oracle in float64 and round to the inputs' dtypes.
A custom op returns tensors only: an empty tensor stands for "absent".
"""

from __future__ import annotations

import math

import torch

from lanekit.reference import layers as ref
from lanekit.runtime.custom_ops import call as _call, custom_op as _custom_op

Tensor = torch.Tensor


def _kernels():
    from lanekit.layers import kernels  # imported on first use: see runtime.lanes

    return kernels


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    return t if t is not None else _empty(like)


# ---- norms: RMSNorm, LayerNorm, AdaLN share one kernel pair ----

@_custom_op("lanekit::norm_fwd")
def _norm_fwd_op(x: Tensor, residual: Tensor | None, gate: Tensor | None, scale: Tensor | None,
                 shift: Tensor | None, weight: Tensor | None, bias: Tensor | None, eps: float,
                 offset: float, is_rms: bool, rows_per_mod: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    y, h, mean, rstd = _kernels().norm_fwd(
        x=x, weight=weight, bias=bias, eps=eps, offset=offset, is_rms=is_rms, residual=residual,
        gate=gate, scale=scale, shift=shift, rows_per_mod=rows_per_mod)
    return y, _or_empty(h, x), mean, rstd


@_norm_fwd_op.register_fake
def _(x, residual, gate, scale, shift, weight, bias, eps, offset, is_rms, rows_per_mod):
    rows = math.prod(x.shape[:-1])
    return (x.new_empty(x.shape), x.new_empty(x.shape) if residual is not None else x.new_empty(0),
            x.new_empty((rows, 3), dtype=torch.float32), x.new_empty((rows,), dtype=torch.float32))


@_custom_op("lanekit::norm_bwd")
def _norm_bwd_op(dy: Tensor, dh: Tensor | None, x: Tensor, residual: Tensor | None,
                 gate: Tensor | None, scale: Tensor | None, shift: Tensor | None,
                 weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor,
                 offset: float, is_rms: bool, rows_per_mod: int) -> list[Tensor]:
    grads = _kernels().norm_bwd(
        dy=dy, dh_out=dh, x=x, weight=weight, bias=bias, mean=mean, rstd=rstd, offset=offset,
        is_rms=is_rms, residual=residual, gate=gate, scale=scale, shift=shift,
        rows_per_mod=rows_per_mod)
    return [_or_empty(g, x) for g in grads]


@_norm_bwd_op.register_fake
def _(dy, dh, x, residual, gate, scale, shift, weight, bias, mean, rstd, offset, is_rms, rows_per_mod):
    def like(t):
        return t.new_empty(t.shape) if t is not None else x.new_empty(0)

    return [like(x), like(residual), like(weight), like(bias), like(gate), like(scale), like(shift)]


def _norm_setup(ctx, inputs, output):
    x, residual, gate, scale, shift, weight, bias, eps, offset, is_rms, rows_per_mod = inputs
    _, _, mean, rstd = output
    ctx.save_for_backward(x, residual, gate, scale, shift, weight, bias, mean, rstd)
    ctx.scalars = (offset, is_rms, rows_per_mod)


def _norm_backward(ctx, dy, dh, dmean, drstd):
    x, residual, gate, scale, shift, weight, bias, mean, rstd = ctx.saved_tensors
    dh = dh if residual is not None and dh is not None and dh.numel() else None
    dx, dr, dw, db, dg, ds, dsh = _call(_norm_bwd_op, dy, dh, x, residual, gate, scale, shift, weight,
                                        bias, mean, rstd, *ctx.scalars, inputs=(dy, dh, x))
    present = (residual, gate, scale, shift, weight, bias)
    dr, dg, ds, dsh, dw, db = (g if t is not None else None
                               for g, t in zip((dr, dg, ds, dsh, dw, db), present))
    return dx, dr, dg, ds, dsh, dw, db, None, None, None, None


_norm_fwd_op.register_autograd(_norm_backward, setup_context=_norm_setup)


def _norm_triton(x, residual, gate, scale, shift, weight, bias, eps, offset, is_rms, rows_per_mod):
    y, h, _, _ = _call(_norm_fwd_op, x, residual, gate, scale, shift, weight, bias, float(eps),
                       float(offset), is_rms, rows_per_mod,
                       inputs=(x, residual, gate, scale, shift, weight, bias))
    return y if residual is None else (y, h)


def rms_norm_triton(*, x, weight, eps, residual=None, offset=0.0):
    return _norm_triton(x, residual, None, None, None, weight, None, eps, offset, True, 1)


def layer_norm_triton(*, x, weight, bias, eps, residual=None):
    return _norm_triton(x, residual, None, None, None, weight, bias, eps, 0.0, False, 1)


def adaln_triton(*, x, scale, shift, gate=None, eps, residual=None):
    rows_per_mod = x.shape[-2] if scale.dim() < x.dim() else 1
    return _norm_triton(x, residual, gate, scale, shift, None, None, eps, 0.0, False, rows_per_mod)


def _in_f64(fn, like: Tensor, **kwargs):
    """The oracle on float64 copies; float results back in ``like``'s dtype."""
    out = fn(**{k: v.to(torch.float64) if isinstance(v, Tensor) and v.is_floating_point() else v
                for k, v in kwargs.items()})
    if isinstance(out, tuple):
        return tuple(o.to(like.dtype) for o in out)
    return out.to(like.dtype)


def rms_norm_reference(*, x, **kw):
    return _in_f64(ref.rms_norm, x, x=x, **kw)


def layer_norm_reference(*, x, **kw):
    return _in_f64(ref.layer_norm, x, x=x, **kw)


def adaln_reference(*, x, **kw):
    return _in_f64(ref.adaln, x, x=x, **kw)


# ---- RoPE ----

def _rotary_kwargs(x, cos, position_ids, cu_seqlens, max_seqlen, seqlen_offsets, seqlen_offset,
                   interleaved, rotary_dim, conjugate):
    return dict(cos=cos, rot_start=0, rotary_dim=rotary_dim, interleaved=interleaved,
                conjugate=conjugate, position_ids=position_ids, cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
                seqlen_offsets=seqlen_offsets if seqlen_offsets is not None else seqlen_offset)


@_custom_op("lanekit::rotary")
def _rotary_op(x: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None,
               cu_seqlens: Tensor | None, max_seqlen: int, seqlen_offsets: Tensor | None,
               seqlen_offset: int, interleaved: bool, rotary_dim: int, conjugate: bool) -> Tensor:
    from lanekit.runtime.alloc import empty

    out = empty(x.shape, dtype=x.dtype, device=x.device)
    return _kernels().rotary_fwd(x=x, sin=sin, out=out, **_rotary_kwargs(
        x, cos, position_ids, cu_seqlens, max_seqlen, seqlen_offsets, seqlen_offset, interleaved,
        rotary_dim, conjugate))


@_rotary_op.register_fake
def _(x, cos, sin, position_ids, cu_seqlens, max_seqlen, seqlen_offsets, seqlen_offset,
      interleaved, rotary_dim, conjugate):
    return x.new_empty(x.shape)


@torch.library.custom_op("lanekit::rotary_", mutates_args=("x",))
def _rotary_inplace_op(x: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None,
                       cu_seqlens: Tensor | None, max_seqlen: int, seqlen_offsets: Tensor | None,
                       seqlen_offset: int, interleaved: bool, rotary_dim: int, conjugate: bool) -> None:
    _kernels().rotary_fwd(x=x, sin=sin, out=x, **_rotary_kwargs(
        x, cos, position_ids, cu_seqlens, max_seqlen, seqlen_offsets, seqlen_offset, interleaved,
        rotary_dim, conjugate))


def _rotary_setup(ctx, inputs, output):
    ctx.rope = inputs[1:]


def _rotary_backward(ctx, dout):
    (cos, sin, position_ids, cu_seqlens, max_seqlen, seqlen_offsets, seqlen_offset, interleaved,
     rotary_dim, conjugate) = ctx.rope
    dx = _call(_rotary_op, dout, cos, sin, position_ids, cu_seqlens, max_seqlen, seqlen_offsets,
               seqlen_offset, interleaved, rotary_dim, not conjugate, inputs=(dout,))
    return dx, None, None, None, None, None, None, None, None, None, None


_rotary_op.register_autograd(_rotary_backward, setup_context=_rotary_setup)


class _RotaryInplace(torch.autograd.Function):
    """In-place RoPE under autograd: x is marked dirty; the backward rotates back."""

    @staticmethod
    def forward(ctx, x, *rope):
        _rotary_inplace_op(x, *rope)
        ctx.mark_dirty(x)
        ctx.rope = rope
        return x

    @staticmethod
    def backward(ctx, dout):
        *rest, conjugate = ctx.rope
        return (_rotary_op(dout, *rest, not conjugate), *([None] * len(ctx.rope)))


def apply_rotary_triton(*, x, cos, sin, interleaved, rotary_dim, position_ids=None,
                        cu_seqlens=None, max_seqlen=0, seqlen_offsets=0, inplace=False):
    offsets = seqlen_offsets if isinstance(seqlen_offsets, Tensor) else None
    offset = 0 if offsets is not None else int(seqlen_offsets)
    args = (cos, sin, position_ids, cu_seqlens, max_seqlen, offsets, offset, interleaved,
            rotary_dim, False)
    if inplace:
        return _RotaryInplace.apply(x, *args)
    return _call(_rotary_op, x, *args, inputs=(x,))


def apply_rotary_reference(*, x, cos, sin, interleaved, rotary_dim, position_ids=None,
                           cu_seqlens=None, max_seqlen=0, seqlen_offsets=0, inplace=False):
    out = _in_f64(ref.apply_rotary, x, x=x, cos=cos, sin=sin, interleaved=interleaved,
                  rotary_dim=rotary_dim, position_ids=position_ids, cu_seqlens=cu_seqlens,
                  seqlen_offsets=seqlen_offsets)
    if inplace:  # recorded by autograd as an in-place op (which PyTorch refuses on a leaf)
        return x.copy_(out)
    return out


# ---- RoPE of q and k in one launch ----

@_custom_op("lanekit::rotary_qk")
def _rotary_qk_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None,
                  seqlen_offsets: Tensor | None, seqlen_offset: int, interleaved: bool, rotary_dim: int,
                  conjugate: bool) -> tuple[Tensor, Tensor]:
    from lanekit.runtime.alloc import empty

    q_out = empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = empty(k.shape, dtype=k.dtype, device=k.device)
    _kernels().rotary_qk_fwd(q=q, k=k, q_out=q_out, k_out=k_out, cos=cos, sin=sin, rotary_dim=rotary_dim,
                             interleaved=interleaved, conjugate=conjugate, position_ids=position_ids,
                             seqlen_offsets=seqlen_offsets if seqlen_offsets is not None else seqlen_offset)
    return q_out, k_out


@_rotary_qk_op.register_fake
def _(q, k, cos, sin, position_ids, seqlen_offsets, seqlen_offset, interleaved, rotary_dim, conjugate):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _rotary_qk_setup(ctx, inputs, output):
    ctx.rope = inputs[2:]


def _rotary_qk_backward(ctx, dq, dk):
    *rope, conjugate = ctx.rope
    dq, dk = _call(_rotary_qk_op, dq, dk, *rope, not conjugate, inputs=(dq, dk))   # the rotation back
    return (dq, dk) + (None,) * 8


_rotary_qk_op.register_autograd(_rotary_qk_backward, setup_context=_rotary_qk_setup)


def apply_rotary_qk_triton(*, q, k, cos, sin, interleaved, rotary_dim, position_ids=None, seqlen_offsets=0):
    offsets = seqlen_offsets if isinstance(seqlen_offsets, Tensor) else None
    offset = 0 if offsets is not None else int(seqlen_offsets)
    return _call(_rotary_qk_op, q, k, cos, sin, position_ids, offsets, offset, interleaved, rotary_dim, False,
                 inputs=(q, k))


def apply_rotary_qk_reference(*, q, **kw):
    return _in_f64(ref.apply_rotary_qk, q, q=q, **kw)


# ---- RMSNorm + RoPE on q and k ----

@_custom_op("lanekit::rms_norm_rope")
def _rms_norm_rope_op(q: Tensor, k: Tensor, q_weight: Tensor | None, k_weight: Tensor | None,
                      cos: Tensor, sin: Tensor, position_ids: Tensor | None,
                      seqlen_offsets: Tensor | None, seqlen_offset: int, eps: float, offset: float,
                      interleaved: bool, rotary_dim: int) -> tuple[Tensor, Tensor]:
    from lanekit.runtime.alloc import empty

    q_out = empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = empty(k.shape, dtype=k.dtype, device=k.device)
    _kernels().qk_norm_rope_fwd(
        q=q, k=k, q_out=q_out, k_out=k_out, q_weight=q_weight, k_weight=k_weight, cos=cos,
        sin=sin, rot_start=0, rotary_dim=rotary_dim, interleaved=interleaved,
        position_ids=position_ids,
        seqlen_offsets=seqlen_offsets if seqlen_offsets is not None else seqlen_offset,
        eps=eps, offset=offset)
    return q_out, k_out


@_rms_norm_rope_op.register_fake
def _(q, k, q_weight, k_weight, cos, sin, position_ids, seqlen_offsets, seqlen_offset, eps,
      offset, interleaved, rotary_dim):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@_custom_op("lanekit::rms_norm_rope_bwd")
def _rms_norm_rope_bwd_op(dq_out: Tensor, dk_out: Tensor, q: Tensor, k: Tensor,
                          q_weight: Tensor | None, k_weight: Tensor | None, cos: Tensor,
                          sin: Tensor, position_ids: Tensor | None, seqlen_offsets: Tensor | None,
                          seqlen_offset: int, eps: float, offset: float, interleaved: bool,
                          rotary_dim: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dqw, dkw = _kernels().rms_norm_rope_bwd(
        dq_out=dq_out, dk_out=dk_out, q=q, k=k, q_weight=q_weight, k_weight=k_weight, cos=cos,
        sin=sin, eps=eps, offset=offset, rotary_dim=rotary_dim, interleaved=interleaved,
        position_ids=position_ids,
        seqlen_offsets=seqlen_offsets if seqlen_offsets is not None else seqlen_offset)
    return dq, dk, _or_empty(dqw, q), _or_empty(dkw, q)


@_rms_norm_rope_bwd_op.register_fake
def _(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, position_ids, seqlen_offsets,
      seqlen_offset, eps, offset, interleaved, rotary_dim):
    def like(w):
        return w.new_empty(w.shape) if w is not None else q.new_empty(0)

    return q.new_empty(q.shape), k.new_empty(k.shape), like(q_weight), like(k_weight)


def _rms_norm_rope_setup(ctx, inputs, output):
    q, k, q_weight, k_weight, cos, sin, position_ids, seqlen_offsets = inputs[:8]
    ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin, position_ids, seqlen_offsets)
    ctx.scalars = inputs[8:]


def _rms_norm_rope_backward(ctx, dq, dk):
    q, k, q_weight, k_weight, cos, sin, position_ids, seqlen_offsets = ctx.saved_tensors
    # an output not used downstream has no gradient: zeros (the kernel reads one)
    dq = dq if dq is not None else torch.zeros_like(q)
    dk = dk if dk is not None else torch.zeros_like(k)
    dq, dk, dqw, dkw = _call(_rms_norm_rope_bwd_op, dq, dk, q, k, q_weight, k_weight, cos, sin,
                             position_ids, seqlen_offsets, *ctx.scalars, inputs=(dq, dk, q, k))
    return (dq, dk, dqw if q_weight is not None else None, dkw if k_weight is not None else None,
            None, None, None, None, None, None, None, None, None)


_rms_norm_rope_op.register_autograd(_rms_norm_rope_backward, setup_context=_rms_norm_rope_setup)


def _offsets(seqlen_offsets):
    if isinstance(seqlen_offsets, Tensor):
        return seqlen_offsets, 0
    return None, int(seqlen_offsets)


def rms_norm_rope_triton(*, q, k, q_weight, k_weight, cos, sin, eps, offset=0.0,
                         interleaved=False, rotary_dim, position_ids=None, seqlen_offsets=0):
    return _call(_rms_norm_rope_op, q, k, q_weight, k_weight, cos, sin, position_ids,
                 *_offsets(seqlen_offsets), float(eps), float(offset), interleaved, rotary_dim,
                 inputs=(q, k, q_weight, k_weight))


def rms_norm_rope_reference(*, q, **kw):
    return _in_f64(ref.rms_norm_rope, q, q=q, **kw)


# ---- QK-norm, RoPE and quantization (forward only) ----

@_custom_op("lanekit::qk_norm_rope_quant")
def _qk_norm_rope_quant_op(q: Tensor, k: Tensor, q_weight: Tensor | None, k_weight: Tensor | None,
                           cos: Tensor, sin: Tensor, position_ids: Tensor | None,
                           seqlen_offsets: Tensor | None, seqlen_offset: int, eps: float,
                           offset: float, interleaved: bool, rotary_dim: int,
                           quant_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from lanekit.runtime.alloc import empty

    q_codes, k_codes = (empty(x.shape, dtype=quant_dtype, device=x.device) for x in (q, k))
    q_scale, k_scale = (empty(x.shape[:-1], dtype=torch.float32, device=x.device) for x in (q, k))
    _kernels().qk_norm_rope_fwd(
        q=q, k=k, q_out=q_codes, k_out=k_codes, q_weight=q_weight, k_weight=k_weight, cos=cos,
        sin=sin, rot_start=q.shape[-1] - rotary_dim, rotary_dim=rotary_dim,
        interleaved=interleaved, position_ids=position_ids,
        seqlen_offsets=seqlen_offsets if seqlen_offsets is not None else seqlen_offset,
        eps=eps, offset=offset, quant_dtype=quant_dtype, q_scale=q_scale, k_scale=k_scale)
    return q_codes, q_scale, k_codes, k_scale


@_qk_norm_rope_quant_op.register_fake
def _(q, k, q_weight, k_weight, cos, sin, position_ids, seqlen_offsets, seqlen_offset, eps,
      offset, interleaved, rotary_dim, quant_dtype):
    return (q.new_empty(q.shape, dtype=quant_dtype), q.new_empty(q.shape[:-1], dtype=torch.float32),
            k.new_empty(k.shape, dtype=quant_dtype), k.new_empty(k.shape[:-1], dtype=torch.float32))


def qk_norm_rope_quant_triton(*, q, k, q_weight, k_weight, cos, sin, eps, offset=0.0,
                              interleaved=False, rotary_dim, position_ids=None, seqlen_offsets=0,
                              quant_dtype):
    return _call(_qk_norm_rope_quant_op, q, k, q_weight, k_weight, cos, sin, position_ids,
                 *_offsets(seqlen_offsets), float(eps), float(offset), interleaved, rotary_dim,
                 quant_dtype)


def qk_norm_rope_quant_reference(**kw):
    """The oracle itself: it computes its exact fp32 sequence whatever dtype it is given."""
    return ref.qk_norm_rope_quant(**kw)


# ---- SwiGLU / GeGLU ----

def _halves(x: Tensor, up: Tensor | None) -> tuple[Tensor, Tensor]:
    if up is None:
        n = x.shape[-1] // 2
        return x[..., :n], x[..., n:]
    return x, up


def _as_rows(t: Tensor) -> Tensor:
    """(rows, N) view of t (..., N); a copy when the leading dims cannot be merged."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


@_custom_op("lanekit::glu")
def _glu_op(x: Tensor, up: Tensor | None, activation: str) -> Tensor:
    from lanekit.runtime.alloc import empty

    gate, up = _halves(x, up)
    out = empty(gate.shape, dtype=gate.dtype, device=gate.device)
    _kernels().glu_fwd(gate=_as_rows(gate), up=_as_rows(up), activation=activation,
                       out=_as_rows(out))
    return out


@_glu_op.register_fake
def _(x, up, activation):
    gate, _ = _halves(x, up)
    return gate.new_empty(gate.shape)


@_custom_op("lanekit::glu_out", mutates_args=("out",))
def _glu_out_op(x: Tensor, up: Tensor | None, activation: str, out: Tensor) -> None:
    gate, up = _halves(x, up)
    _kernels().glu_fwd(gate=_as_rows(gate), up=_as_rows(up), activation=activation,
                       out=_as_rows(out))


@_custom_op("lanekit::glu_bwd")
def _glu_bwd_op(dy: Tensor, x: Tensor, up: Tensor | None, activation: str) -> tuple[Tensor, Tensor]:
    from lanekit.runtime.alloc import empty

    gate, up_ = _halves(x, up)
    dx = empty(x.shape, dtype=x.dtype, device=x.device)
    if up is None:  # one fused gradient: the kernel writes its two halves
        dgate, dup = _halves(_as_rows(dx), None)
        dup_out = x.new_empty(0)
    else:
        dup_out = empty(up.shape, dtype=up.dtype, device=up.device)
        dgate, dup = _as_rows(dx), _as_rows(dup_out)
    _kernels().glu_bwd(dy=_as_rows(dy), gate=_as_rows(gate), up=_as_rows(up_),
                       activation=activation, dgate=dgate, dup=dup)
    return dx, dup_out


@_glu_bwd_op.register_fake
def _(dy, x, up, activation):
    return x.new_empty(x.shape), (up.new_empty(up.shape) if up is not None else x.new_empty(0))


def _glu_setup(ctx, inputs, output):
    x, up, activation = inputs
    ctx.save_for_backward(x, up)
    ctx.activation = activation


def _glu_backward(ctx, dy):
    x, up = ctx.saved_tensors
    dx, dup = _call(_glu_bwd_op, dy, x, up, ctx.activation, inputs=(dy, x, up))
    return dx, (dup if up is not None else None), None


_glu_op.register_autograd(_glu_backward, setup_context=_glu_setup)


def glu_triton(*, gate, up=None, activation, out=None):
    if out is not None:
        _call(_glu_out_op, gate, up, activation, out)
        return out
    return _call(_glu_op, gate, up, activation, inputs=(gate, up))


def glu_reference(*, gate, up=None, activation, out=None):
    y = _in_f64(ref.glu, gate, gate=gate, up=up, activation=activation)
    if out is not None:
        with torch.no_grad():
            out.copy_(y)
        return out
    return y


# ---- backward lanes: autograd through the forward lanes, as training reaches them ----

def _backward_lanes(name, forward_triton, forward_reference):
    wrt = ref.GRAD_INPUTS[name]

    def lane(forward):
        def backward(*, dout, dh=None, dk=None, **kwargs):
            douts = (dout, dk) if name in ("rms_norm_rope", "apply_rotary_qk") else (dout, dh)
            return ref.gradients(forward, douts, wrt, **kwargs)
        return backward

    return lane(forward_triton), lane(forward_reference)


rms_norm_backward_triton, rms_norm_backward_reference = _backward_lanes(
    "rms_norm", rms_norm_triton, rms_norm_reference)
layer_norm_backward_triton, layer_norm_backward_reference = _backward_lanes(
    "layer_norm", layer_norm_triton, layer_norm_reference)
adaln_backward_triton, adaln_backward_reference = _backward_lanes(
    "adaln", adaln_triton, adaln_reference)
apply_rotary_backward_triton, apply_rotary_backward_reference = _backward_lanes(
    "apply_rotary", apply_rotary_triton, apply_rotary_reference)
apply_rotary_qk_backward_triton, apply_rotary_qk_backward_reference = _backward_lanes(
    "apply_rotary_qk", apply_rotary_qk_triton, apply_rotary_qk_reference)
rms_norm_rope_backward_triton, rms_norm_rope_backward_reference = _backward_lanes(
    "rms_norm_rope", rms_norm_rope_triton, rms_norm_rope_reference)
glu_backward_triton, glu_backward_reference = _backward_lanes("glu", glu_triton, glu_reference)
