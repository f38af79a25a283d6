"""The attention lanes, and the custom op that makes the Triton lane opaque to torch.compile.

Every lane takes the normalized keyword arguments that ``flash_attn_func`` produces after
validation (window_size holding the causal mask, bias/mask expanded to (B, Hq, Sq, Sk), slopes to
(B, Hq)) and returns ``(out, lse)``.
"""

from __future__ import annotations

import torch

from lanekit.reference import attention as ref
from lanekit.runtime.custom_ops import call as _call, custom_op as _custom_op


@_custom_op("lanekit::flash_attn_fwd")
def _flash_attn_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    attn_bias: torch.Tensor | None, attn_mask: torch.Tensor | None, alibi_slopes: torch.Tensor | None,
    softmax_scale: float, window_left: int, window_right: int, softcap: float,
    dropout_p: float, seed: int, offset: int,
    sinks: torch.Tensor | None = None, q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from lanekit.attention.kernels import flash_attn_fwd  # imported on first use: see runtime.lanes

    return flash_attn_fwd(
        q=q, k=k, v=v, softmax_scale=softmax_scale, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes, attn_bias=attn_bias, attn_mask=attn_mask,
        dropout_p=dropout_p, seed=seed, offset=offset, sinks=sinks, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
    )


@_flash_attn_fwd_op.register_fake
def _(q, k, v, attn_bias, attn_mask, alibi_slopes, softmax_scale, window_left, window_right,
      softcap, dropout_p, seed, offset, sinks=None, q_descale=None, k_descale=None, v_descale=None,
      out_dtype=None):
    B, Sq, Hq, _ = q.shape
    return (q.new_empty((B, Sq, Hq, v.shape[3]), dtype=out_dtype or q.dtype),
            q.new_empty((B, Hq, Sq), dtype=torch.float32))


@_custom_op("lanekit::flash_attn_bwd")
def _flash_attn_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dlse: torch.Tensor | None,
    attn_bias: torch.Tensor | None, attn_mask: torch.Tensor | None, alibi_slopes: torch.Tensor | None,
    softmax_scale: float, window_left: int, window_right: int, softcap: float,
    dropout_p: float, seed: int, offset: int, bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from lanekit.attention.kernels import flash_attn_bwd

    dq, dk, dv, dbias = flash_attn_bwd(
        dout=dout, q=q, k=k, v=v, out=out, lse=lse, dlse=dlse, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        attn_bias=attn_bias, attn_mask=attn_mask, dropout_p=dropout_p, seed=seed, offset=offset,
        bias_grad=bias_grad,
    )
    # A custom op returns tensors only: an empty one stands for "no bias gradient".
    return dq, dk, dv, dbias if dbias is not None else q.new_empty(0, dtype=torch.float32)


@_flash_attn_bwd_op.register_fake
def _(dout, q, k, v, out, lse, dlse, attn_bias, attn_mask, alibi_slopes, softmax_scale,
      window_left, window_right, softcap, dropout_p, seed, offset, bias_grad):
    B, Sq, Hq, _ = q.shape
    dbias_shape = (B, Hq, Sq, k.shape[1]) if bias_grad else (0,)
    # contiguous, as the kernel's outputs (empty_like would keep a transposed input's layout)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(dbias_shape, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    (q, k, v, attn_bias, attn_mask, alibi_slopes, softmax_scale, window_left, window_right,
     softcap, dropout_p, seed, offset, *extra) = inputs
    sinks = extra[0] if extra else None
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_bias, attn_mask, alibi_slopes, sinks)
    ctx.scalars = (softmax_scale, window_left, window_right, softcap, dropout_p, seed, offset)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, attn_bias, attn_mask, alibi_slopes, sinks = ctx.saved_tensors
    if q.dtype in _QUANT_DTYPES:
        raise RuntimeError("flash_attn_func: fp8 and int8 attention is forward only (as "
                           "FlashAttention-3's); no gradient flows through it")
    bias_grad = attn_bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias = _call(_flash_attn_bwd_op,
                              dout, q, k, v, out, lse, dlse, attn_bias, attn_mask, alibi_slopes, *ctx.scalars,
                              bias_grad, inputs=(dout, q, k, v, dlse, attn_bias))
    dbias = dbias.to(attn_bias.dtype) if bias_grad else None
    dsinks = sinks_grad(dout, out, lse, dlse, sinks, varlen=False) if sinks is not None and ctx.needs_input_grad[13] else None
    return dq, dk, dv, dbias, None, None, None, None, None, None, None, None, None, dsinks, None, None, None, None


_QUANT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)


def sinks_grad(dout, out, lse, dlse, sinks, *, varlen: bool) -> torch.Tensor:
    """The gradient of the sinks (Hq,) fp32: with P_sink = exp(sink - lse) the sink's share of each
    row and Delta = rowsum(dO * O) - dLSE (the backward kernels' Delta, from the rounded output),
    d sink_h = -sum over rows of head h of P_sink * Delta (the sink has no value, so only the
    denominator carries it). lse (B, Hq, Sq), or (Hq, total_q) when ``varlen``. A few fp32 torch
    reductions, no kernel of its own."""
    delta = (dout.float() * out.float()).sum(-1)             # (B, Sq, Hq) or (total_q, Hq)
    delta = delta.transpose(-1, -2)                          # lse's layout
    if dlse is not None:
        delta = delta - dlse.float()
    shape = (-1, 1) if varlen else (1, -1, 1)
    p_sink = torch.exp(sinks.float().reshape(shape) - lse)
    p_sink = torch.where(torch.isneginf(lse), 0.0, p_sink)   # a sink of -inf over no key
    dims = (1,) if varlen else (0, 2)
    return -(p_sink * delta).sum(dims).to(sinks.dtype)


_flash_attn_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def flash_attn_triton(*, q, k, v, softmax_scale, window_size, softcap, alibi_slopes, attn_bias,
                      attn_mask, dropout_p, seed, offset, sinks=None, q_descale=None, k_descale=None,
                      v_descale=None, out_dtype=None):
    # eager inference calls the launcher, eager training an autograd.Function, torch.compile the op.
    # The trailing arguments are always passed: the eager Function's backward returns a gradient
    # for every argument of the op, so it must have been given all of them.
    extra = (sinks, q_descale, k_descale, v_descale, _out_dtype(q, out_dtype))
    return _call(_flash_attn_fwd_op, q, k, v, attn_bias, attn_mask, alibi_slopes, softmax_scale,
                 window_size[0], window_size[1], softcap, dropout_p, seed, offset, *extra,
                 inputs=(q, k, v, attn_bias, sinks))


def p_dtype_of(v: torch.Tensor) -> torch.dtype | None:
    """The format the kernels round P to before P.V for fp8/int8 values (V's fp8 format; fp16 for
    int8): the oracle rounds there too. None for 16-bit and fp32 values (see ATTENTION_FWD)."""
    if v.dtype == torch.int8:
        return torch.float16
    return v.dtype if v.dtype in _QUANT_DTYPES else None


def _f64(t):
    return t.to(torch.float64) if t is not None else None


def flash_attn_reference(*, q, k, v, alibi_slopes, attn_bias, sinks=None, q_descale=None, k_descale=None,
                         v_descale=None, out_dtype=None, **kw):
    """The oracle as a lane: computes in float64, returns out in q's dtype (fp8/int8 inputs:
    ``out_dtype``, bf16 by default) and lse in fp32."""
    f64 = torch.float64
    out, lse = ref.flash_attn(
        q.to(f64), k.to(f64), v.to(f64),
        alibi_slopes=alibi_slopes.to(f64) if alibi_slopes is not None else None,
        attn_bias=attn_bias.to(f64) if attn_bias is not None else None, sinks=_f64(sinks),
        q_descale=_f64(q_descale), k_descale=_f64(k_descale), v_descale=_f64(v_descale), p_dtype=p_dtype_of(v),
        **kw,
    )
    return out.to(_out_dtype(q, out_dtype)), lse.to(torch.float32)


def _out_dtype(q, out_dtype):
    return out_dtype or (torch.bfloat16 if q.dtype in _QUANT_DTYPES else q.dtype)


def flash_attn_backward_triton(*, dout, **kw):
    """The Triton backward, reached the way training reaches it: autograd through the custom op.
    Returns (dq, dk, dv, dbias), dbias per element of the (B, Hq, Sq, Sk) bias or empty."""
    return ref.gradients(flash_attn_triton, dout, **kw)


def flash_attn_backward_reference(*, dout, **kw):
    """Autograd through the reference lane (float64 inside), gradients in the inputs' dtypes."""
    return ref.gradients(flash_attn_reference, dout, **kw)


# ---- packed variable-length batches (flash_attn_varlen_func) ----

@_custom_op("lanekit::flash_attn_varlen_fwd")
def _flash_attn_varlen_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, block_table: torch.Tensor | None, alibi_slopes: torch.Tensor | None,
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int,
    softcap: float, dropout_p: float, seed: int, offset: int,
    sinks: torch.Tensor | None = None, q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from lanekit.attention.kernels import flash_attn_fwd

    return flash_attn_fwd(
        q=q, k=k, v=v, softmax_scale=softmax_scale, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes, attn_bias=None, attn_mask=None,
        dropout_p=dropout_p, seed=seed, offset=offset, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        block_table=block_table, sinks=sinks, q_descale=q_descale, k_descale=k_descale,
        v_descale=v_descale, out_dtype=out_dtype,
    )


@_flash_attn_varlen_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q, max_seqlen_k,
      softmax_scale, window_left, window_right, softcap, dropout_p, seed, offset, sinks=None,
      q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    total_q, Hq, _ = q.shape
    return (q.new_empty((total_q, Hq, v.shape[-1]), dtype=out_dtype or q.dtype),
            q.new_empty((Hq, total_q), dtype=torch.float32))


@_custom_op("lanekit::flash_attn_varlen_bwd")
def _flash_attn_varlen_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dlse: torch.Tensor | None, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, alibi_slopes: torch.Tensor | None, max_seqlen_q: int,
    max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int, softcap: float,
    dropout_p: float, seed: int, offset: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from lanekit.attention.kernels import flash_attn_bwd

    dq, dk, dv, _ = flash_attn_bwd(
        dout=dout, q=q, k=k, v=v, out=out, lse=lse, dlse=dlse, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
        attn_bias=None, attn_mask=None, dropout_p=dropout_p, seed=seed, offset=offset,
        bias_grad=False, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )
    return dq, dk, dv


@_flash_attn_varlen_bwd_op.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q,
      max_seqlen_k, softmax_scale, window_left, window_right, softcap, dropout_p, seed, offset):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q, max_seqlen_k,
     softmax_scale, window_left, window_right, softcap, dropout_p, seed, offset, *extra) = inputs
    sinks = extra[0] if extra else None
    out, lse = output
    ctx.paged = block_table is not None
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks)
    ctx.scalars = (max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, softcap,
                   dropout_p, seed, offset)


def _varlen_backward(ctx, dout, dlse):
    if ctx.paged:
        raise RuntimeError("flash_attn_varlen_func: the backward with a block_table (a paged K/V "
                           "cache) is not supported; pass packed k and v to train")
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks = ctx.saved_tensors
    if q.dtype in _QUANT_DTYPES:
        raise RuntimeError("flash_attn_varlen_func: fp8 and int8 attention is forward only (as "
                           "FlashAttention-3's); no gradient flows through it")
    dq, dk, dv = _call(_flash_attn_varlen_bwd_op, dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k,
                       alibi_slopes, *ctx.scalars, inputs=(dout, q, k, v, dlse))
    dsinks = sinks_grad(dout, out, lse, dlse, sinks, varlen=True) if sinks is not None and ctx.needs_input_grad[16] else None
    return (dq, dk, dv) + (None,) * 13 + (dsinks, None, None, None, None)


_flash_attn_varlen_fwd_op.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def flash_attn_varlen_triton(*, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             block_table, softmax_scale, window_size, softcap, alibi_slopes,
                             dropout_p, seed, offset, sinks=None, q_descale=None, k_descale=None,
                             v_descale=None, out_dtype=None):
    extra = (sinks, q_descale, k_descale, v_descale, _out_dtype(q, out_dtype))   # always: see flash_attn_triton
    return _call(_flash_attn_varlen_fwd_op,
                 q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q, max_seqlen_k,
                 softmax_scale, window_size[0], window_size[1], softcap, dropout_p, seed, offset, *extra,
                 inputs=(q, k, v, sinks))


def flash_attn_varlen_reference(*, q, k, v, alibi_slopes, sinks=None, q_descale=None, k_descale=None,
                                v_descale=None, out_dtype=None, **kw):
    """The varlen oracle as a lane: float64 inside, out in q's dtype (fp8/int8: out_dtype, bf16 by
    default) and lse in fp32."""
    f64 = torch.float64
    out, lse = ref.flash_attn_varlen(
        q.to(f64), k.to(f64), v.to(f64),
        alibi_slopes=alibi_slopes.to(f64) if alibi_slopes is not None else None, sinks=_f64(sinks),
        q_descale=_f64(q_descale), k_descale=_f64(k_descale), v_descale=_f64(v_descale), p_dtype=p_dtype_of(v),
        **kw)
    return out.to(_out_dtype(q, out_dtype)), lse.to(torch.float32)


def _varlen_gradients(forward, dout, *, q, k, v, sinks=None, **kw):
    """(dq, dk, dv, dsinks) by autograd; dsinks empty without sinks."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    sink = [sinks.detach().requires_grad_()] if sinks is not None else []
    with torch.enable_grad():
        out, _ = forward(q=leaves[0], k=leaves[1], v=leaves[2], **({"sinks": sink[0]} if sink else {}), **kw)
        grads = torch.autograd.grad(out, leaves + sink, dout)
    return (*grads[:3], grads[3] if sink else q.new_zeros(0))


def flash_attn_varlen_backward_triton(*, dout, **kw):
    """(dq, dk, dv) through the Triton lane's autograd (the custom op's backward)."""
    return _varlen_gradients(flash_attn_varlen_triton, dout, **kw)


def flash_attn_varlen_backward_reference(*, dout, **kw):
    return _varlen_gradients(flash_attn_varlen_reference, dout, **kw)


# ---- the packed varlen variants, for the registry (the public functions slice and call the above) ----

def _unpacked_qkv(qkv, cu_seqlens, max_seqlen):
    return dict(q=qkv[:, 0], k=qkv[:, 1], v=qkv[:, 2], cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, block_table=None)


def flash_attn_varlen_qkvpacked_triton(*, qkv, cu_seqlens, max_seqlen, **kw):
    """flash_attn_varlen_qkvpacked_func's Triton lane: views of qkv (total, 3, H, D) into the
    varlen lane (its custom op), so autograd gathers dqkv in qkv's layout."""
    return flash_attn_varlen_triton(**_unpacked_qkv(qkv, cu_seqlens, max_seqlen), **kw)


def flash_attn_varlen_qkvpacked_reference(*, qkv, cu_seqlens, max_seqlen, **kw):
    return flash_attn_varlen_reference(**_unpacked_qkv(qkv, cu_seqlens, max_seqlen), **kw)


def flash_attn_varlen_kvpacked_triton(*, q, kv, **kw):
    """flash_attn_varlen_kvpacked_func's Triton lane: views of kv (total_k, 2, Hkv, D)."""
    return flash_attn_varlen_triton(q=q, k=kv[:, 0], v=kv[:, 1], block_table=None, **kw)


def flash_attn_varlen_kvpacked_reference(*, q, kv, **kw):
    return flash_attn_varlen_reference(q=q, k=kv[:, 0], v=kv[:, 1], block_table=None, **kw)


def _packed_gradients(forward, dout, names, kw):
    leaves = {n: kw.pop(n).detach().requires_grad_() for n in names}
    with torch.enable_grad():
        out, _ = forward(**leaves, **kw)
        return torch.autograd.grad(out, list(leaves.values()), dout)


def flash_attn_varlen_qkvpacked_backward_triton(*, dout, **kw):
    """(dqkv,) through the Triton lane's autograd."""
    return _packed_gradients(flash_attn_varlen_qkvpacked_triton, dout, ("qkv",), kw)


def flash_attn_varlen_qkvpacked_backward_reference(*, dout, **kw):
    return _packed_gradients(flash_attn_varlen_qkvpacked_reference, dout, ("qkv",), kw)


def flash_attn_varlen_kvpacked_backward_triton(*, dout, **kw):
    """(dq, dkv) through the Triton lane's autograd."""
    return _packed_gradients(flash_attn_varlen_kvpacked_triton, dout, ("q", "kv"), kw)


def flash_attn_varlen_kvpacked_backward_reference(*, dout, **kw):
    return _packed_gradients(flash_attn_varlen_kvpacked_reference, dout, ("q", "kv"), kw)

# ---- attention over a KV cache (flash_attn_with_kvcache) ----

def _kernel_table(q, block_table, cache_batch_idx):
    """The page table the attention kernel reads: the given one; for a contiguous cache one page
    (its whole row) per sequence, row cache_batch_idx[b]; None for row b (nothing to build)."""
    if block_table is not None or cache_batch_idx is None:
        return block_table
    return cache_batch_idx.reshape(q.shape[0], 1)


def _cache_table(q, block_table, cache_batch_idx):
    """The page table the append writes through: :func:`_kernel_table`'s, with row b spelled out."""
    table = _kernel_table(q, block_table, cache_batch_idx)
    return table if table is not None else torch.arange(q.shape[0], device=q.device, dtype=torch.int32)[:, None]


def _append_slots(table, cache_seqlens, S_new, page_size, num_slots):
    """The positions (B, S_new) int64 of the appended tokens, cache_seqlens[b] + t, and their
    slots in the cache (B * S_new,), page * page_size + offset, through the page table. Computed
    on the device with no value read back: a position outside the table's row (a cache_seqlens
    out of range) or a negative page gets slot ``num_slots``, which the write kernel skips and
    records (kv_cache.kernels.BAD_SLOT), as it does a page past the pool."""
    positions = cache_seqlens.to(torch.int64)[:, None] + torch.arange(S_new, device=cache_seqlens.device)
    index = positions // page_size
    width = table.shape[1]
    pages = table.to(torch.int64).gather(1, index.clamp(0, width - 1))
    slots = pages * page_size + positions % page_size
    slots = torch.where((positions >= 0) & (index < width) & (pages >= 0), slots, num_slots)
    return positions, slots.reshape(-1)


def flash_attn_with_kvcache_inplace(*, q, k_cache, v_cache, cache_seqlens, k, v, rotary_cos,
                                    rotary_sin, rotary_interleaved, cache_batch_idx, cache_leftpad,
                                    block_table, k_cache_scale, v_cache_scale, softmax_scale,
                                    window_size, softcap, alibi_slopes, num_splits, kv_dtype=None,
                                    rotary_dtype=None, max_seqlen_k=None, sinks=None, q_descale=None,
                                    k_descale=None, v_descale=None, out_dtype=None):
    """The Triton lane: rotates q and k (the RoPE kernel) and runs the cache attention kernel,
    which appends k, v into an unquantized cache in place itself (into a cache of codes, kv_cache's
    write kernel appends them first). ``max_seqlen_k``: the most
    keys a sequence holds after the append, which picks the tile (None: unknown, the long-cache
    tile). Returns (out, lse)."""
    from lanekit.attention.kernels import flash_attn_kvcache
    from lanekit.kv_cache.kernels import append_kv
    from lanekit.layers.op import apply_rotary_triton

    rotary_dim = 2 * rotary_cos.shape[1] if rotary_cos is not None else 0
    table = _kernel_table(q, block_table, cache_batch_idx)
    S_new = 0
    k_new = v_new = None
    with torch.no_grad():
        # Few launches and no index tensor built: the append computes its slots from the table
        # and the lengths in the kernel, the rotations take the lengths as per-sequence offsets,
        # and the attention kernel adds S_new to the lengths itself. Into an unquantized cache the
        # attention kernel appends the new tokens itself (one launch); codes are appended first,
        # keys and values in one launch of kv_cache's kernel (quantized on the way).
        if k is not None:
            S_new = k.shape[1]
            if rotary_cos is not None:   # new token t of sequence b at position cache_seqlens[b] + t
                k = apply_rotary_triton(x=k, cos=rotary_cos, sin=rotary_sin, interleaved=rotary_interleaved,
                                        rotary_dim=rotary_dim, seqlen_offsets=cache_seqlens)
            if k_cache_scale is None:
                k_new, v_new = k, v
            else:
                append_kv(x=k, cache=k_cache, table=table, seqlens=cache_seqlens, scale_out=k_cache_scale,
                          second=(v, v_cache, v_cache_scale))
        if rotary_cos is not None:
            Sq = q.shape[1]
            if window_size[0] >= 0 or window_size[1] >= 0:   # query i at cache_seqlens[b] + i
                q = apply_rotary_triton(x=q, cos=rotary_cos, sin=rotary_sin, interleaved=rotary_interleaved,
                                        rotary_dim=rotary_dim, seqlen_offsets=cache_seqlens)
            else:                                             # every query at cache_seqlens[b]
                q = apply_rotary_triton(x=q, cos=rotary_cos, sin=rotary_sin, interleaved=rotary_interleaved,
                                        rotary_dim=rotary_dim,
                                        position_ids=cache_seqlens.to(torch.int64)[:, None].expand(-1, Sq))
        return flash_attn_kvcache(
            q=q, k_cache=k_cache, v_cache=v_cache, block_table=table, seqlens=cache_seqlens,
            leftpad=cache_leftpad, k_cache_scale=k_cache_scale, v_cache_scale=v_cache_scale,
            softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, num_splits=num_splits,
            max_seqlen_k=max_seqlen_k, s_new=S_new, sinks=sinks, q_descale=q_descale, k_descale=k_descale,
            v_descale=v_descale, out_dtype=_out_dtype(q, out_dtype), k_new=k_new, v_new=v_new)


def flash_attn_with_kvcache_reference_inplace(*, q, k_cache, v_cache, k_cache_scale, v_cache_scale,
                                              max_seqlen_k=None, **kw):
    """The reference lane of the public function: the oracle in float64 for (out, lse), and the
    append done in place on the caller's caches by the KV-cache ops' reference lane."""
    out, lse, _, _ = flash_attn_with_kvcache_reference(
        q=q, k_cache=k_cache, v_cache=v_cache, k_cache_scale=k_cache_scale, v_cache_scale=v_cache_scale, **kw)
    if kw.get("k") is not None:
        _write_back_reference(q, k_cache, v_cache, k_cache_scale, v_cache_scale, kw)
    return out, lse


def _write_back_reference(q, k_cache, v_cache, k_cache_scale, v_cache_scale, kw):
    """The reference lane's append, in place on the caller's caches (the oracle works on copies)."""
    from lanekit.kv_cache.op import write_cache_reference
    from lanekit.layers.op import apply_rotary_reference

    k, v, cache_seqlens = kw["k"], kw["v"], kw["cache_seqlens"]
    table = _cache_table(q, kw.get("block_table"), kw.get("cache_batch_idx"))
    page_size = k_cache.shape[1]
    positions, slots = _append_slots(table, cache_seqlens, k.shape[1], page_size, k_cache.shape[0] * page_size)
    if kw.get("rotary_cos") is not None:
        k = apply_rotary_reference(x=k, cos=kw["rotary_cos"], sin=kw["rotary_sin"],
                                   interleaved=kw["rotary_interleaved"],
                                   rotary_dim=2 * kw["rotary_cos"].shape[1], position_ids=positions)
    write_cache_reference(key=k.flatten(0, 1), value=v.flatten(0, 1), k_cache=k_cache, v_cache=v_cache,
                          slot_mapping=slots, k_cache_scale=k_cache_scale, v_cache_scale=v_cache_scale)


def _dequantized(cache, scale):
    from lanekit.reference.kv_cache import dequantize_kv

    if scale is None:   # an int8 cache of values (fp8/int8 attention): compared as floats
        return cache if cache.is_floating_point() else cache.float()
    return dequantize_kv(cache, scale)


def flash_attn_with_kvcache_triton(*, k_cache, v_cache, k_cache_scale=None, v_cache_scale=None, **kw):
    """For the registry: the Triton lane on copies of the caches. Returns (out, lse, k_cache,
    v_cache) with the caches after the append, dequantized to fp32 when they hold codes."""
    kc, vc = k_cache.clone(), v_cache.clone()
    ks = k_cache_scale.clone() if k_cache_scale is not None else None
    vs = v_cache_scale.clone() if v_cache_scale is not None else None
    out, lse = flash_attn_with_kvcache_inplace(k_cache=kc, v_cache=vc, k_cache_scale=ks, v_cache_scale=vs, **kw)
    return out, lse, _dequantized(kc, ks), _dequantized(vc, vs)


def flash_attn_with_kvcache_reference(*, q, k_cache, v_cache, k_cache_scale=None, v_cache_scale=None,
                                      kv_dtype=None, rotary_dtype=None, out_dtype=None, **kw):
    """For the registry: the oracle in float64 (codes stay codes), outputs as the Triton lane's
    (an fp8/int8 q: out in ``out_dtype``, bf16 by default; P rounded where the kernel rounds it)."""
    f64 = torch.float64
    quantized = k_cache_scale is not None
    cast = {n: (t.to(f64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in kw.items()}
    if q.dtype in _QUANT_DTYPES:
        cast["p_dtype"] = p_dtype_of(v_cache)
    out, lse, kc, vc = ref.flash_attn_with_kvcache(
        q.to(f64), k_cache if quantized else k_cache.to(f64), v_cache if quantized else v_cache.to(f64),
        k_cache_scale=k_cache_scale, v_cache_scale=v_cache_scale, kv_dtype=kv_dtype or k_cache.dtype,
        rotary_dtype=rotary_dtype or q.dtype, **cast)
    return out.to(_out_dtype(q, out_dtype)), lse.to(torch.float32), kc, vc
