"""The tuning tables by name, wherever their family keeps them (``lanekit.<family>.tuning``), for
the tools that replace a row by a table's name: ``tune_targets``' sweeps and ``run_case --set``."""

from __future__ import annotations

from lanekit.attention import tuning as attention
from lanekit.kv_cache import tuning as kv_cache
from lanekit.layers import tuning as layers
from lanekit.rnn import tuning as rnn
from lanekit.runtime import tuning as runtime

MODULES = (attention, layers, rnn, kv_cache, runtime)


def table(name: str) -> dict | None:
    """The table (architecture id -> row, or -> rows by bucket) of that name, None if none is."""
    for module in MODULES:
        found = getattr(module, name, None)
        if isinstance(found, dict):
            return found
    return None
