"""flash_attn_with_kvcache (FlashAttention's decode and append API, contiguous and paged caches),
validated and dispatched to a lane, and the split-KV heuristic it and api_mla.py use."""

from __future__ import annotations

import torch

from lanekit.attention import op as _lanes
from lanekit.attention import tuning
from lanekit.attention.api_checks import (_DTYPES, _QUANT_DTYPES, _alibi, _check_heads, _options, _quant,
                                          _read_indices, _sinks)
from lanekit.kv_cache import checks
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.signature import remember, signature
from lanekit.runtime.tuning import compiling, processor_count
from lanekit.runtime.validate import (argument_errors, check_inplace, check_outputs, flag, int_in, is_int,
                                      lane_for, tensor)


MAX_SPLITS = 128

# flash_attn_with_kvcache's checked options by signature (S_new, softmax_scale, left, right,
# rotary_interleaved, num_splits, return_softmax_lse, the key bound)
_CHECKED: dict = {}


def num_splits_heuristic(batch_programs: int, max_seqlen_k: int | None, device: torch.device,
                         block_n: int = 64, programs_per_sm: int = 1) -> int:
    """How many programs split each row's keys: the resident slots (``programs_per_sm`` a SM) over
    ``batch_programs``, rounded to the nearest integer (so the programs come nearest one wave),
    while each keeps at least four key blocks of the longest
    sequence (``max_seqlen_k``, the used length, not the cache's capacity; None inside a CUDA
    graph capture, where it cannot be read: occupancy alone decides, and the programs past a
    sequence's end exit at once). On the H200 (``benchmarks.tune_decode``, B=32, 8 KV heads, D=128,
    4k keys): the 128-key tile (one program per SM) at 4298 GB/s unsplit against at most 4163 in
    two (the two per SM this heuristic aimed at before). On 2026-12-02 (tune_decode): the 64-key
    tile (two an SM) at 4k read 4328 GB/s unsplit and 3742 in two (264 resident: 256 programs fill
    one wave, 512 start a second); with pages of 16 at 32k keys the per-key row (32 keys, 2 warps,
    4 stages), which this heuristic splits in two, 4379 in two, 3601 in three, 3192 unsplit. Since
    2026-12-03 that row is the 64-key one (tuning.FLASH_ATTN_KVCACHE_PER_KEY_PAGES), left unsplit:
    4448 GB/s, and 3793 in two."""
    sms = processor_count(device) if device.type == "cuda" else 4
    programs = max(batch_programs, 1)
    splits = (2 * sms * max(programs_per_sm, 1) + programs) // (2 * programs)   # rounded to nearest
    if max_seqlen_k is not None:
        splits = min(splits, max(1, -(-max_seqlen_k // block_n) // 4))
    return max(1, min(splits, MAX_SPLITS))


def kvcache_num_splits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_table: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                       max_seqlen_k: int | None = None) -> int:
    """The split count ``flash_attn_with_kvcache(..., num_splits=0)`` picks for these tensors:
    :func:`num_splits_heuristic` with the decode tile this device takes for the cache's layout.

    Arguments: q (B, Sq, Hq, D); k_cache (B_cache, S_cache, Hkv, D) or paged (num_blocks,
    page_size, Hkv, D), any dtype the cache takes; v_cache (..., Dv); block_table (B, max_pages)
    int32 or None; cache_leftpad (B,) int32 or None; max_seqlen_k the longest used length in keys
    (None: unknown, as inside a CUDA graph capture: the long-cache tile, occupancy alone), as
    ``flash_attn_with_kvcache``'s max_seqlen_k. Only shapes, dtypes and the device are read,
    never values, so nothing syncs. Returns an int in 1..MAX_SPLITS. Raises nothing of its own:
    the arguments are those ``flash_attn_with_kvcache`` has already checked.

    Source: lanekit's heuristic (FlashDecoding's split-KV, sized by occupancy as FlashAttention's
    ``num_splits_heuristic`` is)."""
    B, Sq, Hq, D = q.shape
    page_size, Hkv, Dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    block_d, block_dv = tuning.head_dim_block(D), tuning.head_dim_block(Dv)
    cfg, _ = tuning.kvcache_tile(q.device, max(block_d, block_dv), fp32=q.dtype == torch.float32,
                                 page_size=page_size, one_page=block_table is None or block_table.shape[1] == 1,
                                 leftpad=cache_leftpad is not None,
                                 max_keys=max_seqlen_k,
                                 interpreted=triton_interpreted())
    resident = tuning.resident_programs(q.device, cfg, cfg.block_n * (block_d + block_dv) * k_cache.element_size())
    rows = Sq * (Hq // Hkv)   # (query, head) rows, in the launcher's blocks of them
    m_blocks = -(-rows // tuning.kvcache_block_m(cfg, rows))
    return num_splits_heuristic(B * Hkv * max(m_blocks, 1), max_seqlen_k, q.device, cfg.block_n, resident)


@argument_errors
def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    k_cache_scale: torch.Tensor | None = None,
    v_cache_scale: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    lane: str | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """Attention of new queries over a KV cache, appending new keys and values to it first:
    FlashAttention-2's ``flash_attn_with_kvcache`` with the same arguments (decode, chunked
    prefill).

    Sequence b's keys are its cache positions ``cache_leftpad[b]`` (default 0) up to
    ``cache_seqlens[b]``, plus the new ``k``, ``v`` (if given), which are first rotated (k only)
    and written into the caches in place at positions cache_seqlens[b], cache_seqlens[b] + 1, ...
    Masks and ALiBi are aligned bottom-right over those keys (query i at key position
    i + Sk_b - Sq, Sk_b = cache_seqlens[b] + S_new - leftpad[b]).

    Arguments:
        q: (B, Sq, Hq, D), fp16, bf16 or fp32 (fp64 on the reference lane).
        k_cache, v_cache: (B_cache, S_cache, Hkv, D) and (..., Dv) (B_cache may be 0 with a
            batch of 0: empty results), or paged (num_blocks >= 1,
            page_size, Hkv, D) with ``block_table``, any page_size >= 1; q's dtype, or int8 /
            torch.float8_e4m3fn codes with ``k_cache_scale``/``v_cache_scale``. Written in place
            when k, v are given.
        k, v: (B, S_new, Hkv, D) and (B, S_new, Hkv, Dv), q's dtype, or None (no append). Into a
            cache of codes they are quantized per (token, head) as :func:`lanekit.kv_cache.reshape_and_cache` does.
        rotary_cos, rotary_sin: (S_ro, rotary_dim / 2), rotary_dim even and <= D: RoPE applied to
            the new k at positions cache_seqlens[b] + t and to q at cache_seqlens[b] + i when causal
            or local (else all of q at cache_seqlens[b]), FlashAttention's rule. Pairing:
            ``rotary_interleaved`` (GPT-J's (2i, 2i + 1), the default as in FlashAttention) or
            NeoX's (i, i + rotary_dim / 2).
        cache_seqlens: (B,) int32, or an int for every sequence: tokens already cached (the end
            position, leftpad included). Required with new k, v or a block_table (as in
            FlashAttention); else the default is S_cache (a full contiguous cache).
        cache_batch_idx: (B,) int32: the cache row of sequence b (contiguous caches only);
            distinct rows when k, v are appended. Default b.
        cache_leftpad: (B,) int32: the position where sequence b's keys start (left padding).
        block_table: (B, max_pages) int32, sequence b's pages in order (paged caches).
        softmax_scale, causal, window_size, softcap, alibi_slopes: as :func:`flash_attn_func`.
        num_splits: split each row's keys across this many programs and merge the partial
            results by their LSE (split-KV); 0 picks by :func:`num_splits_heuristic` from the
            used lengths (``max_seqlen_k``), never the allocated capacity. At most 128.
        return_softmax_lse: also return the LSE.
        k_cache_scale, v_cache_scale: (lanekit) the (B_cache, S_cache, Hkv) or (num_blocks,
            page_size, Hkv) fp32 scales of a cache of codes (value = code * scale); updated in
            place with the appended tokens' scales.
        max_seqlen_k: (lanekit) an int at least every sequence's key count after the append (its
            cache_seqlens[b] + S_new), or None: the cache's capacity (S_cache, or the table's
            pages times page_size). Metadata the caller knows (lengths are never read back for
            it): it picks the decode tile (attention/tuning.py: smaller tiles for short caches on
            some GPUs) and bounds num_splits=0's split count; a bound below a length costs
            speed, never correctness (checked only with LANEKIT_CHECK_INDICES=1). Pass it in
            decode loops (a serving engine's length bucket inside a CUDA graph). The tile
            orders the sums differently: outputs for two bounds differ by rounding.
        lane: as :func:`flash_attn_func`.
        sinks: (Hq,) fp32, as :func:`flash_attn_func` (added once, after the split merge).
        q_descale, k_descale, v_descale, out_dtype: an fp8 (e4m3, e5m2) or int8 q over caches
            of q's dtype (values, no per-token scales) with FlashAttention-3's (B, Hkv) fp32
            descales, as :func:`flash_attn_func`: paged or not, split or not; no append (k, v)
            and no rotary there (write the cache with :mod:`lanekit.kv_cache` first). The
            per-token-scaled int8/e4m3 caches above take a 16-bit q.

    Returns:
        out (B, Sq, Hq, Dv) in q's dtype; with ``return_softmax_lse``, ``(out, softmax_lse)``,
        softmax_lse (B, Hq, Sq) fp32 natural log, -inf for a row that sees no key. The same for
        every num_splits up to rounding. Forward only, as FlashAttention's: the output carries no
        autograd graph (train through :func:`flash_attn_func` or :func:`flash_attn_varlen_func`).

    Masked keys' values must be finite: a NaN or inf in a V row that a query cannot see (masked
    by causal or window_size) can still make that query's output NaN (0 * NaN in P @ V), as
    in FlashAttention and PyTorch's SDPA; which masked queries do is not specified (the Triton
    lane never reads key blocks a tile sees none of). A NaN in a masked K row is harmless.
    Cache positions past cache_seqlens[b] (after the append) are never read.
    (docs/semantics.md, "Non-finite values".)

    Raises:
        TypeError: a non-tensor, an unsupported dtype, index tensors not int32, a num_splits,
            max_seqlen_k or cache_seqlens of another type (an int: Python's, NumPy's or a 0-d
            tensor), a flag (causal, rotary_interleaved, return_softmax_lse) not a bool.
        ValueError: wrong shapes; cache_seqlens, cache_leftpad or a new token past the cache's
            capacity (S_cache; for a paged cache, block_table's pages: named block_table) or
            negative; cache_seqlens None with k, v; leftpad past cache_seqlens; a page that does
            not exist; repeated cache_batch_idx rows with an append; with an append, a paged
            slot written twice or where a sequence's cached token lies (a page shared beyond
            its cached tokens), a cache (or scale) whose elements share memory (an expanded
            view) or that overlaps q, k or v, or that requires grad in grad mode (the append is
            not differentiable) or is an inference tensor outside inference mode, and two of the written tensors (caches, scales)
            starting at the same element (one tensor passed for both); rotary
            positions past S_ro; scales missing or superfluous; num_splits outside 0..128;
            max_seqlen_k negative (or, checked, below a sequence's key count); and the errors
            of :func:`flash_attn_func`. The errors about index values (lengths, left padding,
            rows, pages, slots, rotary positions, max_seqlen_k against the lengths) are raised
            here only in the debug mode ``LANEKIT_CHECK_INDICES=1`` and on the reference lane
            (one device sync; never inside a CUDA graph capture). Nothing is written when an
            argument is rejected. Each error is a RuntimeError too, as in :func:`flash_attn_func`
            (FlashAttention raises RuntimeError for a block_table too narrow for cache_seqlens).

    Index values (no device sync): on the Triton lane cache_seqlens, cache_leftpad,
    cache_batch_idx and block_table are not read back. The kernels keep every read and write in
    bounds: a sequence whose length, left padding or row is out of range reads no key (its rows
    come out 0, LSE -inf) and appends nothing, a page id outside [0, num_blocks) masks its keys,
    a rotary position past S_ro rotates by nothing (its rotated features come out 0), and each
    is recorded in a device-side error flag that :func:`lanekit.check_errors` reads and raises.
    Appends that collide (two sequences' new tokens in one slot, or over another sequence's
    cached token) are the caller's to avoid, as in vLLM and FlashAttention: only the debug mode
    finds them.

    Semantics: FlashAttention 2.7's ``flash_attn_with_kvcache`` (Dao et al.); beyond it: any
    page_size, paged caches with num_splits and with cache_leftpad, quantized caches.
    """
    # The checks of a signature seen before are not run again (runtime.signature), but for what
    # depends on more than metadata: the memory an append writes, the lane (the environment), and
    # index values where they are read back (then every check runs); the split count's tile
    # follows the interpreter and lanekit export's target, keyed too. Only the plain call is keyed
    # (cache_seqlens a tensor; no ALiBi, sinks, descales or out_dtype), whose checks return scalars.
    # A 0-d cache_seqlens is an int (is_int): its value is checked and widened to (B,) on every call.
    key = None
    if (type(cache_seqlens) is torch.Tensor and cache_seqlens.dim() == 1 and alibi_slopes is None
            and sinks is None and q_descale is None and k_descale is None and v_descale is None
            and out_dtype is None):
        key = signature((q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, k_cache_scale, v_cache_scale),
                        (softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits,
                         return_softmax_lse, max_seqlen_k, triton_interpreted(), compiling()))
    checked = _CHECKED.get(key) if key is not None else None
    chosen = lane_for(q, lane, "q") if checked is not None else None
    if checked is not None and not _read_indices(chosen):
        S_new, softmax_scale, left, right, rotary_interleaved, num_splits, return_softmax_lse, bound = checked
        if S_new:
            _check_append(q, k_cache, v_cache, k, v, k_cache_scale, v_cache_scale)
        extra = {}
    else:
        if isinstance(q, torch.Tensor) and q.dtype in _QUANT_DTYPES:
            S_new = _kvcache_quant_tensors(q, k_cache, v_cache, k, v, k_cache_scale, v_cache_scale, rotary_cos,
                                           rotary_sin, block_table is not None)
        else:
            S_new = _kvcache_tensors(q, k_cache, v_cache, k, v, k_cache_scale, v_cache_scale, block_table is not None)
        cache_seqlens, capacity = _kvcache_indices(q, k_cache, S_new, cache_seqlens, cache_batch_idx,
                                                   cache_leftpad, block_table)
        S_ro = _kvcache_rotary(q, rotary_cos, rotary_sin, rotary_interleaved)
        rotary_interleaved = bool(rotary_interleaved)
        num_splits = _split_count(num_splits)
        B, Sq, Hq, D = q.shape
        softmax_scale, left, right = _options(D, Sq, capacity, 0.0, softmax_scale, softcap, causal, window_size)
        return_softmax_lse = flag("return_softmax_lse", return_softmax_lse)
        alibi_slopes = _alibi(alibi_slopes, B, Hq, q)
        sinks = _sinks(sinks, Hq, q)
        descales, out_dtype = _quant(q, B, k_cache.shape[2], q_descale, k_descale, v_descale, out_dtype, 0.0)
        extra = {}
        if sinks is not None or q.dtype in _QUANT_DTYPES:
            extra = dict(sinks=sinks, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                         out_dtype=out_dtype)

        chosen = lane_for(q, lane, "q")
        max_used = None
        if _read_indices(chosen):
            max_used = _check_cache_values(cache_seqlens, cache_leftpad, cache_batch_idx, block_table, S_new,
                                           capacity, k_cache.shape[0], k_cache.shape[1], Sq, S_ro,
                                           left >= 0 or right >= 0)
        bound = _key_bound(max_seqlen_k, max_used, capacity)
        if num_splits == 0:
            num_splits = kvcache_num_splits(q, k_cache, v_cache, block_table, cache_leftpad, bound)
        if key is not None and not extra and max_used is None:
            remember(_CHECKED, key, (S_new, softmax_scale, left, right, rotary_interleaved, num_splits,
                                     return_softmax_lse, bound))

    # the kernels index these as packed vectors and rows: a strided view is read as its copy
    cache_seqlens = cache_seqlens.contiguous()
    cache_leftpad = cache_leftpad.contiguous() if cache_leftpad is not None else None
    block_table = block_table.contiguous() if block_table is not None else None
    impl = _lanes.flash_attn_with_kvcache_inplace if chosen == "triton" else _lanes.flash_attn_with_kvcache_reference_inplace
    out, lse = impl(
        q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k=k, v=v,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
        k_cache_scale=k_cache_scale, v_cache_scale=v_cache_scale, softmax_scale=softmax_scale,
        window_size=(left, right), softcap=float(softcap), alibi_slopes=alibi_slopes, num_splits=num_splits,
        max_seqlen_k=bound, **extra,
    )
    return (out, lse) if return_softmax_lse else out


# ---- flash_attn_with_kvcache's checks, in the order it runs them ----

def _kvcache_tensors(q, k_cache, v_cache, k, v, k_cache_scale, v_cache_scale, paged: bool) -> int:
    """q, the caches (the KV-cache ops' own checks: v_cache like k_cache, non-empty but for a
    contiguous cache's rows, the scales of a codes cache) and the new k, v; an append writes the
    caches (and their scales) in place, each element once, into no input, none that autograd
    would track. Returns S_new (0 without k, v)."""
    tensor("q", q, dtypes=_DTYPES + (torch.float64,), ndim=4)
    tensor("k_cache", k_cache, dtypes=(q.dtype,) + checks.CODE_DTYPES, ndim=4, like=q, like_name="q")
    B, Sq, Hq, D = q.shape
    checks.caches(k_cache, v_cache, k_cache_scale, v_cache_scale, float64=q.dtype == torch.float64, paged=paged)
    Hkv, Dv = k_cache.shape[2], v_cache.shape[3]
    if k_cache.shape[3] != D:
        raise ValueError(f"k_cache: expected head dim {D} (that of q), got {k_cache.shape[3]}")
    _check_heads(q.shape, D, Dv, Hq, Hkv, "k_cache")
    if (k is None) != (v is None):
        raise ValueError(f"k, v: expected both or neither, got k={'a tensor' if k is not None else None}, "
                         f"v={'a tensor' if v is not None else None}")
    if k is None:
        return 0
    tensor("k", k, dtypes=(q.dtype,), ndim=4)
    tensor("v", v, dtypes=(q.dtype,), ndim=4)
    S_new = k.shape[1]
    for name, t, d in (("k", k, D), ("v", v, Dv)):
        if tuple(t.shape) != (B, S_new, Hkv, d) or t.device != q.device:
            raise ValueError(f"{name}: expected shape ({B}, S_new, {Hkv}, {d}) on {q.device} (q's batch, "
                             f"the cache's heads and head dim), got {tuple(t.shape)} on {t.device}")
    if S_new:
        _check_append(q, k_cache, v_cache, k, v, k_cache_scale, v_cache_scale)
    return S_new


def _check_append(q, k_cache, v_cache, k, v, k_cache_scale, v_cache_scale) -> None:
    """The caches (and their scales) an append writes: each element written once, into no input
    (their memory, checked on every call: a signature does not key it), none that autograd
    tracks or PyTorch refuses to write (an inference tensor outside inference mode)."""
    written = (("k_cache", k_cache), ("v_cache", v_cache), ("k_cache_scale", k_cache_scale),
               ("v_cache_scale", v_cache_scale))
    check_outputs(written, q, k, v)
    for name, t in written:
        if t is not None:
            check_inplace(name, t, "the append of k, v", differentiable=False)


def _kvcache_quant_tensors(q, k_cache, v_cache, k, v, k_cache_scale, v_cache_scale, rotary_cos, rotary_sin,
                           paged: bool) -> int:
    """An fp8/int8 q (FlashAttention-3's fp8 decode): caches of q's dtype holding values (no
    per-token scales), no append, no rotary. Returns S_new (0)."""
    tensor("q", q, ndim=4)
    tensor("k_cache", k_cache, ndim=4, like=q, like_name="q", like_dtype=True)
    tensor("v_cache", v_cache, ndim=4, like=q, like_name="q", like_dtype=True)
    blocks, page_size, Hkv, D = k_cache.shape
    if tuple(v_cache.shape[:3]) != (blocks, page_size, Hkv):
        raise ValueError(f"v_cache: expected (num_blocks, page_size, Hkv, Dv) = ({blocks}, {page_size}, {Hkv}, Dv) "
                         f"as k_cache's, got {tuple(v_cache.shape)}")
    if (blocks == 0 and paged) or page_size * Hkv == 0:
        raise ValueError(f"k_cache: expected num_blocks, page_size and Hkv >= 1, got {tuple(k_cache.shape)}")
    for name, t in (("k_cache_scale", k_cache_scale), ("v_cache_scale", v_cache_scale), ("k", k), ("v", v),
                    ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if t is not None:
            raise ValueError(f"{name}: expected None with a {q.dtype} q (fp8/int8 attention reads caches of "
                             f"q's dtype through q/k/v_descale; append and rotate with lanekit.kv_cache "
                             f"first), got a tensor")
    if k_cache.shape[3] != q.shape[3]:
        raise ValueError(f"k_cache: expected head dim {q.shape[3]} (that of q), got {k_cache.shape[3]}")
    _check_heads(q.shape, q.shape[3], v_cache.shape[3], q.shape[2], Hkv, "k_cache")
    return 0


def _kvcache_indices(q, k_cache, S_new: int, cache_seqlens, cache_batch_idx, cache_leftpad,
                     block_table) -> tuple[torch.Tensor, int]:
    """The index arguments' types and shapes (their values: _check_cache_values): block_table or
    cache_batch_idx, cache_seqlens (an int is checked here and becomes a (B,) tensor), cache_leftpad.
    Returns (cache_seqlens, capacity): the tokens a sequence can hold, S_cache or, paged, the
    table's pages of S_cache."""
    B = q.shape[0]
    n_rows, S_cache = k_cache.shape[:2]
    paged = block_table is not None
    if paged:
        checks.table(block_table, q, "q", B, "one per sequence of q")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: expected None with a block_table (the table names "
                             "each sequence's pages), got a tensor")
        capacity = block_table.shape[1] * S_cache
    else:
        capacity = S_cache
        if cache_batch_idx is not None:
            checks.index_vector("cache_batch_idx", cache_batch_idx, B, "one per sequence of q", q, "q")
        elif n_rows != B:
            raise ValueError(f"k_cache: expected {B} rows (q's batch) without cache_batch_idx, got {n_rows}")
    if cache_seqlens is None:
        if paged or S_new:
            raise ValueError("cache_seqlens: expected a (B,) int32 tensor or an int "
                             f"{'with a block_table' if paged else 'with new k, v (where they go)'}, got None")
        cache_seqlens = S_cache
    if is_int(cache_seqlens):
        cache_seqlens = int(cache_seqlens)
        if paged:
            checks.table_width(cache_seqlens + S_new, S_cache, block_table.shape[1])
        if not 0 <= cache_seqlens <= capacity - S_new:
            raise ValueError(f"cache_seqlens: expected 0..{capacity - S_new} (capacity {capacity} less "
                             f"{S_new} new tokens), got {cache_seqlens}")
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, torch.Tensor):
        checks.index_vector("cache_seqlens", cache_seqlens, B, "one per sequence of q", q, "q")
    else:
        raise TypeError(f"cache_seqlens: expected a (B,) int32 tensor, an int or None, got "
                        f"{type(cache_seqlens).__name__}")
    if cache_leftpad is not None:
        checks.index_vector("cache_leftpad", cache_leftpad, B, "one per sequence of q", q, "q")
    return cache_seqlens, capacity


def _kvcache_rotary(q, rotary_cos, rotary_sin, rotary_interleaved) -> int | None:
    """rotary_cos and rotary_sin: both or neither, (S_ro, rotary_dim / 2) on q's device with
    rotary_dim in 2..D; rotary_interleaved a bool. Returns S_ro (None without rotary)."""
    D = q.shape[3]
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos, rotary_sin: expected both or neither")
    if rotary_cos is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            tensor(name, t, dtypes=_DTYPES + (torch.float64,), ndim=2)
            if t.device != q.device or tuple(t.shape) != tuple(rotary_cos.shape):
                raise ValueError(f"{name}: expected (S_ro, rotary_dim / 2) on {q.device} as rotary_cos, "
                                 f"got {tuple(t.shape)} on {t.device}")
        rotary_dim = 2 * rotary_cos.shape[1]
        if not 0 < rotary_dim <= D:
            raise ValueError(f"rotary_cos: expected rotary_dim = 2 * shape[1] in 2..{D} (the head dim), got {rotary_dim}")
    flag("rotary_interleaved", rotary_interleaved)
    return rotary_cos.shape[0] if rotary_cos is not None else None


def _split_count(num_splits) -> int:
    """num_splits: an int in 0..MAX_SPLITS (0: the heuristic picks)."""
    return int_in("num_splits", num_splits, 0, MAX_SPLITS, " (0: a heuristic)")


def _check_cache_values(cache_seqlens, cache_leftpad, cache_batch_idx, block_table, S_new, capacity,
                        n_rows, page_size, Sq, S_ro, bounded) -> int:
    """The index values (cache_seqlens, cache_leftpad and cache_batch_idx read back once; the
    table's pages and slots checked on its device): lengths within the capacity, left padding
    within the length, existing rows and pages, appended tokens in slots of their own, rotary
    positions within cos/sin. Returns the longest sequence's key count after the append (the used
    length)."""
    seqlens = cache_seqlens.cpu().to(torch.int64)
    ends = seqlens + S_new
    # (a paged cache's capacity is its table's width: checks.pages names block_table)
    checks.lengths(seqlens, S_new, capacity if block_table is None else None)
    starts = torch.zeros_like(seqlens)
    if cache_leftpad is not None:
        starts = cache_leftpad.cpu().to(torch.int64)
        if starts.numel() and (bool((starts < 0).any()) or bool((starts > seqlens).any())):
            raise ValueError(f"cache_leftpad: expected 0 <= cache_leftpad <= cache_seqlens, got "
                             f"{starts.tolist()[:16]} for cache_seqlens {seqlens.tolist()[:16]}")
    if cache_batch_idx is not None:
        rows = cache_batch_idx.cpu()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n_rows):
            raise ValueError(f"cache_batch_idx: expected rows in [0, {n_rows}), got {rows.tolist()[:16]}")
        if S_new and rows.unique().numel() != rows.numel():
            raise ValueError("cache_batch_idx: expected distinct rows when k, v are appended (two "
                             f"sequences would write one row), got {rows.tolist()[:16]}")
    if block_table is not None:
        checks.pages(block_table, ends, n_rows, page_size)
        if S_new and seqlens.numel():
            checks.appended_slots(block_table, seqlens, S_new, page_size)
    if S_ro is not None:
        top = int((seqlens + max(S_new, Sq if bounded else 1)).max()) if seqlens.numel() else 0
        if top > S_ro:
            raise ValueError(f"rotary_cos: expected rows for positions up to {top - 1} (cache_seqlens plus "
                             f"the new tokens), got {S_ro} rows")
    return int((ends - starts).max()) if ends.numel() else 0


def _key_bound(max_seqlen_k, max_used: int | None, capacity: int) -> int:
    """max_seqlen_k checked (an int, at least the used length when it was read); returns the bound
    that picks the decode tile and the split count: max_seqlen_k, else the cache's capacity
    (metadata: never a length read back, so the choice is the same with and without
    LANEKIT_CHECK_INDICES)."""
    if max_seqlen_k is None:
        return capacity
    if not is_int(max_seqlen_k):
        raise TypeError(f"max_seqlen_k: expected an int or None, got {type(max_seqlen_k).__name__}")
    max_seqlen_k = int(max_seqlen_k)
    if max_seqlen_k < 0 or (max_used is not None and max_seqlen_k < max_used):
        raise ValueError(f"max_seqlen_k: expected at least every sequence's key count after the append "
                         f"({max_used if max_used is not None else 0}), got {max_seqlen_k}")
    return max_seqlen_k
