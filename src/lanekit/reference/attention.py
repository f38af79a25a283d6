"""Attention oracles: plain PyTorch that reads like the math.

These compute in the dtype of their floating inputs: the checks pass float64 copies of the
low-precision inputs; passing the inputs themselves gives "the same computation done by PyTorch in
the same precision", FlashAttention's fallback accuracy rule. No Triton import here.

Semantics (docs/semantics.md has the sources): scores = q k^T * softmax_scale; softcap then
s = softcap * tanh(s / softcap); ALiBi adds -slope * |i + Sk - Sq - j|; then the additive bias;
then keys outside the window or removed by the boolean mask are dropped. Causal and window masks
are aligned bottom-right: query i sits at key position i + Sk - Sq. A query row that sees no key
gives output 0 and LSE -inf.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _umulhi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of the 64-bit product of the constant ``a`` and uint32 ``b``."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    b_hi, b_lo = b >> 16, b & 0xFFFF
    # Four 16x16-bit products keep every partial product inside int64.
    lo_lo = a_lo * b_lo
    mid = a_hi * b_lo + a_lo * b_hi
    hi_hi = a_hi * b_hi
    lo = (lo_lo + ((mid & 0xFFFF) << 16)) & _MASK32
    carry = (lo_lo + ((mid & 0xFFFF) << 16)) >> 32
    hi = (hi_hi + (mid >> 16) + carry) & _MASK32
    return hi, lo


def philox_uniform(seed: int, counter: torch.Tensor) -> torch.Tensor:
    """Uniform floats in [0, 1) from Philox-4x32-10, as Triton's ``tl.rand(seed, counter)``.

    ``counter``: int64 tensor of non-negative counters. Returns float32 of the same shape. The same
    (seed, counter) gives the same value as the Triton lane, bit for bit.
    """
    c0 = counter & _MASK32
    c1 = (counter >> 32) & _MASK32
    c2 = torch.zeros_like(counter)
    c3 = torch.zeros_like(counter)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        hi_b, lo_b = _umulhi_lo(0xCD9E8D57, c2)
        hi_a, lo_a = _umulhi_lo(0xD2511F53, c0)
        c0, c2, c1, c3 = hi_b ^ c1 ^ k0, hi_a ^ c3 ^ k1, lo_b, lo_a
        k0 = (k0 + 0x9E3779B9) & _MASK32
        k1 = (k1 + 0xBB67AE85) & _MASK32
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # bitcast to int32
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32)


def dropout_uniforms(seed: int, offset: int, B: int, H: int, Sq: int, Sk: int) -> torch.Tensor:
    """The dropout draws, (B, H, Sq, Sk) float32 in [0, 1): entry (b, h, i, j) is kept when its
    draw is >= dropout_p. Its Philox counter is offset + ((b * H + h) * Sq + i) * Sk + j.
    """
    idx = torch.arange(B * H * Sq * Sk, dtype=torch.int64).reshape(B, H, Sq, Sk)
    return philox_uniform(seed, idx + offset)


def visible(Sq: int, Sk: int, window_size: tuple[int, int], device=None) -> torch.Tensor:
    """(Sq, Sk) bool: key j is inside query i's window, aligned bottom-right.

    Query i sits at key position i + Sk - Sq; it sees j when
    i + Sk - Sq - left <= j <= i + Sk - Sq + right, with -1 meaning unbounded on that side.
    """
    left, right = window_size
    pos = torch.arange(Sq, device=device)[:, None] + (Sk - Sq)
    j = torch.arange(Sk, device=device)[None, :]
    keep = torch.ones(Sq, Sk, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= pos - left
    if right >= 0:
        keep &= j <= pos + right
    return keep


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward. q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv).

    ``window_size`` already holds the causal mask (causal is (left, 0)). Returns out (B, Sq, Hq, Dv)
    and lse (B, Hq, Sq), both in the compute dtype (that of q).
    """
    B, Sq, Hq, _ = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    dtype = q.dtype
    group = Hq // Hkv
    qh = q.transpose(1, 2)                                          # (B, Hq, Sq, D)
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)          # (B, Hq, Sk, D)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1).to(dtype)  # (B, Hq, Sk, Dv)

    s = (qh @ kh.transpose(-1, -2)) * softmax_scale                 # (B, Hq, Sq, Sk)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype).reshape(-1 if alibi_slopes.dim() == 2 else 1, Hq)
        i = torch.arange(Sq, device=q.device)[:, None] + (Sk - Sq)
        j = torch.arange(Sk, device=q.device)[None, :]
        s = s - slopes[:, :, None, None] * (i - j).abs().to(dtype)
    if attn_bias is not None:
        s = s + attn_bias.to(dtype)
    keep = visible(Sq, Sk, window_size, device=q.device)
    if attn_mask is not None:
        keep = keep & attn_mask
    s = s.masked_fill(~keep, float("-inf"))

    m = s.amax(dim=-1, keepdim=True) if Sk > 0 else s.new_zeros(s.shape[:-1] + (1,))
    m = torch.where(torch.isneginf(m), 0, m)                        # a row that sees no key
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(total == 0, 1, total)                       # empty rows: all zeros
    lse = (m + torch.log(total)).squeeze(-1)                        # (B, Hq, Sq); -inf if empty
    if dropout_p > 0:
        u = dropout_uniforms(seed, offset, B, Hq, Sq, Sk).to(q.device)
        p = torch.where(u >= dropout_p, p / (1 - dropout_p), 0)
    out = (p @ vh).transpose(1, 2)                                  # (B, Sq, Hq, Dv)
    return out, lse


def gradients(forward, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              attn_bias: torch.Tensor | None = None, **kwargs):
    """(dq, dk, dv, dbias) of ``forward(q=, k=, v=, attn_bias=, **kwargs) -> (out, lse)`` by
    autograd, for the gradient ``dout`` (B, Sq, Hq, Dv) of out. dbias is the gradient of
    ``attn_bias`` in its shape (per element of the (B, Hq, Sq, Sk) view the lanes receive), or an
    empty tensor without a bias.
    """
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    bias = attn_bias.detach().requires_grad_() if attn_bias is not None else None
    with torch.enable_grad():
        out, _ = forward(q=leaves[0], k=leaves[1], v=leaves[2], attn_bias=bias, **kwargs)
        grads = torch.autograd.grad(out, leaves + ([bias] if bias is not None else []), dout)
    dbias = grads[3] if bias is not None else q.new_zeros(0)
    return grads[0], grads[1], grads[2], dbias


def flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs):
    """The gradients of :func:`flash_attn` (see :func:`gradients`), computed in the dtype of q."""
    return gradients(flash_attn, dout, q, k, v, **kwargs)
