"""Sweep the fused layers' tile tables on the GPU: `python -m benchmarks.tune_layers [TABLE[:op] ...]`.

For each sweep (NORM, ROTARY, GLU: the tables of lanekit.layers.tuning that the layers read, by
name; ROTARY_MAXNREG and ROTARY_PREFETCH: more of ROTARY's fields, as TABLE_OF maps them), every
candidate replaces this GPU's row in turn and the bench shapes of benchmarks/layers.py are timed;
prints GB/s per candidate, best first. Copy the winners into lanekit/layers/tuning.py by hand, with
a line of reason, and the figures into docs/tuning/layers.md.
"""

from __future__ import annotations

import itertools
import sys

import torch

from benchmarks import layers
from benchmarks.run import bench_graph
from lanekit.layers import tuning
from lanekit.runtime.tuning import arch_id

CANDIDATES = {
    "NORM": ([dict(max_block_n=b, num_warps=w) for b, w in itertools.product((4096, 8192), (4, 8, 16))],
             ["rms_norm", "rms_norm+residual", "layer_norm", "adaln+gated residual"]),
    # each op reads its own fields: apply_rotary block_rows and num_warps, the q-and-k kernels
    # norm_block_rows and norm_num_warps, or quant_block_rows and quant_num_warps
    "ROTARY": ([dict(block_rows=r, num_warps=w, norm_block_rows=r, quant_block_rows=r, norm_num_warps=w,
                     quant_num_warps=w)
                for r, w in itertools.product((8, 16, 32, 64, 128), (1, 2, 4, 8))],
               ["apply_rotary q", "rms_norm_rope q,k", "qk_norm_rope_quant e4m3"]),
    # the quantized q-and-k kernel's register cap (more programs resident: ncu found it
    # occupancy-bound, stalled on loads), at the tiles that led the ROTARY sweep
    "ROTARY_MAXNREG": ([dict(block_rows=32, num_warps=4, quant_block_rows=r, quant_num_warps=w, quant_maxnreg=n)
                        for r, w, n in itertools.product((8, 16), (1, 2), (0, 80, 72, 64, 56))],
                       ["qk_norm_rope_quant e4m3"]),
    # the q-and-k kernels' prefetches (NVIDIA): cos and sin into L1, and into L2 the rows of the
    # same head block about this many programs later, at the tiles and cap that led the sweeps above
    "ROTARY_PREFETCH": ([dict(block_rows=32, num_warps=4, norm_block_rows=8, norm_num_warps=1, quant_block_rows=8,
                              quant_num_warps=1, quant_maxnreg=72, prefetch_rope=p, norm_prefetch_ahead=n,
                              quant_prefetch_ahead=n)
                         for p, n in itertools.product((0, 1), (0, 1024, 2048, 2560, 3072, 3696, 5120))],
                        ["rms_norm_rope q,k", "qk_norm_rope_quant e4m3"]),
    "GLU": ([dict(block_n=b, num_warps=w) for b, w in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16))],
            ["swiglu", "swiglu fused"]),
}
# sweeps of a table's fields beyond its main sweep: the table each one replaces rows of
TABLE_OF = {"ROTARY_MAXNREG": "ROTARY", "ROTARY_PREFETCH": "ROTARY"}


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    arch = arch_id(torch.device("cuda"))
    wanted = sys.argv[1:]  # NORM, ROTARY:qk_norm_rope_quant e4m3, ... (default: every table and op)
    for table_name, (candidates, ops) in CANDIDATES.items():
        if wanted and not any(w.split(":")[0] == table_name for w in wanted):
            continue
        ops = [op for op in ops if not wanted or table_name in wanted or f"{table_name}:{op}" in wanted]
        table = getattr(tuning, TABLE_OF.get(table_name, table_name))
        config_type = type(table["generic"] if table_name != "NORM" else table["generic"][4096])
        saved = dict(table)
        for op in ops:
            case = dict(op=op)
            inputs = layers.make_inputs(case)
            fn = layers._lanekit(case)
            results = []
            for cand in candidates:
                cfg = config_type(**cand)
                table[arch] = {k: cfg for k in saved["generic"]} if table_name == "NORM" else cfg
                try:
                    error = layers.check(case, *inputs)
                    ms = bench_graph(lambda: fn(*inputs)) if error is None else None
                except Exception as exc:  # a config that does not compile or fit
                    error, ms = f"{type(exc).__name__}", None
                results.append((layers.bytes_moved(case) / ms / 1e6 if ms else 0.0, cand, error))
            table.clear()
            table.update(saved)
            results.sort(key=lambda r: -r[0])
            print(f"== {table_name} {op}")
            for gbps, cand, error in results:
                print(f"   {gbps:7.0f} GB/s  {cand}  {error or ''}")
            del inputs
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
