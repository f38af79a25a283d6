"""Tile tables of the RNN cell kernels, and what their compiles may show.

The tables are data, keyed by architecture id (``lanekit.runtime.tuning.arch_id``); the machinery
that reads them lives in ``lanekit.runtime.tuning``. What was tried, with dates and figures, is in
docs/tuning/rnn.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from lanekit.runtime.tuning import TileConfig, tile_options


# The forward is one GEMM per gate over K = In (then K = H) fused with the gate math: block_b batch
# rows by block_h hidden units of every gate, walking K by block_k. Keyed by the batch bucket: B
# rounded up to a power of two, clamped to 16..128 (tl.dot needs 16 rows).
@dataclass(frozen=True)
class RnnTileConfig:
    block_b: int
    block_h: int
    block_k: int
    num_warps: int
    num_stages: int
    waves_per_eu: int = 0

    def options(self) -> dict:
        return tile_options(self)


# Not yet timed on any GPU (docs/tuning/rnn.md): generic sized to fit every target, sm90 a stated
# guess (more stages, 8 warps for the larger tiles) that compiles; small batches take narrow tiles
# so that a (B <= 16, H = 1024) step still spreads over 32 programs.
RNN_CELL_FWD: dict[str, dict[int, RnnTileConfig]] = {
    "generic": {
        16: RnnTileConfig(16, 32, 64, 4, 2),
        32: RnnTileConfig(32, 32, 64, 4, 2),
        64: RnnTileConfig(64, 32, 32, 4, 2),
        128: RnnTileConfig(64, 64, 32, 8, 2),
    },
    "sm90": {
        16: RnnTileConfig(16, 32, 128, 4, 3),
        32: RnnTileConfig(32, 32, 128, 4, 3),
        64: RnnTileConfig(64, 64, 64, 8, 3),
        128: RnnTileConfig(64, 64, 64, 8, 3),
    },
}
# RDNA (`benchmarks.tune_targets --sweep lstm_fwd`, one row for every batch bucket: B is not
# specialized): the generic 16-row tile spilled on gfx1151 (B=1, fp16); 64x64x32 with 8 warps is
# the largest that fits wave32's 256 VGPRs for the LSTM's four gate accumulators.
RNN_CELL_FWD["gfx1201"] = {
    b: RnnTileConfig(64, 64, 32, 8, 2) for b in RNN_CELL_FWD["generic"]}
# fp32: twice the bytes per tile; fp32 is chosen for accuracy, so small tiles everywhere. RDNA
# (lstm_fwd_fp32 sweep): the generic 32-row tiles spilled about 1 KB per thread with 4 warps;
# 16 rows with 8 warps do not.
RNN_CELL_FWD_FP32: dict[str, dict[int, RnnTileConfig]] = {
    "generic": {
        16: RnnTileConfig(16, 32, 32, 4, 2),
        32: RnnTileConfig(32, 32, 32, 4, 2),
        64: RnnTileConfig(32, 32, 32, 4, 2),
        128: RnnTileConfig(32, 32, 32, 4, 2),
    },
}
RNN_CELL_FWD_FP32["gfx1201"] = {
    b: RnnTileConfig(16, 32, 32, 8, 2) for b in RNN_CELL_FWD_FP32["generic"]}
# The backward's pointwise kernel (gate gradients): block_m batch rows by block_n hidden units.
RNN_CELL_BWD: dict[str, dict[int, TileConfig]] = {
    "generic": {
        16: TileConfig(4, 256, 4, 1),
        32: TileConfig(8, 128, 4, 1),
        64: TileConfig(16, 128, 4, 1),
        128: TileConfig(16, 128, 4, 1),
    },
}
# Interpreted: 16 in every dimension splits the tests' odd sizes (In=13, H=27, B=17) into several
# blocks along B, H and the H-long K loop, so every mask is exercised on the CPU.
RNN_CELL_INTERPRETER = RnnTileConfig(16, 16, 16, 1, 1)


# ---- compile allowances (lanekit targets): (kernel, target) -> (bytes | regular expression, reason).

_NVIDIA_UNCOUNTED = ("spills that ptxas reports as STACK, which the record read as 0 until 2026-12-02 (it "
                     "read LOCAL only): found then, not yet tuned away")
SPILL_ALLOWANCES: dict[tuple[str, str], tuple[int, str]] = {
    (kernel, target): (limit, _NVIDIA_UNCOUNTED) for kernel, target, limit in (
        ("_gru_cell_fwd_kernel", "sm80", 72), ("_gru_cell_fwd_kernel", "sm90", 280),
        ("_lstm_cell_fwd_kernel", "sm80", 96), ("_lstm_cell_fwd_kernel", "sm90", 472),
    )
}

_SMALL_BATCH = ("its batch tiles for B <= 32 (16 and 32 rows) are under wgmma's 64 rows per warpgroup, "
                "so Triton uses Ampere's mma.sync there, still on the tensor cores")
MATRIX_ALLOWANCES: dict[tuple[str, str], tuple[str, str]] = {
    (kernel, "sm90"): (r"\bmma\.sync\.aligned\.\S+", _SMALL_BATCH)
    for kernel in ("_lstm_cell_fwd_kernel", "_gru_cell_fwd_kernel", "_rnn_cell_fwd_kernel")
}
