"""Tile tables of the GEMM family (scaled_mm, int8_mm, mx_mm and the linears), and what their
compiles may show.

Rows are data keyed by architecture id (``lanekit.runtime.tuning.arch_id``; gfx1151 takes
gfx1201's rows), then by the least M a row is for (the largest key M reaches). None is swept on a
GPU yet: each row's reason says where it comes from. What was tried goes to docs/tuning/gemm.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lanekit.runtime.tuning import arch_row, compiling, processor_count, tile_options


@dataclass(frozen=True)
class GemmConfig:
    """A program's tile: block_m rows by block_n columns, block_k of K a step; group_m row tiles
    share a column tile of b in L2 (the swizzle)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    waves_per_eu: int = 0
    # fp8 products summed in the tensor core's own accumulator before each promotion to fp32
    # (tl.dot's max_num_imprecise_acc). 0: every product in fp32, which Triton 3.6 lowers to
    # mma.sync (fp8 widened to fp16) on sm90; block_k: wgmma e4m3 (lanekit export: the per-tensor
    # and rowwise samples then compile to wgmma m64n64k32 with no spill, the 128x128-block ones
    # spill 440-904 bytes). Not switched on anywhere until the H200 measures its accuracy (the
    # fp32 output's 16-step tolerance) and speed.
    imprecise_acc: int = 0

    def options(self) -> dict:
        return tile_options(self)


# Under the interpreter every program runs in Python: few mid-sized tiles (tl.dot needs >= 16)
# that still split the samples' odd shapes (13 x 27 x 41, K = 100) into several tiles.
INTERPRETER = GemmConfig(32, 32, 32, 1, 1, 1)

# Every block_k below divides 128 (the block scheme's 128-wide K groups: one scale per step).
# By the least M a row serves.
GEMM: dict[str, dict[int, GemmConfig]] = {
    "generic": {
        1: GemmConfig(16, 64, 64, 8, 4, 2),
        64: GemmConfig(64, 64, 64, 8, 4, 2),
    },
    # H100/H200: prefill 128 x 128 x 128 fp8 tiles over two warpgroups (8 warps, wgmma m64) and
    # 4 stages (4 x 32 KiB of operands in 227 KiB); decode (M <= 63): 64 rows (wgmma's least),
    # 64 columns, deep K steps to keep reads of b in flight
    "sm90": {
        1: GemmConfig(64, 64, 128, 8, 4, 3),
        64: GemmConfig(64, 128, 128, 8, 4, 4),
        256: GemmConfig(128, 128, 128, 8, 8, 3),
    },
    # A100: mma.sync (fp8 widened to fp16; int8 native), 163 KiB of shared memory
    "sm80": {
        1: GemmConfig(16, 64, 128, 8, 4, 3),
        64: GemmConfig(64, 128, 64, 8, 4, 3),
        256: GemmConfig(128, 128, 64, 8, 8, 3),
    },
    # MI300 (wave64, 64 KiB LDS): 2 stages of 128 x 128 x 64 8-bit operands hold 32 KiB
    "gfx942": {
        1: GemmConfig(16, 64, 128, 8, 4, 2),
        64: GemmConfig(64, 128, 64, 8, 4, 2),
        256: GemmConfig(128, 128, 64, 8, 8, 2),
    },
    # RDNA 4 (and gfx1151 by alias; wave32, 64 KiB LDS): wmma 16 x 16 tiles, 4 warps
    "gfx1201": {
        1: GemmConfig(16, 64, 64, 8, 4, 2),
        64: GemmConfig(64, 64, 64, 8, 4, 2),
    },
}

# MXFP8 takes one scale per 32 along K: a K step of 32 (one scale a step), the row's other fields
MX_BLOCK_K = 32
# The 128 x 128 block scheme's group of K (and of N for b)
BLOCK_GROUP = 128
# The per-token quantize pass: columns a program reads a step, and its warps
QUANT_BLOCK = 1024
QUANT_WARPS = 4


def gemm_config(device: torch.device, M: int, *, mx: bool = False) -> GemmConfig:
    if device.type != "cuda" and compiling() is None:
        cfg = INTERPRETER
    else:
        rows = arch_row(GEMM, device)
        cfg = rows[max(k for k in rows if k <= max(M, 1))]
    if mx:
        cfg = dataclasses.replace(cfg, block_k=MX_BLOCK_K, imprecise_acc=min(cfg.imprecise_acc, MX_BLOCK_K))
    assert BLOCK_GROUP % cfg.block_k == 0, cfg
    return cfg


# ---- 4-bit weights (w4a16_linear, mxfp4_linear) ----
# The weight tile is unpacked and dequantized in registers each K step (int32 words or bytes,
# shifts and masks, a subtraction), so the weight's shared-memory stage is a quarter of a 16-bit
# one's. None is measured on a GPU yet (docs/tuning/gemm.md); where the rows come from is said on each.
W4: dict[str, dict[int, GemmConfig]] = {
    "generic": {
        1: GemmConfig(16, 64, 128, 8, 4, 2),
        64: GemmConfig(64, 64, 64, 8, 4, 2),
    },
    # H100/H200: 64 rows even at decode (wgmma's least M), 128 of K a step (one AWQ/GPTQ group
    # of 128), 8 warps for the two accumulators and the unpacked code tile (4 warps spilled 40
    # bytes on GPTQ's fp16 sample, lanekit export 2026-12-07); prefill: 128 x 128 over 8 warps
    "sm90": {
        1: GemmConfig(64, 64, 128, 8, 8, 3),
        64: GemmConfig(64, 128, 128, 8, 4, 3),
        256: GemmConfig(128, 128, 64, 8, 8, 3),
    },
    # A100: mma.sync m16n8k16, so 16 rows at decode; 163 KiB of shared memory
    "sm80": {
        1: GemmConfig(16, 64, 128, 8, 4, 3),
        64: GemmConfig(64, 128, 64, 8, 4, 3),
        256: GemmConfig(128, 128, 64, 8, 8, 3),
    },
    # MI300 (wave64, 64 KiB LDS): 2 stages; mfma 16 x 16 tiles at decode
    "gfx942": {
        1: GemmConfig(16, 64, 128, 8, 4, 2),
        64: GemmConfig(64, 128, 64, 8, 4, 2),
        256: GemmConfig(128, 128, 64, 8, 8, 2),
    },
    # RDNA 4 (and gfx1151 by alias; wave32, 64 KiB LDS): wmma 16 x 16 tiles, 4 warps
    "gfx1201": {
        1: GemmConfig(16, 64, 64, 8, 4, 2),
        64: GemmConfig(64, 64, 64, 8, 4, 2),
    },
}


def _w4_row(device: torch.device, M: int) -> GemmConfig:
    if device.type != "cuda" and compiling() is None:
        return INTERPRETER
    rows = arch_row(W4, device)
    return rows[max(k for k in rows if k <= max(M, 1))]


# GPTQ's act-order (g_idx) keeps two dequantized weight tiles live (the 16-bit value and its
# remainder, two tl.dot): RDNA's K step of 64 spilled 424 bytes on the act-order sample (lanekit
# export 2026-12-07), 32 does not
ACT_ORDER_BLOCK_K: dict[str, int] = {"generic": 128, "gfx1201": 32}


def w4a16_config(device: torch.device, M: int, group_size: int, K: int, act_order: bool = False) -> GemmConfig:
    """The row for M, its K step no wider than a group (a run of K steps never straddles two
    groups: a wider step would only load masked lanes) and at least 16 (tl.dot's least);
    with act-order no wider than ACT_ORDER_BLOCK_K."""
    cfg = _w4_row(device, M)
    span = group_size if group_size < K else K
    block_k = max(16, min(cfg.block_k, 1 << max(span - 1, 0).bit_length()))
    if act_order and cfg is not INTERPRETER:
        block_k = min(block_k, arch_row(ACT_ORDER_BLOCK_K, device))
    return dataclasses.replace(cfg, block_k=block_k)


def split_k(device: torch.device, tiles: int, steps: int) -> int:
    """How many programs share each output tile's K (their fp32 partial sums added by a second
    launch): 1 where the tiles give every processor two programs; else enough splits for that
    (decode's single row of tiles left 64 programs on the H100's 132 SMs, each walking all of K:
    w4a16 read its weight at 125 GB/s, 2026-12-07), each split at least two K steps."""
    processors = processor_count(device)
    if tiles >= 2 * processors:
        return 1
    return max(1, min(-(-2 * processors // tiles), steps // 2))


def mxfp4_config(device: torch.device, M: int) -> GemmConfig:
    """The row for M with a K step of 32: one e8m0 scale per column a step."""
    return dataclasses.replace(_w4_row(device, M), block_k=MX_BLOCK_K)


# ---- compile allowances (lanekit export / targets): (kernel, target) -> (bytes | regex, reason)
SPILL_ALLOWANCES: dict[tuple[str, str], tuple[int, str]] = {
    ("_scaled_mm_kernel", "sm90"): (560, (
        "the 128x128-block fp8 scheme on the decode row (64 x 64 x 128, 4 warps, fp8 widened for "
        "mma.sync, the block scales multiplied per K step), K 700 with fp32 output: 560 bytes; "
        "the other block samples do not spill; not yet given a row of its own")),
    ("_scaled_mm_kernel", "gfx1151"): (16, (
        "the 128x128-block fp8 scheme on gfx1201's rows (RDNA 3.5 has no fp8 WMMA: e4m3 widened "
        "to fp16, with the block scales per K step): 8 to 12 bytes")),
}
MATRIX_ALLOWANCES: dict[tuple[str, str], tuple[str, str]] = {}
_FP8_SM90 = (
    "lanekit export, Triton 3.6.0: with max_num_imprecise_acc=0 (every fp8 product promoted to "
    "fp32, imprecise_acc 0 in every row) the fp8 tl.dot lowers to mma.sync on sm90 (e4m3/e5m2 "
    "widened to fp16, exactly), not wgmma; int8 and W8A16 take wgmma; imprecise_acc = block_k "
    "gives wgmma e4m3 (docs/tuning/gemm.md), not yet measured for accuracy")
MATRIX_ALLOWANCES[("_scaled_mm_kernel", "sm90")] = (r"\bmma\.sync\.aligned\.\S+", _FP8_SM90)


# ---- int4 x int8 (w4a8_linear) and int4 x int4 (int4_mm): the int8 dot ----
# The 4-bit codes are unpacked to int8 in registers and multiplied on the int8 tensor cores, so the
# rows of the 8-bit table (GEMM) serve, with a K step of at least 32 (the int8 MMA's K) and, for
# w4a8_linear, at most a group (a run of K steps never straddles two groups). None is measured on
# a GPU yet (docs/tuning/gemm.md).
INT8_MIN_BLOCK_K = 32


# Mode 2's correction keeps the row sums of the activation codes live beside the int32 partial
# sum: sm90's decode row (64 x 64 x 128, 4 warps) spilled 40 bytes with it, 16 with a K step of
# 64 (lanekit export 2026-12-07, group 128); 32 does not. sm80's decode row (16 x 64 x 128,
# 4 warps) spilled 8 bytes at 168 registers with fp32 x; a K step of 64 does not (lanekit targets
# 2026-12-07)
W4A8_CORRECTION_BLOCK_K: dict[str, int] = {"generic": 128, "sm90": 32, "sm80": 64}


def w4a8_config(device: torch.device, M: int, group_size: int, correction: bool = False) -> GemmConfig:
    """The 8-bit row for M, its K step the largest power of two dividing group_size (a multiple
    of 32), no wider than the row's (with mode 2's correction: than W4A8_CORRECTION_BLOCK_K)."""
    cfg = gemm_config(device, M)
    widest = cfg.block_k
    if correction and cfg is not INTERPRETER:
        widest = min(widest, arch_row(W4A8_CORRECTION_BLOCK_K, device))
    block_k = min(widest, 1 << (group_size.bit_length() - 1))
    while group_size % block_k:
        block_k //= 2
    return dataclasses.replace(cfg, block_k=max(block_k, INT8_MIN_BLOCK_K), imprecise_acc=0)


def int4_mm_config(device: torch.device, M: int) -> GemmConfig:
    """The 8-bit row for M (K steps of at least 32: K is a multiple of 32)."""
    cfg = gemm_config(device, M)
    return dataclasses.replace(cfg, block_k=max(cfg.block_k, INT8_MIN_BLOCK_K), imprecise_acc=0)


# ---- SVDQuant W4A4 (svdquant_w4a4_linear) ----
# A K step is one group of 64 (one activation and one weight scale per step); the int4 codes are
# unpacked to int8 in registers, so a stage holds 32 bytes of packed codes per row of M and of N.
# None is measured on a GPU yet (docs/tuning/gemm.md); where each row comes from is said on it.
SVDQUANT: dict[str, dict[int, GemmConfig]] = {
    "generic": {
        1: GemmConfig(16, 64, 64, 8, 4, 2),
        64: GemmConfig(64, 64, 64, 8, 4, 2),
    },
    # H100/H200: int8 wgmma takes 64 rows (m64nNk32); prefill 128 x 128 over 8 warps (two
    # warpgroups), 4 stages of 8 KiB of packed codes
    "sm90": {
        1: GemmConfig(64, 64, 64, 8, 4, 3),
        64: GemmConfig(64, 128, 64, 8, 4, 4),
        256: GemmConfig(128, 128, 64, 8, 8, 4),
    },
    # A100: mma.sync m16n8k32 s8, so 16 rows at decode
    "sm80": {
        1: GemmConfig(16, 64, 64, 8, 4, 3),
        64: GemmConfig(64, 128, 64, 8, 4, 3),
        256: GemmConfig(128, 128, 64, 8, 8, 3),
    },
    # MI300 (wave64, 64 KiB LDS): mfma i8 16 x 16 tiles at decode, 2 stages
    "gfx942": {
        1: GemmConfig(16, 64, 64, 8, 4, 2),
        64: GemmConfig(64, 128, 64, 8, 4, 2),
        256: GemmConfig(128, 128, 64, 8, 8, 2),
    },
    # RDNA 4 (and gfx1151 by alias; wave32, 64 KiB LDS): wmma iu8 16 x 16 tiles, 4 warps
    "gfx1201": {
        1: GemmConfig(16, 64, 64, 8, 4, 2),
        64: GemmConfig(64, 64, 64, 8, 4, 2),
    },
}
# RDNA 3.5: gfx1201's rows, the prefill tile over 8 warps: with 4 the fp32 sample with a bias
# (M70, rank 32) spilled 20 bytes at 256 VGPRs; 8 warps take 203 (lanekit targets 2026-12-07)
SVDQUANT["gfx1151"] = {**SVDQUANT["gfx1201"], 64: GemmConfig(64, 64, 64, 8, 8, 2)}
# Columns of the low-rank branch per epilogue step (tl.dot's K); rank 16 takes one step
SVDQUANT_BLOCK_R = 32


def svdquant_config(device: torch.device, M: int) -> GemmConfig:
    if device.type != "cuda" and compiling() is None:
        return dataclasses.replace(INTERPRETER, block_k=64)
    rows = arch_row(SVDQUANT, device)
    return rows[max(k for k in rows if k <= max(M, 1))]


def svdquant_block_r(R: int) -> int:
    """The low-rank step: at least 16 (tl.dot's least K), at most SVDQUANT_BLOCK_R."""
    return max(16, min(SVDQUANT_BLOCK_R, 1 << max(R - 1, 0).bit_length()))
