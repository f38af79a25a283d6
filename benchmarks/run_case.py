"""Run one benchmark case's lanekit call a few times, for a profiler to watch:

    ncu --clock-control none -k regex:_norm_fwd --launch-skip 2 --launch-count 1 \
        python -m benchmarks.run_case layers adaln

The case is one of benchmarks.run's, or for decode any of their form (benchmarks.decode.case_named:
"decode Sk=4k paged 16 in order"). Nothing is timed or checked here; ``benchmarks.run`` does that.
``--set TABLE.field=value`` (repeatable) first replaces a field of this GPU's row of a tuning table,
to profile a candidate: ``--set ROTARY.quant_block_rows=16``.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import tables
from benchmarks.run import FAMILIES, case_named
from lanekit.runtime import tuning


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run_case")
    p.add_argument("family", choices=sorted(FAMILIES))
    p.add_argument("case", help="the case's name as benchmarks.run prints it (decode: or another of its form)")
    p.add_argument("--repeat", type=int, default=4)
    p.add_argument("--set", action="append", default=[], metavar="TABLE.field=value")
    args = p.parse_args(argv)
    try:
        tables.apply_settings(args.set, tuning.arch_id(torch.device("cuda")))
    except ValueError as exc:
        p.error(f"--set: {exc}")
    module = FAMILIES[args.family]
    try:
        case = case_named(module, args.case)
    except ValueError as exc:
        p.error(str(exc))
    inputs = module.make_inputs(case)
    fn = module.runners(case, *inputs)["lanekit"]
    for _ in range(args.repeat):
        fn()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
