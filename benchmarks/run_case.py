"""Run one benchmark case's lanekit call a few times, for a profiler to watch:

    ncu --clock-control none -k regex:_norm_fwd --launch-skip 2 --launch-count 1 \
        python -m benchmarks.run_case layers adaln

Nothing is timed or checked here; ``benchmarks.run`` does that. ``--set TABLE.field=value``
(repeatable) first replaces a field of this GPU's row of a tuning table, to profile a candidate:
``--set ROTARY.quant_block_rows=16``.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from benchmarks.run import FAMILIES
from lanekit.runtime import tuning


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run_case")
    p.add_argument("family", choices=sorted(FAMILIES))
    p.add_argument("case", help="the case's name as benchmarks.run prints it")
    p.add_argument("--repeat", type=int, default=4)
    p.add_argument("--set", action="append", default=[], metavar="TABLE.field=value")
    args = p.parse_args(argv)
    arch = tuning.arch_id(torch.device("cuda"))
    for item in args.set:
        name, value = item.split("=", 1)
        table_name, field = name.split(".", 1)
        table = getattr(tuning, table_name)
        table[arch] = dataclasses.replace(table.get(arch, table["generic"]), **{field: int(value)})
    module = FAMILIES[args.family]
    cases = {module.name(c): c for c in module.cases(False)}
    if args.case not in cases:
        p.error(f"case: expected one of {sorted(cases)}, got {args.case!r}")
    case = cases[args.case]
    inputs = module.make_inputs(case)
    fn = module.runners(case, *inputs)["lanekit"]
    for _ in range(args.repeat):
        fn()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
