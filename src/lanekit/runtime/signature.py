"""Keys of a call's signature, for the hot path's caches (DESIGN.md, "The hot path").

Two things a public op computes on every call follow from its arguments' metadata alone: its
argument checks (types, dtypes, shapes, devices, the scalar options) and its launch metadata
(grid, tile, strides, constexprs). Each is kept per signature, so that a call with a signature
seen before skips them:

- :func:`signature`: a key of everything the argument checks read (each tensor's exact type,
  dtype, shape, strides, device and requires_grad; grad mode; each scalar's type and value), or
  None for a call it cannot key (a tensor subclass, a NumPy scalar, a list, torch.compile
  tracing): such calls are checked in full every time. A cache keyed by it holds what the
  checks returned for a signature that passed them: a different signature never hits it, and a
  bad one is never kept, so it raises on every call as before. What the checks read beyond
  metadata (the environment, memory overlap, inference tensors) stays outside the cache.
- :func:`meta`: a launcher's key of one tensor (dtype, shape, strides, device); :func:`contiguous_strides`,
  the strides of an output a plan has not allocated yet.

Both caches are bounded by :func:`remember`.
"""

from __future__ import annotations

import torch

_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
# the scalar types keyed by value: equal values of these types mean the same argument (a bool and
# an int are told apart by their type, which is keyed too)
_SCALARS = frozenset({type(None), bool, int, float, str, torch.dtype})

_MAX_ENTRIES = 256      # per cache: a shape that changes every call must not grow it forever


def signature(tensors: tuple, scalars: tuple) -> tuple | None:
    """The key of a call whose tensor arguments (each a tensor or None) are ``tensors`` and whose
    other arguments are ``scalars`` (None, bool, int, float, str, torch.dtype, or a tuple of
    them): None where any is of another type, or while torch.compile traces the call."""
    if torch.compiler.is_compiling():
        return None
    key = [torch.is_grad_enabled(), scalars]    # the scalars' values, then their types below
    for t in tensors:
        kind = type(t)
        if kind in _TENSORS:
            key.append((kind, t.dtype, t.shape, t.stride(), t.device, t.requires_grad))
        elif t is None:
            key.append(None)
        else:
            return None
    for s in scalars:
        kind = type(s)
        if kind in _SCALARS:
            key.append(kind)
        elif kind is tuple and all(type(x) in _SCALARS for x in s):
            key.append(tuple(map(type, s)))
        else:
            return None
    return tuple(key)


def meta(t: torch.Tensor | None):
    """What launch metadata can read of ``t``: its dtype, shape, strides and device (None: absent)."""
    return None if t is None else (t.dtype, t.shape, t.stride(), t.device)


def contiguous_strides(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape``, as alloc.empty makes a launcher's outputs
    (a plan computes them from the shape, before the output exists)."""
    return torch.empty(shape, device="meta").stride()


def remember(cache: dict, key, value):
    """``cache[key] = value``, bounded (the dict is emptied when full); returns ``value``."""
    if len(cache) >= _MAX_ENTRIES:
        cache.clear()
    cache[key] = value
    return value
