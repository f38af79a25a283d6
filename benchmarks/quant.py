"""Quantize kernels at LLM activation shapes: lanekit beside the torch composites vLLM-style code
falls back to, GB/s of the bytes each op must move (x read, codes and scales written; the
runner's "of copy" column is the fraction of a device-to-device copy's bandwidth: the bar of
issue 32 is >= 85%).

Shapes (bf16 x): M tokens in (1, 16, 256, 4096, 16384) x K in (4096, 7168, 14336); the SwiGLU
case takes (M, 2N) with N = the K above. Ops: quantize_fp8 per tensor (dynamic: two passes),
per token and per group of 128; quantize_int8 per token; dequantize_fp8 per group to bf16;
silu_and_mul_quant_fp8 per token; hadamard_quantize_int8 (K = 4096 and 7168 -> 8192);
stochastic_round_fp8. Peers: the same math written in torch ops (amax, a division, clamp, cast:
what ``vllm._custom_ops`` falls back to without its CUDA kernels), and for per-token fp8 also
``torch.compile`` of that composite.

Two families (``python -m benchmarks.run quant`` runs both): ``quant_graphs`` (this module, CUDA
graphs: the GPU's time) and ``quant_eager`` (eager calls, host time included).

``python -m benchmarks.quant`` (no GPU needed) runs every case's inputs, check and peers once at
tiny shapes on the CPU with lanekit's reference lane.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import lanekit.quant as lk
from lanekit.reference import quant as ref
from lanekit.testing import compare

UNIT = "GB/s"
CUDA_GRAPHS = True
BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
OPS = ("fp8 tensor", "fp8 token", "fp8 group128", "int8 token", "dequant fp8 group128",
       "silu_and_mul fp8 token", "hadamard int8", "stochastic fp8")
SHAPES = {"M": (1, 16, 256, 4096, 16384), "K": (4096, 7168, 14336)}
QUICK = {"M": (256, 16384), "K": (7168,)}
#: What ``python -m benchmarks.quant`` runs on the CPU: odd widths, one row.
TINY = {"M": (1, 13), "K": (100, 300)}


def cases(quick: bool = False, shapes=None):
    shapes = shapes or (QUICK if quick else SHAPES)
    for op in OPS:
        for K in shapes["K"]:
            if op == "hadamard int8" and K > 8192:
                continue
            for M in shapes["M"]:
                yield dict(op=op, M=M, K=K)


def name(c) -> str:
    return f"{c['op']} M={c['M']} K={c['K']}"


def _kp(K):
    return 1 << max(K - 1, 0).bit_length()


def bytes_moved(c) -> float:
    M, K, op = c["M"], c["K"], c["op"]
    groups = -(-K // 128)
    return {
        "fp8 tensor": M * K * 2 + M * K + 4,                  # x read once per pass counted once
        "fp8 token": M * K * 2 + M * K + 4 * M,
        "fp8 group128": M * K * 2 + M * K + 4 * M * groups,
        "int8 token": M * K * 2 + M * K + 4 * M,
        "dequant fp8 group128": M * K + 4 * M * groups + M * K * 2,
        "silu_and_mul fp8 token": M * 2 * K * 2 + M * K + 4 * M,
        "hadamard int8": M * K * 2 + M * _kp(K) + 4 * M,
        "stochastic fp8": M * K * 4 + M * K,
    }[op]


def make_inputs(c, device="cuda"):
    g = torch.Generator(device).manual_seed(0)
    M, K = c["M"], c["K"]
    width = 2 * K if c["op"].startswith("silu") else K
    dtype = torch.float32 if c["op"] == "stochastic fp8" else BF16
    x = torch.randn(M, width, generator=g, device=device).to(dtype)
    if c["op"].startswith("dequant"):
        codes, s = ref.quantize_fp8(x, E4M3, None, "group", 128)
        return [codes, s]
    return [x]


def _lanekit(c, *inputs):
    op = c["op"]
    if op == "fp8 tensor":
        return lambda: lk.quantize_fp8(inputs[0])
    if op == "fp8 token":
        return lambda: lk.quantize_fp8(inputs[0], granularity="token")
    if op == "fp8 group128":
        return lambda: lk.quantize_fp8(inputs[0], granularity="group")
    if op == "int8 token":
        return lambda: lk.quantize_int8(inputs[0])
    if op == "dequant fp8 group128":
        return lambda: lk.dequantize_fp8(inputs[0], inputs[1], "group", output_dtype=BF16)
    if op == "silu_and_mul fp8 token":
        return lambda: lk.silu_and_mul_quant_fp8(inputs[0])
    if op == "hadamard int8":
        return lambda: lk.hadamard_quantize_int8(inputs[0])
    return lambda: lk.stochastic_round_fp8(inputs[0], seed=1, offset=0)


def _oracle(c, *inputs):
    op, x = c["op"], inputs[0].cpu()
    if op == "fp8 tensor":
        return ref.quantize_fp8(x, E4M3, None, "tensor")
    if op == "fp8 token":
        return ref.quantize_fp8(x, E4M3, None, "token")
    if op == "fp8 group128":
        return ref.quantize_fp8(x, E4M3, None, "group")
    if op == "int8 token":
        return ref.quantize_int8(x, None, "token")
    if op == "dequant fp8 group128":
        return (ref.dequantize(x, inputs[1].cpu(), "group", 128).to(BF16),)
    if op == "silu_and_mul fp8 token":
        return ref.silu_and_mul_quant_fp8(x, E4M3, None, "token", 128, BF16)
    if op == "hadamard int8":
        return ref.hadamard_quantize_int8(x)
    return (ref.stochastic_round_fp8(x, E4M3, 1, 0),)


CHECK_ROWS = 64     # the oracle runs on the CPU: the check takes the first rows of large cases


def check(c, *inputs) -> str | None:
    """lanekit against the oracle on the first CHECK_ROWS rows: codes and scales equal bit for bit
    (dequantize: within one bf16 step). Returns an error or None."""
    if c["op"] == "fp8 tensor":       # a global amax: checked on the whole tensor when small
        rows = inputs[0].shape[0] if inputs[0].numel() <= (1 << 22) else None
        if rows is None:
            return None if _lanekit(c, *inputs)()[0].shape == inputs[0].shape else "wrong shape"
    sub = [t[:CHECK_ROWS] for t in inputs]
    out = _lanekit(c, *sub)()
    out = out if isinstance(out, tuple) else (out,)
    want = _oracle(c, *sub)
    tols = ("exact",) if c["op"].startswith("dequant") else ("codes", "codes")
    for o, w, tol in zip(out, want, tols):
        r = compare(o.cpu(), w.double() if tol == "exact" else w, tol, dtype=BF16 if tol == "exact" else None)
        if not r.ok:
            return r.detail
    return None


def _torch_quant(x, qmax, dtype, per_token=True, group=None):
    xf = x.float()
    if group is not None:
        M, K = xf.shape
        pad = F.pad(xf, (0, -K % group)).view(M, -1, group)
        s = pad.abs().amax(-1, keepdim=True) / qmax
        s = torch.where(s > 0, s, torch.ones_like(s))
        return (pad / s).clamp(-qmax, qmax).to(dtype).view(M, -1)[:, :K], s.squeeze(-1)
    amax = xf.abs().amax(-1, keepdim=True) if per_token else xf.abs().amax()
    s = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    q = (xf / s).clamp(-qmax, qmax)
    return (q.round().to(dtype) if dtype == torch.int8 else q.to(dtype)), s


def _peers(c, *inputs):
    op, x = c["op"], inputs[0]
    if op == "fp8 tensor":
        return {"torch composite": lambda: _torch_quant(x, 448.0, E4M3, per_token=False)}
    if op == "fp8 token":
        # one compiled graph per shape (a static one is the peer's best): every case's, not dynamo's default 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        composite = torch.compile(_torch_quant, dynamic=False) if x.is_cuda else _torch_quant
        return {"torch composite": lambda: _torch_quant(x, 448.0, E4M3),
                "torch.compile composite": lambda: composite(x, 448.0, E4M3)}
    if op == "fp8 group128":
        return {"torch composite": lambda: _torch_quant(x, 448.0, E4M3, group=128)}
    if op == "int8 token":
        return {"torch composite": lambda: _torch_quant(x, 127.0, torch.int8)}
    if op == "dequant fp8 group128":
        s = inputs[1]
        return {"torch composite": lambda: (x.float() * s.repeat_interleave(128, 1)[:, :x.shape[1]]).to(BF16)}
    if op == "silu_and_mul fp8 token":
        N = x.shape[1] // 2
        return {"torch composite": lambda: _torch_quant(F.silu(x[:, :N]) * x[:, N:], 448.0, E4M3)}
    if op == "hadamard int8":
        KP = _kp(x.shape[1])
        H = _hadamard_matrix(KP, x.device)
        return {"torch matmul + quant": lambda: _torch_quant(F.pad(x.float(), (0, KP - x.shape[1])) @ H,
                                                             127.0, torch.int8)}
    return {"torch (x + noise) round": lambda: (x + (torch.rand_like(x) - 0.5) * x.abs() * 0.125).to(E4M3)}


def _hadamard_matrix(n, device):
    H = torch.ones(1, 1)
    while H.shape[0] < n:
        H = torch.cat((torch.cat((H, H), 1), torch.cat((H, -H), 1)), 0)
    return (H / n ** 0.5).to(device)


def runners(c, *inputs):
    """name -> zero-argument callable, for lanekit and each peer (CUDA-graph safe)."""
    return {"lanekit": _lanekit(c, *inputs), **_peers(c, *inputs)}


EAGER = SimpleNamespace(
    __doc__="the quantize ops eagerly (host time included) beside the torch composites (see benchmarks.quant).",
    UNIT="GB/s", CUDA_GRAPHS=False, cases=lambda quick=False, shapes=None: (
        c for c in cases(quick, shapes) if c["M"] in (1, 256, 4096, 13, 100)),
    name=lambda c: name(c) + " eager", bytes_moved=bytes_moved, make_inputs=make_inputs, check=check,
    runners=runners)

FAMILIES = {"quant_graphs": sys.modules[__name__], "quant_eager": EAGER}


def smoke(device: str = "cpu", lane: str = "reference") -> list[str]:
    """Every family's every tiny case on ``device`` (inputs, check, each peer once), lanekit on
    ``lane``. Returns one line per case; raises on a failed check or a peer that does not run."""
    import os

    previous = os.environ.get("LANEKIT_LANE")
    os.environ["LANEKIT_LANE"] = lane
    lines = []
    try:
        for fam, module in FAMILIES.items():
            for c in module.cases(False, shapes=TINY):
                inputs = module.make_inputs(c, device=device)
                error = module.check(c, *inputs)
                if error is not None:
                    raise AssertionError(f"{fam} {module.name(c)}: {error}")
                fns = module.runners(c, *inputs)
                for fn in fns.values():
                    fn()
                lines.append(f"{fam} {module.name(c)}: ok, peers {', '.join(fns)}; {module.bytes_moved(c)} bytes")
    finally:
        if previous is None:
            os.environ.pop("LANEKIT_LANE", None)
        else:
            os.environ["LANEKIT_LANE"] = previous
    return lines


if __name__ == "__main__":
    for line in smoke():
        print(line)
