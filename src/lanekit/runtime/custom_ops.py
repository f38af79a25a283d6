"""Helpers for lanekit's ``torch.library`` custom ops (torch only; no Triton import)."""

from __future__ import annotations

import torch


def custom_op(name: str, mutates_args=()):
    """``torch.library.custom_op``, keeping the plain function callable as ``.direct``."""
    def wrap(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        op.direct = fn
        return op
    return wrap


def call(op, *args, inputs=()):
    """Run a custom op, or its plain function when nothing needs the op: in eager mode with no
    input requiring a gradient, the dispatcher's work (about 20 us of host time per call, longer
    than a norm over a few MB takes on the GPU) buys nothing. torch.compile and autograd go
    through the op."""
    if torch.compiler.is_compiling() or (
            torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)):
        return op(*args)
    return op.direct(*args)
