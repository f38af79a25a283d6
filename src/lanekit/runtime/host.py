"""Host-side integer helpers for the launchers, in plain Python.

``triton.cdiv`` and ``triton.next_power_of_2`` are Triton ``constexpr_function`` objects: called
from host code each goes through Triton's argument unwrapping, several microseconds a call on the
hot path of every launch. These are the same functions on Python ints.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n for n >= 1, and 0 for 0, as ``triton.next_power_of_2``."""
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0
