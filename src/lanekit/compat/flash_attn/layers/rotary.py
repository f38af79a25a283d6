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



class RotaryEmbedding(torch.nn.Module):
    """FlashAttention's ``RotaryEmbedding`` module: RoPE applied in place to packed q, k (and v
    untouched), from cos/sin tables it builds and caches in fp32 then casts to the input's dtype.

    Arguments:
        dim: rotary_dim, the features rotated (even, at most the head dim).
        base: the frequency base: pair i turns by position * base ** (-2i / dim).
        interleaved: GPT-J's pairing if True, else GPT-NeoX's.
        scale_base: None, or XPos (Sun et al. 2022): q's cos/sin multiplied and k's divided by
            ((2i + 0.4 dim) / (1.4 dim)) ** ((position - S // 2) / scale_base).
        device: where the tables live.

    ``forward(qkv, kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None)``: qkv (B, S, 3, H,
    D) or (B, S, Hq + 2 Hkv, D) with num_heads_q, rotated in place and returned; or q (B, S, Hq, D)
    with kv (B, S, 2, Hkv, D), both rotated in place and returned as (q, kv). ``seqlen_offset``: an
    int or a (B,) tensor (then pass ``max_seqlen``, the table's length).

    Source: Su et al., "RoFormer" (2021); FlashAttention's ``flash_attn.layers.rotary``.
    """

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, scale_base: float | None = None,
                 device=None):
        super().__init__()
        self.dim = int_at_least("dim", dim, 2)
        self.base = float(base)
        self.interleaved = interleaved
        self.scale_base = scale_base
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)
        halves = torch.arange(0, dim, 2, device=device, dtype=torch.float32)
        self.register_buffer("scale", (halves + 0.4 * dim) / (1.4 * dim) if scale_base is not None else None,
                             persistent=False)
        self._tables = None   # (length, cos, sin, cos_k, sin_k)

    def _inv_freq(self, device):
        return self.base ** (-torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim)

    def _update(self, length: int, device, dtype):
        """The cos/sin tables for positions 0 .. length - 1 (at least), rebuilt when longer ones,
        another device or dtype, or training after inference-mode tables are needed."""
        t = self._tables
        if (t is not None and t[0] >= length and t[1].device == device and t[1].dtype == dtype
                and not (self.training and t[1].is_inference())):
            return
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._inv_freq(device)
        angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq.to(device))
        cos, sin = torch.cos(angles), torch.sin(angles)
        if self.scale is None:
            self._tables = (length, cos.to(dtype), sin.to(dtype), None, None)
            return
        power = (torch.arange(length, device=device, dtype=torch.float32) - length // 2) / self.scale_base
        scale = self.scale.to(device) ** power[:, None]
        self._tables = (length, (cos * scale).to(dtype), (sin * scale).to(dtype), (cos / scale).to(dtype),
                        (sin / scale).to(dtype))

    def forward(self, qkv: torch.Tensor, kv: torch.Tensor | None = None, seqlen_offset: int | torch.Tensor = 0,
                max_seqlen: int | None = None, num_heads_q: int | None = None):
        tensor("qkv", qkv, ndim=(4, 5))
        if max_seqlen is not None:
            self._update(int_at_least("max_seqlen", max_seqlen), qkv.device, qkv.dtype)
        elif not isinstance(seqlen_offset, torch.Tensor):
            self._update(qkv.shape[1] + int_at_least("seqlen_offset", seqlen_offset), qkv.device, qkv.dtype)
        elif self._tables is None:
            raise ArgumentError("max_seqlen: expected an int with a tensor seqlen_offset (the tables' length), "
                                "got None")
        _, cos, sin, cos_k, sin_k = self._tables
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, interleaved=self.interleaved,
                                         seqlen_offsets=seqlen_offset, num_heads_q=num_heads_q)
        q = apply_rotary_emb(qkv, cos, sin, interleaved=self.interleaved, inplace=True, seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k,
                                  interleaved=self.interleaved, seqlen_offsets=seqlen_offset)
        return q, kv

__all__ = ["RotaryEmbedding", "apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_kv_",
           "apply_rotary_emb_qkv_"]
