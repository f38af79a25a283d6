"""Helpers for lanekit's ``torch.library`` custom ops (torch only; no Triton import)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def custom_op(name: str, mutates_args=()):
    """``torch.library.custom_op``, keeping the plain function callable as ``.direct``."""
    def wrap(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        op.direct = fn
        return op
    return wrap


def _needs_grad(inputs) -> bool:
    if not torch.is_grad_enabled():
        return False
    for t in inputs:
        if t is not None and t.requires_grad:
            return True
    return False


_PLAIN = (torch.Tensor, torch.nn.Parameter)
# the argument types that are never a traced tensor: checked by type() first, since isinstance on
# torch.Tensor goes through its metaclass (a cost per argument on every eager call)
_NOT_TRACED = frozenset({torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, str, torch.dtype})


def _traced(args) -> bool:
    """Whether the call is being traced or transformed (torch.compile, make_fx, AOT autograd,
    fake or functional tensors, a dispatch mode): then only the op itself is right."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return True
    for a in args:
        if type(a) not in _NOT_TRACED and isinstance(a, torch.Tensor):
            return True
    return False


def call(op, *args, inputs=()):
    """Run a custom op, or its plain function when nothing needs the op: in eager mode with no
    input requiring a gradient, the dispatcher's work (about 20 us of host time per call, longer
    than a norm over a few MB takes on the GPU) buys nothing. Eager training goes through an
    ``autograd.Function`` built from the op's own registered autograd (:func:`eager_function`),
    which calls the plain function too; torch.compile, tracing and tensor subclasses go through
    the op."""
    if _traced(args):
        return op(*args)
    if _needs_grad(inputs):
        fn = eager_function(op)
        return fn.apply(*args) if fn is not None else op(*args)
    return op.direct(*args)


_EAGER: dict[int, type | None] = {}


def eager_function(op) -> type | None:
    """An ``autograd.Function`` that runs ``op.direct`` forward and the backward registered with
    ``op.register_autograd`` (its setup_context and backward, unchanged), skipping the dispatcher
    in eager training, as torch.library's own generated Function does below it. None for an op
    with no registered autograd or one that mutates an input (those go through the op)."""
    key = id(op)
    if key in _EAGER:
        return _EAGER[key]
    backward_fn = getattr(op, "_backward_fn", None)
    setup_fn = getattr(op, "_setup_context_fn", None)
    mutates = any(a.alias_info is not None and a.alias_info.is_write
                  for a in op._opoverload._schema.arguments)
    fn = None
    if backward_fn is not None and setup_fn is not None and not mutates and hasattr(op, "direct"):
        def forward(ctx, *args):
            out = op.direct(*args)
            setup_fn(ctx=ctx, inputs=args, output=out)
            return out

        def backward(ctx, *grads):
            return backward_fn(ctx, *grads)

        fn = type(f"Eager_{op._name.replace('::', '_')}", (torch.autograd.Function,),
                  {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    _EAGER[key] = fn
    return fn
