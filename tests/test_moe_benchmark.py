"""benchmarks.moe runs on the GPU only in the lead's sessions: every path of it runs here first, at
tiny shapes on the CPU with lanekit's reference lane (inputs, the check against the float64 oracle,
each peer once and agreeing with lanekit, the work counts). Nothing is timed but a few calls of
the align family's host timer."""

import torch

from benchmarks import moe, run


def test_every_moe_benchmark_case_runs_and_checks_on_the_cpu():
    lines = moe.smoke(device="cpu", lane="reference")
    assert len(lines) == sum(len(list(m.cases(False, shapes=moe.TINY))) for m in moe.FAMILIES.values())
    assert all(": ok, peers " in line for line in lines)


def test_moe_families_are_registered_and_grouped():
    assert set(run.GROUPS["moe"]) == set(moe.FAMILIES) <= set(run.FAMILIES)
    names = [m.name(c) for m in moe.FAMILIES.values() for c in m.cases(False)]
    assert len(names) == len(set(names)) == 24 + 12 + 6 + 2 + 4 + 8
    assert "fused_moe DeepSeek-V3 M=4096" in names and "align+dispatch DeepSeek-V3 M=1, CUDA graph" in names
    assert "fused_moe fp8 DeepSeek-V3 M=4096" in names
    assert "fused_moe mxfp4 gpt-oss-120b M=4096" in names and "fused_moe mxfp4 gpt-oss-20b M=1" in names


def test_decode_bytes_count_the_experts_routed():
    c = next(c for c in moe.DECODE.cases() if c["model"] == "Mixtral-8x7B" and c["M"] == 1)
    assert moe.distinct_experts(c) == 2
    assert moe.decode_bytes(c) == 2 * (2 * 3 * 14336 * 4096 + 2 * 4096)


def test_a_wrong_fused_moe_is_caught_by_the_check(monkeypatch):
    c = next(moe.cases(False, shapes=moe.TINY))
    c = moe._case("fused_moe", c["model"], c["M"], moe.TINY)
    inputs = moe.make_inputs(c, device="cpu")
    real = moe.lk.fused_moe
    monkeypatch.setattr(moe.lk, "fused_moe", lambda *a, **k: real(*a, **k) * 1.01)
    assert moe.check(c, *inputs) is not None


def test_pipeline_and_loop_agree_with_the_oracle():
    c = moe._case("fused_moe", "tiny", 40, moe.TINY)
    xs, w1, w2, routings, _ = moe.make_inputs(c, device="cpu")
    weights, ids = routings[0]
    expected = moe.ref.fused_moe(xs[0].double(), w1.double(), w2.double(), weights.double(), ids)
    for peer in (moe.pipeline, moe.expert_loop):
        got = peer(xs[0], w1, w2, weights, ids)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), expected, rtol=0.03, atol=0.03 * expected.abs().max().item())


def test_a_wrong_mxfp4_fused_moe_is_caught_by_the_check(monkeypatch):
    c = next(moe.MXFP4.cases(False, shapes=moe.TINY))
    inputs = moe.MXFP4.make_inputs(c, device="cpu")
    assert moe.MXFP4.check(c, *inputs) is None
    real = moe.lk.fused_moe
    # 5% off: past the two bf16 steps at max |ref| the tolerance allows (up to 3% of it)
    monkeypatch.setattr(moe.lk, "fused_moe", lambda *a, **k: real(*a, **k) * 1.05)
    assert moe.MXFP4.check(c, *inputs) is not None
