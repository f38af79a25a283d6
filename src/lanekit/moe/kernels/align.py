"""The sort of flat indices by expert behind ``moe_align_block_size`` and ``moe_dispatch``.

Flat index f = t * topk + s names slot s of token t. Each valid f (its expert id e in [0, E))
goes to position start[e] + rank, where rank counts the valid flat indices before f with the
same expert (so within one expert they ascend, as the oracle fixes) and start[e] is the sum of
the earlier experts' runs, each padded to a multiple of the block size (1 for dispatch).
An id outside [0, E) is never used as an address: the align drops it (it takes no slot), the
dispatch puts it after every expert (in flat order, past offs[E - 1]); both record
``BAD_EXPERT`` in the device's error flag.

Two ways, the same order:
- ``_moe_align_one_program_kernel`` and ``_moe_dispatch_one_program_kernel``: every flat index
  in one program, ranks from a [flat, expert] one-hot tile and its cumulative sum
  (``_one_program_positions``; decode: one launch, the dispatch's row copies in it too).
- ``_moe_align_count_kernel`` (a histogram per chunk of flat indices), ``_moe_align_scan_kernel``
  (one program: each expert's start, each chunk's base per expert, the padding and the tail,
  reading only the counts: no value it writes is read back by another of its threads),
  ``_moe_align_scatter_kernel`` (per chunk: a sort of (expert, flat index) keys gives each its
  rank within the chunk; base + position in the sorted chunk is its place).
Padding positions and the tail are written with the sentinel M * topk by the program that knows
them; every position of ``sorted_token_ids`` is written exactly once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.moe import tuning
from lanekit.runtime import errors
from lanekit.runtime.alloc import empty
from lanekit.runtime.lanes import triton_interpreted

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

BAD_EXPERT = errors.register(
    "moe: a topk_ids entry outside [0, num_experts) (never used as an address: the align dropped "
    "it, the dispatch placed it after every expert's rows)")


@triton.jit
def _load_ids(IDS, stride_m, stride_k, flat, numel, topk, E):
    """(ids, in_range, valid) of the flat indices ``flat`` (int64): valid = an id in [0, E)."""
    in_range = flat < numel
    ids = tl.load(IDS + (flat // topk) * stride_m + (flat % topk) * stride_k, mask=in_range, other=-1)
    valid = in_range & (ids >= 0) & (ids < E)
    return ids, in_range, valid


@triton.jit
def _record_bad(ERR, ERR_BIT, in_range, valid):
    bad = tl.max((in_range & (valid == 0)).to(tl.int32), axis=0)
    tl.atomic_or(ERR, ERR_BIT, mask=bad > 0)


@triton.jit
def _fill(PTR, start, end, value, FILL: tl.constexpr):
    """PTR[start:end] = value, FILL elements at a time (start, end: int64 scalars)."""
    for p0 in range(start // FILL * FILL, end, FILL):
        p = p0 + tl.arange(0, FILL).to(tl.int64)
        tl.store(PTR + p, tl.full([FILL], 0, tl.int32) + value, mask=(p >= start) & (p < end))


@triton.jit
def _fill_padding(SORTED, starts, counts, padded, sentinel, block_size, PAD: tl.constexpr):
    """The sentinel in each expert's run past its tokens: [start + count, start + padded)."""
    for j0 in range(0, block_size - 1, PAD):
        j = j0 + tl.arange(0, PAD)
        p = (starts + counts).to(tl.int64)[:, None] + j[None, :]            # [BLOCK_E, PAD]
        tl.store(SORTED + p, tl.full(p.shape, 0, tl.int32) + sentinel,
                 mask=j[None, :] < (padded - counts)[:, None])


@triton.jit
def _one_program_positions(IDS, stride_m, stride_k, numel, topk, E, block_size, ERR, ERR_BIT,
                           BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Every flat index's position, from a [BLOCK_T, BLOCK_E] one-hot tile: (flat, ids, in_range,
    valid, experts, counts, padded, ends, starts, total, rank, pos)."""
    flat = tl.arange(0, BLOCK_T).to(tl.int64)
    ids, in_range, valid = _load_ids(IDS, stride_m, stride_k, flat, numel, topk, E)
    _record_bad(ERR, ERR_BIT, in_range, valid)
    experts = tl.arange(0, BLOCK_E)
    onehot = ((ids[:, None] == experts[None, :]) & valid[:, None]).to(tl.int32)   # [BLOCK_T, BLOCK_E]
    counts = tl.sum(onehot, axis=0)                                               # [BLOCK_E]
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1                 # [BLOCK_T]
    padded = (counts + block_size - 1) // block_size * block_size
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    pos = (tl.sum(onehot * starts[None, :], axis=1) + rank).to(tl.int64)         # [BLOCK_T]
    return flat, ids, in_range, valid, experts, counts, padded, ends, starts, total, rank, pos


@triton.jit
def _moe_align_one_program_kernel(IDS, stride_m, stride_k, numel, topk, E, block_size, OUT,
                                  max_padded, num_blocks, EXPERT_MAP, ERR, ERR_BIT,
                                  HAS_MAP: tl.constexpr, BLOCK_T: tl.constexpr,
                                  BLOCK_E: tl.constexpr, PAD: tl.constexpr, FILL: tl.constexpr):
    # OUT: sorted_token_ids (max_padded), expert_ids (num_blocks), num_tokens_post_padded (1)
    flat, ids, in_range, valid, experts, counts, padded, ends, starts, total, rank, pos = \
        _one_program_positions(IDS, stride_m, stride_k, numel, topk, E, block_size, ERR, ERR_BIT,
                               BLOCK_T, BLOCK_E)
    EXPERT_IDS = OUT + max_padded
    tl.store(OUT + pos, flat.to(tl.int32), mask=valid)
    first = valid & (rank % block_size == 0)             # the first token of a block names its expert
    e = ids
    fill = 0
    if HAS_MAP:
        e = tl.load(EXPERT_MAP + ids, mask=first, other=0)
        fill = tl.load(EXPERT_MAP)
    tl.store(EXPERT_IDS + pos // block_size, e, mask=first)
    _fill(EXPERT_IDS, (total // block_size).to(tl.int64), num_blocks, fill, FILL)
    _fill_padding(OUT, starts, counts, padded, numel, block_size, PAD)
    _fill(OUT, total.to(tl.int64), max_padded, numel, FILL)
    tl.store(EXPERT_IDS + num_blocks, total)


@triton.jit
def _moe_dispatch_one_program_kernel(IDS, stride_m, stride_k, numel, topk, E, ORDER, X, stride_xm,
                                     stride_xk, P, stride_pm, stride_pk, K, ERR, ERR_BIT,
                                     GATHER: tl.constexpr, BLOCK_T: tl.constexpr,
                                     BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    # ORDER: inv_permuted_idx (numel), then offs (E)
    flat, ids, in_range, valid, experts, counts, padded, ends, starts, total, rank, pos = \
        _one_program_positions(IDS, stride_m, stride_k, numel, topk, E, 1, ERR, ERR_BIT,
                               BLOCK_T, BLOCK_E)
    bad = (in_range & (valid == 0)).to(tl.int32)          # after every expert, in flat order
    pos = tl.where(valid, pos, total + tl.cumsum(bad, axis=0) - 1)
    tl.store(ORDER + flat, pos.to(tl.int32), mask=in_range)
    tl.store(ORDER + numel + experts, ends, mask=experts < E)
    if GATHER:
        token = flat // topk
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
            m = in_range[:, None] & (k < K)[None, :]                              # [BLOCK_T, BLOCK_K]
            rows = tl.load(X + token[:, None] * stride_xm + k[None, :] * stride_xk, mask=m)
            tl.store(P + pos[:, None] * stride_pm + k[None, :] * stride_pk, rows, mask=m)


@triton.jit
def _moe_align_count_kernel(IDS, stride_m, stride_k, numel, topk, E, COUNTS, ERR, ERR_BIT,
                            BLOCK_T: tl.constexpr, NUM_BINS: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    flat = chunk * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    ids, in_range, valid = _load_ids(IDS, stride_m, stride_k, flat, numel, topk, E)
    _record_bad(ERR, ERR_BIT, in_range, valid)
    key = tl.where(valid, ids, E)                                  # bin E: ids outside [0, E)
    counts = tl.histogram(key, NUM_BINS, mask=in_range)            # [NUM_BINS]
    tl.store(COUNTS + chunk * NUM_BINS + tl.arange(0, NUM_BINS), counts)


@triton.jit
def _moe_align_scan_kernel(COUNTS, BASE, STARTS, num_chunks, numel, E, block_size,
                           SORTED, EXPERT_IDS, NUM_POST, EXPERT_MAP, max_padded, num_blocks, OFFS,
                           DISPATCH: tl.constexpr, HAS_MAP: tl.constexpr,
                           NUM_BINS: tl.constexpr, PAD: tl.constexpr, FILL: tl.constexpr):
    bins = tl.arange(0, NUM_BINS)
    run = tl.zeros([NUM_BINS], dtype=tl.int32)
    counts_row = COUNTS + bins                      # advanced a row at a time: 64-bit pointers
    for c in range(num_chunks):                      # each expert's count
        run += tl.load(counts_row)
        counts_row += NUM_BINS
    counts = tl.where(bins < E, run, 0)
    padded = (counts + block_size - 1) // block_size * block_size
    if DISPATCH:
        padded = tl.where(bins == E, run, padded)     # ids outside [0, E): after every expert
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(tl.where(bins < E, padded, 0), axis=0)
    tl.store(STARTS + bins, starts)
    # a chunk's base: the expert's start + the earlier chunks' count of it - this chunk's count of
    # the lower experts (then base + the place in the chunk's sorted keys is the position)
    before = tl.zeros([NUM_BINS], dtype=tl.int32)
    counts_row, base_row = COUNTS + bins, BASE + bins
    for c in range(num_chunks):
        cnt = tl.load(counts_row)
        lower = tl.cumsum(cnt, axis=0) - cnt
        tl.store(base_row, starts + before - lower)
        before += cnt
        counts_row += NUM_BINS
        base_row += NUM_BINS
    if DISPATCH:
        tl.store(OFFS + bins, ends, mask=bins < E)
    else:
        fill = 0
        if HAS_MAP:
            fill = tl.load(EXPERT_MAP)
        _fill(EXPERT_IDS, (total // block_size).to(tl.int64), num_blocks, fill, FILL)
        _fill_padding(SORTED, starts, counts, padded, numel, block_size, PAD)
        _fill(SORTED, total.to(tl.int64), max_padded, numel, FILL)
        tl.store(NUM_POST, total)


@triton.jit
def _moe_align_scatter_kernel(IDS, stride_m, stride_k, numel, topk, E, block_size, BASE, STARTS,
                              SORTED, EXPERT_IDS, EXPERT_MAP, INV,
                              DISPATCH: tl.constexpr, HAS_MAP: tl.constexpr,
                              BLOCK_T: tl.constexpr, NUM_BINS: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    local = tl.arange(0, BLOCK_T)
    flat = chunk * BLOCK_T + local.to(tl.int64)
    ids, in_range, valid = _load_ids(IDS, stride_m, stride_k, flat, numel, topk, E)
    # bin E: ids outside [0, E); E + 1: past the end of the flat indices
    key = tl.where(valid, ids, tl.where(in_range, E, E + 1)) * BLOCK_T + local
    key = tl.sort(key)                                              # [BLOCK_T] by expert, then flat
    e = key // BLOCK_T
    mine = flat - local + (key % BLOCK_T)                           # the flat index at sorted place q
    if DISPATCH:
        keep = e <= E
    else:
        keep = e < E
    base = tl.load(BASE + chunk * NUM_BINS + e, mask=keep, other=0)
    pos = (base + local).to(tl.int64)
    if DISPATCH:
        tl.store(INV + mine, pos.to(tl.int32), mask=keep)
    else:
        tl.store(SORTED + pos, mine.to(tl.int32), mask=keep)
        start = tl.load(STARTS + e, mask=keep, other=0)
        first = keep & ((pos - start) % block_size == 0)           # the first token of a block
        expert = e
        if HAS_MAP:
            expert = tl.load(EXPERT_MAP + e, mask=first, other=0)
        tl.store(EXPERT_IDS + pos // block_size, expert, mask=first)


def padded_length(numel: int, block_size: int, num_experts: int) -> int:
    """max_num_tokens_padded of the oracle: every expert's run padded, or, when fewer slots than
    experts are routed, every slot its own block."""
    padded = numel + num_experts * (block_size - 1)
    return min(numel * block_size, padded) if numel < num_experts else padded


def _pad_tile(block_size, experts, cfg):
    """The columns of the [experts, PAD] tile that writes the padding (at most block_size - 1 a
    run): a tile of at most row_block * rows elements."""
    return max(1, min(tuning.next_pow2(max(block_size - 1, 1)), cfg.row_block * cfg.rows // experts))


def _one_program(numel, num_experts, cfg):
    block_t = tuning.next_pow2(max(numel, 1))
    block_e = tuning.next_pow2(num_experts)
    return block_t, block_e, block_t * block_e <= cfg.one_program_tile


def _chunked(*, topk_ids, num_experts, block_size, dispatch, cfg, err, sorted_ids=None,
             expert_ids=None, num_post=None, expert_map=None, max_padded=0, num_blocks=0,
             inv=None, offs=None):
    """The sort of many flat indices: count per chunk, one scan, a scatter per chunk."""
    device = topk_ids.device
    M, topk = topk_ids.shape
    numel = M * topk
    dummy = topk_ids
    chunk = cfg.chunk
    num_chunks = tuning.cdiv(numel, chunk)
    bins = tuning.next_pow2(num_experts + 1)
    scratch = empty((2 * num_chunks * bins + bins,), dtype=topk_ids.dtype, device=device)
    counts, base = scratch[:num_chunks * bins], scratch[num_chunks * bins:2 * num_chunks * bins]
    starts = scratch[2 * num_chunks * bins:]
    common = dict(DISPATCH=dispatch, HAS_MAP=expert_map is not None)
    _moe_align_count_kernel[(num_chunks,)](topk_ids, *topk_ids.stride(), numel, topk, num_experts,
                                           counts, err, BAD_EXPERT, BLOCK_T=chunk, NUM_BINS=bins,
                                           num_warps=cfg.num_warps)
    _moe_align_scan_kernel[(1,)](
        counts, base, starts, num_chunks, numel, num_experts, block_size,
        sorted_ids if sorted_ids is not None else dummy,
        expert_ids if expert_ids is not None else dummy,
        num_post if num_post is not None else dummy,
        expert_map if expert_map is not None else dummy, max_padded, num_blocks,
        offs if offs is not None else dummy, NUM_BINS=bins,
        PAD=_pad_tile(block_size, bins, cfg), FILL=cfg.row_block, num_warps=cfg.scan_num_warps,
        **common)
    _moe_align_scatter_kernel[(num_chunks,)](
        topk_ids, *topk_ids.stride(), numel, topk, num_experts, block_size, base, starts,
        sorted_ids if sorted_ids is not None else dummy,
        expert_ids if expert_ids is not None else dummy,
        expert_map if expert_map is not None else dummy,
        inv if inv is not None else dummy, BLOCK_T=chunk, NUM_BINS=bins,
        num_warps=cfg.num_warps, **common)


def align_lengths(numel: int, block_size: int, num_experts: int) -> tuple[int, int]:
    """(max_num_tokens_padded, the number of blocks)."""
    max_padded = padded_length(numel, block_size, num_experts)
    return max_padded, (max_padded + block_size - 1) // block_size


def split_align_output(out, max_padded: int, num_blocks: int):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded): views of the align's buffer (one
    call for the three, the cheapest in host time)."""
    return torch.split_with_sizes(out, (max_padded, num_blocks, 1))


def moe_align_block_size_fwd(*, topk_ids, block_size, num_experts, expert_map=None):
    """topk_ids int32 (M, topk), any strides; expert_map int32 (E,) or None. Returns one int32
    buffer holding (sorted_token_ids, expert_ids, num_tokens_post_padded) as the oracle defines
    them, one after the other (split_align_output gives the three views)."""
    device = topk_ids.device
    cfg = tuning.align_config(device)
    err = errors.error_flag(device)
    M, topk = topk_ids.shape
    numel = M * topk
    expert_map = expert_map.contiguous() if expert_map is not None else None   # (E,): a copy at most
    max_padded, num_blocks = align_lengths(numel, block_size, num_experts)
    # one allocation for the three (an allocation costs host time on the decode path)
    out = empty((max_padded + num_blocks + 1,), dtype=topk_ids.dtype, device=device)
    block_t, block_e, one = _one_program(numel, num_experts, cfg)
    if one:
        _moe_align_one_program_kernel[(1,)](
            topk_ids, *topk_ids.stride(), numel, topk, num_experts, block_size, out, max_padded,
            num_blocks, expert_map if expert_map is not None else topk_ids, err, BAD_EXPERT,
            HAS_MAP=expert_map is not None, BLOCK_T=block_t, BLOCK_E=block_e,
            PAD=_pad_tile(block_size, block_e, cfg), FILL=cfg.row_block, num_warps=cfg.num_warps)
        return out
    sorted_ids, expert_ids, num_post = split_align_output(out, max_padded, num_blocks)
    _chunked(topk_ids=topk_ids, num_experts=num_experts, block_size=block_size, dispatch=False,
             cfg=cfg, err=err, sorted_ids=sorted_ids, expert_ids=expert_ids, num_post=num_post,
             expert_map=expert_map, max_padded=max_padded, num_blocks=num_blocks)
    return out


def split_order(order, M: int, topk: int):
    """(inv (M, topk), offs (E,)) views of expert_order_fwd's buffer."""
    inv, offs = torch.split_with_sizes(order, (M * topk, order.shape[0] - M * topk))
    return inv.view(M, topk), offs


def expert_order_fwd(*, topk_ids, num_experts, x, permuted):
    """The dispatch's order: (one int32 buffer of inv (M, topk) then offs (E,), see split_order;
    whether the rows of x were copied into permuted in the same launch)."""
    device = topk_ids.device
    cfg = tuning.align_config(device)
    err = errors.error_flag(device)
    M, topk = topk_ids.shape
    numel = M * topk
    K = x.shape[1]
    order = empty((numel + num_experts,), dtype=topk_ids.dtype, device=device)
    block_t, block_e, one = _one_program(numel, num_experts, cfg)
    if one:
        gather = numel * K <= cfg.fuse_gather
        _moe_dispatch_one_program_kernel[(1,)](
            topk_ids, *topk_ids.stride(), numel, topk, num_experts, order, x, *x.stride(),
            permuted, *permuted.stride(), K, err, BAD_EXPERT, GATHER=gather, BLOCK_T=block_t,
            BLOCK_E=block_e,
            BLOCK_K=max(16, min(tuning.next_pow2(max(K, 1)), cfg.gather_tile // block_t)) if gather else 16,
            num_warps=cfg.num_warps)
        return order, gather
    inv, offs = split_order(order, M, topk)
    _chunked(topk_ids=topk_ids, num_experts=num_experts, block_size=1, dispatch=True, cfg=cfg,
             err=err, inv=inv, offs=offs)
    return order, False
