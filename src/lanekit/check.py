"""Every registered op, on every lane this machine has, on each of its samples, against its oracle.

This is the engine of ``lanekit check`` and of the check records in docs/checks/ from which the
execution matrix is generated; tests/test_check.py runs it in-process. For each sample: the oracle
(``op.reference()``) runs on float64 copies of the floating inputs, the lane runs on the inputs
themselves with its outputs poisoned (NaN), and every output named in ``op.outputs`` is compared
with :func:`lanekit.testing.compare` under that output's tolerance. The lane must also leave its
inputs unchanged. An exception in a lane fails that sample with its message; it never ends the run.

Whether Triton runs natively or interpreted is decided by the caller before any kernel module is
imported (the CLI and tests/conftest.py set ``TRITON_INTERPRET=1`` when there is no GPU); this
module only reads it, so that importing lanekit never changes a process's environment.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import platform
import signal
import time
import warnings
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable

import torch

from lanekit.families import registry
from lanekit.runtime.lanes import LANES, triton_interpreted
from lanekit.runtime.registry import Op, Sample
from lanekit.runtime.tuning import arch_id
from lanekit.testing import compare, poisoned_outputs, upcast

RECORD_VERSION = 1

TRITON_UNAVAILABLE = ("Triton needs a GPU, or TRITON_INTERPRET=1 set before lanekit's kernel "
                      "modules are imported (`lanekit check` does that on a machine with no GPU)")


@dataclass
class OutputResult:
    """One output of one sample: its largest error in steps of the output format at max |ref|."""

    output: str
    steps: float
    allowed: float
    ok: bool
    detail: str = ""

    @property
    def ratio(self) -> float:
        """steps / allowed; NaN counts as infinitely far off. Exact outputs (allowed 0, such as
        quantized codes) are 0 when they match and infinitely far off when they do not."""
        if math.isnan(self.steps):
            return math.inf
        if self.allowed == 0:
            return 0.0 if self.steps == 0 else math.inf
        return self.steps / self.allowed


@dataclass
class SampleResult:
    name: str
    ok: bool
    seconds: float
    outputs: list[OutputResult] = field(default_factory=list)
    error: str = ""  # an exception, a wrong number of outputs, a modified input

    @property
    def detail(self) -> str:
        parts = [self.error] if self.error else []
        parts += [f"{o.output}: {o.detail}" for o in self.outputs if not o.ok]
        return "; ".join(parts)


@dataclass
class LaneResult:
    """One op on one lane, over all its samples. ``status``: "native" or "interpreted" (the Triton
    lane matched on every sample), "reference" (the reference lane did), "failing", or "not run"
    (the lane cannot run here)."""

    op: str
    lane: str
    status: str
    samples: list[SampleResult] = field(default_factory=list)
    note: str = ""  # why a lane was not run, or why it failed before any sample ran

    @property
    def ok(self) -> bool:
        return self.status != "failing"

    @property
    def passed(self) -> int:
        return sum(s.ok for s in self.samples)

    @property
    def total(self) -> int:
        return len(self.samples)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.samples)

    @property
    def failures(self) -> list[SampleResult]:
        return [s for s in self.samples if not s.ok]

    def worst(self) -> tuple[str, OutputResult] | None:
        """(sample name, output) of the comparison closest to its limit, or None if none ran."""
        pairs = [(s.name, o) for s in self.samples for o in s.outputs]
        return max(pairs, key=lambda p: p[1].ratio) if pairs else None


@dataclass
class CheckRun:
    machine: dict
    results: list[LaneResult]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def to_dict(self) -> dict:
        return {"version": RECORD_VERSION, "machine": self.machine,
                "results": [_lane_to_dict(r) for r in self.results]}

    def write(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict) -> CheckRun:
        if data.get("version") != RECORD_VERSION:
            raise ValueError(f"check record: expected version {RECORD_VERSION}, got {data.get('version')!r}")
        return cls(data["machine"], [_lane_from_dict(r) for r in data["results"]])

    @classmethod
    def read(cls, path: str | Path) -> CheckRun:
        return cls.from_dict(json.loads(Path(path).read_text()))


def machine_lanes(device: str | torch.device) -> tuple[str, ...]:
    """The lanes this process can run on ``device``: the reference always, Triton on a GPU or
    under Triton's interpreter."""
    device = torch.device(device)
    has_triton = device.type == "cuda" or triton_interpreted()
    return tuple(lane for lane in LANES if lane != "triton" or has_triton)


def passing_status(lane: str) -> str:
    if lane == "reference":
        return "reference"
    return "interpreted" if triton_interpreted() else "native"


def machine_info(device: str | torch.device) -> dict:
    """What a check record says about where it ran."""
    device = torch.device(device)
    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = None
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "arch": arch_id(device),
        "interpreted": triton_interpreted(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def check_sample(op: Op, lane: str, sample: Sample) -> SampleResult:
    """Run ``lane`` of ``op`` on ``sample`` and compare each output with the float64 oracle."""
    try:
        ref = op.reference()(**{k: upcast(v) for k, v in sample.kwargs.items()})
    except Exception as e:  # noqa: BLE001 (a failure is a result, not a crash)
        return SampleResult(sample.name, False, 0.0, error=f"the oracle raised {type(e).__name__}: {e}")
    ref = ref if isinstance(ref, tuple) else (ref,)
    before = {k: v.clone() for k, v in sample.kwargs.items() if isinstance(v, torch.Tensor)}
    start = time.perf_counter()
    try:
        with poisoned_outputs(), _interpreter_quiet(lane):
            out = op.lane(lane)(**sample.kwargs)
        _synchronize(sample)
    except Exception as e:  # noqa: BLE001
        return SampleResult(sample.name, False, time.perf_counter() - start,
                            error=f"{type(e).__name__}: {e}")
    seconds = time.perf_counter() - start
    out = out if isinstance(out, tuple) else (out,)
    names = [name for name, _ in op.outputs]
    if len(out) != len(names) or len(ref) != len(names):
        return SampleResult(sample.name, False, seconds,
                            error=f"expected {len(names)} outputs ({', '.join(names)}), "
                                  f"the lane returned {len(out)} and the oracle {len(ref)}")
    modified = [k for k, v in before.items() if not _same(v, sample.kwargs[k])]
    outputs = []
    for (name, tolerance), o, r in zip(op.outputs, out, ref):
        try:
            if not isinstance(o, torch.Tensor):
                raise TypeError(f"expected a tensor, got {type(o).__name__}")
            c = compare(o, r, tolerance)
            outputs.append(OutputResult(name, c.steps, c.allowed_steps, c.ok, c.detail))
        except Exception as e:  # noqa: BLE001 (e.g. an integer output where floats were expected)
            outputs.append(OutputResult(name, math.nan, tolerance.ulps, False,
                                        f"{type(e).__name__}: {e}"))
    error = f"modified its input {', '.join(modified)}" if modified else ""
    ok = not modified and all(o.ok for o in outputs)
    return SampleResult(sample.name, ok, seconds, outputs, error)


def check_lane(op: Op, lane: str, device: str | torch.device,
               on_sample: Callable[[str, str, str, SampleResult | None], None] | None = None,
               samples: int | None = None) -> LaneResult:
    """Every sample of ``op`` on ``lane`` (its first ``samples`` of them, when given).
    ``on_sample(op, lane, sample, result)`` is called before each sample (result None) and after it."""
    if lane not in machine_lanes(device):
        return LaneResult(op.name, lane, "not run", note=TRITON_UNAVAILABLE)
    limit = samples
    try:
        samples = list(itertools.islice(op.samples(str(device)), limit))
    except Exception as e:  # noqa: BLE001
        return LaneResult(op.name, lane, "failing", note=f"generating samples: {type(e).__name__}: {e}")
    results = []
    for sample in samples:
        if on_sample:
            on_sample(op.name, lane, sample.name, None)
        results.append(check_sample(op, lane, sample))
        if on_sample:
            on_sample(op.name, lane, sample.name, results[-1])
    ok = bool(results) and all(r.ok for r in results)
    note = "" if results else "the op has no samples"
    return LaneResult(op.name, lane, passing_status(lane) if ok else "failing", results, note)


def plan(ops: Iterable[str] | None = None, lanes: Iterable[str] | None = None) -> list[tuple[Op, str]]:
    """The (op, lane) pairs to check: every registered op (or those named) on each of its lanes
    (or those named). Raises ValueError for an unknown op or lane name."""
    registered = registry()
    names = list(ops) if ops else sorted(registered, key=lambda n: (registered[n].family, n))
    unknown = [n for n in names if n not in registered]
    if unknown:
        raise ValueError(f"unknown op {', '.join(unknown)}; registered ops are {', '.join(sorted(registered))}")
    wanted = list(lanes) if lanes else list(LANES)
    bad = [lane for lane in wanted if lane not in LANES]
    if bad:
        raise ValueError(f"unknown lane {', '.join(bad)}; lanes are {', '.join(LANES)}")
    return [(registered[n], lane) for n in names for lane in LANES
            if lane in wanted and lane in registered[n].lanes]


def run_checks(device: str | torch.device, ops: Iterable[str] | None = None,
               lanes: Iterable[str] | None = None,
               on_sample: Callable[[str, str, str, SampleResult | None], None] | None = None,
               jobs: int = 1, samples: int | None = None) -> CheckRun:
    """Check the planned (op, lane) pairs on ``device``; see :func:`plan` and :func:`check_lane`
    (``samples``: each op's first that many samples only; None: all).

    ``jobs`` > 1 checks the pairs in that many worker processes (see :func:`check_in_workers`);
    the results are the same, in the same order."""
    pairs = plan(ops, lanes)
    if jobs > 1 and len(pairs) > 1:
        run_unit = functools.partial(_check_unit, samples=samples) if samples is not None else None
        results = check_in_workers([(op.name, lane) for op, lane in pairs], device, jobs, on_sample, run_unit)
    else:
        results = [check_lane(op, lane, device, on_sample, samples) for op, lane in pairs]
    return CheckRun(machine_info(device), results)


def default_jobs(device: str | torch.device) -> int:
    """How many processes ``lanekit check`` runs by default: one per CPU this process may use when
    the Triton lane is interpreted (the interpreter runs one kernel on one core, so the cores are
    idle otherwise), one on a GPU (the kernels share one device, and they are fast there)."""
    if torch.device(device).type == "cuda" or not triton_interpreted():
        return 1
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def check_in_workers(units: list[tuple[str, str]], device: str | torch.device, jobs: int,
                     on_sample: Callable[[str, str, str, SampleResult | None], None] | None = None,
                     run_unit: Callable = None) -> list[LaneResult]:
    """:func:`check_lane` on each (op name, lane) of ``units``, in ``jobs`` worker processes, the
    results in the order of ``units``. Workers are started with the ``spawn`` method (safe with
    CUDA and with threads) and inherit this process's environment, ``TRITON_INTERPRET`` included;
    each takes the next unit when it is done with one. ``on_sample`` is called in this process as
    the workers go.
    A worker that dies (a crash in a kernel, say) fails the unit it was running, with its exit
    code, and a new worker takes its place for the units left. ``run_unit(op name, lane, device,
    on_sample)`` runs one unit in a worker (default: :func:`check_lane` on the registered op)."""
    ctx = multiprocessing.get_context("spawn")
    todo = deque(range(len(units)))
    results: list[LaneResult | None] = [None] * len(units)
    threads = max(1, torch.get_num_threads() // jobs)   # the cores shared out, not oversubscribed
    workers: dict = {}   # connection -> [process, index of the unit it runs, or None]

    def busy() -> int:
        return sum(w[1] is not None for w in workers.values())

    def start_worker():
        mine, theirs = ctx.Pipe()
        process = ctx.Process(target=_worker, args=(theirs, str(device), threads, run_unit or _check_unit),
                              daemon=True)
        process.start()
        theirs.close()
        workers[mine] = [process, None]

    def give_work(conn):
        index = todo.popleft()
        try:
            conn.send((index, *units[index]))
        except OSError:   # it died: its sentinel says so below, and the unit waits for another
            todo.appendleft(index)
        else:
            workers[conn][1] = index

    finished = False
    try:
        while todo or busy():
            while len(workers) < min(jobs, len(todo) + busy()):
                start_worker()
            for conn, (_, index) in list(workers.items()):
                if index is None and todo:
                    give_work(conn)
            ready = multiprocessing.connection.wait([*workers, *(w[0].sentinel for w in workers.values())])
            for conn, (process, _) in list(workers.items()):
                if conn not in ready and process.sentinel not in ready:
                    continue
                try:
                    while conn.poll():   # a dead worker's last messages are read too
                        kind, index, payload = conn.recv()
                        if kind == "sample" and on_sample:
                            on_sample(*payload)
                        elif kind == "done":
                            results[index] = payload
                            workers[conn][1] = None
                except (EOFError, OSError):
                    pass
                if process.is_alive():
                    continue
                process.join()
                index = workers.pop(conn)[1]
                conn.close()
                if index is not None:
                    name, lane = units[index]
                    results[index] = LaneResult(name, lane, "failing", note=(
                        f"the worker process checking it died (exit code {process.exitcode}); "
                        f"`lanekit check --op {name} --lane {lane} --jobs 1` runs it in one process"))
        finished = True
    finally:
        for conn, (process, _) in workers.items():
            if finished:
                try:
                    conn.send(None)
                except OSError:
                    pass
                process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join()
            conn.close()
    return results


def _worker(conn, device: str, threads: int, run_unit: Callable) -> None:
    """A worker of :func:`check_in_workers`: checks the units it is sent until it is sent None.
    Ctrl-C is the parent's to handle (it ends the workers), not a traceback from each of them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    while True:
        try:
            unit = conn.recv()
        except EOFError:   # the parent is gone
            return
        if unit is None:
            return
        index, name, lane = unit

        def on_sample(*event, _index=index):
            conn.send(("sample", _index, event))

        conn.send(("done", index, run_unit(name, lane, device, on_sample)))


def _check_unit(name: str, lane: str, device: str, on_sample, samples: int | None = None) -> LaneResult:
    return check_lane(registry()[name], lane, device, on_sample, samples)


def count_samples(device: str | torch.device, pairs: list[tuple[Op, str]], samples: int | None = None) -> int:
    """How many samples :func:`run_checks` will run (for a progress bar)."""
    runnable = machine_lanes(device)
    total = 0
    for op, lane in pairs:
        if lane in runnable:
            try:
                total += sum(1 for _ in itertools.islice(op.samples(str(device)), samples))
            except Exception:  # noqa: BLE001 (check_lane reports it)
                pass
    return total


@contextmanager
def _interpreter_quiet(lane: str):
    """Under Triton's interpreter, the kernels' arithmetic runs in NumPy, which warns where the
    GPU computes IEEE results silently: log(0) = -inf and exp(-inf) = 0 for masked scores, x / 0
    and overflow to inf where a kernel then masks or clamps. Those warnings are expected, and
    printed before the table they looked like failures: they are ignored for the interpreted
    Triton lane's own calls (a wrong value still fails its comparison). Nothing changes for other
    lanes or outside this call."""
    if lane != "triton" or not triton_interpreted():
        yield
        return
    with warnings.catch_warnings():
        # numpy's reductions (tl.sum, tl.max) warn from its own module: an fp32 sum of squares
        # that overflows before a norm takes the row again, scaled
        warnings.filterwarnings("ignore", category=RuntimeWarning,
                                module=r"(triton\.runtime\.interpreter|numpy\._core\.fromnumeric)",
                                message=r"(divide by zero|overflow|invalid value) encountered")
        yield


def _synchronize(sample: Sample) -> None:
    for v in sample.kwargs.values():
        if isinstance(v, torch.Tensor) and v.device.type == "cuda":
            torch.cuda.synchronize(v.device)
            return


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _num(x: float) -> float | str:
    """A float for JSON (4 decimals are plenty for steps), which has no NaN or infinity: those
    become strings."""
    return round(x, 4) if math.isfinite(x) else str(x)


def _lane_to_dict(r: LaneResult) -> dict:
    worst = r.worst()
    return {
        "op": r.op, "lane": r.lane, "status": r.status, "passed": r.passed, "total": r.total,
        "worst": None if worst is None else {
            "sample": worst[0], "output": worst[1].output,
            "steps": _num(worst[1].steps), "allowed": worst[1].allowed},
        "seconds": round(sum(round(s.seconds, 3) for s in r.samples), 3),  # what from_dict sums
        "note": r.note,
        "samples": [{
            "name": s.name, "ok": s.ok, "seconds": round(s.seconds, 3), "error": s.error,
            "outputs": [{"output": o.output, "steps": _num(o.steps), "allowed": o.allowed,
                         "ok": o.ok, "detail": o.detail} for o in s.outputs],
        } for s in r.samples],
    }


def _lane_from_dict(d: dict) -> LaneResult:
    samples = [SampleResult(
        s["name"], s["ok"], s["seconds"],
        [OutputResult(o["output"], float(o["steps"]), o["allowed"], o["ok"], o["detail"]) for o in s["outputs"]],
        s["error"],
    ) for s in d["samples"]]
    return LaneResult(d["op"], d["lane"], d["status"], samples, d.get("note", ""))
