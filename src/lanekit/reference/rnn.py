"""RNN-cell oracles: plain PyTorch that reads like the math of ``torch.nn.LSTMCell``,
``torch.nn.GRUCell`` and ``torch.nn.RNNCell``.

These compute in the dtype of their floating inputs (the checks pass float64 copies). Shapes:
input (B, In), h and c (B, H); the weights keep PyTorch's layout, the gates stacked along the rows:
w_ih (G*H, In), w_hh (G*H, H), b_ih and b_hh (G*H,), with G = 4 (LSTM: i, f, g, o), 3 (GRU: r, z, n)
or 1 (Elman). A missing state (None) is zeros, as in the modules; a missing bias is no bias.
No Triton here.
"""

from __future__ import annotations

import torch


def _affine(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x w^T + b, without the bias when it is None."""
    y = x @ w.t()
    return y if b is None else y + b


def _state(h: torch.Tensor | None, input: torch.Tensor, H: int) -> torch.Tensor:
    return h if h is not None else input.new_zeros(input.shape[0], H)


def lstm_cell(input, h, c, w_ih, w_hh, b_ih=None, b_hh=None):
    """One LSTM step. Returns (h', c'), each (B, H).

    gates = x W_ih^T + b_ih + h W_hh^T + b_hh, split into i, f, g, o (in that order)
    i, f, o = sigmoid(.), g = tanh(.);  c' = f * c + i * g;  h' = o * tanh(c')
    """
    H = w_hh.shape[1]
    h, c = _state(h, input, H), _state(c, input, H)
    gates = _affine(input, w_ih, b_ih) + _affine(h, w_hh, b_hh)
    i, f, g, o = gates.chunk(4, dim=1)
    i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
    c_next = f * c + i * g
    h_next = o * torch.tanh(c_next)
    return h_next, c_next


def gru_cell(input, h, w_ih, w_hh, b_ih=None, b_hh=None):
    """One GRU step. Returns h' (B, H).

    gi = x W_ih^T + b_ih and gh = h W_hh^T + b_hh, each split into r, z, n (in that order)
    r = sigmoid(gi_r + gh_r), z = sigmoid(gi_z + gh_z), n = tanh(gi_n + r * gh_n)
    h' = (1 - z) * n + z * h
    The reset gate multiplies W_hn h + b_hn, after the bias, as PyTorch (and cuDNN) do.
    """
    h = _state(h, input, w_hh.shape[1])
    gi_r, gi_z, gi_n = _affine(input, w_ih, b_ih).chunk(3, dim=1)
    gh_r, gh_z, gh_n = _affine(h, w_hh, b_hh).chunk(3, dim=1)
    r = torch.sigmoid(gi_r + gh_r)
    z = torch.sigmoid(gi_z + gh_z)
    n = torch.tanh(gi_n + r * gh_n)
    return (1 - z) * n + z * h


def rnn_cell(input, h, w_ih, w_hh, b_ih=None, b_hh=None, nonlinearity="tanh"):
    """One Elman RNN step. Returns h' = act(x W_ih^T + b_ih + h W_hh^T + b_hh) (B, H), act being
    tanh or relu."""
    h = _state(h, input, w_hh.shape[1])
    pre = _affine(input, w_ih, b_ih) + _affine(h, w_hh, b_hh)
    return torch.tanh(pre) if nonlinearity == "tanh" else torch.relu(pre)


# The differentiable inputs of each cell, in the order the backward ops return their gradients.
LSTM_INPUTS = ("input", "h", "c", "w_ih", "w_hh", "b_ih", "b_hh")
GRU_INPUTS = ("input", "h", "w_ih", "w_hh", "b_ih", "b_hh")
RNN_INPUTS = GRU_INPUTS


def gradients(forward, grad_outputs: tuple[torch.Tensor, ...], names: tuple[str, ...], **kwargs):
    """The gradients of ``forward(**kwargs)`` (a tensor or a tuple of tensors) for the gradients
    ``grad_outputs`` of its outputs, by autograd: one per name in ``names``, in that order, each in
    its input's shape, or an empty tensor where that input is None."""
    leaves = {n: kwargs[n].detach().requires_grad_() for n in names if kwargs[n] is not None}
    with torch.enable_grad():
        out = forward(**{**kwargs, **leaves})
        out = out if isinstance(out, tuple) else (out,)
        grads = torch.autograd.grad(out, list(leaves.values()), grad_outputs, allow_unused=True)
    by_name = dict(zip(leaves, grads))
    empty = kwargs["input"].new_zeros(0)
    return tuple(
        empty if n not in by_name else (by_name[n] if by_name[n] is not None else torch.zeros_like(leaves[n]))
        for n in names
    )


def lstm_cell_backward(dh_next, dc_next, **kwargs):
    """(d input, d h, d c, d w_ih, d w_hh, d b_ih, d b_hh) of :func:`lstm_cell` for the gradients
    dh_next and dc_next of h' and c'; empty tensors for inputs that are None."""
    return gradients(lstm_cell, (dh_next, dc_next), LSTM_INPUTS, **kwargs)


def gru_cell_backward(dh_next, **kwargs):
    """(d input, d h, d w_ih, d w_hh, d b_ih, d b_hh) of :func:`gru_cell` for the gradient dh_next
    of h'; empty tensors for inputs that are None."""
    return gradients(gru_cell, (dh_next,), GRU_INPUTS, **kwargs)


def rnn_cell_backward(dh_next, **kwargs):
    """(d input, d h, d w_ih, d w_hh, d b_ih, d b_hh) of :func:`rnn_cell` for the gradient dh_next
    of h'; empty tensors for inputs that are None."""
    return gradients(rnn_cell, (dh_next,), RNN_INPUTS, **kwargs)
