"""Training speed: forward + backward of every fused layer and of the RNN cells, beside Liger-Kernel,
eager PyTorch and torch.compile in the same run, timed from CUDA graphs (the GPU's time) and eagerly
(``triton.testing.do_bench`` on the calls as made, the host's launches included).

Layers at benchmarks.layers' Llama-3-8B shapes (8k tokens, hidden 4096, FFN 14336, 32 query and 8
KV heads of 128; AdaLN (B=4, S=2048, N=4096)), bf16. One call: the forward, then
``torch.autograd.grad`` of its outputs with fixed random output gradients, for the differentiable
inputs (x, weights, residual; q, k; gate, up). GB/s counts the least traffic of both passes: each
activation read or written once per pass (a norm's forward reads x and writes y, its backward reads
x and dy and writes dx: 5 tensors; parameters, whose gradients are small, not counted). Peers:
eager PyTorch as models write it (benchmarks.layers' functions), that function under
torch.compile, and Liger-Kernel's functional op where it has one (``benchmarks.liger``; dropped when
not importable; Liger's RoPE rotates its inputs in place, which autograd may refuse on the leaves
given here: the runner then reports it as not run). RNN cells: LSTM and GRU, B=256, input and
hidden 1024, bf16, forward alone and forward + backward (every input and weight), GB/s of the
weights, input and state read and the outputs (and gradients) written once; peers PyTorch's fused
cells (``torch.lstm_cell`` / ``torch.gru_cell``, as ``nn.LSTMCell`` runs) and the same step
written out in eager PyTorch under torch.compile. Liger has no RNN cell.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

import lanekit.layers as L
import lanekit.rnn as R
from benchmarks import layers as fwd
from benchmarks import liger
from lanekit.layers.registry import LAYERS_BWD
from lanekit.reference import layers as ref
from lanekit.reference import rnn as ref_rnn
from lanekit.rnn.registry import RNN_BWD, RNN_FWD
from lanekit.testing import compare, upcast

TOKENS, HIDDEN, FFN, HQ, HKV, D = fwd.TOKENS, fwd.HIDDEN, fwd.FFN, fwd.HQ, fwd.HKV, fwd.D
BF16 = torch.bfloat16
RNN_B, RNN_IN, RNN_H = 256, 1024, 1024

LAYER_OPS = ("rms_norm", "rms_norm+residual", "layer_norm", "adaln", "adaln+gated residual", "apply_rotary q",
             "apply_rotary_qk", "rms_norm_rope q,k", "swiglu", "geglu tanh")
# which inputs (by position in benchmarks.layers.make_inputs' list) each case differentiates
_DIFF = {"rms_norm": (0, 1), "rms_norm+residual": (0, 1, 3), "layer_norm": (0, 1, 2), "adaln": (0, 1, 2),
         "adaln+gated residual": (0, 1, 2, 3, 4), "apply_rotary q": (0,), "apply_rotary_qk": (0, 1),
         "rms_norm_rope q,k": (0, 1, 2, 3), "swiglu": (0, 1), "geglu tanh": (0, 1)}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---- fused layers, forward + backward ----

def layer_cases(quick: bool = False):
    for op in LAYER_OPS:
        yield dict(op=op)


def layer_bytes(c) -> float:
    op, x = c["op"], _numel((TOKENS, HIDDEN))
    q, kv = _numel((TOKENS, HQ, D)), _numel((TOKENS, HKV, D))
    per = {"rms_norm": 5 * x, "layer_norm": 5 * x, "adaln": 5 * x, "rms_norm+residual": 8 * x,
           "adaln+gated residual": 9 * x, "apply_rotary q": 4 * q, "apply_rotary_qk": 4 * (q + kv),
           "rms_norm_rope q,k": 5 * (q + kv), "swiglu": 8 * _numel((TOKENS, FFN)),
           "geglu tanh": 8 * _numel((TOKENS, FFN))}[op]
    return 2 * per


def layer_inputs(c, device="cuda"):
    op = c["op"]
    base = {"apply_rotary_qk": "apply_rotary q"}.get(op, op)
    return fwd.make_inputs(dict(op=base), device)


def _lanekit_layer(c):
    if c["op"] == "apply_rotary_qk":
        return lambda q, k, qw, kw, cos, sin: L.apply_rotary_qk(q, k, cos, sin)
    return fwd._lanekit(c)


def _eager_layer(c):
    if c["op"] == "apply_rotary_qk":
        return lambda q, k, qw, kw, cos, sin: (fwd._hf_rope(q, cos, sin), fwd._hf_rope(k, cos, sin))
    return fwd._eager(c)


def _liger_layer(c):
    op = c["op"]
    if op == "rms_norm":
        f = liger.rms_norm(1e-5)
        return f and (lambda x, w, b, r: f(x, w))
    if op == "rms_norm+residual":
        f = liger.rms_norm_residual(1e-5)
        return f and (lambda x, w, b, r: f(x, w, r))
    if op == "layer_norm":
        f = liger.layer_norm(1e-5)
        return f and (lambda x, w, b, r: f(x, w, b))
    if op == "apply_rotary_qk":
        f = liger.rope_qk()
        return f and (lambda q, k, qw, kw, cos, sin: f(q, k, cos, sin))
    if op == "swiglu":
        f = liger.swiglu()
        return f and (lambda g, u: f(g, u))
    if op == "geglu tanh":
        f = liger.geglu_tanh()
        return f and (lambda g, u: f(g, u))
    return None


def _train_step(f, inputs, diff):
    """A zero-argument callable: f's forward on leaves (the inputs at positions ``diff`` made to
    require grad) and the gradients of those leaves for fixed random output gradients."""
    leaves = [t.detach().requires_grad_() if i in diff else t for i, t in enumerate(inputs)]
    wrt = [leaves[i] for i in diff]
    with torch.no_grad():
        outs = f(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator(device=inputs[0].device).manual_seed(1)
    douts = [torch.randn(o.shape, generator=g, device=o.device, dtype=o.dtype) for o in outs]

    def step():
        out = f(*leaves)
        out = out if isinstance(out, tuple) else (out,)
        return torch.autograd.grad(out, wrt, douts, allow_unused=True)
    return step, leaves, douts


def layer_check(c, *inputs) -> str | None:
    """lanekit's gradients against the float64 oracle's (autograd through lanekit.reference) on the
    first 64 tokens; the forward is benchmarks.layers' check."""
    op = c["op"]
    t = slice(0, 64)
    if op.startswith("adaln"):
        small = [inputs[0][:1, t], *(v[:1] for v in inputs[1:4]), inputs[4][:1, t]]
    elif op in ("rms_norm", "rms_norm+residual", "layer_norm"):
        small = [inputs[0][t], inputs[1], inputs[2], inputs[3][t]]
    elif op.startswith(("apply_rotary", "rms_norm_rope")):
        small = [inputs[0][:, t], inputs[1][:, t], inputs[2], inputs[3], inputs[4][t], inputs[5][t]]
    else:
        small = [v[t] for v in inputs]
    small = [v.contiguous() for v in small]
    diff = _DIFF[op]
    step, _, douts = _train_step(_lanekit_layer(c), small, diff)
    got = step()
    oracle = _oracle_layer(c)
    # the same output gradients, in float64
    leaves = [upcast(v).detach().requires_grad_() if i in diff else upcast(v) for i, v in enumerate(small)]
    outs = oracle(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    want = torch.autograd.grad(outs, [leaves[i] for i in diff], [upcast(d) for d in douts], allow_unused=True)
    for g_, w_ in zip(got, want, strict=True):
        if (g_ is None) != (w_ is None):
            return "a gradient missing"
        if g_ is not None:
            result = compare(g_, w_, LAYERS_BWD)
            if not result.ok:
                return result.detail
    return None


def _oracle_layer(c):
    op = c["op"]
    if op == "rms_norm":
        return lambda x, w, b, r: ref.rms_norm(x, w, 1e-5)
    if op == "rms_norm+residual":
        return lambda x, w, b, r: ref.rms_norm(x, w, 1e-5, residual=r)
    if op == "layer_norm":
        return lambda x, w, b, r: ref.layer_norm(x, w, b, 1e-5)
    if op == "adaln":
        return lambda x, sc, sh, gate, r: ref.adaln(x, sc, sh)
    if op == "adaln+gated residual":
        return lambda x, sc, sh, gate, r: ref.adaln(x, sc, sh, gate=gate, residual=r)
    if op == "apply_rotary q":
        return lambda q, k, qw, kw, cos, sin: ref.apply_rotary(q, cos, sin)
    if op == "apply_rotary_qk":
        return lambda q, k, qw, kw, cos, sin: ref.apply_rotary_qk(q, k, cos, sin)
    if op == "rms_norm_rope q,k":
        return lambda q, k, qw, kw, cos, sin: ref.rms_norm_rope(q, k, qw, kw, cos, sin)
    act = "gelu_tanh" if op == "geglu tanh" else "silu"
    return lambda g, u: ref.glu(g, u, activation=act)


def layer_runners(c, *inputs):
    diff = _DIFF[c["op"]]
    eager = _eager_layer(c)
    fns = {"lanekit": _lanekit_layer(c), "eager": eager, "torch.compile": torch.compile(eager)}
    lg = _liger_layer(c)
    if lg:
        fns["liger"] = lg
    return {n: _train_step(f, inputs, diff)[0] for n, f in fns.items()}


LAYERS_TRAIN = SimpleNamespace(
    __doc__="Fused layers, forward + backward, from CUDA graphs (see benchmarks.train).",
    UNIT="GB/s", CUDA_GRAPHS=True, cases=layer_cases, name=lambda c: f"{c['op']} fwd+bwd",
    bytes_moved=layer_bytes, make_inputs=layer_inputs, check=layer_check, runners=layer_runners)
LAYERS_TRAIN_EAGER = SimpleNamespace(
    __doc__="Fused layers, forward + backward, eagerly (host launches included; see benchmarks.train).",
    UNIT="GB/s", CUDA_GRAPHS=False, cases=layer_cases, name=lambda c: f"{c['op']} fwd+bwd eager",
    bytes_moved=layer_bytes, make_inputs=layer_inputs, check=layer_check, runners=layer_runners)


# ---- RNN cells ----

def rnn_cases(quick: bool = False):
    for cell in ("lstm", "gru"):
        for train in (False, True):
            yield dict(cell=cell, train=train)


def rnn_name(c) -> str:
    return f"{c['cell']}_cell B={RNN_B} H={RNN_H}" + (" fwd+bwd" if c["train"] else "")


def rnn_bytes(c) -> float:
    gates = 4 if c["cell"] == "lstm" else 3
    weights = gates * RNN_H * (RNN_IN + RNN_H) + 2 * gates * RNN_H
    states = 2 if c["cell"] == "lstm" else 1
    acts = RNN_B * RNN_IN + states * RNN_B * RNN_H           # input and state read
    outs = states * RNN_B * RNN_H                             # new state written
    once = weights + acts + outs
    return 2 * (once if not c["train"] else 2 * once + weights)   # backward: grads of all, weights read again


def rnn_inputs(c, device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    gates = 4 if c["cell"] == "lstm" else 3

    def rnd(*shape, scale=1.0):
        return torch.randn(shape, generator=g, device=device, dtype=BF16) * scale

    x, h = rnd(RNN_B, RNN_IN), rnd(RNN_B, RNN_H)
    w_ih, w_hh = rnd(gates * RNN_H, RNN_IN, scale=RNN_IN ** -0.5), rnd(gates * RNN_H, RNN_H, scale=RNN_H ** -0.5)
    b_ih, b_hh = rnd(gates * RNN_H), rnd(gates * RNN_H)
    if c["cell"] == "lstm":
        return [x, h, rnd(RNN_B, RNN_H), w_ih, w_hh, b_ih, b_hh]
    return [x, h, w_ih, w_hh, b_ih, b_hh]


def _rnn_fns(c):
    if c["cell"] == "lstm":
        ours = lambda x, h, cc, wi, wh, bi, bh: R.lstm_cell(x, (h, cc), wi, wh, bi, bh)  # noqa: E731
        torch_cell = lambda x, h, cc, wi, wh, bi, bh: torch.lstm_cell(x, (h, cc), wi, wh, bi, bh)  # noqa: E731

        def written(x, h, cc, wi, wh, bi, bh):
            i, f, gg, o = (F.linear(x, wi, bi) + F.linear(h, wh, bh)).chunk(4, 1)
            c2 = torch.sigmoid(f) * cc + torch.sigmoid(i) * torch.tanh(gg)
            return torch.sigmoid(o) * torch.tanh(c2), c2
        oracle = lambda x, h, cc, wi, wh, bi, bh: ref_rnn.lstm_cell(x, h, cc, wi, wh, bi, bh)  # noqa: E731
    else:
        ours = lambda x, h, wi, wh, bi, bh: R.gru_cell(x, h, wi, wh, bi, bh)  # noqa: E731
        torch_cell = lambda x, h, wi, wh, bi, bh: torch.gru_cell(x, h, wi, wh, bi, bh)  # noqa: E731

        def written(x, h, wi, wh, bi, bh):
            ir, iz, inn = F.linear(x, wi, bi).chunk(3, 1)
            hr, hz, hn = F.linear(h, wh, bh).chunk(3, 1)
            r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
            n = torch.tanh(inn + r * hn)
            return (1 - z) * n + z * h
        oracle = lambda x, h, wi, wh, bi, bh: ref_rnn.gru_cell(x, h, wi, wh, bi, bh)  # noqa: E731
    return ours, torch_cell, written, oracle


def rnn_check(c, *inputs) -> str | None:
    ours, _, _, oracle = _rnn_fns(c)
    diff = tuple(range(len(inputs))) if c["train"] else ()
    if not diff:
        got = ours(*inputs)
        want = oracle(*(upcast(v) for v in inputs))
    else:
        step, _, douts = _train_step(ours, list(inputs), diff)
        got = step()
        leaves = [upcast(v).detach().requires_grad_() for v in inputs]
        outs = oracle(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        want = torch.autograd.grad(outs, leaves, [upcast(d) for d in douts])
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g_, w_ in zip(got, want, strict=True):
        result = compare(g_, w_, RNN_BWD if c["train"] else RNN_FWD)
        if not result.ok:
            return result.detail
    return None


def rnn_runners(c, *inputs):
    ours, torch_cell, written, _ = _rnn_fns(c)
    fns = {"lanekit": ours, "torch cell": torch_cell, "torch.compile": torch.compile(written)}
    if not c["train"]:
        return {n: (lambda f=f: f(*inputs)) for n, f in fns.items()}
    diff = tuple(range(len(inputs)))
    return {n: _train_step(f, list(inputs), diff)[0] for n, f in fns.items()}


RNN_TRAIN = SimpleNamespace(
    __doc__="LSTM and GRU cells, forward and forward + backward, from CUDA graphs (see benchmarks.train).",
    UNIT="GB/s", CUDA_GRAPHS=True, cases=rnn_cases, name=rnn_name, bytes_moved=rnn_bytes,
    make_inputs=rnn_inputs, check=rnn_check, runners=rnn_runners)
RNN_TRAIN_EAGER = SimpleNamespace(
    __doc__="LSTM and GRU cells eagerly, host launches included (see benchmarks.train).",
    UNIT="GB/s", CUDA_GRAPHS=False, cases=rnn_cases, name=lambda c: rnn_name(c) + " eager",
    bytes_moved=rnn_bytes, make_inputs=rnn_inputs, check=rnn_check, runners=rnn_runners)

FAMILIES = {"layers_train": LAYERS_TRAIN, "layers_train_eager": LAYERS_TRAIN_EAGER, "rnn_train": RNN_TRAIN,
            "rnn_train_eager": RNN_TRAIN_EAGER}
