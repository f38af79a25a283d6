"""Lanes and the op registry.

A *lane* is one implementation of one op on one kind of device: ``triton`` (compiled for the GPU
present, or run by Triton's interpreter on a CPU) and ``reference`` (the plain-PyTorch oracle).
Every op registers its oracle, its lanes, a generator of sample inputs and its tolerance here; the
execution matrix, ``lanekit check`` and the tests all read this one registry.

Lane implementations are named by import path (``"module:function"``) and imported on first use, so
``import lanekit`` never imports a Triton kernel module: a process decides whether Triton runs
natively or interpreted (``TRITON_INTERPRET=1``) before the first kernel module is imported.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

LANES = ("triton", "reference")
LANE_ENV = "LANEKIT_LANE"


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
    yields the op's sample inputs, odd shapes included. ``tolerance`` names an entry of
    :data:`lanekit.testing.TOLERANCES`.
    """

    name: str
    family: str
    oracle: str
    lanes: dict[str, str]
    samples: Callable[[str], Iterable[Sample]]
    outputs: tuple[tuple[str, str], ...] = (("out", "exact"),)
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
    if op.name in _REGISTRY:
        raise ValueError(f"op {op.name!r} is registered twice")
    _REGISTRY[op.name] = op
    return op


def registry() -> dict[str, Op]:
    """All registered ops, by name, after importing every family that registers some."""
    from lanekit import ops  # noqa: F401  (the import registers the ops)

    return dict(_REGISTRY)


def get_op(name: str) -> Op:
    ops = registry()
    if name not in ops:
        raise ValueError(f"unknown op {name!r}; registered ops are {sorted(ops)}")
    return ops[name]


def _load(path: str) -> Callable:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def triton_interpreted() -> bool:
    """Whether Triton kernels imported by this process run under Triton's interpreter.

    Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, that is when its module is first
    imported; lanekit never sets it (the CLI and the test suite do, before any kernel import).
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def select_lane(device: torch.device, lane: str | None) -> str:
    """The lane that runs an op whose tensors are on ``device``.

    Order: the call's ``lane=`` argument, then the ``LANEKIT_LANE`` environment variable, then the
    device: a CUDA (or ROCm, which PyTorch also calls ``cuda``) tensor runs ``triton``, anything
    else ``reference``. Asking for ``triton`` on a CPU tensor is only possible when this process
    runs Triton interpreted.
    """
    chosen = lane if lane is not None else os.environ.get(LANE_ENV) or None
    if chosen is None:
        return "triton" if device.type == "cuda" else "reference"
    if chosen not in LANES:
        source = "lane" if lane is not None else LANE_ENV
        raise ValueError(f"{source}: expected one of {LANES}, got {chosen!r}")
    if chosen == "triton" and device.type != "cuda" and not triton_interpreted():
        raise ValueError(
            f"lane='triton' on {device.type} tensors needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment before importing lanekit, or pass CUDA tensors"
        )
    return chosen
