"""Tile tables of the quant kernels, and what their compiles may show.

Keyed by architecture id (``lanekit.runtime.tuning.arch_id``; gfx1151 aliases gfx1201). Not yet
swept on a GPU.
"""

from __future__ import annotations

# Columns per step of a quantize / dequantize program (one program per row and group): 1024
# 16-bit values are 2 KiB, 8 per thread at 4 warps: enough bytes in flight per program for a
# streaming pass, and no spill. A group's columns (128 by default) take a power of two >= them.
QUANT_BLOCK: dict[str, int] = {"generic": 1024}
QUANT_WARPS: dict[str, int] = {"generic": 4}

SPILL_ALLOWANCES: dict = {}
MATRIX_ALLOWANCES: dict = {}

# Warps of a Hadamard program (one row of KP <= 8192 fp32 values in registers: 64 per thread
# at 4 warps at the largest width).
HADAMARD_WARPS: dict[str, int] = {"generic": 4}
HADAMARD_MAX_WIDTH = 8192
