"""Ahead-of-time export for GPU targets, and the compile record behind docs/targets.md.

``lanekit export --target T --out DIR`` compiles every canonical specialization of every kernel
(``lanekit.runtime.targets.capture``, handed every op of ``lanekit.families``) for T, with no
GPU, and writes per kernel its binaries (``<key>.cubin`` or ``<key>.hsaco``) and a manifest
``<kernel>.json``. ``lanekit targets`` does
the same for every target without writing binaries, and records the compiler's report in
docs/targets.json, from which docs/targets.md is rendered; ``lanekit targets --check`` (run by CI)
fails when either file is not what the current kernels give.

Each recorded specialization carries its fingerprint (``Specialization.fingerprint``): a hash of
everything its compile and its judgement read. ``lanekit targets`` compiles only the
specializations whose fingerprint is not in the record and keeps the others' reports (a fresh
compile of all ~5,500 takes about half an hour on two cores; ``--recompile`` does it); CI's
``--check --verify N`` compiles N of the kept ones again, drawn at random, and fails if a report
moved, so the record is checked against the compiler itself too.

Compiling runs in parallel processes (forked after the capture, so they share the captured
kernels); Triton's cache ($TRITON_CACHE_DIR, by default ~/.triton/cache) makes a second run fast.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import difflib
import json
import multiprocessing
import os
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable

from lanekit import families
from lanekit.runtime.targets import GPU_TARGETS, SPILL_BUDGET, TARGETS, UNSUPPORTED, Report, Specialization

RECORD_VERSION = 2
RECORD_FILE = "targets.json"
DOC_FILE = "targets.md"
REGENERATE = "run `lanekit targets` (in a checkout, `python3 dev.py lanekit targets`)"

_SPECS: list[Specialization] = []   # what the forked workers compile, by index


def _compile_one(index: int, want_binary: bool):
    from lanekit.runtime.targets import compile_spec

    spec = _SPECS[index]
    kernel, report = compile_spec(spec)
    binary = kernel.asm[GPU_TARGETS[spec.target].binary] if (kernel is not None and want_binary) else None
    return index, dataclasses.asdict(report), binary


def capture_all(targets: Iterable[str], ops: Iterable[str] | None = None,
                keep: Callable[[Specialization], bool] | None = None) -> list[Specialization]:
    """The specializations the registered samples of ``ops`` (op names; default: every registered
    op) launch on each target, those ``keep`` accepts (default: all)."""
    from lanekit.runtime.targets import capture

    chosen = [families.get_op(name) for name in ops] if ops is not None else list(families.registry().values())
    allowances = families.allowances()
    return [spec for target in targets for spec in capture(target, chosen, allowances)
            if keep is None or keep(spec)]


def compile_all(targets: Iterable[str], ops: Iterable[str] | None = None, *, jobs: int | None = None,
                binaries: bool = False, progress: Callable[[int, int], None] | None = None,
                keep: Callable[[Specialization], bool] | None = None):
    """Capture and compile for each target: a list of (Specialization, Report, binary or None).
    ``ops``: op names (default: every registered op). ``keep``: compile only the specializations
    it accepts."""
    return compile_specs(capture_all(targets, ops, keep), jobs=jobs, binaries=binaries, progress=progress)


def compile_specs(specs: list[Specialization], *, jobs: int | None = None, binaries: bool = False,
                  progress: Callable[[int, int], None] | None = None):
    """Compile each of ``specs``: a list of (Specialization, Report, binary or None), in order."""
    global _SPECS
    _SPECS = specs
    results: list = [None] * len(specs)
    jobs = max(1, jobs or os.cpu_count() or 1)
    done = 0
    # One set of worker processes per target: Triton 3.6 keeps state across compiles in a
    # process, so that after an sm90 compile an sm80 one of an fp32 -> e5m2 cast emits sm89's
    # cvt.e5m2x2 and ptxas refuses it (seen 2026-12-07 with a fresh cache, on main's kernels too)
    by_target: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        by_target.setdefault(spec.target, []).append(i)
    pool = None
    try:
        for indices in by_target.values():
            if jobs == 1 and len(by_target) == 1:
                outcomes = (_compile_one(i, binaries) for i in indices)
            else:
                pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))
                futures = [pool.submit(_compile_one, i, binaries) for i in indices]
                outcomes = (f.result() for f in concurrent.futures.as_completed(futures))
            for index, report, binary in outcomes:
                results[index] = (specs[index], Report(**report), binary)
                done += 1
                if progress:
                    progress(done, len(specs))
            if pool is not None:
                pool.shutdown()
                pool = None
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        _SPECS = []
    return results


@dataclasses.dataclass
class Compiled:
    """What :func:`compile_record` did: every specialization with its report (``results``, as
    :func:`compile_all` gives them), how many reports it took from the previous record
    (``reused``) and how many it compiled for want of one (``compiled``), and of the reused ones:
    how many it compiled again to verify them (``verified``), the seed that drew them, and those
    whose report differed from the record's (``mismatches``: (spec, recorded fields, compiled
    fields))."""

    results: list
    reused: int
    compiled: int
    verified: int
    seed: int
    mismatches: list


def compile_record(targets: Iterable[str], previous: dict | None = None, *, ops: Iterable[str] | None = None,
                   verify: int = 0, seed: int | None = None, jobs: int | None = None,
                   progress: Callable[[int, int], None] | None = None) -> Compiled:
    """The reports of every specialization on ``targets``, for the compile record.

    A specialization whose fingerprint (``Specialization.fingerprint``: the Triton release, the
    kernel's source and its callees', the launch, the compile options, the allowances, the
    judging code) equals that of an entry of ``previous`` (a record, :func:`read_record`) keeps
    that entry's report; the rest are compiled. ``verify`` of the reused ones, drawn at random
    with ``seed`` (default: a fresh one), are compiled again and compared with the record."""
    import random

    specs = capture_all(targets, ops)
    # (the fingerprint holds the Triton release: a record of another Triton keeps nothing)
    recorded = {(e["target"], e["key"]): e for e in previous["specializations"]} if previous is not None else {}
    reports: list = [None] * len(specs)
    for i, spec in enumerate(specs):
        entry = recorded.get((spec.target, spec.key))
        if entry is not None and entry.get("fingerprint") == spec.fingerprint:
            reports[i] = Report(spec.key, spec.kernel, spec.target,
                                **{f.name: entry[f.name] for f in dataclasses.fields(Report)
                                   if f.name not in ("key", "kernel", "target")})
    reused = [i for i, r in enumerate(reports) if r is not None]
    seed = random.SystemRandom().randrange(2 ** 32) if seed is None else seed
    checked = sorted(random.Random(seed).sample(reused, min(verify, len(reused))))
    to_compile = sorted(set(i for i, r in enumerate(reports) if r is None) | set(checked))
    mismatches = []
    for i, (_, report, _) in zip(to_compile, compile_specs([specs[i] for i in to_compile], jobs=jobs,
                                                              progress=progress)):
        if reports[i] is not None:
            kept, fresh = _report_fields(reports[i]), _report_fields(report)
            if kept != fresh:
                mismatches.append((specs[i], kept, fresh))
        reports[i] = report
    return Compiled([(spec, report, None) for spec, report in zip(specs, reports)], reused=len(reused),
                    compiled=len(to_compile) - len(checked), verified=len(checked), seed=seed, mismatches=mismatches)


def triton_version() -> str:
    return metadata.version("triton")


def export(targets: Iterable[str], ops: Iterable[str] | None, out: Path, *, jobs: int | None = None,
           progress=None) -> list[tuple[Specialization, Report]]:
    """Compile and write OUT/<target>/<kernel>.json and OUT/<target>/<key>.<cubin|hsaco>."""
    results = compile_all(targets, ops, jobs=jobs, binaries=True, progress=progress)
    manifests: dict[tuple[str, str], list] = {}
    for spec, report, binary in results:
        folder = out / spec.target
        folder.mkdir(parents=True, exist_ok=True)
        entry = spec.manifest()
        entry.update(_report_fields(report))
        if binary is not None:
            name = f"{spec.key}.{GPU_TARGETS[spec.target].binary}"
            (folder / name).write_bytes(binary)
            entry["binary"] = name
        manifests.setdefault((spec.target, spec.kernel), []).append(entry)
    for (target, kernel), entries in manifests.items():
        doc = {"kernel": kernel, "target": target, "triton": triton_version(), "specializations": entries}
        (out / target / f"{kernel}.json").write_text(json.dumps(doc, indent=1) + "\n")
    return [(spec, report) for spec, report, _ in results]


def _report_fields(report: Report) -> dict:
    fields = dataclasses.asdict(report)
    for name in ("key", "kernel", "target"):
        fields.pop(name)
    return fields


# ---- the record (docs/targets.json) and docs/targets.md ----

def record(results) -> dict:
    """The compile record: the Triton version, and per specialization its launch and its report."""
    entries = []
    for spec, report, *_ in results:
        entry = {"target": spec.target, "kernel": spec.kernel, "key": spec.key, "fingerprint": spec.fingerprint,
                 "num_warps": spec.options["num_warps"], "num_stages": spec.options["num_stages"],
                 "samples": spec.samples}
        entry.update(_report_fields(report))
        entries.append(entry)
    entries.sort(key=lambda e: (TARGETS.index(e["target"]), e["kernel"], e["key"]))
    return {"version": RECORD_VERSION, "triton": triton_version(), "specializations": entries}


def dumps_record(data: dict) -> str:
    """The record as text: one specialization a line, so that a change reads as a short diff."""
    head = json.dumps({k: v for k, v in data.items() if k != "specializations"})[:-1]
    lines = ",\n".join(json.dumps(entry) for entry in data["specializations"])
    return f'{head}, "specializations": [\n{lines}\n]}}\n'


def read_record(path: Path) -> dict:
    data = json.loads(path.read_text())
    if data.get("version") != RECORD_VERSION:
        raise ValueError(f"{path}: expected version {RECORD_VERSION}, got {data.get('version')!r}")
    return data


def _kib(n: int) -> str:
    return f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n} B"


def render(data: dict) -> str:
    """The text of docs/targets.md, from a compile record."""
    specs = data["specializations"]
    kernels = sorted({s["kernel"] for s in specs})
    by = {}
    for s in specs:
        by.setdefault((s["kernel"], s["target"]), []).append(s)
    lines = [
        "# Targets",
        "",
        "<!-- Generated by `lanekit targets`: do not edit by hand. -->",
        "",
        f"Every kernel compiled ahead of time for each GPU target, on a machine with no GPU, by Triton "
        f"{data['triton']}: the canonical specializations are the launches that the registered samples "
        "of every op make (`lanekit.runtime.targets.capture`, handed every op of `lanekit.families`), configured with that target's tuning rows. "
        f"Generated from `docs/{RECORD_FILE}`; to refresh both, {REGENERATE}. "
        "`tests/test_targets.py` fails when either is out of date. Each specialization's report is kept "
        "while its fingerprint (the Triton release, the kernel's source and its callees', the launch, the "
        "options, the allowances) is unchanged, and compiled again when it changes; CI "
        "(`lanekit targets --check --verify 200`) fails when the record is not what the current kernels "
        "give, and compiles 200 kept reports again, drawn at random, failing if one moved. "
        "`lanekit export --target T --out DIR` writes the binaries and a manifest per kernel.",
        "",
        "## Kernels and targets",
        "",
        _row(["kernel"] + list(TARGETS)),
        _row(["---"] * (len(TARGETS) + 1)),
    ]
    for kernel in kernels:
        cells = [f"`{kernel}`"]
        for target in TARGETS:
            group = by.get((kernel, target), [])
            bad = [s for s in group if s["problems"]]
            lacking = [s for s in group if s["unsupported"]]
            if not group:
                cells.append("—")
            elif bad:
                cells.append(f"**failing** ({len(bad)} of {len(group)})")
            else:
                cells.append(f"compiled ({len(group) - len(lacking)})"
                             + (f", unsupported ({len(lacking)})" if lacking else ""))
        lines.append(_row(cells))
    allowed = families.allowances()
    lines += [
        "",
        "compiled (n): its n specializations compiled, and each passed the checks below. "
        "unsupported (m): m need a data type the target does not have (" + "; ".join(
            f"{t}: {why}" for t, (_, why) in UNSUPPORTED.items()) + "). "
        "**failing** (a of n): a of them did not (listed under Failures).",
        "",
        "Checks: a kernel whose `tl.dot` takes 16-bit (or 8-bit) operands uses the target's matrix "
        "instructions (`wgmma` on sm90, `mma` on sm80, in the PTX; `v_mfma` on gfx942, wave64; "
        "`v_wmma` on gfx1151 and gfx1201, wave32, in the AMDGCN); its shared memory (LDS) fits the "
        "target (" + ", ".join(f"{t.name} {_kib(t.max_shared)}" for t in GPU_TARGETS.values()) + "); "
        f"it spills no more than {SPILL_BUDGET} bytes per thread to scratch"
        + ("" if not allowed.spills else ", except: " + "; ".join(
            f"`{k}` on {' and '.join(ts)}: {b} bytes ({why})" for (k, b, why), ts in _grouped(allowed.spills)))
        + ". An fp32 `tl.dot` is not held to the matrix check (RDNA has no fp32 WMMA; fp32 is chosen "
        "for accuracy). Other matrix instructions accepted: " + "; ".join(
            f"{', '.join(f'`{k}`' for k in ks)} on {t}: {why}" for (t, why), ks in _by_reason(allowed.matrix))
        + ".",
    ]
    for target in TARGETS:
        t = GPU_TARGETS[target]
        regs = "registers" if t.backend == "cuda" else "VGPRs + AGPRs" if t.warp_size == 64 else "VGPRs"
        lines += ["", f"## {target}", "",
                  _row(["kernel", "specializations", "warps × stages", "matrix instructions",
                        f"{regs} (max)", "shared memory (max)", "scratch bytes (max)"]),
                  _row(["---"] * 7)]
        for kernel in kernels:
            group = by.get((kernel, target), [])
            if not group:
                continue
            done = [s for s in group if s["compiled"]]
            lacking = sum(1 for s in group if s["unsupported"])
            dots = sorted({s["dot"] for s in done if s["dot"]})
            found = sorted({m for s in done for m in s["matrix"]})
            if found:
                matrix = ", ".join(f"`{m}`" for m in _short(found))
            elif dots:
                matrix = f"none ({', '.join(dots)} dot)"
            else:
                matrix = "— (no 16-bit dot)"
            shapes = sorted({(s["num_warps"], s["num_stages"]) for s in group})
            lines.append(_row([
                f"`{kernel}`", f"{len(done)} of {len(group)} compiled"
                + (f" ({lacking} unsupported)" if lacking else ""),
                ", ".join(f"{w}×{st}" for w, st in shapes), matrix,
                max((s["registers"] for s in done), default="—"),
                _kib(max((s["shared"] for s in done), default=0)),
                max((s["scratch"] for s in done), default="—"),
            ]))
    failing = [s for s in specs if s["problems"]]
    if failing:
        lines += ["", "## Failures", ""]
        for s in failing:
            samples = "; ".join(s["samples"][:3]) + (f"; and {len(s['samples']) - 3} more" if len(s["samples"]) > 3 else "")
            lines.append(f"- {s['target']} · `{s['kernel']}` ({s['key']}; {samples}): " + "; ".join(s["problems"]))
    return "\n".join(lines) + "\n"


def _grouped(allowances: dict) -> list:
    """{(kernel, target): (value, reason)} as [((kernel, value, reason), [targets])], in order."""
    groups: dict = {}
    for (kernel, target), (value, why) in sorted(allowances.items(),
                                                 key=lambda kv: (kv[0][0], TARGETS.index(kv[0][1]))):
        groups.setdefault((kernel, value, why), []).append(target)
    return list(groups.items())


def _by_reason(allowances: dict) -> list:
    """{(kernel, target): (value, reason)} as [((target, reason), [kernels])], in order."""
    groups: dict = {}
    for (kernel, target), (_, why) in sorted(allowances.items()):
        groups.setdefault((target, why), []).append(kernel)
    return list(groups.items())


def _short(instructions: list[str], limit: int = 4) -> list[str]:
    """At most ``limit`` distinct instructions, the PTX ones without their operand-type suffixes."""
    names = sorted({i if i.startswith("v_") else ".".join(i.split(".")[:3]) for i in instructions})
    return names[:limit] + ([f"+{len(names) - limit} more"] if len(names) > limit else [])


def _row(cells) -> str:
    text = ["" if c is None else str(c).replace("|", "\\|").replace("\n", " ") for c in cells]
    return "| " + " | ".join(text) + " |"


def diff(committed: str, generated: str, name: str) -> str:
    return "".join(difflib.unified_diff(committed.splitlines(True), generated.splitlines(True),
                                        f"{name} (committed)", f"{name} (generated)"))


def compiled_status(data: dict) -> dict[tuple[str, str], str]:
    """For the execution matrix: (op, target) -> "compiled" when every specialization the op's
    samples launch compiled and passed on that target, "partly" when the others need a data type
    the target lacks (UNSUPPORTED), else "failing"."""
    status: dict[tuple[str, str], str] = {}
    for s in data["specializations"]:
        for sample in s["samples"]:
            key = (sample.split(": ", 1)[0], s["target"])
            rank = 2 if s["problems"] else 1 if s.get("unsupported") else 0
            status[key] = max(status.get(key, "compiled"), ("compiled", "partly", "failing")[rank],
                              key=("compiled", "partly", "failing").index)
    return status
