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
from lanekit.runtime import errors
from lanekit.runtime.host import cdiv, next_power_of_2
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.tuning import INTERPRETER, TileConfig, lookup
from lanekit.runtime.validate import ArgumentError
from lanekit.runtime.launch import launch

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

LOG2E = 1.4426950408889634
MAX_GRID_YZ = 65535  # CUDA's limit on grid dimensions 1 and 2 (heads, batch)

# Index values that live on the device are not read back per call (DESIGN.md's hot path): the
# kernels mask what is out of range and record it here, for lanekit.check_errors().
BAD_SEQLENS = errors.register(
    "attention: a cache_seqlens, cache_leftpad or cache_batch_idx value out of range (a length below 0 "
    "or past the cache's capacity, left padding past the length, a row past the cache, or a page past "
    "the pool where a block_table row is one page): that "
    "sequence's keys were not read, its output rows are 0 and its LSE -inf")
BAD_PAGE = errors.register(
    "attention: a block_table page id outside [0, num_blocks) where a sequence has keys: those keys "
    "were masked (never read)")
BAD_CU_SEQLENS = errors.register(
    "flash_attn_varlen_func: cu_seqlens_q or cu_seqlens_k not non-decreasing from 0 within the total "
    "(or the paged capacity), or a sequence longer than its max_seqlen: the values were clamped into "
    "range (a sequence's rows outside its clamped range are not written)")


@triton.jit
def _valid_pages(pages, n_in, num_blocks):
    # Page ids as stored (int32) checked against the pool: one outside [0, num_blocks) becomes
    # page 0 and its keys are masked. Returns (pages, keys still in, keys whose page was bad).
    ok = (pages >= 0) & (pages < num_blocks)
    return tl.where(ok, pages, 0), n_in & ok, n_in & (ok == 0)


@triton.jit
def _record(ERR, ERR_BIT, bad):
    # OR ERR_BIT into the error flag when any element of ``bad`` is set (one masked atomic).
    tl.atomic_or(ERR, ERR_BIT, mask=tl.max(bad.to(tl.int32), 0) > 0)


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


# ---- fp8 / int8 attention and sinks (shared by the forward and the KV-cache kernels) ----

QUANT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
MIN_K_8BIT = 32   # Triton's 8-bit tl.dot on NVIDIA takes a reduction of at least 32


@triton.jit
def _pv_dot(p, v, INPUT_PRECISION: tl.constexpr, PV_FP16: tl.constexpr = False):
    # [BLOCK_M, BLOCK_N] probabilities times [BLOCK_N, BLOCK_DV] values, fp32. P is rounded to V's
    # format (fp8 x fp8 where V is fp8, e5m2 x e5m2 for e5m2); PV_FP16 (int8 V): P in fp16 against
    # V's codes, exact in fp16.
    if PV_FP16:  # (one return: the branch not taken is not compiled, an int8 P.V never built)
        pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return pv


@triton.jit
def _add_sinks(acc, l_i, m_i, sink):
    # A row's sink logit (natural units) joins its running sum with no value: the max, sum and
    # accumulator rescaled to max(m, sink) (log2 units). A sink of -inf adds nothing.
    sink_log2 = sink.to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, sink_log2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    return acc * alpha[:, None], l_i * alpha + tl.math.exp2(sink_log2 - m_safe), m_new


def quant_args(q: torch.Tensor, v: torch.Tensor, sinks, q_descale, k_descale, v_descale) -> dict:
    """The kernels' sinks and fp8/int8 arguments (appended to their signatures): nothing when
    neither is used, so the 16-bit kernel compiles as before. fp8 and int8 q, k, v take their
    (B, Hkv) descales: the scores are (q k^T) * q_descale * k_descale before the softmax scale,
    and v_descale multiplies the output. P.V: P rounded to V's fp8 format and multiplied in that
    format (e5m2 x e5m2 for e5m2); for int8 V, P in fp16 against V's codes (exact in fp16)."""
    if sinks is None and q.dtype not in QUANT_DTYPES:
        return {}
    quant = q.dtype in QUANT_DTYPES
    strides = {}
    for name, d in (("q", q_descale), ("k", k_descale), ("v", v_descale)):
        strides[f"stride_d{name}b"], strides[f"stride_d{name}h"] = d.stride() if quant else (0, 0)
    return dict(Sinks=sinks.contiguous() if sinks is not None else q,   # read at Sinks + h: a strided view's copy
                DescQ=q_descale if quant else q, DescK=k_descale if quant else q,
                DescV=v_descale if quant else q, **strides,
                HAS_SINKS=sinks is not None, HAS_DESCALE=quant, PV_FP16=v.dtype == torch.int8)
@triton.jit
def _running_max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _clamp_cu_seqlens_kernel(CU, OUT, n, total, capacity, max_len, ERR, ERR_BIT,
                             PAGED: tl.constexpr, BLOCK: tl.constexpr):
    # One program over the n = B + 1 cumulative lengths. Packed (PAGED false): each clamped to
    # [0, total], then their running maximum (non-decreasing), so every sequence's rows lie in
    # [0, total). Paged keys (their starts are unused): each length clamped to [0, capacity] (a
    # block_table row's tokens) and summed again. Anything changed, a first value other than 0,
    # a last one other than total (packed), or a length past max_len is recorded in ERR.
    offs = tl.arange(0, BLOCK)
    inb = offs < n
    cu = tl.load(CU + offs, mask=inb, other=0).to(tl.int64)                     # [BLOCK]
    prev = tl.load(CU + offs - 1, mask=inb & (offs > 0), other=0).to(tl.int64)
    if PAGED:
        length = tl.where(offs > 0, cu - prev, 0)
        fixed = tl.minimum(tl.maximum(length, 0), capacity)
        out = tl.cumsum(fixed, 0)
        bad = inb & ((fixed != length) | ((offs == 0) & (cu != 0)) | (fixed > max_len))
    else:
        clamped = tl.where(offs == 0, 0, tl.minimum(tl.maximum(cu, 0), total))
        out = tl.associative_scan(clamped, 0, _running_max)
        out_prev = tl.associative_scan(tl.where(offs > 1, tl.minimum(tl.maximum(prev, 0), total), 0), 0,
                                       _running_max)
        bad = inb & ((out != cu) | ((offs == n - 1) & (cu != total)) | (out - out_prev > max_len))
    tl.store(OUT + offs, out.to(tl.int32), mask=inb)
    tl.atomic_or(ERR, ERR_BIT, mask=tl.max(bad.to(tl.int32), 0) > 0)


def clamp_cu_seqlens(cu: torch.Tensor, *, total: int, capacity: int, max_len: int, paged: bool) -> torch.Tensor:
    """cu_seqlens (B + 1,) int32 brought into range on the device, with no value read back:
    packed (``paged`` false), non-decreasing within [0, total]; paged keys, lengths within
    [0, capacity]. Valid values come back unchanged; anything out of range, or a length past
    ``max_len``, is recorded as BAD_CU_SEQLENS in the device's error flag. One launch."""
    out = torch.empty_like(cu)
    n = cu.shape[0]
    with torch.cuda.device(cu.device) if cu.is_cuda else _null():
        launch(_clamp_cu_seqlens_kernel, (1,), cu, out, n, total, capacity, max_len, errors.error_flag(cu.device),
                                       BAD_CU_SEQLENS, PAGED=paged, BLOCK=max(2, next_power_of_2(n)),
                                       num_warps=4)
    return out


def _null():
    import contextlib

    return contextlib.nullcontext()


def clamp_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, block_table=None):
    """A varlen call's cu_seqlens_q and cu_seqlens_k through :func:`clamp_cu_seqlens` (two
    launches, no sync): query rows within q's total, key rows within k's (or, with a block table,
    each length within its row's pages)."""
    cq = clamp_cu_seqlens(cu_seqlens_q, total=q.shape[0], capacity=0, max_len=max_seqlen_q, paged=False)
    if block_table is not None:
        ck = clamp_cu_seqlens(cu_seqlens_k, total=0, capacity=block_table.shape[1] * k.shape[1],
                              max_len=max_seqlen_k, paged=True)
    else:
        ck = clamp_cu_seqlens(cu_seqlens_k, total=k.shape[0], capacity=0, max_len=max_seqlen_k, paged=False)
    return cq, ck
