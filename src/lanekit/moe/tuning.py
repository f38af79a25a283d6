"""Tile tables of the mixture-of-experts kernels, and what their compiles may show.

Small tables are data here, keyed by architecture id (``lanekit.runtime.tuning.arch_id``); the
grouped GEMM's configs, keyed by shape, dtype and GPU, are data files a tuner writes
(``lanekit/moe/configs/``). What was tried is in docs/tuning/moe.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lanekit.runtime.tuning import arch_id
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
        # a few rows per expert: 32-row blocks, still weight-bound; with 4 warps GEMM1 spilled
        # 512 bytes a thread at K 200 (lanekit export, 2 to 4 stages), with 8 it does not
        128: FusedMoeConfig(32, 64, 64, 64, 64, 4, 8, 3),
        # prefill: MMA-bound; GEMM1 128 rows x (64 gate + 64 up) columns, the density of one
        # 128 x 128 tile (128 gate and 128 up spilled 8 bytes a thread), GEMM2 128 x 128; 8 warps,
        # 3 stages of at most 32 KiB in shared memory
        1 << 62: FusedMoeConfig(128, 64, 64, 128, 64, 8, 8, 3),
    },
    # Ampere: sm90's rows (mma.sync everywhere; 164 KiB of shared memory holds their 3 to 4
    # stages), not yet measured on an A100
    "sm80": {
        16: FusedMoeConfig(16, 32, 128, 64, 128, 1, 4, 4, split_k2=2),
        128: FusedMoeConfig(32, 64, 64, 64, 64, 4, 8, 3),
        1 << 62: FusedMoeConfig(128, 64, 64, 128, 64, 8, 8, 3),
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


# K or N not a multiple of 16: rows of x, w1, w2 and the intermediate start unaligned, their loads
# are not vectorized, and the sm90 prefill row spilled 280 and 336 bytes a thread (K 136, N 40:
# lanekit export); such shapes take at most this bucket's row.
FUSED_MOE_UNALIGNED_BUCKET = 128


def fused_moe_config(device: torch.device, M: int, K: int, N: int) -> FusedMoeConfig:
    rows = arch_row(FUSED_MOE, device)
    if K % 16 or N % 16:
        M = min(M, FUSED_MOE_UNALIGNED_BUCKET)
    return rows[min((k for k in rows if k >= M), default=max(rows))]


def fused_moe_sum_block(device: torch.device, K: int) -> int:
    return min(arch_row(FUSED_MOE_SUM_BLOCK, device), block16(K))


# -- fused_moe, quantized experts (fp8 W8A8, int8 W8A16) --

# Rows that differ from fused_moe's for the quantized kernels; every block_k must divide 128 (the
# block scheme applies one 128 x 128 scale per K step). Others take FUSED_MOE's row (all of whose
# block_k are 32, 64 or 128).
FUSED_MOE_QUANT: dict[str, dict[int, FusedMoeConfig]] = {
    "sm90": {
        # prefill: fp8 halves the bytes of a tile, so a K step of 128 (one block scale, four
        # wgmma k-steps of 32) takes the shared memory bf16's 64 did: 32 KiB a stage, 3 stages.
        # Not yet measured on the H200.
        1 << 62: FusedMoeConfig(128, 64, 128, 128, 128, 8, 8, 3),
    },
}
# The activation quantization pass: columns of one row a program reads at a time
FUSED_MOE_QUANT_BLOCK = 1024


def fused_moe_quant_config(device: torch.device, M: int, K: int, N: int) -> FusedMoeConfig:
    cfg = fused_moe_config(device, M, K, N)
    rows = FUSED_MOE_QUANT.get(arch_id(device), {})
    if rows and not (K % 16 or N % 16):
        own = rows[min((k for k in rows if k >= M), default=max(rows))]
        if own.block_m == cfg.block_m:    # the same M bucket as fused_moe's row
            cfg = own
    assert 128 % cfg.block_k1 == 0 and 128 % cfg.block_k2 == 0, cfg
    return cfg


# ---- compile allowances (lanekit targets): (kernel, target) -> (bytes | regular expression, reason).
SPILL_ALLOWANCES: dict[tuple[str, str], tuple[int, str]] = {}
_FUSED_MOE_SMALL_BLOCKS = (
    "fused_moe's decode and few-token rows align tokens in blocks of 16 or 32 rows, below "
    "wgmma's 64-row warpgroup tile: mma.sync there; those launches are bound by reading the "
    "expert weights, not by the MMA (the prefill rows, 128-row blocks, take wgmma)")
MATRIX_ALLOWANCES: dict[tuple[str, str], tuple[str, str]] = {
    (kernel, "sm90"): (r"\bmma\.sync\.aligned\.\S+", _FUSED_MOE_SMALL_BLOCKS)
    for kernel in ("_fused_moe_gemm1_kernel", "_fused_moe_gemm2_kernel")
}
# fused_moe's quantized GEMMs: the same small-block rows as fused_moe's, so mma.sync there
# (lanekit export, Triton 3.6.0: e4m3 operands widened to fp16, exactly, for mma.sync f16; W8A16
# multiplies bf16/fp16); the prefill row takes wgmma m64n64k32 e4m3
MATRIX_ALLOWANCES.update({
    (kernel, "sm90"): (r"\bmma\.sync\.aligned\.\S+", _FUSED_MOE_SMALL_BLOCKS)
    for kernel in ("_fused_moe_quant_gemm1_kernel", "_fused_moe_quant_gemm2_kernel")
})
