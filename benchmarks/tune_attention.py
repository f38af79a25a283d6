"""Sweep tile configurations of the attention kernels on this GPU and print the fastest per head
dim, to fill attention/tuning.py's tables for this architecture:
`python -m benchmarks.tune_attention [--backward | --fp32] [--dims 64 128]`. Every candidate is
checked against the oracle before it is timed. The backward sweep times forward + backward, first
over the dK/dV kernel's tiles, then over the dQ kernel's. --fp32 sweeps the forward's fp32 table
(FLASH_ATTN_FWD_FP32: no tensor cores, the products on the FMA units) at benchmarks.attention_fp32's
shapes."""

from __future__ import annotations

import argparse

import torch
import triton

from benchmarks import attention, attention_fp32, attention_train
from lanekit.attention import tuning
from lanekit.runtime.tuning import TileConfig, arch_id

CANDIDATES = [TileConfig(bm, bn, w, s) for bm, bn, w, s in [
    (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3),
    (64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 4), (128, 128, 4, 3),
]]
# fp32: the generic rows (64 x 64 up to D=64, 64 x 32 at D=128, 32 x 32 at D=256), and small tiles
# (the FMA-unit products hold a tile's operands in registers: at 64 x 32 and D=128 ptxas spills
# about 7 KB a thread on sm80 and sm90)
FP32_CANDIDATES = [TileConfig(bm, bn, w, s) for bm, bn, w, s in [
    (64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2), (32, 32, 4, 1), (32, 16, 4, 2), (16, 32, 4, 2),
    (16, 16, 4, 2), (16, 16, 4, 1), (16, 16, 8, 1), (16, 16, 2, 2),
]]
BWD_DKDV_CANDIDATES = [TileConfig(bm, bn, w, s) for bm, bn, w, s in [
    (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (32, 128, 8, 2), (64, 64, 4, 3),
]]
BWD_DQ_CANDIDATES = [TileConfig(bm, bn, w, s) for bm, bn, w, s in [
    (128, 64, 8, 3), (64, 32, 4, 3), (128, 32, 8, 3), (128, 128, 8, 2),
]]


def sweep(module, case, table, D, candidates) -> None:
    """Time ``module``'s lanekit runner on ``case`` with each candidate in ``table[D]``; print
    them fastest first, then the peers, and leave the fastest in the table."""
    inputs = module.make_inputs(case)
    results = []
    for cfg in candidates:
        table[D] = cfg
        try:
            err = module.check(case, *inputs)
            if err:
                results.append((0.0, cfg, err))
                continue
            ms = triton.testing.do_bench(module.runners(case, *inputs)["lanekit"], return_mode="median")
            results.append((module.flops(case) / ms / 1e9, cfg, ""))
        except Exception as exc:  # out of shared memory, say
            results.append((0.0, cfg, str(exc).splitlines()[0][:100]))
    results.sort(key=lambda r: -r[0])
    table[D] = results[0][1]
    print(f"{arch_id(torch.device('cuda'))} {module.name(case)}", flush=True)
    for tf, cfg, err in results:
        print(f"   {tf:7.1f} TFLOP/s  {cfg}  {err}", flush=True)
    for peer, fn in module.runners(case, *inputs).items():
        if peer != "lanekit":
            print(f"   {module.flops(case) / triton.testing.do_bench(fn, return_mode='median') / 1e9:7.1f} "
                  f"TFLOP/s  {peer}", flush=True)


def backward(dims) -> None:
    arch = arch_id(torch.device("cuda"))
    dkdv = tuning.FLASH_ATTN_BWD_DKDV.setdefault(arch, dict(tuning.FLASH_ATTN_BWD_DKDV["generic"]))
    dq = tuning.FLASH_ATTN_BWD_DQ.setdefault(arch, dict(tuning.FLASH_ATTN_BWD_DQ["generic"]))
    for D in dims:
        for causal in (False, True):
            case = dict(D=D, S=4096, causal=causal, B=attention.TOKENS // 4096, H=2048 // D)
            sweep(attention_train, case, dkdv, D, BWD_DKDV_CANDIDATES)
            sweep(attention_train, case, dq, D, BWD_DQ_CANDIDATES)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tune_attention")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--backward", action="store_true", help="sweep the backward's tiles")
    which.add_argument("--fp32", action="store_true", help="sweep the fp32 forward's tiles")
    parser.add_argument("--dims", type=int, nargs="*", default=[64, 128])
    args = parser.parse_args()
    if args.backward:
        backward(args.dims)
        return
    arch = arch_id(torch.device("cuda"))
    if args.fp32:
        table = tuning.FLASH_ATTN_FWD_FP32.setdefault(arch, dict(tuning.FLASH_ATTN_FWD_FP32["generic"]))
        for case in attention_fp32.cases():
            if case["D"] in args.dims:
                sweep(attention_fp32, case, table, case["D"], FP32_CANDIDATES)
        return
    table = tuning.FLASH_ATTN_FWD.setdefault(arch, dict(tuning.FLASH_ATTN_FWD["generic"]))
    for D in args.dims:
        for causal in (False, True):
            case = dict(D=D, S=4096, causal=causal, B=attention.TOKENS // 4096, H=2048 // D)
            sweep(attention, case, table, D, CANDIDATES)

if __name__ == "__main__":
    main()
