"""Public RNN-cell functions: one step of torch.nn.LSTMCell, GRUCell and RNNCell, as functions of
the weights, validated, dispatched to a lane."""

from __future__ import annotations

import torch

from lanekit.rnn import op as _lanes
from lanekit.runtime.validate import lane_for, tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Gates per cell, and their order along the rows of the weights (PyTorch's).
_GATES = {"lstm_cell": (4, "i, f, g, o"), "gru_cell": (3, "r, z, n"), "rnn_cell": (1, "")}
_NONLINEARITIES = ("tanh", "relu")


def _validate(cell: str, input, states: list[tuple[str, torch.Tensor]], w_ih, w_hh, b_ih, b_hh) -> int:
    """Check every argument of one cell call before anything runs; returns H."""
    G, order = _GATES[cell]
    rows = f"({G}*H, ...), the gates {order} stacked along the rows" if G > 1 else "(H, ...)"
    tensor("input", input, dtypes=_DTYPES + (torch.float64,))
    if input.dim() not in (1, 2):
        raise ValueError(f"input: expected 2 dimensions (B, In), or 1 (In,) unbatched, got shape {tuple(input.shape)}")
    for name, w in (("w_ih", w_ih), ("w_hh", w_hh)):
        tensor(name, w, like=input, like_name="input", like_dtype=True)
        if w.dim() != 2:
            raise ValueError(f"{name}: expected 2 dimensions {rows}, got shape {tuple(w.shape)}")
    H, In = w_hh.shape[1], input.shape[-1]
    if w_hh.shape[0] != G * H:
        raise ValueError(f"w_hh: expected shape ({G}*H, H) {rows}, got {tuple(w_hh.shape)}")
    if tuple(w_ih.shape) != (G * H, In):
        raise ValueError(f"w_ih: expected shape ({G * H}, {In}): ({G}*H, In) with H={H} from w_hh and "
                         f"In={In} from input, got {tuple(w_ih.shape)}")
    for name, b in (("b_ih", b_ih), ("b_hh", b_hh)):
        if b is not None:
            tensor(name, b, like=input, like_name="input", like_dtype=True)
            if tuple(b.shape) != (G * H,):
                raise ValueError(f"{name}: expected shape ({G * H},) ({G}*H with H={H} from w_hh) or None, "
                                 f"got {tuple(b.shape)}")
    if input.dim() == 2:
        expected, what = (input.shape[0], H), f"(B, H) with B={input.shape[0]} from input and H={H} from w_hh"
    else:
        expected, what = (H,), f"(H,) with H={H} from w_hh, as input is unbatched"
    for name, t in states:
        tensor(name, t, like=input, like_name="input", like_dtype=True)
        if tuple(t.shape) != expected:
            raise ValueError(f"{name}: expected shape {expected}: {what}, got {tuple(t.shape)}")
    return H


def _run(cell: str, input: torch.Tensor, lane: str | None, **kwargs):
    """Pick the lane and call it on 2-D views (an unbatched call is a batch of one)."""
    chosen = lane_for(input, lane, "input")
    batched = input.dim() == 2
    if not batched:
        input = input.unsqueeze(0)
        kwargs = {k: v.unsqueeze(0) if k in ("h", "c") and v is not None else v for k, v in kwargs.items()}
    # The lane functions the registry names (ops.py), looked up by attribute rather than through
    # the registry's importlib, which torch.compile cannot trace.
    out = getattr(_lanes, f"{cell}_{chosen}")(input=input, **kwargs)
    if batched:
        return out
    return tuple(t.squeeze(0) for t in out) if isinstance(out, tuple) else out.squeeze(0)


def lstm_cell(
    input: torch.Tensor,
    hx: tuple[torch.Tensor, torch.Tensor] | None,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None = None,
    b_hh: torch.Tensor | None = None,
    *,
    lane: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One LSTM step, ``torch.nn.LSTMCell``'s forward as a function of its weights.

    Computes ``gates = input W_ih^T + b_ih + h W_hh^T + b_hh``, split along H into i, f, g, o;
    ``c' = sigmoid(f) * c + sigmoid(i) * tanh(g)`` and ``h' = sigmoid(o) * tanh(c')``. The Triton
    lane does it in one launch (both GEMMs, fp32 accumulation, and the gate math fused).

    Arguments:
        input: (B, In), or (In,) for one unbatched sample; fp16, bf16 or fp32 (also fp64 on the
            reference lane). Any strides.
        hx: (h, c), each (B, H) ((H,) when input is unbatched), input's dtype and device; or None
            for zeros, as the module.
        w_ih: (4*H, In), the module's ``weight_ih``: the rows of the i, f, g, o gates in that order.
        w_hh: (4*H, H), the module's ``weight_hh``; H is read from it.
        b_ih, b_hh: (4*H,) or None (no bias: the module with ``bias=False`` has neither). Either may
            be given alone.
        lane: "triton" or "reference"; default: triton for CUDA/ROCm tensors, reference otherwise,
            overridden by the LANEKIT_LANE environment variable.

    Returns:
        (h', c'), each (B, H) (or (H,) unbatched) in input's dtype.

    Raises:
        TypeError: an argument is not a tensor, a dtype is unsupported or differs from input's, hx
            is not None or a pair, or fp64 outside the reference lane.
        ValueError: a wrong rank or shape (each error names the argument, the expected shape and
            where its sizes come from), a device other than input's, or an unknown lane.

    Gradients: differentiable in input, h, c, the weights and the biases. The Triton forward saves
    the gate activations (fp32); the backward computes the gate gradients in one Triton launch,
    then d(input), d(h), dW_ih, dW_hh with torch matmuls and the bias gradients as fp32 sums.
    Works under ``torch.compile(fullgraph=True)``: both kernels are custom ops with fake
    implementations.

    Semantics: PyTorch's ``torch.nn.LSTMCell`` (weight layout, gate order, zero state, return
    values); docs/semantics.md lists the choices.

    Example::

        cell = torch.nn.LSTMCell(13, 27)
        h, c = lstm_cell(x, None, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
    """
    if hx is None:
        states = []
    elif isinstance(hx, (tuple, list)) and len(hx) == 2:
        states = [("hx[0]", hx[0]), ("hx[1]", hx[1])]
    else:
        raise TypeError(f"hx: expected None or a pair (h, c) of tensors, got {type(hx).__name__}"
                        + (f" of length {len(hx)}" if isinstance(hx, (tuple, list)) else ""))
    _validate("lstm_cell", input, states, w_ih, w_hh, b_ih, b_hh)
    h, c = (None, None) if hx is None else hx
    return _run("lstm_cell", input, lane, h=h, c=c, w_ih=w_ih, w_hh=w_hh, b_ih=b_ih, b_hh=b_hh)


def gru_cell(
    input: torch.Tensor,
    hx: torch.Tensor | None,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None = None,
    b_hh: torch.Tensor | None = None,
    *,
    lane: str | None = None,
) -> torch.Tensor:
    """One GRU step, ``torch.nn.GRUCell``'s forward as a function of its weights.

    With ``gi = input W_ih^T + b_ih`` and ``gh = h W_hh^T + b_hh``, each split along H into r, z, n:
    ``r = sigmoid(gi_r + gh_r)``, ``z = sigmoid(gi_z + gh_z)``, ``n = tanh(gi_n + r * gh_n)`` (the
    reset gate scales ``W_hn h + b_hn``, bias included, as in PyTorch and cuDNN), and
    ``h' = (1 - z) * n + z * h``. The Triton lane does it in one launch.

    Arguments:
        input: (B, In), or (In,) unbatched; fp16, bf16 or fp32 (fp64 on the reference lane). Any
            strides.
        hx: h (B, H) ((H,) unbatched), input's dtype and device; or None for zeros.
        w_ih: (3*H, In), the module's ``weight_ih``: the rows of r, z, n in that order.
        w_hh: (3*H, H), the module's ``weight_hh``; H is read from it.
        b_ih, b_hh: (3*H,) or None.
        lane: as :func:`lstm_cell`.

    Returns:
        h' (B, H) (or (H,) unbatched) in input's dtype.

    Raises:
        TypeError, ValueError: as :func:`lstm_cell` (hx must be a tensor or None).

    Gradients: as :func:`lstm_cell`. The forward saves r, z, n and ``W_hn h + b_hn`` (fp32).

    Semantics: PyTorch's ``torch.nn.GRUCell``; docs/semantics.md.
    """
    states = [] if hx is None else [("hx", hx)]
    _validate("gru_cell", input, states, w_ih, w_hh, b_ih, b_hh)
    return _run("gru_cell", input, lane, h=hx, w_ih=w_ih, w_hh=w_hh, b_ih=b_ih, b_hh=b_hh)


def rnn_cell(
    input: torch.Tensor,
    hx: torch.Tensor | None,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None = None,
    b_hh: torch.Tensor | None = None,
    nonlinearity: str = "tanh",
    *,
    lane: str | None = None,
) -> torch.Tensor:
    """One Elman RNN step, ``torch.nn.RNNCell``'s forward as a function of its weights.

    Computes ``h' = act(input W_ih^T + b_ih + h W_hh^T + b_hh)``, act being tanh or relu, in one
    launch on the Triton lane.

    Arguments:
        input: (B, In), or (In,) unbatched; fp16, bf16 or fp32 (fp64 on the reference lane). Any
            strides.
        hx: h (B, H) ((H,) unbatched), input's dtype and device; or None for zeros.
        w_ih: (H, In), the module's ``weight_ih``.
        w_hh: (H, H), the module's ``weight_hh``; H is read from it.
        b_ih, b_hh: (H,) or None.
        nonlinearity: "tanh" (default) or "relu", as the module's argument.
        lane: as :func:`lstm_cell`.

    Returns:
        h' (B, H) (or (H,) unbatched) in input's dtype.

    Raises:
        TypeError, ValueError: as :func:`gru_cell`; ValueError for another nonlinearity.

    Gradients: as :func:`lstm_cell`. The forward saves h' in fp32: the derivative is 1 - h'^2 for
    tanh, and for relu 1 where h' > 0, else 0 (0 at 0, as PyTorch).

    Semantics: PyTorch's ``torch.nn.RNNCell``; docs/semantics.md.
    """
    if nonlinearity not in _NONLINEARITIES:
        raise ValueError(f"nonlinearity: expected one of {_NONLINEARITIES}, got {nonlinearity!r}")
    states = [] if hx is None else [("hx", hx)]
    _validate("rnn_cell", input, states, w_ih, w_hh, b_ih, b_hh)
    return _run("rnn_cell", input, lane, h=hx, w_ih=w_ih, w_hh=w_hh, b_ih=b_ih, b_hh=b_hh,
                nonlinearity=nonlinearity)
