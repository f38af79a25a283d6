"""Tile tables of the fused-layer kernels (norms, RoPE, QK-norm with quant, GLU), and what their
compiles may show.

The tables are data, keyed by architecture id (``lanekit.runtime.tuning.arch_id``); the machinery
that reads them lives in ``lanekit.runtime.tuning``. What was tried, with dates and figures, is in
docs/tuning/layers.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lanekit.runtime.tuning import arch_row, block16, compiling


@dataclass(frozen=True)
class NormConfig:
    """Rows up to ``max_block_n`` features are held in registers (x read once); wider rows are
    walked in blocks of ``max_block_n``."""

    max_block_n: int
    num_warps: int


# norm_fwd / norm_bwd, keyed by the padded row width (a power of two); a width over the largest
# key takes the largest key's row. generic: 4 warps up to 1024 features, then 8, then 16 from 8192;
# sm90 takes them (4 and 8 warps within 1% on the H200: docs/tuning/layers.md, NORM).
NORM: dict[str, dict[int, NormConfig]] = {
    "generic": {
        1024: NormConfig(1024, 4),
        4096: NormConfig(4096, 8),
        16384: NormConfig(16384, 16),
        65536: NormConfig(16384, 16),
    },
}
# A100: rows over 16384 features walk blocks of 8192. 16 warps cap ptxas at 128 registers a
# thread, and the backward's looped fp32 rows spilled 120 bytes at blocks of 16384 (lanekit
# targets 2026-12-07); at 8192 they take 78 and none.
NORM["sm80"] = {**NORM["generic"], 65536: NormConfig(8192, 16)}
# AdaLN with one row of scale and shift per batch entry: the forward's programs take up to this many
# rows of one entry each, loading that row once. 1: 4 rows ran slower on the H200, until a sweep
# (benchmarks.tune_layers) finds better (docs/tuning/layers.md, NORM_MOD_ROWS).
NORM_MOD_ROWS = 1
# Each program of the norm's backward sums the gradients of a run of rows; this many programs
# (about four per SM on an H100/H200) keep the GPU busy while the partial sums stay small.
NORM_BWD_PROGRAMS: dict[str, int] = {"generic": 512, "sm90": 528}


@dataclass(frozen=True)
class RotaryConfig:
    block_rows: int   # (token, head) rows per program of the forward: a token's heads, then tokens
    num_warps: int
    norm_block_rows: int = 16   # the same for RMSNorm + RoPE of q and k (without quantization)
    bwd_block_s: int = 16       # tokens per program of rms_norm_rope's backward (loops over heads)
    quant_block_rows: int = 32  # the same for RMSNorm + RoPE + quantization of q and k
    norm_num_warps: int = 4     # warps of RMSNorm + RoPE of q and k (one launch)
    quant_num_warps: int = 4    # warps of RMSNorm + RoPE + quantization of q and k
    quant_maxnreg: int = 0      # registers a thread of it may use (NVIDIA rows only; 0: ptxas picks),
                                # at the shapes it fits without spills (quant_register_cap)
    # prefetches by PTX instructions, so in NVIDIA rows only (layers.kernels.shared._prefetch_rows):
    prefetch_rope: int = 0         # 1: the q-and-k kernels' cos and sin rows into L1
    norm_prefetch_ahead: int = 0   # RMSNorm + RoPE of q and k: a program's prefetch into L2 of the
                                   # rows of x of the program about this many later, of the same
                                   # head block (a whole number of token blocks; 0: none)
    quant_prefetch_ahead: int = 0  # the same for the quantized form


# apply_rotary, and the q-and-k kernels (rms_norm_rope, qk_norm_rope_quant and its backward). The
# sweeps, A/B runs and profiles behind each row: docs/tuning/layers.md, ROTARY.
ROTARY: dict[str, RotaryConfig] = {
    "generic": RotaryConfig(32, 4, norm_block_rows=32, quant_block_rows=32, norm_num_warps=4),
    # the H200 (benchmarks.tune_layers): small one-warp programs, many resident; cos and sin
    # prefetched into L1; the quantized form capped at 72 registers, its x prefetched into L2 2048
    # programs ahead
    "sm90": RotaryConfig(32, 4, norm_block_rows=8, quant_block_rows=8, norm_num_warps=1, quant_num_warps=1,
                         quant_maxnreg=72, prefetch_rope=1, quant_prefetch_ahead=2048),
    # RDNA (benchmarks.tune_targets --sweep rope_bwd): the backward spilled with 16 tokens a program
    # on wave32 at D=80, 8 do not; the q-and-k forwards keep the smaller tiles
    "gfx1201": RotaryConfig(32, 4, norm_block_rows=16, bwd_block_s=8, quant_block_rows=32, norm_num_warps=4),
}


@dataclass(frozen=True)
class EltwiseConfig:
    block_n: int      # features per program (one row)
    num_warps: int
    # a row of several blocks whose N block_n does not divide (rows not flattened: a fused input)
    # takes the largest block down to block_n >> fit_shifts that does, and warps in proportion
    fit_shifts: int = 2


# sm90: SwiGLU at 8k x 14336 on the H200 (benchmarks.tune_layers GLU): 4096 features and 16 warps,
# 2048 and 8, 8192 and 16 within 1% of each other; a fused input's rows take 2048 and 8 warps by
# fit_shifts (docs/tuning/layers.md, GLU).
GLU: dict[str, EltwiseConfig] = {"generic": EltwiseConfig(1024, 4), "sm90": EltwiseConfig(4096, 16)}

# Under the interpreter every program runs in Python: fewer, larger programs are faster.
INTERPRETER_NORM_BWD_PROGRAMS = 4


def norm_config(device: torch.device, N: int) -> NormConfig:
    rows = arch_row(NORM, device)
    width = block16(N)
    key = min((k for k in rows if k >= width), default=max(rows))
    return rows[key]


def norm_bwd_programs(device: torch.device) -> int:
    if device.type != "cuda" and compiling() is None:
        return INTERPRETER_NORM_BWD_PROGRAMS
    return arch_row(NORM_BWD_PROGRAMS, device)


def rotary_config(device: torch.device) -> RotaryConfig:
    return arch_row(ROTARY, device)


def quant_register_cap(cfg: RotaryConfig, D: int, rotary_dim: int, interleaved: bool) -> int:
    """The register cap (Triton's maxnreg; 0 for none) of a quantized q-and-k launch: the row's
    quant_maxnreg, but only at the shapes it was swept at and compiles without spilling under,
    NeoX RoPE over all of a power-of-two D of up to 128 (sm90 at 72: D=64 and 128 take no stack;
    interleaved, partial rotary, D=96 and D=256 spill 16 to 264 bytes a thread, so they keep
    ptxas's own register count)."""
    fits = rotary_dim == D and not interleaved and D <= 128 and D & (D - 1) == 0
    return cfg.quant_maxnreg if fits else 0


def glu_config(device: torch.device) -> EltwiseConfig:
    return arch_row(GLU, device)


# ---- compile allowances (lanekit targets): (kernel, target) -> (bytes | regular expression, reason).

_NVIDIA_UNCOUNTED = ("spills that ptxas reports as STACK, which the record read as 0 until 2026-12-02 (it "
                     "read LOCAL only): found then, not yet tuned away")
SPILL_ALLOWANCES: dict[tuple[str, str], tuple[int, str]] = {
    (kernel, target): (limit, _NVIDIA_UNCOUNTED) for kernel, target, limit in (
        ("_norm_bwd_kernel", "sm80", 112), ("_norm_bwd_kernel", "sm90", 128),
        ("_rms_norm_rope_bwd_kernel", "sm80", 24), ("_rms_norm_rope_bwd_kernel", "sm90", 24),
    )
}
MATRIX_ALLOWANCES: dict[tuple[str, str], tuple[str, str]] = {}
