"""Public MLA decode functions: FlashMLA's ``get_mla_metadata`` and ``flash_mla_with_kvcache``,
validated, dispatched to a lane. (A module of its own beside api.py, which holds FlashAttention's
functions and is past the ~800 lines at which a family splits a file.)"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lanekit.attention import op_mla as _lanes
from lanekit.attention import tuning
from lanekit.attention.api_checks import _softmax_scale
from lanekit.attention.api_kvcache import MAX_SPLITS, num_splits_heuristic
from lanekit.kv_cache import checks
from lanekit.runtime import errors
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.validate import (argument_errors, flag, int_at_least, int_in, lane_for, shape,
                                      tensor)

_DTYPES = (torch.float16, torch.bfloat16)
# The caches of codes MLA decode reads (values = codes * scale, one fp32 scale per (slot, head), as
# lanekit.kv_cache.quantize_kv makes them); fp8 e5m2 beside the paged K/V cache's int8 and e4m3.
MLA_CODE_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
MAX_HEAD_DIM_V = 512
MAX_ROPE_DIM = 128
# FlashMLA's arguments for sparse attention (DeepSeek V3.2), which lanekit does not implement.
_SPARSE_ARGS = ("indices", "attn_sink", "extra_k_cache", "extra_indices_in_kvcache", "topk_length",
                "extra_topk_length")


@dataclass
class FlashMLASchedMeta:
    """The schedule of a run of :func:`flash_mla_with_kvcache` calls, lanekit's counterpart of
    FlashMLA's tile scheduler metadata (same name, different contents): made by
    :func:`get_mla_metadata` before a decode loop, filled by the first call that takes it, reused
    by the later ones (every layer of a step, as FlashMLA's).

    Fields:
        max_seqlen_k: the most keys a sequence holds (read once from cache_seqlens by
            get_mla_metadata; None: the block table's capacity, max_pages * page_size, bounds it).
        num_splits: the split count the first call chose (None until then); later calls reuse it
            without computing anything.
        config: (B, Sq, H, Hkv, D, page_size, causal, cache dtype) of the first call; a later
            call with other shapes raises ValueError, as FlashMLA asserts.
    """

    max_seqlen_k: int | None = None
    num_splits: int | None = None
    config: tuple | None = None


@argument_errors
def get_mla_metadata(cache_seqlens: torch.Tensor | None = None, num_q_tokens_per_head_k: int | None = None,
                     num_heads_k: int | None = None, num_heads_q: int | None = None,
                     is_fp8_kvcache: bool = False, topk: int | None = None, *,
                     max_seqlen_k: int | None = None):
    """The schedule metadata of a decode step, FlashMLA's ``get_mla_metadata``: call it once before
    the loop over layers and pass its first result to every :func:`flash_mla_with_kvcache` call
    of that step as ``tile_scheduler_metadata``.

    lanekit's schedule is a split count (split-KV, merged by LSE) chosen at the first call from
    the shapes and the longest sequence. Passing ``cache_seqlens`` here reads its largest value
    back once (one device sync, before the loop, never inside flash_mla_with_kvcache); without it,
    ``max_seqlen_k`` gives that bound, else the block table's capacity does.

    Arguments:
        cache_seqlens: (B,) int32, each sequence's cached tokens, or None.
        num_q_tokens_per_head_k, num_heads_k, num_heads_q, is_fp8_kvcache: FlashMLA's; accepted
            for compatibility and not needed (the first call's shapes and cache dtype decide).
        topk: FlashMLA's sparse attention; must be None.
        max_seqlen_k: (lanekit) an int >= 0 bounding every sequence's length, instead of reading
            cache_seqlens (inside a CUDA graph capture, the bound the graph replays under).

    Returns:
        ``(FlashMLASchedMeta, None)``: FlashMLA's pair, whose second item (the old interface's
        num_splits tensor) is None, as in FlashMLA since 2025.

    Raises:
        TypeError: cache_seqlens not an int32 tensor; max_seqlen_k not an int.
        ValueError: cache_seqlens not 1-D, or with a negative value; topk given (sparse attention
            is not implemented); max_seqlen_k negative. Each is a RuntimeError too.

    Source: FlashMLA (DeepSeek), ``flash_mla_interface.get_mla_metadata``.
    """
    if topk is not None:
        raise ValueError(f"topk: expected None (lanekit's MLA decode is dense; FlashMLA's sparse attention "
                         f"is not implemented), got {topk!r}")
    flag("is_fp8_kvcache", is_fp8_kvcache)
    bound = None if max_seqlen_k is None else int_at_least("max_seqlen_k", max_seqlen_k)
    if cache_seqlens is not None:
        tensor("cache_seqlens", cache_seqlens, dtypes=(torch.int32,), ndim=1)
        if cache_seqlens.numel():
            longest, shortest = (int(x) for x in torch.stack((cache_seqlens.max(), cache_seqlens.min())).tolist())
            if shortest < 0:
                raise ValueError(f"cache_seqlens: expected values >= 0, got {shortest}")
            bound = longest if bound is None else max(bound, longest)
        elif bound is None:
            bound = 0
    return FlashMLASchedMeta(max_seqlen_k=bound), None


def mla_num_splits(q: torch.Tensor, k_cache: torch.Tensor, max_seqlen_k: int | None) -> int:
    """The split count ``flash_mla_with_kvcache(..., num_splits=0)`` picks: :func:`num_splits_heuristic`
    (one program a SM: the MLA tile fills most of an SM's shared memory) over B x Hkv x the row
    blocks of (query, head) pairs, with each split keeping at least four key blocks of
    ``max_seqlen_k`` (the longest sequence; None: occupancy alone). Reads shapes only. Returns an
    int in 1..128."""
    B, Sq, H, _ = q.shape
    Hkv = k_cache.shape[2]
    rows = Sq * (H // Hkv)
    cfg = tuning.mla_tile(q.device, rows, interpreted=triton_interpreted())
    m_blocks = -(-rows // tuning.mla_block_h(cfg, rows))
    return num_splits_heuristic(B * Hkv * max(m_blocks, 1), max_seqlen_k, q.device, cfg.block_n, 1)


@argument_errors
def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int = 512,
    tile_scheduler_metadata: FlashMLASchedMeta | None = None,
    num_splits: int | None = 0,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: None = None,
    attn_sink: None = None,
    extra_k_cache: None = None,
    extra_indices_in_kvcache: None = None,
    topk_length: None = None,
    extra_topk_length: None = None,
    *,
    k_cache_scale: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    lane: str | None = None,
):
    """Multi-head latent attention decode over a paged latent cache, FlashMLA's
    ``flash_mla_with_kvcache`` with the same arguments in the same order (DeepSeek V2/V3's MLA in
    its absorbed form).

    Every query head attends over the same cached rows: the key of token j is its whole cached row
    (D = 576 in DeepSeek V3: 512 latent + 64 rope features), its value the first ``head_dim_v``
    (512) features of that row. ``out = softmax(q K^T * softmax_scale) V`` per head, over sequence
    b's first ``cache_seqlens[b]`` cached tokens.

    Arguments:
        q: (B, Sq, H, D), fp16 or bf16 (absorbed queries: q_nope times W_UK, then q_pe). Any
            strides. Sq > 1 for speculative (multi-token) decode.
        k_cache: (num_blocks, page_size, Hkv, D), q's dtype, or int8 / fp8 e4m3 / fp8 e5m2 codes
            with ``k_cache_scale``. Hkv divides H (DeepSeek: 1; query head h reads cache head
            h // (H / Hkv)). Any page_size >= 1, any strides.
        block_table: (B, max_pages) int32: token t of sequence b is in page
            ``block_table[b, t // page_size]`` at offset ``t % page_size``; entries past a
            sequence's pages are not read.
        cache_seqlens: (B,) int32, each sequence's cached tokens, 0 .. max_pages * page_size.
        head_dim_v: Dv, the value's features (the first Dv of each row): 1..512, D - Dv <= 128.
        tile_scheduler_metadata: the first result of :func:`get_mla_metadata`, or None. The first
            call that takes it stores its split count there; later ones reuse it (their shapes
            must match).
        num_splits: split each sequence's keys across this many programs and merge the partial
            results by their LSE (split-KV); 0 or None picks by :func:`mla_num_splits` from the
            metadata's count, else from the longest sequence (metadata's or ``max_seqlen_k``), else
            from the block table's capacity. An int in 0..128.
        softmax_scale: multiplies q k^T before the softmax. Default ``D ** -0.5`` (FlashMLA's:
            the whole 576-wide head dim).
        causal: with Sq > 1, query i sees keys j <= i + Sk - Sq (aligned bottom-right, as
            FlashAttention; Sk = cache_seqlens[b]). No effect at Sq = 1.
        is_fp8_kvcache: FlashMLA's flag for an fp8 cache; lanekit reads the format from k_cache's
            dtype, so True only checks that k_cache holds fp8 codes. (FlashMLA's own fp8 layout,
            656 bytes a token with the scales inline, is not taken: quantize the cache with
            ``lanekit.kv_cache.quantize_kv`` into codes and ``k_cache_scale``.)
        indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
            extra_topk_length: FlashMLA's sparse attention (DeepSeek V3.2); must be None.
        k_cache_scale: (lanekit) (num_blocks, page_size, Hkv) fp32, a codes cache's scales (value
            = code * scale, one per (slot, head), as ``lanekit.kv_cache.quantize_kv`` returns for
            the cache's rows); None for a cache of values.
        max_seqlen_k: (lanekit) an int bounding every sequence's length, for num_splits=0 (not
            checked against the values, which are never read back).
        lane: "triton" or "reference"; default: triton for CUDA/ROCm tensors, reference otherwise,
            overridden by the LANEKIT_LANE environment variable.

    Returns:
        ``(out, softmax_lse)``: out (B, Sq, H, head_dim_v) in q's dtype; softmax_lse (B, H, Sq)
        fp32, natural log. A row that sees no key (cache_seqlens 0, or causal with Sq > Sk) gives
        out 0 and lse -inf (FlashMLA returns +inf there; lanekit keeps FlashAttention's -inf,
        which ``merge_attn_states`` and FlashMLA's own combine both treat as empty). Forward
        only: no autograd graph.

    Raises:
        TypeError: a non-tensor; q not fp16/bf16; k_cache of another dtype than q's or a code
            dtype; block_table or cache_seqlens not int32; k_cache_scale not fp32; head_dim_v,
            num_splits or max_seqlen_k not an int; causal or is_fp8_kvcache not a bool;
            tile_scheduler_metadata not a FlashMLASchedMeta (FlashMLA's old tensors included).
        ValueError: wrong ranks or shapes (q's D other than k_cache's, Hkv not dividing H, a
            block_table or cache_seqlens without B rows, scales not (num_blocks, page_size, Hkv));
            head_dim_v outside 1..512 or D - head_dim_v above 128; num_splits outside 0..128;
            scales missing for codes or given for values; is_fp8_kvcache with a cache that is not
            fp8; a sparse-attention argument given; metadata from a call of other shapes; tensors
            on different devices; an unknown lane. The index values (block_table, cache_seqlens)
            are not read back (no device sync): a length outside [0, max_pages * page_size] is
            clamped into it and a page id outside [0, num_blocks) masked (its keys count for
            nothing), both recorded for :func:`lanekit.check_errors`; with LANEKIT_CHECK_INDICES=1,
            and on the reference lane with CPU tensors, they are checked on the host first and
            raise ValueError here. Each is a RuntimeError too
            (:class:`lanekit.runtime.validate.ArgumentError` and ``ArgumentTypeError``), as
            FlashMLA's argument checks (TORCH_CHECK) raise RuntimeError.

    Semantics: FlashMLA (DeepSeek), ``flash_mla_interface.flash_mla_with_kvcache`` (dense
    decoding); beyond it: fp16, int8, fp8 e4m3 and e5m2 caches with lanekit's per-(slot, head)
    scales, any page_size, any H, Hkv > 1. docs/semantics.md lists the differences.
    """
    for name, given in zip(_SPARSE_ARGS, (indices, attn_sink, extra_k_cache, extra_indices_in_kvcache,
                                          topk_length, extra_topk_length)):
        if given is not None:
            raise ValueError(f"{name}: expected None (lanekit's MLA decode is dense; FlashMLA's sparse "
                             f"attention is not implemented), got {type(given).__name__}")
    tensor("q", q, dtypes=_DTYPES, ndim=4)
    tensor("k_cache", k_cache, dtypes=(q.dtype,) + MLA_CODE_DTYPES, ndim=4, like=q, like_name="q")
    B, Sq, H, D = q.shape
    num_blocks, page_size, Hkv, D_cache = k_cache.shape
    if D_cache != D:
        raise ValueError(f"k_cache: expected head dim {D} (that of q), got {D_cache}")
    if num_blocks == 0 or page_size == 0 or Hkv == 0:
        raise ValueError(f"k_cache: expected num_blocks, page_size and Hkv >= 1, got {tuple(k_cache.shape)}")
    if H == 0 or H % Hkv != 0:
        raise ValueError(f"k_cache: expected a number of heads that divides H={H} (q's heads, at least one), "
                         f"got Hkv={Hkv}")
    head_dim_v = int_in("head_dim_v", head_dim_v, 1, min(D, MAX_HEAD_DIM_V), " (at most q's D and 512)")
    if D - head_dim_v > MAX_ROPE_DIM:
        raise ValueError(f"head_dim_v: expected at least D - {MAX_ROPE_DIM} = {D - MAX_ROPE_DIM} (at most "
                         f"{MAX_ROPE_DIM} rope features past the value's), got {head_dim_v}")
    tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, like=q, like_name="q")
    if block_table.shape[0] != B:
        raise ValueError(f"block_table: expected {B} rows (one per sequence of q), got shape {tuple(block_table.shape)}")
    tensor("cache_seqlens", cache_seqlens, dtypes=(torch.int32,), ndim=1, like=q, like_name="q")
    shape("cache_seqlens", cache_seqlens, (B,), "one per sequence of q")
    quantized = k_cache.dtype in MLA_CODE_DTYPES
    if quantized:
        if k_cache_scale is None:
            raise ValueError(f"k_cache_scale: a cache of {k_cache.dtype} codes needs its scales: expected "
                             "(num_blocks, page_size, Hkv) fp32, got None")
        tensor("k_cache_scale", k_cache_scale, dtypes=(torch.float32,), ndim=3, like=q, like_name="q")
        shape("k_cache_scale", k_cache_scale, (num_blocks, page_size, Hkv), "(num_blocks, page_size, Hkv), the cache's")
    elif k_cache_scale is not None:
        raise ValueError(f"k_cache_scale: expected None for a cache of {k_cache.dtype} values (scales go with "
                         "int8 or fp8 codes), got a tensor")
    if flag("is_fp8_kvcache", is_fp8_kvcache) and k_cache.dtype not in _FP8:
        raise ValueError(f"is_fp8_kvcache: True needs a k_cache of fp8 codes (float8_e4m3fn or float8_e5m2, with "
                         f"k_cache_scale), got a {k_cache.dtype} cache")
    softmax_scale = _softmax_scale(D, softmax_scale)
    causal = flag("causal", causal)
    if num_splits is None:
        num_splits = 0
    elif isinstance(num_splits, torch.Tensor) and num_splits.dim() > 0:
        raise TypeError("num_splits: expected an int in 0..128 or None, got a tensor (FlashMLA's old num_splits "
                        "from get_mla_metadata: lanekit's get_mla_metadata returns None there)")
    num_splits = int_in("num_splits", num_splits, 0, MAX_SPLITS, " (0 or None: a heuristic)")
    meta = tile_scheduler_metadata
    if meta is not None and not isinstance(meta, FlashMLASchedMeta):
        raise TypeError(f"tile_scheduler_metadata: expected the FlashMLASchedMeta of lanekit's get_mla_metadata "
                        f"or None, got {type(meta).__name__}")
    if max_seqlen_k is not None:
        max_seqlen_k = int_at_least("max_seqlen_k", max_seqlen_k)
    chosen = lane_for(q, lane, "q")
    if errors.check_indices_eagerly() or (chosen == "reference" and not q.is_cuda):
        # (the reference lane indexes with the values on the host anyway: checking them costs nothing there)
        _check_index_values(block_table, cache_seqlens, num_blocks, page_size)

    if num_splits == 0:
        config = (B, Sq, H, Hkv, D, page_size, causal, k_cache.dtype)
        if meta is not None and meta.config is not None:
            if meta.config != config:
                raise ValueError(f"tile_scheduler_metadata: expected the shapes of the call that filled it "
                                 f"(B, Sq, H, Hkv, D, page_size, causal, cache dtype) = {meta.config}, got {config}; "
                                 "call get_mla_metadata again for other shapes")
            num_splits = meta.num_splits
        else:
            bound = max_seqlen_k
            if bound is None and meta is not None:
                bound = meta.max_seqlen_k
            if bound is None:
                bound = block_table.shape[1] * page_size
            num_splits = mla_num_splits(q, k_cache, bound)
            if meta is not None:
                meta.num_splits, meta.config = num_splits, config
    # the kernel indexes these as packed rows: a strided view is read as its copy
    return getattr(_lanes, f"flash_mla_with_kvcache_{chosen}")(
        q=q, k_cache=k_cache, block_table=block_table.contiguous(), cache_seqlens=cache_seqlens.contiguous(),
        head_dim_v=head_dim_v, softmax_scale=float(softmax_scale), causal=causal, k_cache_scale=k_cache_scale,
        num_splits=num_splits)


def _check_index_values(block_table, cache_seqlens, num_blocks: int, page_size: int) -> None:
    """LANEKIT_CHECK_INDICES=1: the lengths and the pages they use, read back and checked (a sync)."""
    seqlens = cache_seqlens.cpu()
    checks.lengths(seqlens)
    checks.pages(block_table, seqlens, num_blocks, page_size, name="cache_seqlens")
