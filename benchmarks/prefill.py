"""Prefill of a packed batch: lanekit.flash_attn_varlen_func beside lanekit.flash_attn_func on the
same total tokens (a dense (B, S) batch of equal lengths) and SDPA's flash backend on that dense
batch. bf16, 32 query heads and 8 KV heads of 128, causal, 16k tokens as 8 x 2048 and as 4 x 4096;
FLOPs = 2 * 2 * tokens * S * Hq * D / 2 (causal). The varlen batch is the dense one packed, so the
work is identical and the ratio is the cost of the packing. Timed replaying CUDA graphs (the GPU's
time): in eager mode flash_attn_varlen_func also reads cu_seqlens back to validate them, a device
sync that a graph capture skips.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import lanekit
from lanekit.testing import compare

HQ, HKV, D = 32, 8, 128
CUDA_GRAPHS = True
BF16 = torch.bfloat16


def cases(quick: bool = False):
    yield dict(B=8, S=2048)
    if not quick:
        yield dict(B=4, S=4096)


def name(c) -> str:
    return f"prefill varlen {c['B']} x {c['S']} causal"


def flops(c) -> float:
    return 4 * c["B"] * c["S"] * c["S"] * HQ * D / 2


def make_inputs(c, device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    Bn, S = c["B"], c["S"]
    q = torch.randn(Bn, S, HQ, D, generator=g, device=device, dtype=BF16)
    k = torch.randn(Bn, S, HKV, D, generator=g, device=device, dtype=BF16)
    v = torch.randn(Bn, S, HKV, D, generator=g, device=device, dtype=BF16)
    cu = torch.arange(0, (Bn + 1) * S, S, dtype=torch.int32, device=device)
    return [q, k, v, cu]


def check(c, q, k, v, cu) -> str | None:
    """The packed batch gives the dense batch's output."""
    S = c["S"]
    packed = lanekit.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, S, S,
                                            causal=True)
    dense = lanekit.flash_attn_func(q, k, v, causal=True)
    result = compare(packed, dense.flatten(0, 1).double(), "exact")
    return None if result.ok else result.detail


def runners(c, q, k, v, cu):
    S = c["S"]
    qp, kp, vp = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def sdpa_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

    return {
        "lanekit": lambda: lanekit.flash_attn_varlen_func(qp, kp, vp, cu, cu, S, S, causal=True),
        "flash_attn_func": lambda: lanekit.flash_attn_func(q, k, v, causal=True),
        "sdpa-flash": sdpa_flash,
    }
