"""benchmarks.quant runs on the GPU only in the lead's sessions: every path of it runs here first,
at tiny shapes on the CPU (inputs, the check against the oracle, each peer once)."""

import pytest
import torch

from benchmarks import quant, run

# the Triton lane runs natively where there is a GPU, interpreted on the CPU otherwise
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("lane", ["reference", "triton"])
def test_every_quant_benchmark_case_runs_and_checks_on_the_cpu(lane):
    lines = quant.smoke(device=DEVICE if lane == "triton" else "cpu", lane=lane)
    assert len(lines) == sum(len(list(m.cases(False, shapes=quant.TINY))) for m in quant.FAMILIES.values())


def test_quant_families_are_registered_and_grouped():
    assert set(run.GROUPS["quant"]) == set(quant.FAMILIES) <= set(run.FAMILIES)
    names = [m.name(c) for m in quant.FAMILIES.values() for c in m.cases(False)]
    assert len(names) == len(set(names))
    assert "fp8 token M=16384 K=7168" in names


def test_a_wrong_quantize_is_caught_by_the_check(monkeypatch):
    c = dict(op="fp8 token", M=13, K=100)
    inputs = quant.make_inputs(c, device="cpu")
    real = quant.lk.quantize_fp8
    monkeypatch.setattr(quant.lk, "quantize_fp8", lambda *a, **k: (real(*a, **k)[0], real(*a, **k)[1] * 2))
    assert quant.check(c, *inputs) is not None
