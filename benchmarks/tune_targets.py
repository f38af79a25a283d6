"""Choose a target's tile configurations from the compiler's resource report, with no GPU.

`python -m benchmarks.tune_targets --target gfx1201 [--sweep attn_fwd ...] [--jobs N]`

For each sweep (a tuning table, the ops whose samples exercise it and the kernel it configures),
every candidate row is put in the table for that target, the samples' launches are captured and
compiled for the target (lanekit.runtime.targets), and the compiler's report is printed per bucket:
VGPRs (registers), shared memory / LDS, scratch spill bytes, matrix instructions. The choice per
bucket is the largest tile (rows x columns) whose every specialization passes the target's checks
(compiles, uses the matrix instructions, fits in shared memory, spills nothing), then the one with
more stages, then fewer warps; where none passes, the one that spills least (which then needs an
allowance, with its reason, in lanekit.runtime.targets.SPILL_ALLOWANCES). It is printed as the row
to write in the family's tuning.py (lanekit.layers.tuning, ...).

This chooses what compiles and fits; speed is for benchmarks on the GPU itself (tune_attention.py).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Callable

from benchmarks import tables
from lanekit.layers.tuning import RotaryConfig
from lanekit.rnn.tuning import RnnTileConfig
from lanekit.runtime.targets import TARGETS
from lanekit.runtime.tuning import TileConfig


@dataclass(frozen=True)
class Sweep:
    table: str                       # a tuning table's name (benchmarks.tables.table)
    ops: tuple[str, ...]             # whose samples launch the kernel
    kernels: tuple[str, ...]
    bucket: Callable[[dict], int]    # a specialization's constexprs -> the table's key
    fp32: bool | None                # the table of fp32 inputs, or of 16-bit ones; None: of both
    candidates: Callable[[str], list]   # target -> candidate rows
    area: Callable[[object], int]    # the size of a candidate's tile, bigger preferred
    bucketed: bool = True            # a row per bucket (head dim); else one row for every bucket


# The modules whose tables a sweep names, searched in order: the families' tuning, then runtime's.


_ATTN_FWD_OPS = ("flash_attn_func", "flash_attn_varlen_func")
_ATTN_BWD_OPS = ("flash_attn_func.backward", "flash_attn_varlen_func.backward")


def _attn_bucket(c):
    return max(16, c["BLOCK_D"], c["BLOCK_DV"])


def _attn_candidates(fp32: bool, backward: bool = False):
    """Tiles for the attention kernels. Each warp holds the whole k (and v) tile of a step as the
    dot's B operand, D x block_n values over its lanes, so wave32 (RDNA) needs narrower key blocks
    than wave64 (CDNA) at the same head dim: hence block_n down to 16. The backward kernels keep
    two more tiles in registers (dK and dV, or dQ), so their largest candidates are smaller."""
    def make(target):
        shapes = [(128, 64), (64, 64), (128, 32), (64, 32), (128, 16), (32, 32), (64, 16), (32, 16), (16, 16)]
        if backward:
            shapes = [(64, 64), (32, 64), (64, 32), (16, 64), (32, 32), (64, 16), (16, 32), (32, 16), (16, 16)]
        if fp32:
            shapes = shapes[3:]
        warps = (4,) if target == "gfx942" else (4, 8)
        return [TileConfig(m, n, w, s) for m, n in shapes for w in warps for s in (1, 2)]
    return make


_RNN_FWD = ("_lstm_cell_fwd_kernel", "_gru_cell_fwd_kernel", "_rnn_cell_fwd_kernel")


def _rnn_bucket(c):
    return 0   # B is not specialized: one row, checked on every sample, serves every batch bucket


def _rnn_candidates(fp32: bool):
    def make(target):
        shapes = [(16, 32, 32), (16, 16, 32), (16, 32, 16), (32, 32, 32), (32, 16, 32)] if fp32 else \
                 [(16, 32, 64), (16, 32, 32), (32, 32, 64), (32, 32, 32), (64, 32, 32), (64, 64, 32)]
        warps = (4,) if target == "gfx942" else (4, 8)
        return [RnnTileConfig(b, h, k, w, s) for b, h, k in shapes for w in warps for s in (1, 2)]
    return make


SWEEPS: dict[str, Sweep] = {
    "attn_fwd": Sweep("FLASH_ATTN_FWD", _ATTN_FWD_OPS, ("_flash_attn_fwd_kernel",), _attn_bucket, False,
                      _attn_candidates(False), lambda c: c.block_m * c.block_n),
    "attn_fwd_fp32": Sweep("FLASH_ATTN_FWD_FP32", _ATTN_FWD_OPS, ("_flash_attn_fwd_kernel",), _attn_bucket,
                           True, _attn_candidates(True), lambda c: c.block_m * c.block_n),
    "attn_bwd_dkdv": Sweep("FLASH_ATTN_BWD_DKDV", _ATTN_BWD_OPS, ("_flash_attn_bwd_dkdv_kernel",),
                           _attn_bucket, False, _attn_candidates(False, True), lambda c: c.block_m * c.block_n),
    "attn_bwd_dkdv_fp32": Sweep("FLASH_ATTN_BWD_DKDV_FP32", _ATTN_BWD_OPS,
                                ("_flash_attn_bwd_dkdv_kernel",), _attn_bucket, True, _attn_candidates(True, True),
                                lambda c: c.block_m * c.block_n),
    "attn_bwd_dq": Sweep("FLASH_ATTN_BWD_DQ", _ATTN_BWD_OPS, ("_flash_attn_bwd_dq_kernel",),
                         _attn_bucket, False, _attn_candidates(False, True), lambda c: c.block_m * c.block_n),
    "attn_bwd_dq_fp32": Sweep("FLASH_ATTN_BWD_DQ_FP32", _ATTN_BWD_OPS, ("_flash_attn_bwd_dq_kernel",),
                              _attn_bucket, True, _attn_candidates(True, True), lambda c: c.block_m * c.block_n),
    "attn_kvcache": Sweep("FLASH_ATTN_KVCACHE", ("flash_attn_with_kvcache",), ("_flash_attn_kvcache_kernel",),
                          _attn_bucket, None, _attn_candidates(False), lambda c: c.block_m * c.block_n),
    "lstm_fwd": Sweep("RNN_CELL_FWD", ("lstm_cell", "gru_cell", "rnn_cell"), _RNN_FWD, _rnn_bucket,
                      False, _rnn_candidates(False), lambda c: c.block_b * c.block_h * c.block_k, False),
    "lstm_fwd_fp32": Sweep("RNN_CELL_FWD_FP32", ("lstm_cell", "gru_cell", "rnn_cell"), _RNN_FWD,
                           _rnn_bucket, True, _rnn_candidates(True), lambda c: c.block_b * c.block_h * c.block_k, False),
    "rope_bwd": Sweep("ROTARY", ("rms_norm_rope.backward",), ("_rms_norm_rope_bwd_kernel",), lambda c: 0, False,
                      lambda t: [RotaryConfig(32, 4, 16, s) for s in (16, 8, 4, 2)], lambda c: c.bwd_block_s, False),
}


def _is_fp32(spec) -> bool:
    return next(t for t in spec.signature.values() if t.startswith("*")) == "*fp32"


def sweep(name: str, target: str, jobs: int) -> dict:
    """Try ``target``'s candidates, most preferred first, each on the buckets no earlier candidate
    passed; print each report; return the choice per bucket (the first candidate that passes)."""
    from lanekit.export import compile_all

    s = SWEEPS[name]
    table = tables.table(s.table)
    saved = table.get(target)
    bucketed = not isinstance(table["generic"], RotaryConfig)
    buckets = set(table["generic"]) if s.bucketed and bucketed else {0}
    order = sorted(s.candidates(target), key=lambda c: (-s.area(c), -getattr(c, "num_stages", 0), c.num_warps))
    choice: dict = {}
    least_spill: dict = {}   # bucket -> (scratch bytes, candidate): the fallback when none passes
    try:
        for cand in order:
            open_ = buckets - set(choice)
            if not open_:
                break
            table[target] = {b: cand for b in table["generic"]} if bucketed else cand

            def keep(spec):
                return (spec.kernel in s.kernels and s.fp32 in (None, _is_fp32(spec))
                        and s.bucket(spec.constexprs) in open_)
            reports: dict[int, list] = {}
            for spec, rep, _ in compile_all([target], s.ops, jobs=jobs, keep=keep):
                reports.setdefault(s.bucket(spec.constexprs), []).append(rep)
            for bucket, reps in sorted(reports.items()):
                ok = all(r.ok for r in reps)
                problems = "; ".join(sorted({p for r in reps for p in r.problems}))
                print(f"{target} {s.table}[{bucket}] {cand}: {'passes' if ok else 'fails'} ({len(reps)} launches): "
                      f"registers <= {max(r.registers for r in reps)}, shared <= {max(r.shared for r in reps)}, "
                      f"scratch <= {max(r.scratch for r in reps)}{'; ' + problems[:200] if problems else ''}",
                      flush=True)
                if ok:
                    choice[bucket] = cand
                elif all(p.startswith("spills") for r in reps for p in r.problems):
                    scratch = max(r.scratch for r in reps)
                    if bucket not in least_spill or scratch < least_spill[bucket][0]:
                        least_spill[bucket] = (scratch, cand)
            for bucket in open_ - set(reports):   # no sample launches this bucket: nothing to learn
                choice.setdefault(bucket, None)
    finally:
        if saved is None:
            table.pop(target, None)
        else:
            table[target] = saved
    for bucket in sorted(buckets):
        if bucket in choice:
            print(f"CHOICE {target} {s.table}[{bucket}]: {choice[bucket]}", flush=True)
        elif bucket in least_spill:
            scratch, cand = least_spill[bucket]
            choice[bucket] = cand
            print(f"CHOICE {target} {s.table}[{bucket}]: {cand}: none passes; this one spills least "
                  f"({scratch} bytes per thread: needs an entry in targets.SPILL_ALLOWANCES)", flush=True)
        else:
            print(f"CHOICE {target} {s.table}[{bucket}]: no candidate compiles and fits", flush=True)
    return choice


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", required=True, choices=TARGETS)
    parser.add_argument("--sweep", action="append", choices=sorted(SWEEPS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    for target in args.target:
        for name in args.sweep or SWEEPS:
            sweep(name, target, args.jobs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
