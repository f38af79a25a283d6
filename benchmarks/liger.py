"""Liger-Kernel as the fused layers' peer: its functional ops with lanekit's argument layouts.

Each adapter returns None when liger-kernel is not importable (or lacks the op), so that a
benchmark drops that peer and runs the others. The functions are ``liger_kernel.transformers
.functional``'s (Liger's own autograd Functions: forward and backward, as a model patched by Liger
runs them).
"""

from __future__ import annotations

import torch


def _functional():
    try:
        from liger_kernel.transformers import functional
    except Exception:  # not installed, or it fails to import on this machine: no Liger peer
        return None
    return functional


def rms_norm(eps: float):
    """(x, w) -> RMSNorm with Llama's casting (fp32 inside, weight applied in the input dtype)."""
    f = _functional()
    if f is None or not hasattr(f, "liger_rms_norm"):
        return None
    return lambda x, w: f.liger_rms_norm(x, w, eps)


def rms_norm_residual(eps: float):
    """(x, w, r) -> (RMSNorm(x + r), x + r), Liger's fused add-RMSNorm where it has one."""
    f = _functional()
    if f is None or not hasattr(f, "liger_fused_add_rms_norm"):
        return None
    return lambda x, w, r: f.liger_fused_add_rms_norm(x, r, w, eps)


def layer_norm(eps: float):
    f = _functional()
    if f is None or not hasattr(f, "liger_layer_norm"):
        return None
    return lambda x, w, b: f.liger_layer_norm(x, w, b, eps)


def rope_qk():
    """(q (B, S, Hq, D), k (B, S, Hkv, D), cos, sin (S, D / 2)) -> (q', k'): Liger's RoPE on q and
    k in one launch. It takes transformers' layout, (B, H, S, D) with (1, S, D) duplicated cos and
    sin: q and k are passed as transposed views, cos and sin are widened once, outside the timing."""
    f = _functional()
    if f is None or not hasattr(f, "liger_rope"):
        return None
    widened = {}

    def run(q, k, cos, sin):
        key = (cos.data_ptr(), sin.data_ptr())
        if key not in widened:
            widened.clear()
            widened[key] = (torch.cat((cos, cos), -1)[None].to(q.dtype).contiguous(),
                            torch.cat((sin, sin), -1)[None].to(q.dtype).contiguous())
        c, s = widened[key]
        q2, k2 = f.liger_rope(q.transpose(1, 2), k.transpose(1, 2), c, s)
        return q2.transpose(1, 2), k2.transpose(1, 2)
    return run


def swiglu():
    f = _functional()
    if f is None or not hasattr(f, "liger_swiglu"):
        return None
    return lambda g, u: f.liger_swiglu(g, u)


def geglu_tanh():
    """Liger's GeGLU (the tanh approximation of GELU, as Gemma's)."""
    f = _functional()
    if f is None or not hasattr(f, "liger_geglu"):
        return None
    return lambda g, u: f.liger_geglu(g, u)
