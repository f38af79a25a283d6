"""Kernel launches with Triton's per-call argument binding cached: ``launch(kernel, grid, ...)``
is ``kernel[grid](...)``, with less host time on a GPU.

Every ``kernel[grid](*args, **kwargs)`` runs Triton's ``JITFunction.run``: it binds each argument
(a specialization per argument: dtype and 16-byte alignment of a pointer, divisibility of an int),
builds the kernel cache's key from them, looks the compiled kernel up and only then calls its
launcher. For a kernel of 40 arguments that binding costs more host time than the rest of a fused
layer's call (measured on a CPU: about 30 us a call with the norm kernel's 41 parameters). Here the
first launch of a specialization goes through Triton unchanged and its compiled kernel is kept
under a key that determines that specialization: the device, every argument's type, and for a
tensor its dtype and whether its address is a multiple of 16, for anything else its value (so
ints are keyed more finely than Triton's divisibility classes: never less). A later launch with
the same key calls the compiled kernel's launcher directly, as ``JITFunction.run`` itself does
after its lookup.

On by default; ``LANEKIT_FAST_LAUNCH=0`` (read once, at the first launch) turns it off, and every
launch is then ``kernel[grid](...)``. It was written against Triton 3.6's ``JITFunction.run``,
tested here with stand-ins for Triton's launcher, and run natively on an H100 (2026-12-07): the
test suite through it (the 1750 tests that ran before the call's time ran out: every failure was
one of the suite's own, and the same without the shortcut) and the eager benchmark, each case
checked against its oracle (flash_attn_func 183 -> 85 us a call, rms_norm 77 -> 63 us).

Only NVIDIA GPUs take the shortcut (AMD's backend specializes a pointer on the size of its buffer
too, which is not in the key), only when no launch hook is set (profilers add one: they get
Triton's own path), and never under Triton's interpreter or while ``lanekit export`` intercepts
launches (``JITFunction.run`` patched): those run ``kernel[grid](...)`` as written.
"""

from __future__ import annotations

import os

import torch

# tensors keyed by dtype and alignment (a type() lookup: isinstance on torch.Tensor costs a metaclass
# check per argument); another subclass would be keyed as itself: such a launch is never kept
Tensor = torch.Tensor
_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})

_MAX_ENTRIES = 512      # per kernel: an int argument that changes every call must not grow it forever

_JIT = None             # (JITFunction, its original run, triton.knobs.runtime, triton's driver, ok), on first use
_KERNELS: dict[int, "_Kernel"] = {}


class _Kernel:
    """One JITFunction's order of parameters (for the launcher, which takes every parameter,
    constexprs included, positionally) and its compiled kernels by key."""

    __slots__ = ("names", "defaults", "compiled")

    def __init__(self, kernel):
        self.names = tuple(kernel.arg_names)
        self.defaults = {p.name: p.default for p in kernel.params if p.has_default}
        self.compiled: dict = {}


def _jit():
    """The fast path's fixed facts, found once: None (and nothing kept) while JITFunction.run is
    not Triton's own (``lanekit export`` intercepts launches by replacing it)."""
    global _JIT
    if _JIT is None:
        from triton import knobs
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction

        if JITFunction.run.__qualname__ != "JITFunction.run":
            return None
        enabled = os.environ.get("LANEKIT_FAST_LAUNCH", "1") != "0"
        _JIT = (JITFunction, JITFunction.run, knobs.runtime, driver,
                enabled and not getattr(torch.version, "hip", None))
    return _JIT


def _hooked(hook) -> bool:
    """Whether a launch hook is set: Triton 3.6's are chains (``knobs.HookChain``), empty unless a
    profiler adds to them; the launcher is given None for an empty one (nothing to call)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _device_and_stream(driver):
    """The current device and its current stream, as ``JITFunction.run`` asks for them."""
    device = driver.active.get_current_device()
    return device, driver.active.get_current_stream(device)


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, binding the arguments once per specialization (module
    doc). ``grid`` is a tuple of up to three ints."""
    facts = _JIT or _jit()
    if facts is None:
        kernel[grid](*args, **kwargs)
        return
    jit_cls, original_run, runtime, driver, platform_ok = facts
    if (type(kernel) is not jit_cls or not platform_ok or jit_cls.run is not original_run or kernel.pre_run_hooks
            or _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook) or callable(grid)):
        kernel[grid](*args, **kwargs)
        return
    info = _KERNELS.get(id(kernel))
    if info is None:
        info = _KERNELS[id(kernel)] = _Kernel(kernel)
    device, stream = _device_and_stream(driver)
    try:
        # what decides Triton's specialization, and more (the module's doc)
        key = (device, len(args), *map(type, args), *map(type, kwargs.values()), *kwargs,
               *[a if type(a) not in _TENSORS else (a.dtype, a.data_ptr() & 15 == 0) for a in args],
               *[a if type(a) not in _TENSORS else (a.dtype, a.data_ptr() & 15 == 0) for a in kwargs.values()])
        hit = info.compiled.get(key)
    except TypeError:   # an argument that cannot be a key (unhashable): Triton's own path
        kernel[grid](*args, **kwargs)
        return
    g0 = grid[0]
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    if hit is not None:
        run, function, packed = hit
        tail = [kwargs[n] if n in kwargs else info.defaults[n] for n in info.names[len(args):]]
        run(g0, g1, g2, stream, function, packed, None, None, None, *args, *tail)
        return
    compiled = kernel[grid](*args, **kwargs)
    if compiled is None or not hasattr(compiled, "packed_metadata") or any(isinstance(a, Tensor) for a in key):
        return   # (a tensor in the key: a subclass, which would be held here and never hit)
    if len(info.compiled) >= _MAX_ENTRIES:
        info.compiled.clear()
    info.compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata)
