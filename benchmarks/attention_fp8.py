"""fp8 attention forward (and sinks): lanekit's e4m3 with descales beside its own bf16 and PyTorch
SDPA's flash backend on bf16 copies of the same values, same run.

No fp8 peer is installed on the GPU machine (FlashAttention-3's fp8 is a separate build), so the
ratios are against bf16 attention of the same shape: what fp8 buys over the 16-bit path. Shapes:
D in {64, 128}, Sq = Sk in {4k, 16k}, causal and not, 16k tokens, 2048 / D heads; and a gpt-oss
style case, bf16 with sinks (64 heads over 8 KV heads, D 64, window 128 and full). FLOPs as
benchmarks.attention counts them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import lanekit
from lanekit.attention.registry import ATTENTION_FP8, ATTENTION_FWD
from lanekit.reference import attention as ref
from lanekit.testing import compare, upcast

TOKENS = 16 * 1024


def cases(quick: bool = False):
    for D in (64, 128):
        for S in ((4096,) if quick else (4096, 16384)):
            for causal in (False, True):
                yield dict(D=D, S=S, causal=causal, B=TOKENS // S, H=2048 // D, Hkv=2048 // D, fp8=True)
    for window in (128, -1):
        yield dict(D=64, S=4096, causal=True, B=4, H=64, Hkv=8, fp8=False, sinks=True, window=window)


def name(c) -> str:
    kind = "e4m3" if c["fp8"] else "bf16 sinks" + (f" window {c['window']}" if c.get("window", -1) >= 0 else "")
    return (f"fwd {kind} D={c['D']} S={c['S']} B={c['B']} H={c['H']}/{c['Hkv']} "
            f"{'causal' if c['causal'] else 'full'}")


def flops(c) -> float:
    f = 4 * c["B"] * c["H"] * c["S"] * c["S"] * c["D"]
    if c.get("window", -1) >= 0:
        return 4 * c["B"] * c["H"] * c["S"] * (c["window"] + 1) * c["D"]
    return f / 2 if c["causal"] else f


def make_inputs(c, device="cuda"):
    """q, k, v: e4m3 codes with (B, Hkv) descales (fp8 cases), or bf16 with (H,) sinks."""
    g = torch.Generator(device=device).manual_seed(0)
    B, S, H, Hkv, D = c["B"], c["S"], c["H"], c["Hkv"], c["D"]
    q = torch.randn((B, S, H, D), generator=g, device=device)
    k, v = (torch.randn((B, S, Hkv, D), generator=g, device=device) for _ in range(2))
    if not c["fp8"]:
        return [q.bfloat16(), k.bfloat16(), v.bfloat16(), torch.randn(H, generator=g, device=device)]
    d = [torch.full((B, Hkv), 1 / 64, device=device) for _ in range(3)]
    return [(t * 64).to(torch.float8_e4m3fn) for t in (q, k, v)] + d


def _kwargs(c, extra):
    if c["fp8"]:
        return dict(q_descale=extra[0], k_descale=extra[1], v_descale=extra[2])
    return dict(sinks=extra[0], window_size=(c["window"], 0) if c["window"] >= 0 else (-1, -1))


def check(c, q, k, v, *extra) -> str | None:
    """lanekit against the float64 oracle on the last 128 query rows of batch 0."""
    out = lanekit.flash_attn_func(q, k, v, causal=c["causal"], **_kwargs(c, extra))
    rows = slice(c["S"] - 128, c["S"])
    kw = dict(softmax_scale=c["D"] ** -0.5, window_size=(c.get("window", -1), 0 if c["causal"] else -1))
    if c["fp8"]:
        expected, _ = ref.flash_attn_quantized(q[:1, rows], k[:1], v[:1], q_descale=extra[0][:1],
                                               k_descale=extra[1][:1], v_descale=extra[2][:1], **kw)
        result = compare(out[:1, rows], expected, ATTENTION_FP8)
    else:
        expected, _ = ref.flash_attn(upcast(q[:1, rows]), upcast(k[:1]), upcast(v[:1]), sinks=upcast(extra[0]), **kw)
        result = compare(out[:1, rows], expected, ATTENTION_FWD)
    return None if result.ok else result.detail


def runners(c, q, k, v, *extra):
    """name -> zero-argument callable: lanekit's fp8 (or sinks) call, lanekit bf16 and SDPA flash
    on bf16 values of the same shape (no sinks: SDPA has none)."""
    kw = _kwargs(c, extra)
    qb, kb, vb = ((t.float() / 64).bfloat16() if c["fp8"] else t for t in (q, k, v))
    window = kw.get("window_size", (-1, -1))
    group = c["H"] // c["Hkv"]
    qt, kt, vt = qb.transpose(1, 2), kb.transpose(1, 2).repeat_interleave(group, 1), vb.transpose(1, 2).repeat_interleave(group, 1)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=c["causal"])

    runs = {"lanekit": lambda: lanekit.flash_attn_func(q, k, v, causal=c["causal"], **kw),
            "lanekit-bf16": lambda: lanekit.flash_attn_func(qb, kb, vb, causal=c["causal"], window_size=window)}
    if window == (-1, -1):
        runs["sdpa-flash"] = sdpa
    return runs
