"""benchmarks.gemm runs on the GPU only in the lead's sessions: every case's inputs, check and
CPU-capable peers run here first at tiny shapes; the cases are well-formed and registered."""

from benchmarks import gemm, run


def test_every_gemm_benchmark_case_runs_and_checks_on_the_cpu():
    lines = gemm.smoke(device="cpu")
    assert len(lines) == len(gemm.OPS) * len(gemm.TINY_MS) * len(gemm.TINY_KNS)
    assert all(": ok, peers lanekit" in line for line in lines), lines


def test_gemm_families_are_registered_and_grouped():
    assert set(run.GROUPS["gemm"]) == set(gemm.FAMILIES) <= set(run.FAMILIES)
    names = [m.name(c) for m in gemm.FAMILIES.values() for c in m.cases(False)]
    assert len(names) == len(set(names)) == 2 * len(gemm.OPS) * 16
    assert "scaled_mm row M=8192 K=4096 N=14336" in names
    quick = list(gemm.cases(True))
    assert len(quick) == len(gemm.OPS) * 2 and all(c["K"] == 4096 for c in quick)
    assert gemm.flops(quick[0]) == 2.0 * 16 * 4096 * 4096
