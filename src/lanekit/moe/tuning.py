"""Tile tables of the mixture-of-experts kernels, and what their compiles may show.

Small tables are data here, keyed by architecture id (``lanekit.runtime.tuning.arch_id``); the
grouped GEMM's configs, keyed by shape, dtype and GPU, are data files a tuner writes
(``lanekit/moe/configs/``). What was tried is in docs/tuning/moe.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lanekit.runtime.tuning import ARCH_ALIASES, arch_id, arch_row, block16, compiling, tile_options

# ---- routing: topk_softmax, grouped_topk ----

@dataclass(frozen=True)
class RoutingConfig:
    """Tokens per program of topk_softmax and grouped_topk (each holds all E scores of a token)."""

    block_m: int
    num_warps: int


# keyed by the padded expert count (a power of two; larger E takes the largest key's row):
# [block_m, E] tiles of 1024-2048 fp32 scores, 8-16 per thread at 4 warps, each top-k step two
# row reductions over them. Not yet swept on the GPU.
ROUTING: dict[str, dict[int, RoutingConfig]] = {
    "generic": {
        64: RoutingConfig(16, 4),
        128: RoutingConfig(16, 4),
        256: RoutingConfig(8, 4),
        512: RoutingConfig(4, 4),
    },
}


def routing_config(device, num_experts: int) -> RoutingConfig:
    rows = arch_row(ROUTING, device)
    padded = max(64, 1 << max(num_experts - 1, 0).bit_length())
    return rows.get(padded, rows[max(rows)])



# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----

@dataclass(frozen=True)
class AlignConfig:
    """The sort by expert of moe_align_block_size and moe_dispatch, and the row copies around it.

    A sort whose (flat indices x experts) one-hot tile, both padded to powers of two, holds at
    most ``one_program_tile`` elements runs in one program (one launch: decode); larger ones in
    three (count per chunk of ``chunk`` flat indices, one scan, a scatter per chunk).
    ``fuse_gather``: dispatch copies the rows of x in that same program while M * topk * K is at
    most this, ``gather_tile`` elements of rows at a time (few iterations: each waits for its
    loads). ``row_block``: the columns a program of the gather, combine and their backwards
    copies or sums at once, ``rows``: the flat indices a gather program takes.
    """

    one_program_tile: int
    chunk: int
    fuse_gather: int
    row_block: int
    rows: int
    num_warps: int
    scan_num_warps: int
    gather_tile: int


# generic (every target until a sweep on the GPU says otherwise): a one-program tile of 16384
# one-hot elements is 8 per thread at 8 warps of 32 lanes (4 on AMD's wave64), and keeps decode
# (M * topk <= 64 at E = 256) in one launch; chunks of 1024 flat indices keep the per-chunk sort a
# 55-step bitonic network in registers; rows of 1024 columns are 4 per thread at 8 warps; the
# one program's row copies take 16384 elements (64 per thread) a step: decode's 8 rows of
# K = 7168 in 4 steps.
ALIGN: dict[str, AlignConfig] = {
    "generic": AlignConfig(one_program_tile=16384, chunk=1024, fuse_gather=65536, row_block=1024,
                           rows=4, num_warps=8, scan_num_warps=8, gather_tile=16384),
}


def align_config(device) -> AlignConfig:
    return arch_row(ALIGN, device)


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): triton.next_power_of_2 in plain Python, whose
    call costs a few microseconds of host time on the decode path."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)



# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----

@dataclass(frozen=True)
class GemmConfig:
    """A grouped GEMM tile. Forward: block_m rows of a group by block_n columns, block_k of K a
    step. The weights' gradient (grouped_mm_bwd): block_m rows of K by block_n columns of N, block_k
    of a group's rows a step. group_m: row tiles that share a column tile of b in L2 (the swizzle)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    waves_per_eu: int = 0   # AMD: the occupancy the compiler keeps registers for (0: its choice)

    def options(self) -> dict:
        return tile_options(self)


# Under the interpreter every program runs in Python: few, mid-sized tiles (tl.dot needs >= 16).
INTERPRETER_GEMM = GemmConfig(32, 32, 32, 1, 1, 1)

# Shared memory (LDS) a program may use, by architecture, for the stages of the default tiles when
# no tuned file has a row (on a GPU, the driver's figure is read instead).
SHARED_MEMORY: dict[str, int] = {
    "generic": 65536,
    "sm80": 166912,     # A100: 163 KiB opt-in per block
    "sm90": 232448,     # H100/H200: 227 KiB opt-in per block
    "gfx942": 65536,    # MI300: 64 KiB LDS
    "gfx1201": 65536,   # RDNA 4 (and gfx1151 by alias): 64 KiB LDS
}

# Default tiles by the rows a group holds on average (M_total / E), the largest first that the
# average reaches; stages come from shared memory (default_gemm_config). sm90's wgmma takes 64 rows
# a warpgroup, so no tile has fewer than 64 rows per 4 warps (mma.sync would do, at the same
# bandwidth-bound speed, but the compile record asks for the target's matrix instructions).
DEFAULT_TILES: dict[str, tuple[tuple[int, GemmConfig], ...]] = {
    "grouped_mm": (
        # 128 x 128 x 64, 8 warps: the tile CUTLASS's sm90 grouped GEMM also takes for bf16;
        # GROUP_M 8 keeps b's column tiles in L2 across row tiles
        (128, GemmConfig(128, 128, 64, 8, 8, 0)),
        # 32..127 rows: 64 x 128 x 64, 4 warps: half a 128-row tile would be padding
        (32, GemmConfig(64, 128, 64, 8, 4, 0)),
        # decode: bound by reading b; 64 rows (wgmma's least); 64 x 64 x 128 spilled 264 to 1192
        # bytes a thread on sm90 at odd shapes (docs/tuning/moe.md)
        (0, GemmConfig(64, 64, 64, 1, 4, 0)),
    ),
    # the weights' gradient: block_m x block_n of (K, N), block_k of a group's rows a step
    "grouped_mm_bwd": (
        (128, GemmConfig(128, 128, 64, 1, 8, 0)),
        (0, GemmConfig(64, 64, 32, 1, 4, 0)),   # few rows a group: bound by writing d b
    ),
}
# fp32 operands multiply in fp32 (ieee, no TF32) on the FMA units: small tiles keep the product's
# registers (a 16 x 64 x 128 one spilled 4 KiB a thread on sm90).
FP32_TILE = GemmConfig(32, 32, 32, 1, 4, 0)
# A K that block_k does not divide masks every K step's loads: sm90 spilled 208 bytes a thread at
# block_k 64 with K = 72 and 24 (the backward's d a, the transposed weights' contiguous dim), sm80
# 16 bytes with K = 48. So block_k halves down to 16 until it divides K; a K that 16 does not divide
# takes 32, which compiles clean on sm90.
ODD_K_BLOCK_K = 32


def _block_k_for(K: int, block_k: int) -> int:
    """block_k, halved down to 16 until it divides K; ODD_K_BLOCK_K (at most) if none does."""
    bk = block_k
    while bk > 16 and K % bk:
        bk //= 2
    return bk if K % bk == 0 else min(block_k, ODD_K_BLOCK_K)


MAX_STAGES = 4    # more buys nothing on a K loop of 64-wide steps (Triton's matmul tutorial, sm90)

# The tuned configs: JSON files that benchmarks/tune_moe.py writes, one per (kernel, arch, dtype,
# E, K, N), holding a config per M_total (rows); a call takes the row of the nearest M_total.
CONFIG_DIR = Path(__file__).parent / "configs"


def config_file_name(kernel: str, arch: str, dtype: torch.dtype, E: int, K: int, N: int) -> str:
    return f"{kernel}-{arch}-{str(dtype).removeprefix('torch.')}-E{E}-K{K}-N{N}.json"


@functools.lru_cache(maxsize=None)
def _config_file(name: str) -> dict[int, GemmConfig] | None:
    path = CONFIG_DIR / name
    if not path.is_file():
        return None
    rows = json.loads(path.read_text())["configs"]
    return {int(m): GemmConfig(**row) for m, row in rows.items()}


def clear_config_cache() -> None:
    """Forget the config files read and the configs chosen (after the files change)."""
    _config_file.cache_clear()
    _arch_gemm_config.cache_clear()


def _shared_memory(device: torch.device, arch: str) -> int:
    if compiling() is None and device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        optin = getattr(props, "shared_memory_per_block_optin", 0)
        if optin:
            return int(optin)
    return SHARED_MEMORY.get(arch, SHARED_MEMORY.get(ARCH_ALIASES.get(arch, ""), SHARED_MEMORY["generic"]))


def default_gemm_config(kernel: str, device: torch.device, arch: str, M: int, E: int, K: int,
                        dtype: torch.dtype) -> GemmConfig:
    """The default tile for an average of M / E rows a group, with as many stages (2 to MAX_STAGES)
    as the architecture's shared memory holds (a and b tiles a stage, plus one stage's worth for
    the epilogue)."""
    average = M // max(E, 1)
    if dtype == torch.float32:
        tile = FP32_TILE
    else:
        tile = next(cfg for rows, cfg in DEFAULT_TILES[kernel] if average >= rows)
        if kernel == "grouped_mm":
            tile = dataclasses.replace(tile, block_k=_block_k_for(K, tile.block_k))
    size = max(torch.tensor([], dtype=dtype).element_size(), 2)
    stage = (tile.block_m * tile.block_k + tile.block_k * tile.block_n) * size
    stages = max(2, min(MAX_STAGES, _shared_memory(device, arch) // stage - 1))
    return dataclasses.replace(tile, num_stages=stages)


def _gemm_config(kernel: str, device: torch.device, *, E, K, N, M, dtype) -> GemmConfig:
    if device.type != "cuda" and compiling() is None:
        return INTERPRETER_GEMM
    return _arch_gemm_config(kernel, device, arch_id(device), E, K, N, M, dtype)


@functools.lru_cache(maxsize=4096)   # the per-call host path: one dict lookup once a shape is seen
def _arch_gemm_config(kernel, device, arch, E, K, N, M, dtype) -> GemmConfig:
    for key in (arch, ARCH_ALIASES.get(arch)):
        rows = key and _config_file(config_file_name(kernel, key, dtype, E, K, N))
        if rows:
            return rows[min(rows, key=lambda m: (abs(m - M), m))]
    return default_gemm_config(kernel, device, arch, M, E, K, dtype)


def grouped_mm_config(device: torch.device, *, E: int, K: int, N: int, M: int, dtype: torch.dtype) -> GemmConfig:
    """The forward's tile for (M_total, K) @ (E, K, N) multiplied in ``dtype`` (fp32 where an
    operand is) on ``device``: the tuned file's row nearest M_total, else
    :func:`default_gemm_config`."""
    return _gemm_config("grouped_mm", device, E=E, K=K, N=N, M=M, dtype=dtype)


def grouped_mm_bwd_config(device: torch.device, *, E: int, K: int, N: int, M: int, dtype: torch.dtype) -> GemmConfig:
    """The weights' gradient's tile (block_m over K, block_n over N, block_k over a group's rows)."""
    return _gemm_config("grouped_mm_bwd", device, E=E, K=K, N=N, M=M, dtype=dtype)


# -- fused_moe --

@dataclass(frozen=True)
class FusedMoeConfig:
    """One launch of the fused expert MLP: block_m is the align's block (rows of one expert);
    GEMM1 takes block_n1 gate and as many up columns over block_k1 of K; GEMM2 block_n2 output
    columns (of K) over block_k2 of N, its reduction split split_k2 ways (the sum pass adds the
    splits in order: still deterministic); group_m row blocks share a column block (L2 reuse)."""

    block_m: int
    block_n1: int
    block_k1: int
    block_n2: int
    block_k2: int
    group_m: int
    num_warps: int
    num_stages: int
    split_k2: int = 1
    waves_per_eu: int = 0

    def options(self) -> dict:
        return tile_options(self)


# fused_moe, keyed by the largest M (tokens) a row serves; an M over the largest key takes it.
# Not yet swept on the GPU (benchmarks' tune-moe step): first rows from the shapes' arithmetic.
FUSED_MOE: dict[str, dict[int, FusedMoeConfig]] = {
    # the interpreter (and any GPU without a row): small tiles, few programs per block
    "generic": {
        16: FusedMoeConfig(16, 32, 32, 32, 32, 1, 4, 2),
        1 << 62: FusedMoeConfig(16, 32, 32, 32, 32, 4, 4, 2),
    },
    "sm90": {
        # decode: each routed expert's weights read once; 16-row blocks (one per expert), narrow N
        # tiles and a 2-way split of GEMM2's N so that top-8 of 768..2048 fills 132 SMs
        16: FusedMoeConfig(16, 32, 128, 64, 128, 1, 4, 4, split_k2=2),
        # a few rows per expert: 32-row blocks, still weight-bound; with 4 warps GEMM1 spilled
        # 512 bytes a thread at K 200 (lanekit export, 2 to 4 stages), with 8 it does not
        128: FusedMoeConfig(32, 64, 64, 64, 64, 4, 8, 3),
        # prefill: MMA-bound; GEMM1 128 rows x (64 gate + 64 up) columns, the density of one
        # 128 x 128 tile (128 gate and 128 up spilled 8 bytes a thread), GEMM2 128 x 128; 8 warps,
        # 3 stages of at most 32 KiB in shared memory
        1 << 62: FusedMoeConfig(128, 64, 64, 128, 64, 8, 8, 3),
    },
    # Ampere: sm90's rows (mma.sync everywhere; 164 KiB of shared memory holds their 3 to 4
    # stages), not yet measured on an A100
    "sm80": {
        16: FusedMoeConfig(16, 32, 128, 64, 128, 1, 4, 4, split_k2=2),
        128: FusedMoeConfig(32, 64, 64, 64, 64, 4, 8, 3),
        1 << 62: FusedMoeConfig(128, 64, 64, 128, 64, 8, 8, 3),
    },
    "gfx942": {
        # CDNA 3, 64 KiB of LDS: two stages of 64 x 64 (x2) x 64 tiles fit in 48 KiB
        16: FusedMoeConfig(16, 32, 128, 64, 128, 1, 4, 2, split_k2=2),
        1 << 62: FusedMoeConfig(64, 64, 64, 64, 64, 8, 4, 2),
    },
}
# The sum pass: a program per (token, block of K columns), a few warps (elementwise, fp32)
FUSED_MOE_SUM_BLOCK: dict[str, int] = {"generic": 256, "sm90": 1024, "gfx942": 1024}
FUSED_MOE_SUM_WARPS = 4


# K or N not a multiple of 16: rows of x, w1, w2 and the intermediate start unaligned, their loads
# are not vectorized, and the sm90 prefill row spilled 280 and 336 bytes a thread (K 136, N 40:
# lanekit export); such shapes take at most this bucket's row.
FUSED_MOE_UNALIGNED_BUCKET = 128


def fused_moe_config(device: torch.device, M: int, K: int, N: int) -> FusedMoeConfig:
    rows = arch_row(FUSED_MOE, device)
    if K % 16 or N % 16:
        M = min(M, FUSED_MOE_UNALIGNED_BUCKET)
    return rows[min((k for k in rows if k >= M), default=max(rows))]


def fused_moe_sum_block(device: torch.device, K: int) -> int:
    return min(arch_row(FUSED_MOE_SUM_BLOCK, device), block16(K))


# -- fused_moe, quantized experts (fp8 W8A8, int8 W8A16) --

# Rows that differ from fused_moe's for the quantized kernels; every block_k must divide 128 (the
# block scheme applies one 128 x 128 scale per K step). Others take FUSED_MOE's row (all of whose
# block_k are 32, 64 or 128).
FUSED_MOE_QUANT: dict[str, dict[int, FusedMoeConfig]] = {
    "sm90": {
        # prefill: a K step of 128 (one block scale) at 32 KiB a stage, 3 stages; 32 gate + 32 up
        # and 64 output columns, since with every wgmma's sum promoted (max_num_imprecise_acc=0)
        # 64 + 64 and 128 spilled 64 and 136 bytes. Not yet measured on the H200.
        1 << 62: FusedMoeConfig(128, 32, 128, 64, 128, 8, 8, 3),
    },
}
# The activation quantization pass: columns of one row a program reads at a time
FUSED_MOE_QUANT_BLOCK = 1024


def fused_moe_quant_config(device: torch.device, M: int, K: int, N: int) -> FusedMoeConfig:
    cfg = fused_moe_config(device, M, K, N)
    rows = FUSED_MOE_QUANT.get(arch_id(device), {})
    if rows and not (K % 16 or N % 16):
        own = rows[min((k for k in rows if k >= M), default=max(rows))]
        if own.block_m == cfg.block_m:    # the same M bucket as fused_moe's row
            cfg = own
    assert 128 % cfg.block_k1 == 0 and 128 % cfg.block_k2 == 0, cfg
    return cfg


# ---- compile allowances (lanekit targets): (kernel, target) -> (bytes | regular expression, reason).
SPILL_ALLOWANCES: dict[tuple[str, str], tuple[int, str]] = {
    ("_fused_moe_mxfp4_gemm2_kernel", "sm90"): (8, (
        "one 4-byte value live across the K loop, stored once before it and loaded once after "
        "(one STL and one LDL a program, none in the loop), on the 32-row sample (M 17, K 96, "
        "N 160) only, since the e2m1 operand is built from bit patterns (2026-12-07)")),
    ("_fused_moe_quant_gemm1_kernel", "gfx1151"): (256, (
        "the 128x128-block fp8 GEMM1 on fused_moe's generic rows (K 200, N 72): e4m3 widened to "
        "fp16 for RDNA 3.5's WMMA with a scale per K step, and (since 2026-12-07) 64-bit pointer "
        "steps for K strides past 2^31 / BLOCK_K: 128 -> 256 bytes; not yet given rows of its own")),
}
_FUSED_MOE_SMALL_BLOCKS = (
    "fused_moe's decode and few-token rows align tokens in blocks of 16 or 32 rows, below "
    "wgmma's 64-row warpgroup tile: mma.sync there; those launches are bound by reading the "
    "expert weights, not by the MMA (the prefill rows, 128-row blocks, take wgmma)")
MATRIX_ALLOWANCES: dict[tuple[str, str], tuple[str, str]] = {
    (kernel, "sm90"): (r"\bmma\.sync\.aligned\.\S+", _FUSED_MOE_SMALL_BLOCKS)
    for kernel in ("_fused_moe_gemm1_kernel", "_fused_moe_gemm2_kernel")
}
# fused_moe's quantized GEMMs: the same small-block rows as fused_moe's, so mma.sync there
# (lanekit export, Triton 3.6.0: e4m3 operands widened to fp16, exactly, for mma.sync f16; W8A16
# multiplies bf16/fp16); the prefill row takes wgmma m64n64k32 e4m3
MATRIX_ALLOWANCES.update({
    (kernel, "sm90"): (r"\bmma\.sync\.aligned\.\S+", _FUSED_MOE_SMALL_BLOCKS)
    for kernel in ("_fused_moe_quant_gemm1_kernel", "_fused_moe_quant_gemm2_kernel")
})


# -- fused_moe, MXFP4 experts (use_mxfp4_w4a16) --

# Rows that differ from fused_moe's for the MXFP4 kernels, whose K step is always 32 (one e8m0
# scale per column a step; block_k1/block_k2 are unread) and whose every step's product is scaled
# before it is added (a second accumulator-sized tile live). Others take FUSED_MOE's row. Not yet
# measured on the GPU: gpt-oss's shapes (K = N = 2880, E 32/128, top-4) are the first to sweep.
FUSED_MOE_MXFP4: dict[str, dict[int, FusedMoeConfig]] = {
    "sm90": {
        # decode: fused_moe's row (4 warps) spilled 8 bytes a thread in GEMM2, and with 2 stages
        # in GEMM1 too (lanekit export, Triton 3.6); 8 warps, as w4a16_linear's rows, do not
        16: FusedMoeConfig(16, 32, 32, 64, 32, 1, 8, 3, split_k2=2),
        # prefill: 128 x (64 gate + 64 up) spilled 24 bytes, GEMM2's 128 x 128 192 bytes (the
        # scaled product beside the accumulator); 128 x (32 + 32) and 128 x 64 do not
        1 << 62: FusedMoeConfig(128, 32, 32, 64, 32, 8, 8, 3),
    },
}
FUSED_MOE_MXFP4["sm80"] = FUSED_MOE_MXFP4["sm90"]     # as fused_moe: sm90's rows on Ampere


def fused_moe_mxfp4_config(device: torch.device, M: int, K: int, N: int) -> FusedMoeConfig:
    cfg = fused_moe_config(device, M, K, N)
    rows = FUSED_MOE_MXFP4.get(arch_id(device), {})
    if rows:
        own = rows[min((k for k in rows if k >= M), default=max(rows))]
        if own.block_m == cfg.block_m:    # the same M bucket as fused_moe's row (the align's block)
            cfg = own
    return cfg


# fused_moe's MXFP4 GEMMs: fused_moe's small-block rows, so mma.sync there as for fused_moe
MATRIX_ALLOWANCES.update({
    (kernel, "sm90"): (r"\bmma\.sync\.aligned\.\S+", _FUSED_MOE_SMALL_BLOCKS)
    for kernel in ("_fused_moe_mxfp4_gemm1_kernel", "_fused_moe_mxfp4_gemm2_kernel")
})
