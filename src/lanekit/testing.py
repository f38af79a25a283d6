"""The accuracy rule, NaN poisoning and sample inputs; used by the tests and by ``lanekit check``.

The rule (DESIGN.md): the oracle runs in float64 on the same low-precision inputs; a result passes
when its largest error is within ``ulps`` steps of the output format at the output's magnitude, one
step being the spacing of the output dtype at max |ref| (near 1.0: 0.00098 for fp16, 0.0078 for
bf16; it doubles when the value doubles). NaN never passes; neither does a NaN or inf where the
oracle has a finite value. Ops whose math cannot meet one step say why in :data:`TOLERANCES`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Outputs are poisoned where the launchers allocate them: runtime.alloc, re-exported here.
from lanekit.runtime.alloc import poisoned_outputs  # noqa: F401


@dataclass(frozen=True)
class Tolerance:
    """Allowed error of one output, in steps of its format at max |ref|.

    ``fp32_ulps`` replaces ``ulps`` when the output is fp32, whose step (2^-23 relative) is below
    the rounding of any reduction longer than a few terms.
    """

    ulps: float = 1.0
    fp32_ulps: float | None = None
    reason: str = "one step of the output format (the project's rule)"
    codes: bool = False   # quantized codes: every code equal to the oracle's, nothing less

    def steps_for(self, dtype: torch.dtype) -> float:
        if dtype == torch.float32 and self.fp32_ulps is not None:
            return self.fp32_ulps
        return self.ulps


# Every exception to the one-step rule, with its reason, in one place.
TOLERANCES: dict[str, Tolerance] = {
    "exact": Tolerance(1.0),
    "attention_fwd": Tolerance(
        ulps=3.0,
        fp32_ulps=64.0,
        reason=(
            "the probabilities P are rounded to the input format before the P.V product, as "
            "FlashAttention does to run it on the tensor cores. That adds up to u_in * max|v| "
            "(u_in: the input format's unit roundoff) on top of the final rounding: with "
            "max|v| about 3 * max|out|, as for random inputs, one to two more steps; measured "
            "up to 2.2 steps in bf16 (with an additive bias, whose largest probability is then "
            "not exactly 1) and 1.4 without. fp32: the online softmax and the length-Sk sums "
            "round at 2^-24 per term; 64 steps (2^-17 relative to max|out|) holds for Sk up to 64k."
        ),
    ),
    "attention_bwd": Tolerance(
        ulps=6.0,
        fp32_ulps=64.0,
        reason=(
            "dQ sums Sk products and dK, dV sum Sq of them (times the query heads sharing a KV "
            "head), each with rounded factors: P and dS are rounded to the input format before "
            "their products, as in FlashAttention, and Delta = rowsum(dO * O) uses the rounded "
            "output. FlashAttention's rule for gradients is three times the error of the same "
            "computation done by PyTorch in the same precision; on the registered samples that "
            "PyTorch computation errs by up to 3.0 steps (fp16/bf16) and 7 steps (fp32), and "
            "lanekit by up to 1.9 and 12.6. Six steps is twice PyTorch's worst; fp32 as the forward. "
            "A fixed number of steps holds for these short rows only: over thousands of keys every "
            "16-bit computation errs more (lanekit 6.4 steps on dQ at 4096 keys), so long rows are "
            "held to the three-times-PyTorch rule itself (tests/test_attention_backward.py and "
            "every benchmark case)."
        ),
    ),
    "attention_dbias": Tolerance(
        ulps=4.0,
        fp32_ulps=64.0,
        reason=(
            "dBias = P * (dP - Delta), rounded to the bias's format: the difference cancels, and "
            "Delta comes from the rounded output. PyTorch in the same precision errs by 2.3 steps "
            "on the bias sample, lanekit by 1.8."
        ),
    ),
    "eltwise": Tolerance(
        ulps=1.0,
        fp32_ulps=4.0,
        reason=(
            "an elementwise formula (RoPE, SwiGLU/GeGLU and their gradients) computed in fp32: "
            "16-bit outputs are rounded once, within one step; fp32 outputs carry the rounding of "
            "each of the formula's few fp32 operations: measured up to 2.1 steps on GLU gradients "
            "with saturated gates (gate ~ N(0, 16)), where PyTorch in fp32 errs by 5.6 (SwiGLU) "
            "and 9.5 (GeGLU tanh); four steps"
        ),
    ),
    "norm": Tolerance(
        ulps=1.0,
        fp32_ulps=8.0,
        reason=(
            "16-bit outputs are one rounding of an fp32 result: one step. fp32 outputs carry the "
            "rounding of the mean and mean square, sums of N fp32 terms in an order that depends on "
            "the tile: measured up to 1.2 steps, also on rows of mean 100 at N=4096 and 20000 (the "
            "mean is kept as an unevaluated sum of two fp32, where PyTorch in fp32 errs by 14 "
            "steps); eight steps"
        ),
    ),
    "layers_bwd": Tolerance(
        ulps=1.0,
        fp32_ulps=16.0,
        reason=(
            "16-bit gradients are one rounding of an fp32 result (measured at most 0.5 steps, where "
            "PyTorch in the same precision errs by up to 1.9). fp32 gradients of the parameters "
            "(dweight, dscale, dgate) are sums over rows in fp32, each term rounded at 2^-24: "
            "measured up to 2.2 steps over 17 rows (PyTorch in fp32: 1.5); sixteen steps leaves "
            "room for thousands of rows"
        ),
    ),
    "codes": Tolerance(
        ulps=0.0,
        codes=True,
        reason="quantized codes (int8, fp8) are specified bit for bit: they equal the oracle's",
    ),
    "lse": Tolerance(
        ulps=1.0,
        fp32_ulps=64.0,
        reason="the LSE is an fp32 reduction over Sk terms: same bound as the fp32 attention output",
    ),
    "rnn_fwd": Tolerance(
        ulps=1.0,
        fp32_ulps=16.0,
        reason=(
            "h' and c' are computed in fp32 and rounded once, so fp16/bf16 meet one step (measured "
            "up to 0.50). fp32: the gate pre-activations are fp32 sums of In + H products, and the "
            "exp2-based sigmoid and tanh add a few fp32 ulps; measured up to 5.7 steps (In=200, "
            "H=150), where PyTorch's own fp32 modules err by up to 21.8 steps on the same inputs."
        ),
    ),
    "rnn_bwd": Tolerance(
        ulps=2.0,
        fp32_ulps=16.0,
        reason=(
            "the gate gradients are rounded to the input format before the matmuls that give "
            "d(input), d(h), dW_ih and dW_hh (as PyTorch's modules do in fp16/bf16), and each of "
            "those sums B or G*H rounded products. Measured up to 1.24 steps (fp16 dW_ih of the "
            "Elman cell; bf16 up to 1.19) over odd sizes and six seeds, where PyTorch's modules in "
            "the same precision err by up to 1.8 steps (3.1 for dc). fp32: measured up to 7.0 "
            "steps (dinput, In=200, H=150), PyTorch's fp32 modules up to 7.9."
        ),
    ),
}


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """The spacing of ``dtype`` at ``magnitude`` (one step of the format there)."""
    finfo = torch.finfo(dtype)
    magnitude = max(abs(magnitude), finfo.tiny)
    return 2.0 ** math.floor(math.log2(magnitude)) * finfo.eps


@dataclass(frozen=True)
class Comparison:
    max_error: float
    steps: float          # max_error in steps of the output format at max |ref|
    allowed_steps: float
    ok: bool
    detail: str


def compare(out: torch.Tensor, ref: torch.Tensor, tolerance: Tolerance | str = "exact",
            dtype: torch.dtype | None = None) -> Comparison:
    """Compare ``out`` (any dtype) with the float64 oracle ``ref`` under the project's rule.

    ``dtype`` is the output format whose step is the unit (default: out's dtype). Positions where
    ref is -inf or +inf must hold the same infinity; NaN anywhere in out fails.
    """
    tol = TOLERANCES[tolerance] if isinstance(tolerance, str) else tolerance
    dtype = dtype or out.dtype
    if tol.codes:
        return _compare_codes(out, ref)
    if out.shape != ref.shape:
        return Comparison(math.inf, math.inf, tol.steps_for(dtype), False,
                          f"shape {tuple(out.shape)} != oracle's {tuple(ref.shape)}")
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    if torch.isnan(o).any():
        n = int(torch.isnan(o).sum())
        return Comparison(math.nan, math.nan, tol.steps_for(dtype), False, f"{n} NaN in the output")
    inf_r = torch.isinf(r)
    if not torch.equal(torch.isinf(o), inf_r) or not torch.equal(o[inf_r], r[inf_r]):
        return Comparison(math.inf, math.inf, tol.steps_for(dtype), False,
                          "infinities differ from the oracle's")
    finite = ~inf_r
    if not finite.any():
        return Comparison(0.0, 0.0, tol.steps_for(dtype), True, "")
    err = (o[finite] - r[finite]).abs().max().item()
    unit = ulp(dtype, r[finite].abs().max().item())
    steps = err / unit
    allowed = tol.steps_for(dtype)
    ok = steps <= allowed
    detail = "" if ok else f"largest error {err:.3g} = {steps:.2f} steps of {dtype} at max|ref| (allowed {allowed})"
    return Comparison(err, steps, allowed, ok, detail)


def _compare_codes(out: torch.Tensor, ref: torch.Tensor) -> Comparison:
    """Quantized codes: equal to the oracle's, element for element (``steps`` counts the codes
    that differ)."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return Comparison(math.inf, math.inf, 0.0, False,
                          f"codes {out.dtype} {tuple(out.shape)} != oracle's {ref.dtype} {tuple(ref.shape)}")
    o, r = out.detach().cpu().double(), ref.detach().cpu().double()
    if torch.isnan(o).any():
        return Comparison(math.nan, math.nan, 0.0, False, f"{int(torch.isnan(o).sum())} NaN codes")
    differ = o != r
    n = int(differ.sum())
    err = (o - r).abs().max().item() if o.numel() else 0.0
    detail = "" if n == 0 else f"{n} of {o.numel()} codes differ from the oracle's (largest error {err:g})"
    return Comparison(err, float(n), 0.0, n == 0, detail)


def assert_close(out: torch.Tensor, ref: torch.Tensor, tolerance: Tolerance | str = "exact",
                 dtype: torch.dtype | None = None) -> Comparison:
    """:func:`compare`, raising AssertionError with the detail when it fails."""
    c = compare(out, ref, tolerance, dtype)
    assert c.ok, c.detail
    return c


def randn(*shape, dtype, device, generator=None, scale: float = 1.0) -> torch.Tensor:
    """Normal samples drawn in fp32 on the CPU (repeatable everywhere), then cast and moved."""
    x = torch.randn(*shape, generator=generator, dtype=torch.float32) * scale
    return x.to(dtype=dtype, device=device)


def upcast(x):
    """float64 copy of a floating tensor; anything else unchanged."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(torch.float64)
    return x
