"""``lanekit``: the command line.

    lanekit check [--op NAME ...] [--lane triton|reference ...] [--json PATH] [--jobs N] [--samples N]
        every registered op on every lane this machine has, against its oracle (lanekit.check)
    lanekit matrix [--check]
        regenerate docs/execution-matrix.md from the registry and docs/checks/*.json
    lanekit export --target T [--target T ...] [--op NAME ...] --out DIR [--jobs N]
        compile every kernel's canonical specializations for GPU targets with no GPU (lanekit.export)
    lanekit targets [--check] [--recompile] [--verify N [--seed S]] [--jobs N]
        compile for every target and regenerate docs/targets.json and docs/targets.md (what changed
        since the record; --verify N compiles N unchanged ones again to check the record)
    lanekit demo [ARGS ...]
        lanekit.demo.main(ARGS)

Triton runs natively when PyTorch sees a GPU; otherwise this process sets ``TRITON_INTERPRET=1``
before any kernel module is imported, and the Triton lane runs under the interpreter on the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # everything after "demo" belongs to the demo, --help included
        return _demo(argv[1:])
    args = _parser().parse_args(argv)
    if args.command in ("export", "targets") and _interpreted_env():
        return _in_compiled_process(args, argv)
    return args.run(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lanekit", description="lanekit: fused Triton kernels, "
                                     "each checked against a readable PyTorch oracle.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = sub.add_parser("check", help="check every op on every lane of this machine against its oracle",
                           description="Run every registered op on every lane this machine has (Triton "
                           "natively on a GPU, else interpreted on the CPU; the reference), on each of its "
                           "samples, against the float64 oracle. Exits 1 when any sample fails.")
    check.add_argument("--op", action="append", metavar="NAME", help="only this op (repeatable)")
    check.add_argument("--lane", action="append", choices=("triton", "reference"),
                       help="only this lane (repeatable)")
    check.add_argument("--json", metavar="PATH",
                       help="also write the results and the machine's description as JSON "
                       "(docs/checks/<machine>.json records a machine for the execution matrix)")
    check.add_argument("--jobs", type=_positive, metavar="N",
                       help="check this many (op, lane) pairs at once, each in a process of its own "
                       "(default: one per CPU when Triton is interpreted, 1 on a GPU)")
    check.add_argument("--samples", type=_positive, metavar="N",
                       help="check only each op's first N samples (default: all): a quicker pass, such "
                       "as CI's second check under the newest Triton")
    check.set_defaults(run=_check)

    matrix = sub.add_parser("matrix", help="regenerate docs/execution-matrix.md",
                            description="Write docs/execution-matrix.md from the op registry and the "
                            "check records in docs/checks/*.json.")
    matrix.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the file differs from what would be written")
    matrix.add_argument("--docs", metavar="DIR", help="the docs folder (default: the checkout's docs/)")
    matrix.set_defaults(run=_matrix)

    from lanekit.runtime.targets import TARGETS

    export = sub.add_parser("export", help="compile the kernels for GPU targets, with no GPU needed",
                            description="Compile each kernel's canonical specializations (the launches the "
                            "registered samples of its ops make) for each target, and write OUT/<target>/ "
                            "<key>.cubin or .hsaco and a manifest OUT/<target>/<kernel>.json. Exits 1 when a "
                            "specialization fails a target (it does not compile, misses the target's matrix "
                            "instructions, overflows shared memory or spills), saying why.")
    export.add_argument("--target", action="append", required=True, choices=TARGETS,
                        help="a GPU architecture (repeatable)")
    export.add_argument("--op", action="append", metavar="NAME",
                        help="only the kernels this op launches (repeatable; default: every op)")
    export.add_argument("--out", required=True, metavar="DIR", help="the folder to write into")
    export.add_argument("--jobs", type=int, metavar="N", help="compiling processes (default: one per CPU)")
    export.set_defaults(run=_export)

    targets = sub.add_parser("targets", help="compile for every target; regenerate docs/targets.md",
                             description="Compile every kernel for every target and write the compiler's "
                             "report to docs/targets.json and docs/targets.md. A specialization whose "
                             "fingerprint (Triton's release, the kernel's source and its callees', the "
                             "launch, the options, the allowances) is that of a recorded one keeps its "
                             "report unless --recompile.")
    targets.add_argument("--check", action="store_true",
                         help="write nothing; exit 1 if either file differs from what would be written")
    targets.add_argument("--recompile", action="store_true",
                         help="compile every specialization (default: keep the record's report of each "
                         "one whose fingerprint is unchanged)")
    targets.add_argument("--verify", type=int, default=0, metavar="N",
                         help="compile N of the kept reports again, drawn at random, and fail if any differs")
    targets.add_argument("--seed", type=int, metavar="S", help="the seed that draws them (default: a fresh one)")
    targets.add_argument("--jobs", type=int, metavar="N", help="compiling processes (default: one per CPU)")
    targets.add_argument("--docs", metavar="DIR", help="the docs folder (default: the checkout's docs/)")
    targets.set_defaults(run=_targets)

    sub.add_parser("demo", help="run lanekit's demo (lanekit demo --help for its arguments)")
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of 1 or more, got {text!r}")
    return value


def _use_gpu_or_interpreter() -> str:
    """Decide native or interpreted Triton before any kernel module is imported; the device."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def _check(args) -> int:
    device = _use_gpu_or_interpreter()

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from lanekit import check

    console = Console()
    if not console.is_terminal:  # a log or a pipe: no need to squeeze the table into 80 columns
        console.width = max(console.width, 120)
    try:
        pairs = check.plan(args.op, args.lane)
    except ValueError as e:
        console.print(f"lanekit check: {e}", style="red", markup=False, highlight=False)
        return 2
    problem = _unwritable(args.json) if args.json else None
    if problem:  # said now, not after the whole run
        console.print(f"lanekit check: --json {args.json}: cannot write there ({problem})", style="red",
                      markup=False, highlight=False, soft_wrap=True)
        return 2
    start = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("checking", total=check.count_samples(device, pairs, args.samples))

        def on_sample(op, lane, sample, result):
            if result is None:
                progress.update(task, description=f"{op} · {lane} · {sample}")
            else:
                progress.advance(task)

        jobs = args.jobs or check.default_jobs(device)
        run = check.run_checks(device, args.op, args.lane, on_sample, jobs=jobs, samples=args.samples)
    results = run.results
    elapsed = time.perf_counter() - start

    console.print(_table(run))
    for line in ERROR_LEGEND:   # short lines, so that no terminal of 80 columns breaks a phrase
        console.print(line, style="dim", markup=False, highlight=False)
    failures = _failures(run)
    if failures:
        console.print(failures)
    passed = sum(r.passed for r in results)
    total = sum(r.total for r in results)
    failing = [r for r in results if not r.ok]
    mode = "interpreted on the CPU" if run.machine["interpreted"] else f"native on {run.machine['device']}"
    verdict = f"{len(failing)} of {len(results)} lanes failing" if failing else "all lanes passed"
    some = f", each op's first {args.samples} only" if args.samples else ""
    console.print(f"{verdict}: {passed}/{total} samples passed{some} in {elapsed:.1f} s (Triton {mode})",
                  style="red" if failing else "green", markup=False, highlight=False)
    if args.json:
        run.write(args.json)
        console.print(f"wrote {args.json}", markup=False, highlight=False)
    return 1 if failing else 0


def _unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written (its folder made, the file opened for writing), or None.
    An existing file is left as it is; a new one is not left behind."""
    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        return "it is a folder"
    folder = next((p for p in path.parents if p.exists()), None)
    if folder is not None and not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as e:
        return f"{e.strerror or type(e).__name__}: {e.filename}" if e.filename else str(e)
    return None


ERROR_LEGEND = (
    "error: steps off / steps allowed, for the comparison nearest its tolerance",
    "       (over every sample and output; a step is one unit of the output format",
    "       at the oracle's largest magnitude)",
)

_STYLES = {"native": "green", "interpreted": "green", "reference": "cyan", "failing": "bold red",
           "not run": "yellow"}


def _table(run):
    from rich.table import Table

    info = run.machine
    mode = "interpreted" if info["interpreted"] else "native"
    table = Table(title=f"lanekit check on {info['device']} ({info['arch']}), Triton {mode}",
                  caption=f"torch {info['torch']} · triton {info['triton']} · python {info['python']}")
    table.add_column("op", no_wrap=True)
    table.add_column("lane")
    table.add_column("status")
    table.add_column("samples", justify="right")
    table.add_column("error", justify="right")
    table.add_column("time", justify="right")
    for r in run.results:
        worst = r.worst()
        error = f"{worst[1].steps:.2f} / {worst[1].allowed:g}" if worst else "—"
        table.add_row(r.op, r.lane, f"[{_STYLES[r.status]}]{r.status}[/]", f"{r.passed}/{r.total}",
                      error, f"{r.seconds:.1f} s")
    return table


def _failures(run):
    from rich.text import Text

    text = Text()
    for r in run.results:
        if r.status == "not run" or (not r.ok and not r.samples):
            text.append(f"\n{r.op} · {r.lane}: {r.status}: {r.note}\n", style=_STYLES[r.status])
        if r.failures:
            text.append(f"\n{r.op} · {r.lane}: {len(r.failures)} of {r.total} samples failed\n", style="bold red")
            for s in r.failures:
                text.append(f"  {s.name}: ", style="bold")
                text.append(f"{s.detail}\n")
    return text


def _matrix(args) -> int:
    from pathlib import Path

    from lanekit import matrix

    path, generated = matrix.render_repo(Path(args.docs) if args.docs else None)
    committed = path.read_text() if path.exists() else ""
    if args.check:
        if committed == generated:
            print(f"{path} is up to date")
            return 0
        sys.stdout.write(matrix.diff(committed, generated))
        print(f"{path} is out of date: run `lanekit matrix`")
        return 1
    path.write_text(generated)
    print(f"wrote {path}")
    return 0


def _interpreted_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _in_compiled_process(args, argv) -> int:
    """Export compiles kernels for absent GPUs, so they must be imported compiled: where this
    process was told to interpret them (TRITON_INTERPRET=1, as under the test suite), the command
    runs in a child process without it. Bad op names are reported here first."""
    import subprocess

    from lanekit.families import get_op

    try:
        for name in getattr(args, "op", None) or ():
            get_op(name)
    except ValueError as e:
        print(f"lanekit {args.command}: op: {e}", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.call([sys.executable, "-m", "lanekit", *argv], env=env)


def _progress(what):
    started = time.perf_counter()

    def show(done, total):
        if done == total or done % 50 == 0:
            print(f"{what}: {done}/{total} compiled ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return show


def _export(args) -> int:
    from pathlib import Path

    from lanekit import export
    from lanekit.families import get_op

    try:
        for name in args.op or ():
            get_op(name)
    except ValueError as e:
        print(f"lanekit export: op: {e}", file=sys.stderr)
        return 2
    try:
        results = export.export(args.target, args.op, Path(args.out), jobs=args.jobs,
                                progress=_progress("lanekit export"))
    except ValueError as e:
        print(f"lanekit export: {e}", file=sys.stderr)
        return 2
    failing = [(s, r) for s, r in results if r.problems]
    lacking = [(s, r) for s, r in results if r.unsupported]
    for spec, report in failing:
        print(f"{spec.target} · {spec.kernel} ({spec.key}; {spec.samples[0]}): {'; '.join(report.problems)}")
    for spec, report in lacking:
        print(f"{spec.target} · {spec.kernel} ({spec.key}; {spec.samples[0]}): unsupported: {report.unsupported}")
    passed = len(results) - len(failing) - len(lacking)
    print(f"{passed} of {len(results)} specializations compiled and passed for {', '.join(args.target)}"
          + (f" ({len(lacking)} unsupported there)" if lacking else "") + f"; wrote {args.out}")
    return 1 if failing else 0


def _targets(args) -> int:
    from pathlib import Path

    from lanekit import export
    from lanekit.matrix import docs_dir
    from lanekit.runtime.targets import TARGETS

    docs = Path(args.docs) if args.docs else docs_dir()
    previous = None
    if not args.recompile and (docs / export.RECORD_FILE).exists():
        try:
            previous = export.read_record(docs / export.RECORD_FILE)
        except ValueError:      # a record of another version: compile everything
            previous = None
    done = export.compile_record(TARGETS, previous, verify=args.verify, seed=args.seed, jobs=args.jobs,
                                 progress=_progress("lanekit targets"))
    print(f"lanekit targets: {done.compiled} specializations compiled, {done.reused} reports kept from "
          f"docs/{export.RECORD_FILE} (fingerprint unchanged)"
          + (f", {done.verified} of those compiled again to verify them (--seed {done.seed})" if done.verified else ""))
    for spec, recorded, compiled in done.mismatches:
        changed = [k for k in recorded if recorded[k] != compiled[k]]
        print(f"{spec.target} · {spec.kernel} ({spec.key}): the record says "
              f"{', '.join(f'{k}={recorded[k]!r}' for k in changed)} but compiling it again gives "
              f"{', '.join(f'{k}={compiled[k]!r}' for k in changed)}")
    if done.mismatches:
        print(f"{len(done.mismatches)} reports of docs/{export.RECORD_FILE} differ from a fresh compile of the same "
              f"fingerprint (the record was edited, or the compiler is not deterministic here): run "
              f"`lanekit targets --recompile`")
    data = export.record(done.results)
    files = {docs / export.RECORD_FILE: export.dumps_record(data),
             docs / export.DOC_FILE: export.render(data)}
    if args.check:
        stale = 0
        for path, generated in files.items():
            committed = path.read_text() if path.exists() else ""
            if committed != generated:
                sys.stdout.write(export.diff(committed, generated, path.name))
                print(f"{path} is out of date: {export.REGENERATE}")
                stale += 1
        if not stale:
            print(f"{len(data['specializations'])} specializations: docs/{export.RECORD_FILE} and "
                  f"docs/{export.DOC_FILE} are up to date")
        return 1 if stale or done.mismatches else 0
    for path, text in files.items():
        path.write_text(text)
        print(f"wrote {path}")
    return 1 if done.mismatches else 0


def _demo(argv: list[str]) -> int:
    _use_gpu_or_interpreter()  # the demo may run the Triton lane
    try:
        from lanekit.demo import main as demo_main
    except ModuleNotFoundError as e:
        if e.name != "lanekit.demo":
            raise
        print("lanekit demo: this version of lanekit has no demo yet", file=sys.stderr)
        return 2
    return demo_main(argv)


if __name__ == "__main__":
    sys.exit(main())
