"""Fused-layer forward cases at Llama-3-8B shapes: lanekit beside eager PyTorch and torch.compile.

8k tokens, hidden 4096, FFN 14336, 32 query heads and 8 KV heads of 128; AdaLN at DiT-like
(B=4, S=2048, N=4096). bf16. The unit is GB/s of tensors read and written once (the least traffic
any implementation needs), so it compares directly with the device-to-device copy bandwidth that
the runner measures in the same run. Peers: the same computation written in eager PyTorch the way
models write it (transformers' Llama RMSNorm and rotate_half RoPE, F.layer_norm, F.silu(g) * u),
and that function through torch.compile. Every peer is timed replaying a CUDA graph of its calls,
so the figures are the GPU's time without the host's launch overhead (the way serving engines run
these layers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import lanekit.layers as L
from lanekit.families import get_op
from lanekit.reference import layers as ref
from lanekit.testing import compare, upcast

UNIT = "GB/s"
CUDA_GRAPHS = True   # time the GPU alone: see benchmarks.run.bench_graph
TOKENS, HIDDEN, FFN, HQ, HKV, D = 8192, 4096, 14336, 32, 8, 128
BF16 = torch.bfloat16


def cases(quick: bool = False):
    yield dict(op="rms_norm")
    yield dict(op="rms_norm+residual")
    yield dict(op="layer_norm")
    yield dict(op="adaln")
    yield dict(op="adaln+gated residual")
    yield dict(op="apply_rotary q")
    yield dict(op="rms_norm_rope q,k")
    yield dict(op="qk_norm_rope_quant e4m3")
    yield dict(op="swiglu")
    yield dict(op="swiglu fused")
    yield dict(op="geglu tanh")


def name(c) -> str:
    return c["op"]


def _numel(*shapes):
    total = 0
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        total += n
    return total


def bytes_moved(c) -> float:
    """Bytes each call must read and write at least (parameters included)."""
    x = (TOKENS, HIDDEN)
    op = c["op"]
    if op in ("rms_norm", "layer_norm", "adaln"):
        return 2 * 2 * _numel(x)
    if op in ("rms_norm+residual", "adaln+gated residual"):
        return 2 * 4 * _numel(x)
    if op == "apply_rotary q":
        return 2 * 2 * _numel((TOKENS, HQ, D))
    if op == "rms_norm_rope q,k":
        return 2 * 2 * _numel((TOKENS, HQ + HKV, D))
    if op == "qk_norm_rope_quant e4m3":
        return (2 + 1) * _numel((TOKENS, HQ + HKV, D)) + 4 * TOKENS * (HQ + HKV)
    return 2 * 3 * _numel((TOKENS, FFN))  # GLUs: gate and up read, out written


def make_inputs(c, device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, dtype=BF16):
        return torch.randn(shape, generator=g, device=device, dtype=dtype)

    op = c["op"]
    if op.startswith("adaln"):
        x = rnd(4, TOKENS // 4, HIDDEN)
        return [x, rnd(4, HIDDEN) * 0.1, rnd(4, HIDDEN) * 0.1, rnd(4, HIDDEN), rnd(*x.shape)]
    if op in ("rms_norm", "rms_norm+residual", "layer_norm"):
        return [rnd(TOKENS, HIDDEN), rnd(HIDDEN), rnd(HIDDEN), rnd(TOKENS, HIDDEN)]
    if op.startswith(("apply_rotary", "rms_norm_rope", "qk_norm")):
        theta = torch.rand(TOKENS, D // 2, generator=g, device=device) * 6.3
        return [rnd(1, TOKENS, HQ, D), rnd(1, TOKENS, HKV, D), rnd(D), rnd(D), theta.cos(), theta.sin()]
    if op == "swiglu fused":
        return [rnd(TOKENS, 2 * FFN)]
    return [rnd(TOKENS, FFN), rnd(TOKENS, FFN)]


def _lanekit(c):
    op = c["op"]
    if op == "rms_norm":
        return lambda x, w, b, r: L.rms_norm(x, w, 1e-5)
    if op == "rms_norm+residual":
        return lambda x, w, b, r: L.rms_norm(x, w, 1e-5, residual=r)
    if op == "layer_norm":
        return lambda x, w, b, r: L.layer_norm(x, w, b, 1e-5)
    if op == "adaln":
        return lambda x, sc, sh, gate, r: L.adaln(x, sc, sh)
    if op == "adaln+gated residual":
        return lambda x, sc, sh, gate, r: L.adaln(x, sc, sh, gate, residual=r)
    if op == "apply_rotary q":
        return lambda q, k, qw, kw, cos, sin: L.apply_rotary(q, cos, sin)
    if op == "rms_norm_rope q,k":
        return lambda q, k, qw, kw, cos, sin: L.rms_norm_rope(q, k, qw, kw, cos, sin)
    if op == "qk_norm_rope_quant e4m3":
        return lambda q, k, qw, kw, cos, sin: L.qk_norm_rope_quant(q, k, qw, kw, cos, sin)
    if op == "swiglu fused":
        return lambda x: L.swiglu(x)
    if op == "geglu tanh":
        return lambda g, u: L.geglu(g, u, approximate="tanh")
    return lambda g, u: L.swiglu(g, u)


def _llama_rms_norm(x, w, eps=1e-5):
    """transformers' LlamaRMSNorm.forward."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _hf_rope(x, cos, sin):
    """transformers' apply_rotary_pos_emb with its (S, D) duplicated cos/sin in the model dtype."""
    c = torch.cat((cos, cos), -1).to(x.dtype)[None, :, None]
    s = torch.cat((sin, sin), -1).to(x.dtype)[None, :, None]
    return x * c + _rotate_half(x) * s


def _eager(c):
    op = c["op"]
    if op == "rms_norm":
        return lambda x, w, b, r: _llama_rms_norm(x, w)
    if op == "rms_norm+residual":
        def f(x, w, b, r):
            h = x + r
            return _llama_rms_norm(h, w), h
        return f
    if op == "layer_norm":
        return lambda x, w, b, r: F.layer_norm(x, (HIDDEN,), w, b, 1e-5)
    if op == "adaln":
        return lambda x, sc, sh, gate, r: (F.layer_norm(x, (HIDDEN,), eps=1e-6) * (1 + sc[:, None])
                                           + sh[:, None])
    if op == "adaln+gated residual":
        def f(x, sc, sh, gate, r):
            h = r + gate[:, None] * x
            return F.layer_norm(h, (HIDDEN,), eps=1e-6) * (1 + sc[:, None]) + sh[:, None], h
        return f
    if op == "apply_rotary q":
        return lambda q, k, qw, kw, cos, sin: _hf_rope(q, cos, sin)
    if op == "rms_norm_rope q,k":
        return lambda q, k, qw, kw, cos, sin: (_hf_rope(_llama_rms_norm(q, qw, 1e-6), cos, sin),
                                               _hf_rope(_llama_rms_norm(k, kw, 1e-6), cos, sin))
    if op == "qk_norm_rope_quant e4m3":
        def quant(x, w, cos, sin):
            n = _llama_rms_norm(x, w, 1e-6).float()
            n = _hf_rope(n, cos, sin)
            scale = n.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
            return (n / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.squeeze(-1)
        return lambda q, k, qw, kw, cos, sin: (*quant(q, qw, cos, sin), *quant(k, kw, cos, sin))
    if op == "swiglu fused":
        return lambda x: F.silu(x[..., :FFN]) * x[..., FFN:]
    if op == "geglu tanh":
        return lambda g, u: F.gelu(g, approximate="tanh") * u
    return lambda g, u: F.silu(g) * u


def check(c, *inputs) -> str | None:
    """lanekit against the float64 oracle on the first 64 tokens. Returns an error or None."""
    op = c["op"]
    out = _lanekit(c)(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    t = slice(0, 64)
    x64 = [upcast(v) for v in inputs]
    tolerance = "norm"
    if op.startswith("adaln"):
        x, sc, sh, gate, r = x64
        kw = dict(gate=gate[:1], residual=r[:1, t]) if "gated" in op else {}
        expected, got = ref.adaln(x[:1, t], sc[:1], sh[:1], **kw), [o[:1, t] for o in out]
    elif op == "layer_norm":
        x, w, b, _ = x64
        expected, got = ref.layer_norm(x[t], w, b, 1e-5), [out[0][t]]
    elif op.startswith("rms_norm") and "rope" not in op:
        x, w, _, r = x64
        expected = ref.rms_norm(x[t], w, 1e-5, residual=r[t] if "residual" in op else None)
        got = [o[t] for o in out]
    elif op == "apply_rotary q":
        q, _, _, _, cos, sin = x64
        expected, got, tolerance = ref.apply_rotary(q[:, t], cos, sin), [out[0][:, t]], "eltwise"
    elif op == "rms_norm_rope q,k":
        q, k, qw, kw, cos, sin = x64
        expected, got = ref.rms_norm_rope(q[:, t], k[:, t], qw, kw, cos, sin), [o[:, t] for o in out]
    elif op.startswith("qk_norm"):
        q, k, qw, kw, cos, sin = inputs
        eps = float(torch.tensor(1e-6, dtype=torch.float32))
        expected = ref.qk_norm_rope_quant(q[:, t], k[:, t], qw, kw, cos, sin, eps=eps)
        # codes and scales, each under the registry's tolerance for it
        got = [o[:, t] for o in out]
        tolerance = tuple(tol for _, tol in get_op("qk_norm_rope_quant").outputs)
    else:
        expected = ref.glu(*(v[t] for v in x64), activation="gelu_tanh" if op == "geglu tanh" else "silu")
        got, tolerance = [out[0][t]], "eltwise"
    expected = expected if isinstance(expected, tuple) else (expected,)
    tolerances = tolerance if isinstance(tolerance, tuple) else (tolerance,) * len(got)
    for o, e, tol in zip(got, expected, tolerances, strict=True):
        result = compare(o, e, tol)
        if not result.ok:
            return result.detail
    return None


def runners(c, *inputs):
    """name -> zero-argument callable, for lanekit and each peer."""
    ours, eager = _lanekit(c), _eager(c)
    compiled = torch.compile(eager)
    return {
        "lanekit": lambda: ours(*inputs),
        "eager": lambda: eager(*inputs),
        "torch.compile": lambda: compiled(*inputs),
    }
