"""docs/execution-matrix.md is generated: it must be what `lanekit matrix` makes of the registry and
the committed check records, and the CPU record must cover every registered op, lane and sample."""

from pathlib import Path

import pytest

from lanekit import matrix
from lanekit.check import CheckRun, LaneResult, OutputResult, SampleResult
from lanekit.cli import main
from lanekit.families import registry
from lanekit.runtime.targets import TARGETS

DOCS = Path(__file__).resolve().parents[1] / "docs"
CPU_RECORD = DOCS / "checks" / "cpu-interpreter.json"
HOW = "To regenerate: " + matrix.REGENERATE + "."


def test_committed_matrix_is_generated_from_the_registry_and_the_records():
    path, generated = matrix.render_repo(DOCS)
    assert path.exists(), f"docs/execution-matrix.md is missing. {HOW}"
    committed = path.read_text()
    assert committed == generated, (
        f"docs/execution-matrix.md differs from what the registry and docs/checks/*.json generate. "
        f"{HOW}\n{matrix.diff(committed, generated)}")


def test_cpu_interpreter_record_covers_every_registered_op_lane_and_sample():
    assert CPU_RECORD.exists(), f"{CPU_RECORD} is missing. {HOW}"
    record = CheckRun.read(CPU_RECORD)
    assert record.machine["interpreted"] is True and record.machine["arch"] == "generic", (
        f"{CPU_RECORD} was not recorded under Triton's interpreter. {HOW}")
    recorded = {(r.op, r.lane): r for r in record.results}
    problems = []
    for name, op in registry().items():
        samples = [s.name for s in op.samples("cpu")]
        for lane in op.lanes:
            r = recorded.get((name, lane))
            if r is None or r.status == "not run":
                problems.append(f"{name} · {lane}: not in the record")
            elif [s.name for s in r.samples] != samples:
                problems.append(f"{name} · {lane}: recorded samples {[s.name for s in r.samples]}, "
                                f"registered {samples}")
    assert not problems, f"{CPU_RECORD} is stale: " + "; ".join(problems) + f". {HOW}"


def _record(arch, interpreted, lanes):
    machine = {"device": "NVIDIA H200" if arch == "sm90" else "cpu", "arch": arch,
               "interpreted": interpreted, "torch": "2.13.0", "triton": "3.6.0", "python": "3.11.7",
               "date": "2026-11-30 12:00 UTC"}
    return CheckRun(machine, lanes)


def _lane(op, lane, status, *samples):
    return LaneResult(op, lane, status, list(samples))


def _sample(name, steps, allowed=3.0, ok=True, detail=""):
    return SampleResult(name, ok, 0.1, [OutputResult("out", steps, allowed, ok, detail)])


def test_matrix_shows_each_record_status_and_error_and_a_column_per_uncovered_target():
    op = next(iter(registry().values()))
    records = {
        "cpu-interpreter": _record("generic", True, [
            _lane(op.name, "triton", "interpreted", _sample("a", 1.25), _sample("b", 2.5)),
        ]),
        "sm90": _record("sm90", False, [
            _lane(op.name, "triton", "failing", _sample("a", 0.5),
                  _sample("b", float("nan"), ok=False, detail="3 NaN in the output")),
            _lane(op.name, "reference", "reference", _sample("a", 0.5)),
        ]),
    }
    text = matrix.render({op.name: op}, records)
    rows = {line.split(" | ")[2]: line for line in text.splitlines() if line.startswith(f"| {op.family} |")}

    assert "| cpu-interpreter | sm90 |" in text
    assert "sm90 (compile)" not in text  # a machine covers it
    assert all(f"| {t} (compile) |" in text for t in TARGETS if t != "sm90")
    assert "| interpreted (2.50 of 3) | **failing** (1/2 passed) |" in rows["triton"]
    assert "| not run | reference (0.50 of 3) |" in rows["reference"]
    assert f'- `sm90` · `{op.name}` · triton · sample "b": out: 3 NaN in the output' in text


def test_matrix_command_check_flags_a_stale_file(tmp_path, capsys):
    docs = tmp_path / "docs"
    (docs / "checks").mkdir(parents=True)
    (docs / "checks" / "cpu-interpreter.json").write_text(CPU_RECORD.read_text())

    assert main(["matrix", "--docs", str(docs)]) == 0
    assert main(["matrix", "--docs", str(docs), "--check"]) == 0
    path = docs / matrix.MATRIX_FILE
    path.write_text(path.read_text().replace("interpreted (", "native ("))
    capsys.readouterr()
    assert main(["matrix", "--docs", str(docs), "--check"]) == 1
    assert "out of date" in capsys.readouterr().out


def test_a_malformed_record_is_named(tmp_path):
    (tmp_path / "old-machine.json").write_text('{"version": 0, "machine": {}, "results": []}')
    with pytest.raises(ValueError, match="old-machine.json: not a check record .*expected version 1"):
        matrix.load_records(tmp_path)
