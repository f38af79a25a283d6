"""Oracles of the fused layers: plain PyTorch that reads like the math. No Triton here.

They compute in the dtype of their floating inputs (the checks pass float64 copies) and return
results in that dtype; the lanes round to the input's dtype. ``qk_norm_rope_quant`` is the exception:
its codes are defined by an exact fp32 sequence of operations (see its docstring), so its oracle
computes that sequence whatever dtype it is given.

Sources (docs/semantics.md): RMSNorm (Zhang & Sennrich 2019) as in Llama, with Gemma's ``1 + w``
form; LayerNorm as ``torch.nn.functional.layer_norm`` over the last dim; AdaLN as DiT's adaLN-Zero
(Peebles & Xie 2023); RoPE (Su et al. 2021) with GPT-NeoX's half-split pairing or GPT-J's
interleaved pairing, FlashAttention's ``apply_rotary_emb`` conventions; SwiGLU/GeGLU (Shazeer 2020),
with vLLM's ``silu_and_mul`` layout for a fused (..., 2N) input.
"""

from __future__ import annotations

import math

import torch

from lanekit.reference.numerics import QUANT_MAX, power_of_two, quantize_per_head, to_codes, unit_exponent  # noqa: F401


def _norm(h: torch.Tensor, eps: float, rms: bool) -> torch.Tensor:
    """(h - mean) / sqrt(var + eps) over the last dim; RMSNorm: mean taken as 0."""
    if not rms:
        h = h - h.mean(-1, keepdim=True)
    return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x, weight, eps=1e-6, residual=None, offset=0.0):
    """y = h / sqrt(mean(h^2) + eps) * (offset + weight), h = x (+ residual).
    Returns y, or (y, h) with a residual."""
    h = x if residual is None else x + residual
    y = _norm(h, eps, rms=True)
    if weight is not None:
        y = y * (offset + weight)
    return y if residual is None else (y, h)


def layer_norm(x, weight, bias, eps=1e-5, residual=None):
    """y = (h - mean) / sqrt(var + eps) * weight + bias over the last dim, h = x (+ residual).
    Returns y, or (y, h) with a residual."""
    h = x if residual is None else x + residual
    y = _norm(h, eps, rms=False)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y if residual is None else (y, h)


def adaln(x, scale, shift, gate=None, eps=1e-6, residual=None):
    """DiT's modulated LayerNorm (no affine weights): y = LN(h) * (1 + scale) + shift.

    x: (B, S, N) or (rows, N); scale, shift and gate: (B, N), broadcast over the S tokens of their
    batch entry, or one row per row of x. h = x, or with a residual h = residual + gate * x (gate 1
    when absent): the gated residual add of the block before, fused with the next block's norm.
    Returns y, or (y, h) with a residual.
    """
    def per_row(t):
        return t.unsqueeze(-2) if t.dim() < x.dim() else t

    h = x
    if residual is not None:
        h = residual + (x if gate is None else per_row(gate) * x)
    y = _norm(h, eps, rms=False) * (1 + per_row(scale)) + per_row(shift)
    return y if residual is None else (y, h)


def rotary_positions(x_shape, *, position_ids=None, cu_seqlens=None, seqlen_offsets=0):
    """The position of every token of x, as int64 of shape x.shape[:-2] ((B, S) or (T,))."""
    if position_ids is not None:
        return position_ids.long().expand(x_shape[:-2])
    if cu_seqlens is not None:
        lengths = cu_seqlens.long().diff()
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
        pos = torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - starts
        offsets = seqlen_offsets if isinstance(seqlen_offsets, int) else \
            torch.repeat_interleave(seqlen_offsets.long(), lengths)
        return pos + offsets
    B, S = x_shape[0], x_shape[1]
    pos = torch.arange(S).expand(B, S)
    if isinstance(seqlen_offsets, int):
        return pos + seqlen_offsets
    return pos.to(seqlen_offsets.device) + seqlen_offsets.long()[:, None]


def apply_rotary(x, cos, sin, interleaved=False, rotary_dim=None, position_ids=None,
                 cu_seqlens=None, seqlen_offsets=0, conjugate=False, max_seqlen=None):
    """Rotate pairs of x's first ``rotary_dim`` features by angle theta(position, i).

    x: (B, S, H, D) or packed (T, H, D); cos, sin: (S_ro, rotary_dim / 2), row p holding
    cos(theta(p, i)), sin(theta(p, i)). Pair i is (i, i + rotary_dim / 2) (NeoX) or (2i, 2i + 1)
    (interleaved, GPT-J): (a, b) -> (a cos - b sin, b cos + a sin). Features from rotary_dim on
    pass through. ``conjugate`` rotates by -theta (the backward). ``max_seqlen`` is accepted for
    the kernels' sake (it sizes their grid) and not needed here.
    """
    rd = rotary_dim if rotary_dim is not None else 2 * cos.shape[-1]
    pos = rotary_positions(x.shape, position_ids=position_ids, cu_seqlens=cu_seqlens,
                           seqlen_offsets=seqlen_offsets)
    c = cos[pos.to(cos.device)].unsqueeze(-2)   # (..., 1, rd / 2)
    s = sin[pos.to(sin.device)].unsqueeze(-2)
    if conjugate:
        s = -s
    return torch.cat((_rotate_pairs(x[..., :rd], c, s, interleaved), x[..., rd:]), dim=-1)


def apply_rotary_qk(q, k, cos, sin, interleaved=False, rotary_dim=None, position_ids=None, seqlen_offsets=0):
    """RoPE of q (B, S, Hq, D) and k (B, S, Hkv, D) at the same positions: :func:`apply_rotary`
    of each. Returns (q', k')."""
    kw = dict(interleaved=interleaved, rotary_dim=rotary_dim, position_ids=position_ids,
              seqlen_offsets=seqlen_offsets)
    return apply_rotary(q, cos, sin, **kw), apply_rotary(k, cos, sin, **kw)


def _rotate_pairs(rot, c, s, interleaved):
    """Each pair (a, b) of rot's features -> (a c - b s, b c + a s): NeoX pairs (i, i + d/2), or
    interleaved (2i, 2i + 1)."""
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    half = rot.shape[-1] // 2
    a, b = rot[..., :half], rot[..., half:]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)


def rms_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=1e-6, offset=0.0, interleaved=False,
                  rotary_dim=None, position_ids=None, seqlen_offsets=0):
    """QK-norm then RoPE: RMSNorm of every head vector (over D, weights (D,)), then rotary.
    q: (B, S, Hq, D), k: (B, S, Hkv, D). Returns (q', k')."""
    rope = dict(interleaved=interleaved, rotary_dim=rotary_dim, position_ids=position_ids,
                seqlen_offsets=seqlen_offsets)
    return (apply_rotary(rms_norm(q, q_weight, eps, offset=offset), cos, sin, **rope),
            apply_rotary(rms_norm(k, k_weight, eps, offset=offset), cos, sin, **rope))


def qk_norm_rope_quant(q, k, q_weight, k_weight, cos, sin, eps=1e-6, offset=0.0,
                       interleaved=False, rotary_dim=None, position_ids=None, seqlen_offsets=0,
                       quant_dtype=torch.float8_e4m3fn):
    """RMSNorm per head, RoPE on the last ``rotary_dim`` features, then per-(token, head) quant.

    The codes are specified bit for bit, and depend on no sum. RMSNorm multiplies a head vector
    by rstd = 1 / sqrt(mean(x^2) + eps), one positive number for the whole vector, and dividing by
    the scale (max |n| / qmax) takes any such factor out again: n / scale = u * qmax / max |u| for
    u = RoPE(x * (offset + w)). So the codes are taken from u, every step one correctly rounded
    fp32 operation in this order: x * (offset + w); rotary (a * cos - b * sin, b * cos + a * sin,
    each product rounded); amax = max |u|; inv = min(qmax / amax, 2^127) (one division per row,
    as vLLM's fp8 quantizers take the reciprocal once; the bound keeps an all-zero row's finite);
    codes = :func:`to_codes` of u * inv. They equal n / scale's rounded up to where that
    calculation's own roundings would fall, with one rounding fewer (no x * rstd).

    A row whose amax lies outside [2^-100, 2^100) (all zero, tiny, huge or not finite) takes u from
    x * p instead, p = 2^k a power of two that brings amax into [1, 2): k = :func:`unit_exponent`
    of amax where amax is finite and nonzero, at most k_x + 125 for k_x that of max |x| (so that
    |x * p| < 2^126), and k_x where amax is 0, inf or NaN (u under- or overflowed entirely). Such a
    scaling is exact but for elements it takes below fp32's normal range, changes no code where no
    step of u over- or underflows, and keeps rows of huge or tiny x, or of weights near fp32's
    ends, as precise as any other, where cos and sin are a rotation's (|cos|, |sin| <= 1, with
    cos^2 + sin^2 near 1: then max |u| is about max |x * w|). Elsewhere p = 1. With cos and sin far
    from that (2^100, or both 0 or subnormal for a pair) x * p can still under- or overflow on the
    way: such a row may lose precision, come out as zero codes with scale 1, or get a NaN scale.

    scale = amax / p * rstd / qmax, in float64 (the sum of squares too) rounded once to fp32; 1
    for an all-zero row: codes * scale is the RMSNorm-then-RoPE vector n. A row whose amax is not
    finite even so (inf or NaN in x, or a u that overflows from x * p) gets a NaN scale, and every
    code of it is the NaN code (0x7F, e4m3) or 0 (int8): the NaN-visible rule of docs/semantics.md. Returns (q_codes, q_scale, k_codes, k_scale), scales (B, S, H) fp32.
    """
    f32 = torch.float32
    D = q.shape[-1]
    rd = rotary_dim if rotary_dim is not None else 2 * cos.shape[-1]
    pos = rotary_positions(q.shape, position_ids=position_ids, seqlen_offsets=seqlen_offsets)
    c = cos.to(f32)[pos.to(cos.device)].unsqueeze(-2)
    s = sin.to(f32)[pos.to(sin.device)].unsqueeze(-2)
    qmax = QUANT_MAX[quant_dtype]

    def direction(x, wf):
        u = x * wf if wf is not None else x
        return torch.cat((u[..., : D - rd], _rotate_pairs(u[..., D - rd:], c, s, interleaved)), dim=-1)

    def one(x, w):
        wf = w.to(f32) + f32_scalar(offset) if w is not None else None
        xf = x.to(f32)
        amax = direction(xf, wf).abs().amax(-1)
        redo = ~((amax >= 2.0 ** -100) & (amax < 2.0 ** 100))
        k_x = unit_exponent(xf.abs().amax(-1))
        k = torch.where((amax > 0) & amax.isfinite(), torch.minimum(unit_exponent(amax), k_x + 125), k_x)
        p = torch.where(redo, power_of_two(k), torch.ones_like(amax))
        u = direction(xf * p.unsqueeze(-1), wf)
        amax = u.abs().amax(-1)
        inv = torch.minimum(torch.full_like(amax, qmax) / amax, torch.full_like(amax, 2.0 ** 127))
        inv = torch.where(amax.isfinite(), inv, torch.full_like(inv, float("nan")))   # codes NaN / 0
        x64 = x.to(torch.float64)
        rstd = 1.0 / torch.sqrt((x64 * x64).sum(-1) / D + eps)
        scale = (amax.to(torch.float64) / p.to(torch.float64) * rstd / qmax).to(f32)
        scale = torch.where(amax.isfinite(), scale, torch.full_like(scale, float("nan")))
        scale = torch.where(amax == 0, torch.ones_like(scale), scale)
        return to_codes(u * inv.unsqueeze(-1), quant_dtype), scale

    return (*one(q, q_weight), *one(k, k_weight))


def f32_scalar(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _gelu(g, approximate):
    if approximate == "tanh":
        return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
    return 0.5 * g * (1 + torch.erf(g / math.sqrt(2)))


def _split(gate, up):
    if up is None:
        n = gate.shape[-1] // 2
        return gate[..., :n], gate[..., n:]
    return gate, up


def swiglu(gate, up=None):
    """silu(gate) * up. With up None, gate is the fused (..., 2N) tensor: gate first, then up."""
    gate, up = _split(gate, up)
    return gate * torch.sigmoid(gate) * up


def geglu(gate, up=None, approximate="none"):
    """gelu(gate) * up, gelu as torch.nn.functional.gelu(approximate=...)."""
    gate, up = _split(gate, up)
    return _gelu(gate, approximate) * up


def glu(gate, up=None, activation="silu"):
    """The gated unit by activation name: "silu" (SwiGLU), "gelu" or "gelu_tanh" (GeGLU)."""
    if activation == "silu":
        return swiglu(gate, up)
    return geglu(gate, up, "tanh" if activation == "gelu_tanh" else "none")


def gradients(forward, douts, wrt, **kwargs):
    """Gradients of ``forward(**kwargs)`` by autograd, one per name in ``wrt``, for the output
    gradients ``douts`` (one per output; None for an output not used downstream). A name whose
    input is None gets an empty tensor, so that every call returns the same number of tensors."""
    leaves = {n: kwargs[n].detach().requires_grad_() for n in wrt if kwargs.get(n) is not None}
    with torch.enable_grad():
        outs = forward(**{**kwargs, **leaves})
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, d) for o, d in zip(outs, douts) if d is not None]
        grads = torch.autograd.grad([o for o, _ in pairs], list(leaves.values()),
                                    [d for _, d in pairs], allow_unused=True)
    by_name = dict(zip(leaves, grads))
    empty = torch.zeros(0, dtype=douts[0].dtype, device=douts[0].device)
    return tuple(by_name[n] if by_name.get(n) is not None else
                 (torch.zeros_like(leaves[n]) if n in leaves else empty) for n in wrt)


# The inputs each differentiable layer has gradients for, in the order the backward returns them.
GRAD_INPUTS = {
    "rms_norm": ("x", "weight", "residual"),
    "layer_norm": ("x", "weight", "bias", "residual"),
    "adaln": ("x", "scale", "shift", "gate", "residual"),
    "apply_rotary": ("x",),
    "rms_norm_rope": ("q", "k", "q_weight", "k_weight"),
    "apply_rotary_qk": ("q", "k"),
    "glu": ("gate", "up"),
}


def _backward(name):
    def backward(dout, dh=None, dk=None, **kwargs):
        douts = (dout, dk) if name in ("rms_norm_rope", "apply_rotary_qk") else (dout, dh)
        return gradients(globals()[name], douts, GRAD_INPUTS[name], **kwargs)
    backward.__name__ = f"{name}_backward"
    backward.__doc__ = (f"Gradients of :func:`{name}` ({', '.join(GRAD_INPUTS[name])}) by autograd, "
                        "for dout (and dh, the gradient of a returned residual sum; dk for k').")
    return backward


rms_norm_backward = _backward("rms_norm")
layer_norm_backward = _backward("layer_norm")
adaln_backward = _backward("adaln")
apply_rotary_backward = _backward("apply_rotary")
apply_rotary_qk_backward = _backward("apply_rotary_qk")
rms_norm_rope_backward = _backward("rms_norm_rope")
glu_backward = _backward("glu")
