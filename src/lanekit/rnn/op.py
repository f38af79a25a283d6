"""The RNN-cell lanes, and the custom ops that make the Triton lane opaque to torch.compile.

Every lane takes the normalized keyword arguments that the public functions produce after
validation: 2-D ``input`` (B, In), the state ``h`` (and ``c``) (B, H) or None for zeros, the weights
and the biases (or None). The LSTM lanes return ``(h', c')``, the GRU and Elman lanes ``h'``.

Each forward is one custom op (one Triton launch) that also returns the fp32 activations its
backward needs. The backward's pointwise part is a second custom op (one Triton launch); the GEMMs
for d(input), d(h), dW_ih, dW_hh and the bias sums are torch ops in the autograd formula, so that
cuBLAS runs them (a Triton GEMM of ours would not beat it on these plain shapes) and
torch.compile sees them.
"""

from __future__ import annotations

import torch

from lanekit.reference import rnn as ref
from lanekit.runtime.custom_ops import call as _call, custom_op as _custom_op


def _needs_grad(*tensors) -> bool:
    """Whether autograd will ask for the backward: only then does the forward save activations."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _param_grads(ctx, dgi, dgh, input, h, w_ih, w_hh, dh_extra=None):
    """Gradients of input, h, w_ih, w_hh, b_ih, b_hh (None where autograd does not ask) from the
    gate gradients: dgi multiplies W_ih's rows and dgh W_hh's (the same tensor except in the GRU).
    Input and h are the op's inputs 0 and 1; the weights and biases follow from
    ``ctx.weight_index``. ``dh_extra``: a direct gradient of h, added to dgh W_hh (GRU)."""
    need = ctx.needs_input_grad
    i_w = ctx.weight_index
    dinput = dgi @ w_ih if need[0] else None
    dh = None
    if h is not None and need[1]:
        dh = dgh @ w_hh if dh_extra is None else torch.addmm(dh_extra, dgh, w_hh)
    dw_ih = dgi.t() @ input if need[i_w] else None
    dw_hh = None
    if need[i_w + 1]:
        # no state: h = 0, so dW_hh = 0 (PyTorch's modules also return zeros, not None)
        dw_hh = dgh.t() @ h if h is not None else torch.zeros_like(w_hh)
    # the bias sums accumulate in fp32, then round once
    db_ih = dgi.sum(0, dtype=torch.float32).to(dgi.dtype) if need[i_w + 2] else None
    db_hh = dgh.sum(0, dtype=torch.float32).to(dgh.dtype) if need[i_w + 3] else None
    return dinput, dh, dw_ih, dw_hh, db_ih, db_hh


def _check_saved(saved: torch.Tensor, rows: int) -> None:
    if saved.numel() == 0 and rows:
        raise RuntimeError("lanekit: the RNN cell's forward ran without saving its activations (no "
                           "input required grad then), yet its backward was called")


# ------------------------------------------------------------------------------------------ LSTM


@_custom_op("lanekit::lstm_cell_fwd")
def _lstm_cell_fwd_op(
    input: torch.Tensor, h: torch.Tensor | None, c: torch.Tensor | None,
    w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: torch.Tensor | None, b_hh: torch.Tensor | None,
    save: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from lanekit.rnn.kernels import lstm_cell_fwd  # imported on first use: see runtime.lanes

    return lstm_cell_fwd(input=input, h=h, c=c, w_ih=w_ih, w_hh=w_hh, b_ih=b_ih, b_hh=b_hh, save=save)


@_lstm_cell_fwd_op.register_fake
def _(input, h, c, w_ih, w_hh, b_ih, b_hh, save):
    B, H = input.shape[0], w_hh.shape[1]
    return (input.new_empty((B, H)), input.new_empty((B, H)),
            input.new_empty((B, 4 * H) if save else (0,), dtype=torch.float32))


@_custom_op("lanekit::lstm_cell_bwd")
def _lstm_cell_bwd_op(
    dh_next: torch.Tensor | None, dc_next: torch.Tensor | None, c: torch.Tensor | None,
    saved: torch.Tensor, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    from lanekit.rnn.kernels import lstm_cell_bwd

    return lstm_cell_bwd(dh_next=dh_next, dc_next=dc_next, c=c, saved=saved, dtype=dtype)


@_lstm_cell_bwd_op.register_fake
def _(dh_next, dc_next, c, saved, dtype):
    B, H = saved.shape[0], saved.shape[1] // 4
    return saved.new_empty((B, 4 * H), dtype=dtype), saved.new_empty((B, H) if c is not None else (0,), dtype=dtype)


def _lstm_setup_context(ctx, inputs, output):
    input, h, c, w_ih, w_hh, b_ih, b_hh, save = inputs
    ctx.save_for_backward(input, h, c, w_ih, w_hh, output[2])
    ctx.weight_index = 3


def _lstm_backward(ctx, dh_next, dc_next, _dsaved):
    input, h, c, w_ih, w_hh, saved = ctx.saved_tensors
    _check_saved(saved, input.shape[0] * w_hh.shape[1])
    dgates, dc = _call(_lstm_cell_bwd_op, dh_next, dc_next, c, saved, input.dtype)
    dinput, dh, dw_ih, dw_hh, db_ih, db_hh = _param_grads(ctx, dgates, dgates, input, h, w_ih, w_hh)
    dc = dc if c is not None and ctx.needs_input_grad[2] else None
    return dinput, dh, dc, dw_ih, dw_hh, db_ih, db_hh, None


_lstm_cell_fwd_op.register_autograd(_lstm_backward, setup_context=_lstm_setup_context)

# ------------------------------------------------------------------------------------------- GRU


@_custom_op("lanekit::gru_cell_fwd")
def _gru_cell_fwd_op(
    input: torch.Tensor, h: torch.Tensor | None,
    w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: torch.Tensor | None, b_hh: torch.Tensor | None,
    save: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    from lanekit.rnn.kernels import gru_cell_fwd

    return gru_cell_fwd(input=input, h=h, w_ih=w_ih, w_hh=w_hh, b_ih=b_ih, b_hh=b_hh, save=save)


@_gru_cell_fwd_op.register_fake
def _(input, h, w_ih, w_hh, b_ih, b_hh, save):
    B, H = input.shape[0], w_hh.shape[1]
    return input.new_empty((B, H)), input.new_empty((B, 4 * H) if save else (0,), dtype=torch.float32)


@_custom_op("lanekit::gru_cell_bwd")
def _gru_cell_bwd_op(
    dh_next: torch.Tensor, h: torch.Tensor | None, saved: torch.Tensor, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from lanekit.rnn.kernels import gru_cell_bwd

    return gru_cell_bwd(dh_next=dh_next, h=h, saved=saved, dtype=dtype)


@_gru_cell_bwd_op.register_fake
def _(dh_next, h, saved, dtype):
    B, H = saved.shape[0], saved.shape[1] // 4
    return (saved.new_empty((B, 3 * H), dtype=dtype), saved.new_empty((B, 3 * H), dtype=dtype),
            saved.new_empty((B, H) if h is not None else (0,), dtype=dtype))


def _gru_setup_context(ctx, inputs, output):
    input, h, w_ih, w_hh, b_ih, b_hh, save = inputs
    ctx.save_for_backward(input, h, w_ih, w_hh, output[1])
    ctx.weight_index = 2


def _gru_backward(ctx, dh_next, _dsaved):
    input, h, w_ih, w_hh, saved = ctx.saved_tensors
    _check_saved(saved, input.shape[0] * w_hh.shape[1])
    dgi, dgh, dh_direct = _call(_gru_cell_bwd_op, dh_next, h, saved, input.dtype)
    grads = _param_grads(ctx, dgi, dgh, input, h, w_ih, w_hh,
                         dh_extra=dh_direct if h is not None else None)
    return *grads, None


_gru_cell_fwd_op.register_autograd(_gru_backward, setup_context=_gru_setup_context)

# ----------------------------------------------------------------------------------------- Elman


@_custom_op("lanekit::rnn_cell_fwd")
def _rnn_cell_fwd_op(
    input: torch.Tensor, h: torch.Tensor | None,
    w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: torch.Tensor | None, b_hh: torch.Tensor | None,
    relu: bool, save: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    from lanekit.rnn.kernels import rnn_cell_fwd

    return rnn_cell_fwd(input=input, h=h, w_ih=w_ih, w_hh=w_hh, b_ih=b_ih, b_hh=b_hh, relu=relu, save=save)


@_rnn_cell_fwd_op.register_fake
def _(input, h, w_ih, w_hh, b_ih, b_hh, relu, save):
    B, H = input.shape[0], w_hh.shape[1]
    return input.new_empty((B, H)), input.new_empty((B, H) if save else (0,), dtype=torch.float32)


@_custom_op("lanekit::rnn_cell_bwd")
def _rnn_cell_bwd_op(dh_next: torch.Tensor, saved: torch.Tensor, relu: bool, dtype: torch.dtype) -> torch.Tensor:
    from lanekit.rnn.kernels import rnn_cell_bwd

    return rnn_cell_bwd(dh_next=dh_next, saved=saved, relu=relu, dtype=dtype)


@_rnn_cell_bwd_op.register_fake
def _(dh_next, saved, relu, dtype):
    return saved.new_empty(saved.shape, dtype=dtype)


def _rnn_setup_context(ctx, inputs, output):
    input, h, w_ih, w_hh, b_ih, b_hh, relu, save = inputs
    ctx.save_for_backward(input, h, w_ih, w_hh, output[1])
    ctx.weight_index = 2
    ctx.relu = relu


def _rnn_backward(ctx, dh_next, _dsaved):
    input, h, w_ih, w_hh, saved = ctx.saved_tensors
    _check_saved(saved, input.shape[0] * w_hh.shape[1])
    dpre = _call(_rnn_cell_bwd_op, dh_next, saved, ctx.relu, input.dtype)
    return *_param_grads(ctx, dpre, dpre, input, h, w_ih, w_hh), None, None


_rnn_cell_fwd_op.register_autograd(_rnn_backward, setup_context=_rnn_setup_context)

# ----------------------------------------------------------------------------------------- lanes


def lstm_cell_triton(*, input, h, c, w_ih, w_hh, b_ih, b_hh):
    save = _needs_grad(input, h, c, w_ih, w_hh, b_ih, b_hh)
    h_next, c_next, _ = _call(_lstm_cell_fwd_op, input, h, c, w_ih, w_hh, b_ih, b_hh, save,
                               inputs=(input, h, c, w_ih, w_hh, b_ih, b_hh))
    return h_next, c_next


def gru_cell_triton(*, input, h, w_ih, w_hh, b_ih, b_hh):
    save = _needs_grad(input, h, w_ih, w_hh, b_ih, b_hh)
    return _call(_gru_cell_fwd_op, input, h, w_ih, w_hh, b_ih, b_hh, save,
                 inputs=(input, h, w_ih, w_hh, b_ih, b_hh))[0]


def rnn_cell_triton(*, input, h, w_ih, w_hh, b_ih, b_hh, nonlinearity):
    save = _needs_grad(input, h, w_ih, w_hh, b_ih, b_hh)
    return _call(_rnn_cell_fwd_op, input, h, w_ih, w_hh, b_ih, b_hh, nonlinearity == "relu", save,
                 inputs=(input, h, w_ih, w_hh, b_ih, b_hh))[0]


def _f64(kwargs: dict) -> dict:
    return {k: v.to(torch.float64) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def lstm_cell_reference(**kw):
    """The oracle as a lane: computes in float64, returns h', c' in input's dtype."""
    h_next, c_next = ref.lstm_cell(**_f64(kw))
    return h_next.to(kw["input"].dtype), c_next.to(kw["input"].dtype)


def gru_cell_reference(**kw):
    """The oracle as a lane: computes in float64, returns h' in input's dtype."""
    return ref.gru_cell(**_f64(kw)).to(kw["input"].dtype)


def rnn_cell_reference(**kw):
    """The oracle as a lane: computes in float64, returns h' in input's dtype."""
    return ref.rnn_cell(**_f64(kw)).to(kw["input"].dtype)


# The backward as the registry checks it. The Triton lane: autograd through the custom ops, the
# way training reaches them. The reference lane: autograd through the float64 oracle itself (not
# through the forward lane functions above, so that replacing a forward lane leaves it alone).
# Both return the gradients of every differentiable input (reference.rnn.*_INPUTS order) in their
# inputs' dtypes, an empty tensor for an input that is None.


def _in_dtypes(grads, kw, names):
    return tuple(g.to(kw[n].dtype if kw[n] is not None else kw["input"].dtype) for g, n in zip(grads, names))


def lstm_cell_backward_triton(*, dh_next, dc_next, **kw):
    return ref.gradients(lstm_cell_triton, (dh_next, dc_next), ref.LSTM_INPUTS, **kw)


def lstm_cell_backward_reference(**kw):
    return _in_dtypes(ref.lstm_cell_backward(**_f64(kw)), kw, ref.LSTM_INPUTS)


def gru_cell_backward_triton(*, dh_next, **kw):
    return ref.gradients(gru_cell_triton, (dh_next,), ref.GRU_INPUTS, **kw)


def gru_cell_backward_reference(**kw):
    return _in_dtypes(ref.gru_cell_backward(**_f64(kw)), kw, ref.GRU_INPUTS)


def rnn_cell_backward_triton(*, dh_next, **kw):
    return ref.gradients(rnn_cell_triton, (dh_next,), ref.RNN_INPUTS, **kw)


def rnn_cell_backward_reference(**kw):
    return _in_dtypes(ref.rnn_cell_backward(**_f64(kw)), kw, ref.RNN_INPUTS)
