"""Public paged-KV-cache functions and the ``PagedKVCache`` object: validated, dispatched to a lane.

Layout (FlashAttention's paged KV cache, as ``flash_attn_with_kvcache`` reads it):

- ``k_cache``, ``v_cache``: (num_blocks, page_size, Hkv, D) (v may have its own Dv); fp16, bf16 or
  fp32 values, or int8 / fp8 e4m3 codes.
- a quantized cache's scales: ``k_cache_scale``, ``v_cache_scale`` (num_blocks, page_size, Hkv) fp32,
  one per (slot, head); the value of a code is codes * scale.
- ``block_table`` (B, max_pages) int32: the pages of sequence b, in order; ``cache_seqlens`` (B,)
  int32: its number of tokens. Token t of sequence b is in page ``block_table[b, t // page_size]``
  at offset ``t % page_size``.
- ``slot_mapping`` (N,) int32 or int64 (vLLM's): where new token n goes, slot = page * page_size +
  offset; a negative slot is padding and is skipped.

Any page_size from 1 up. The data moves in Triton kernels; the host only validates and keeps
``PagedKVCache``'s bookkeeping.
"""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Callable, Hashable, Iterable

import numpy as np
import torch

from lanekit.kv_cache import checks, op as _lanes
from lanekit.kv_cache.checks import CODE_DTYPES as _CODE_DTYPES, DTYPES as _DTYPES
from lanekit.runtime.errors import check_indices_eagerly
from lanekit.runtime.lanes import select_lane
from lanekit.runtime.validate import (check_inplace, check_outputs, device as _device, int_at_least, int_in,
                                      is_int, lane_for, shape as _shape, tensor as _tensor)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, *,
                      k_cache_scale: torch.Tensor | None = None,
                      v_cache_scale: torch.Tensor | None = None, lane: str | None = None) -> None:
    """Write new tokens' keys and values into a paged cache at their slots, in place.

    Token n goes to slot ``slot_mapping[n]`` = page * page_size + offset of both caches; a
    negative slot is padding and is skipped (nothing written). A cache of int8 or fp8 e4m3 codes
    gets each (token, head) row quantized: scale = amax / qmax over its D features (qmax 127 for
    int8, 448 for e4m3; 1 for an all-zero row), or ``k_scale``/``v_scale`` when given; codes =
    x / scale rounded to nearest, ties to even, clamped (int8 to [-128, 127], e4m3 to +-448), bit
    for bit as ``lanekit.reference.kv_cache.quantize_kv``; the scale is stored at the same slot of
    ``k_cache_scale``/``v_cache_scale``. A row holding a NaN or inf stays visible (docs/semantics.md,
    "NaN-visible quantization"): its scale is NaN and its codes e4m3's NaN (0x7F) or int8's 0, so it
    reads back as NaN; with a given scale, a NaN value's code is 0x7F (e4m3) or 0 (int8: no NaN
    there) and +-inf saturates.

    Arguments:
        key: (N, Hkv, D); value: (N, Hkv, Dv); fp16, bf16 or fp32, one dtype, the caches' dtype
            when they hold values. Any strides.
        k_cache, v_cache: (num_blocks, page_size, Hkv, D) and (..., Dv): fp16, bf16 or fp32
            values, or int8 or torch.float8_e4m3fn codes; any page_size >= 1, any strides.
            Written in place.
        slot_mapping: (N,) int32 or int64; each non-negative slot below num_blocks * page_size
            and used once. Not read back (no device sync) unless ``LANEKIT_CHECK_INDICES=1`` or
            on the reference lane: the kernel skips a slot at or past num_blocks * page_size and
            records it for :func:`lanekit.check_errors`; a slot used twice races, as in vLLM.
        k_scale, v_scale: fp32 scales to quantize with instead of amax / qmax, broadcastable to
            (N, Hkv) (one per tensor, per head or per (token, head)); > 0. Codes caches only.
        k_cache_scale, v_cache_scale: (num_blocks, page_size, Hkv) fp32, a codes cache's scales
            (required with codes, None otherwise). Written in place.
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Raises:
        TypeError: a non-tensor; an unsupported dtype; key of another dtype than a values cache.
        ValueError: shapes that do not match, a slot out of range or repeated, scales missing
            for codes or given for values, a scale <= 0 or not finite, tensors on different
            devices; a cache or cache scale whose elements share memory (an expanded view), that
            overlaps an input, or that starts where another of them does (one tensor passed for
            both), or that requires grad in grad mode (the write is not differentiable) or is an
            inference tensor outside inference mode. Nothing is written then.

    Source: vLLM's ``reshape_and_cache_flash`` (slot_mapping, padding slots) into FlashAttention's
    paged layout; per-(token, head) scales and the rounding are lanekit's (docs/semantics.md).
    """
    _write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_cache_scale, v_cache_scale, lane)


def _write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_cache_scale, v_cache_scale,
           lane, held: Callable[[], torch.Tensor] | None = None) -> None:
    """:func:`reshape_and_cache`'s checks, then the write. ``held``: called once the arguments'
    metadata passed, it checks the slots against what the caller knows (:meth:`PagedKVCache.write`'s
    record of its appends) and returns the non-negative ones on the host, in range and each once,
    which saves reading them back from the device; None: they are read back and checked here."""
    quantized = checks.caches(k_cache, v_cache, k_cache_scale, v_cache_scale)
    blocks, page_size, H, D = k_cache.shape
    Dv = v_cache.shape[3]
    _tensor("key", key, dtypes=_DTYPES if quantized else (k_cache.dtype,), ndim=3, like=k_cache)
    N = key.shape[0]
    _shape("key", key, (N, H, D), "(N, Hkv, D), Hkv and D as k_cache's")
    _tensor("value", value, dtypes=(key.dtype,), ndim=3, like=k_cache)
    _shape("value", value, (N, H, Dv), "(N, Hkv, Dv), N as key's, Hkv and Dv as v_cache's")
    checks.index_vector("slot_mapping", slot_mapping, N, "(N,), one slot per token of key", like=k_cache,
                        dtypes=checks.SLOT_DTYPES)
    chosen = lane_for(k_cache, lane, "k_cache")
    # The slots' values are read back only where they are known on the host already (held), in
    # the debug mode LANEKIT_CHECK_INDICES=1, or on the reference lane; otherwise the kernel skips
    # a slot past the cache and records it (kernels.BAD_SLOT, lanekit.check_errors()).
    eager = held is None and (chosen == "reference" or check_indices_eagerly())
    used = held() if held is not None else slot_mapping[slot_mapping >= 0] if eager else None
    if (used.numel() if used is not None else N):
        outputs = (("k_cache", k_cache), ("v_cache", v_cache), ("k_cache_scale", k_cache_scale),
                   ("v_cache_scale", v_cache_scale))
        check_outputs(outputs, key, value, slot_mapping, k_scale, v_scale)
        for name, t in outputs:
            if t is not None:
                check_inplace(name, t, "the write", differentiable=False)
        if eager:
            checks.slots("slot_mapping", used, page_size, blocks)
    scales = {}
    for name, given in (("k_scale", k_scale), ("v_scale", v_scale)):
        if given is None:
            scales[name] = None
        elif not quantized:
            raise ValueError(f"{name}: expected None for a cache of {k_cache.dtype} values (scales "
                             "quantize into int8 or float8_e4m3fn codes), got a tensor")
        else:
            scales[name] = checks.scale(name, given, (N, H), "(N, Hkv)", k_cache, positive=True)
    getattr(_lanes, f"write_cache_{chosen}")(
        key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
        k_scale=scales["k_scale"], v_scale=scales["v_scale"], k_cache_scale=k_cache_scale,
        v_cache_scale=v_cache_scale)


def gather_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 cache_seqlens: torch.Tensor, *, k_cache_scale: torch.Tensor | None = None,
                 v_cache_scale: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                 max_seqlen: int | None = None, lane: str | None = None):
    """Read each sequence's keys and values back from its pages, as dense tensors.

    Row b of the results holds sequence b's ``cache_seqlens[b]`` tokens in order, then zeros up
    to ``max_seqlen`` (dense and zero-padded, the layout ``flash_attn_func`` takes with
    per-row lengths; pack with the lengths if a varlen layout is wanted). Pages a sequence does not
    own, and the slots of its last page past its length, are never read. A codes cache is
    dequantized: codes * scale in fp32, rounded once to ``dtype``.

    Arguments:
        k_cache, v_cache: (num_blocks, page_size, Hkv, D) / (..., Dv) as in
            :func:`reshape_and_cache`.
        block_table: (B, max_pages) int32; the first ceil(cache_seqlens[b] / page_size) entries
            of row b are its pages, each in [0, num_blocks); later entries are not read.
        cache_seqlens: (B,) int32 >= 0, at most max_pages * page_size.
        k_cache_scale, v_cache_scale: (num_blocks, page_size, Hkv) fp32 with a codes cache.
        dtype: fp16, bf16 or fp32; default the cache's dtype (values) or fp32 (codes).
        max_seqlen: the results' length, at least max(cache_seqlens) (the default: read back, one
            device sync, with the lengths and pages checked on the host). Given, nothing is read
            back (unless ``LANEKIT_CHECK_INDICES=1`` or on the reference lane): the kernel reads
            no page outside [0, num_blocks) and no sequence whose length is outside
            [0, max_pages * page_size] (zeros there), leaves out tokens past max_seqlen, and
            records each for :func:`lanekit.check_errors`.
        lane: as in :func:`reshape_and_cache`.

    Returns:
        (k, v): (B, max_seqlen, Hkv, D) and (B, max_seqlen, Hkv, Dv) in ``dtype``.

    Raises:
        TypeError: a non-tensor, an unsupported dtype, block_table or cache_seqlens not int32,
            max_seqlen not an int (Python's, NumPy's or a 0-d integer tensor).
        ValueError: mismatched shapes; a length beyond the pages its row holds; a used page out of
            [0, num_blocks); max_seqlen too small; scales missing or superfluous; devices.

    Source: FlashAttention's paged-cache layout (``flash_attn_with_kvcache``'s block_table and
    cache_seqlens); vLLM's ``gather_cache`` reads the same pages (packed, with cu_seqlens).
    """
    checks.caches(k_cache, v_cache, k_cache_scale, v_cache_scale)
    checks.table(block_table, k_cache)
    checks.index_vector("cache_seqlens", cache_seqlens, block_table.shape[0], "(B,), one per row of block_table",
                        like=k_cache)
    if dtype is not None and dtype not in _DTYPES:
        raise TypeError(f"dtype: expected one of {[str(d) for d in _DTYPES]} or None, got {dtype!r}")
    chosen = lane_for(k_cache, lane, "k_cache")
    if max_seqlen is None or chosen == "reference" or check_indices_eagerly():
        held = cache_seqlens.cpu()   # the lengths, read back once (a device sync)
        checks.lengths(held)
        checks.pages(block_table, held, k_cache.shape[0], k_cache.shape[1], name="cache_seqlens")
        longest = int(held.max()) if held.numel() else 0
    else:   # no value read back: the kernel masks and records what is out of range
        longest = 0
    if max_seqlen is None:
        max_seqlen = longest
    else:
        max_seqlen = int_at_least("max_seqlen", max_seqlen, longest, " (the longest sequence)")
    return getattr(_lanes, f"gather_cache_{chosen}")(
        k_cache=k_cache, v_cache=v_cache, block_table=block_table, cache_seqlens=cache_seqlens.contiguous(),
        k_cache_scale=k_cache_scale, v_cache_scale=v_cache_scale, dtype=dtype, max_seqlen=max_seqlen)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                scale: torch.Tensor | None = None, *, lane: str | None = None):
    """Quantize x per row (over its last dim) to int8 or fp8 e4m3 / e5m2 codes, as the cache stores them.

    scale = amax / qmax per row (qmax 127 for int8, 448 for e4m3, 57344 for e5m2; 1 for an all-zero
    row), or the given ``scale``; codes = x / scale (one correctly rounded fp32 division) rounded
    to nearest, ties to even, clamped (int8 to [-128, 127]: with a given scale -128 is reachable;
    e4m3 to +-448, e5m2 to +-57344). Bit for bit as ``lanekit.reference.kv_cache.quantize_kv``.
    (e5m2 codes are for ``flash_mla_with_kvcache``'s caches; the paged K/V cache holds int8 or e4m3.)
    A row holding a NaN or inf gets a NaN scale and NaN codes (0x7F: e4m3's NaN, an e5m2 NaN) or 0
    codes (int8), as :func:`reshape_and_cache`.

    Arguments:
        x: (..., D), D >= 1; fp16, bf16 or fp32, any strides.
        dtype: torch.int8, torch.float8_e4m3fn or torch.float8_e5m2.
        scale: fp32 broadcastable to x.shape[:-1], every value > 0 and finite; or None.
        lane: as in :func:`reshape_and_cache`.

    Returns:
        (codes (..., D) in dtype, scale (...) fp32).

    Raises:
        TypeError: a non-tensor, x not fp16/bf16/fp32, dtype not int8, e4m3 or e5m2, scale not fp32.
        ValueError: x 0-d or with D = 0; scale of the wrong shape, <= 0 or not finite; devices.

    Source: per-token-head KV quantization as in vLLM's fp8/int8 KV caches; rounding as
    ``torch.round`` and PyTorch's float8 casts.
    """
    _tensor("x", x, dtypes=_DTYPES)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x: expected (..., D) with D >= 1, got shape {tuple(x.shape)}")
    if dtype not in checks.QUANTIZE_DTYPES:
        raise TypeError(f"dtype: expected torch.int8, torch.float8_e4m3fn or torch.float8_e5m2, got {dtype!r}")
    if scale is not None:
        checks.scale("scale", scale, x.shape[:-1], "x.shape[:-1], one per row", x, positive=True)
    chosen = lane_for(x, lane)
    return getattr(_lanes, f"quantize_kv_{chosen}")(x=x, dtype=dtype, scale=scale)


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, *,
                  lane: str | None = None) -> torch.Tensor:
    """codes * scale per row: the values a quantized cache (or :func:`quantize_kv`) holds.

    One fp32 multiplication (rounded once), then rounded to ``dtype``: bit for bit as
    ``lanekit.reference.kv_cache.dequantize_kv``.

    Arguments:
        codes: (..., D), int8, torch.float8_e4m3fn or torch.float8_e5m2, any strides.
        scale: fp32 broadcastable to codes.shape[:-1].
        dtype: fp16, bf16 or fp32 (default).
        lane: as in :func:`reshape_and_cache`.

    Returns:
        (..., D) in dtype.

    Raises:
        TypeError: a non-tensor, codes not int8/e4m3/e5m2, scale not fp32, dtype not a float format.
        ValueError: codes 0-d; scale of the wrong shape; devices.

    Source: the dequantization of vLLM's fp8/int8 KV caches, per (token, head).
    """
    _tensor("codes", codes, dtypes=checks.QUANTIZE_DTYPES)
    if codes.dim() == 0:
        raise ValueError("codes: expected (..., D), got a 0-d tensor")
    checks.scale("scale", scale, codes.shape[:-1], "codes.shape[:-1]", codes, positive=False)
    if dtype not in _DTYPES:
        raise TypeError(f"dtype: expected one of {[str(d) for d in _DTYPES]}, got {dtype!r}")
    chosen = lane_for(codes, lane, "codes")
    return getattr(_lanes, f"dequantize_kv_{chosen}")(codes=codes, scale=scale, dtype=dtype)


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor, *, lane: str | None = None):
    """Attention over two key sets A and B from its two partial results.

    ``lse = log(exp(lse_a) + exp(lse_b))`` and ``out = exp(lse_a - lse) * out_a +
    exp(lse_b - lse) * out_b``, in fp32, out rounded once to out_a's dtype: exactly what attention
    over the keys of A and B together gives (split-KV decoding; a cached prefix and new tokens).
    A partial whose LSE is -inf saw no key and contributes nothing, whatever its out holds (NaN
    included); +inf, the LSE FlashAttention 2 returns for a row with no key, counts as -inf. Both
    empty: out 0 and lse -inf, never NaN.

    Arguments:
        out_a, out_b: (B, Sq, H, D), one dtype: fp16, bf16 or fp32 (fp64 on the reference lane);
            any strides.
        lse_a, lse_b: (B, H, Sq) fp32, natural log (FlashAttention's softmax_lse).
        lane: as in :func:`reshape_and_cache`.

    Returns:
        (out (B, Sq, H, D) in out_a's dtype, lse (B, H, Sq) fp32).

    Raises:
        TypeError: a non-tensor, an unsupported dtype, lse not fp32, out_b of another dtype.
        ValueError: shapes that do not match, tensors on different devices.

    Source: FlashAttention's split-KV combine of partial results by their LSE; vLLM's
    ``merge_attn_states`` (its (H, T) LSE layout replaced by FlashAttention's (B, H, Sq)).
    """
    _tensor("out_a", out_a, dtypes=_DTYPES + (torch.float64,), ndim=4)
    _tensor("out_b", out_b, dtypes=(out_a.dtype,), ndim=4, like=out_a)
    _shape("out_b", out_b, out_a.shape, "out_a's shape")
    B, S, H, _ = out_a.shape
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        _tensor(name, lse, dtypes=(torch.float32,), ndim=3, like=out_a)
        _shape(name, lse, (B, H, S), "(B, H, Sq) from out_a's (B, Sq, H, D)")
    chosen = lane_for(out_a, lane, "out_a")
    return getattr(_lanes, f"merge_attn_states_{chosen}")(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)


class KVCacheFullError(RuntimeError):
    """The page pool of a :class:`PagedKVCache` cannot hold the tokens asked for."""


def _seq_id(name: str, s):
    """One sequence id as the cache keys it: an int (Python's, NumPy's or a 0-d integer tensor:
    all the same id as the int they equal), a str, bytes, or a tuple of these (such as (request,
    beam)). Anything else is a TypeError: a float (np.float64(2.0) would be the id 2, a float
    tensor an id of its own that nothing could name again), a bool, None, a list."""
    if isinstance(s, (str, bytes)):
        return s
    if is_int(s):
        return int(s)
    if isinstance(s, np.ndarray) and s.ndim == 0 and np.issubdtype(s.dtype, np.integer):
        return int(s)
    if isinstance(s, tuple):
        return tuple(_seq_id(name, x) for x in s)
    raise TypeError(f"{name}: expected ids that are ints, str, bytes or tuples of them, got "
                    f"{type(s).__name__} {s!r}")


class PagedKVCache:
    """A paged KV cache for one attention layer: the pages, a pool of free pages, and sequences.

    The tensors are FlashAttention's paged layout (see this module's docstring): ``k_cache`` and
    ``v_cache`` (num_blocks, page_size, Hkv, D), and for a codes cache ``k_scale`` and ``v_scale``
    (num_blocks, page_size, Hkv) fp32. Sequences, by id (an int, a str, bytes, or a tuple of
    those such as (request, beam); NumPy and 0-d tensor ints are the ints they equal; methods
    taking ``seq_ids`` take one id or a list of them), own pages taken
    from the pool as they grow (:meth:`append`) and give them back when they shrink or end (:meth:`trim`,
    :meth:`free`). The pool hands out its lowest-numbered free page first, which keeps the pages in
    use close together: decode reads pages spread over a whole large pool a little slower than
    pages near each other (on an H200, pages of 16 shuffled over 4 GiB about 1.5% slower than in
    order or handed out round robin; docs/performance.md, the decode note). The bookkeeping is host
    Python; writes and reads are the Triton kernels of :func:`reshape_and_cache` and
    :func:`gather_cache`.

    The cache remembers which append handed out each slot: :meth:`write` takes only the tensors
    append returned, and only while the sequences still hold their slots, so a slot_mapping kept
    past a :meth:`free` or :meth:`trim` (whose pages a later append may have given to another
    sequence) is refused rather than overwriting that sequence's tokens.

    Example::

        cache = PagedKVCache(num_blocks=64, page_size=16, num_kv_heads=8, head_dim=128,
                             dtype=torch.bfloat16, device="cuda")
        slots = cache.append([0, 1], [37, 5])       # prefill two sequences: 42 slots
        cache.write(k_new, v_new, slots)            # k_new, v_new: (42, 8, 128)
        k, v = cache.gather([0, 1])                 # (2, 37, 8, 128) each, zero-padded
        # a decode step: the lengths before it, room for the new token, then the kernel writes it
        lens = cache.cache_seqlens([0, 1])
        cache.append([0, 1], [1, 1])
        out = lanekit.flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, k1, v1,
                                              cache_seqlens=lens, block_table=cache.block_table([0, 1]),
                                              k_cache_scale=cache.k_scale, v_cache_scale=cache.v_scale)
        cache.trim(0, 7); cache.free(1)
    """

    def __init__(self, num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 kv_dtype: torch.dtype | None = None, *, lane: str | None = None):
        """Allocate the pages (zeroed; scales 1).

        Arguments:
            num_blocks, page_size, num_kv_heads, head_dim: ints >= 1.
            dtype: the model's dtype, fp16, bf16 or fp32: what :meth:`write` takes and
                :meth:`gather` returns.
            device: where the pages live (a str or torch.device).
            kv_dtype: None to store values in ``dtype``; torch.int8 or torch.float8_e4m3fn to
                store codes with per-(slot, head) fp32 scales.
            lane: passed to every operation (None: by device).

        Raises:
            ValueError: a size < 1, an unknown lane, a device this machine does not have ("cuda"
                with no GPU visible). TypeError: a size not an int, an unsupported dtype or
                kv_dtype, a device not a str or torch.device.
        """
        sizes = [int_at_least(name, v, 1) for name, v in (
            ("num_blocks", num_blocks), ("page_size", page_size), ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim))]
        num_blocks, page_size, num_kv_heads, head_dim = sizes
        if dtype not in _DTYPES:
            raise TypeError(f"dtype: expected one of {[str(d) for d in _DTYPES]}, got {dtype!r}")
        if kv_dtype is not None and kv_dtype not in _CODE_DTYPES:
            raise TypeError(f"kv_dtype: expected None, torch.int8 or torch.float8_e4m3fn, got {kv_dtype!r}")
        device = _device("device", device)
        select_lane(device, lane)  # an unknown lane fails here, not at the first write
        self.page_size, self.dtype, self.kv_dtype, self.lane = page_size, dtype, kv_dtype, lane
        shape = (num_blocks, page_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=kv_dtype or dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=kv_dtype or dtype, device=device)
        self.k_scale = self.v_scale = None
        if kv_dtype is not None:
            self.k_scale = torch.ones(shape[:3], dtype=torch.float32, device=device)
            self.v_scale = torch.ones(shape[:3], dtype=torch.float32, device=device)
        self._free = list(range(num_blocks))     # a min-heap: the lowest free page goes first
        self._pages: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}
        # Which append handed out each slot, while a sequence holds it (-1: nobody holds it), and
        # what each append returned: its tensor (weakly, by id), that tensor's version then, and
        # its slots on the host. write() checks a returned tensor against these on the host.
        self._holder = np.full(num_blocks * page_size, -1, dtype=np.int64)
        self._appends = 0
        self._handed: dict[int, tuple[weakref.ref, int, int, np.ndarray]] = {}

    def __getstate__(self):
        # what append handed out is known by tensor identity, which a copy made by pickling does
        # not keep: the copy forgets it (and refuses those tensors); the slots held stay recorded
        return {**self.__dict__, "_handed": {}}

    @classmethod
    def allocate(cls, num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 kv_dtype: torch.dtype | None = None, *, lane: str | None = None) -> PagedKVCache:
        """The same as ``PagedKVCache(...)``."""
        return cls(num_blocks, page_size, num_kv_heads, head_dim, dtype, device, kv_dtype, lane=lane)

    @property
    def num_blocks(self) -> int:
        return self.k_cache.shape[0]

    @property
    def device(self) -> torch.device:
        return self.k_cache.device

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def sequences(self) -> list:
        """The ids of the sequences held, in the order they were first appended."""
        return list(self._lengths)

    def seq_len(self, seq_id: Hashable) -> int:
        return self._lengths[self._known(seq_id)]

    def pages(self, seq_id: Hashable) -> list[int]:
        """The pages of ``seq_id``, in order (a copy)."""
        return list(self._pages[self._known(seq_id)])

    def _known(self, seq_id, name: str = "seq_id"):
        """The id as the cache keys it (:func:`_seq_id`), which must be a sequence held."""
        seq_id = _seq_id(name, seq_id)
        if seq_id not in self._lengths:
            raise ValueError(f"{name}: expected one of the sequences held {self.sequences}, got {seq_id!r}")
        return seq_id

    def _ids(self, seq_ids, *, known: bool) -> list:
        """A list of distinct ids: one id is a str, bytes, a tuple (such as (request, beam)) or any
        value that is not iterable (an int, a 0-d tensor or array); anything else iterable (a list,
        range, generator, tensor or array) holds several. Each as :func:`_seq_id` keys it."""
        if (isinstance(seq_ids, (str, bytes, tuple)) or not isinstance(seq_ids, Iterable)
                or (isinstance(seq_ids, (torch.Tensor, np.ndarray)) and seq_ids.ndim == 0)):
            ids = [seq_ids]
        else:
            ids = list(seq_ids)
        ids = [_seq_id("seq_ids", s) for s in ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids: expected distinct ids, got {ids}")
        if known:
            for s in ids:
                self._known(s, "seq_ids")
        return ids

    def _slots(self, seq_id, start: int, stop: int) -> np.ndarray:
        """The slots of positions [start, stop) of ``seq_id`` (its pages must cover them)."""
        pos = np.arange(start, stop, dtype=np.int64)
        pages = np.asarray(self._pages[seq_id], dtype=np.int64)
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size

    def append(self, seq_ids: Hashable | Iterable[Hashable], num_tokens: int | Iterable[int]) -> torch.Tensor:
        """Make room for ``num_tokens[i]`` new tokens at the end of sequence ``seq_ids[i]`` (a new id
        starts an empty sequence), taking pages from the pool as needed.

        Returns:
            slot_mapping (N,) int64 on the cache's device, N = sum(num_tokens): the slots of the
            new tokens, sequence by sequence, in order; pass it to :meth:`write` (or slices of
            it), unchanged: the cache knows this tensor and checks it without reading it back.

        Raises:
            KVCacheFullError: the pool has fewer free pages than the new tokens need; nothing is
                changed then. ValueError: ids repeated, counts negative or of another length.
                TypeError: an id not an int, str, bytes or a tuple of them; a count not an int.
        """
        ids = self._ids(seq_ids, known=False)
        if is_int(num_tokens):
            counts = [num_tokens]
        else:
            try:
                counts = list(num_tokens)
            except TypeError:
                raise TypeError(f"num_tokens: expected an int or an iterable of ints, got "
                                f"{type(num_tokens).__name__}") from None
        if len(counts) != len(ids):
            raise ValueError(f"num_tokens: expected one count per id ({len(ids)}), got {len(counts)}")
        counts = [int_at_least("num_tokens", n) for n in counts]
        ps = self.page_size
        need = [-(-(self._lengths.get(s, 0) + n) // ps) - len(self._pages.get(s, ()))
                for s, n in zip(ids, counts)]
        if sum(need) > len(self._free):
            raise KVCacheFullError(
                f"append: the new tokens need {sum(need)} more pages of {ps} slots, the pool has "
                f"{len(self._free)} free of {self.num_blocks} (free or trim a sequence first)")
        slots = [np.zeros(0, dtype=np.int64)]
        for s, n, k in zip(ids, counts, need):
            pages = self._pages.setdefault(s, [])
            start = self._lengths.setdefault(s, 0)
            pages += [heapq.heappop(self._free) for _ in range(k)]
            slots.append(self._slots(s, start, start + n))
            self._lengths[s] = start + n
        host = np.concatenate(slots)
        self._appends += 1
        self._holder[host] = self._appends
        out = torch.from_numpy(host.copy()).to(self.device)
        handed = self._handed
        key = id(out)
        ref = weakref.ref(out, lambda r: handed.pop(key, None) if handed.get(key, (None,))[0] is r else None)
        handed[key] = (ref, out._version, self._appends, host)
        return out

    def _holders(self, slots: np.ndarray) -> str:
        """Who holds each of ``slots`` now, for an error: 'sequence 1's position 3', 'no sequence'."""
        said = []
        for slot in slots[:3].tolist():
            page, offset = divmod(slot, self.page_size)
            owner = next(((s, i * self.page_size + offset) for s, pages in self._pages.items()
                          for i, p in enumerate(pages) if p == page), None)
            if owner is None or owner[1] >= self._lengths[owner[0]]:
                said.append(f"slot {slot}: no sequence")
            else:
                said.append(f"slot {slot}: sequence {owner[0]!r}'s position {owner[1]}")
        return "; ".join(said) + (" ..." if len(slots) > 3 else "")

    def _written_slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The slots :meth:`write` writes, on the host, read from the cache's own record of what
        :meth:`append` handed out (nothing is read back from the device): slot_mapping must be a
        tensor append returned, or a slice of one, unchanged since, and every one of its slots
        still held by the append that handed it out. The values of another tensor cannot say
        whose slots they are (after free(0) and append(1, 4), sequence 0's old slots are sequence
        1's new ones), so it is refused."""
        base = slot_mapping if slot_mapping._base is None else slot_mapping._base
        handed = self._handed.get(id(base))
        if (handed is None or handed[0]() is not base or handed[1] != base._version
                or slot_mapping.dtype != base.dtype):
            raise ValueError(
                "slot_mapping: expected the tensor this cache's append() returned (or a slice of it), "
                "unchanged, got a tensor it did not hand out (a copy, a concatenation, or one changed in "
                "place), whose slots it cannot tell the owner of; place tokens by hand with "
                "lanekit.kv_cache.reshape_and_cache on cache.k_cache and cache.v_cache")
        _, _, append, host = handed
        n, step = slot_mapping.shape[0], slot_mapping.stride(0)
        first = slot_mapping.storage_offset() - base.storage_offset()
        host = host[first: first + step * (n - 1) + 1: step] if n and step else np.repeat(host[first:first + 1], n)
        stale = host[self._holder[host] != append]
        if stale.size:
            raise ValueError(
                f"slot_mapping: expected slots that the sequences hold now, got the result of an append "
                f"whose slots were given back since by free() or trim(), now {self._holders(stale)}")
        written = torch.from_numpy(host)
        checks.slots("slot_mapping", written, self.page_size)   # a view may name a slot twice (stride 0)
        return written

    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
              k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        """:func:`reshape_and_cache` of key, value (N, Hkv, D) into this cache at ``slot_mapping``,
        a tensor :meth:`append` returned (or a slice of it, such as one chunk of a prefill); a
        codes cache quantizes them and stores their scales.

        The cache keeps, on the host, which append handed out each slot and which slots each
        sequence holds, so the write goes only where the tokens belong and nothing is read back
        from the device: a slot_mapping whose slots were given back since (:meth:`free`,
        :meth:`trim`) is refused, even where a later append handed the same slots to another
        sequence. To place tokens elsewhere, call :func:`reshape_and_cache` on ``k_cache`` and
        ``v_cache`` (and the scales).

        Raises:
            ValueError: a slot_mapping append did not return (a copy, a concatenation, a tensor
                changed in place), or holding slots given back since; and the errors of
                :func:`reshape_and_cache`. Nothing is written then.
        """
        _write(key, value, self.k_cache, self.v_cache, slot_mapping, k_scale, v_scale, self.k_scale,
               self.v_scale, self.lane, held=lambda: self._written_slots(slot_mapping))

    def block_table(self, seq_ids: Hashable | Iterable[Hashable], max_pages: int | None = None) -> torch.Tensor:
        """(B, max_pages) int32 on the cache's device: row b lists the pages of ``seq_ids[b]``,
        then zeros (not read: past the sequence's length). max_pages: default the most pages any
        of them holds."""
        ids = self._ids(seq_ids, known=True)
        widest = max((len(self._pages[s]) for s in ids), default=0)
        width = widest if max_pages is None else int_at_least(
            "max_pages", max_pages, widest, " (the most pages a sequence holds)")
        table = torch.zeros(len(ids), width, dtype=torch.int32)
        for b, s in enumerate(ids):
            table[b, : len(self._pages[s])] = torch.tensor(self._pages[s], dtype=torch.int32)
        return table.to(self.device)

    def cache_seqlens(self, seq_ids: Hashable | Iterable[Hashable]) -> torch.Tensor:
        """(B,) int32 on the cache's device: the lengths of ``seq_ids``."""
        ids = self._ids(seq_ids, known=True)
        return torch.tensor([self._lengths[s] for s in ids], dtype=torch.int32).to(self.device)

    def gather(self, seq_ids: Hashable | Iterable[Hashable], dtype: torch.dtype | None = None):
        """:func:`gather_cache` of ``seq_ids``: (k, v), each (B, longest, Hkv, D) in ``dtype``
        (default the cache's model dtype), zero-padded."""
        ids = self._ids(seq_ids, known=True)
        return gather_cache(self.k_cache, self.v_cache, self.block_table(ids), self.cache_seqlens(ids),
                            k_cache_scale=self.k_scale, v_cache_scale=self.v_scale,
                            dtype=dtype or self.dtype, max_seqlen=max((self._lengths[s] for s in ids), default=0),
                            lane=self.lane)

    def free(self, seq_id: Hashable) -> None:
        """Forget ``seq_id`` and give its pages back to the pool."""
        seq_id = self._known(seq_id)
        self._holder[self._slots(seq_id, 0, self._lengths[seq_id])] = -1
        for page in self._pages.pop(seq_id):
            heapq.heappush(self._free, page)
        del self._lengths[seq_id]

    def trim(self, seq_id: Hashable, n: int) -> None:
        """Drop the last ``n`` tokens of ``seq_id`` (0 <= n <= its length); pages left empty go
        back to the pool. The sequence stays, possibly empty.

        Raises:
            TypeError: n not an int. ValueError: n outside [0, the length]; an id not held."""
        seq_id = self._known(seq_id)
        length = self._lengths[seq_id]
        keep = length - int_in("n", n, 0, length, f" (the length of sequence {seq_id!r})")
        self._holder[self._slots(seq_id, keep, length)] = -1
        pages = self._pages[seq_id]
        kept = -(-keep // self.page_size)
        for page in pages[kept:]:
            heapq.heappush(self._free, page)
        del pages[kept:]
        self._lengths[seq_id] = keep
