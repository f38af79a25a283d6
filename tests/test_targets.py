"""Ahead-of-time export for GPU targets (lanekit export / lanekit targets), with no GPU.

Compiling needs kernels imported compiled, not interpreted, so the tests that compile run in a child
process without TRITON_INTERPRET (the test session sets it when there is no GPU).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import triton

from lanekit import export, matrix
from lanekit.cli import main
from lanekit.families import get_op
from lanekit.runtime.targets import GPU_TARGETS, TARGETS, Report, judge

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
TRITON_TYPE = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}
HOW = "To regenerate: " + export.REGENERATE + "."


def _compiling_child(args: list[str], cwd: Path) -> str:
    """Run ``python args`` in a child whose Triton compiles (no interpreter); its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _compiled_python(code: str, tmp_path: Path) -> str:
    """Run ``code`` in a child Python whose Triton compiles (no interpreter); its stdout."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(code))
    return _compiling_child([str(script)], tmp_path)


def test_export_writes_a_binary_and_a_manifest_per_kernel_for_every_target(tmp_path):
    out = tmp_path / "out"
    argv = ["export", "--op", "adaln", "--out", str(out), "--jobs", "2"]
    for target in TARGETS:
        argv += ["--target", target]
    assert main(argv) == 0
    samples = list(get_op("adaln").samples("cpu"))
    sample = samples[0]
    N = sample.kwargs["x"].shape[-1]
    for target in TARGETS:
        manifest = json.loads((out / target / "_norm_fwd_kernel.json").read_text())
        assert manifest["kernel"] == "_norm_fwd_kernel" and manifest["target"] == target
        assert manifest["triton"] == export.triton_version()
        specs = manifest["specializations"]
        # every sample's launch is in some specialization; the first sample's is read below
        assert sorted(n for sp in specs for n in sp["samples"]) == sorted(f"adaln: {s.name}" for s in samples)
        [spec] = [sp for sp in specs if f"adaln: {sample.name}" in sp["samples"]]
        assert spec["signature"]["X"] == TRITON_TYPE[sample.kwargs["x"].dtype]
        assert spec["signature"]["IS_RMS"] == "constexpr"
        assert spec["constexprs"]["HAS_MOD"] is True and spec["constexprs"]["BLOCK_N"] == triton.next_power_of_2(N)
        assert spec["num_warps"] == 4 and spec["num_stages"] >= 1 and spec["compiled"] is True
        assert spec["problems"] == [] and spec["scratch"] == 0 and spec["registers"] > 0
        assert spec["dot"] == "" and spec["matrix"] == []
        binary = (out / target / spec["binary"]).read_bytes()
        assert spec["binary"].endswith("." + GPU_TARGETS[target].binary)
        assert binary[:4] == b"\x7fELF", f"{target}: {spec['binary']} is not an ELF object"


def test_a_16_bit_dot_uses_each_targets_matrix_instructions_and_the_check_names_a_missing_one(tmp_path):
    (tmp_path / "toy.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit
        def _toy_dot_kernel(A, B, C, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            a = tl.load(A + offs[:, None] * BLOCK + offs[None, :])
            b = tl.load(B + offs[:, None] * BLOCK + offs[None, :])
            tl.store(C + offs[:, None] * BLOCK + offs[None, :], tl.dot(a, b))
    """))
    out = _compiled_python("""
        import json
        from toy import _toy_dot_kernel
        from lanekit.runtime.targets import Specialization, TARGETS, compile_spec, read_report, GPU_TARGETS
        sig = {"A": "*fp16", "B": "*fp16", "C": "*fp32", "BLOCK": "constexpr"}
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
        found = {}
        for target in TARGETS:
            spec = Specialization("_toy_dot_kernel", "toy", target, sig, {"BLOCK": 64}, {}, {"num_warps": 4, "num_stages": 2},
                                  fn=_toy_dot_kernel, triton_args=(sig, {(3,): 64}, attrs),
                                  compile_options={"num_warps": 4, "num_stages": 2})
            kernel, report = compile_spec(spec)
            found[target] = [report.dot, report.matrix, report.problems]
        ampere = compile_spec(Specialization("_toy_dot_kernel", "toy", "sm80", sig, {}, {}, {},
                                             fn=_toy_dot_kernel, triton_args=(sig, {(3,): 64}, attrs),
                                             compile_options={"num_warps": 4, "num_stages": 2}))[0]
        as_hopper = read_report(ampere, GPU_TARGETS["sm90"], "k", "_toy_dot_kernel")  # mma.sync, no wgmma
        found["sm80 as sm90"] = [as_hopper.dot, as_hopper.matrix, as_hopper.problems]
        print(json.dumps(found))
    """, tmp_path)
    found = json.loads(out.splitlines()[-1])
    for target in TARGETS:
        dot, instructions, problems = found[target]
        assert dot == "f16" and problems == [], f"{target}: {found[target]}"
        assert instructions and all(i.startswith(GPU_TARGETS[target].matrix_name) for i in instructions), target
    assert any("m64" in i for i in found["sm90"][1])  # a warpgroup MMA, 64 rows
    dot, instructions, problems = found["sm80 as sm90"]
    assert dot == "f16" and instructions == []
    assert problems == ["multiplies f16 matrices without wgmma instructions"]


def test_spills_to_ptxas_stack_are_counted_and_judged(tmp_path):
    """ptxas puts register spills in the stack frame (cuobjdump's STACK, not LOCAL): a kernel held
    to 32 registers that needs more reports them, and fails the check without an allowance."""
    (tmp_path / "toy.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit
        def _toy_wide_kernel(X, Y, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            x = tl.load(X + offs)
            tl.store(Y + offs, x * tl.sum(x * x, axis=0) + tl.cumsum(x, axis=0))
    """))
    out = _compiled_python("""
        import json
        from toy import _toy_wide_kernel
        from lanekit.runtime.targets import Specialization, compile_spec
        sig = {"X": "*fp32", "Y": "*fp32", "BLOCK": "constexpr"}
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(2)}
        found = {}
        for cap in (0, 32):
            options = {"num_warps": 1, "num_stages": 1, **({"maxnreg": cap} if cap else {})}
            spec = Specialization("_toy_wide_kernel", "toy", "sm90", sig, {"BLOCK": 2048}, {}, options,
                                  fn=_toy_wide_kernel, triton_args=(sig, {(2,): 2048}, attrs),
                                  compile_options=options)
            report = compile_spec(spec)[1]
            found[cap] = [report.registers, report.scratch, report.problems]
        print(json.dumps(found))
    """, tmp_path)
    found = json.loads(out.splitlines()[-1])
    registers, scratch, problems = found["0"]
    assert registers > 32 and scratch == 0 and problems == [], found
    registers, scratch, problems = found["32"]
    assert registers <= 32 and scratch > 0, found
    assert problems == [f"spills {scratch} bytes per thread to scratch (budget 0)"]


def test_judge_names_each_problem():
    report = Report("k-0", "k", "gfx1201", True, registers=256, shared=80 * 1024, scratch=16, dot="bf16")
    assert judge(report, GPU_TARGETS["gfx1201"]) == [
        "multiplies bf16 matrices without v_wmma instructions",
        "needs 81920 bytes of shared memory, over gfx1201's 65536",
        "spills 16 bytes per thread to scratch (budget 0)",
    ]
    fine = Report("k-0", "k", "gfx1201", True, registers=128, shared=64 * 1024, dot="bf16",
                  matrix=["v_wmma_f32_16x16x16_bf16"])
    assert judge(fine, GPU_TARGETS["gfx1201"]) == []


def test_an_unknown_target_lists_the_valid_ones(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["export", "--target", "sm75", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --target: invalid choice: 'sm75'" in err
    assert all(t in err for t in TARGETS)


def test_an_unknown_op_lists_the_registered_ones(tmp_path, capsys):
    assert main(["export", "--target", "sm90", "--op", "flash_attn_fun", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown op 'flash_attn_fun'; registered ops are [" in err and "'flash_attn_func'" in err
    assert not any(tmp_path.iterdir()), "nothing is written for a bad op"


def test_committed_targets_page_is_generated_from_the_committed_record():
    record = DOCS / export.RECORD_FILE
    assert record.exists(), f"docs/{export.RECORD_FILE} is missing. {HOW}"
    generated = export.render(export.read_record(record))
    committed = (DOCS / export.DOC_FILE).read_text()
    assert committed == generated, (f"docs/{export.DOC_FILE} differs from what docs/{export.RECORD_FILE} "
                                    f"generates. {HOW}\n{export.diff(committed, generated, export.DOC_FILE)}")


def test_committed_record_holds_every_launch_the_registered_samples_make_on_every_target(tmp_path):
    """The record's specializations are those that capture finds now (new samples, new tuning rows
    or a changed launcher make it stale); CI's `lanekit targets --check` compiles them all again."""
    out = _compiled_python("""
        import json
        from lanekit.families import registry
        from lanekit.runtime.targets import TARGETS, capture
        ops = list(registry().values())
        print(json.dumps(sorted([s.target, s.key, s.samples] for t in TARGETS for s in capture(t, ops))))
    """, tmp_path)
    captured = json.loads(out.splitlines()[-1])
    recorded = sorted([s["target"], s["key"], s["samples"]] for s in
                      export.read_record(DOCS / export.RECORD_FILE)["specializations"])
    missing = [c[:2] for c in captured if c not in recorded]
    extra = [r[:2] for r in recorded if r not in captured]
    assert not missing and not extra, (f"docs/{export.RECORD_FILE} is stale: not recorded {missing[:5]}, "
                                       f"no longer launched {extra[:5]}. {HOW}")


def test_targets_keeps_the_report_of_an_unchanged_fingerprint_and_verify_finds_an_edited_one(tmp_path):
    """`lanekit targets` compiles only what changed since the record; --verify compiles kept reports
    again and names one that differs from the compiler's."""
    out = _compiled_python("""
        import dataclasses, json
        import triton
        from lanekit import export

        @triton.jit
        def other_kernel(x):
            pass

        def copy(record):
            return json.loads(json.dumps(record))

        first = export.compile_record(["sm80"], None, ops=["adaln"], jobs=1)
        record = export.record(first.results)
        again = export.compile_record(["sm80"], record, ops=["adaln"], jobs=1)
        edited, stale = copy(record), copy(record)
        edited["specializations"][0]["registers"] += 1
        stale["specializations"][0]["fingerprint"] = "0" * 16
        verified = export.compile_record(["sm80"], edited, ops=["adaln"], verify=1000, seed=1, jobs=1)
        refreshed = export.compile_record(["sm80"], stale, ops=["adaln"], jobs=1)
        spec = first.results[0][0]
        print(json.dumps({
            "first": [first.compiled, first.reused], "again": [again.compiled, again.reused],
            "verified": [verified.compiled, verified.reused, verified.verified,
                         [(s.key, a["registers"], b["registers"]) for s, a, b in verified.mismatches]],
            "refreshed": [refreshed.compiled, refreshed.reused],
            "same": [export.record(again.results) == record, export.record(refreshed.results) == record],
            "edited_key": edited["specializations"][0]["key"],
            "registers": record["specializations"][0]["registers"],
            "fingerprints": [spec.fingerprint != dataclasses.replace(spec, fn=other_kernel).fingerprint,
                             spec.fingerprint != dataclasses.replace(spec, spill_budget=8).fingerprint,
                             spec.fingerprint == dataclasses.replace(spec, samples=["x"]).fingerprint],
        }))
    """, tmp_path)
    got = json.loads(out.splitlines()[-1])
    n = got["first"][0]
    assert n > 1 and got["first"] == [n, 0]
    assert got["again"] == [0, n] and got["refreshed"] == [1, n - 1] and got["same"] == [True, True]
    registers = got["registers"]
    assert got["verified"] == [0, n, n, [[got["edited_key"], registers + 1, registers]]]
    assert got["fingerprints"] == [True, True, True]


def test_the_execution_matrix_says_compiled_per_target_from_the_record():
    ops = {name: op for name, op in matrix.registry().items() if name == "lstm_cell"}
    data = {"specializations": [
        {"target": "gfx942", "kernel": "k", "problems": [], "samples": ["lstm_cell: a", "lstm_cell: b"]},
        {"target": "gfx1201", "kernel": "k", "problems": [], "samples": ["lstm_cell: a"]},
        {"target": "gfx1201", "kernel": "k", "problems": ["spills 8 bytes"], "samples": ["lstm_cell: b"]},
    ]}
    text = matrix.render(ops, {}, export.compiled_status(data))
    [triton_row] = [line for line in text.splitlines() if line.startswith("| rnn | `lstm_cell` | triton |")]
    [reference_row] = [line for line in text.splitlines() if line.startswith("| rnn | `lstm_cell` | reference |")]
    cells = dict(zip([f"{t}" for t in TARGETS], triton_row.strip("| ").split(" | ")[3:]))
    assert cells == {"sm80": "—", "sm90": "—", "gfx942": "compiled",
                     "gfx1151": "—", "gfx1201": "**failing** (docs/targets.md)"}
    assert reference_row.endswith("| — | — | — | — | — |")


def test_compiling_for_makes_the_launchers_read_the_targets_rows():
    from lanekit.attention import tuning as attention_tuning
    from lanekit.layers import tuning as layers_tuning
    from lanekit.runtime import tuning
    cpu = torch.device("cpu")
    assert tuning.arch_id(cpu) == "generic"
    with tuning.compiling_for("gfx1201"):
        assert tuning.arch_id(cpu) == "gfx1201"
        assert (tuning.lookup(attention_tuning.FLASH_ATTN_FWD, cpu, 128)
                == attention_tuning.FLASH_ATTN_FWD["gfx1201"][128])
        assert layers_tuning.norm_bwd_programs(cpu) == layers_tuning.NORM_BWD_PROGRAMS["generic"]
    assert tuning.arch_id(cpu) == "generic"
    assert layers_tuning.norm_bwd_programs(cpu) == layers_tuning.INTERPRETER_NORM_BWD_PROGRAMS


def test_waves_per_eu_reaches_the_launch_only_where_a_row_sets_it():
    from lanekit.rnn.tuning import RnnTileConfig
    from lanekit.runtime.tuning import TileConfig

    assert TileConfig(64, 32, 4, 1).options() == {"num_warps": 4, "num_stages": 1}
    assert RnnTileConfig(16, 32, 32, 4, 1, waves_per_eu=2).options() == {
        "num_warps": 4, "num_stages": 1, "waves_per_eu": 2}


def test_sass_tool_attributes_the_path_taken_to_source_lines():
    """`python -m benchmarks.sass CASE --lines N` (a benchmark's launch compiled for sm90 on the
    CPU) prints, under each launch, N source lines of lanekit's kernels with their instruction
    counts, most first, summing to at most the instructions on the path taken."""
    out = _compiling_child(["-m", "benchmarks.sass", "rms_norm", "--lines", "3"], REPO)
    head, *lines = out.strip().splitlines()
    hot = int(head.split(" SASS, ")[1].split()[0])
    counts = [int(line.split()[0]) for line in lines]
    assert len(lines) == 3 and all(".py:" in line for line in lines), out
    assert counts == sorted(counts, reverse=True) and 0 < sum(counts) <= hot, out
    assert any("kernels.py:" in line or "kernels/" in line for line in lines), out   # a module or a package
