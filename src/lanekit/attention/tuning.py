"""Tile tables of the attention kernels, and what their compiles may show.

The tables are data, keyed by architecture id (``lanekit.runtime.tuning.arch_id``); the machinery
that reads them (``TileConfig``, ``lookup``, ``compiling_for``) lives in ``lanekit.runtime.tuning``.
What was tried on the way to each row, with dates and figures, is in docs/tuning/attention.md.
"""

from __future__ import annotations

# ---- compile allowances (lanekit targets): where a kernel may spill, or use another matrix
# instruction than the target's own; (kernel, target) -> (bytes | regular expression, reason).

_RDNA_FP32_D256 = ("fp32 at D=256: the q tile and the accumulator (block_m x 256 fp32 each) beside the k "
                   "and v operands exceed wave32's 256 VGPRs at every tile down to 16x16 "
                   "(benchmarks.tune_targets --sweep attn_fwd_fp32); fp32 at D=128 and the 16-bit forward "
                   "do not spill")
_RDNA_DKDV = ("dK and dV (block_n x D fp32 each) stay in registers beside the k and v operands: above D=64, "
              "and in fp32, that exceeds wave32's 256 VGPRs at every tile down to 16x16 "
              "(benchmarks.tune_targets --sweep attn_bwd_dkdv); the rows take the tile that spills least")
_RDNA_DQ_FP32 = ("fp32 at D=256: dQ and the q tile (block_m x 256 fp32 each) beside the k and v operands exceed "
                 "wave32's 256 VGPRs at every tile down to 16x16 (benchmarks.tune_targets --sweep "
                 "attn_bwd_dq_fp32)")
_RDNA_KVCACHE = ("fp32 at D=128 (its one fp32 sample): every candidate tile spills on wave32, 16 keys a step with "
                 "8 warps least (benchmarks.tune_targets --sweep attn_kvcache); the 16-bit paths do not spill")
_NVIDIA_UNCOUNTED = ("spills that ptxas reports as STACK, which the record read as 0 until 2026-12-02 (it "
                     "read LOCAL only): found then, not yet tuned away; ")
_NVIDIA_OTHERS = _NVIDIA_UNCOUNTED + "the worst are a bias with a mask at D=111 and the backward at odd head dims"
_NVIDIA_FWD = _NVIDIA_UNCOUNTED + ("the worst is a bias with a mask at D=111 (on sm80 ptxas falls to 32 registers "
                                   "and 7 KB of stack with the 16-bit D=128 row); fp32 at D=64, 128 and 256 has "
                                   "rows of its own since (FLASH_ATTN_FWD_FP32: 584 bytes at most, sm90's D=128 "
                                   "row, the fastest timed)")
SPILL_ALLOWANCES: dict[tuple[str, str], tuple[int, str]] = {
    **{(kernel, rdna): (limit, why) for rdna in ("gfx1151", "gfx1201") for kernel, limit, why in (
        ("_flash_attn_fwd_kernel", 796, _RDNA_FP32_D256),
        ("_flash_attn_bwd_dkdv_kernel", 2608, _RDNA_DKDV),
        ("_flash_attn_bwd_dq_kernel", 2556, _RDNA_DQ_FP32),
    )},
    ("_flash_attn_kvcache_kernel", "gfx1151"): (168, _RDNA_KVCACHE),
    ("_flash_attn_kvcache_kernel", "gfx1201"): (36, _RDNA_KVCACHE),
    # NVIDIA: the spills there since before the record counted them (largest per kernel; the
    # record itself pins each specialization's figure, so any change still fails --check)
    ("_flash_attn_fwd_kernel", "sm80"): (7336, _NVIDIA_FWD),
    ("_flash_attn_fwd_kernel", "sm90"): (2088, _NVIDIA_FWD),
    **{(kernel, target): (limit, _NVIDIA_OTHERS) for kernel, target, limit in (
        ("_flash_attn_bwd_dkdv_kernel", "sm80", 976), ("_flash_attn_bwd_dkdv_kernel", "sm90", 2112),
        ("_flash_attn_bwd_dq_kernel", "sm80", 656), ("_flash_attn_bwd_dq_kernel", "sm90", 1416),
    )},
}

_DECODE_ROWS = ("decode and short appends (Sq x group <= 16 rows of (query, head) pairs) take a 16-row tile, "
                "under wgmma's 64 rows per warpgroup, so Triton uses mma.sync there, still on the tensor cores")
MATRIX_ALLOWANCES: dict[tuple[str, str], tuple[str, str]] = {
    ("_flash_attn_kvcache_kernel", "sm90"): (r"\bmma\.sync\.aligned\.\S+", _DECODE_ROWS),
}
