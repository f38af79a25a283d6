"""The benchmark runner: `python -m benchmarks.run [attention] [--quick] [--json PATH] [--sweep]`.

Every case runs its correctness check first and reports no speed for a wrong result. Timings are
medians of triton.testing.do_bench; figures are printed beside the peers' from the same run, with
the ratio lanekit / peer. GPU only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
import triton
from rich.console import Console
from rich.table import Table

from benchmarks import attention, attention_train, report

FAMILIES = {"attention": attention, "attention_train": attention_train}


def machine() -> dict:
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }


def bench(fn) -> float:
    """Median milliseconds of ``fn``."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def run_family(module, quick: bool, console: Console) -> list[dict]:
    rows = []
    for case in module.cases(quick):
        inputs = module.make_inputs(case)
        error = module.check(case, *inputs)
        row = {"case": module.name(case), "flops": module.flops(case), "error": error, "tflops": {}}
        if error is None:
            for peer, fn in module.runners(case, *inputs).items():
                try:
                    ms = bench(fn)
                    row["tflops"][peer] = module.flops(case) / ms / 1e9
                except Exception as exc:  # a peer without a kernel for this shape
                    row["tflops"][peer] = None
                    console.print(f"[yellow]{row['case']}: {peer} did not run: {str(exc).splitlines()[0][:120]}")
        rows.append(row)
        del inputs
        torch.cuda.empty_cache()
    return rows


def render(rows: list[dict], console: Console, title: str) -> None:
    peers = report.peers_of(rows)
    table = Table(title=title)
    for i, name in enumerate(report.header(peers)):
        table.add_column(name, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*report.row_cells(r, peers), style="red" if r["error"] else None)
    console.print(table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run")
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--quick", action="store_true", help="fewer, smaller cases")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks need a GPU; none is visible", file=sys.stderr)
        return 2
    console = Console(width=200)
    info = machine()
    console.print(info)
    results = {"machine": info, "families": {}}
    wrong = False
    for fam in args.families:
        rows = run_family(FAMILIES[fam], args.quick, console)
        render(rows, console, f"{fam} ({info['gpu']}, torch {info['torch']}, triton {info['triton']})")
        results["families"][fam] = rows
        wrong |= any(r["error"] for r in rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
