"""The attention lanes, and the custom op that makes the Triton lane opaque to torch.compile.

Every lane takes the normalized keyword arguments that ``flash_attn_func`` produces after
validation (window_size holding the causal mask, bias/mask expanded to (B, Hq, Sq, Sk), slopes to
(B, Hq)) and returns ``(out, lse)``.
"""

from __future__ import annotations

import torch

from lanekit.reference import attention as ref


@torch.library.custom_op("lanekit::flash_attn_fwd", mutates_args=())
def _flash_attn_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    attn_bias: torch.Tensor | None, attn_mask: torch.Tensor | None, alibi_slopes: torch.Tensor | None,
    softmax_scale: float, window_left: int, window_right: int, softcap: float,
    dropout_p: float, seed: int, offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    from lanekit.attention.kernels import flash_attn_fwd  # imported on first use: see runtime.lanes

    return flash_attn_fwd(
        q=q, k=k, v=v, softmax_scale=softmax_scale, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes, attn_bias=attn_bias, attn_mask=attn_mask,
        dropout_p=dropout_p, seed=seed, offset=offset,
    )


@_flash_attn_fwd_op.register_fake
def _(q, k, v, attn_bias, attn_mask, alibi_slopes, softmax_scale, window_left, window_right,
      softcap, dropout_p, seed, offset):
    B, Sq, Hq, _ = q.shape
    return (q.new_empty((B, Sq, Hq, v.shape[3])),
            q.new_empty((B, Hq, Sq), dtype=torch.float32))


@torch.library.custom_op("lanekit::flash_attn_bwd", mutates_args=())
def _flash_attn_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dlse: torch.Tensor | None,
    attn_bias: torch.Tensor | None, attn_mask: torch.Tensor | None, alibi_slopes: torch.Tensor | None,
    softmax_scale: float, window_left: int, window_right: int, softcap: float,
    dropout_p: float, seed: int, offset: int, bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from lanekit.attention.kernels import flash_attn_bwd

    dq, dk, dv, dbias = flash_attn_bwd(
        dout=dout, q=q, k=k, v=v, out=out, lse=lse, dlse=dlse, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        attn_bias=attn_bias, attn_mask=attn_mask, dropout_p=dropout_p, seed=seed, offset=offset,
        bias_grad=bias_grad,
    )
    # A custom op returns tensors only: an empty one stands for "no bias gradient".
    return dq, dk, dv, dbias if dbias is not None else q.new_empty(0, dtype=torch.float32)


@_flash_attn_bwd_op.register_fake
def _(dout, q, k, v, out, lse, dlse, attn_bias, attn_mask, alibi_slopes, softmax_scale,
      window_left, window_right, softcap, dropout_p, seed, offset, bias_grad):
    B, Sq, Hq, _ = q.shape
    dbias_shape = (B, Hq, Sq, k.shape[1]) if bias_grad else (0,)
    # contiguous, as the kernel's outputs (empty_like would keep a transposed input's layout)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(dbias_shape, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    (q, k, v, attn_bias, attn_mask, alibi_slopes, softmax_scale, window_left, window_right,
     softcap, dropout_p, seed, offset) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_bias, attn_mask, alibi_slopes)
    ctx.scalars = (softmax_scale, window_left, window_right, softcap, dropout_p, seed, offset)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, attn_bias, attn_mask, alibi_slopes = ctx.saved_tensors
    bias_grad = attn_bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias = _flash_attn_bwd_op(
        dout, q, k, v, out, lse, dlse, attn_bias, attn_mask, alibi_slopes, *ctx.scalars, bias_grad)
    dbias = dbias.to(attn_bias.dtype) if bias_grad else None
    return dq, dk, dv, dbias, None, None, None, None, None, None, None, None, None


_flash_attn_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def flash_attn_triton(*, q, k, v, softmax_scale, window_size, softcap, alibi_slopes, attn_bias,
                      attn_mask, dropout_p, seed, offset):
    return _flash_attn_fwd_op(q, k, v, attn_bias, attn_mask, alibi_slopes, softmax_scale,
                              window_size[0], window_size[1], softcap, dropout_p, seed, offset)


def flash_attn_reference(*, q, k, v, alibi_slopes, attn_bias, **kw):
    """The oracle as a lane: computes in float64, returns out in q's dtype and lse in fp32."""
    f64 = torch.float64
    out, lse = ref.flash_attn(
        q.to(f64), k.to(f64), v.to(f64),
        alibi_slopes=alibi_slopes.to(f64) if alibi_slopes is not None else None,
        attn_bias=attn_bias.to(f64) if attn_bias is not None else None, **kw,
    )
    return out.to(q.dtype), lse.to(torch.float32)


def flash_attn_backward_triton(*, dout, **kw):
    """The Triton backward, reached the way training reaches it: autograd through the custom op.
    Returns (dq, dk, dv, dbias), dbias per element of the (B, Hq, Sq, Sk) bias or empty."""
    return ref.gradients(flash_attn_triton, dout, **kw)


def flash_attn_backward_reference(*, dout, **kw):
    """Autograd through the reference lane (float64 inside), gradients in the inputs' dtypes."""
    return ref.gradients(flash_attn_reference, dout, **kw)
