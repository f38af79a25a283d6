"""Tile tables of the mixture-of-experts kernels, and what their compiles may show.

Small tables are data here, keyed by architecture id (``lanekit.runtime.tuning.arch_id``); the
grouped GEMM's configs, keyed by shape, dtype and GPU, are data files a tuner writes
(``lanekit/moe/configs/``). What was tried is in docs/tuning/moe.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lanekit.runtime.tuning import arch_row
from lanekit.runtime.tuning import block16
from lanekit.runtime.tuning import tile_options

# ---- routing: topk_softmax, grouped_topk ----


# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----


# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----

# -- fused_moe --

@dataclass(frozen=True)
class FusedMoeConfig:
    """One launch of the fused expert MLP: block_m is the align's block (rows of one expert);
    GEMM1 takes block_n1 gate and as many up columns over block_k1 of K; GEMM2 block_n2 output
    columns (of K) over block_k2 of N, its reduction split split_k2 ways (the sum pass adds the
    splits in order: still deterministic); group_m row blocks share a column block (L2 reuse)."""

    block_m: int
    block_n1: int
    block_k1: int
    block_n2: int
    block_k2: int
    group_m: int
    num_warps: int
    num_stages: int
    split_k2: int = 1
    waves_per_eu: int = 0

    def options(self) -> dict:
        return tile_options(self)


# fused_moe, keyed by the largest M (tokens) a row serves; an M over the largest key takes it.
# Not yet swept on the GPU (benchmarks' tune-moe step): first rows from the shapes' arithmetic.
FUSED_MOE: dict[str, dict[int, FusedMoeConfig]] = {
    # the interpreter (and any GPU without a row): small tiles, few programs per block
    "generic": {
        16: FusedMoeConfig(16, 32, 32, 32, 32, 1, 4, 2),
        1 << 62: FusedMoeConfig(16, 32, 32, 32, 32, 4, 4, 2),
    },
    "sm90": {
        # decode: each routed expert's weights read once; 16-row blocks (one per expert), narrow N
        # tiles and a 2-way split of GEMM2's N so that top-8 of 768..2048 fills 132 SMs
        16: FusedMoeConfig(16, 32, 128, 64, 128, 1, 4, 4, split_k2=2),
        # a few rows per expert: 32-row blocks, still weight-bound
        128: FusedMoeConfig(32, 64, 64, 64, 64, 4, 4, 4),
        # prefill: MMA-bound; 128 x 128 tiles (two fp32 accumulators in GEMM1: 8 warps), 3 stages
        # of 48 KiB in shared memory
        1 << 62: FusedMoeConfig(128, 128, 64, 128, 64, 8, 8, 3),
    },
    "gfx942": {
        # CDNA 3, 64 KiB of LDS: two stages of 64 x 64 (x2) x 64 tiles fit in 48 KiB
        16: FusedMoeConfig(16, 32, 128, 64, 128, 1, 4, 2, split_k2=2),
        1 << 62: FusedMoeConfig(64, 64, 64, 64, 64, 8, 4, 2),
    },
}
# The sum pass: a program per (token, block of K columns), a few warps (elementwise, fp32)
FUSED_MOE_SUM_BLOCK: dict[str, int] = {"generic": 256, "sm90": 1024, "gfx942": 1024}
FUSED_MOE_SUM_WARPS = 4


def fused_moe_config(device: torch.device, M: int) -> FusedMoeConfig:
    rows = arch_row(FUSED_MOE, device)
    return rows[min((k for k in rows if k >= M), default=max(rows))]


def fused_moe_sum_block(device: torch.device, K: int) -> int:
    return min(arch_row(FUSED_MOE_SUM_BLOCK, device), block16(K))



# ---- compile allowances (lanekit targets): (kernel, target) -> (bytes | regular expression, reason).
SPILL_ALLOWANCES: dict[tuple[str, str], tuple[int, str]] = {}
MATRIX_ALLOWANCES: dict[tuple[str, str], tuple[str, str]] = {}
