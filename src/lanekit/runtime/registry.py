"""The op registry's types: what lanekit knows of every op, and the one table that holds them.

Every op registers its oracle, its lanes, a generator of sample inputs and a tolerance per output;
the execution matrix, ``lanekit check``, ``lanekit export`` and the registry-driven tests all read
this one table. Each family registers its own ops in ``lanekit/<family>/registry.py``; the one
list of families, and the function that loads them, is :mod:`lanekit.families`. This module imports
nothing of lanekit's.

Lane implementations and oracles are named by import path (``"module:function"``) and imported on
first use, so registering an op imports no Triton kernel module: a process decides whether Triton
runs natively or interpreted (``TRITON_INTERPRET=1``) before the first kernel module is imported.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(frozen=True)
class Sample:
    """One checked call of an op: ``kwargs`` for the lane function, and a readable ``name``."""

    name: str
    kwargs: dict


@dataclass(frozen=True)
class Op:
    """What the registry knows of one op.

    ``lanes`` maps a lane name to the import path of its implementation. Every lane function takes
    the same normalized keyword arguments (those a :class:`Sample` carries) and returns a tensor or
    a tuple of tensors. ``oracle`` is the import path of the reference, which computes in the dtype
    of its floating inputs; the checks call it on inputs upcast to float64. ``samples(device)``
    yields the op's sample inputs, odd shapes included. ``outputs`` names each output with its
    :class:`lanekit.testing.Tolerance` (the shared ones are in ``lanekit.testing``, a family's own
    beside its samples).
    """

    name: str
    family: str
    oracle: str
    lanes: dict[str, str]
    samples: Callable[[str], Iterable[Sample]]
    outputs: tuple[tuple[str, object], ...]    # (name, lanekit.testing.Tolerance) per output
    doc: str = ""

    def lane(self, name: str) -> Callable:
        """The implementation of lane ``name`` (imported on first use)."""
        if name not in self.lanes:
            raise ValueError(f"op {self.name!r} has no lane {name!r}; it has {sorted(self.lanes)}")
        return _load(self.lanes[name])

    def reference(self) -> Callable:
        return _load(self.oracle)


_REGISTRY: dict[str, Op] = {}


def register(op: Op) -> Op:
    """Add ``op`` to the registry (a family's registry module calls this at import)."""
    if op.name in _REGISTRY:
        raise ValueError(f"op {op.name!r} is registered twice")
    _REGISTRY[op.name] = op
    return op


def registered() -> dict[str, Op]:
    """The ops registered so far, by name (:func:`lanekit.families.registry` loads them all first)."""
    return dict(_REGISTRY)


def _load(path: str) -> Callable:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
