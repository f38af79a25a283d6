"""Tile tables of the paged KV-cache kernels (writes, reads, quantization, the merge of partials),
and what their compiles may show.

The tables are data, keyed by architecture id (``lanekit.runtime.tuning.arch_id``); the machinery
that reads them lives in ``lanekit.runtime.tuning``. What was tried is in docs/tuning/kv_cache.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lanekit.runtime.tuning import arch_row


@dataclass(frozen=True)
class KvCacheConfig:
    """Each program moves ``tile`` elements: tile // BLOCK_D rows of one (token, head) each
    (BLOCK_D: the head dim rounded up to a power of two), so that a row's amax for the quantized
    write stays in one program."""

    tile: int
    num_warps: int


# Not yet timed on any GPU: 4096 elements (32 rows of D=128, 32 per thread with 4 warps) is a
# stated guess for a copy kernel.
KV_CACHE: dict[str, KvCacheConfig] = {"generic": KvCacheConfig(4096, 4)}


def kv_cache_config(device: torch.device) -> KvCacheConfig:
    return arch_row(KV_CACHE, device)


# ---- compile allowances (lanekit targets): (kernel, target) -> (bytes | regular expression, reason).
SPILL_ALLOWANCES: dict[tuple[str, str], tuple[int, str]] = {}
MATRIX_ALLOWANCES: dict[tuple[str, str], tuple[str, str]] = {}
