"""The accuracy rule, NaN poisoning and sample inputs; used by the tests and by ``lanekit check``.

The rule (DESIGN.md): the oracle runs in float64 on the same low-precision inputs; a result passes
when its largest error is within ``ulps`` steps of the output format at the output's magnitude, one
step being the spacing of the output dtype at max |ref| (near 1.0: 0.00098 for fp16, 0.0078 for
bf16; it doubles when the value doubles). NaN never passes; neither does a NaN or inf where the
oracle has a finite value. An op whose math cannot meet one step says why in a tolerance of its
own, beside its samples (``<family>/registry.py``); the shared ones are here.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Iterator

import torch

# Outputs are poisoned where the launchers allocate them: runtime.alloc, re-exported here.
from lanekit.runtime.alloc import poisoned_outputs  # noqa: F401


@dataclass(frozen=True)
class Tolerance:
    """Allowed error of one output, in steps of its format at max |ref|, under a readable ``name``.

    ``fp32_ulps`` replaces ``ulps`` when the output is fp32, whose step (2^-23 relative) is below
    the rounding of any reduction longer than a few terms.
    """

    name: str
    ulps: float = 1.0
    fp32_ulps: float | None = None
    reason: str = "one step of the output format (the project's rule)"
    codes: bool = False   # quantized codes: every code equal to the oracle's, nothing less
    # Steps counted in this format instead of the output's (None: the output's). fp8 attention
    # counts in its P's fp8 format (see ATTENTION_FP8 in attention/registry.py and the note below).
    unit: torch.dtype | None = None

    def steps_for(self, dtype: torch.dtype) -> float:
        if dtype == torch.float32 and self.fp32_ulps is not None:
            return self.fp32_ulps
        return self.ulps


# The tolerances several families' outputs share. An op whose math cannot meet one step has its own,
# with the reason, beside its samples in <family>/registry.py (ATTENTION_FWD, NORM, RNN_BWD, ...).
EXACT = Tolerance("exact", 1.0)

ELTWISE = Tolerance(
    name="eltwise",
    ulps=1.0,
    fp32_ulps=4.0,
    reason=(
        "an elementwise formula (RoPE, SwiGLU/GeGLU and their gradients) computed in fp32: "
        "16-bit outputs are rounded once, within one step; fp32 outputs carry the rounding of "
        "each of the formula's few fp32 operations: measured up to 2.1 steps on GLU gradients "
        "with saturated gates (gate ~ N(0, 16)), where PyTorch in fp32 errs by 5.6 (SwiGLU) "
        "and 9.5 (GeGLU tanh); four steps"
    ),
)

CODES = Tolerance(
    name="codes",
    ulps=0.0,
    codes=True,
    reason="quantized codes (int8, fp8) are specified bit for bit: they equal the oracle's",
)

LSE = Tolerance(
    name="lse",
    ulps=1.0,
    fp32_ulps=64.0,
    reason="the LSE is an fp32 reduction over Sk terms: same bound as the fp32 attention output",
)

TOLERANCES: dict[str, Tolerance] = {t.name: t for t in (EXACT, ELTWISE, CODES, LSE)}


# What the fp8/int8 attention oracle rounds, and why (lanekit.reference.attention.flash_attn's
# p_dtype): the kernels multiply P by V in V's fp8 format (int8 V: P in fp16 against V's codes), so
# P = e^{s - m} is rounded to that format before the product, while the denominator sum(e^{s - m})
# is not. The oracle does the same in float64, with m the row's final max. The kernel's m is its
# running max, so where the max moves from one key block to a later one, the kernel rounded the
# earlier blocks' P at another binade offset: each such P may differ from the oracle's by one step
# of the fp8 format. The output is therefore held to "within one step of the fp8 format's rounding
# of P": one step of P's fp8 format at max|out| (a tolerance whose unit is that format). Measured:
# 0.17 to 0.38 steps of e4m3/e5m2 over 400 keys whose max moves; where it does not move (one key
# block) the output is within 0.5 steps of bf16. Without the rounding in the oracle, e5m2 fails by
# 10 bf16 steps on 33 keys. int8's P in fp16 is within the 16-bit rule (ATTENTION_FWD).


def tolerance_named(name: str) -> Tolerance:
    """The shared tolerance called ``name`` (a family's own is imported from its registry module:
    ``from lanekit.attention.registry import ATTENTION_FWD``)."""
    if name not in TOLERANCES:
        raise ValueError(f"tolerance: expected a Tolerance or one of {sorted(TOLERANCES)}, got {name!r}")
    return TOLERANCES[name]


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
    tol = tolerance_named(tolerance) if isinstance(tolerance, str) else tolerance
    dtype = dtype or tol.unit or out.dtype
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


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """out equals ref exactly: int8 and fp8 codes bit for bit (an fp8 NaN code included), floats
    value for value with NaN in the same places (a NaN's sign and payload are not compared). The
    NaN-visible rule's tests (docs/semantics.md) use it where :func:`assert_close` refuses NaN."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, \
        f"{what}: {out.dtype} {tuple(out.shape)} != {ref.dtype} {tuple(ref.shape)}"
    o, r = out.detach().cpu(), ref.detach().cpu()
    if o.dtype.itemsize == 1 and o.is_floating_point():
        o, r = o.view(torch.uint8), r.view(torch.uint8)
    if o.is_floating_point():
        nan = torch.isnan(o)
        assert torch.equal(nan, torch.isnan(r)), f"{what}: NaN at {nan.nonzero().tolist()[:8]}, oracle's at " \
            f"{torch.isnan(r).nonzero().tolist()[:8]}"
        o, r = o.masked_fill(nan, 0), r.masked_fill(nan, 0)
    differ = o != r
    assert not differ.any(), f"{what}: {int(differ.sum())} of {o.numel()} differ, first at " \
        f"{differ.nonzero()[0].tolist()}: {o[differ][:4].tolist()} != {r[differ][:4].tolist()}"


def generator(name: str, salt: str = "") -> torch.Generator:
    """A CPU generator seeded by ``salt + name`` (CRC-32): a sample named ``name`` draws the same
    inputs in every process and on every machine."""
    return torch.Generator().manual_seed(zlib.crc32((salt + name).encode()))


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view with a row stride twice the width (every other row of a buffer)."""
    buf = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    buf[..., : t.shape[-1]] = t
    return buf[..., : t.shape[-1]]


def every_other(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view of every other element along the last dim (stride 2 there): a
    strided vector, where :func:`noncontiguous` of a 1-d tensor is a contiguous prefix."""
    buf = torch.empty(*t.shape, 2, dtype=t.dtype, device=t.device)
    buf[..., 0] = t
    return buf[..., 0]


def with_output_grads(samples, grads) -> Iterator:
    """Each sample (of a forward op) with the gradients of its outputs added to its kwargs, for
    the op's backward samples. ``grads(kwargs)`` gives, in order, each gradient's name, shape and
    a tensor whose dtype and device it takes; they are drawn in that order from
    ``generator(sample.name, "dout ")``."""
    for case in samples:
        kw = dict(case.kwargs)
        g = generator(case.name, "dout ")
        for name, (shape, like) in grads(kw).items():
            kw[name] = randn(*shape, dtype=like.dtype, device=like.device, generator=g)
        yield type(case)(case.name, kw)


def randn(*shape, dtype, device, generator=None, scale: float = 1.0) -> torch.Tensor:
    """Normal samples drawn in fp32 on the CPU (repeatable everywhere), then cast and moved."""
    x = torch.randn(*shape, generator=generator, dtype=torch.float32) * scale
    return x.to(dtype=dtype, device=device)


def on_device(kwargs: dict, device) -> dict:
    """kwargs with its tensors moved to ``device``, beside a case's good ones (else a GPU refuses
    the device before the change a refusal test makes); a "meta" tensor (a device refusal's own
    case) stays where it is."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v
            for k, v in kwargs.items()}


def upcast(x):
    """float64 copy of a floating tensor; anything else unchanged."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(torch.float64)
    return x


def registered_cases(ops, device: str) -> list:
    """pytest parameters (op name, sample) for every registered sample of ``ops`` (registered op
    objects, e.g. ``map(get_op, names)``) on ``device``, each with the id "name: sample name": for a
    test file that runs its family's registered samples on each lane. Takes the ops rather than their
    names because this layer sits below the family registry (tests/test_layout.py). Imports pytest
    (the test extra) only when called."""
    import pytest

    return [pytest.param(op.name, sample, id=f"{op.name}: {sample.name}")
            for op in ops for sample in op.samples(device)]
