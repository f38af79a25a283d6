"""Tile tables of the quant kernels, and what their compiles may show.

Keyed by architecture id (``lanekit.runtime.tuning.arch_id``; gfx1151 aliases gfx1201). Not yet
swept on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from lanekit.runtime.tuning import arch_row

# Columns per step of a quantize / dequantize program (one program per row and group): 1024
# 16-bit values are 2 KiB, 8 per thread at 4 warps: enough bytes in flight per program for a
# streaming pass, and no spill. A group's columns (128 by default) take a power of two >= them.
QUANT_BLOCK: dict[str, int] = {"generic": 1024}
QUANT_WARPS: dict[str, int] = {"generic": 4}

# Group granularity with a power-of-two group: a program takes (rows, groups) of them, a
# [rows, groups, group] tile, so that it moves enough bytes (one program per row and group of 128
# read 256 bytes and reached 17% of the copy bandwidth at M = 16384, K = 7168 on an H100,
# 2026-12-07): 4 x 8 groups of 128 are 8 KiB of bf16. The interpreter's 1 x 2 keeps partial tiles
# in the samples (odd rows, a last group past C).
QUANT_GROUP_TILE: dict[str, tuple[int, int]] = {"generic": (1, 2), "sm90": (4, 8), "sm80": (4, 8),
                                               "gfx942": (4, 8), "gfx1201": (2, 8)}

SPILL_ALLOWANCES: dict = {}
MATRIX_ALLOWANCES: dict = {}

# Warps of a Hadamard program (one row of KP <= 8192 fp32 values in registers: 64 per thread
# at 4 warps at the largest width).
HADAMARD_WARPS: dict[str, int] = {"generic": 4}
HADAMARD_MAX_WIDTH = 8192


# ---- SVDQuant's activation pass (quantize_w4a4_act, fused with the low-rank down projection) ----

@dataclass(frozen=True)
class W4A4ActConfig:
    """Rows per program (16: tl.dot's least M, for x @ lora_down), low-rank columns per program
    (grid axis 1 over R), warps."""

    block_m: int
    block_r: int
    num_warps: int


# A streaming pass that also runs a [16, 64] x [64, BLOCK_R] dot per group: 16 rows keep M = 1..16
# decode batches in one program row; up to 64 low-rank columns a program (rank 128: two programs
# per row block, each re-reading x; the first also quantizes). Not swept on a GPU.
W4A4_ACT: dict[str, W4A4ActConfig] = {
    "generic": W4A4ActConfig(16, 64, 4),
    # H100/H200: 64 rows, wgmma's least M (16 rows lowered the down projection to mma.sync,
    # lanekit export 2026-12-07)
    "sm90": W4A4ActConfig(64, 64, 4),
}


def w4a4_act_config(device, R: int) -> W4A4ActConfig:
    cfg = arch_row(W4A4_ACT, device)
    block_r = max(16, min(cfg.block_r, 1 << max(R - 1, 0).bit_length()))
    return W4A4ActConfig(cfg.block_m, block_r, cfg.num_warps)
