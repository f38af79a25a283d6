"""Tile tables of the mixture-of-experts kernels, and what their compiles may show.

Small tables are data here, keyed by architecture id (``lanekit.runtime.tuning.arch_id``); the
grouped GEMM's configs, keyed by shape, dtype and GPU, are data files a tuner writes
(``lanekit/moe/configs/``). What was tried is in docs/tuning/moe.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from lanekit.runtime.tuning import arch_row

# ---- routing: topk_softmax, grouped_topk ----

@dataclass(frozen=True)
class RoutingConfig:
    """Tokens per program of topk_softmax and grouped_topk (each holds all E scores of a token)."""

    block_m: int
    num_warps: int


# keyed by the padded expert count (a power of two; larger E takes the largest key's row):
# [block_m, E] tiles of 1024-2048 fp32 scores, 8-16 per thread at 4 warps, each top-k step two
# row reductions over them. Not yet swept on the GPU.
ROUTING: dict[str, dict[int, RoutingConfig]] = {
    "generic": {
        64: RoutingConfig(16, 4),
        128: RoutingConfig(16, 4),
        256: RoutingConfig(8, 4),
        512: RoutingConfig(4, 4),
    },
}


def routing_config(device, num_experts: int) -> RoutingConfig:
    rows = arch_row(ROUTING, device)
    padded = max(64, 1 << max(num_experts - 1, 0).bit_length())
    return rows.get(padded, rows[max(rows)])



# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----

@dataclass(frozen=True)
class AlignConfig:
    """The sort by expert of moe_align_block_size and moe_dispatch, and the row copies around it.

    A sort whose (flat indices x experts) one-hot tile, both padded to powers of two, holds at
    most ``one_program_tile`` elements runs in one program (one launch: decode); larger ones in
    three (count per chunk of ``chunk`` flat indices, one scan, a scatter per chunk).
    ``fuse_gather``: dispatch copies the rows of x in that same program while M * topk * K is at
    most this, ``gather_tile`` elements of rows at a time (few iterations: each waits for its
    loads). ``row_block``: the columns a program of the gather, combine and their backwards
    copies or sums at once, ``rows``: the flat indices a gather program takes.
    """

    one_program_tile: int
    chunk: int
    fuse_gather: int
    row_block: int
    rows: int
    num_warps: int
    scan_num_warps: int
    gather_tile: int


# generic (every target until a sweep on the GPU says otherwise): a one-program tile of 16384
# one-hot elements is 8 per thread at 8 warps of 32 lanes (4 on AMD's wave64), and keeps decode
# (M * topk <= 64 at E = 256) in one launch; chunks of 1024 flat indices keep the per-chunk sort a
# 55-step bitonic network in registers; rows of 1024 columns are 4 per thread at 8 warps; the
# one program's row copies take 16384 elements (64 per thread) a step: decode's 8 rows of
# K = 7168 in 4 steps.
ALIGN: dict[str, AlignConfig] = {
    "generic": AlignConfig(one_program_tile=16384, chunk=1024, fuse_gather=65536, row_block=1024,
                           rows=4, num_warps=8, scan_num_warps=8, gather_tile=16384),
}


def align_config(device) -> AlignConfig:
    return arch_row(ALIGN, device)


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): triton.next_power_of_2 in plain Python, whose
    call costs a few microseconds of host time on the decode path."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)



# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----


# ---- compile allowances (lanekit targets): (kernel, target) -> (bytes | regular expression, reason).
SPILL_ALLOWANCES: dict[tuple[str, str], tuple[int, str]] = {}
MATRIX_ALLOWANCES: dict[tuple[str, str], tuple[str, str]] = {}
