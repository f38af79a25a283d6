"""Oracles of the paged KV cache: plain PyTorch that reads like the definitions. No Triton here.

The cache's layout is FlashAttention's paged KV cache (``flash_attn_with_kvcache``): k_cache and
v_cache (num_blocks, page_size, Hkv, D); a sequence's token t lives in page
``block_table[b, t // page_size]`` at offset ``t % page_size``; ``cache_seqlens[b]`` tokens are live.
New tokens are written at slots (vLLM's ``slot_mapping``): slot = page * page_size + offset, and a
negative slot is padding, skipped. A quantized cache holds int8 or fp8 e4m3 codes and one fp32 scale
per (slot, head), (num_blocks, page_size, Hkv): the value is codes * scale.

Quantization is specified bit for bit (as ``lanekit.reference.numerics.quantize_per_head``): the
input is taken in fp32 (exact for fp16, bf16 and fp32 inputs), scale = amax / qmax per (token, head)
(qmax 127 for int8, 448 for e4m3; 1 for an all-zero row) unless scales are given, and codes = x /
scale correctly rounded, then rounded half to even and clamped ([-128, 127] for int8, +-448 for e4m3,
whose cast rounds to nearest even). Dequantization is codes * scale in fp32, one rounding, then
rounded to the requested dtype.

``merge_attn_states`` combines two attention partials over disjoint key sets by their natural-log
LSEs, as FlashAttention's split-KV combine and vLLM's ``merge_attn_states``.
"""

from __future__ import annotations

import torch

from lanekit.reference.numerics import quantize_per_head, to_codes

F32 = torch.float32


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None):
    """Per-row symmetric quantization of x (..., D) to ``dtype`` (int8, float8_e4m3fn or float8_e5m2).

    Without ``scale``: :func:`lanekit.reference.numerics.quantize_per_head` of x in fp32. With
    ``scale`` (broadcastable to x.shape[:-1], > 0): codes = round-half-even(x / scale) clamped,
    and that scale returned (expanded to x.shape[:-1], fp32). Returns (codes, scale)."""
    v = x.to(F32)
    if scale is None:
        return quantize_per_head(v, dtype)
    s = scale.to(F32).expand(x.shape[:-1])
    # divided by a tensor: correctly rounded (see quantize_per_head)
    return to_codes(v / s.unsqueeze(-1), dtype), s.contiguous()


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = F32) -> torch.Tensor:
    """codes (..., D) * scale (...) in fp32 (one rounding), rounded to ``dtype``. ``codes`` may be
    given as any float holding the code values (the checks pass float64 copies of fp8 codes)."""
    return (codes.to(F32) * scale.to(F32).unsqueeze(-1)).to(dtype)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None,
                      k_cache_scale=None, v_cache_scale=None, kv_dtype=None):
    """Write token n of key/value (N, Hkv, D) at slot ``slot_mapping[n]`` of copies of the caches;
    negative slots are skipped. A quantized cache (``k_cache_scale`` given) gets the codes of
    :func:`quantize_kv` (with the given ``k_scale``/``v_scale``, broadcastable to (N, Hkv), if any)
    and their scales. ``kv_dtype`` is the caches' storage dtype (default k_cache's; the checks pass
    float64 copies of float caches). Returns the new (k_cache, v_cache), and with scales
    (k_cache, v_cache, k_cache_scale, v_cache_scale)."""
    kv_dtype = kv_dtype or k_cache.dtype
    quantized = k_cache_scale is not None
    keep = slot_mapping.long() >= 0
    slots = slot_mapping.long()[keep]
    outs, scales = [], []
    for x, cache, given, cache_scale in ((key, k_cache, k_scale, k_cache_scale),
                                         (value, v_cache, v_scale, v_cache_scale)):
        blocks, page_size, H, D = cache.shape
        new = cache.to(kv_dtype, copy=True, memory_format=torch.contiguous_format)
        rows = new.view(blocks * page_size, H, D)
        if quantized:
            codes, s = quantize_kv(x, kv_dtype, None if given is None else given.expand(x.shape[:-1]))
            new_scale = cache_scale.to(F32, copy=True, memory_format=torch.contiguous_format)
            new_scale.view(blocks * page_size, H)[slots] = s[keep]
            rows[slots] = codes[keep]
            scales.append(new_scale)
        else:
            rows[slots] = x[keep].to(kv_dtype)
        outs.append(new)
    return (*outs, *scales)


def gather_cache(k_cache, v_cache, block_table, cache_seqlens, k_cache_scale=None,
                 v_cache_scale=None, dtype=None, max_seqlen=None):
    """Each sequence's tokens read back from its pages, as dense (B, max_seqlen, Hkv, D) tensors
    padded with zeros (max_seqlen: the longest sequence if None). A quantized cache is dequantized
    (:func:`dequantize_kv`) to ``dtype`` (default fp32); a float cache is returned in ``dtype``
    (default its own). Returns (k, v)."""
    lengths = [int(n) for n in cache_seqlens]
    S = max(lengths, default=0) if max_seqlen is None else max_seqlen
    outs = []
    for cache, scale in ((k_cache, k_cache_scale), (v_cache, v_cache_scale)):
        _, page_size, H, D = cache.shape
        out_dtype = dtype or (F32 if scale is not None else cache.dtype)
        out = torch.zeros(len(lengths), S, H, D, dtype=out_dtype, device=cache.device)
        for b, n in enumerate(lengths):
            pages = block_table[b, : -(-n // page_size)].long()
            rows = cache[pages].reshape(-1, H, D)[:n]
            if scale is not None:
                rows = dequantize_kv(rows, scale[pages].reshape(-1, H)[:n], out_dtype)
            out[b, :n] = rows.to(out_dtype)
        outs.append(out)
    return tuple(outs)


def merge_attn_states(out_a, lse_a, out_b, lse_b):
    """Attention over keys A and B from its partials over A and over B.

    out_*: (B, Sq, H, D); lse_*: (B, H, Sq), natural log. lse = log(e^lse_a + e^lse_b);
    out = (e^(lse_a - lse) out_a + e^(lse_b - lse) out_b). A partial whose LSE is -inf (no key)
    contributes nothing, whatever its out holds; +inf, FlashAttention 2's LSE of a row with no key,
    counts as -inf (as vLLM's merge does). Both empty: out 0 and lse -inf. Computed in the dtype of
    lse_a; returns (out, lse)."""
    ninf = torch.tensor(float("-inf"), dtype=lse_a.dtype, device=lse_a.device)
    la = torch.where(torch.isposinf(lse_a), ninf, lse_a)
    lb = torch.where(torch.isposinf(lse_b), ninf, lse_b.to(lse_a.dtype))
    m = torch.maximum(la, lb)
    empty = torch.isneginf(m)
    m = torch.where(empty, 0, m)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)            # (B, H, Sq); exp(-inf) = 0
    total = wa + wb
    lse = torch.where(empty, ninf, m + torch.log(torch.where(empty, 1, total)))

    def weighted(out, w):
        w = w.transpose(1, 2).unsqueeze(-1)                  # (B, Sq, H, 1)
        return torch.where(w > 0, out.to(lse_a.dtype) * w, 0)

    denom = torch.where(empty, 1, total).transpose(1, 2).unsqueeze(-1)
    return (weighted(out_a, wa) + weighted(out_b, wb)) / denom, lse
