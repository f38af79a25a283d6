"""Tile tables of the RNN cell kernels, and what their compiles may show.

The tables are data, keyed by architecture id (``lanekit.runtime.tuning.arch_id``); the machinery
that reads them lives in ``lanekit.runtime.tuning``. What was tried, with dates and figures, is in
docs/tuning/rnn.md.
"""

from __future__ import annotations

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
