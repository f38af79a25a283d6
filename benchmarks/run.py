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

from benchmarks import (attention, attention_fp8, attention_fp32, attention_train, decode, eager, gemm, gemm_4bit,
                        generate, layers, linear_attn, mla, moe, prefill, quant, report, train)

FAMILIES = {"attention": attention, "attention_train": attention_train, "attention_fp32": attention_fp32,
            "attention_fp8": attention_fp8,
            "layers": layers, "decode": decode, "prefill": prefill, **moe.FAMILIES,
            **quant.FAMILIES, **gemm.FAMILIES, **gemm_4bit.FAMILIES, **mla.FAMILIES, **linear_attn.FAMILIES, "eager": eager,
            **train.FAMILIES, "generate": generate}
#: Names that stand for several families: ``python -m benchmarks.run moe``.
GROUPS = {"moe": tuple(moe.FAMILIES), "quant": tuple(quant.FAMILIES), "gemm": tuple(gemm.FAMILIES),
          "gemm_4bit": tuple(gemm_4bit.FAMILIES),
          "mla": tuple(mla.FAMILIES), "linear_attn": tuple(linear_attn.FAMILIES), "train": tuple(train.FAMILIES)}


def machine() -> dict:
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }


def copy_bandwidth() -> float:
    """GB/s of a device-to-device copy of 1 GiB (bytes read plus bytes written), the ceiling of a
    memory-bound kernel on this GPU."""
    src = torch.empty(2 ** 29, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return moved / ms / 1e6


def bench(fn) -> float:
    """Median milliseconds of ``fn``."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph(fn) -> float:
    """Median milliseconds of ``fn`` replayed from a CUDA graph: the GPU's time alone, without the
    host's launch overhead (which exceeds the GPU time of a kernel moving a few hundred MB)."""
    for _ in range(3):  # compile and autotune outside the graph
        fn()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def case_named(module, name: str) -> dict:
    """The case of family ``module`` that benchmarks.run prints as ``name``, or for a family with a
    case_named of its own (decode) any case of that form. Raises ValueError naming the expected."""
    cases = {module.name(c): c for c in module.cases(False)}
    if name in cases:
        return cases[name]
    if hasattr(module, "case_named"):
        return module.case_named(name)
    raise ValueError(f"case: expected one of {sorted(cases)}, got {name!r}")


def is_timed(module) -> bool:
    """Families whose figure is microseconds per call on the host's clock (lower is better)."""
    return getattr(module, "UNIT", "TFLOP/s") == "us"


def is_rate(module) -> bool:
    """Families whose figure is a rate the family measures itself (generation's tokens per second,
    higher is better): ``module.measure(case, fn)``."""
    return getattr(module, "UNIT", "TFLOP/s") == "tokens/s"


def is_memory_bound(module) -> bool:
    """GB/s for memory-bound families (bytes_moved), TFLOP/s for compute-bound ones (flops)."""
    return getattr(module, "UNIT", "TFLOP/s") == "GB/s"


def work(module, case) -> float:
    """The case's bytes moved or flops, as its family counts them."""
    return module.bytes_moved(case) if is_memory_bound(module) else module.flops(case)


def measure(module, case, fn) -> float:
    """fn's GB/s or TFLOP/s on the case, timed from a CUDA graph where the family asks for it; or,
    for a family in microseconds, fn's wall-clock time per call, the host's included."""
    if is_timed(module):
        return moe.host_us(fn)
    if is_rate(module):
        return module.measure(case, fn)
    timer = bench_graph if getattr(module, "CUDA_GRAPHS", False) else bench
    return work(module, case) / timer(fn) / (1e6 if is_memory_bound(module) else 1e9)


def run_family(module, quick: bool, console: Console) -> list[dict]:
    rows = []
    for case in module.cases(quick):
        inputs = module.make_inputs(case)
        try:
            error = module.check(case, *inputs)
        except Exception as exc:  # a case that cannot run is reported, and the others still run
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        gbps = is_memory_bound(module)
        if is_timed(module):
            row = {"case": module.name(case), "error": error, "us": {}}
            key = "us"
        elif is_rate(module):
            row = {"case": module.name(case), "error": error, "tok_s": {}}
            key = "tok_s"
        else:
            key = "gbps" if gbps else "tflops"
            row = {"case": module.name(case), ("bytes" if gbps else "flops"): work(module, case), "error": error,
                   key: {}}
        if error is None:
            for peer, fn in module.runners(case, *inputs).items():
                try:
                    row[key][peer] = measure(module, case, fn)
                except Exception as exc:  # a peer without a kernel for this shape
                    row[key][peer] = None
                    console.print(f"[yellow]{row['case']}: {peer} did not run: {str(exc).splitlines()[0][:120]}")
            if row[key].get("lanekit") is None:  # no figure of ours: the row says why
                row["error"] = "lanekit did not run"
        rows.append(row)
        # a line per case as it is measured: a run cut short still shows what it measured
        console.print(f"[dim]{row['case']}: " + (row["error"] or ", ".join(
            f"{peer} {v:.1f}" if v is not None else f"{peer} n/a" for peer, v in row[key].items())))
        del inputs
        torch.cuda.empty_cache()
    return rows


def render(rows: list[dict], console: Console, title: str, copy_gbps: float | None) -> None:
    peers = report.peers_of(rows)
    table = Table(title=title)
    for i, name in enumerate(report.header(peers, rows, copy_gbps)):
        table.add_column(name, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*report.row_cells(r, peers, copy_gbps), style="red" if r["error"] else None)
    console.print(table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run")
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--quick", action="store_true", help="fewer, smaller cases")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    args.families = [f for name in args.families for f in GROUPS.get(name, (name,))]
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        parser.error(f"families: expected names from {sorted(FAMILIES) + sorted(GROUPS)}, got {unknown}")
    if not torch.cuda.is_available():
        print("benchmarks need a GPU; none is visible", file=sys.stderr)
        return 2
    console = Console(width=200)
    info = machine()
    if any(is_memory_bound(FAMILIES[f]) for f in args.families):
        info["copy_gbps"] = copy_bandwidth()
    console.print(info)
    results = {"machine": info, "families": {}}
    wrong = False
    for fam in args.families:
        rows = run_family(FAMILIES[fam], args.quick, console)
        render(rows, console, f"{fam} ({info['gpu']}, torch {info['torch']}, triton {info['triton']})",
               info.get("copy_gbps"))
        for line in getattr(FAMILIES[fam], "annotate", lambda rows: [])(rows):   # a family's lines under its table
            console.print(line)
        results["families"][fam] = rows
        wrong |= any(r["error"] for r in rows)
        if args.json:   # after every family: a run cut short keeps the families it finished
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
