"""Sweep the linear-attention kernels' tiles on this GPU and print the fastest, to fill
linear_attn/tuning.py's row for this architecture: `python -m benchmarks.tune_linear_attn [--quick]`.

Each kernel's launch (``LinearAttnTiles``: state_fwd, output, state_bwd, grad) is swept in turn with
the others held, on benchmarks.linear_attn's cases (chunk_simple_gla, T = 4k and 16k): the forward
for state_fwd and output, forward + backward for state_bwd and grad. Every candidate is checked
against the oracle (benchmarks.linear_attn.check) before it is timed; the fastest stays in the row
for the next kernel's sweep, and the row is printed at the end, beside fla's time when it imports.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import triton

from benchmarks import linear_attn as bench
from lanekit.linear_attn import tuning
from lanekit.linear_attn.tuning import ChunkConfig
from lanekit.runtime.tuning import arch_id

CANDIDATES = {
    "state_fwd": [ChunkConfig(64, bv, w, s, block_k=bk) for bk, bv, w, s in [
        (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (32, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3),
        (64, 128, 8, 3), (32, 32, 2, 3), (0, 64, 8, 2)]],
    "output": [ChunkConfig(64, bv, w, s) for bv, w, s in [
        (128, 8, 2), (128, 4, 2), (64, 4, 2), (64, 4, 3), (128, 8, 3), (64, 8, 2), (32, 4, 2)]],
    "state_bwd": [ChunkConfig(64, bv, w, s, block_k=bk) for bk, bv, w, s in [
        (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (32, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3),
        (32, 32, 2, 3)]],
    "grad": [ChunkConfig(64, bv, w, s) for bv, w, s in [
        (64, 8, 1), (64, 8, 2), (32, 8, 1), (32, 4, 1), (64, 4, 1), (128, 8, 1), (32, 8, 2)]],
}


def _time(case, inputs) -> float:
    return triton.testing.do_bench(bench.runners(case, *inputs)["lanekit"], return_mode="median")


def sweep(arch: str, kernel: str, case) -> None:
    inputs = bench.make_inputs(case)
    results = []
    for cfg in CANDIDATES[kernel]:
        tuning.TILES[arch] = dataclasses.replace(tuning.TILES[arch], **{kernel: cfg})
        try:
            err = bench.check(case, *inputs)
            results.append((float("inf"), cfg, err) if err else (_time(case, inputs), cfg, ""))
        except Exception as exc:  # out of shared memory, say
            results.append((float("inf"), cfg, str(exc).splitlines()[0][:100]))
    results.sort(key=lambda r: r[0])
    tuning.TILES[arch] = dataclasses.replace(tuning.TILES[arch], **{kernel: results[0][1]})
    print(f"{arch} {kernel}: {bench.name(case)}", flush=True)
    for ms, cfg, err in results:
        print(f"   {ms:8.3f} ms  {cfg}  {err}", flush=True)
    for peer, fn in bench.runners(case, *inputs).items():
        if peer != "lanekit":
            print(f"   {triton.testing.do_bench(fn, return_mode='median'):8.3f} ms  {peer}", flush=True)
    del inputs
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tune_linear_attn")
    parser.add_argument("--quick", action="store_true", help="T = 4k only")
    args = parser.parse_args(argv)
    arch = arch_id(torch.device("cuda"))
    tuning.TILES.setdefault(arch, tuning.tiles(torch.device("cuda"), torch.bfloat16))
    for case in bench.cases(args.quick):
        if case["op"] != "chunk_simple_gla":
            continue
        for kernel in (("state_bwd", "grad") if case["backward"] else ("state_fwd", "output")):
            sweep(arch, kernel, case)
    print(f"{arch}: {tuning.TILES[arch]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
