"""What the attention kernels share: the varlen and page-table addressing (``@triton.jit``
helpers, inlined into each kernel), and the launchers' host helpers (strides, head-dim blocks,
the tile lookup, the grid's limits).

Every kernel module here applies the interpreter's fixes at import (``fix_interpreter``, idempotent),
so that whichever is imported first, its kernels run correctly under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.attention import tuning
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.tuning import INTERPRETER, TileConfig, lookup
from lanekit.runtime.validate import ArgumentError

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

LOG2E = 1.4426950408889634
MAX_GRID_YZ = 65535  # CUDA's limit on grid dimensions 1 and 2 (heads, batch)


@triton.jit
def _varlen_bounds(CuSeqQ, CuSeqK, b):
    # Sequence b of a packed batch: its first query row and query count, its first key row
    # (unused with a block table, whose pages place the keys) and key count. Starts are int64.
    q_lo = tl.load(CuSeqQ + b)
    Sq = tl.load(CuSeqQ + b + 1) - q_lo
    k_lo = tl.load(CuSeqK + b)
    Sk = tl.load(CuSeqK + b + 1) - k_lo
    return q_lo.to(tl.int64), Sq, k_lo.to(tl.int64), Sk


@triton.jit
def _page_ids(bt_row, offs_n, n_in, page_size, page_shift=0, POW2_PAGE: tl.constexpr = False):
    # The pages bt_row[n // page_size] of keys offs_n (>= 0) of one sequence, as stored (int32);
    # keys past the sequence (not n_in) read none and get page 0, masked by the caller.
    # POW2_PAGE: page_size == 2^page_shift, so a shift instead of an integer division by a runtime
    # value (about 20 instructions per key on sm90).
    if POW2_PAGE:
        return tl.load(bt_row + (offs_n >> page_shift), mask=n_in, other=0)
    return tl.load(bt_row + offs_n // page_size, mask=n_in, other=0)


@triton.jit
def _page_offsets(page, offs_n, page_size, stride_page, stride_n, POW2_PAGE: tl.constexpr = False):
    # Offsets of keys offs_n in their pages ``page`` of a paged cache (num_blocks, page_size, H,
    # D): row n % page_size of the page; int64, as a page's offset may pass 2^31.
    if POW2_PAGE:
        row = (offs_n & (page_size - 1)).to(tl.int64)
    else:
        row = (offs_n % page_size).to(tl.int64)
    return page.to(tl.int64) * stride_page + row * stride_n


def _strides4(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    return tuple(t.stride()) if t is not None else (0, 0, 0, 0)


def _block(d: int) -> int:
    return tuning.head_dim_block(d)


def _strides_bthd(t: torch.Tensor, varlen: bool, paged: bool = False) -> tuple[int, int, int, int]:
    """Strides of a (B, S, H, D) operand: a packed (total, H, D) one has batch stride 0; a paged
    cache (num_blocks, page_size, H, D) passes its page stride in the batch slot."""
    if varlen and not paged:
        return (0, *t.stride())
    return tuple(t.stride())


def _tile(table: dict, device: torch.device, bucket: int) -> TileConfig:
    """The tile row for this device's architecture and head-dim bucket; the interpreter's own."""
    return INTERPRETER if triton_interpreted() else lookup(table, device, bucket)


def _check_grid(B: int, H: int, heads: str = "heads") -> None:
    """B and H fit grid dimensions 1 and 2: else an ArgumentError (a ValueError, and a
    RuntimeError as FlashAttention's launch checks are)."""
    if B > MAX_GRID_YZ or H > MAX_GRID_YZ:
        raise ArgumentError(f"q: the Triton lane runs at most {MAX_GRID_YZ} batches and {heads} "
                         f"(grid dimensions 1 and 2), got B={B}, {'Hq' if heads == 'heads' else 'Hkv'}={H}")
