"""A/B timing of one benchmark case across source trees, on the GPU:

    mkdir -p .gpu/old && git archive <commit> src | tar -x -C .gpu/old
    python -m benchmarks.ab layers "qk_norm_rope_quant e4m3" old=.gpu/old/src new=src --rounds 3
    python -m benchmarks.ab gemm_graphs "scaled_mm tensor M=1024 K=4096 N=4096" \
        row=src wgmma=src,GEMM.imprecise_acc=128

A tree may carry settings after a comma, ``TABLE.field=value`` each (as ``run_case --set``): they
replace fields of that GPU's tuning rows in its process, so one checkout A/Bs a row's candidate.

Each NAME=SRC tree's lanekit is timed in a process of its own (PYTHONPATH=SRC ahead of this
checkout, whose benchmarks build the inputs and time the call, so a tree must be recent enough for
them to import), the trees alternating round by round: a GPU's figure for one kernel moves by a
few percent between machines and over minutes, so only figures taken side by side in one run
compare two versions. Each line gives the case's lanekit figure, timed as benchmarks.run times it
(CUDA graphs where the family uses them), and the copy bandwidth measured in the same process.
The device tool carries git-ignored trees with ``carry=[".gpu"]``; ``scripts/gpu.sh ab`` runs this
with AB_ARGS.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _one(family: str, case: str, settings: list[str]) -> str:
    """The case's lanekit figure and the copy bandwidth, timed in this process, with ``settings``
    (TABLE.field=value) applied to this GPU's tuning rows first."""
    import torch

    from benchmarks import run, tables
    from lanekit.runtime import tuning

    tables.apply_settings(settings, tuning.arch_id(torch.device("cuda")))

    module = run.FAMILIES[family]
    c = run.case_named(module, case)
    inputs = module.make_inputs(c)
    error = module.check(c, *inputs)
    figure = run.measure(module, c, module.runners(c, *inputs)["lanekit"])
    del inputs
    torch.cuda.empty_cache()
    unit = "GB/s" if run.is_memory_bound(module) else "TFLOP/s"
    return f"{figure:8.1f} {unit}  copy {run.copy_bandwidth():.0f} GB/s" + (f"  CHECK FAILED: {error}" if error else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("family", help="a benchmarks.run family (layers, decode, prefill, attention, ...)")
    p.add_argument("case", help="the case's name as benchmarks.run prints it (decode: or another of its form)")
    p.add_argument("trees", nargs="*", metavar="NAME=SRC[,TABLE.field=value...]",
                   help="source trees holding lanekit/, each with settings of its tuning rows if any")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # a child: time here
    p.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)   # the child's settings
    args = p.parse_args(argv)
    if args.one:
        print(_one(args.family, args.case, args.set), flush=True)
        return 0
    from benchmarks import run   # the names checked before any child starts

    if args.family not in run.FAMILIES:
        p.error(f"family: expected one of {sorted(run.FAMILIES)}, got {args.family!r}")
    try:
        run.case_named(run.FAMILIES[args.family], args.case)
    except ValueError as exc:
        p.error(str(exc))
    from benchmarks import tables

    trees = []
    for spec in args.trees:
        name, sep, rest = spec.partition("=")
        src, *settings = rest.split(",")
        if not sep or not (Path(src) / "lanekit").is_dir():
            p.error(f"trees: expected NAME=SRC with SRC holding lanekit/, got {spec!r}")
        for item in settings:     # the form checked here, before any child starts
            if "." not in item.partition("=")[0] or tables.table(item.partition(".")[0]) is None:
                p.error(f"trees: expected settings TABLE.field=value after SRC, got {item!r} in {spec!r}")
        trees.append((name, str(Path(src).resolve()), settings))
    if not trees:
        p.error("trees: expected at least one NAME=SRC")
    width = max(len(n) for n, _, _ in trees)
    failed = False
    for rnd in range(args.rounds):
        for name, src, settings in trees:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(ROOT)]))
            sets = [a for item in settings for a in ("--set", item)]
            child = subprocess.run([sys.executable, "-m", "benchmarks.ab", args.family, args.case, "--one", *sets],
                                   env=env, cwd=ROOT, capture_output=True, text=True)
            lines = child.stdout.strip().splitlines()
            if child.returncode or not lines:
                failed = True
                line = "FAILED: " + (child.stderr.strip().splitlines() or ["no output"])[-1]
            else:
                line = lines[-1]
            print(f"round {rnd}  {name:<{width}}  {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
