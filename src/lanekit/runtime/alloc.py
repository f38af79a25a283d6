"""Output allocation for the launchers, with NaN poisoning for checked runs.

Every launcher allocates its outputs through :func:`empty`. Inside :func:`poisoned_outputs` (used
by the tests and ``lanekit check``) those buffers are filled with NaN (floats) or the dtype's
largest value (integers) first, so an element a kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import contextlib
import math

import torch

_poison_depth = 0


def empty(shape, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if _poison_depth:
        if t.is_floating_point():
            t.fill_(math.nan)
        else:
            t.fill_(torch.iinfo(t.dtype).max)
    return t


@contextlib.contextmanager
def poisoned_outputs():
    """Within this block, outputs that launchers allocate start out as NaN."""
    global _poison_depth
    _poison_depth += 1
    try:
        yield
    finally:
        _poison_depth -= 1
