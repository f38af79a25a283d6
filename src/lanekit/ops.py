"""The registry's entries: every op, its oracle, its lanes, its sample inputs and its tolerance.

Adding an op means adding one ``register(Op(...))`` here; the execution matrix, ``lanekit check``
and the registry-driven tests pick it up from there.
"""

from __future__ import annotations

import zlib

import torch

from lanekit.runtime.lanes import Op, Sample, register
from lanekit.testing import randn


def attention_case(name, device, *, B=1, Sq=17, Sk=17, Hq=2, Hkv=None, D=64, Dv=None,
                   dtype=torch.float16, causal=False, window_size=(-1, -1), softcap=0.0,
                   alibi=None, bias_shape=None, mask_shape=None, dropout_p=0.0, seed=0,
                   kv_transposed=False) -> Sample:
    """A ``flash_attn_func`` sample in the lanes' normalized form, from readable parameters.

    ``alibi``: None, "head" (Hq,) or "batch" (B, Hq). ``bias_shape``/``mask_shape``: a shape
    broadcastable to (B, Hq, Sq, Sk). ``kv_transposed``: k and v are non-contiguous views.
    """
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # the same inputs in every process
    Hkv = Hkv or Hq
    Dv = Dv or D
    q = randn(B, Sq, Hq, D, dtype=dtype, device=device, generator=g)
    if kv_transposed:  # (B, Hkv, Sk, D) storage viewed as (B, Sk, Hkv, D)
        k = randn(B, Hkv, Sk, D, dtype=dtype, device=device, generator=g).transpose(1, 2)
        v = randn(B, Hkv, Sk, Dv, dtype=dtype, device=device, generator=g).transpose(1, 2)
    else:
        k = randn(B, Sk, Hkv, D, dtype=dtype, device=device, generator=g)
        v = randn(B, Sk, Hkv, Dv, dtype=dtype, device=device, generator=g)
    slopes = None
    if alibi is not None:
        slopes = (torch.rand(Hq if alibi == "head" else (B, Hq), generator=g) * 0.5).to(device)
        slopes = slopes.expand(B, Hq)
    bias = mask = None
    if bias_shape is not None:
        bias = randn(*bias_shape, dtype=dtype, device=device, generator=g, scale=2.0).expand(B, Hq, Sq, Sk)
    if mask_shape is not None:
        mask = (torch.rand(*mask_shape, generator=g) > 0.3).to(device).expand(B, Hq, Sq, Sk)
    left, right = window_size
    return Sample(name, dict(
        q=q, k=k, v=v, softmax_scale=D ** -0.5, window_size=(left, 0 if causal else right),
        softcap=softcap, alibi_slopes=slopes, attn_bias=bias, attn_mask=mask,
        dropout_p=dropout_p, seed=seed, offset=0,
    ))


def _attention_samples(device):
    bf16, f32 = torch.bfloat16, torch.float32
    yield attention_case("mha d64 bf16 S97", device, B=2, Sq=97, Sk=97, Hq=3, D=64, dtype=bf16)
    yield attention_case("gqa 6:2 causal Sq17 Sk129 d72", device, Sq=17, Sk=129, Hq=6, Hkv=2, D=72, causal=True)
    yield attention_case("causal Sq129 Sk37 d80 (empty rows)", device, Sq=129, Sk=37, D=80, dtype=bf16, causal=True)
    yield attention_case("mqa 4:1 window(4,0) Sq1 Sk37 d59", device, Sq=1, Sk=37, Hq=4, Hkv=1, D=59, window_size=(4, 0))
    yield attention_case("window(8,3) S97 d96", device, Sq=97, Sk=97, D=96, dtype=bf16, window_size=(8, 3))
    yield attention_case("softcap30 alibi(B,H) d96", device, B=2, Sq=33, Sk=65, D=96, softcap=30.0, alibi="batch")
    yield attention_case("alibi(H) causal d128", device, Sq=48, Sk=48, D=128, alibi="head", causal=True, dtype=bf16)
    yield attention_case("bias+mask d111", device, B=2, Sq=19, Sk=41, Hq=2, D=111, dtype=bf16,
                         bias_shape=(1, 2, 19, 41), mask_shape=(2, 1, 1, 41))
    yield attention_case("Dqk192 Dv128", device, Sq=20, Sk=33, D=192, Dv=128)
    yield attention_case("d256 fp32", device, Sq=17, Sk=40, D=256, dtype=f32)
    yield attention_case("d1 fp32 causal", device, Sq=9, Sk=9, D=1, dtype=f32, causal=True)
    yield attention_case("dropout0.2 d32", device, Sq=33, Sk=47, D=32, dropout_p=0.2, seed=1234)
    yield attention_case("k,v transposed views d64", device, Sq=21, Sk=50, Hq=4, Hkv=2, D=64, kv_transposed=True)
    yield attention_case("Sk0", device, Sq=5, Sk=0, D=16)


def _attention_bwd_samples(device):
    """The forward's samples, each with a gradient of out (dout), plus an empty query."""
    cases = list(_attention_samples(device))
    cases.append(attention_case("Sq0", device, Sq=0, Sk=7, D=16))
    for case in cases:
        q, v = case.kwargs["q"], case.kwargs["v"]
        g = torch.Generator().manual_seed(zlib.crc32(b"dout " + case.name.encode()))
        dout = randn(*q.shape[:3], v.shape[3], dtype=q.dtype, device=device, generator=g)
        yield Sample(case.name, dict(case.kwargs, dout=dout))


register(Op(
    name="flash_attn_func",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn",
    lanes={"triton": "lanekit.attention.op:flash_attn_triton",
           "reference": "lanekit.attention.op:flash_attn_reference"},
    samples=_attention_samples,
    outputs=(("out", "attention_fwd"), ("lse", "lse")),
    doc="FlashAttention-compatible attention forward: MHA/GQA/MQA, causal/window, softcap, ALiBi, bias, mask, dropout",
))

register(Op(
    name="flash_attn_func.backward",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn_backward",
    lanes={"triton": "lanekit.attention.op:flash_attn_backward_triton",
           "reference": "lanekit.attention.op:flash_attn_backward_reference"},
    samples=_attention_bwd_samples,
    outputs=(("dq", "attention_bwd"), ("dk", "attention_bwd"), ("dv", "attention_bwd"),
             ("dbias", "attention_dbias")),
    doc="Gradients of flash_attn_func by autograd: dq, dk, dv, and the bias's gradient when it has one",
))


# ------------------------------------------------------------------------------------------- rnn

RNN_GATES = {"lstm_cell": 4, "gru_cell": 3, "rnn_cell": 1}


def rnn_case(name, device, cell, *, B=17, In=13, H=27, dtype=torch.bfloat16, bias=True, hx=True,
             strided=False, nonlinearity="tanh", grads=False) -> Sample:
    """A sample of ``cell`` ("lstm_cell", "gru_cell" or "rnn_cell") in the lanes' normalized form.

    Weights are drawn as PyTorch's modules initialize them, U(-1/sqrt(H), 1/sqrt(H)); input and
    state are N(0, 1). ``strided``: input and w_ih are transposed views, h (and c) column slices
    of wider tensors. ``grads``: also the gradients of the outputs (dh_next, and dc_next for
    the LSTM), for the backward ops.
    """
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # the same inputs in every process
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
        outputs=(("h", "rnn_fwd"), ("c", "rnn_fwd")) if _cell == "lstm_cell" else (("h", "rnn_fwd"),),
        doc=_RNN_DOCS[_cell],
    ))
    register(Op(
        name=f"{_cell}.backward",
        family="rnn",
        oracle=f"lanekit.reference.rnn:{_cell}_backward",
        lanes={"triton": f"lanekit.rnn.op:{_cell}_backward_triton",
               "reference": f"lanekit.rnn.op:{_cell}_backward_reference"},
        samples=_rnn_samples(_cell, grads=True),
        outputs=tuple((name, "rnn_bwd") for name in _RNN_GRADS[_cell]),
        doc=f"Gradients of {_cell} by autograd: input, state, weights and biases (empty where absent)",
    ))
