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


def test_a_tuning_setting_replaces_its_field_in_every_bucket_of_one_architecture(monkeypatch):
    # run_case --set and ab's trees with settings (the sm90 fp8 rows' imprecise_acc A/B)
    import pytest

    from benchmarks import ab, tables
    from lanekit.gemm import tuning

    monkeypatch.setitem(tuning.GEMM, "sm90", dict(tuning.GEMM["sm90"]))     # put back after the test
    before = dict(tuning.GEMM["sm80"])
    tables.apply_settings(["GEMM.imprecise_acc=128"], "sm90")
    assert {c.imprecise_acc for c in tuning.GEMM["sm90"].values()} == {128}
    assert tuning.GEMM["sm80"] == before
    for bad in ("GEMM.imprecise_acc=x", "GEMM.nope=1", "NOPE.block_m=16"):
        with pytest.raises(ValueError, match="expected"):
            tables.apply_settings([bad], "sm90")
    with pytest.raises(SystemExit):     # refused before any child process starts
        ab.main(["gemm_graphs", "scaled_mm tensor M=1024 K=4096 N=4096", "a=src,NOPE.block_m=16"])
