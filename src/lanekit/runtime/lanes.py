"""Lanes, and the choice of one per call.

A *lane* is one implementation of one op on one kind of device: ``triton`` (compiled for the GPU
present, or run by Triton's interpreter on a CPU) and ``reference`` (the plain-PyTorch oracle).
Which lanes an op has is in its registry entry (:mod:`lanekit.runtime.registry`); which one runs a
call is :func:`select_lane`'s answer.
"""

from __future__ import annotations

import os

import torch

LANES = ("triton", "reference")
LANE_ENV = "LANEKIT_LANE"

_ENCODED: dict[str, object] = {}


def getenv(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, read on every call as that is (tests and users change
    the environment between calls), without encoding the name again each time: os.environ's own
    get costs about 2 us a read on a slow host, and a call reads a few variables."""
    data = getattr(os.environ, "_data", None)
    if data is None:   # not CPython's os._Environ: its own get
        return os.environ.get(name, default)
    key = _ENCODED.get(name)
    if key is None:
        key = _ENCODED[name] = os.environ.encodekey(name)
    value = data.get(key)
    return default if value is None else os.environ.decodevalue(value)


def triton_interpreted() -> bool:
    """Whether Triton kernels imported by this process run under Triton's interpreter.

    Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, that is when its module is first
    imported; lanekit never sets it (the CLI and the test suite do, before any kernel import).
    """
    return getenv("TRITON_INTERPRET", "0") not in ("", "0")


def select_lane(device: torch.device, lane: str | None) -> str:
    """The lane that runs an op whose tensors are on ``device``.

    Order: the call's ``lane=`` argument, then the ``LANEKIT_LANE`` environment variable, then the
    device: a CUDA (or ROCm, which PyTorch also calls ``cuda``) tensor runs ``triton``, anything
    else ``reference``. Asking for ``triton`` on a CPU tensor is only possible when this process
    runs Triton interpreted.
    """
    chosen = lane if lane is not None else getenv(LANE_ENV) or None
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
