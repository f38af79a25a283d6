"""The check machinery (lanekit.check, `lanekit check`): a run reports every pair it checks, and a
wrong lane of any op is reported failing, with its sample names and a non-zero exit.

That every registered sample of every op passes on every lane is `lanekit check`'s own run
(`python3 dev.py check`, CI's first step, and scripts/gpu.sh on the GPU), not repeated here. The
tests of the machinery below cover every op, each output and each lane, on the fewest samples that
show it (:func:`_first_samples`): how a result is judged and reported is the same code for every
sample, and the whole sweep of samples, run here again, took more than half of the suite's time."""

import dataclasses
import importlib
import itertools
import json
import math
import os
import warnings

import pytest
import torch

from lanekit import check
from lanekit.cli import main
from lanekit.families import registry

OPS = registry()
PAIRS = [(name, lane) for name, op in OPS.items() for lane in op.lanes]


# cheap pairs on both lanes (the Triton lane interpreted without a GPU), named out of the plan's
# order so that worker processes finish them out of order
FEW = ["quantize_kv", "geglu", "merge_attn_states", "dequantize_kv"]


def _first_samples(op, count: int = 1):
    """``op`` with only its first ``count`` samples."""
    return dataclasses.replace(op, samples=lambda device, _op=op: itertools.islice(_op.samples(device), count))


@pytest.fixture
def first_samples(monkeypatch):
    """Every op of a run that looks them up (check.plan, so `lanekit check` in this process too)
    has only its first sample."""
    monkeypatch.setattr(check, "registry", lambda: {name: _first_samples(op) for name, op in OPS.items()})


def test_a_run_reports_every_sample_of_every_planned_pair(device):
    run = check.run_checks(device, FEW)

    assert [(r.op, r.lane) for r in run.results] == [(op, lane) for op in FEW for lane in OPS[op].lanes]
    failures = [f"{r.op} · {r.lane} · {s.name}: {s.detail}" for r in run.results for s in r.failures]
    assert not failures, "\n".join(failures)
    interpreted = device == "cpu"
    for r in run.results:
        assert [s.name for s in r.samples] == [s.name for s in OPS[r.op].samples(device)]
        assert r.passed == r.total > 0
        expected = "reference" if r.lane == "reference" else ("interpreted" if interpreted else "native")
        assert r.status == expected
        steps, allowed = r.worst()[1].steps, r.worst()[1].allowed
        assert 0 <= steps <= allowed
    assert run.ok
    assert run.machine["interpreted"] is interpreted
    assert run.machine["arch"] == ("generic" if interpreted else run.machine["arch"])


def _wrong_by(kind: str, index: int):
    """A perturbation of output ``index``: "off" adds 1 + |x| to every finite element (an error of
    over 100%), "nan" writes one NaN, as an element a kernel forgot to write would read."""

    def perturb(outputs):
        outputs = list(outputs)
        dtype = outputs[index].dtype
        o = outputs[index].to(torch.float64, memory_format=torch.contiguous_format)  # fp8, int8 too
        if kind == "off":
            o = torch.where(torch.isfinite(o), o + 1 + o.abs(), o)
        elif o.numel():  # integer codes have no NaN: the poison an unwritten code would hold
            o.view(-1)[o.numel() // 2] = math.nan if dtype.is_floating_point else torch.iinfo(dtype).max
        if not dtype.is_floating_point:
            o = o.clamp(torch.iinfo(dtype).min, torch.iinfo(dtype).max)
        outputs[index] = o.to(dtype)
        return tuple(outputs)

    return perturb


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.double(), b.double()
    return not (torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def _patch_lane(monkeypatch, path: str, fn) -> None:
    module, _, attr = path.partition(":")
    monkeypatch.setattr(importlib.import_module(module), attr, fn)


def _install_wrong_lanes(monkeypatch, perturb):
    """Replace every lane of every op by its reference lane, perturbed."""
    for op in OPS.values():
        reference = op.lane("reference")
        for path in op.lanes.values():
            _patch_lane(monkeypatch, path,
                        lambda _reference=reference, **kw: perturb(_as_tuple(_reference(**kw))))


@pytest.mark.parametrize("kind", ["off", "nan"])
@pytest.mark.parametrize("output", [0, 1], ids=["first output", "second output"])
def test_a_wrong_lane_is_reported_failing(monkeypatch, device, kind, output):
    perturb = _wrong_by(kind, output)
    pairs = [(n, lane) for n, lane in PAIRS if len(OPS[n].outputs) > output]
    if not pairs:
        pytest.skip("no registered op has that many outputs")
    # Per sample, whether the perturbation changes the right answer at all (it leaves an output
    # that is all -inf, or empty, as it is): exactly those samples must be reported. Each op's
    # samples up to the first that it changes are checked.
    changes = {}
    for name in {n for n, _ in pairs}:
        reference = OPS[name].lane("reference")
        changes[name] = []
        for s in OPS[name].samples(device):
            right = _as_tuple(reference(**s.kwargs))
            changes[name].append(any(map(_differs, right, perturb(right))))
            if changes[name][-1]:
                break
    _install_wrong_lanes(monkeypatch, perturb)

    for name, lane in pairs:
        result = check.check_lane(_first_samples(OPS[name], len(changes[name])), lane, device)
        assert result.status == "failing"
        assert result.passed < result.total
        assert [not s.ok for s in result.samples] == changes[name]
        output_name = OPS[name].outputs[output][0]
        codes = OPS[name].outputs[output][1].codes
        for s in result.failures:
            assert s.detail.startswith(f"{output_name}: ")
            if kind == "nan" and not codes:
                assert "NaN" in s.detail
            elif codes:  # an fp8 NaN (also where 1 + 2|x| overflows e4m3), or an int8 code that is off
                assert "NaN" in s.detail or "codes differ" in s.detail
            else:
                assert "largest error" in s.detail


def test_check_command_exits_nonzero_and_records_the_failing_samples(monkeypatch, first_samples, tmp_path, capsys):
    _install_wrong_lanes(monkeypatch, _wrong_by("nan", 0))
    path = tmp_path / "record.json"

    assert main(["check", "--json", str(path), "--jobs", "1"]) == 1   # the patched lanes are this process's

    printed = capsys.readouterr().out
    assert "failing" in printed and "lanes failing" in printed
    data = json.loads(path.read_text())
    assert {(r["op"], r["lane"]) for r in data["results"]} == set(PAIRS)
    for r in data["results"]:
        assert r["status"] == "failing"
        for s in r["samples"]:   # every output the op names is compared
            assert [o["output"] for o in s["outputs"]] == [name for name, _ in OPS[r["op"]].outputs]
        failed = [s["name"] for s in r["samples"] if not s["ok"]]
        assert failed and all(name in printed for name in failed)
        # an integer code has no NaN: the poison (its dtype's largest value) counts as a code that differs
        codes = OPS[r["op"]].outputs[0][1].codes
        assert r["worst"]["steps"] == "nan" or (codes and r["worst"]["steps"] >= 1)
    assert set(data["machine"]) >= {"device", "arch", "interpreted", "torch", "triton", "date"}
    assert check.CheckRun.read(path).to_dict() == data


def test_an_exception_in_a_lane_fails_its_samples_with_the_message(monkeypatch, first_samples, device, capsys):
    def boom(**kwargs):
        raise RuntimeError("the kernel fell over")

    for op in OPS.values():
        for path in op.lanes.values():
            _patch_lane(monkeypatch, path, boom)

    run = check.run_checks(device)
    assert not run.ok
    for r in run.results:
        assert r.status == "failing" and r.passed == 0 and r.total > 0
        assert all(s.error == "RuntimeError: the kernel fell over" for s in r.samples)
    assert main(["check", "--lane", "reference", "--jobs", "1"]) == 1
    assert "RuntimeError: the kernel fell over" in capsys.readouterr().out


def test_a_lane_that_modifies_its_input_fails(monkeypatch, device):
    for name, op in OPS.items():
        reference = op.lane("reference")

        def scribbles(_reference=reference, **kwargs):
            out = _reference(**kwargs)
            tensors = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
            # an op of integer inputs only (moe_align_block_size's expert ids) gets them changed
            first = next((v for v in tensors if v.is_floating_point()), tensors[0])
            if first.is_floating_point():  # fp8 codes (dequantize_fp8's) have no mul_: widen, change, store back
                first.copy_(first.double().mul(2).add(1))
            else:
                first.add_(1)
            return out

        with monkeypatch.context() as patch:  # one op at a time: a backward lane calls its forward's
            _patch_lane(patch, op.lanes["reference"], scribbles)
            result = check.check_lane(_first_samples(op), "reference", device)
        assert result.status == "failing"
        assert "modified its input" in result.samples[0].error, op.name


def test_unknown_op_or_lane_is_a_usage_error(capsys):
    assert main(["check", "--op", "no_such_op"]) == 2
    assert "unknown op no_such_op" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown lane"):
        check.plan(lanes=["cuda"])


def test_an_unwritable_json_path_fails_before_the_run(monkeypatch, tmp_path, capsys):
    def no_run(*args, **kwargs):
        raise AssertionError("the checks ran")

    monkeypatch.setattr(check, "run_checks", no_run)
    (tmp_path / "a-file").write_text("")
    for path, why in ((tmp_path / "a-file" / "run.json", f"{tmp_path / 'a-file'} is a file, not a folder"),
                      (tmp_path, "it is a folder")):
        assert main(["check", "--json", str(path)]) == 2
        assert f"lanekit check: --json {path}: cannot write there ({why})\n" in capsys.readouterr().out
    assert (tmp_path / "a-file").read_text() == ""


def test_the_error_legend_is_printed_in_lines_no_terminal_breaks(capsys):
    assert main(["check", "--op", "rms_norm", "--lane", "reference"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("error: "))
    legend = lines[start:next(i for i, line in enumerate(lines) if line.startswith("all lanes passed"))]
    assert len(legend) >= 2 and all(len(line.rstrip()) <= 80 for line in legend), legend
    assert "steps allowed" in legend[0] and "one unit of the output format" in " ".join(legend)


def test_the_interpreters_expected_numpy_warnings_are_not_shown(device):
    # the interpreter runs the kernels in NumPy, which warns where the GPU silently gives inf (exp
    # overflowing in gelu's tanh here): `lanekit check` printed those before its table
    if device != "cpu":
        pytest.skip("no interpreter: Triton runs natively")
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = check.check_lane(OPS["geglu"], "triton", device)
    assert result.status == "interpreted"
    assert [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)] == []
    assert warnings.filters == filters   # the process's own filters are left as they were


# ---- lanekit check --jobs N: (op, lane) pairs in worker processes ----

def _without_timing(record: dict) -> dict:
    machine = {k: v for k, v in record["machine"].items() if k != "date"}
    results = [{**{k: v for k, v in r.items() if k != "seconds"},
                "samples": [{k: v for k, v in s.items() if k != "seconds"} for s in r["samples"]]}
               for r in record["results"]]
    return {**record, "machine": machine, "results": results}


def _table_rows(printed: str) -> list[str]:
    """The table's rows and the verdict, without the times."""
    rows = [line.rsplit("│", 2)[0] for line in printed.splitlines() if line.startswith("│")]
    return rows + [line.split(" in ")[0] for line in printed.splitlines() if "samples passed in" in line]


def test_check_in_worker_processes_prints_and_records_what_one_process_does(tmp_path, capsys):
    printed = {}
    for jobs in ("1", "2"):
        assert main(["check", *(a for op in FEW for a in ("--op", op)), "--jobs", jobs,
                     "--json", str(tmp_path / f"jobs{jobs}.json")]) == 0
        printed[jobs] = capsys.readouterr().out
    one, two = (json.loads((tmp_path / f"jobs{jobs}.json").read_text()) for jobs in ("1", "2"))

    assert [(r["op"], r["lane"]) for r in two["results"]] == [(op, lane) for op in FEW for lane in OPS[op].lanes]
    assert _without_timing(two) == _without_timing(one)
    assert _table_rows(printed["2"]) == _table_rows(printed["1"])
    assert len(_table_rows(printed["2"])) == 2 * len(FEW) + 1   # a row per pair, and the verdict


def test_workers_report_every_sample_as_it_runs(device):
    seen = []
    run = check.run_checks(device, FEW[:2], ["reference"], lambda *event: seen.append(event), jobs=2)

    for r in run.results:
        names = [s.name for s in r.samples]
        assert [e[2] for e in seen if e[:2] == (r.op, r.lane) and e[3] is None] == names
        assert [e[3] for e in seen if e[:2] == (r.op, r.lane) and e[3] is not None] == r.samples
    assert len(seen) == 2 * sum(r.total for r in run.results)


def _dies_on_geglu(name, lane, device, on_sample):
    """A worker's unit that kills its process on geglu's Triton lane, as a crashing kernel would."""

    if (name, lane) == ("geglu", "triton"):
        os._exit(3)
    return check.check_lane(OPS[name], lane, device, on_sample)


def test_a_worker_that_dies_fails_its_pair_and_the_others_still_run(device):
    units = [(op, lane) for op in FEW for lane in ("reference", "triton")]

    results = check.check_in_workers(units, device, 2, run_unit=_dies_on_geglu)

    assert [(r.op, r.lane) for r in results] == units
    for r in results:
        if (r.op, r.lane) == ("geglu", "triton"):
            assert r.status == "failing" and not r.samples
            assert r.note.startswith("the worker process checking it died (exit code 3)")
            assert "--op geglu --lane triton --jobs 1" in r.note
        else:
            assert r.ok and r.total > 0, (r.op, r.lane, r.note)


def test_jobs_default_to_the_cores_when_interpreted_and_one_on_a_gpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert check.default_jobs("cpu") == cores
    assert check.default_jobs("cuda") == 1
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert check.default_jobs("cpu") == 1


@pytest.mark.parametrize("jobs", ["0", "-1", "two"])
def test_jobs_below_one_is_a_usage_error(jobs, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["check", "--jobs", jobs])
    assert exit.value.code == 2
    assert f"expected a whole number of 1 or more, got '{jobs}'" in capsys.readouterr().err


def test_samples_checks_each_ops_first_samples_in_one_process_and_in_workers(device, tmp_path, capsys):
    few = ["quantize_kv", "geglu"]
    for jobs in ("1", "2"):
        path = tmp_path / f"first{jobs}.json"
        assert main(["check", *(a for op in few for a in ("--op", op)), "--samples", "2", "--jobs", jobs,
                     "--json", str(path)]) == 0
        printed = capsys.readouterr().out
        data = json.loads(path.read_text())
        for r in data["results"]:
            assert [s["name"] for s in r["samples"]] == [s.name for s in OPS[r["op"]].samples(device)][:2]
        total = 2 * sum(len(OPS[op].lanes) for op in few)
        assert f"all lanes passed: {total}/{total} samples passed, each op's first 2 only in" in printed
