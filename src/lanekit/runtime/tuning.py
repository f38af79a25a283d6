"""Tile configurations as data: one table per kernel, keyed by architecture id, then by bucket.

This module is the machinery only; each family keeps its own tables in ``lanekit/<family>/tuning.py``
(and the dated logs of what was tried in docs/tuning/<family>.md). Launchers read the tables; no
block size or warp count is written in host code. An architecture id is ``sm<major><minor>`` on
NVIDIA (``sm80``, ``sm90``) and the gfx name on AMD (``gfx942``, ``gfx1201``); an architecture
without a row of its own takes its alias's (:data:`ARCH_ALIASES`), else the ``generic`` row, which
is also the row for Triton's interpreter.

AMD rows (``gfx942``: CDNA 3, wave64; ``gfx1151``, ``gfx1201``: RDNA 3.5 and 4, wave32; all with
64 KiB of LDS) were chosen with ``python -m benchmarks.tune_targets --target T`` from the compiler's
resource report (the largest tile that compiles with the target's matrix instructions, fits its
LDS and spills no register), not copied from NVIDIA's; ``docs/targets.md`` shows what they compile
to. ``waves_per_eu`` (AMD only; 0 leaves it to the compiler) asks the compiler to keep registers
low enough for that many waves per SIMD.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    waves_per_eu: int = 0

    def options(self) -> dict:
        """The launch's compile options: warps, stages, and waves per EU where one is set (AMD)."""
        return tile_options(self)


def tile_options(cfg) -> dict:
    """Warps, stages, and waves per EU where the row sets one (AMD): a row's launch options."""
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.waves_per_eu:
        opts["waves_per_eu"] = cfg.waves_per_eu
    return opts


# The interpreter runs each program in Python, paying per operation rather than per element:
# 32x32 tiles ran the backward tests three times faster than 16x16 and still split the tests'
# odd lengths (17, 37, 97, 129) into several blocks.
INTERPRETER = TileConfig(32, 32, 1, 1)


_COMPILING_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("compiling_for", default=None)


@contextlib.contextmanager
def compiling_for(arch: str):
    """Within this block :func:`arch_id` answers ``arch`` for every device, so that launchers pick
    that architecture's rows: ``lanekit export`` captures a target's launches this way on a machine
    without that GPU (``lanekit.runtime.targets.capture``)."""
    token = _COMPILING_FOR.set(arch)
    try:
        yield
    finally:
        _COMPILING_FOR.reset(token)


def compiling() -> str | None:
    """The architecture of the enclosing :func:`compiling_for` block, None outside one."""
    return _COMPILING_FOR.get()


def arch_id(device: torch.device) -> str:
    """``sm90``, ``gfx942``, ... for a GPU device; ``generic`` for anything else; the target arch
    inside :func:`compiling_for`."""
    compiling = _COMPILING_FOR.get()
    if compiling is not None:
        return compiling
    arch = _ARCH_OF.get(device)
    if arch is not None:
        return arch
    if device.type != "cuda" or not torch.cuda.is_available():
        arch = "generic"
    elif device.index is None:   # the current device's: not kept (it may change)
        return _cuda_arch_id(torch.cuda.current_device())
    else:
        arch = _cuda_arch_id(device.index)
    _ARCH_OF[device] = arch
    return arch


# a device's architecture, by device (a tensor's .device): asked once, looked up on every launch
_ARCH_OF: dict[torch.device, str] = {}


@functools.lru_cache(maxsize=None)
def _cuda_arch_id(index: int) -> str:
    """The architecture of CUDA/ROCm device ``index``, asked of the driver once per process."""
    props = torch.cuda.get_device_properties(index)
    if getattr(torch.version, "hip", None):
        return props.gcnArchName.split(":")[0]
    return f"sm{props.major}{props.minor}"


# An architecture with no row of its own in a table takes its alias's row: the same wave size, LDS
# and matrix instructions (RDNA 3.5's WMMA is RDNA 4's at the sizes the kernels use).
ARCH_ALIASES: dict[str, str] = {"gfx1151": "gfx1201"}


def _arch_key(table: dict, arch: str) -> str:
    if arch in table:
        return arch
    alias = ARCH_ALIASES.get(arch)
    return alias if alias in table else "generic"


def lookup(table: dict[str, dict[int, TileConfig]], device: torch.device, bucket: int) -> TileConfig:
    """The config for ``bucket`` on ``device``'s architecture (or its alias), else the generic one."""
    rows = table[_arch_key(table, arch_id(device))]
    return rows.get(bucket, table["generic"][bucket])


def arch_row(table: dict, device: torch.device):
    """``device``'s architecture's row (or its alias's) of a table of one row per architecture, else
    the generic one."""
    return table[_arch_key(table, arch_id(device))]


# Processors (SMs, CUs) of each architecture's usual part, for launches captured for a target that
# is not present (lanekit export): H100/H200, A100, MI300X, RX 9070 XT, Strix Halo. The generic
# row (Triton's interpreter) is 1, so that the tests' grids of one tile take the split-K path
# (gemm.tuning.split_k) and grids of several do not.
PROCESSORS: dict[str, int] = {"generic": 1, "sm90": 132, "sm80": 108, "gfx942": 304, "gfx1201": 64,
                              "gfx1151": 40}


def processor_count(device: torch.device) -> int:
    """The streaming multiprocessors (compute units) of ``device``: asked of the driver once per
    device, or :data:`PROCESSORS`'s for a target compiled for (and for the interpreter)."""
    if compiling() is None and device.type == "cuda" and torch.cuda.is_available():
        return _cuda_processors(device.index if device.index is not None else torch.cuda.current_device())
    return arch_row(PROCESSORS, device)


@functools.lru_cache(maxsize=None)
def _cuda_processors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def block16(n: int) -> int:
    """The least power of two that holds n, and at least 16 (the smallest tile tl.dot takes)."""
    return max(16, 1 << max(n - 1, 0).bit_length())
