"""Tile configurations as data: one table per kernel, keyed by architecture id, then by bucket.

Launchers read these tables; no block size or warp count is written in host code. An architecture
id is ``sm<major><minor>`` on NVIDIA (``sm80``, ``sm90``) and the gfx name on AMD (``gfx942``,
``gfx1201``); ``generic`` is the fallback for any other, and for Triton's interpreter.

AMD rows (``gfx942``: CDNA 3, wave64; ``gfx1151``, ``gfx1201``: RDNA 3.5 and 4, wave32; all with
64 KiB of LDS) were chosen with ``python -m benchmarks.tune_targets --target T`` from the compiler's
resource report (the largest tile that compiles with the target's matrix instructions, fits its
LDS and spills no register), not copied from NVIDIA's; ``docs/targets.md`` shows what they compile
to. ``waves_per_eu`` (AMD only; 0 leaves it to the compiler) asks the compiler to keep registers
low enough for that many waves per SIMD.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    waves_per_eu: int = 0

    def options(self) -> dict:
        """The launch's compile options: warps, stages, and waves per EU where one is set (AMD)."""
        return _options(self)


def _options(cfg) -> dict:
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.waves_per_eu:
        opts["waves_per_eu"] = cfg.waves_per_eu
    return opts


# The interpreter runs each program in Python, paying per operation rather than per element:
# 32x32 tiles ran the backward tests three times faster than 16x16 and still split the tests'
# odd lengths (17, 37, 97, 129) into several blocks.
INTERPRETER = TileConfig(32, 32, 1, 1)


_COMPILING_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("compiling_for", default=None)


@contextlib.contextmanager
def compiling_for(arch: str):
    """Within this block :func:`arch_id` answers ``arch`` for every device, so that launchers pick
    that architecture's rows: ``lanekit export`` captures a target's launches this way on a machine
    without that GPU (``lanekit.runtime.targets.capture``)."""
    token = _COMPILING_FOR.set(arch)
    try:
        yield
    finally:
        _COMPILING_FOR.reset(token)


def arch_id(device: torch.device) -> str:
    """``sm90``, ``gfx942``, ... for a GPU device; ``generic`` for anything else; the target arch
    inside :func:`compiling_for`."""
    compiling = _COMPILING_FOR.get()
    if compiling is not None:
        return compiling
    if device.type != "cuda" or not torch.cuda.is_available():
        return "generic"
    return _cuda_arch_id(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_arch_id(index: int) -> str:
    """The architecture of CUDA/ROCm device ``index``, asked of the driver once per process."""
    props = torch.cuda.get_device_properties(index)
    if getattr(torch.version, "hip", None):
        return props.gcnArchName.split(":")[0]
    return f"sm{props.major}{props.minor}"


def lookup(table: dict[str, dict[int, TileConfig]], device: torch.device, bucket: int) -> TileConfig:
    """The config for ``bucket`` on ``device``'s architecture, else the generic one."""
    rows = table.get(arch_id(device), table["generic"])
    return rows.get(bucket, table["generic"][bucket])


def _block16(n: int) -> int:
    """The least power of two that holds n, and at least 16 (the smallest tile tl.dot takes)."""
    return max(16, 1 << max(n - 1, 0).bit_length())


# ---- fused layers (lanekit.layers) ----

@dataclass(frozen=True)
class NormConfig:
    """Rows up to ``max_block_n`` features are held in registers (x read once); wider rows are
    walked in blocks of ``max_block_n``."""

    max_block_n: int
    num_warps: int


# norm_fwd / norm_bwd, keyed by the padded row width (a power of two); a width over the largest
# key takes the largest key's row. generic: 4 warps up to 1024 features, then 8, then 16 from 8192.
# On the H200 (benchmarks.tune_layers, 8k rows of 4096) 4 and 8 warps are within 1% of each
# other for RMSNorm and LayerNorm (3786 to 3865 GB/s), and 16 warps lose 10% on RMSNorm: generic kept.
NORM: dict[str, dict[int, NormConfig]] = {
    "generic": {
        1024: NormConfig(1024, 4),
        4096: NormConfig(4096, 8),
        16384: NormConfig(16384, 16),
        65536: NormConfig(16384, 16),
    },
}
# AdaLN with one row of scale and shift per batch entry: the forward's programs take up to this many
# rows of one entry each, loading that row once (every row reloads it at 1: 16 KB beside 16 KB of x
# and y at N = 4096, bf16). On the H200 (benchmarks.run layers, 2026-12-01) 4 rows ran at 2842 GB/s,
# 67% of copy, against 3242 (76%) for one row a program before the change: 1 until a sweep
# (benchmarks.tune_layers) finds better.
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
    # prefetches by PTX instructions, so in NVIDIA rows only (layers.kernels._prefetch_rows):
    prefetch_rope: int = 0         # 1: the q-and-k kernels' cos and sin rows into L1
    norm_prefetch_ahead: int = 0   # RMSNorm + RoPE of q and k: a program's prefetch into L2 of the
                                   # rows of x of the program about this many later, of the same
                                   # head block (a whole number of token blocks; 0: none)
    quant_prefetch_ahead: int = 0  # the same for the quantized form


# sm90: `python -m benchmarks.tune_layers` on the H200 (CUDA-graph timing, Llama-3-8B shapes):
# RoPE of q 3844 GB/s at 32 rows and 4 warps (3848 with 8). The q-and-k kernel (one launch since)
# is sized from its sm90 SASS (`python -m benchmarks.sass`, issued instructions per element on the
# path real inputs take), not yet timed: a thread's share of a tile carries fixed work (addresses,
# per-row fp64 rstd, divisions), so more elements per thread cost less each. RMSNorm + RoPE at 32
# rows and 4 warps: 15.2 per element, 71 registers (16 rows: 18.7; 64: 13.2 at 132 registers);
# with quantization at 64 rows: 21.8 per element, 153 registers (32 rows: 25.7; 128: 20.2 at 254).
# Before (two launches, 16 and 32 rows): 20.3 and 26.5 per element, at 40 and 72 registers.
# RDNA (`benchmarks.tune_targets --sweep rope_bwd`): the backward of RMSNorm + RoPE spilled with 16
# tokens a program on wave32 at D=80; 8 do not. Its q-and-k forwards keep the smaller tiles there.
# Timed on the H200 (2026-12-01): RMSNorm + RoPE at 32 rows 3466 GB/s (82% of copy; two launches:
# 3310); the quantized form at 64 rows 2139 GB/s (50%; two launches at 32 rows: 2548): its 153
# registers cost more than the instructions saved. 32 rows for it (25.7 per element) is not yet timed.
# Swept on the H200 (`benchmarks.tune_layers ROTARY:...`, 2026-12-01): the quantized form at 8 rows
# and 1 warp 2644 GB/s (62% of copy), 16 rows and 2 warps 2574, 32 rows and 4 warps 2267: small
# programs, many of them resident (88 registers capped the 4-warp programs at 31% occupancy).
# Swept again (2026-12-02, `benchmarks.tune_layers ROTARY_MAXNREG "ROTARY:rms_norm_rope q,k"`): capped
# at 72 registers (28 one-warp programs an SM resident, not 25; no spills at D=128 with RoPE on all
# features, the shape swept; other shapes keep ptxas's count: quant_register_cap) the quantized form
# reads 2725 GB/s against 2621 uncapped, and 2530 at 64 (spilling). ncu on a 96-register variant
# showed 20 warps an SM resident, 0.63 instructions issued a cycle, and the most stalls on loads
# (long scoreboard, 37%), which read as loads in flight binding it (but see the TMA variant
# below: more loads in flight did not help). Three variants, tried on throwaway code and swept the same
# way, were slower: programs looping over 2 to 32 tiles of tokens with the weights loaded once
# (17.6 instructions an element, not 24.5, but 128 registers: 2435 GB/s at best), that loop with
# its loads pipelined through shared memory (2 or 3 stages: 2112), and cos and sin loaded beside x
# (2385). RMSNorm + RoPE at 8 rows and 1 warp: 3594 GB/s, against 3433 at the earlier 32 rows and 4 warps.
# Loads in flight are not what binds it (2026-12-02): a throwaway kernel that streamed the tiles in
# through tensor descriptors (TMA; persistent programs holding the weights, 2 to 4 tiles in flight
# in shared memory, no registers spent on them) swept 84 tiles, programs an SM, stages and caps
# beside the shipped row in one run: at best 2397 GB/s (16 one-warp programs an SM, 8 rows, 3
# stages) against 2727. The shipped kernel's SASS issues about 24 instructions an element, 14 of
# them the exact fp32 steps and fp64 sum of squares that reference.layers.qk_norm_rope_quant
# specifies; at the ~2.6 instructions a cycle an SM that 2727 GB/s implies, 80% of copy needs
# about 20.
# Where its cycles go (ncu on the H200, 2026-12-02: `gpu.sh ncu`, then the smsp__average_warps_
# issue_stalled_* and sm__inst_executed_pipe_* metrics in a second run): instructions issued on 69%
# of cycles; per issued instruction a warp waits 9.0 cycles, of which 2.75 on global loads (long
# scoreboard), 1.9 not selected (another warp issued), 1.23 on fixed latencies, 0.66 on a busy
# pipe; no pipe above 41% (ALU 41, FMA 37, FP64 10); up to 28 one-warp programs an SM resident (72
# registers; 25.5 achieved), 6.25 warps a scheduler active. RMSNorm + RoPE without quantization:
# issued on 45% of cycles, 9.9 of its 13.1 cycles a warp waits on global loads. Two more variants
# (throwaway code, 2026-12-02):
# - persistent programs that issue the next tile's loads into registers before computing this
#   one's (the rows worked out again per tile, not held), timed by tune_layers (its candidates
#   and the shipped kernel in one run): at best 2741 GB/s (16 programs an SM,
#   128 registers) against 2743 for the shipped kernel, and RMSNorm + RoPE 3487 against 3590. The
#   loads in flight are hidden, but with fewer warps resident the other waits are not.
# - q's or k's pointers and row strides chosen by one branch on the program's flag instead of a
#   select of each pair (uniform registers instead of ~20 vector instructions; 795 SASS
#   instructions on the path taken, as the shipped kernel's 791): 2828 GB/s (one run, a version
#   correct only when q's and k's strides specialize alike; the shipped kernel 2743 in a separate
#   run that day). Not kept: the branch's arms must agree in type, and every way to make them agree
#   for all inputs (a cast in the arms, or unspecialized strides) makes the compiler copy the whole
#   kernel into both arms (2400+ SASS instructions, against the shipped kernel's 1224).
# - (2026-12-02, `benchmarks.sass`, not timed) cos and sin loaded once per program when it holds
#   one token (BLOCK_S = 1, as at Llama-3-8B shapes) and broadcast over its heads: 827 SASS
#   instructions on the path taken against 791 (the broadcast's layout costs more than the 16 loads
#   and conversions a thread saves); RMSNorm + RoPE 470 against 463.
# (2026-12-02, later; old and new code alternated in one run, twice, A/B) Three changes
# to the q-and-k kernel, kept: bf16 widened by an integer shift (one instruction an element, not
# two: layers.kernels._to_f32), the weight's `+ offset` done once per weight element a thread holds,
# not once per column of its tile (_per_feature: 8 additions a thread, not 32), and a token block's
# head blocks launched as adjacent programs. The first two cut the quantized form from 791 to 698
# SASS instructions on the path taken (`benchmarks.sass`; 700 with the third's index arithmetic) and
# RMSNorm + RoPE from 463 to 423 (420): 2731 -> 2838 GB/s quantized, RMSNorm + RoPE level (3620).
# The launch order then took RMSNorm + RoPE to 3820 (90% of copy) and the quantized form to 2870
# (68%). Tried beside them and not kept: the weights loaded before the sum of squares (2811 to
# 2833), cos and sin loaded there too (2116: 102 registers and their loads beside x's); ptxas's own
# register count (85, no spills) reads as the 72 cap does (2863 against 2861). Both forms now take
# about the same time per element (45 us for Llama-3-8B's 8k tokens) although the quantized one
# issues 65% more instructions: what binds them is no longer the instruction count alone. ncu on the
# shipped kernels (`NCU_CASES="layers:qk_norm_rope_quant~e4m3:_qk_norm_rope_fwd" bash scripts/gpu.sh
# ncu`): quantized, 43.1 us, an instruction issued on 66% of cycles, 6.24 warps a scheduler active
# (28 an SM at most: registers), 1.85 eligible, a warp waiting 9.4 cycles an instruction of which
# 3.2 on loads, DRAM 57% busy; RMSNorm + RoPE 40.8 us, issuing on 45%, DRAM 76%. At 66% issue the
# quantized form needs about 620 instructions a program (not 700) for 80% of copy; the ~310 that are
# not the oracle's per-element steps (addresses, the fp64 rstd, two divisions, the tile-wide checks,
# the weights' layout change, cos and sin) are each 20 to 80.
# (2026-12-03; A/B, 2c88e8c's code and the new alternated in one run on the H200, twice) Fewer
# instructions did not help alone: int32 row offsets where they fit and the fp64 rstd from the
# hardware's reciprocal square root where its fp32 rounding is certain (layers.kernels.
# _rsqrt_f32_candidate) cut the quantized form from 700 to 662 SASS instructions on the path
# taken and RMSNorm + RoPE from 420 to 393, at the same GB/s (2838 and 3783 against 2838 and 3793).
# ncu then showed 20% of stall samples on the first use of x (DRAM) and 12% on cos and sin (L2),
# each warp holding only its 2 KB of x in flight. Prefetches, which hold no registers, took it:
# cos and sin into L1 once x's loads are issued (prefetch_rope), and into L2 x's rows of the
# program `quant_prefetch_ahead` later (swept 512 to 7392; 2048 to 3696 alike, 2560 best; about
# 3700 one-warp programs are resident). Quantized: 2853 -> 2990 (cos and sin) -> 3030 GB/s (both);
# RMSNorm + RoPE 3840 -> 3935 with cos and sin alone (x ahead lowers it: 3850 at 2560, 3110 at
# 7392). 2c88e8c's 700-instruction kernel with the same prefetches stays at 2870: once the latency is
# hidden the instruction count binds again, so the two changes count only together. bench-layers
# that day: 3043 GB/s (72% of copy) and 3913 (92%). `benchmarks.tune_layers ROTARY_PREFETCH`
# sweeps these fields.
# (2026-12-03, later; A/B against f132437 alternated in one run, five pairs) The x prefetch now
# takes the tile of the same head block a whole number of token blocks ahead (the row's count of
# programs rounded to them): only its tokens differ from the program's own tile, so its addresses
# reuse the tile's. 722 -> 691 SASS instructions on the path taken; quantized 3009-3024 -> 3025-3049
# GB/s (+0.6%), RMSNorm + RoPE unchanged (no x prefetch). Fewer instructions buy little now: ncu on
# it, an instruction issued on 70% of cycles, 6.28 warps a scheduler active, 2.18 eligible, 8.95
# cycles a warp waits an instruction, DRAM 59% busy. Tried the same day, not kept:
# - quant_maxnreg 56 and 64 (36 and 32 warps an SM, 18 and 15 spill instructions): 2845 and 2866
#   GB/s against 3027 at 72; 80 reads as 72 (3026).
# - programs looping over tiles (grid-stride, a grid of 14 to 28 programs an SM, weights loaded
#   once): 579 instructions a tile against 722, but 137 registers uncapped (weights, pointers and
#   strides held across the loop); capped at 72 it spills (64 spill instructions) and the loop form
#   with one tile a program fell to 1616 GB/s. Best looping: 2775 (14 programs an SM, 112
#   registers, no spills) against 3096 for the shipped kernel in that run.
# (2026-12-03, third session) The quantized form's codes no longer depend on the norm (the per-row
# rstd divides out of n / scale: reference.layers.qk_norm_rope_quant), so the kernel dropped the
# exact fp64 sum of squares, the fp64 rstd and its certainty check, the product by rstd, and one
# of its two correctly rounded divisions: 691 -> 558 SASS instructions on the path taken, no
# spills at the 72 cap. A/B on the H200 (.gpu/ab_loop.py, the bench's inputs, CUDA graphs, old and
# new code alternated, three pairs each): 2965-2987 -> 3247-3266 GB/s on one machine; on another
# 3130-3146 -> 3362-3366, and 3389-3396 with quant_prefetch_ahead 2048 (3126-3128 for the old
# code at 2048): kept. Swept on the new kernel (`tune_layers ROTARY_MAXNREG ROTARY_PREFETCH`): caps
# 64 and 80 and ptxas's own count read below 72 (2926, 3189, 3260 against 3250 in the A/B); the
# prefetch at 1024 to 3696 within 1% (2048 best, 3214 in tune_layers' timing, 2560 3190). Tried,
# not kept: the outputs and scales addressed by one contiguous row index instead of picked strides
# (546 instructions, 12 fewer, but ptxas then spilled 4 registers on the path taken at the 72 cap:
# 3140 GB/s against 3364). ncu on the kept kernel: 38.0 us, an instruction issued on 63% of cycles,
# 6.15 warps a scheduler active and 1.43 eligible, DRAM 65% busy. bench-layers at 968dc46: 3223
# GB/s, 76% of copy (4220). Later that day, not yet timed (the device budget was spent; tests,
# compute-sanitizer and lanekit check passed natively): with every pair present the feature offsets
# are constants (EVEN: HALF = BLOCK_HALF; ROT_ALL: rotary from feature 0), which freed the
# registers that the contiguous output rows had spilled, so those went in too: 558 -> 519 SASS
# instructions on the path taken, no spills at the 72 cap; RMSNorm + RoPE 408 -> 383, 62 registers.
# (2026-12-03, fourth session) Timed, with the fixes at the ends of the range on top (7981b7d: 531
# instructions on the path taken, its program-uniform addresses now on the uniform datapath), the
# three alternated on one H200 (.gpu/ab.py, three rounds, copy 4231 GB/s): 968dc46 3207-3215 GB/s,
# 723d4de's kernel 3320-3333, 7981b7d 3424-3431. bench-layers at 7981b7d: 3458 GB/s, 81% of copy
# (4244), 1.93x torch.compile. Again on another H200 with `benchmarks.ab` (two rounds): 723d4de's
# kernel 3357-3381 GB/s, 7981b7d 3473-3479 (copy 4244-4248).
ROTARY: dict[str, RotaryConfig] = {
    "generic": RotaryConfig(32, 4, norm_block_rows=32, quant_block_rows=32, norm_num_warps=4),
    "sm90": RotaryConfig(32, 4, norm_block_rows=8, quant_block_rows=8, norm_num_warps=1, quant_num_warps=1,
                         quant_maxnreg=72, prefetch_rope=1, quant_prefetch_ahead=2048),
    "gfx1201": RotaryConfig(32, 4, norm_block_rows=16, bwd_block_s=8, quant_block_rows=32, norm_num_warps=4),
}
ROTARY["gfx1151"] = ROTARY["gfx1201"]


@dataclass(frozen=True)
class EltwiseConfig:
    block_n: int      # features per program (one row)
    num_warps: int
    # a row of several blocks whose N block_n does not divide (rows not flattened: a fused input)
    # takes the largest block down to block_n >> fit_shifts that does, and warps in proportion
    fit_shifts: int = 2


# sm90: the same sweep, SwiGLU at 8k x 14336: 8192 features and 16 warps 4248 GB/s, against 4152 to
# 4191 for 1024 to 4096 features with 4 to 16 warps. Again on 2026-12-01 (`tune_layers GLU`): 4096
# and 16 warps 4366, 2048 and 8 warps 4357 (4356 fused), 8192 and 16 warps 4336: all within 1%.
# (2026-12-03, A/B against 1417c16 alternated in one run, three pairs) SwiGLU from one fused
# (8k, 2 x 14336) tensor, whose halves cannot be flattened into one row: 4096-blocks leave half of
# each row's last block idle; 2048 and 8 warps (fit_shifts) 4363-4364 GB/s against 4335-4337,
# torch.compile 4355-4356 in the same runs.
GLU: dict[str, EltwiseConfig] = {"generic": EltwiseConfig(1024, 4), "sm90": EltwiseConfig(4096, 16)}

# Under the interpreter every program runs in Python: fewer, larger programs are faster.
INTERPRETER_NORM_BWD_PROGRAMS = 4


def _arch_row(table: dict, device: torch.device):
    return table.get(arch_id(device), table["generic"])


def norm_config(device: torch.device, N: int) -> NormConfig:
    rows = _arch_row(NORM, device)
    width = _block16(N)
    key = min((k for k in rows if k >= width), default=max(rows))
    return rows[key]


def norm_bwd_programs(device: torch.device) -> int:
    if device.type != "cuda" and _COMPILING_FOR.get() is None:
        return INTERPRETER_NORM_BWD_PROGRAMS
    return _arch_row(NORM_BWD_PROGRAMS, device)


def rotary_config(device: torch.device) -> RotaryConfig:
    return _arch_row(ROTARY, device)


def quant_register_cap(cfg: RotaryConfig, D: int, rotary_dim: int, interleaved: bool) -> int:
    """The register cap (Triton's maxnreg; 0 for none) of a quantized q-and-k launch: the row's
    quant_maxnreg, but only at the shapes it was swept at and compiles without spilling under,
    NeoX RoPE over all of a power-of-two D of up to 128 (sm90 at 72: D=64 and 128 take no stack;
    interleaved, partial rotary, D=96 and D=256 spill 16 to 264 bytes a thread, so they keep
    ptxas's own register count)."""
    fits = rotary_dim == D and not interleaved and D <= 128 and D & (D - 1) == 0
    return cfg.quant_maxnreg if fits else 0


def glu_config(device: torch.device) -> EltwiseConfig:
    return _arch_row(GLU, device)


# RNN cells (lanekit.rnn). The forward is one GEMM per gate over K = In (then K = H) fused with
# the gate math: block_b batch rows by block_h hidden units of every gate, walking K by block_k.
# Keyed by the batch bucket: B rounded up to a power of two, clamped to 16..128 (tl.dot needs 16
# rows). Not yet measured on any GPU: the generic rows are sized to fit every target (the four
# fp32 accumulators of an LSTM or GRU program are 4 * block_b * block_h values); the sm90 rows are
# a stated guess (more stages, 8 warps for the larger tiles) until a benchmark measures them. Every
# row compiles for sm90 (Triton's compiler run for that target on a CPU: at most 106 KB of shared
# memory, for the LSTM at 64x64x64 with 3 stages). Small batches take narrow tiles so that a
# (B <= 16, H = 1024) step still spreads over 32 programs.
@dataclass(frozen=True)
class RnnTileConfig:
    block_b: int
    block_h: int
    block_k: int
    num_warps: int
    num_stages: int
    waves_per_eu: int = 0

    def options(self) -> dict:
        return _options(self)


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
RNN_CELL_FWD["gfx1201"] = RNN_CELL_FWD["gfx1151"] = {
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
RNN_CELL_FWD_FP32["gfx1201"] = RNN_CELL_FWD_FP32["gfx1151"] = {
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


# Paged KV cache (lanekit.kv_cache): writes to and reads from pages, quantizing or dequantizing on
# the way, and the merge of attention partials. Each program moves ``tile`` elements: tile //
# BLOCK_D rows of one (token, head) each (BLOCK_D: the head dim rounded up to a power of two), so a
# row's amax for the quantized write stays in one program. Not yet measured on any GPU: 4096
# elements (32 rows of D=128, 32 per thread with 4 warps) is a stated guess for a copy kernel.
@dataclass(frozen=True)
class KvCacheConfig:
    tile: int
    num_warps: int


KV_CACHE: dict[str, KvCacheConfig] = {"generic": KvCacheConfig(4096, 4)}


def kv_cache_config(device: torch.device) -> KvCacheConfig:
    return _arch_row(KV_CACHE, device)
