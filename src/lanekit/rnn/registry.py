"""The RNN cells' registry entries: sample builders, tolerances, and the ``register`` calls of
lstm_cell, gru_cell and rnn_cell, forward and backward.

Each sample is in the lanes' normalized form (the keyword arguments of ``lanekit.rnn.op``'s lane
functions); its values come from a generator seeded by its name.
"""

from __future__ import annotations

import torch

from lanekit.runtime.registry import Op, Sample, register
from lanekit.testing import Tolerance, generator, randn

# The tolerances of the cells' outputs (the project's rule: lanekit.testing).
RNN_FWD = Tolerance(
    name="rnn_fwd",
    ulps=1.0,
    fp32_ulps=16.0,
    reason=(
        "h' and c' are computed in fp32 and rounded once, so fp16/bf16 meet one step (measured "
        "up to 0.50). fp32: the gate pre-activations are fp32 sums of In + H products, and the "
        "exp2-based sigmoid and tanh add a few fp32 ulps; measured up to 5.7 steps (In=200, "
        "H=150), where PyTorch's own fp32 modules err by up to 21.8 steps on the same inputs."
    ),
)

RNN_BWD = Tolerance(
    name="rnn_bwd",
    ulps=2.0,
    fp32_ulps=16.0,
    reason=(
        "the gate gradients are rounded to the input format before the matmuls that give "
        "d(input), d(h), dW_ih and dW_hh (as PyTorch's modules do in fp16/bf16), and each of "
        "those sums B or G*H rounded products. Measured up to 1.24 steps (fp16 dW_ih of the "
        "Elman cell; bf16 up to 1.19) over odd sizes and six seeds, where PyTorch's modules in "
        "the same precision err by up to 1.8 steps (3.1 for dc). fp32: measured up to 7.0 "
        "steps (dinput, In=200, H=150), PyTorch's fp32 modules up to 7.9."
    ),
)


RNN_GATES = {"lstm_cell": 4, "gru_cell": 3, "rnn_cell": 1}


def rnn_case(name, device, cell, *, B=17, In=13, H=27, dtype=torch.bfloat16, bias=True, hx=True,
             strided=False, nonlinearity="tanh", grads=False) -> Sample:
    """A sample of ``cell`` ("lstm_cell", "gru_cell" or "rnn_cell") in the lanes' normalized form.

    Weights are drawn as PyTorch's modules initialize them, U(-1/sqrt(H), 1/sqrt(H)); input and
    state are N(0, 1). ``strided``: input and w_ih are transposed views, h (and c) column slices
    of wider tensors. ``grads``: also the gradients of the outputs (dh_next, and dc_next for
    the LSTM), for the backward ops.
    """
    g = generator(name)
    G = RNN_GATES[cell]

    def uniform(*shape):
        return ((torch.rand(*shape, generator=g) * 2 - 1) * H ** -0.5).to(dtype=dtype, device=device)

    def state():
        if strided:  # every other column of a (B, 2H) tensor
            return randn(B, 2 * H, dtype=dtype, device=device, generator=g)[:, ::2]
        return randn(B, H, dtype=dtype, device=device, generator=g)

    if strided:
        x = randn(In, B, dtype=dtype, device=device, generator=g).t()
        w_ih = uniform(In, G * H).t()
    else:
        x = randn(B, In, dtype=dtype, device=device, generator=g)
        w_ih = uniform(G * H, In)
    kwargs = dict(input=x, h=state() if hx else None)
    if cell == "lstm_cell":
        kwargs["c"] = state() if hx else None
    kwargs.update(w_ih=w_ih, w_hh=uniform(G * H, H),
                  b_ih=uniform(G * H) if bias else None, b_hh=uniform(G * H) if bias else None)
    if cell == "rnn_cell":
        kwargs["nonlinearity"] = nonlinearity
    if grads:
        kwargs["dh_next"] = randn(B, H, dtype=dtype, device=device, generator=g)
        if cell == "lstm_cell":
            kwargs["dc_next"] = randn(B, H, dtype=dtype, device=device, generator=g)
    return Sample(name, kwargs)


def _rnn_samples(cell, grads=False):
    """Odd sizes (In=13, H=27; In=40, H=70), batches 17, 1 and 0, every dtype, no bias, no state,
    strided views; the Elman cell with tanh and relu."""
    f16, f32 = torch.float16, torch.float32

    def samples(device):
        def case(name, **kw):
            return rnn_case(name, device, cell, grads=grads, **kw)

        yield case("B17 In13 H27 bf16")
        yield case("B1 In13 H27 fp16 no bias", B=1, dtype=f16, bias=False)
        yield case("B17 In13 H27 fp32", dtype=f32)
        yield case("B17 In40 H70 bf16 no state", In=40, H=70, hx=False)
        yield case("B17 strided views fp16", dtype=f16, strided=True)
        if cell == "rnn_cell":
            yield case("B17 In13 H27 relu bf16", nonlinearity="relu")
            yield case("B1 In13 H27 relu fp32 no bias", B=1, dtype=f32, bias=False, nonlinearity="relu")
        yield case("B0", B=0)

    return samples


_RNN_DOCS = {
    "lstm_cell": "torch.nn.LSTMCell's step (gates i, f, g, o): h', c' from one fused launch",
    "gru_cell": "torch.nn.GRUCell's step (gates r, z, n; reset applied to W_hn h + b_hn): h' from one fused launch",
    "rnn_cell": "torch.nn.RNNCell's step, tanh or relu: h' from one fused launch",
}
_RNN_GRADS = {
    "lstm_cell": ("dinput", "dh", "dc", "dw_ih", "dw_hh", "db_ih", "db_hh"),
    "gru_cell": ("dinput", "dh", "dw_ih", "dw_hh", "db_ih", "db_hh"),
    "rnn_cell": ("dinput", "dh", "dw_ih", "dw_hh", "db_ih", "db_hh"),
}

for _cell in ("lstm_cell", "gru_cell", "rnn_cell"):
    register(Op(
        name=_cell,
        family="rnn",
        oracle=f"lanekit.reference.rnn:{_cell}",
        lanes={"triton": f"lanekit.rnn.op:{_cell}_triton", "reference": f"lanekit.rnn.op:{_cell}_reference"},
        samples=_rnn_samples(_cell),
        outputs=(("h", RNN_FWD), ("c", RNN_FWD)) if _cell == "lstm_cell" else (("h", RNN_FWD),),
        doc=_RNN_DOCS[_cell],
    ))
    register(Op(
        name=f"{_cell}.backward",
        family="rnn",
        oracle=f"lanekit.reference.rnn:{_cell}_backward",
        lanes={"triton": f"lanekit.rnn.op:{_cell}_backward_triton",
               "reference": f"lanekit.rnn.op:{_cell}_backward_reference"},
        samples=_rnn_samples(_cell, grads=True),
        outputs=tuple((name, RNN_BWD) for name in _RNN_GRADS[_cell]),
        doc=f"Gradients of {_cell} by autograd: input, state, weights and biases (empty where absent)",
    ))
