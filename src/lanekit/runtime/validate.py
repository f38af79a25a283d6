"""Argument checks shared by the public functions: each raises a ValueError or TypeError that
names the argument, the expected and the got, before anything is launched.

The errors are :class:`ArgumentError` and :class:`ArgumentTypeError`: a ValueError and a
TypeError that are RuntimeErrors too, because FlashAttention (whose API lanekit's attention
takes) reports bad arguments with RuntimeError (its C++ TORCH_CHECKs), and code written for it
catches that. ``except ValueError`` and ``except RuntimeError`` both catch them."""

from __future__ import annotations

import functools
import math
import numbers

import numpy as np
import torch

from lanekit.runtime.lanes import select_lane

class ArgumentError(ValueError, RuntimeError):
    """A bad argument value (a shape, a size, a range, a device): catchable as ValueError and, as
    FlashAttention's argument errors are, as RuntimeError."""


class ArgumentTypeError(TypeError, RuntimeError):
    """An argument of the wrong type or dtype: catchable as TypeError and as RuntimeError."""


def argument_errors(fn):
    """Decorate a public function so that the plain ValueError and TypeError its checks raise
    (here, in a family's own checks, or in a launcher's grid check) reach the caller as
    :class:`ArgumentError` and :class:`ArgumentTypeError`: the same message and traceback, and
    catchable as RuntimeError too. Errors of other classes pass unchanged."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError) as e:
            cls = {ValueError: ArgumentError, TypeError: ArgumentTypeError}.get(type(e))
            if cls is None:
                raise
            raise cls(*e.args).with_traceback(e.__traceback__) from None

    return wrapper


# The floating dtypes the Triton lanes take; float64 runs on the reference lane only (lane_for).
LANE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# Python's own float and int answered by type() first: isinstance against numbers' ABCs walks
# their registry (a few microseconds per argument on every call)
def is_real(x) -> bool:
    """A real number (Python's or NumPy's), and not a bool (True would silently mean 1.0)."""
    t = type(x)
    if t is float or t is int:
        return True
    return t is not bool and isinstance(x, numbers.Real) and not isinstance(x, np.bool_)


def real(name: str, value, expected: str, valid=math.isfinite) -> float:
    """``value`` as a Python float: a TypeError unless :func:`is_real` (``eps="1e-5"`` is a wrong
    type, as ``causal=1`` is), a ValueError unless ``valid`` (a predicate on the float; default:
    finite), each saying ``expected``."""
    if not is_real(value):
        raise ArgumentTypeError(f"{name}: expected {expected}, got {type(value).__name__}")
    try:
        x = float(value)
    except OverflowError:      # an int past float's range (10**400): out of every range a caller takes
        x = math.inf if value > 0 else -math.inf
    if not valid(x):
        raise ArgumentError(f"{name}: expected {expected}, got {value!r}")
    return x


def is_int(x) -> bool:
    """An integer: Python's or NumPy's (not a bool: True would silently mean 1), or a 0-d tensor of
    an integer dtype (its value is read back where it is used: on a GPU, one sync). Floats are not
    ints, whatever their value."""
    t = type(x)
    if t is int:
        return True
    if t is bool or t is float:
        return False
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)
    return isinstance(x, numbers.Integral) and not isinstance(x, np.bool_)


def is_flag(x) -> bool:
    """A bool: Python's or NumPy's, or a 0-d torch.bool tensor (never an int, a str or None)."""
    if type(x) is bool:
        return True
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and x.dtype == torch.bool
    return isinstance(x, np.bool_)


def flag(name: str, value) -> bool:
    """``value`` as a Python bool: a TypeError unless :func:`is_flag` (``causal=1`` and
    ``return_attn_probs="no"`` are refused alike)."""
    if not is_flag(value):
        raise ArgumentTypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return bool(value)


def int_at_least(name: str, value, low: int = 0, what: str = "") -> int:
    """``value`` as a Python int: a TypeError unless :func:`is_int`, a ValueError if below ``low``
    (``what`` says where low comes from: " (the longest sequence)")."""
    if not is_int(value):
        raise ArgumentTypeError(f"{name}: expected an int >= {low}{what}, got {type(value).__name__}")
    value = int(value)
    if value < low:
        raise ArgumentError(f"{name}: expected an int >= {low}{what}, got {value!r}")
    return value


def int_in(name: str, value, low: int, high: int, what: str = "") -> int:
    """``value`` as a Python int: a TypeError unless :func:`is_int`, a ValueError outside
    [low, high] (``what`` says where the bounds come from)."""
    if not is_int(value):
        raise ArgumentTypeError(f"{name}: expected an int in [{low}, {high}]{what}, got {type(value).__name__}")
    value = int(value)
    if not low <= value <= high:
        raise ArgumentError(f"{name}: expected an int in [{low}, {high}]{what}, got {value!r}")
    return value


def _one_int(x):
    """x as a Python int if it is one integer (:func:`is_int`, or a 1-element tensor or NumPy
    array of an integer dtype), else None. A tensor's value is read back (on a GPU, one sync)."""
    if isinstance(x, np.ndarray):
        x = x.reshape(-1)[0] if x.size == 1 and x.dtype.kind in "iu" else None
    elif isinstance(x, torch.Tensor) and x.numel() == 1 and x.dim() <= 1:
        x = x.reshape(())
    return int(x) if x is not None and is_int(x) else None


def int_pair(name: str, value, what: str = "") -> tuple[int, int]:
    """``value`` as a pair of Python ints, taking what FlashAttention takes for a pair such as
    ``window_size``: a tuple or list of two integers (Python's, NumPy's, or 0-d / 1-element
    integer tensors), or a tensor or NumPy array of two integers (``torch.randint(0, S, (2,))``;
    read back: on a GPU, one sync). A TypeError for anything else (floats and bools are not ints,
    whatever their value); ranges are the caller's. ``what`` names the pair: " (left, right)"."""
    if isinstance(value, torch.Tensor) and tuple(value.shape) == (2,):
        integer = not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool)
        items = value.tolist() if integer else None   # both values in one read
    elif isinstance(value, np.ndarray) and value.shape == (2,):
        items = value.tolist() if value.dtype.kind in "iu" else None
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        items = list(value)
    else:
        items = None
    pair = [_one_int(x) for x in items] if items is not None else [None]
    if None in pair:
        raise ArgumentTypeError(f"{name}: expected a pair of ints{what} (a tuple, list, tensor or array of "
                                f"two), got {value!r}")
    return pair[0], pair[1]


def device(name: str, value) -> torch.device:
    """``value`` (a str such as "cuda:1", or a torch.device) as a torch.device this process can
    allocate on: a TypeError for another type, a ValueError naming the device for a name torch
    does not know, a backend with no device here (CUDA or ROCm, say, with no GPU visible) or an
    index past the devices there are."""
    if not isinstance(value, (str, torch.device)):
        raise ArgumentTypeError(f"{name}: expected a str or torch.device, got {type(value).__name__}")
    try:
        dev = torch.device(value)
    except RuntimeError:
        raise ArgumentError(f"{name}: expected a device name such as 'cpu', 'cuda' or 'cuda:1', got {value!r}") from None
    backend = getattr(torch, dev.type, None) if dev.type not in ("cpu", "meta") else None
    if backend is not None and hasattr(backend, "is_available") and hasattr(backend, "device_count"):
        if not backend.is_available():
            raise ArgumentError(f"{name}: expected a device this machine has, got {str(dev)!r} "
                             f"(torch.{dev.type}.is_available() is False: no such device is visible)")
        if dev.index is not None and dev.index >= backend.device_count():
            raise ArgumentError(f"{name}: expected a device this machine has, got {str(dev)!r} "
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
        raise ArgumentError(f"{name}: expected a tensor whose elements do not share memory, got strides "
                         f"{out.stride()} for shape {tuple(out.shape)} (an expanded view)")
    span = None
    storage = out.untyped_storage().data_ptr()
    for t in inputs:
        if t is None or t.untyped_storage().data_ptr() != storage or t.numel() == 0:
            continue
        lo, hi = span = span or _span(out)   # only where an input shares out's memory
        same = t.data_ptr() == out.data_ptr() and t.shape == out.shape and t.stride() == out.stride()
        t_lo, t_hi = _span(t)
        if not same and t_lo <= hi and lo <= t_hi:
            raise ArgumentError(f"{name}: expected memory that the inputs do not overlap (or exactly an "
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
            raise ArgumentError(f"{name}: expected memory of its own (both are written), got the memory "
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
        raise ArgumentError(f"{name}: expected a tensor that can be written in place ({what}), got an "
                         "inference tensor outside torch.inference_mode() (PyTorch refuses in-place "
                         "writes to it); clone it, or call under torch.inference_mode()")
    if not (torch.is_grad_enabled() and t.requires_grad):
        return
    fix = f"pass a tensor that does not require grad, call under torch.no_grad(), or drop {what}"
    if not differentiable:
        raise ArgumentError(f"{name}: expected a tensor that does not require grad ({what} writes it, and "
                         f"that write is not differentiable), got requires_grad=True; {fix}")
    if t._is_view():
        try:
            origin = str(torch._C._autograd._get_creation_meta(t)).rpartition(".")[2]
        except RuntimeError:  # a view autograd keeps no record of (not differentiable)
            origin = ""
        if origin in _VIEW_ORIGINS:
            raise ArgumentError(f"{name}: expected a tensor autograd lets be written in place ({what}), got a "
                             f"view {_VIEW_ORIGINS[origin]} (PyTorch refuses in-place writes to it); {fix}")
        if t._base.is_leaf:
            raise ArgumentError(f"{name}: expected a tensor autograd lets be written in place ({what}), got a "
                             f"view of a leaf that requires grad (PyTorch refuses in-place writes to it); {fix}")
    elif t.is_leaf:
        raise ArgumentError(f"{name}: expected a tensor autograd lets be written in place ({what}), got a "
                         f"leaf that requires grad (PyTorch refuses in-place writes to it); {fix}")


def tensor(name: str, t, *, dtypes=None, ndim=None, like: torch.Tensor | None = None,
           like_name: str | None = None, like_dtype: bool = False):
    """Check that t is a tensor (a TypeError), of an accepted dtype (a TypeError) and rank (an int
    or a tuple of them; a ValueError), on ``like``'s device (a ValueError). ``like_name`` names
    like in the device error ("expected the device of q"); with ``like_dtype``, t must also have
    like's dtype (a TypeError naming like_name). Reads only metadata."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:   # sparse or nested: no strides for a kernel to read
        raise ArgumentTypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if like_dtype and t.dtype != like.dtype:
        raise ArgumentTypeError(f"{name}: expected the dtype of {like_name} ({like.dtype}), got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ArgumentTypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if ndims is not None and t.dim() not in ndims:
        raise ArgumentError(f"{name}: expected {' or '.join(map(str, ndims))} dimensions, got shape {tuple(t.shape)}")
    if like is not None and t.device != like.device:
        if like_name is not None:
            raise ArgumentError(f"{name}: expected the device of {like_name} ({like.device}), got {t.device}")
        raise ArgumentError(f"{name}: expected a tensor on {like.device} (the input's device), got {t.device}")


def shape(name: str, t: torch.Tensor, expected: tuple, what: str):
    if tuple(t.shape) != tuple(expected):
        raise ArgumentError(f"{name}: expected shape {tuple(expected)} ({what}), got {tuple(t.shape)}")


def lane_for(x: torch.Tensor, lane: str | None, name: str = "x", chosen: str | None = None) -> str:
    """The lane that runs an op on ``x``: :func:`lanekit.runtime.lanes.select_lane` on x's device
    (the call's ``lane``, then LANEKIT_LANE, then the device), or ``chosen`` where the caller has
    selected it already. A float64 ``x`` runs on the reference lane only: elsewhere a TypeError
    naming ``name``."""
    if chosen is None:
        chosen = select_lane(x.device, lane)
    if x.dtype == torch.float64 and chosen != "reference":
        raise ArgumentTypeError(f"{name}: expected dtype in {[str(d) for d in LANE_DTYPES]} on the {chosen} lane, got "
                        "torch.float64 (float64 runs on the reference lane only: lane='reference')")
    return chosen
