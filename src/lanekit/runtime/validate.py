"""Argument checks shared by the public functions: each raises a ValueError or TypeError that
names the argument, the expected and the got, before anything is launched."""

from __future__ import annotations

import numbers

import numpy as np
import torch

from lanekit.runtime.lanes import select_lane

# The floating dtypes the Triton lanes take; float64 runs on the reference lane only (lane_for).
LANE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_real(x) -> bool:
    """A real number (Python's or NumPy's), and not a bool (True would silently mean 1.0)."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def is_int(x) -> bool:
    """An integer: Python's or NumPy's (not a bool: True would silently mean 1), or a 0-d tensor of
    an integer dtype (its value is read back where it is used: on a GPU, one sync). Floats are not
    ints, whatever their value."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def is_flag(x) -> bool:
    """A bool: Python's or NumPy's, or a 0-d torch.bool tensor (never an int, a str or None)."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and x.dtype == torch.bool
    return isinstance(x, (bool, np.bool_))


def flag(name: str, value) -> bool:
    """``value`` as a Python bool: a TypeError unless :func:`is_flag` (``causal=1`` and
    ``return_attn_probs="no"`` are refused alike)."""
    if not is_flag(value):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return bool(value)


def int_at_least(name: str, value, low: int = 0, what: str = "") -> int:
    """``value`` as a Python int: a TypeError unless :func:`is_int`, a ValueError if below ``low``
    (``what`` says where low comes from: " (the longest sequence)")."""
    if not is_int(value):
        raise TypeError(f"{name}: expected an int >= {low}{what}, got {type(value).__name__}")
    value = int(value)
    if value < low:
        raise ValueError(f"{name}: expected an int >= {low}{what}, got {value!r}")
    return value


def int_in(name: str, value, low: int, high: int, what: str = "") -> int:
    """``value`` as a Python int: a TypeError unless :func:`is_int`, a ValueError outside
    [low, high] (``what`` says where the bounds come from)."""
    if not is_int(value):
        raise TypeError(f"{name}: expected an int in [{low}, {high}]{what}, got {type(value).__name__}")
    value = int(value)
    if not low <= value <= high:
        raise ValueError(f"{name}: expected an int in [{low}, {high}]{what}, got {value!r}")
    return value


def device(name: str, value) -> torch.device:
    """``value`` (a str such as "cuda:1", or a torch.device) as a torch.device this process can
    allocate on: a TypeError for another type, a ValueError naming the device for a name torch
    does not know, a backend with no device here (CUDA or ROCm, say, with no GPU visible) or an
    index past the devices there are."""
    if not isinstance(value, (str, torch.device)):
        raise TypeError(f"{name}: expected a str or torch.device, got {type(value).__name__}")
    try:
        dev = torch.device(value)
    except RuntimeError:
        raise ValueError(f"{name}: expected a device name such as 'cpu', 'cuda' or 'cuda:1', got {value!r}") from None
    backend = getattr(torch, dev.type, None) if dev.type not in ("cpu", "meta") else None
    if backend is not None and hasattr(backend, "is_available") and hasattr(backend, "device_count"):
        if not backend.is_available():
            raise ValueError(f"{name}: expected a device this machine has, got {str(dev)!r} "
                             f"(torch.{dev.type}.is_available() is False: no such device is visible)")
        if dev.index is not None and dev.index >= backend.device_count():
            raise ValueError(f"{name}: expected a device this machine has, got {str(dev)!r} "
                             f"(torch.{dev.type}.device_count() is {backend.device_count()})")
    return dev


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last] byte of t's elements in memory."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    first = t.data_ptr() + min(0, last) * t.element_size()
    return first, t.data_ptr() + max(0, last) * t.element_size() + t.element_size() - 1


def check_writable(name: str, out: torch.Tensor, *inputs: torch.Tensor | None):
    """out can be written element by element: no two of its elements share memory, and it either
    is exactly one of the inputs (the same elements) or shares no memory with any of them."""
    if out.numel() == 0:
        return
    if any(st == 0 and n > 1 for n, st in zip(out.shape, out.stride())):
        raise ValueError(f"{name}: expected a tensor whose elements do not share memory, got strides "
                         f"{out.stride()} for shape {tuple(out.shape)} (an expanded view)")
    lo, hi = _span(out)
    for t in inputs:
        if t is None or t.numel() == 0 or t.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
            continue
        same = t.data_ptr() == out.data_ptr() and t.shape == out.shape and t.stride() == out.stride()
        t_lo, t_hi = _span(t)
        if not same and t_lo <= hi and lo <= t_hi:
            raise ValueError(f"{name}: expected memory that the inputs do not overlap (or exactly an "
                             f"input), got a view that partly overlaps one of them")


def check_outputs(outputs: tuple[tuple[str, torch.Tensor | None], ...], *inputs: torch.Tensor | None) -> None:
    """The tensors one call writes, as (name, tensor) pairs (None: not written): each passes
    check_writable against the inputs, and no two start at the same element (one tensor passed
    for two outputs, or views of it that start together, would have elements written twice).
    Outputs that start apart are not compared further: the k and v halves of one (..., 2, Hkv, D)
    or (2, num_blocks, ...) buffer pass, and so would views made to overlap partway."""
    first = {}
    for name, t in outputs:
        if t is None or t.numel() == 0:
            continue
        check_writable(name, t, *inputs)
        if t.data_ptr() in first:
            raise ValueError(f"{name}: expected memory of its own (both are written), got the memory "
                             f"of {first[t.data_ptr()]}")
        first[t.data_ptr()] = name


_VIEW_ORIGINS = {"NO_GRAD_MODE": "created under torch.no_grad()",
                 "MULTI_OUTPUT_NODE": "one of several views one call returned (unbind, split, chunk)",
                 "INFERENCE_MODE": "created under torch.inference_mode()",
                 "IN_CUSTOM_FUNCTION": "returned by a custom autograd Function"}


def check_inplace(name: str, t: torch.Tensor, what: str, *, differentiable: bool = True) -> None:
    """``t`` may be written in place by a call (``what`` names the option that writes it:
    "inplace=True", "out=", "the append of k, v"): a ValueError where PyTorch's autograd would
    refuse the write, said before anything runs (a kernel launched first would change t and
    autograd raise after). Refused: an inference tensor outside torch.inference_mode(); with
    grad mode on and t requiring grad, a leaf (a parameter, say), a view of a leaf, or a view
    autograd cannot rebase (made under no_grad, or one of several views of one call); and,
    where the write is not ``differentiable`` (a cache append, an out= result), any t that
    requires grad, whose gradient would silently be wrong. Reads only metadata."""
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(f"{name}: expected a tensor that can be written in place ({what}), got an "
                         "inference tensor outside torch.inference_mode() (PyTorch refuses in-place "
                         "writes to it); clone it, or call under torch.inference_mode()")
    if not (torch.is_grad_enabled() and t.requires_grad):
        return
    fix = f"pass a tensor that does not require grad, call under torch.no_grad(), or drop {what}"
    if not differentiable:
        raise ValueError(f"{name}: expected a tensor that does not require grad ({what} writes it, and "
                         f"that write is not differentiable), got requires_grad=True; {fix}")
    if t._is_view():
        try:
            origin = str(torch._C._autograd._get_creation_meta(t)).rpartition(".")[2]
        except RuntimeError:  # a view autograd keeps no record of (not differentiable)
            origin = ""
        if origin in _VIEW_ORIGINS:
            raise ValueError(f"{name}: expected a tensor autograd lets be written in place ({what}), got a "
                             f"view {_VIEW_ORIGINS[origin]} (PyTorch refuses in-place writes to it); {fix}")
        if t._base.is_leaf:
            raise ValueError(f"{name}: expected a tensor autograd lets be written in place ({what}), got a "
                             f"view of a leaf that requires grad (PyTorch refuses in-place writes to it); {fix}")
    elif t.is_leaf:
        raise ValueError(f"{name}: expected a tensor autograd lets be written in place ({what}), got a "
                         f"leaf that requires grad (PyTorch refuses in-place writes to it); {fix}")


def tensor(name: str, t, *, dtypes=None, ndim=None, like: torch.Tensor | None = None,
           like_name: str | None = None, like_dtype: bool = False):
    """Check that t is a tensor (a TypeError), of an accepted dtype (a TypeError) and rank (an int
    or a tuple of them; a ValueError), on ``like``'s device (a ValueError). ``like_name`` names
    like in the device error ("expected the device of q"); with ``like_dtype``, t must also have
    like's dtype (a TypeError naming like_name). Reads only metadata."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if like_dtype and t.dtype != like.dtype:
        raise TypeError(f"{name}: expected the dtype of {like_name} ({like.dtype}), got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if ndims is not None and t.dim() not in ndims:
        raise ValueError(f"{name}: expected {' or '.join(map(str, ndims))} dimensions, got shape {tuple(t.shape)}")
    if like is not None and t.device != like.device:
        if like_name is not None:
            raise ValueError(f"{name}: expected the device of {like_name} ({like.device}), got {t.device}")
        raise ValueError(f"{name}: expected a tensor on {like.device} (the input's device), got {t.device}")


def shape(name: str, t: torch.Tensor, expected: tuple, what: str):
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} ({what}), got {tuple(t.shape)}")


def lane_for(x: torch.Tensor, lane: str | None, name: str = "x") -> str:
    """The lane that runs an op on ``x``: :func:`lanekit.runtime.lanes.select_lane` on x's device
    (the call's ``lane``, then LANEKIT_LANE, then the device). A float64 ``x`` runs on the
    reference lane only: elsewhere a TypeError naming ``name``."""
    chosen = select_lane(x.device, lane)
    if x.dtype == torch.float64 and chosen != "reference":
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in LANE_DTYPES]} on the {chosen} lane, got "
                        "torch.float64 (float64 runs on the reference lane only: lane='reference')")
    return chosen
