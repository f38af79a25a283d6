"""Sweep the MLA decode tile and split count on the GPU: `python -m benchmarks.tune_mla [--quick] [--tiles=BH/BN/W/S,...] [--splits=S,...]`.

For each case of benchmarks/mla.py (CUDA graphs; --quick: the bf16 ones), every tile (rows of
(query, head) pairs, cached rows a step, warps, stages) replaces this GPU's row of
attention.tuning.FLASH_MLA_KVCACHE, and every split count (0: the heuristic's) is timed, each
candidate checked against the float64 oracle first (a wrong or failing one is printed, not timed).
Prints GB/s of the latent cache and TFLOP/s, best first per case. Copy the winner into
attention/tuning.py by hand with its figures in docs/tuning/mla.md.
"""

from __future__ import annotations

import sys

import torch

from benchmarks import mla
from benchmarks.run import bench_graph
from lanekit.attention import tuning
from lanekit.runtime.tuning import TileConfig, arch_id

TILES = [TileConfig(*t) for t in ((64, 32, 8, 3), (64, 32, 8, 2), (64, 64, 8, 2), (64, 16, 8, 4), (64, 32, 8, 4),
                                  (32, 32, 8, 3), (32, 64, 4, 2))]
SPLITS = (0, 1, 2, 4)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    arch = arch_id(torch.device("cuda"))
    saved = tuning.FLASH_MLA_KVCACHE.get(arch)
    args = sys.argv[1:]
    tiles, splits_swept = TILES, SPLITS
    for a in args:
        if a.startswith("--tiles="):
            tiles = [TileConfig(*map(int, t.split("/"))) for t in a[8:].split(",")]
        elif a.startswith("--splits="):
            splits_swept = tuple(map(int, a[9:].split(",")))
    cases = [c for c in mla.cases(False) if "--quick" not in args or c["cache"] == "bf16"]
    try:
        for c in cases:
            inputs = mla.make_inputs(c)
            q, cache, scale, table, seqlens, meta = inputs
            results = []
            for cfg in tiles:
                tuning.FLASH_MLA_KVCACHE[arch] = cfg
                for splits in splits_swept:
                    def run():
                        return mla.lanekit.flash_mla_with_kvcache(q, cache, table, seqlens, mla.DV, None, splits,
                                                                  k_cache_scale=scale, max_seqlen_k=c["sk"])
                    try:
                        out, lse = run()
                        error = _check(c, q, cache, scale, table, seqlens, out, lse)
                        if error:
                            print(f"{mla.name(c)} {cfg} splits {splits}: wrong: {error}", flush=True)
                            continue
                        ms = bench_graph(run)
                    except Exception as exc:  # a tile that does not compile or fit
                        print(f"{mla.name(c)} {cfg} splits {splits}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                        continue
                    gbps = mla.cache_bytes(c) / ms / 1e6
                    results.append((gbps, cfg, splits))
                    print(f"{mla.name(c)} {cfg} splits {splits}: {gbps:.0f} GB/s, "
                          f"{mla.flops(c) / ms / 1e9:.0f} TFLOP/s", flush=True)
            print(f"== {mla.name(c)}, best first:")
            for gbps, cfg, splits in sorted(results, key=lambda r: -r[0])[:5]:
                print(f"   {gbps:.0f} GB/s  {cfg}  splits {splits}")
            del inputs
            torch.cuda.empty_cache()
    finally:
        if saved is None:
            tuning.FLASH_MLA_KVCACHE.pop(arch, None)
        else:
            tuning.FLASH_MLA_KVCACHE[arch] = saved
    return 0


def _check(c, q, cache, scale, table, seqlens, out, lse) -> str | None:
    """The first and last sequences against the oracle, as benchmarks.mla.check does."""
    from lanekit.attention.registry import ATTENTION_FWD
    from lanekit.reference import mla as ref
    from lanekit.testing import compare, upcast

    seqs = [0, q.shape[0] - 1]
    want, want_lse = ref.flash_mla_with_kvcache(upcast(q[seqs]), cache, table[seqs], seqlens[seqs], mla.DV,
                                                softmax_scale=mla.D ** -0.5, k_cache_scale=scale)
    for got, expected, tol in ((out[seqs], want, ATTENTION_FWD), (lse[seqs], want_lse, "lse")):
        result = compare(got, expected, tol)
        if not result.ok:
            return result.detail
    return None


if __name__ == "__main__":
    raise SystemExit(main())
