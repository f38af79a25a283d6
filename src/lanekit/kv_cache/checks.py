"""The checks of a KV cache's structures, shared by the kv_cache ops and by attention's
``flash_attn_with_kvcache`` and paged ``flash_attn_varlen_func``: the caches and a codes cache's
scales, index vectors and the block table (metadata only), then the values that live on the
device: lengths against the table, the pages a sequence uses, the slots a write goes to.

Each raises a ValueError or TypeError naming the argument, before anything is written. The
metadata checks read no device value; the value checks say in their docstrings what they read
back (DESIGN.md's hot path: attention's callers skip them inside a CUDA graph capture).
"""

from __future__ import annotations

import torch

from lanekit.runtime.validate import shape as _shape, tensor as _tensor

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)
# quantize_kv and dequantize_kv also take fp8 e5m2 codes (flash_mla_with_kvcache reads e5m2 caches);
# the paged K/V cache's writes and attention keep to CODE_DTYPES
QUANTIZE_DTYPES = CODE_DTYPES + (torch.float8_e5m2,)
CACHE_DTYPES = DTYPES + CODE_DTYPES
SLOT_DTYPES = (torch.int32, torch.int64)


# ---- metadata: dtypes, shapes, devices ----

def caches(k_cache, v_cache, k_cache_scale, v_cache_scale, float64: bool = False, paged: bool = True) -> bool:
    """Check the caches (and a quantized cache's scales); returns whether they hold codes.
    ``float64``: float64 caches are accepted too (the reference lane's attention takes them).
    ``paged``: a paged cache needs a page at least; a contiguous (B_cache, S_cache, Hkv, D) one
    (``paged=False``) may have no rows, as a batch of 0 sequences has."""
    _tensor("k_cache", k_cache, dtypes=CACHE_DTYPES + ((torch.float64,) if float64 else ()), ndim=4)
    _tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), ndim=4, like=k_cache)
    blocks, page_size, H, D = k_cache.shape
    if tuple(v_cache.shape[:3]) != (blocks, page_size, H):
        raise ValueError(f"v_cache: expected (num_blocks, page_size, Hkv, Dv) = ({blocks}, {page_size}, "
                         f"{H}, Dv) as k_cache's, got {tuple(v_cache.shape)}")
    if (blocks == 0 and paged) or page_size * H == 0 or D == 0 or v_cache.shape[3] == 0:
        sizes = "num_blocks, page_size, Hkv and D >= 1" if paged else "S_cache, Hkv and D >= 1"
        raise ValueError(f"k_cache: expected {sizes}, got {tuple(k_cache.shape)} (v_cache {tuple(v_cache.shape)})")
    quantized = k_cache.dtype in CODE_DTYPES
    for name, scale in (("k_cache_scale", k_cache_scale), ("v_cache_scale", v_cache_scale)):
        if quantized:
            if scale is None:
                raise ValueError(f"{name}: a cache of {k_cache.dtype} codes needs its scales: expected "
                                 f"(num_blocks, page_size, Hkv) fp32, got None")
            _tensor(name, scale, dtypes=(torch.float32,), like=k_cache)
            _shape(name, scale, (blocks, page_size, H), "(num_blocks, page_size, Hkv), the cache's")
        elif scale is not None:
            raise ValueError(f"{name}: expected None for a cache of {k_cache.dtype} values (scales go "
                             f"with int8 or float8_e4m3fn codes), got a tensor")
    return quantized


def scale(name: str, t, shape: tuple, what: str, like: torch.Tensor, *, positive: bool) -> torch.Tensor:
    """A given scale: fp32, broadcastable to ``shape``; with ``positive``, every value > 0 and
    finite (read back: one device sync). Returns it expanded to ``shape`` (a view)."""
    _tensor(name, t, dtypes=(torch.float32,), like=like)
    try:
        expanded = t.expand(shape)
    except RuntimeError:
        raise ValueError(f"{name}: expected a shape broadcastable to {tuple(shape)} ({what}), got "
                         f"{tuple(t.shape)}") from None
    if positive and t.numel() and not bool(((t > 0) & torch.isfinite(t)).all()):
        raise ValueError(f"{name}: expected every scale > 0 and finite, got min {float(t.min())}, "
                         f"max {float(t.max())}")
    return expanded


def index_vector(name: str, t, n: int, what: str, like: torch.Tensor, like_name: str | None = None,
                 dtypes=(torch.int32,)) -> None:
    """An (n,) index vector (cache_seqlens, cache_leftpad, cache_batch_idx, slot_mapping) on like's
    device; ``what`` says where n comes from."""
    _tensor(name, t, dtypes=dtypes, ndim=1, like=like, like_name=like_name)
    _shape(name, t, (n,), what)


def table(block_table, like: torch.Tensor, like_name: str | None = None, B: int | None = None,
          what: str = "") -> None:
    """block_table: (B, max_pages) int32 on like's device (B None: any number of rows); ``what``
    says where B comes from."""
    _tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, like=like, like_name=like_name)
    if B is not None and block_table.shape[0] != B:
        raise ValueError(f"block_table: expected {B} rows ({what}), got shape {tuple(block_table.shape)}")


# ---- values ----

def lengths(seqlens: torch.Tensor, S_new: int = 0, capacity: int | None = None) -> None:
    """cache_seqlens's values, read back already (on the host): each >= 0, and with ``capacity``
    (a contiguous cache's S_cache) each plus the S_new appended tokens at most capacity. A paged
    cache's capacity is its table's width, which :func:`pages` checks."""
    if not seqlens.numel():
        return
    if int(seqlens.min()) < 0 or (capacity is not None and int(seqlens.max()) + S_new > capacity):
        bound = (f" and cache_seqlens + {S_new} new tokens <= the capacity {capacity}"
                 if capacity is not None else "")
        raise ValueError(f"cache_seqlens: expected 0 <= cache_seqlens{bound}, got {seqlens.tolist()[:16]}")


def table_width(tokens: int, page_size: int, max_pages: int, name: str = "block_table",
                sequence: int | None = None) -> None:
    """A block_table row of ``max_pages`` pages holds the longest sequence's ``tokens``; the error
    names ``name`` (block_table, or cache_seqlens where the lengths are what is checked)."""
    need = -(-tokens // page_size)
    if need > max_pages:
        which = f" (sequence {sequence})" if sequence is not None else ""
        raise ValueError(f"{name}: expected at most max_pages * page_size = {max_pages} * {page_size} = "
                         f"{max_pages * page_size} tokens a sequence (a row of block_table), got "
                         f"{tokens}{which}, needing {need} pages")


def pages(block_table: torch.Tensor, seqlens: torch.Tensor, num_blocks: int, page_size: int,
          name: str = "block_table") -> None:
    """Every page that sequence b's first seqlens[b] tokens use is listed in its row and exists
    (seqlens on any device; the longest is read back unless on the host, then the used pages:
    a device sync). A sequence longer than its row is named ``name`` (:func:`table_width`)."""
    max_pages = block_table.shape[1]
    if seqlens.numel():
        longest = int(seqlens.max())
        if longest > max_pages * page_size:   # (which sequence: read only for the error)
            table_width(longest, page_size, max_pages, name, sequence=int(seqlens.argmax()))
    needed = ((seqlens.to(torch.int64) + page_size - 1) // page_size).to(block_table.device)
    used = torch.arange(max_pages, device=block_table.device)[None, :] < needed[:, None]
    listed = block_table[used]
    if listed.numel() and (int(listed.min()) < 0 or int(listed.max()) >= num_blocks):
        raise ValueError(f"block_table: expected pages in [0, {num_blocks}) (the cache's num_blocks) "
                         f"where a sequence has tokens, got {int(listed.min())}..{int(listed.max())}")


def slots(name: str, written: torch.Tensor, page_size: int, num_blocks: int | None = None) -> None:
    """The slots (page * page_size + offset, a flat int tensor without padding) that one call
    writes: each below num_blocks * page_size (when given: the largest is read back) and each once
    (two tokens written to one slot would race; computed where ``written`` lives, no value read
    back unless one repeats)."""
    if num_blocks is not None:
        top = int(written.max())
        if top >= num_blocks * page_size:
            raise ValueError(f"{name}: expected slots below num_blocks * page_size = "
                             f"{num_blocks} * {page_size} = {num_blocks * page_size} (or negative for padding), "
                             f"got {top}")
    distinct, counts = written.unique(return_counts=True)
    if distinct.numel() != written.numel():
        twice = int(distinct[counts > 1][0])
        raise ValueError(f"{name}: expected every written token its own slot (two would race for one), "
                         f"got slot {twice} (page {twice // page_size}, offset {twice % page_size}) twice")


def appended_slots(block_table: torch.Tensor, seqlens: torch.Tensor, S_new: int, page_size: int) -> None:
    """The S_new tokens appended to each sequence (at seqlens[b] + t, pages checked to exist) land
    in slots no other appended token takes (:func:`slots`) and where no sequence holds a cached
    token (its positions below seqlens): pages shared by prefix (full pages, read only) pass.
    Computed on the table's device; one value read back."""
    seqlens = seqlens.to(block_table.device)
    pos = seqlens[:, None] + torch.arange(S_new, device=seqlens.device)              # (B, S_new)
    page = block_table.gather(1, pos // page_size).to(torch.int64).flatten()
    offset = (pos % page_size).flatten()
    slots("block_table", page * page_size + offset, page_size)
    # cached tokens in each listed page; a page written at an offset below that many is overwritten
    held = (seqlens[:, None] - page_size * torch.arange(block_table.shape[1], device=seqlens.device)).clamp(0, page_size)
    written, inverse = page.unique(return_inverse=True)
    lowest = torch.full_like(written, page_size).scatter_reduce(0, inverse, offset, "amin")  # per written page
    at = torch.searchsorted(written, block_table.to(torch.int64)).clamp(max=written.numel() - 1)
    clash = (written[at] == block_table) & (lowest[at] < held)
    if bool(clash.any()):
        b, i = (int(x) for x in clash.nonzero()[0])
        raise ValueError(f"block_table: expected appended tokens in slots no sequence holds a cached "
                         f"token in, got page {int(block_table[b, i])} (sequence {b}'s page {i}, "
                         f"{int(held[b, i])} cached tokens) written at offset {int(lowest[at[b, i]])}")
