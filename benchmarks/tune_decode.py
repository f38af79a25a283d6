"""Sweep the decode kernel's tile and split count on the GPU: `python -m benchmarks.tune_decode [--quick]`.

For each bench case of benchmarks/decode.py, every (block_n, warps, stages) replaces this GPU's rows
of FLASH_ATTN_KVCACHE and FLASH_ATTN_KVCACHE_PER_KEY_PAGES and every split count is timed (CUDA
graphs); prints GB/s best first. Copy the winners into tuning.py (and the heuristic) by hand, with
the figures as comment.
"""

from __future__ import annotations

import itertools
import sys

import torch

import lanekit
from benchmarks import decode
from benchmarks.run import bench_graph
from lanekit.runtime import tuning

TILES = [tuning.TileConfig(64, bn, w, s) for bn, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]
SPLITS = (1, 2, 4, 8, 16)
# --quick: the 32k cases (issue 4's bar), the tiles and splits that led the last full sweep's
QUICK_TILES = [tuning.TileConfig(64, bn, w, s) for bn, w, s in itertools.product((64, 128), (4, 8), (2, 3, 4))]
QUICK_SPLITS = (1, 2, 3, 4)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    arch = tuning.arch_id(torch.device("cuda"))
    tables = (tuning.FLASH_ATTN_KVCACHE, tuning.FLASH_ATTN_KVCACHE_PER_KEY_PAGES)
    saved = [t.get(arch) for t in tables]
    quick = "--quick" in sys.argv[1:]
    tiles, splits_swept = (QUICK_TILES, QUICK_SPLITS) if quick else (TILES, SPLITS)
    for case in decode.cases():
        if (case["layout"] == "paged 256" and not quick) or (quick and case["sk"] < 32768):
            continue
        q, k, v, kc, vc, seqlens, table = decode.make_inputs(case)
        results = []
        for tile, splits in itertools.product(tiles, splits_swept):
            for t in tables:  # the candidate for every layout, per-key pages included
                t[arch] = {key: tile for key in tuning.FLASH_ATTN_KVCACHE["generic"]}
            try:
                ms = bench_graph(lambda: lanekit.flash_attn_with_kvcache(
                    q, kc, vc, cache_seqlens=seqlens, block_table=table, num_splits=splits))
                results.append((decode.bytes_moved(case) / ms / 1e6, tile, splits))
            except Exception as exc:  # a tile that does not compile or fit
                print(f"{tile} splits={splits}: {type(exc).__name__}")
        print(f"== {decode.name(case)} (heuristic picks {decode._splits(case)} splits)")
        for gbps, tile, splits in sorted(results, key=lambda r: -r[0])[:8]:
            print(f"  {gbps:7.0f} GB/s  block_n={tile.block_n} warps={tile.num_warps} stages={tile.num_stages} splits={splits}")
        del q, k, v, kc, vc
        torch.cuda.empty_cache()
    for t, rows in zip(tables, saved):
        if rows is None:
            t.pop(arch, None)
        else:
            t[arch] = rows
    return 0


if __name__ == "__main__":
    sys.exit(main())
