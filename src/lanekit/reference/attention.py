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
    dropout_draws: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    p_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward. q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv).

    ``window_size`` already holds the causal mask (causal is (left, 0)). Returns out (B, Sq, Hq, Dv)
    and lse (B, Hq, Sq), both in the compute dtype (that of q). ``dropout_draws`` (B, Hq, Sq, Sk)
    replaces the draws of :func:`dropout_uniforms` (a packed batch numbers its draws otherwise).

    ``sinks`` (Hq,): a logit per head that joins every row's softmax denominator with no value
    (gpt-oss): out = sum_j e^{s_j} v_j / (e^{sink} + sum_j e^{s_j}), and the LSE includes it; a
    row that sees no key gives 0 and LSE = sink.

    fp8/int8 attention (FlashAttention-3's descales): q, k, v hold the codes (as floats), and
    ``q_descale``, ``k_descale``, ``v_descale`` (B, Hkv) multiply them back: the scores are
    (q k^T) * q_descale * k_descale * softmax_scale (softcap, ALiBi and bias after that, never
    multiplied by the descales), and v_descale multiplies the output. ``p_dtype``: the format the
    kernel rounds the unnormalized probabilities e^{s - m} (m: the row's largest visible score, sinks
    aside) to before its P.V product (V's fp8 format; fp16 for int8 V); the denominator is not
    rounded, as in the kernel.
    """
    B, Sq, Hq, _ = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    dtype = q.dtype
    group = Hq // Hkv
    qh = q.transpose(1, 2)                                          # (B, Hq, Sq, D)
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)          # (B, Hq, Sk, D)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1).to(dtype)  # (B, Hq, Sk, Dv)

    s = qh @ kh.transpose(-1, -2)                                   # (B, Hq, Sq, Sk)
    if q_descale is not None or k_descale is not None:
        s = s * _head_descale(q_descale, B, Hq, dtype, q.device) * _head_descale(k_descale, B, Hq, dtype, q.device)
    s = s * softmax_scale
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
    alpha = 1.0
    if sinks is not None:   # the sink's term joins the denominator, both taken relative to
        sink = sinks.to(dtype)[None, :, None, None]   # top = max(m, sink) (e^{sink - m} overflows
        top = torch.maximum(m, sink)                  # for a sink far above the scores)
        top = torch.where(torch.isneginf(top), 0, top)
        alpha = torch.exp(m - top)
        total = total * alpha + torch.exp(sink - top)
        m = top
    if p_dtype is not None:  # the kernel's P.V takes e^{s - m} rounded to p_dtype; the sum is not
        e = e.to(p_dtype).to(dtype)
    p = e * alpha / torch.where(total == 0, 1, total)               # empty rows: all zeros
    lse = (m + torch.log(total)).squeeze(-1)                        # (B, Hq, Sq); -inf if empty
    if dropout_p > 0:
        u = dropout_draws if dropout_draws is not None else dropout_uniforms(seed, offset, B, Hq, Sq, Sk)
        u = u.to(q.device)
        p = torch.where(u >= dropout_p, p / (1 - dropout_p), 0)
    out = p @ vh                                                    # (B, Hq, Sq, Dv)
    if v_descale is not None:
        out = out * _head_descale(v_descale, B, Hq, dtype, q.device)
    return out.transpose(1, 2), lse


def _head_descale(descale: torch.Tensor | None, B: int, Hq: int, dtype, device) -> torch.Tensor:
    """A (B, Hkv) descale as a (B, Hq, 1, 1) factor (query head h takes KV head h // group's);
    1 when None."""
    if descale is None:
        return torch.ones((), dtype=dtype, device=device)
    group = Hq // descale.shape[1]
    return descale.to(dtype).repeat_interleave(group, dim=1).reshape(B, Hq, 1, 1)


def paged_to_dense(k_cache: torch.Tensor, block_table_row: torch.Tensor, n: int) -> torch.Tensor:
    """The first n tokens of one sequence of a paged cache (num_blocks, page_size, H, D), whose
    pages are ``block_table_row``, in order: (n, H, D)."""
    pages = block_table_row[: -(-n // k_cache.shape[1])].long()
    return k_cache[pages].flatten(0, 1)[:n]


def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_table: torch.Tensor | None = None,
    softmax_scale: float,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seed: int = 0,
    offset: int = 0,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    p_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a packed batch: :func:`flash_attn` on each sequence by itself (``sinks``,
    the (B, Hkv) descales and ``p_dtype`` as there, descale row b for sequence b).

    q (total_q, Hq, D); k, v (total_k, Hkv, D), or paged (num_blocks, page_size, Hkv, D) with
    ``block_table`` (B, max_pages); sequence b holds query rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1]
    and keys cu_seqlens_k[b] .. cu_seqlens_k[b + 1] (its first Sk_b cached tokens when paged), and
    its masks are aligned bottom-right with its own lengths. ``alibi_slopes`` (B, Hq). The dropout
    draw of (head h, packed query row r, key j) has Philox counter
    offset + (h * total_q + r) * max_seqlen_k + j. Returns out (total_q, Hq, Dv), lse (Hq, total_q).
    """
    total_q, Hq, _ = q.shape
    out = q.new_zeros(total_q, Hq, v.shape[-1])
    lse = q.new_full((Hq, total_q), float("-inf"))
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1 = cq[b], cq[b + 1]
        n = ck[b + 1] - ck[b]
        if q1 == q0:
            continue
        if block_table is not None:
            kb, vb = paged_to_dense(k, block_table[b], n), paged_to_dense(v, block_table[b], n)
        else:
            kb, vb = k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        draws = None
        if dropout_p > 0:
            rows = torch.arange(Hq)[:, None] * total_q + torch.arange(q0, q1)[None, :]   # (Hq, Sq_b)
            counters = offset + rows[:, :, None] * max_seqlen_k + torch.arange(n)[None, None, :]
            draws = philox_uniform(seed, counters)[None]
        o, l = flash_attn(q[q0:q1][None], kb[None], vb[None], softmax_scale=softmax_scale,
                          window_size=window_size, softcap=softcap,
                          alibi_slopes=alibi_slopes[b:b + 1] if alibi_slopes is not None else None,
                          dropout_p=dropout_p, seed=seed, offset=offset, dropout_draws=draws, sinks=sinks,
                          p_dtype=p_dtype, **_row_descales(b, q_descale, k_descale, v_descale))
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


def _row_descales(b: int, q_descale, k_descale, v_descale) -> dict:
    """Row b of each (B, Hkv) descale, as (1, Hkv), for :func:`flash_attn` on sequence b alone."""
    return {name: (d[b:b + 1] if d is not None else None)
            for name, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))}


def gradients(forward, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              attn_bias: torch.Tensor | None = None, sinks: torch.Tensor | None = None, **kwargs):
    """(dq, dk, dv, dbias, dsinks) of ``forward(q=, k=, v=, attn_bias=, sinks=, **kwargs) -> (out,
    lse)`` by autograd, for the gradient ``dout`` (B, Sq, Hq, Dv) of out. dbias is the gradient of
    ``attn_bias`` in its shape (per element of the (B, Hq, Sq, Sk) view the lanes receive), or an
    empty tensor without a bias; dsinks that of ``sinks`` (Hq,), or empty without sinks.
    """
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    bias = attn_bias.detach().requires_grad_() if attn_bias is not None else None
    sink = sinks.detach().requires_grad_() if sinks is not None else None
    extra = {"sinks": sink} if sinks is not None else {}
    with torch.enable_grad():
        out, _ = forward(q=leaves[0], k=leaves[1], v=leaves[2], attn_bias=bias, **extra, **kwargs)
        wrt = leaves + [t for t in (bias, sink) if t is not None]
        grads = list(torch.autograd.grad(out, wrt, dout))
    dq, dk, dv = grads[:3]
    dbias = grads.pop(3) if bias is not None else q.new_zeros(0)
    dsinks = grads[3] if sink is not None else q.new_zeros(0)
    return dq, dk, dv, dbias, dsinks


def flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs):
    """The gradients of :func:`flash_attn` (see :func:`gradients`), computed in the dtype of q."""
    return gradients(flash_attn, dout, q, k, v, **kwargs)


def flash_attn_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs):
    """(dq, dk, dv, dsinks) of :func:`flash_attn_varlen` by autograd, for the gradient ``dout`` of
    out; dsinks empty without ``sinks``."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    sinks = kwargs.pop("sinks", None)
    sink = [sinks.detach().requires_grad_()] if sinks is not None else []
    with torch.enable_grad():
        out, _ = flash_attn_varlen(*leaves, sinks=sink[0] if sink else None, **kwargs)
        grads = torch.autograd.grad(out, leaves + sink, dout)
    return (*grads[:3], grads[3] if sink else q.new_zeros(0))


def flash_attn_varlen_qkvpacked(qkv: torch.Tensor, *, cu_seqlens: torch.Tensor, max_seqlen: int, **kwargs):
    """:func:`flash_attn_varlen` on qkv (total, 3, H, D): q, k, v along dimension 1, one set of
    lengths for queries and keys (FlashAttention's ``flash_attn_varlen_qkvpacked_func``)."""
    return flash_attn_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                             max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, **kwargs)


def flash_attn_varlen_kvpacked(q: torch.Tensor, kv: torch.Tensor, **kwargs):
    """:func:`flash_attn_varlen` with kv (total_k, 2, Hkv, D): k and v along dimension 1
    (FlashAttention's ``flash_attn_varlen_kvpacked_func``)."""
    return flash_attn_varlen(q, kv[:, 0], kv[:, 1], **kwargs)


def flash_attn_varlen_qkvpacked_backward(dout: torch.Tensor, qkv: torch.Tensor, **kwargs):
    """(dqkv,) of :func:`flash_attn_varlen_qkvpacked` by autograd, in qkv's layout."""
    leaf = qkv.detach().requires_grad_()
    with torch.enable_grad():
        out, _ = flash_attn_varlen_qkvpacked(leaf, **kwargs)
        return torch.autograd.grad(out, (leaf,), dout)


def flash_attn_varlen_kvpacked_backward(dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, **kwargs):
    """(dq, dkv) of :func:`flash_attn_varlen_kvpacked` by autograd, dkv in kv's layout."""
    leaves = [t.detach().requires_grad_() for t in (q, kv)]
    with torch.enable_grad():
        out, _ = flash_attn_varlen_kvpacked(*leaves, **kwargs)
        return torch.autograd.grad(out, leaves, dout)

def _rounded(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return x.to(dtype).to(x.dtype) if dtype is not None else x


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    rotary_interleaved: bool = True,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    k_cache_scale: torch.Tensor | None = None,
    v_cache_scale: torch.Tensor | None = None,
    kv_dtype: torch.dtype | None = None,
    rotary_dtype: torch.dtype | None = None,
    softmax_scale: float,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 1,
    max_seqlen_k: int | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    p_dtype: torch.dtype | None = None,
):
    """Decode attention over a KV cache, FlashAttention's ``flash_attn_with_kvcache``, on copies.

    q (B, Sq, Hq, D). The cache: (B_cache, S_cache, Hkv, D), row ``cache_batch_idx[b]`` (default
    b) for sequence b; or paged (num_blocks, page_size, Hkv, D) with ``block_table``. Sequence b
    holds cache positions [cache_leftpad[b] (default 0), cache_seqlens[b]). The new k, v (B, S_new,
    Hkv, D), if given, are rotated (k only; positions cache_seqlens[b] + t) and written at positions
    cache_seqlens[b] + t, stored as ``kv_dtype`` (the cache's dtype; with scales, quantized by
    :func:`lanekit.reference.kv_cache.quantize_kv`). q is rotated at positions cache_seqlens[b] + i
    when the window is bounded on either side (causal or local), else all at cache_seqlens[b].
    Then each sequence is :func:`flash_attn` of its q over its positions [leftpad, seqlens + S_new)
    (dequantized). The rotated q and k are rounded to ``rotary_dtype`` (the inputs' dtype: the
    kernels store them so) when given. ``num_splits`` and ``max_seqlen_k`` change nothing here
    (they are the kernel's schedule and tile). ``sinks``, the (B, Hkv) descales of an fp8/int8
    q over a cache of its dtype, and ``p_dtype``: as :func:`flash_attn`.

    Returns (out (B, Sq, Hq, Dv), lse (B, Hq, Sq), k_cache, v_cache), the caches after the write,
    dequantized to fp32 when they hold codes.
    """
    from lanekit.reference import kv_cache as kvref, layers as lref

    B, Sq = q.shape[:2]
    dtype = q.dtype
    kv_dtype = kv_dtype or k_cache.dtype
    paged = block_table is not None
    if not paged:  # a contiguous cache is one page of S_cache tokens per sequence
        rows = cache_batch_idx if cache_batch_idx is not None else torch.arange(B, device=q.device)
        block_table = rows.reshape(B, 1)
    page_size = k_cache.shape[1]
    start = cache_seqlens.long().cpu()
    left, right = window_size
    if k is not None:
        S_new = k.shape[1]
        positions = start[:, None] + torch.arange(S_new)                         # (B, S_new)
        if rotary_cos is not None:
            k = _rounded(lref.apply_rotary(k, rotary_cos, rotary_sin, rotary_interleaved, position_ids=positions),
                         rotary_dtype)
        pages = block_table.long().cpu()[torch.arange(B)[:, None], positions // page_size]
        slots = (pages * page_size + positions % page_size).reshape(-1).to(q.device)
        new = kvref.reshape_and_cache(k.flatten(0, 1), v.flatten(0, 1), k_cache, v_cache, slots,
                                      k_cache_scale=k_cache_scale, v_cache_scale=v_cache_scale,
                                      kv_dtype=kv_dtype)
        k_cache, v_cache = new[0], new[1]
        if k_cache_scale is not None:
            k_cache_scale, v_cache_scale = new[2], new[3]
        end = start + S_new
    else:
        end = start
    if rotary_cos is not None:
        bounded = left >= 0 or right >= 0
        positions = start[:, None] + (torch.arange(Sq) if bounded else torch.zeros(Sq, dtype=torch.long))
        q = _rounded(lref.apply_rotary(q, rotary_cos, rotary_sin, rotary_interleaved, position_ids=positions),
                     rotary_dtype)
    lp = cache_leftpad.long().cpu() if cache_leftpad is not None else torch.zeros(B, dtype=torch.long)

    quantized = k_cache_scale is not None
    outs, lses = [], []
    for b in range(B):
        n = int(end[b])
        kb = paged_to_dense(k_cache, block_table[b], n)[int(lp[b]):]
        vb = paged_to_dense(v_cache, block_table[b], n)[int(lp[b]):]
        if quantized:
            kb = kvref.dequantize_kv(kb, paged_to_dense(k_cache_scale[..., None], block_table[b], n)[int(lp[b]):, :, 0], dtype)
            vb = kvref.dequantize_kv(vb, paged_to_dense(v_cache_scale[..., None], block_table[b], n)[int(lp[b]):, :, 0], dtype)
        o, l = flash_attn(q[b:b + 1], kb[None].to(dtype), vb[None].to(dtype), softmax_scale=softmax_scale,
                          window_size=window_size, softcap=softcap,
                          alibi_slopes=alibi_slopes[b:b + 1] if alibi_slopes is not None else None,
                          sinks=sinks, p_dtype=p_dtype, **_row_descales(b, q_descale, k_descale, v_descale))
        outs.append(o)
        lses.append(l)
    if B == 0:   # an empty batch: empty results of the documented shapes
        Dv = v_cache.shape[-1]
        outs = [torch.empty((0, Sq, q.shape[2], Dv), dtype=dtype)]
        lses = [torch.empty((0, q.shape[2], Sq), dtype=dtype)]
    out, lse = torch.cat(outs), torch.cat(lses)
    if quantized:
        k_cache = kvref.dequantize_kv(k_cache, k_cache_scale)
        v_cache = kvref.dequantize_kv(v_cache, v_cache_scale)
    return out, lse, k_cache, v_cache


def quantized_p_dtype(v: torch.Tensor) -> torch.dtype:
    """Where fp8/int8 attention rounds P before P.V: V's fp8 format; fp16 for int8 V (P in fp16
    against V's codes, exact in fp16)."""
    return torch.float16 if v.dtype == torch.int8 else v.dtype


def _upcast_all(kw: dict) -> dict:
    return {n: (t.to(torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
            for n, t in kw.items()}


def flash_attn_quantized(q, k, v, *, out_dtype=None, **kwargs):
    """:func:`flash_attn` of fp8/int8 q, k, v (codes) with their descales, in float64: P rounded
    to :func:`quantized_p_dtype`. ``out_dtype`` is the lanes' (the oracle stays float64)."""
    f64 = torch.float64
    return flash_attn(q.to(f64), k.to(f64), v.to(f64), p_dtype=quantized_p_dtype(v), **_upcast_all(kwargs))


def flash_attn_varlen_quantized(q, k, v, *, out_dtype=None, **kwargs):
    """:func:`flash_attn_varlen` of fp8/int8 q, k, v with their descales, as :func:`flash_attn_quantized`."""
    f64 = torch.float64
    return flash_attn_varlen(q.to(f64), k.to(f64), v.to(f64), p_dtype=quantized_p_dtype(v), **_upcast_all(kwargs))


def flash_attn_with_kvcache_quantized(q, k_cache, v_cache, *, out_dtype=None, kv_dtype=None, rotary_dtype=None,
                                      **kwargs):
    """:func:`flash_attn_with_kvcache` of an fp8/int8 q over caches of its dtype with the
    descales, as :func:`flash_attn_quantized`."""
    f64 = torch.float64
    return flash_attn_with_kvcache(q.to(f64), k_cache.to(f64), v_cache.to(f64), p_dtype=quantized_p_dtype(v_cache),
                                   **_upcast_all(kwargs))
