"""The tuning tables by name, wherever their family keeps them (``lanekit.<family>.tuning``), for
the tools that replace a row by a table's name: ``tune_targets``' sweeps and ``run_case --set``."""

from __future__ import annotations

import importlib

from lanekit.families import FAMILIES
from lanekit.runtime import tuning as runtime


def table(name: str) -> dict | None:
    """The table (architecture id -> row, or -> rows by bucket) of that name, None if none is."""
    for module in [importlib.import_module(f"lanekit.{f}.tuning") for f in FAMILIES] + [runtime]:
        found = getattr(module, name, None)
        if isinstance(found, dict):
            return found
    return None
