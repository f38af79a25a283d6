"""Eager calls with small inputs: microseconds of wall time per call, the host's cost included.

What a Python caller sees when the GPU time is negligible (a few KB to a few hundred KB per call):
validation, dispatch, allocation and the launch, per op, beside the peers that do the same work in
the same run: ``F.rms_norm`` / ``F.layer_norm`` / ``F.silu(g) * u`` / ``F.gelu(g) * u`` (PyTorch's
own, one or two launches), Liger-Kernel's functional ops (Triton launched from Python, as ours;
dropped when liger-kernel is not importable), SDPA for ``flash_attn_func``, and, for the paged
``flash_attn_with_kvcache`` decode, FlashAttention's own where it is installed. Timed by
``benchmarks.moe.host_us``: back-to-back calls, synchronized per batch of 50, median of 20 batches.
Issue 38's bars: each fused layer at most 1.2x Liger's time, flash_attn_func at most 1.2x SDPA's,
the paged decode call at most 60 us.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import lanekit
import lanekit.layers as L
from benchmarks import liger
from benchmarks.moe import host_us  # noqa: F401  (the timer benchmarks.run uses for UNIT "us")
from lanekit.attention.registry import ATTENTION_FWD
from lanekit.layers.registry import NORM
from lanekit.reference import attention as ref_attn
from lanekit.reference import layers as ref
from lanekit.testing import compare, upcast

UNIT = "us"
BF16 = torch.bfloat16
ROWS, HIDDEN, FFN = 4, 2048, 4096          # a few tokens: the GPU's time is a few microseconds
S, HQ, HKV, D = 16, 16, 4, 128             # rope and attention: one short sequence
DECODE_B, PAGE, PAGES = 8, 16, 32          # decode: 8 sequences of up to 512 cached keys


def cases(quick: bool = False):
    for op in ("rms_norm", "rms_norm+residual", "layer_norm", "apply_rotary q", "apply_rotary_qk",
               "swiglu", "geglu tanh", "flash_attn_func", "flash_attn_with_kvcache paged"):
        yield dict(op=op)


def name(c) -> str:
    return f"{c['op']} eager"


def make_inputs(c, device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, dtype=BF16):
        return torch.randn(shape, generator=g, device=device, dtype=dtype)

    op = c["op"]
    if op in ("rms_norm", "rms_norm+residual", "layer_norm"):
        return [rnd(ROWS, HIDDEN), rnd(HIDDEN), rnd(HIDDEN), rnd(ROWS, HIDDEN)]
    if op.startswith("apply_rotary"):
        theta = torch.rand(S, D // 2, generator=g, device=device) * 6.3
        return [rnd(1, S, HQ, D), rnd(1, S, HKV, D), theta.cos(), theta.sin()]
    if op in ("swiglu", "geglu tanh"):
        return [rnd(ROWS, FFN), rnd(ROWS, FFN)]
    if op == "flash_attn_func":
        return [rnd(1, S, HQ, D), rnd(1, S, HKV, D), rnd(1, S, HKV, D)]
    # paged decode: every sequence 400 keys long, one new token appended each call at a fixed
    # position (the same slot rewritten: the call's cost, not a growing cache)
    kc, vc = rnd(DECODE_B * PAGES, PAGE, HKV, D), rnd(DECODE_B * PAGES, PAGE, HKV, D)
    table = torch.randperm(DECODE_B * PAGES, generator=g, device=device).to(torch.int32).reshape(DECODE_B, PAGES)
    seqlens = torch.full((DECODE_B,), 400, dtype=torch.int32, device=device)
    return [rnd(DECODE_B, 1, HQ, D), kc, vc, rnd(DECODE_B, 1, HKV, D), rnd(DECODE_B, 1, HKV, D), table, seqlens]


def _lanekit(c):
    op = c["op"]
    return {
        "rms_norm": lambda x, w, b, r: L.rms_norm(x, w, 1e-6),
        "rms_norm+residual": lambda x, w, b, r: L.rms_norm(x, w, 1e-6, residual=r),
        "layer_norm": lambda x, w, b, r: L.layer_norm(x, w, b, 1e-5),
        "apply_rotary q": lambda q, k, cos, sin: L.apply_rotary(q, cos, sin),
        "apply_rotary_qk": lambda q, k, cos, sin: L.apply_rotary_qk(q, k, cos, sin),
        "swiglu": lambda g, u: L.swiglu(g, u),
        "geglu tanh": lambda g, u: L.geglu(g, u, approximate="tanh"),
        "flash_attn_func": lambda q, k, v: lanekit.flash_attn_func(q, k, v, causal=True),
        "flash_attn_with_kvcache paged": lambda q, kc, vc, k, v, table, seqlens: lanekit.flash_attn_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table, causal=True, max_seqlen_k=401),
    }[op]


def _peers(c) -> dict:
    op = c["op"]
    peers = {}
    if op == "rms_norm":
        peers["F.rms_norm"] = lambda x, w, b, r: F.rms_norm(x, (HIDDEN,), w, 1e-6)
        lg = liger.rms_norm(1e-6)
        if lg is not None:
            peers["liger"] = lambda x, w, b, r: lg(x, w)
    elif op == "rms_norm+residual":
        def add_norm(x, w, b, r):
            h = x + r
            return F.rms_norm(h, (HIDDEN,), w, 1e-6), h
        peers["F.rms_norm"] = add_norm
        lg = liger.rms_norm_residual(1e-6)
        if lg is not None:
            peers["liger"] = lambda x, w, b, r: lg(x, w, r.clone())   # (it adds into r in place)
    elif op == "layer_norm":
        peers["F.layer_norm"] = lambda x, w, b, r: F.layer_norm(x, (HIDDEN,), w, b, 1e-5)
        lg = liger.layer_norm(1e-5)
        if lg is not None:
            peers["liger"] = lambda x, w, b, r: lg(x, w, b)
    elif op.startswith("apply_rotary"):
        lg = liger.rope_qk()
        if lg is not None:   # q and k in one launch (rotates its inputs in place)
            peers["liger q,k"] = lambda q, k, cos, sin: lg(q, k, cos, sin)
    elif op == "swiglu":
        peers["F.silu*u"] = lambda g, u: F.silu(g) * u
        lg = liger.swiglu()
        if lg is not None:
            peers["liger"] = lg
    elif op == "geglu tanh":
        peers["F.gelu*u"] = lambda g, u: F.gelu(g, approximate="tanh") * u
        lg = liger.geglu_tanh()
        if lg is not None:
            peers["liger"] = lg
    elif op == "flash_attn_func":
        peers["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)
    else:
        try:
            from flash_attn import flash_attn_with_kvcache as fa_kvcache
        except Exception:   # FlashAttention not installed: no peer
            fa_kvcache = None
        if fa_kvcache is not None and PAGE % 256 == 0:   # its paged form needs pages of 256
            peers["flash-attn"] = lambda q, kc, vc, k, v, table, seqlens: fa_kvcache(
                q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table, causal=True)
    return peers


def check(c, *inputs) -> str | None:
    """lanekit against the float64 oracle. Returns an error or None."""
    op = c["op"]
    out = _lanekit(c)(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    x64 = [upcast(t) for t in inputs]
    if op.startswith(("rms_norm", "layer_norm")):
        x, w, b, r = x64
        if op == "layer_norm":
            expected, tol = (ref.layer_norm(x, w, b, 1e-5),), NORM
        else:
            expected = ref.rms_norm(x, w, 1e-6, residual=r if "residual" in op else None)
            expected, tol = (expected if isinstance(expected, tuple) else (expected,)), NORM
    elif op == "apply_rotary q":
        q, k, cos, sin = x64
        expected, tol = (ref.apply_rotary(q, cos, sin),), "eltwise"
    elif op == "apply_rotary_qk":
        q, k, cos, sin = x64
        expected, tol = ref.apply_rotary_qk(q, k, cos, sin), "eltwise"
    elif op in ("swiglu", "geglu tanh"):
        expected = (ref.glu(*x64, activation="silu" if op == "swiglu" else "gelu_tanh"),)
        tol = "eltwise"
    elif op == "flash_attn_func":
        q, k, v = x64
        expected = (ref_attn.flash_attn(q, k, v, softmax_scale=D ** -0.5, window_size=(-1, 0))[0],)
        tol = ATTENTION_FWD
    else:
        q, kc, vc, k, v, table, seqlens = inputs
        expected = (lanekit.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=seqlens,
                                                    block_table=table, causal=True, lane="reference"),)
        tol = ATTENTION_FWD
        lanekit.check_errors()
    for o, e in zip(out, expected, strict=True):
        result = compare(o, e, tol)
        if not result.ok:
            return result.detail
    return None


def runners(c, *inputs):
    fns = {"lanekit": _lanekit(c), **_peers(c)}
    return {n: (lambda f=f: f(*inputs)) for n, f in fns.items()}
