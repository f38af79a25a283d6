"""Sweep the decode kernel's tile and split count on the GPU: `python -m benchmarks.tune_decode [--quick] [--tiles=BN/W/S,...] [--splits=S,...] [CASE ...]`.

A CASE is a bench case's name or another of its form (benchmarks.decode.case_named): "decode
Sk=32k paged 4", "decode Sk=4k paged 16 in order" (pages handed out in order, not shuffled).

For each bench case of benchmarks/decode.py, every (block_n, warps, stages) replaces this GPU's rows
of every decode table (FLASH_ATTN_KVCACHE and its _PER_KEY_PAGES, _SHORT: the candidate is what
the case runs, whatever its layout and length) and every split count is timed (CUDA
graphs), each candidate checked against the oracle first (a wrong one is printed, not timed);
prints every candidate's GB/s, best first, beside SDPA's cuDNN backend (the bar) timed in the same run. Copy
the winners into attention/tuning.py (and the heuristic) by hand, with the figures as comment.
"""

from __future__ import annotations

import itertools
import sys

import torch

from benchmarks import decode
from benchmarks.run import bench_graph
from lanekit.attention import tuning
from lanekit.runtime.tuning import TileConfig, arch_id

# (block_n, warps, stages): the rows that led earlier sweeps, with room around them; 16 and 32 keys
# a step make pages of 16 whole blocks (one lookup per block, not per key)
TILES = [TileConfig(64, bn, w, s) for bn, w, s in (
    (128, 8, 2), (128, 8, 3), (128, 4, 2), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3),
    (32, 4, 3), (32, 4, 4), (32, 2, 4), (16, 2, 4), (16, 2, 6), (16, 4, 4), (16, 1, 6))]
SPLITS = (1, 2, 3, 4)
# --quick: the 32k cases (issue 4's bar), the tiles and splits that led the last full sweep's
QUICK_TILES = [TileConfig(64, bn, w, s) for bn, w, s in itertools.product((64, 128), (4, 8), (2, 3, 4))]
QUICK_SPLITS = (1, 2, 3, 4)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    arch = arch_id(torch.device("cuda"))
    tables = (tuning.FLASH_ATTN_KVCACHE, tuning.FLASH_ATTN_KVCACHE_PER_KEY_PAGES, tuning.FLASH_ATTN_KVCACHE_SHORT)
    saved = [t.get(arch) for t in tables]

    def restore():  # this GPU's shipped rows back in every table
        for t, rows in zip(tables, saved):
            if rows is None:
                t.pop(arch, None)
            else:
                t[arch] = rows

    quick = "--quick" in sys.argv[1:]
    tiles, splits_swept = (QUICK_TILES, QUICK_SPLITS) if quick else (TILES, SPLITS)
    args = sys.argv[1:]
    only = [a for a in args if not a.startswith("--")]  # case names, e.g. "decode Sk=4k paged 16"
    for a in args:  # --tiles=BN/WARPS/STAGES,... and --splits=S,...: a sweep of one's own
        if a.startswith("--tiles="):
            tiles = [TileConfig(64, *map(int, t.split("/"))) for t in a[8:].split(",")]
        elif a.startswith("--splits="):
            splits_swept = tuple(map(int, a[9:].split(",")))
    for case in [decode.case_named(n) for n in only] if only else decode.cases():
        if quick and case["sk"] < 32768:
            continue
        q, k, v, kc, vc, seqlens, table = decode.make_inputs(case)
        restore()  # the shipped rows, for the heuristic's own pick
        picked = decode._splits(case, q, kc, vc, table)
        cudnn = bench_graph(decode.runners(case, q, k, v, kc, vc, seqlens, table)["sdpa-cudnn"])
        oracle = decode.expected(q, k, v)  # once per case: every candidate is checked against it
        results = []
        for tile, splits in itertools.product(tiles, splits_swept):
            for t in tables:  # the candidate for every layout and length, per-key pages included
                t[arch] = {key: tile for key in tuning.FLASH_ATTN_KVCACHE["generic"]}
            try:
                error = decode.check(case, q, k, v, kc, vc, seqlens, table, num_splits=splits, oracle=oracle)
                if error:
                    print(f"{tile} splits={splits}: WRONG {error}")
                    continue
                ms = bench_graph(decode.runners(case, q, k, v, kc, vc, seqlens, table, splits)["lanekit"])
                results.append((decode.bytes_moved(case) / ms / 1e6, tile, splits))
            except Exception as exc:  # a tile that does not compile or fit
                print(f"{tile} splits={splits}: {type(exc).__name__}")
        print(f"== {decode.name(case)} (heuristic picks {picked} splits; SDPA cuDNN on the contiguous "
              f"cache {decode.bytes_moved(case) / cudnn / 1e6:.0f} GB/s)")
        for gbps, tile, splits in sorted(results, key=lambda r: -r[0]):
            print(f"  {gbps:7.0f} GB/s  block_n={tile.block_n} warps={tile.num_warps} stages={tile.num_stages} splits={splits}")
        del q, k, v, kc, vc, oracle
        torch.cuda.empty_cache()
    restore()
    return 0


if __name__ == "__main__":
    sys.exit(main())
