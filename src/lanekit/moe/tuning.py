"""Tile tables of the mixture-of-experts kernels, and what their compiles may show.

Small tables are data here, keyed by architecture id (``lanekit.runtime.tuning.arch_id``); the
grouped GEMM's configs, keyed by shape, dtype and GPU, are data files a tuner writes
(``lanekit/moe/configs/``). What was tried is in docs/tuning/moe.md.
"""

from __future__ import annotations

# ---- routing: topk_softmax, grouped_topk ----


# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----


# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----


# ---- compile allowances (lanekit targets): (kernel, target) -> (bytes | regular expression, reason).
SPILL_ALLOWANCES: dict[tuple[str, str], tuple[int, str]] = {}
MATRIX_ALLOWANCES: dict[tuple[str, str], tuple[str, str]] = {}
