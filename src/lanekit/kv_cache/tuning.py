"""Tile tables of the paged KV-cache kernels (writes, reads, quantization, the merge of partials),
and what their compiles may show.

The tables are data, keyed by architecture id (``lanekit.runtime.tuning.arch_id``); the machinery
that reads them lives in ``lanekit.runtime.tuning``. What was tried is in docs/tuning/kv_cache.md.
"""

from __future__ import annotations

# ---- compile allowances (lanekit targets): (kernel, target) -> (bytes | regular expression, reason).
SPILL_ALLOWANCES: dict[tuple[str, str], tuple[int, str]] = {}
MATRIX_ALLOWANCES: dict[tuple[str, str], tuple[str, str]] = {}
