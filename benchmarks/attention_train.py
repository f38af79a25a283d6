"""Attention forward + backward (a training step's attention): lanekit beside PyTorch SDPA's flash
and cuDNN backends, same run.

Shapes (issue 3): bf16, D in {64, 128}, Sq = Sk in {1k, 4k, 16k}, causal and not, B * S = 16k
tokens, 2048 / D heads. FLOPs counted as FlashAttention's benchmark does: the forward's
4 * B * H * S^2 * D times 3.5 (the backward is 2.5 forwards), halved when causal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import lanekit
from benchmarks import attention
from lanekit.reference import attention as ref
from lanekit.testing import upcast

cases = attention.cases


def name(c) -> str:
    return "fwd+bwd" + attention.name(c)[3:]


def flops(c) -> float:
    return 3.5 * attention.flops(c)


def make_inputs(c, device="cuda"):
    q, k, v = attention.make_inputs(c, device)
    g = torch.Generator(device=device).manual_seed(1)
    dout = torch.randn(q.shape, generator=g, device=device, dtype=q.dtype)
    return [t.requires_grad_() for t in (q, k, v)] + [dout]


def _step(c, q, k, v, dout):
    out = lanekit.flash_attn_func(q, k, v, causal=c["causal"])
    return torch.autograd.grad(out, (q, k, v), dout)


def check(c, q, k, v, dout) -> str | None:
    """lanekit's dq, dk, dv on batch 0, head 0 (heads and batches are independent, so a slice of
    the problem is the same problem) against the float64 oracle's, by FlashAttention's rule for
    gradients: at most three times the error of the same computation done by PyTorch in bf16.
    (The fixed step bound of the tolerance table is for the registered samples' short rows; over
    thousands of keys the error of any bf16 computation grows past it.) Returns an error or None."""
    got = _step(c, q, k, v, dout)
    one = [t.detach()[:1, :, :1] for t in (q, k, v, dout)]
    kw = dict(softmax_scale=c["D"] ** -0.5, window_size=(-1, 0 if c["causal"] else -1))
    exact = ref.flash_attn_backward(*(upcast(t) for t in (one[3], *one[:3])), **kw)
    same = ref.flash_attn_backward(one[3], *one[:3], **kw)
    for label, g, e, s in zip(("dq", "dk", "dv"), got, exact, same):
        err = (g[:1, :, :1].double() - e).abs().max().item()
        same_err = (s.double() - e).abs().max().item()
        if not err <= 3 * same_err:
            return f"{label}: largest error {err:.3g} > 3 x PyTorch bf16's {same_err:.3g}"
    return None


def runners(c, q, k, v, dout):
    """name -> zero-argument callable running forward and backward, for lanekit and each peer."""
    qt, kt, vt, dt = (t.transpose(1, 2) for t in (q, k, v, dout))  # SDPA's (B, H, S, D) views

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=c["causal"])
                return torch.autograd.grad(out, (q, k, v), dt)
        return run

    return {
        "lanekit": lambda: _step(c, q, k, v, dout),
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
    }
