"""Linear attention, forward and forward + backward: lanekit beside flash-linear-attention (fla), the
kernels of the same name, same run.

Shapes (issue 34, as fla's benchmarks): bf16, D = K = V = 128, H = 16 heads, T = 4096 (B = 8) and
T = 16384 (B = 2): 32k tokens either way. Ops: ``chunk_simple_gla`` (g = logsigmoid(x) / 16, a
realistic slow decay) and ``chunk_linear_attn`` (normalize=False: fla's default there is True),
no initial or final state. FLOPs counted per token and head as the chunked algorithm does them with
64-token chunks: 2 * 64 * (K + V) for the intra-chunk products plus 4 * K * V for the state's
(q h and k^T v); forward + backward counts three forwards. The peer: fla's ``chunk_simple_gla`` and
``chunk_linear_attn`` from the fla-core wheel (``import fla.ops``); when fla is not importable the
cases run lanekit alone and the runner says why once.

Two families (``python -m benchmarks.run linear_attn`` runs both): ``linear_attn_graphs`` (this
module, replayed from CUDA graphs: the GPU's time) and ``linear_attn_eager`` (eager calls, host
time included). The bar (issue 34): >= 1.0x fla, forward and backward, at 4k and 16k.

``python -m benchmarks.linear_attn`` (no GPU needed) runs every case's inputs, check and runners
once at tiny shapes on the CPU with lanekit's reference lane.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import lanekit.linear_attn as la
from lanekit.linear_attn.registry import LINEAR_ATTN_BWD, LINEAR_ATTN_DG, LINEAR_ATTN_FWD
from lanekit.testing import compare

UNIT = "TFLOP/s"
CUDA_GRAPHS = True
TOKENS, H, D = 32768, 16, 128
CHUNK = 64                    # the chunk the FLOP count assumes (lanekit's and fla's)
#: What ``python -m benchmarks.linear_attn`` runs on the CPU.
TINY = dict(tokens=96, H=2, D=32, lengths=(48,))
_FLA_NOTE: list[str] = []     # why fla did not import, said once


def _fla():
    """fla's (chunk_simple_gla, chunk_linear_attn), or None (and the reason, said once)."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as exc:  # noqa: BLE001 (any import failure means: no peer)
        if not _FLA_NOTE:
            _FLA_NOTE.append(f"{type(exc).__name__}: {exc}")
            print(f"linear_attn: fla is not importable ({_FLA_NOTE[0]}); the fla peer is skipped",
                  file=sys.stderr)
        return None
    return chunk_simple_gla, chunk_linear_attn


def cases(quick: bool = False, shapes=None):
    s = shapes or dict(tokens=TOKENS, H=H, D=D, lengths=(4096,) if quick else (4096, 16384))
    for T in s["lengths"]:
        for op in ("chunk_simple_gla", "chunk_linear_attn"):
            for backward in (False, True):
                yield dict(op=op, T=T, B=s["tokens"] // T, H=s["H"], D=s["D"], backward=backward)


def name(c) -> str:
    return f"{'fwd+bwd' if c['backward'] else 'fwd'} {c['op']} T={c['T']} B={c['B']} H={c['H']} D={c['D']}"


def flops(c) -> float:
    D = c["D"]
    per_token = 2 * CHUNK * (D + D) + 4 * D * D
    return per_token * c["B"] * c["T"] * c["H"] * (3 if c["backward"] else 1)


def make_inputs(c, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (c["B"], c["T"], c["H"], c["D"])
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(3))
    g = F.logsigmoid(torch.randn(shape[:3], generator=gen, device=device)) / 16 if c["op"] == "chunk_simple_gla" else None
    do = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    if c["backward"]:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        g = g.requires_grad_() if g is not None else None
    return [q, k, v, g, do]


def _lanekit(c, q, k, v, g, do):
    if c["op"] == "chunk_simple_gla":
        return lambda: la.chunk_simple_gla(q, k, v, g)[0]
    return lambda: la.chunk_linear_attn(q, k, v)[0]


def _peer(c, q, k, v, g, do):
    fla = _fla()
    if fla is None:
        return None
    chunk_simple_gla, chunk_linear_attn = fla
    if c["op"] == "chunk_simple_gla":
        return lambda: chunk_simple_gla(q, k, v, g)[0]
    return lambda: chunk_linear_attn(q, k, v, normalize=False)[0]


def _with_backward(c, forward, q, k, v, g, do):
    if not c["backward"]:
        return forward
    leaves = [t for t in (q, k, v, g) if t is not None]
    return lambda: torch.autograd.grad(forward(), leaves, do)


def _parallel(q, k, v, g, scale):
    """The recurrence's output in its quadratic form, for one (batch, head): o = (scale * q k^T * D) v
    with D[t, s] = exp(b_t - b_s) for s <= t (b the cumulative g), else 0. In q's dtype."""
    T = q.shape[0]
    a = (q @ k.t()) * scale
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if g is not None:
        b = g.to(torch.float64).cumsum(0)
        decay = torch.exp((b[:, None] - b[None, :]).masked_fill(~causal, -torch.inf)).to(a.dtype)
        a = a * decay
    else:
        a = a.masked_fill(~causal, 0)
    return a @ v


def check(c, q, k, v, g, do) -> str | None:
    """lanekit on batch 0, head 0 (heads and batches are independent) against the float64 oracle in
    its quadratic form over the whole sequence: within the registry's tolerance, or, over
    thousands of tokens, within FlashAttention's rule (three times the error of the same quadratic
    form computed by PyTorch in bf16). Forward: o; forward + backward: dq, dk, dv (and dg).
    Returns an error or None."""
    scale = c["D"] ** -0.5
    one = [t.detach()[0, :, 0] if t is not None else None for t in (q, k, v, g, do)]
    leaves64 = [t.double().requires_grad_() if t is not None else None for t in one[:4]]
    leaves16 = [t.clone().requires_grad_() if t is not None else None for t in one[:4]]
    exact = _parallel(*leaves64, scale)
    same = _parallel(*leaves16[:3], leaves16[3], scale)
    if not c["backward"]:
        got = [_lanekit(c, q, k, v, g, do)()[0, :, 0]]
        pairs = [("o", got[0], exact, same, LINEAR_ATTN_FWD)]
    else:
        got = [t[0, :, 0] for t in _with_backward(c, _lanekit(c, q, k, v, g, do), q, k, v, g, do)()]
        used = [i for i, t in enumerate(leaves64) if t is not None]
        want = torch.autograd.grad(exact, [leaves64[i] for i in used], one[4].double())
        same_g = torch.autograd.grad(same, [leaves16[i] for i in used], one[4])
        names = ("dq", "dk", "dv", "dg")
        pairs = [(names[i], a, w, s, LINEAR_ATTN_DG if i == 3 else LINEAR_ATTN_BWD)
                 for i, a, w, s in zip(used, got, want, same_g)]
    for label, a, e, s, tol in pairs:
        result = compare(a, e, tol)
        if result.ok:
            continue
        err = (a.double() - e).abs().max().item()
        same_err = (s.double() - e.detach()).abs().max().item()
        if not err <= 3 * same_err:
            return f"{label}: {result.detail}, and over 3 x PyTorch bf16's error {same_err:.3g}"
    return None


def runners(c, q, k, v, g, do):
    """name -> zero-argument callable, for lanekit and fla (when it imports)."""
    out = {"lanekit": _with_backward(c, _lanekit(c, q, k, v, g, do), q, k, v, g, do)}
    peer = _peer(c, q, k, v, g, do)
    if peer is not None:
        out["fla"] = _with_backward(c, peer, q, k, v, g, do)
    return out


EAGER = SimpleNamespace(
    __doc__="linear attention eagerly (host time included) beside fla (see benchmarks.linear_attn).",
    UNIT="TFLOP/s", CUDA_GRAPHS=False, cases=cases, name=lambda c: name(c) + " eager", flops=flops,
    make_inputs=make_inputs, check=check, runners=runners)

FAMILIES = {"linear_attn_graphs": sys.modules[__name__], "linear_attn_eager": EAGER}


def smoke(device: str = "cpu", lane: str = "reference") -> list[str]:
    """Every family's every tiny case on ``device`` (inputs, check, each runner once), lanekit on
    ``lane``. Returns one line per case; raises on a failed check."""
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
                lines.append(f"{fam} {module.name(c)}: ok, runners {', '.join(fns)}; {module.flops(c):.3g} flops")
    finally:
        if previous is None:
            os.environ.pop("LANEKIT_LANE", None)
        else:
            os.environ["LANEKIT_LANE"] = previous
    return lines


if __name__ == "__main__":
    for line in smoke():
        print(line)
