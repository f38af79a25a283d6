"""Attention forward cases: lanekit beside PyTorch SDPA's flash and cuDNN backends, same run.

Shapes (issue 2): bf16, D in {64, 128}, Sq = Sk in {1k, 4k, 16k}, causal and not, B * S = 16k
tokens, 2048 / D heads. FLOPs counted as FlashAttention does: 4 * B * H * Sq * Sk * D, halved
when causal. A case may name another dtype (benchmarks.attention_fp32's do); fp32 cases have SDPA's
memory-efficient backend as their peer, as the flash and cuDNN backends take 16-bit inputs only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import lanekit
from lanekit.attention.registry import ATTENTION_FWD
from lanekit.reference import attention as ref
from lanekit.testing import compare, upcast

TOKENS = 16 * 1024


def cases(quick: bool = False):
    for D in (64, 128):
        for S in ((1024, 4096) if quick else (1024, 4096, 16384)):
            for causal in (False, True):
                yield dict(D=D, S=S, causal=causal, B=TOKENS // S, H=2048 // D)


def name(c) -> str:
    dtype = f" {str(c['dtype']).removeprefix('torch.')}" if "dtype" in c else ""
    return f"fwd D={c['D']} S={c['S']} B={c['B']} H={c['H']} {'causal' if c['causal'] else 'full'}{dtype}"


def flops(c) -> float:
    f = 4 * c["B"] * c["H"] * c["S"] * c["S"] * c["D"]
    return f / 2 if c["causal"] else f


def make_inputs(c, device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    shape = (c["B"], c["S"], c["H"], c["D"])
    dtype = c.get("dtype", torch.bfloat16)
    return [torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(3)]


def check(c, q, k, v) -> str | None:
    """lanekit against the float64 oracle on the last 128 query rows of batch 0 (bottom-right
    aligned, so the causal mask is the same as in the full problem). Returns an error or None."""
    out = lanekit.flash_attn_func(q, k, v, causal=c["causal"])
    rows = slice(c["S"] - 128, c["S"])
    expected, _ = ref.flash_attn(upcast(q[:1, rows]), upcast(k[:1]), upcast(v[:1]),
                                 softmax_scale=c["D"] ** -0.5, window_size=(-1, 0 if c["causal"] else -1))
    result = compare(out[:1, rows], expected, ATTENTION_FWD)
    return None if result.ok else result.detail


def runners(c, q, k, v):
    """name -> zero-argument callable, for lanekit and each peer."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA's (B, H, S, D) views, no copy

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=c["causal"])
        return run

    if q.dtype == torch.float32:
        peers = {"sdpa-efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION)}
    else:
        peers = {"sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
    return {"lanekit": lambda: lanekit.flash_attn_func(q, k, v, causal=c["causal"]), **peers}
