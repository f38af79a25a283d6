"""FlashAttention's ``flash_attn.layers.rotary``: rotary embeddings with its names and argument
order, on :func:`lanekit.layers.apply_rotary` (a Triton kernel on GPU tensors, the oracle on CPU
ones; forward and backward)."""

from __future__ import annotations

import torch

from lanekit.layers.api import apply_rotary
from lanekit.runtime.validate import ArgumentError, argument_errors, int_at_least, tensor


@argument_errors
def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets: int | torch.Tensor = 0,
                     cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> torch.Tensor:
    """RoPE of x's first rotary_dim = 2 * cos.shape[1] features, FlashAttention's ``apply_rotary_emb``.

    Arguments:
        x: (B, S, H, D), or packed (total, H, D) with ``cu_seqlens``; fp16, bf16 or fp32.
        cos, sin: (S_ro, rotary_dim / 2); row p rotates position p.
        interleaved: GPT-J's pairs (2i, 2i + 1) if True, else GPT-NeoX's (i, i + rotary_dim / 2).
        inplace: write the result into x and return it.
        seqlen_offsets: an int or a (B,) int tensor added to each sequence's positions (decode).
        cu_seqlens: (B + 1,) int32 for packed x; max_seqlen: its longest sequence (or None).

    Returns: x's shape and dtype. Differentiable in x.

    Raises: as :func:`lanekit.layers.apply_rotary` (each error a RuntimeError too).
    """
    return apply_rotary(x, cos, sin, interleaved, inplace=inplace, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                        seqlen_offsets=seqlen_offsets)


apply_rotary_emb_func = apply_rotary_emb   # FlashAttention's older name


@argument_errors
def apply_rotary_emb_qkv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cos_k: torch.Tensor | None = None,
                          sin_k: torch.Tensor | None = None, interleaved: bool = False,
                          seqlen_offsets: int | torch.Tensor = 0, num_heads_q: int | None = None) -> torch.Tensor:
    """RoPE of q and k in place inside qkv, FlashAttention's ``apply_rotary_emb_qkv_``: qkv
    (B, S, 3, H, D), or (B, S, Hq + 2 * Hkv, D) with ``num_heads_q`` = Hq (GQA). q takes cos/sin,
    k takes cos_k/sin_k (default: cos/sin). Returns qkv."""
    tensor("qkv", qkv, ndim=(4, 5))
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ArgumentError(f"qkv: expected (B, S, 3, H, D), got {tuple(qkv.shape)}")
        q, k = qkv[:, :, 0], qkv[:, :, 1]
    else:
        if num_heads_q is None:
            raise ArgumentError("num_heads_q: expected an int with a (B, S, Hq + 2 * Hkv, D) qkv, got None")
        Hq = int_at_least("num_heads_q", num_heads_q, 1)
        Hkv, rest = divmod(qkv.shape[2] - Hq, 2)
        if rest or Hkv < 1:
            raise ArgumentError(f"num_heads_q: expected Hq with {qkv.shape[2]} - Hq = 2 * Hkv > 0, got {Hq}")
        q, k = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv]
    apply_rotary(q, cos, sin, interleaved, inplace=True, seqlen_offsets=seqlen_offsets)
    apply_rotary(k, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k, interleaved, inplace=True,
                 seqlen_offsets=seqlen_offsets)
    return qkv


@argument_errors
def apply_rotary_emb_kv_(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                         seqlen_offsets: int | torch.Tensor = 0) -> torch.Tensor:
    """RoPE of k in place inside kv (B, S, 2, Hkv, D), FlashAttention's ``apply_rotary_emb_kv_``.
    Returns kv."""
    tensor("kv", kv, ndim=5)
    if kv.shape[2] != 2:
        raise ArgumentError(f"kv: expected (B, S, 2, Hkv, D), got {tuple(kv.shape)}")
    apply_rotary(kv[:, :, 0], cos, sin, interleaved, inplace=True, seqlen_offsets=seqlen_offsets)
    return kv


__all__ = ["apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_kv_", "apply_rotary_emb_qkv_"]
