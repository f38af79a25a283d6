"""Tile tables of the linear-attention kernels, and what their compiles may show.

The tables are data, keyed by architecture id (``lanekit.runtime.tuning.arch_id``); the machinery
that reads them lives in ``lanekit.runtime.tuning``. What was tried, with dates and figures, goes to
docs/tuning/linear_attn.md.

Every chunked kernel works on chunks of ``chunk`` tokens; the whole K (padded to a power of two,
at most 256) is one tile, V is walked in blocks of ``block_v``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lanekit.runtime.tuning import arch_row, tile_options


@dataclass(frozen=True)
class ChunkConfig:
    """One chunked kernel's launch: chunk length, V block, warps, stages (and AMD's waves per EU);
    for the state passes also a K block (0: the whole K), since each block of the state's rows
    evolves on its own."""

    chunk: int
    block_v: int
    num_warps: int
    num_stages: int
    waves_per_eu: int = 0
    block_k: int = 0

    def options(self) -> dict:
        return tile_options(self)


@dataclass(frozen=True)
class LinearAttnTiles:
    """The launches of one architecture, one per kernel (kernels/chunk.py, kernels/recurrent.py).

    state_fwd: the state pass (one program per (sequence * head, V block, K block), the chunks in order).
    output: the output pass (one program per (chunk, V block, head)).
    state_bwd: the state-gradient pass (the chunks in reverse).
    grad: dq, dk, dv (and the decay's per-token term) per chunk, V walked inside.
    recurrent: the step-by-step recurrence (chunk unused).
    All chunked kernels of one call share one chunk length: the state pass stores a state per
    chunk that the others read.
    """

    state_fwd: ChunkConfig
    output: ChunkConfig
    state_bwd: ChunkConfig
    grad: ChunkConfig
    recurrent: ChunkConfig

    @property
    def chunk(self) -> int:
        return self.state_fwd.chunk


# generic: 64-token chunks (fla's), V blocks of 64 for the sequential state passes so that
# (batch * head) programs times two V blocks fill the GPU, the whole V (up to 128) for the output
# pass so that q k^T is computed once per chunk. Not yet timed on a GPU (docs/tuning/linear_attn.md).
TILES: dict[str, LinearAttnTiles] = {
    "generic": LinearAttnTiles(
        state_fwd=ChunkConfig(64, 64, 4, 2, block_k=64),
        output=ChunkConfig(64, 128, 4, 2),
        state_bwd=ChunkConfig(64, 64, 4, 2, block_k=64),
        grad=ChunkConfig(64, 64, 8, 1),
        recurrent=ChunkConfig(64, 32, 4, 1),
    ),
    # Hopper: 64 x 64 blocks of the state (four programs per head at K = V = 128, as fla's state
    # pass may split), so that B * H = 32 heads (T = 16k, B = 2) still run 128 programs along
    # their 256 chunks; three stages for the loads of the next chunks.
    "sm90": LinearAttnTiles(
        state_fwd=ChunkConfig(64, 64, 4, 3, block_k=64),
        output=ChunkConfig(64, 128, 8, 2),
        state_bwd=ChunkConfig(64, 64, 4, 3, block_k=64),
        grad=ChunkConfig(64, 64, 8, 1),
        recurrent=ChunkConfig(64, 32, 4, 1),
    ),
    # RDNA (wave32, 64 KiB of LDS): 32-token chunks and 32-wide V blocks keep the grad kernel's
    # three fp32 accumulators within its VGPRs.
    "gfx1201": LinearAttnTiles(
        state_fwd=ChunkConfig(32, 32, 4, 1, block_k=32),
        output=ChunkConfig(32, 64, 4, 1),
        state_bwd=ChunkConfig(32, 32, 4, 1, block_k=32),
        grad=ChunkConfig(32, 32, 4, 1),
        recurrent=ChunkConfig(32, 32, 4, 1),
    ),
}

# Ampere: the grad kernel's three fp32 accumulators with 64- and 32-wide V blocks spilled 8 to 24
# bytes (mma.sync keeps its operands in registers, 255 registers a thread at 8 warps): 16-wide.
TILES["sm80"] = LinearAttnTiles(
    state_fwd=ChunkConfig(64, 64, 4, 2, block_k=64),
    output=ChunkConfig(64, 128, 4, 2),
    state_bwd=ChunkConfig(64, 64, 4, 2, block_k=64),
    grad=ChunkConfig(64, 16, 8, 1),
    recurrent=ChunkConfig(64, 32, 4, 1),
)

# CDNA 3 (wave64): 8 warps leave each thread 256 VGPRs, where the grad kernel's 64-wide V blocks
# spilled 32 to 40 bytes (16-bit varlen and strided samples); 32-wide: 193-242, none.
TILES["gfx942"] = replace(TILES["generic"], grad=ChunkConfig(64, 32, 8, 1))

# fp32 inputs (IEEE products: no tensor cores, every operand in registers), and the normalized
# form's backward (computed in fp32): 32-token chunks and 32-wide V blocks (16 in the grad kernel,
# where 32 spilled 8 to 68 bytes on sm90 and gfx942); the 64-token tiles spilled kilobytes on
# every target.
TILES_FP32: dict[str, LinearAttnTiles] = {
    "generic": LinearAttnTiles(
        state_fwd=ChunkConfig(32, 32, 4, 1),
        output=ChunkConfig(32, 32, 4, 1),
        state_bwd=ChunkConfig(32, 32, 4, 1),
        grad=ChunkConfig(32, 16, 8, 1),
        recurrent=ChunkConfig(32, 32, 4, 1),
    ),
    # RDNA: the 32-token grad kernel spilled 200 to 370 bytes (wave32's VGPRs): 16-token chunks.
    "gfx1201": LinearAttnTiles(
        state_fwd=ChunkConfig(16, 16, 4, 1, block_k=32),
        output=ChunkConfig(16, 16, 4, 1),
        state_bwd=ChunkConfig(16, 16, 4, 1, block_k=32),
        grad=ChunkConfig(16, 16, 4, 1),
        recurrent=ChunkConfig(16, 32, 4, 1),
    ),
}

# Interpreted: 16-token chunks and 16-wide V (and state K) blocks, so that the tests' short
# sequences (17, 40 tokens) cross several chunks and blocks and every mask runs on the CPU.
INTERPRETER = LinearAttnTiles(
    state_fwd=ChunkConfig(16, 16, 1, 1, block_k=16),
    output=ChunkConfig(16, 16, 1, 1),
    state_bwd=ChunkConfig(16, 16, 1, 1, block_k=16),
    grad=ChunkConfig(16, 16, 1, 1),
    recurrent=ChunkConfig(16, 16, 1, 1),
)


def tiles(device, dtype) -> LinearAttnTiles:
    """The launches for ``device``'s architecture (its alias's, else generic's) and the inputs'
    dtype."""
    return arch_row(TILES_FP32 if dtype == torch.float32 else TILES, device)


# ---- compile allowances (lanekit targets): (kernel, target) -> (bytes | regular expression, reason).
_STACK = ("8 bytes of ptxas stack frame at 80 registers a thread (fp32 grad kernel; a varlen fp16 state "
          "pass): not register pressure; found 2026-12-07 (`lanekit export --target sm90`), not yet traced")
SPILL_ALLOWANCES: dict[tuple[str, str], tuple[int, str]] = {
    ("_chunk_grad_kernel", "sm90"): (8, _STACK),
    ("_chunk_state_fwd_kernel", "sm90"): (8, _STACK),
}
_NARROW_K = ("the state passes multiply [K, chunk] by [chunk, V block]: a key head dim under 64 (the samples' "
             "K = 16 and 32) is under wgmma's 64 rows per warpgroup, so Triton uses Ampere's mma.sync there, "
             "still on the tensor cores")
MATRIX_ALLOWANCES: dict[tuple[str, str], tuple[str, str]] = {
    (kernel, "sm90"): (r"\bmma\.sync\.aligned\.\S+", _NARROW_K)
    for kernel in ("_chunk_state_fwd_kernel", "_chunk_state_bwd_kernel")
}
