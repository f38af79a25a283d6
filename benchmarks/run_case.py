"""Run one benchmark case's lanekit call a few times, for a profiler to watch:

    ncu --clock-control none -k regex:_norm_fwd --launch-skip 2 --launch-count 1 \
        python -m benchmarks.run_case layers adaln

Nothing is timed or checked here; ``benchmarks.run`` does that.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.run import FAMILIES


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run_case")
    p.add_argument("family", choices=sorted(FAMILIES))
    p.add_argument("case", help="the case's name as benchmarks.run prints it")
    p.add_argument("--repeat", type=int, default=4)
    args = p.parse_args(argv)
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
