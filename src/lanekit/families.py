"""The one list of lanekit's op families, and what is gathered from all of them.

A family is a folder, ``lanekit/<family>/``: its public functions (``api.py``), custom ops
(``op.py``), kernels, its registry entries (``registry.py``: samples, tolerances, ``register``
calls) and its tile tables and compile allowances (``tuning.py``). Adding a family means adding
its name here; adding an op touches only its family's folder and its oracle in
``lanekit.reference``. Nothing here is imported by ``import lanekit``: the registry is loaded when
a tool asks for it (``lanekit check``, ``lanekit export``, the tests).
"""

from __future__ import annotations

import importlib

from lanekit.runtime.registry import Op, registered
from lanekit.runtime.targets import Allowances
from lanekit.testing import TOLERANCES, Tolerance

FAMILIES: tuple[str, ...] = ("attention", "kv_cache", "layers", "moe", "quant", "gemm", "rnn", "linear_attn")


def registry() -> dict[str, Op]:
    """Every registered op, by name, after importing each family's registry module."""
    for family in FAMILIES:
        importlib.import_module(f"lanekit.{family}.registry")
    return registered()


def get_op(name: str) -> Op:
    ops = registry()
    if name not in ops:
        raise ValueError(f"unknown op {name!r}; registered ops are {sorted(ops)}")
    return ops[name]


def tolerances() -> dict[str, Tolerance]:
    """Every tolerance that a registered op's outputs use, and the shared ones, by name."""
    found = dict(TOLERANCES)
    for op in registry().values():
        for output, tol in op.outputs:
            if found.setdefault(tol.name, tol) != tol:
                raise ValueError(f"{op.name}: output {output!r} has a tolerance named {tol.name!r} "
                                 "unlike another of that name")
    return found


def allowances() -> Allowances:
    """Every family's compile allowances (``<family>/tuning.py``: SPILL_ALLOWANCES and
    MATRIX_ALLOWANCES), keyed by (kernel, target)."""
    spills, matrix = {}, {}
    for family in FAMILIES:
        tuning = importlib.import_module(f"lanekit.{family}.tuning")
        for mine, theirs in ((spills, tuning.SPILL_ALLOWANCES), (matrix, tuning.MATRIX_ALLOWANCES)):
            twice = mine.keys() & theirs.keys()
            if twice:
                raise ValueError(f"{family}: allowances for {sorted(twice)} are given by two families")
            mine.update(theirs)
    return Allowances(spills, matrix)
