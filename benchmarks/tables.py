"""The tuning tables by name, wherever their family keeps them (``lanekit.<family>.tuning``), for
the tools that replace a row by a table's name: ``tune_targets``' sweeps, ``run_case --set`` and
``ab``'s trees with settings."""

from __future__ import annotations

import dataclasses
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


def apply_settings(items: list[str], arch: str) -> None:
    """Replace int fields of ``arch``'s rows in place, each item ``TABLE.field=value``: a row, or
    rows by bucket (NORM, GEMM, ...), whose field is then replaced in every bucket. Raises
    ValueError naming an item that is not of that form."""
    for item in items:
        name, _, value = item.partition("=")
        table_name, _, field = name.partition(".")
        found = table(table_name)
        if not isinstance(found, dict) or "generic" not in found:
            raise ValueError(f"expected TABLE.field=value with TABLE a tuning table, got {item!r}")
        row = found.get(arch, found["generic"])
        rows = row if isinstance(row, dict) else {None: row}
        first = next(iter(rows.values()))
        fields = [f.name for f in dataclasses.fields(first)]
        if field not in fields or not value.lstrip("-").isdigit():
            raise ValueError(f"expected an int field of {type(first).__name__} ({', '.join(fields)}), got {item!r}")
        replaced = {k: dataclasses.replace(r, **{field: int(value)}) for k, r in rows.items()}
        found[arch] = replaced if isinstance(row, dict) else replaced[None]
