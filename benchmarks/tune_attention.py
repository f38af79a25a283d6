"""Sweep tile configurations of the attention forward on this GPU and print the fastest per head
dim, to fill runtime/tuning.py's table for this architecture: `python -m benchmarks.tune_attention`.
Every candidate is checked against the oracle before it is timed."""

from __future__ import annotations

import torch
import triton

from benchmarks import attention
from lanekit.runtime import tuning
from lanekit.runtime.tuning import TileConfig

CANDIDATES = [TileConfig(bm, bn, w, s) for bm, bn, w, s in [
    (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3),
    (64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 4), (128, 128, 4, 3),
]]


def main() -> None:
    arch = tuning.arch_id(torch.device("cuda"))
    table = tuning.FLASH_ATTN_FWD.setdefault(arch, dict(tuning.FLASH_ATTN_FWD["generic"]))
    for D in (64, 128):
        for causal in (False, True):
            case = dict(D=D, S=4096, causal=causal, B=attention.TOKENS // 4096, H=2048 // D)
            q, k, v = attention.make_inputs(case)
            results = []
            for cfg in CANDIDATES:
                table[D] = cfg
                try:
                    err = attention.check(case, q, k, v)
                    if err:
                        results.append((0.0, cfg, err))
                        continue
                    ms = triton.testing.do_bench(attention.runners(case, q, k, v)["lanekit"], return_mode="median")
                    results.append((attention.flops(case) / ms / 1e9, cfg, ""))
                except Exception as exc:  # out of shared memory, say
                    results.append((0.0, cfg, str(exc).splitlines()[0][:100]))
            results.sort(key=lambda r: -r[0])
            print(f"{arch} {attention.name(case)}")
            for tf, cfg, err in results:
                print(f"   {tf:7.1f} TFLOP/s  {cfg}  {err}")


if __name__ == "__main__":
    main()
