"""benchmarks.gemm_4bit runs on the GPU only in the lead's sessions: every op's inputs, check and
peers run here first at tiny shapes; the cases are well-formed and registered."""

from benchmarks import gemm_4bit, run


def test_every_gemm_4bit_benchmark_op_runs_and_checks_on_the_cpu():
    lines = gemm_4bit.smoke(device="cpu")
    assert len(lines) == len(gemm_4bit.OPS) * len(gemm_4bit.TINY_MS) * len(gemm_4bit.TINY_KNS)
    assert all(": ok, peers lanekit, bf16 F.linear, dequantize + bf16 F.linear, lanekit w8a16" in line
               for line in lines), lines


def test_gemm_4bit_families_are_registered_and_grouped():
    assert set(run.GROUPS["gemm_4bit"]) == set(gemm_4bit.FAMILIES) <= set(run.FAMILIES)
    graphs = [gemm_4bit.GRAPHS.name(c) for c in gemm_4bit.GRAPHS.cases(False)]
    assert len(graphs) == len(set(graphs)) == len(gemm_4bit.OPS) * 8 * 5
    assert "w4a16 awq M=1 K=4096 N=28672" in graphs and "mxfp4 M=1024 K=25600 N=5120" in graphs
    decode = list(gemm_4bit.BANDWIDTH.cases(False))
    assert decode and all(c["M"] <= 16 for c in decode) and len(decode) == len(gemm_4bit.OPS) * 8 * 3
    c = dict(op="w4a16 awq", M=1, K=4096, N=4096)
    # packed weight 8 MiB, fp16 scales and 4-bit zeros per 128 of K, x and y
    assert gemm_4bit.bytes_moved(c) == 4096 * 4096 / 2 + 32 * 4096 * 2.5 + 2 * (4096 + 4096)
    assert gemm_4bit.flops(c) == 2.0 * 4096 * 4096


def test_int4_benchmark_ops_run_and_check_on_the_cpu():
    lines = gemm_4bit.smoke_int(device="cpu")
    assert len(lines) == len(gemm_4bit.INT_OPS) * len(gemm_4bit.TINY_MS) * len(gemm_4bit.TINY_KNS)
    w4a8 = [line for line in lines if line.startswith("w4a8 ")]
    int4 = [line for line in lines if line.startswith("int4_mm ")]
    assert w4a8 and all(": ok, peers lanekit, bf16 F.linear, dequantize + bf16 F.linear, lanekit w8a8" in line
                        for line in w4a8), lines
    assert int4 and all(": ok, peers lanekit, lanekit fp8 scaled_mm, lanekit int8_mm, bf16 F.linear" in line
                        for line in int4), lines
    c = dict(op="int4_mm", M=1024, K=4096, N=4096)
    # both packed operands, the fp32 scales, y in bf16
    assert gemm_4bit.int_bytes_moved(c) == (1024 + 4096) * 4096 / 2 + 4 * (1024 + 4096) + 2.0 * 1024 * 4096
    assert "gemm4_int" in gemm_4bit.FAMILIES


def test_the_svdquant_benchmark_family_runs_and_checks_on_the_cpu():
    lines = gemm_4bit.svdq_smoke(device="cpu")
    assert len(lines) == len(gemm_4bit.SVDQ_OPS) * len(gemm_4bit.TINY_MS) * len(gemm_4bit.TINY_KNS)
    peers = "peers lanekit, bf16 F.linear, dequantize + bf16 F.linear + low rank, lanekit fp8 scaled_mm"
    assert all(": ok, " + peers in line for line in lines), lines
    assert "gemm4_svdquant" in run.GROUPS["gemm_4bit"] and "gemm4_svdquant" in run.FAMILIES
    c = dict(op="svdquant rank32", M=1024, K=4096, N=4096)
    assert gemm_4bit.svdq_flops(c) == 2.0 * 1024 * 4096 * 4096 + 2.0 * 1024 * 8192 * 32
    assert {d["M"] for d in gemm_4bit.svdq_cases()} >= {1, 1024}
