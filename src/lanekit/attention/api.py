"""Public attention functions: FlashAttention's API (dense, packed, varlen), validated,
dispatched to a lane. flash_attn_with_kvcache is in api_kvcache.py, the shared checks in
api_checks.py."""

from __future__ import annotations

import torch

from lanekit.attention import op as _lanes
from lanekit.attention.api_checks import (_DTYPES, _QUANT_DTYPES, _alibi, _broadcast_4d, _check_heads,
                                          _cu_seqlens, _cu_seqlens_values, _dropout_seed, _options, _quant,
                                          _read_indices, _sinks)
from lanekit.kv_cache import checks
from lanekit.runtime.signature import remember, signature
from lanekit.runtime.validate import argument_errors, flag, int_at_least, lane_for, tensor

# flash_attn_func's checked options by signature: (softmax_scale, left, right, return_attn_probs)
_CHECKED: dict = {}


@argument_errors
def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    attn_bias: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    lane: str | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """Scaled dot-product attention, FlashAttention-2's ``flash_attn_func`` with the same arguments.

    Computes ``softmax(q k^T * softmax_scale [softcapped] + alibi + attn_bias, masked) v`` per head.
    Multi-query and grouped-query attention (MQA/GQA) are supported by passing k and v with fewer
    heads than q: query head h reads key/value head ``h // (Hq // Hkv)``.

    Arguments:
        q: (B, Sq, Hq, D), fp16, bf16 or fp32 (also fp64 on the reference lane, to check a model
            in float64). Any strides.
        k: (B, Sk, Hkv, D), same dtype and device as q; Hq must be a multiple of Hkv.
        v: (B, Sk, Hkv, Dv), same dtype and device; Dv may differ from D. 1 <= D, Dv <= 256.
        dropout_p: probability of dropping an attention probability, in [0, 1). The kept ones are
            scaled by 1 / (1 - dropout_p). Set 0.0 for evaluation.
        softmax_scale: multiplies q k^T before the softmax. Default ``D ** -0.5``.
        causal: mask out keys after the query, aligned bottom-right: query i sits at key position
            i + Sk - Sq. Same as ``window_size=(left, 0)``.
        window_size: (left, right). Query i (at key position p = i + Sk - Sq) sees keys j with
            p - left <= j <= p + right; -1 leaves that side unbounded.
        softcap: if > 0, scores become ``softcap * tanh(score / softcap)`` (Gemma 2, Grok).
        alibi_slopes: (Hq,) or (B, Hq) fp32: adds ``-slope * |i + Sk - Sq - j|`` to the scores.
        deterministic: accepted for FlashAttention compatibility. lanekit's backward is always
            deterministic (no atomic adds: backward runs on the same inputs give bit-identical
            gradients); on the H200 the atomic variant FlashAttention uses by default measured
            slower in Triton.
        return_attn_probs: also return the LSE (see Returns).
        attn_bias: (lanekit) additive float bias broadcastable to (B, Hq, Sq, Sk), added after
            scaling and softcap: ``softmax(q k^T * scale + attn_bias)``. Not in FlashAttention.
        attn_mask: (lanekit) bool, broadcastable to (B, Hq, Sq, Sk); True keeps a key.
        dropout_seed, dropout_offset: (lanekit) the Philox seed and counter offset of the dropout
            mask, as Python ints. The same pair gives the same mask. Default seed: drawn from
            PyTorch's default CPU generator, so ``torch.manual_seed`` makes runs repeatable.
        lane: (lanekit) "triton" or "reference"; default: triton for CUDA/ROCm tensors, reference
            otherwise, overridden by the LANEKIT_LANE environment variable.
        sinks: (Hq,) fp32, attention sinks (gpt-oss): a learned logit per query head that joins
            every row's softmax denominator with no value,
            ``out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j))``; the LSE includes it, and
            a row that sees no key gives 0 with LSE = sink. Differentiable (its gradient is
            ``-sum over rows of exp(sink - lse) * (rowsum(dO * O) - dLSE)``). Finite or -inf.
        q_descale, k_descale, v_descale: (B, Hkv) fp32, FlashAttention-3's descales for fp8
            (torch.float8_e4m3fn, torch.float8_e5m2) or int8 q, k, v (None: 1). The scores are
            ``(q k^T) * q_descale * k_descale * softmax_scale``, then softcap, ALiBi and attn_bias
            (never multiplied by the descales); v_descale multiplies the output. P.V runs in
            V's fp8 format (P rounded to it; e5m2 x e5m2 for e5m2 V); for int8, P in fp16 against
            V's codes. Forward only, no dropout. fp8 needs sm89+ on NVIDIA (int8 runs on sm80).
        out_dtype: the output's dtype for fp8/int8 inputs: torch.bfloat16 (default), float16 or
            float32; for other inputs None or q's dtype.

    Returns:
        out: (B, Sq, Hq, Dv) in q's dtype (fp8/int8: out_dtype). A query row that sees no key gives 0.
        With ``return_attn_probs``: ``(out, softmax_lse, None)``, softmax_lse (B, Hq, Sq) fp32, the
        natural-log sum of exp of the (scaled, softcapped, biased) visible scores; -inf for a row
        that sees no key. The third item (FlashAttention's dropout-masked probabilities, for
        testing only) is not materialized.

    Masked keys' values must be finite: a NaN or inf in a V row that a query cannot see (masked
    by causal, window_size or attn_mask) can still make that query's output NaN (0 * NaN in P @ V), as
    in FlashAttention and PyTorch's SDPA; which masked queries do is not specified (the Triton
    lane never reads key blocks a tile sees none of). A NaN in a masked K row is harmless.
    (docs/semantics.md, "Non-finite values".)

    Raises:
        TypeError: an argument is not a tensor, or has an unsupported dtype, or dtypes differ; a
            flag (causal, deterministic, return_attn_probs) not a bool, window_size not a pair of
            ints (a tuple, list, tensor or array of two; NumPy's ints and 0-d or 1-element
            tensors count, floats and bools do not) or a dropout seed/offset not an int.
        ValueError: wrong rank or shape, Hq not a multiple of Hkv, head dim outside 1..256,
            devices differ, window sizes below -1, dropout_p outside [0, 1), softcap < 0, a bias
            or mask not broadcastable to (B, Hq, Sq, Sk), or an unknown lane; sinks not (Hq,);
            descales not (B, Hkv) or given for 16-bit inputs, an out_dtype outside bf16/fp16/fp32,
            dropout or a tensor requiring grad with fp8/int8 inputs.
        Each is a RuntimeError too (``lanekit.runtime.validate.ArgumentError`` and
        ``ArgumentTypeError``), as FlashAttention's argument errors are.

    Gradients: differentiable in q, k, v and ``attn_bias`` (its gradient is summed over the
    dimensions it was broadcast along; FlashAttention has no bias). A gradient of the returned
    ``softmax_lse`` is honoured too. The Triton lane runs FlashAttention-2's backward (the
    probabilities recomputed from the LSE, the dropout mask regenerated from its seed and
    offset); the reference lane differentiates the float64 oracle. Works under
    ``torch.compile(fullgraph=True)``: both directions are custom ops with fake implementations.

    Semantics: FlashAttention 2.7 (Dao et al.), incl. bottom-right aligned causal/window masks,
    ALiBi and softcap; sinks as gpt-oss's attention (and vLLM's ``sinks=``); fp8 descales as
    FlashAttention-3's ``flash_attn_func``; docs/semantics.md lists where lanekit differs or goes
    beyond.
    """
    # The checks of a signature seen before are not run again (runtime.signature): only the plain
    # call is keyed (no bias, mask, ALiBi, sinks or descales), whose checks return scalars alone.
    key = None
    if (attn_bias is None and attn_mask is None and alibi_slopes is None and sinks is None and q_descale is None
            and k_descale is None and v_descale is None):
        key = signature((q, k, v), (dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                                    return_attn_probs, out_dtype))
    checked = _CHECKED.get(key) if key is not None else None
    extra = {}
    if checked is not None:
        softmax_scale, left, right, return_attn_probs = checked
        dropout_seed, dropout_offset = _dropout_seed(dropout_p, dropout_seed, dropout_offset)
    else:
        tensor("q", q, dtypes=_DTYPES + (torch.float64,) + _QUANT_DTYPES, ndim=4)
        tensor("k", k, ndim=4, like=q, like_name="q", like_dtype=True)
        tensor("v", v, ndim=4, like=q, like_name="q", like_dtype=True)
        B, Sq, Hq, D = q.shape
        if k.shape[0] != B or v.shape[0] != B:
            raise ValueError(f"k, v: expected batch size {B} (that of q), got {k.shape[0]} and {v.shape[0]}")
        Sk, Hkv = k.shape[1], k.shape[2]
        if v.shape[1] != Sk or v.shape[2] != Hkv:
            raise ValueError(f"v: expected (B, Sk, Hkv, Dv) with Sk={Sk}, Hkv={Hkv} (from k), got {tuple(v.shape)}")
        if k.shape[3] != D:
            raise ValueError(f"k: expected head dim {D} (that of q), got {k.shape[3]}")
        Dv = v.shape[3]
        _check_heads(q.shape, D, Dv, Hq, Hkv)
        softmax_scale, left, right = _options(D, Sq, Sk, dropout_p, softmax_scale, softcap, causal, window_size)
        flag("deterministic", deterministic)
        return_attn_probs = flag("return_attn_probs", return_attn_probs)
        shape4 = (B, Hq, Sq, Sk)
        alibi_slopes = _alibi(alibi_slopes, B, Hq, q)
        if attn_bias is not None:
            tensor("attn_bias", attn_bias, dtypes=_DTYPES + (torch.float64,), ndim=(0, 1, 2, 3, 4), like=q,
                   like_name="q")
            attn_bias = _broadcast_4d("attn_bias", attn_bias, shape4)
        if attn_mask is not None:
            tensor("attn_mask", attn_mask, dtypes=(torch.bool,), ndim=(0, 1, 2, 3, 4), like=q, like_name="q")
            attn_mask = _broadcast_4d("attn_mask", attn_mask, shape4)
        dropout_seed, dropout_offset = _dropout_seed(dropout_p, dropout_seed, dropout_offset)
        sinks = _sinks(sinks, Hq, q)
        descales, out_dtype = _quant(q, B, Hkv, q_descale, k_descale, v_descale, out_dtype, dropout_p,
                                     (("q", q), ("k", k), ("v", v), ("attn_bias", attn_bias), ("sinks", sinks),
                                      ("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)))
        extra = {}
        if sinks is not None or q.dtype in _QUANT_DTYPES:
            extra = dict(sinks=sinks, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                         out_dtype=out_dtype)
        if key is not None and not extra:
            remember(_CHECKED, key, (softmax_scale, left, right, return_attn_probs))
    chosen = lane_for(q, lane, "q")
    # The lane functions the registry names (ops.py), looked up by attribute rather than through
    # the registry's importlib, which torch.compile cannot trace.
    out, lse = getattr(_lanes, f"flash_attn_{chosen}")(
        q=q, k=k, v=v, softmax_scale=softmax_scale, window_size=(left, right),
        softcap=float(softcap), alibi_slopes=alibi_slopes, attn_bias=attn_bias, attn_mask=attn_mask,
        dropout_p=float(dropout_p), seed=dropout_seed, offset=dropout_offset, **extra,
    )
    if return_attn_probs:
        return out, lse, None
    return out


@argument_errors
def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    attn_bias: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    lane: str | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """:func:`flash_attn_func` on q, k and v packed in one tensor, FlashAttention-2's signature.

    Arguments:
        qkv: (B, S, 3, H, D), fp16, bf16 or fp32 (fp64 on the reference lane): q, k and v along
            dimension 2 (self-attention, as many key/value heads as query heads). The gradient is
            returned in the same layout.
        The rest (sinks, descales and out_dtype included): as :func:`flash_attn_func`.

    Returns: as :func:`flash_attn_func`, out (B, S, H, D).

    Raises:
        TypeError: qkv is not a tensor, or has an unsupported dtype.
        ValueError: qkv is not 5-D with size 3 in dimension 2; and as :func:`flash_attn_func`.
    """
    tensor("qkv", qkv, dtypes=_DTYPES + (torch.float64,) + _QUANT_DTYPES, ndim=5)
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv: expected shape (B, S, 3, H, D), got {tuple(qkv.shape)}")
    return flash_attn_func(
        qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, deterministic, return_attn_probs, attn_bias=attn_bias, attn_mask=attn_mask,
        dropout_seed=dropout_seed, dropout_offset=dropout_offset, lane=lane, sinks=sinks,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
    )


@argument_errors
def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    attn_bias: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    lane: str | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """:func:`flash_attn_func` with k and v packed in one tensor, FlashAttention-2's signature.

    Arguments:
        q: (B, Sq, Hq, D), fp16, bf16 or fp32.
        kv: (B, Sk, 2, Hkv, D), q's dtype: k and v along dimension 2; Hq a multiple of Hkv.
        The rest (sinks, descales and out_dtype included): as :func:`flash_attn_func`.

    Returns: as :func:`flash_attn_func`, out (B, Sq, Hq, D).

    Raises:
        TypeError: kv is not a tensor, or has an unsupported dtype or one other than q's.
        ValueError: kv is not 5-D with size 2 in dimension 2; and as :func:`flash_attn_func`.
    """
    tensor("kv", kv, dtypes=_DTYPES + (torch.float64,) + _QUANT_DTYPES, ndim=5)
    if isinstance(q, torch.Tensor) and kv.dtype != q.dtype:
        raise TypeError(f"kv: expected the dtype of q ({q.dtype}), got {kv.dtype}")
    if kv.shape[2] != 2:
        raise ValueError(f"kv: expected shape (B, Sk, 2, Hkv, D), got {tuple(kv.shape)}")
    return flash_attn_func(
        q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, deterministic, return_attn_probs, attn_bias=attn_bias, attn_mask=attn_mask,
        dropout_seed=dropout_seed, dropout_offset=dropout_offset, lane=lane, sinks=sinks,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
    )



@argument_errors
def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    lane: str | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """Attention over a packed batch of sequences of different lengths, FlashAttention-2's
    ``flash_attn_varlen_func`` with the same arguments.

    Sequence b holds query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and key rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v, and attends only within itself: each
    sequence is :func:`flash_attn_func` on its own, with causal, window and ALiBi positions aligned
    bottom-right by its own lengths (query i at key position i + Sk_b - Sq_b). A sequence of zero
    queries or zero keys is valid: it produces nothing, or zeros (LSE -inf), and gets zero gradients.

    Arguments:
        q: (total_q, Hq, D), fp16, bf16 or fp32 (fp64 on the reference lane). Any strides.
        k: (total_k, Hkv, D), and v: (total_k, Hkv, Dv), q's dtype and device, Hq a multiple of
            Hkv; or, with ``block_table``, a paged cache (num_blocks, page_size, Hkv, D), any
            page_size >= 1.
        cu_seqlens_q, cu_seqlens_k: (B + 1,) int32, the cumulative lengths: 0, then
            non-decreasing up to total_q (total_k; with a block table, the sequence's cached
            tokens, each at most max_pages * page_size).
        max_seqlen_q, max_seqlen_k: ints, at least every sequence's length. Bounds, not sizes:
            the grid covers no more than the tokens in q and k (a generous bound costs nothing);
            max_seqlen_k also spaces the dropout counters (below).
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic, dropout_seed,
        dropout_offset, lane: as :func:`flash_attn_func`. The dropout draw of (head h, packed
            query row r, key j) has Philox counter dropout_offset + (h * total_q + r) *
            max_seqlen_k + j.
        alibi_slopes: (Hq,) or (B, Hq) fp32.
        return_attn_probs: also return the LSE (see Returns).
        block_table: (B, max_pages) int32, the pages of sequence b's keys in order (FlashAttention
            2.6's paged varlen). Inference only: no gradient flows through a paged k or v.
        sinks, out_dtype: as :func:`flash_attn_func` (sinks (Hq,) fp32, differentiable).
        q_descale, k_descale, v_descale: (B, Hkv) fp32 for fp8/int8 q, k, v, row b for
            sequence b: as :func:`flash_attn_func` (forward only).

    Returns:
        out: (total_q, Hq, Dv) in q's dtype. With ``return_attn_probs``: ``(out, softmax_lse,
        None)``, softmax_lse (Hq, total_q) fp32 (FlashAttention's varlen layout), natural log;
        -inf for a row that sees no key.

    Masked keys' values must be finite: a NaN or inf in a V row that a query cannot see (masked
    by causal or window_size) can still make that query's output NaN (0 * NaN in P @ V), as
    in FlashAttention and PyTorch's SDPA; which masked queries do is not specified (the Triton
    lane never reads key blocks a tile sees none of). A NaN in a masked K row is harmless.
    Other sequences' keys are never read.
    (docs/semantics.md, "Non-finite values".)

    Raises:
        TypeError: a non-tensor, an unsupported dtype, cu_seqlens or block_table not int32; a
            max_seqlen not an int, a flag not a bool.
        ValueError: wrong ranks or shapes, cu_seqlens not from 0 to the total or decreasing, a
            sequence longer than its max_seqlen, a block_table too short for a sequence or naming
            a page that does not exist, and the errors of :func:`flash_attn_func`. The values of
            cu_seqlens and block_table are checked on the host only in the debug mode
            ``LANEKIT_CHECK_INDICES=1`` and on the reference lane (a device sync; never inside a
            CUDA graph capture).

    Index values (no device sync): on the Triton lane the values of cu_seqlens and block_table
    are not read back. The kernels keep every read and write in bounds: cu_seqlens are clamped
    on the device (non-decreasing within the totals; paged lengths within the table's pages), a
    page id outside [0, num_blocks) masks its keys, and each is recorded in a device-side error
    flag that :func:`lanekit.check_errors` reads and raises (a ``ValueError``, also a
    RuntimeError). Rows of a sequence whose own range was invalid are not written then
    (docs/semantics.md, "Index values"). Each error is a RuntimeError too, as in
    :func:`flash_attn_func`.

    Semantics: FlashAttention 2.7's ``flash_attn_varlen_func`` (Dao et al.); the LSE layout
    (Hq, total_q) is its own.
    """
    tensor("q", q, dtypes=_DTYPES + (torch.float64,) + _QUANT_DTYPES, ndim=3)
    tensor("k", k, ndim=4 if block_table is not None else 3, like=q, like_name="q", like_dtype=True)
    tensor("v", v, ndim=k.dim(), like=q, like_name="q", like_dtype=True)
    total_q, Hq, D = q.shape
    Hkv, Dv = k.shape[-2], v.shape[-1]
    if k.shape[-1] != D:
        raise ValueError(f"k: expected head dim {D} (that of q), got {k.shape[-1]}")
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise ValueError(f"v: expected {tuple(k.shape[:-1]) + ('Dv',)} (k's leading dimensions), got {tuple(v.shape)}")
    _check_heads(q.shape, D, Dv, Hq, Hkv)
    max_seqlen_q = int_at_least("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = int_at_least("max_seqlen_k", max_seqlen_k)
    B = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, q)
    _cu_seqlens("cu_seqlens_k", cu_seqlens_k, B, q)
    if block_table is not None:
        checks.table(block_table, q, "q", B, "one per sequence of cu_seqlens_q")
    chosen = lane_for(q, lane, "q")
    if _read_indices(chosen):  # both read back in one transfer: one device sync
        both = torch.cat((cu_seqlens_q, cu_seqlens_k)).tolist()
        _cu_seqlens_values("cu_seqlens_q", both[:B + 1], total_q, max_seqlen_q)
        _cu_seqlens_values("cu_seqlens_k", both[B + 1:], -1 if block_table is not None else k.shape[0],
                           max_seqlen_k)
        if block_table is not None:
            checks.pages(block_table, cu_seqlens_k.diff(), k.shape[0], k.shape[1])
    softmax_scale, left, right = _options(D, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                                          softcap, causal, window_size)
    flag("deterministic", deterministic)
    return_attn_probs = flag("return_attn_probs", return_attn_probs)
    alibi_slopes = _alibi(alibi_slopes, B, Hq, q)
    dropout_seed, dropout_offset = _dropout_seed(dropout_p, dropout_seed, dropout_offset)
    sinks = _sinks(sinks, Hq, q)
    descales, out_dtype = _quant(q, B, Hkv, q_descale, k_descale, v_descale, out_dtype, dropout_p,
                                 (("q", q), ("k", k), ("v", v), ("sinks", sinks), ("q_descale", q_descale),
                                  ("k_descale", k_descale), ("v_descale", v_descale)))
    extra = {}
    if sinks is not None or q.dtype in _QUANT_DTYPES:
        extra = dict(sinks=sinks, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                     out_dtype=out_dtype)

    out, lse = getattr(_lanes, f"flash_attn_varlen_{chosen}")(
        q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q.contiguous(), cu_seqlens_k=cu_seqlens_k.contiguous(),
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        block_table=block_table.contiguous() if block_table is not None else None,
        softmax_scale=softmax_scale, window_size=(left, right), softcap=float(softcap),
        alibi_slopes=alibi_slopes, dropout_p=float(dropout_p), seed=dropout_seed, offset=dropout_offset,
        **extra,
    )
    if return_attn_probs:
        return out, lse, None
    return out



@argument_errors
def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    lane: str | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """:func:`flash_attn_varlen_func` on q, k and v packed in one tensor, FlashAttention-2's
    ``flash_attn_varlen_qkvpacked_func`` with the same arguments (self-attention of each packed
    sequence on itself).

    Arguments:
        qkv: (total, 3, H, D), fp16, bf16 or fp32 (fp64 on the reference lane): q, k and v of
            every token along dimension 1, as many key/value heads as query heads. The
            gradient is returned in the same layout.
        cu_seqlens: (B + 1,) int32, the cumulative lengths, the same for queries and keys: 0, then
            non-decreasing up to total.
        max_seqlen: int, at least every sequence's length.
        The rest: as :func:`flash_attn_varlen_func` (alibi_slopes (H,) or (B, H); sinks,
            descales and out_dtype included).

    Returns: as :func:`flash_attn_varlen_func`, out (total, H, D); with ``return_attn_probs``,
    ``(out, softmax_lse, None)``, softmax_lse (H, total) fp32.

    Raises:
        TypeError: qkv is not a tensor or has an unsupported dtype; and as
            :func:`flash_attn_varlen_func`.
        ValueError: qkv is not (total, 3, H, D); and as :func:`flash_attn_varlen_func`.
        Each is a RuntimeError too (:class:`lanekit.runtime.validate.ArgumentError`).

    Semantics: FlashAttention 2.7's ``flash_attn_varlen_qkvpacked_func`` (Dao et al.).
    """
    tensor("qkv", qkv, dtypes=_DTYPES + (torch.float64,) + _QUANT_DTYPES, ndim=4)
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv: expected shape (total, 3, H, D), got {tuple(qkv.shape)}")
    try:
        return flash_attn_varlen_func(
            qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
            dropout_seed=dropout_seed, dropout_offset=dropout_offset, lane=lane, sinks=sinks,
            q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
        )
    except (ValueError, TypeError) as e:   # name this function's arguments, not the unpacked call's
        raise _renamed(e, {"cu_seqlens_q": "cu_seqlens", "cu_seqlens_k": "cu_seqlens",
                           "max_seqlen_q": "max_seqlen", "max_seqlen_k": "max_seqlen"}) from None


def _renamed(e: Exception, names: dict[str, str]) -> Exception:
    """``e`` with the argument its message starts with ("name: expected ...") renamed by ``names``,
    of the same class and traceback; ``e`` itself when it names none of them."""
    name, sep, rest = str(e.args[0]).partition(": ") if len(e.args) == 1 else ("", "", "")
    if not sep or name not in names:
        return e
    return type(e)(f"{names[name]}: {rest}").with_traceback(e.__traceback__)


@argument_errors
def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    lane: str | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """:func:`flash_attn_varlen_func` with k and v packed in one tensor, FlashAttention-2's
    ``flash_attn_varlen_kvpacked_func`` with the same arguments.

    Arguments:
        q: (total_q, Hq, D), fp16, bf16 or fp32 (fp64 on the reference lane).
        kv: (total_k, 2, Hkv, D), q's dtype: k and v of every key token along dimension 1; Hq a
            multiple of Hkv (MQA/GQA). The gradient is returned in the same layout.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k and the rest (sinks, descales
            and out_dtype included): as :func:`flash_attn_varlen_func`.

    Returns: as :func:`flash_attn_varlen_func`, out (total_q, Hq, D); with
    ``return_attn_probs``, ``(out, softmax_lse, None)``, softmax_lse (Hq, total_q) fp32.

    Raises:
        TypeError: kv is not a tensor, or has an unsupported dtype or one other than q's; and as
            :func:`flash_attn_varlen_func`.
        ValueError: kv not (total_k, 2, Hkv, D); and as :func:`flash_attn_varlen_func`. Each is a
            RuntimeError too (:class:`lanekit.runtime.validate.ArgumentError`).

    Semantics: FlashAttention 2.7's ``flash_attn_varlen_kvpacked_func`` (Dao et al.).
    """
    tensor("kv", kv, dtypes=_DTYPES + (torch.float64,) + _QUANT_DTYPES, ndim=4)
    if isinstance(q, torch.Tensor) and kv.dtype != q.dtype:
        raise TypeError(f"kv: expected the dtype of q ({q.dtype}), got {kv.dtype}")
    if kv.shape[1] != 2:
        raise ValueError(f"kv: expected shape (total_k, 2, Hkv, D), got {tuple(kv.shape)}")
    return flash_attn_varlen_func(
        q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
        dropout_seed=dropout_seed, dropout_offset=dropout_offset, lane=lane, sinks=sinks,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
    )
