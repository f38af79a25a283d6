"""The oracle of MLA decode (``flash_mla_with_kvcache``): plain PyTorch that reads like the math.
No Triton here.

DeepSeek's multi-head latent attention, decoded in its absorbed form (FlashMLA's "MQA mode"): each
cached token is one row of D features (512 latent + 64 rope dims in DeepSeek V2/V3), shared by every
query head; the key is the whole row and the value its first Dv (head_dim_v) features. The cache is
paged as FlashAttention's (num_blocks, page_size, Hkv, D): token t of sequence b sits in page
``block_table[b, t // page_size]`` at offset ``t % page_size``; a cache of int8 or fp8 codes holds
one fp32 scale per (slot, head) as ``lanekit.kv_cache`` does (the value is codes * scale).
"""

from __future__ import annotations

import torch


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           cache_seqlens: torch.Tensor, head_dim_v: int, *, softmax_scale: float,
                           causal: bool = False, k_cache_scale: torch.Tensor | None = None,
                           num_splits: int = 1):
    """Attention of q over each sequence's cached tokens, computed in q's dtype (float64 in checks).

    q (B, Sq, H, D); k_cache (num_blocks, page_size, Hkv, D), Hkv dividing H (query head h reads
    cache head h // (H / Hkv)); block_table (B, max_pages); cache_seqlens (B,). Sequence b's keys
    K_b = its first cache_seqlens[b] cached rows (dequantized: codes * k_cache_scale), values V_b =
    K_b[..., :head_dim_v]. Scores q K^T * softmax_scale; with ``causal``, query i sees keys
    j <= i + Sk - Sq (bottom-right, as FlashAttention). ``num_splits`` is the kernel's schedule:
    it changes nothing here.

    Returns out (B, Sq, H, head_dim_v) and lse (B, H, Sq), natural log; a row that sees no key
    gives out 0 and lse -inf.
    """
    B, Sq, H, D = q.shape
    _, page_size, Hkv, _ = k_cache.shape
    dtype = q.dtype
    out = torch.zeros(B, Sq, H, head_dim_v, dtype=dtype, device=q.device)
    lse = torch.full((B, H, Sq), float("-inf"), dtype=dtype, device=q.device)
    for b in range(B):
        n = int(cache_seqlens[b])
        pages = block_table[b, : -(-n // page_size)].long().to(k_cache.device)
        k = k_cache[pages].reshape(-1, Hkv, D)[:n].to(dtype)                            # (n, Hkv, D)
        if k_cache_scale is not None:
            k = k * k_cache_scale[pages].reshape(-1, Hkv)[:n, :, None].to(dtype)
        k = k.to(q.device).repeat_interleave(H // Hkv, dim=1)                           # (n, H, D)
        s = torch.einsum("ihd,jhd->hij", q[b], k) * softmax_scale                       # (H, Sq, n)
        if causal:
            later = torch.arange(n, device=q.device)[None, :] > torch.arange(Sq, device=q.device)[:, None] + n - Sq
            s = s.masked_fill(later, float("-inf"))
        m = s.amax(dim=-1, keepdim=True) if n else s.new_full((H, Sq, 1), float("-inf"))
        m = torch.where(torch.isneginf(m), 0, m)                                          # a row that sees no key
        lse_b = (m + torch.log(torch.exp(s - m).sum(-1, keepdim=True))).squeeze(-1)     # (H, Sq); NaN stays NaN
        seen = ~torch.isneginf(lse_b)                                                    # (an inf score: NaN, as
        p = torch.where(seen[..., None], torch.exp(s - torch.where(seen, lse_b, 0)[..., None]), 0)   # attention's)
        out[b] = torch.einsum("hij,jhd->ihd", p, k[..., :head_dim_v])
        lse[b] = lse_b
    return out, lse
