"""8-bit matmuls (issue 32): lanekit.gemm beside cuBLASLt's torch._scaled_mm, torch._int_mm, bf16
F.linear and the dequantize-then-bf16 pipeline, in TFLOP/s (2 * M * N * K).

Shapes: M in {16, 128, 1024, 8192} x (K, N) in {(4096, 4096), (4096, 14336), (14336, 4096),
(7168, 2048)}. Ops: ``scaled_mm`` fp8 e4m3 per tensor, rowwise and 128 x 128 blocks (the block
case's peer includes our own per-tensor figure: the bar is 0.9x of it), ``int8_mm`` and
``w8a8_linear`` (with its activation quant) beside torch._int_mm (plus its scaling for w8a8),
``w8a16_linear`` beside bf16 F.linear and dequantize-then-F.linear, ``mx_mm`` beside bf16.
Two families: ``gemm_graphs`` (CUDA graphs: the GPU's time) and ``gemm_eager`` (host included);
``python -m benchmarks.run gemm`` runs both. ``python -m benchmarks.gemm`` runs every case's
inputs, check and peers once at tiny shapes on the CPU.
"""

from __future__ import annotations

import sys
import zlib
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import lanekit.gemm as lk
from lanekit.gemm import registry as greg
from lanekit.reference import gemm as ref
from lanekit.testing import compare

UNIT = "TFLOP/s"
BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
MS = (16, 128, 1024, 8192)
KNS = ((4096, 4096), (4096, 14336), (14336, 4096), (7168, 2048))
OPS = ("scaled_mm tensor", "scaled_mm row", "scaled_mm block", "int8_mm", "w8a8_linear",
       "w8a16_linear", "mx_mm")
QUICK_MS, QUICK_KNS = (16, 1024), ((4096, 4096),)
TINY_MS, TINY_KNS = (5, 33), ((256, 160),)


def cases(quick: bool = False, *, ms=None, kns=None):
    ms = ms or (QUICK_MS if quick else MS)
    kns = kns or (QUICK_KNS if quick else KNS)
    for op in OPS:
        for K, N in kns:
            for M in ms:
                yield dict(op=op, M=M, K=K, N=N)


def name(c) -> str:
    return f"{c['op']} M={c['M']} K={c['K']} N={c['N']}"


def flops(c) -> float:
    return 2.0 * c["M"] * c["N"] * c["K"]


def make_inputs(c, device="cuda"):
    """(x bf16 (M, K), the op's kwargs for lanekit): weights at scale K^-1/2 so outputs are O(1)."""
    g = torch.Generator(device).manual_seed(zlib.crc32(name(c).encode()))
    M, K, N = c["M"], c["K"], c["N"]
    x = torch.randn(M, K, generator=g, device=device).to(BF16)
    op = c["op"]
    if op.startswith("scaled_mm") or op == "mx_mm":
        a = torch.randn(M, K, generator=g, device=device).to(E4M3)
        wq = torch.randn(N, K, generator=g, device=device).to(E4M3)
        s = 1.0 / K ** 0.5
        if op == "scaled_mm tensor":
            kw = dict(a=a, b=wq.t(), scale_a=torch.ones((), device=device),
                      scale_b=torch.full((), s, device=device))
        elif op == "scaled_mm row":
            kw = dict(a=a, b=wq.t(), scale_a=torch.ones(M, 1, device=device),
                      scale_b=torch.full((1, N), s, device=device))
        elif op == "scaled_mm block":
            kw = dict(a=a, b=wq.t(), scale_a=torch.ones(M, -(-K // 128), device=device),
                      scale_b=torch.full((-(-K // 128), -(-N // 128)), s, device=device))
        else:
            kw = dict(a=a, a_scale=torch.full((M, K // 32), 127, dtype=torch.uint8, device=device),
                      b=wq.t(), b_scale=torch.full((K // 32, N), 120, dtype=torch.uint8, device=device))
        return x, kw
    wi = torch.randint(-128, 128, (N, K), generator=g, device=device, dtype=torch.int8)
    ws = torch.full((N,), 1.0 / (127 * K ** 0.5), device=device)
    if op == "int8_mm":
        ai = torch.randint(-128, 128, (M, K), generator=g, device=device, dtype=torch.int8)
        return x, dict(a=ai, b=wi.t(), scale_a=torch.ones(M, 1, device=device), scale_b=ws.reshape(1, N))
    return x, dict(x=x, weight=wi, weight_scale=ws)


def _lanekit(c, kw):
    fn = {"int8_mm": lk.int8_mm, "w8a8_linear": lk.w8a8_linear, "w8a16_linear": lk.w8a16_linear,
          "mx_mm": lk.mx_mm}.get(c["op"], lk.scaled_mm)
    return lambda: fn(**kw)


def _oracle(c, kw):
    up = {k: (v.double() if v.is_floating_point() else v) for k, v in kw.items()}
    fn = {"int8_mm": ref.int8_mm, "w8a8_linear": ref.w8a8_linear, "w8a16_linear": ref.w8a16_linear,
          "mx_mm": ref.mx_mm}.get(c["op"], ref.scaled_mm)
    return fn(**up)


def check(c, x, kw) -> str | None:
    """None when lanekit's output is within the gemm tolerance of the float64 oracle."""
    out = _lanekit(c, kw)()
    got = compare(out, _oracle(c, kw), greg.GEMM)
    return None if got.ok else got.detail


def runners(c, x, kw) -> dict:
    """lanekit and its peers for the case: name -> a no-argument callable."""
    op = c["op"]
    w_bf16 = torch.randn(c["N"], c["K"], device=x.device).to(BF16)
    peers = {"lanekit": _lanekit(c, kw), "bf16 F.linear": lambda: F.linear(x, w_bf16)}
    if op in ("scaled_mm tensor", "scaled_mm row"):
        peers["torch._scaled_mm"] = lambda: torch._scaled_mm(kw["a"], kw["b"], kw["scale_a"],
                                                             kw["scale_b"], out_dtype=BF16)
    if op == "scaled_mm block":
        one = torch.ones((), device=x.device)
        peers["lanekit per-tensor"] = lambda: lk.scaled_mm(kw["a"], kw["b"], one, one)
    if op == "int8_mm":
        peers["torch._int_mm"] = lambda: torch._int_mm(kw["a"], kw["b"])
    if op == "w8a8_linear":
        wt = kw["weight"].t()
        xi = torch.randint(-128, 128, x.shape, dtype=torch.int8, device=x.device)
        peers["torch._int_mm (codes given)"] = lambda: torch._int_mm(xi, wt)
    if op == "w8a16_linear":
        w, s = kw["weight"], kw["weight_scale"]
        peers["dequantize + bf16 F.linear"] = lambda: F.linear(x, w.to(BF16) * s.to(BF16)[:, None])
    return peers


GRAPHS = SimpleNamespace(UNIT=UNIT, CUDA_GRAPHS=True, cases=cases, name=name, flops=flops,
                         make_inputs=make_inputs, check=check, runners=runners)
EAGER = SimpleNamespace(UNIT=UNIT, CUDA_GRAPHS=False, cases=cases,
                        name=lambda c: name(c) + " eager", flops=flops, make_inputs=make_inputs,
                        check=check, runners=runners)
FAMILIES = {"gemm_graphs": GRAPHS, "gemm_eager": EAGER}


def smoke(device="cpu") -> list[str]:
    """Every case at tiny shapes: inputs, the check, each peer that runs on ``device`` once."""
    lines = []
    for c in cases(ms=TINY_MS, kns=TINY_KNS):
        x, kw = make_inputs(c, device)
        error = check(c, x, kw)
        ran = []
        for peer, fn in runners(c, x, kw).items():
            if peer.startswith("torch._") and device == "cpu":
                continue        # cuBLASLt / int_mm peers: GPU only
            fn()
            ran.append(peer)
        lines.append(f"{name(c)}: {'ok' if error is None else error}, peers {', '.join(ran)}")
    return lines


if __name__ == "__main__":
    for line in smoke():
        print(line)
    sys.exit(0)
