"""Errors found on the device: invalid index values that live in device memory (expert ids,
group offsets; later block tables, cache seqlens, slot mappings, cu_seqlens).

Reading such values back to check them would cost a device sync on every call. Instead the
kernels are bounds-safe on their own (an index outside its range is masked, never dereferenced)
and record what they saw in a per-device int32 flag, one bit per kind of error; the host reads
the flag lazily: at :func:`check_errors`, which raises a ``ValueError`` naming every error seen
since the last check and clears the flag. ``LANEKIT_CHECK_INDICES=1`` makes the public functions
check index values on the host before launching instead (a sync per call: a debug mode). This
is the trade-off vLLM makes for its expert ids and FlashAttention for its page tables, neither of
which checks them at all.

A family registers each kind of error once (:func:`register`, at import) and passes
``error_flag(device)`` and the kind's bit to its kernels, which ``tl.atomic_or`` the bit in.
"""

from __future__ import annotations

import torch

from lanekit.runtime.lanes import getenv
from lanekit.runtime.validate import ArgumentError

_KINDS: dict[int, str] = {}
_FLAGS: dict[torch.device, torch.Tensor] = {}


def register(message: str) -> int:
    """A new kind of device-side error, described by ``message`` (what was wrong and what the
    kernel did with it); returns its bit, which kernels OR into the flag."""
    for bit, known in _KINDS.items():
        if known == message:
            return bit
    if len(_KINDS) == 31:
        raise RuntimeError("lanekit.runtime.errors: more than 31 kinds of device-side error")
    bit = 1 << len(_KINDS)
    _KINDS[bit] = message
    return bit


def error_flag(device: torch.device) -> torch.Tensor:
    """The int32 (1,) flag of ``device``: zero until a kernel records an error. Kept for the
    process's life, so that CUDA graphs may capture launches that write it."""
    flag = _FLAGS.get(device)   # a tensor's .device: found at once, on every launch
    if flag is not None:
        return flag
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _FLAGS:
        _FLAGS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _FLAGS[device]


def check_indices_eagerly() -> bool:
    """Whether the public functions check device-resident index values on the host before every
    launch (``LANEKIT_CHECK_INDICES=1``)."""
    return getenv("LANEKIT_CHECK_INDICES", "") == "1"


def check_errors() -> None:
    """Raise an :class:`~lanekit.runtime.validate.ArgumentError` (a ``ValueError``, and a
    ``RuntimeError`` as FlashAttention's index checks raise) naming every kind of device-side
    error recorded since the last call (on any device), and clear the flags. A sync per device with a flag: call it where a sync
    is cheap (after a step, in a test). Returns None when no error was recorded."""
    found = []
    for device, flag in _FLAGS.items():
        bits = int(flag.item())
        if bits:
            flag.zero_()
            found += [f"{device}: {message}" for bit, message in sorted(_KINDS.items()) if bits & bit]
    if found:
        raise ArgumentError("lanekit found invalid indices on the device since the last check_errors():\n  "
                            + "\n  ".join(found))
