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


# flash_attn_fwd: keyed by the padded head dim (max of Dqk and Dv, rounded up to a power of two, at
# least 16). Bigger head dims take smaller tiles so that q, k, v tiles and the accumulator fit in
# registers and shared memory.
FLASH_ATTN_FWD: dict[str, dict[int, TileConfig]] = {
    "generic": {
        16: TileConfig(64, 64, 4, 2),
        32: TileConfig(64, 64, 4, 2),
        64: TileConfig(64, 64, 4, 2),
        128: TileConfig(64, 64, 4, 2),
        256: TileConfig(64, 32, 4, 1),
    },
    # sm90: checked with `python -m benchmarks.tune_attention` on an H200 (bf16, S=4096): for D=64,
    # 4 stages gave 415 TFLOP/s instead of 378 without causal, the same with causal; not yet taken.
    "sm90": {
        16: TileConfig(128, 64, 4, 3),
        32: TileConfig(128, 64, 4, 3),
        64: TileConfig(128, 64, 4, 3),
        128: TileConfig(128, 64, 8, 3),
        256: TileConfig(64, 64, 4, 2),
    },
    "sm80": {
        16: TileConfig(128, 64, 4, 3),
        32: TileConfig(128, 64, 4, 3),
        64: TileConfig(128, 64, 4, 3),
        128: TileConfig(128, 64, 8, 3),
        256: TileConfig(64, 32, 4, 2),
    },
    # RDNA (wave32): `benchmarks.tune_targets --target gfx1201 --sweep attn_fwd`. Every warp holds
    # the whole k and v tiles of a step as WMMA operands (D x block_n over 32 lanes), so the
    # generic 64x64 with 4 warps spilled up to 4 KB per thread at D=128; narrower key blocks and
    # 8 warps do not spill. gfx1151 (RDNA 3.5) takes the same rows: same wave size and LDS.
    "gfx1201": {
        16: TileConfig(128, 64, 4, 2),
        32: TileConfig(128, 64, 8, 2),
        64: TileConfig(128, 32, 8, 2),
        128: TileConfig(32, 32, 8, 1),
        256: TileConfig(128, 16, 8, 2),
    },
    # CDNA 3 (wave64, MFMA): `benchmarks.tune_targets --target gfx942 --sweep attn_fwd`: the
    # generic 64x64 spilled with bias + mask (D=111) and with dropout (D=32); 128-row tiles with 4
    # warps fit in 512 VGPRs + AGPRs and 64 KiB of LDS, with 32 keys a step at D=128.
    "gfx942": {
        16: TileConfig(128, 64, 4, 2),
        32: TileConfig(128, 64, 4, 2),
        64: TileConfig(128, 64, 4, 2),
        128: TileConfig(128, 32, 4, 2),
        256: TileConfig(128, 64, 4, 2),
    },
}
FLASH_ATTN_FWD["gfx1151"] = FLASH_ATTN_FWD["gfx1201"]

# flash_attn_with_kvcache (decode and chunked prefill over a paged cache): block_m rows of (query,
# head) pairs (decode uses 16, the least tl.dot takes, when Sq * group <= 16), block_n keys per step.
# Same buckets as the forward. Decode streams the cache once: the tile is sized for bandwidth.
FLASH_ATTN_KVCACHE: dict[str, dict[int, TileConfig]] = {
    "generic": {
        16: TileConfig(64, 64, 4, 2),
        32: TileConfig(64, 64, 4, 2),
        64: TileConfig(64, 64, 4, 2),
        128: TileConfig(64, 64, 4, 2),
        256: TileConfig(32, 32, 4, 1),
    },
    # sm90: `python -m benchmarks.tune_decode --quick` on the H200 (2026-12-01, B=32, 32 query and
    # 8 KV heads of 128, bf16, 32k keys, copy at 4248 GB/s): 128 keys a step, 8 warps, 3 stages read
    # a contiguous cache at 4518 GB/s with 1 or 2 splits (64 keys: 4497 at best), pages of 256 at
    # 4458 / 4433. Before the K/V loads were 16 bytes wide no tile passed 2531. At 4k keys
    # (2026-12-02) it reads 4298 GB/s unsplit, 64 keys with 4 warps and 3 stages 4390 (two programs
    # per SM, but 4564 against 4606 at 32k): kept. A persistent grid did not close 4k's gap to cuDNN
    # (throwaway code, 2026-12-02): programs looping over (row block, split, KV head, sequence)
    # items, the key loops flattened into that loop (tl.range(flatten=True)) so that an item's first
    # loads could overlap the last one's tail, read 4256 to 4267 GB/s at 1, 2 or 4 programs an SM,
    # as a program per item did (4266; cuDNN 4441 in that run); pages of 256 fell to 2987 (4237 in
    # the bench record then, measured at 2cd6cd3). Nor did walking a sequence's key blocks in three
    # loops as the prefill kernel does (2026-12-02, throwaway code): the masked blocks at either
    # end, the blocks every row sees in between with no key or window mask. Timed against the
    # shipped kernel in alternation (`benchmarks.run decode`, two runs of each): at 4k contiguous
    # 4200 / 4196 GB/s against 4305 / 4312, pages of 16 4078 / 4098 against 4150 / 4119, pages of
    # 256 4250 / 4242 against 4321 / 4325; at 32k 0.1% to 0.8% below. The masks are not what costs
    # at 4k; the likely cost (not profiled) is the extra loops' pipeline prologues.
    # Nor did merging the splits in the kernel (2026-12-02, throwaway code): with 2 or more splits
    # each program counted itself in a zeroed int32 per (sequence, KV head, row block) after
    # writing its partial (barrier, then an acq_rel atomic), and the last to arrive merged the
    # partials, replacing _merge_splits_kernel (4.7 us in the profiler against the 127 us decode
    # kernel, pages of 16 at 4k, 3 splits). Against the shipped code, two alternated runs each:
    # pages of 16 at 4k 4057 / 4053 GB/s against 4061 / 4056, at 32k 4310 / 4257 against 4373 /
    # 4316; the atomic's round trip at each program's end, and the merge in the kernel's tail,
    # cost what the second launch did. What did pay, in the same runs: a contiguous cache is
    # read without a table of row numbers (that table was a torch.arange, one more kernel in
    # the graph): 4k contiguous 4273 / 4273 against 4229 / 4233.
    # This row is sm90's for caches of more than KVCACHE_SHORT_KEYS keys, contiguous or in pages
    # holding whole blocks; shorter caches and smaller pages take the rows further down
    # (FLASH_ATTN_KVCACHE_SHORT, _PER_KEY_PAGES).
    "sm90": {128: TileConfig(64, 128, 8, 3)},
    # CDNA 3 (`benchmarks.tune_targets --target gfx942 --sweep attn_kvcache`): 64 keys a step
    # spilled, and at D=128 with 2 stages needed 68 KiB of LDS; 32 keys fit. The samples exercise
    # D=64 and D=128 only.
    "gfx942": {64: TileConfig(128, 32, 4, 2), 128: TileConfig(128, 32, 4, 2)},
    # RDNA (the same sweep, gfx1201): 32 keys a step at D=64; at D=128 every candidate spills (its
    # fp32 sample), 16 keys with 8 warps least (targets.SPILL_ALLOWANCES).
    "gfx1201": {64: TileConfig(128, 32, 4, 2), 128: TileConfig(128, 16, 8, 1)},
}
FLASH_ATTN_KVCACHE["gfx1151"] = FLASH_ATTN_KVCACHE["gfx1201"]
# Paged caches take the same rows as contiguous ones. The page lookup is a load that the K and V
# addresses wait on, and Triton's pipeliner (3.6, NVIDIA) gives such loads only (num_stages - 1)
# // 2 blocks of lookahead (the TTGIR for sm90 showed one K buffer and a wait for every copy each
# step at 3 stages). So the kernel loads each block's pages a step ahead, as a loop-carried value;
# the K and V loads then wait on no load of their own step and get num_stages - 1 buffers, as a
# contiguous cache's do (2 at 3 stages). Until 2026-12-02 paged rows had their own tables with
# about twice the stages instead (128 keys, 8 warps, 5 stages; 64, 4, 5 for short caches). With the
# lookahead, on the H200 (`benchmarks.tune_decode`, one run, SDPA cuDNN on the contiguous cache 4322
# and 4472 GB/s): pages of 256 read 4311 GB/s at 4k keys with the contiguous short row (64 keys, 4
# warps, 3 stages) and 4462 at 32k with the long row (128, 8, 3); in `benchmarks.run decode` of the
# same call 4296 and 4521 GB/s, against 4285 and 4514 for the old paged rows, timed after them.
#
# Rows for 16-bit caches of more than KVCACHE_SHORT_KEYS keys whose pages do not hold whole key
# blocks of the long row (page_size not a multiple of its block_n, or left padding): a page lookup
# per key, per page where pages of a power of two divide this row's block_n (kvcache_block_pages),
# per block where the page size is a multiple of it. sm90, 2026-12-02: in that run, pages of 16
# at 32k keys read 3970 GB/s with the long row (128 keys), 4379 with 32 keys, 2 warps, 4 stages in 2
# splits, 4315 with 64, 4, 3 in 3 splits, 4310 with 16, 2, 4 (whole-page blocks) in 3; the old
# per-key row (16 keys, 2 warps, 8 stages, before the lookahead) 4163 in the bench. Short caches of
# small pages take FLASH_ATTN_KVCACHE_SHORT's row: 4149 GB/s at 4k (one split), the best of that
# sweep (the 32-key row 4080 in 2 splits, 16 keys 4076). A second run the same day agreed (32k: 4369
# GB/s for this row in 2 splits, 4335 for 16 keys in 3; 4k: 4190 for the short row, cuDNN 4312), and
# timed the cost of the pages' order (this kernel and rows, `benchmarks.run decode`'s shapes): pages
# of 16 in the bench's random order 4209 GB/s at 4k, in order 4294, the contiguous cache 4328; at
# 32k 4370, 4289 and 4502. Pages of 256: 4290 / 4307 / 4327 and 4517 / 4512 / 4522. So at 4k about
# 2% of the gap to the contiguous cache is where the pages lie, not how the kernel walks them.
#
# 2026-12-03: now that the kernel loads one table entry per page where a key block holds whole
# pages (kvcache_block_pages, which gives its instruction counts), the 64-key row leads
# instead (`benchmarks.tune_decode`, 64/4/3, 64/4/4, 32/2/4, 32/4/4, 128/8/3 in 1 to 3 splits, on
# two H200s): pages of 16 at 32k keys 4448 GB/s unsplit against 4369 for the 32-key row in 2
# splits (cuDNN 4478 on the contiguous cache); on the first H200 4549 against 4476 (cuDNN 4603).
# Pages of 1 and 4 at 32k (a table load per key, and 16 a block): 4333 and 4379 unsplit
# against 4318 and 4369, ties. 4 stages read the same as 3 (4454, 4321, 4370). So this row is now
# the short row's: 64 keys, 4 warps, 3 stages, two programs an SM, which the split heuristic
# leaves unsplit (256 programs, one wave); in 2 splits (two waves) it reads 3600 to 3850.
# `benchmarks.ab` against the code before (a lookup per key, the 32-key row in 2 splits), two
# rounds: pages of 16 at 32k 4560 / 4561 GB/s against 4439 / 4431; at 4k (the short row both
# times) 4303 / 4321 against 4302 / 4313; the contiguous cache at 32k 4610 / 4610 against 4611 / 4608.
# The sm90 SASS of pages of 16 at 4k shows Triton's pipeliner issuing each block's table loads in
# the same iteration as the K and V copies that use them (an LDG, then its value used 8
# instructions later), so a warp waits a load's latency every block, although the source loads
# the pages a block ahead; the contiguous cache has no such wait. Tried on 2026-12-03 (throwaway
# code, `benchmarks.sass` and `benchmarks.ab`), neither kept:
# - pages carried two blocks ahead (two loop-carried values): the pipeliner then gave up on the
#   loop (no cp.async; K and V through registers into shared memory).
# - the lookup in the block's own step, as on AMD, with 5 stages: the pipeliner then streams the
#   table through shared memory two blocks ahead of K and V, which get two buffers as at 3 stages
#   with the lookahead (70 KiB, 109 registers against 152). Against the lookahead's 64 / 4 / 3,
#   two rounds: pages of 16 at 4k 4264 / 4252 GB/s against 4245 / 4242, at 32k 4420 / 4418
#   against 4462 / 4466; pages of 1 at 4k 4122 / 4099 against 4074 / 4074; pages of 4 at 32k
#   4372 / 4371 against 4348 / 4350. 64 / 4 / 7 and 32-key tiles (5 or 7 stages) were slower.
#   A loss on the bench's pages of 16 at 32k for gains under 1% on smaller pages.
# Nor does that wait cost what is left of the gap to cuDNN: in Nsight Compute (one launch, 4k
# keys, `NCU_CASES=decode:decode~Sk=4k~paged~16~in~order:_flash_attn_kvcache_kernel bash
# scripts/gpu.sh ncu`) pages of 16 handed out in order take 126.5 us, the contiguous cache 126.9,
# the bench's pages shuffled over the pool 130.1. The rest is where the pages lie (the decode
# record's note in docs/performance.md). Later that day, in throwaway kernels on the bench's shapes
# (two H200 runs), nothing brought shuffled pages closer to pages in order: a program reading 2, 4
# or 8 KV heads of each page (fewer address translations a byte; shuffled / in order 0.98-0.99 at
# every count, as at 1), PTX prefetches of the pages 2 to 16 blocks ahead (a line a page: 2-4%
# slower; every line of the head's slice: 12-40% slower), and a kernel that only reads the pages
# (the decode bench's `read-only`) loses as much to the shuffle (4k: 4330 GB/s against 4411 in
# order).
# Nor did TMA (2026-12-03, throwaway code, one H200, 4k keys unless said): host tensor descriptors
# over the cache as (pages * page_size, Hkv * D), a [16, 128] box a page. Read alone, the copies
# were not pipelined (a wait after each, 1500 GB/s) unless they fed a tl.dot; so fed, the best
# (32 keys a step, 2 warps, 6 stages) read 4530 GB/s in order and 4403 shuffled, against 4500 and
# 4415 for the read-only kernel above: TMA loses more to the shuffle (2.8% against 1.9%). A
# decode kernel on them (16 or 32 keys a step, 1, 2 or 4 warps, 4 to 8 stages) did best with 32
# keys and 1 warp: 4417 in order and 4279 shuffled, against lanekit's 4370 and 4324 and cuDNN's
# 4434 on the contiguous cache; at 32k 4577 and 4426 against 4629 and 4556. With 2 or 4 warps it
# read under 3300. The same 1-warp tiles in this kernel (`benchmarks.tune_decode --tiles=32/1/4,
# 32/1/6,16/1/6,16/1/8,64/2/3,32/2/6 --splits=1,2`, the three 4k paged-16 and contiguous cases)
# read at most 4235; 64/4/3 led every case (shuffled 4317, in order 4389, contiguous 4414; cuDNN
# 4407 to 4442). Beside the TMA decode kernel the read-only kernel read the shuffled pages at 4437
# GB/s, cuDNN the contiguous cache at 4434: on that H200 merely reading pages of 16 shuffled over
# the pool ties cuDNN.
FLASH_ATTN_KVCACHE_PER_KEY_PAGES: dict[str, dict[int, TileConfig]] = {
    "sm90": {128: TileConfig(64, 64, 4, 3)},
}
# Rows that replace FLASH_ATTN_KVCACHE's (and FLASH_ATTN_KVCACHE_PER_KEY_PAGES's) when every
# sequence holds at most KVCACHE_SHORT_KEYS keys (flash_attn_with_kvcache's max_seqlen_k: the used
# length read back, or the caller's bound; None, as inside a CUDA graph capture without one, keeps
# the long rows): smaller tiles, two programs an SM, so that B=32 x 8 KV heads run as one wave
# instead of two. A bucket of lengths picks a row; the lengths stay runtime arguments of one kernel
# (not specialized).
# sm90 (tune_decode, H200, 2026-12-02, 4k keys, one split): contiguous 64 keys, 4 warps, 3 stages
# 4328 GB/s against 4259 for the 128-key row (cuDNN 4326), but 4457 against 4526 at 32k (32 keys
# and 4 stages led at 4k, 4370, and lost 5% at 32k). Only 4k and 32k were timed: the bound between
# them is a guess.
KVCACHE_SHORT_KEYS = 8192
FLASH_ATTN_KVCACHE_SHORT: dict[str, dict[int, TileConfig]] = {"sm90": {128: TileConfig(64, 64, 4, 3)}}
# Architectures whose FLASH_ATTN_KVCACHE rows do not fit an fp32 cache, which takes the generic rows
# there. sm90: 128 fp32 keys of D=128 over 3 stages need 272 KB of shared memory (the H200 has 227).
FLASH_ATTN_KVCACHE_FP32_GENERIC = ("sm90",)


# fp32 inputs: twice the bytes per tile, and fp32 is chosen for accuracy rather than speed, so
# small tiles on every architecture. Sized with the compiler's report of shared memory for sm90
# with every feature on (bias, mask, ALiBi, dropout, softcap, window): the 16-bit tiles need up to
# 295 KB there, over the H200's 227 KB.
FLASH_ATTN_FWD_FP32: dict[str, dict[int, TileConfig]] = {
    "generic": {
        16: TileConfig(64, 64, 4, 2),
        32: TileConfig(64, 64, 4, 2),
        64: TileConfig(64, 64, 4, 2),
        128: TileConfig(64, 32, 4, 2),
        256: TileConfig(32, 32, 4, 1),
    },
    # NVIDIA: the products run on the FMA units, each thread holding its share of both operands:
    # the generic 64 x 32 tile at D=128 made ptxas spill about 7 KB a thread (32 registers and the
    # rest on the stack, sm80 and sm90 alike) and ran at 0.9 TFLOP/s on the H200; 32 x 32 at D=256
    # spilled 3 KB on sm90 (1 KB on sm80). `python -m benchmarks.tune_attention --fp32 --dims 128
    # 256` (H200, 2026-12-02, S=2048, 16k tokens, full / causal): D=128 32 x 32, 4 warps, 1 stage
    # 8.8 / 8.6 TFLOP/s (584 bytes of spills; 16 x 16 spills nothing, 6.5), D=256 16 x 16, 4 warps,
    # 1 stage 6.4 / 6.2 (no spills; was 3.1 / 3.7); SDPA's memory-efficient backend beside them 45 /
    # 42 at D=128 and 43 / 39 at D=256. sm80 (not timed: no A100 here): tiles its compile report
    # shows without spills (192 and 168 registers). D in (32, 64]: the generic 64 x 64 spilled
    # 1136 bytes a thread at D=64 on sm90 (1064 on sm80). `tune_attention --fp32 --dims 32 64`
    # (H200, 2026-12-02, full / causal): D=64 32 x 32, 4 warps, 2 stages 11.8 / 11.4 TFLOP/s (113
    # registers, no spills; 64 x 64: 9.9 / 9.3; SDPA's memory-efficient backend 35.4 / 33.2); sm80
    # takes it from its compile report (110 registers at D=64, no spills; 8 bytes causal). With
    # bias, mask, ALiBi, softcap and a window on: 255 registers and 16 bytes of stack on both; with
    # dropout too, 32 on sm90 and 88 on sm80. D=48 is not timed (255 registers on sm90, against
    # 113 at D=64). D <= 32 keeps 64 x 64: at D=32 it led the sweep (15.4 / 14.7, against 11.1 /
    # 10.8 for 32 x 32; SDPA 20.8 / 19.4), though it spills 48 bytes a thread there (8 causal).
    "sm90": {64: TileConfig(32, 32, 4, 2), 128: TileConfig(32, 32, 4, 1), 256: TileConfig(16, 16, 4, 1)},
    "sm80": {64: TileConfig(32, 32, 4, 2), 128: TileConfig(32, 32, 4, 2), 256: TileConfig(16, 16, 4, 1)},
    # RDNA: the same sweep (attn_fwd_fp32) over flash_attn_func's samples (D=1 and D=256): at
    # D=256 every candidate spills on RDNA, 16x16 with 8 warps least (targets.SPILL_ALLOWANCES
    # says why). D=128 (a varlen sample) takes the same tile, not yet swept.
    "gfx1201": {
        16: TileConfig(64, 32, 4, 2),
        128: TileConfig(16, 16, 8, 1),
        256: TileConfig(16, 16, 8, 1),
    },
}
FLASH_ATTN_FWD_FP32["gfx1151"] = FLASH_ATTN_FWD_FP32["gfx1201"]

# flash_attn backward: one table for the dK/dV kernel (block_m: query rows per step, block_n: the
# program's keys, whose dK and dV accumulate in registers) and one for the dQ kernel (block_m: the
# program's query rows, block_n: keys per step). Same buckets as the forward.
FLASH_ATTN_BWD_DKDV: dict[str, dict[int, TileConfig]] = {
    "generic": {
        16: TileConfig(32, 64, 4, 2),
        32: TileConfig(32, 64, 4, 2),
        64: TileConfig(32, 64, 4, 2),
        128: TileConfig(32, 64, 4, 2),
        256: TileConfig(16, 32, 4, 1),
    },
    # From `python -m benchmarks.tune_attention --backward` on the H200 (S=4096, bf16): 64x128
    # with 8 warps led at D=64 and D=128, causal and not (352 vs 339 TFLOP/s for 32x128 at
    # D=128 non-causal, forward + backward). D=256 is not tuned: a guess that fits.
    "sm90": {
        16: TileConfig(64, 128, 8, 2),
        32: TileConfig(64, 128, 8, 2),
        64: TileConfig(64, 128, 8, 2),
        128: TileConfig(64, 128, 8, 2),
        256: TileConfig(16, 64, 8, 2),
    },
    # RDNA (attn_bwd_dkdv sweep): dK and dV (block_n x D fp32 each) stay in registers beside the k
    # and v operands; above D=64 every candidate down to 16x16 spills on wave32, 16x16 with 8
    # warps least (targets.SPILL_ALLOWANCES).
    "gfx1201": {
        16: TileConfig(64, 64, 4, 1),
        32: TileConfig(32, 64, 4, 1),
        64: TileConfig(16, 64, 8, 2),
        128: TileConfig(16, 16, 8, 1),
        256: TileConfig(16, 16, 8, 1),
    },
    # CDNA 3 (attn_bwd_dkdv sweep): the generic 32x64 spilled with ALiBi (D=128) and with bias +
    # mask (D=111); these are the largest tiles that fit in 512 VGPRs + AGPRs without spilling.
    "gfx942": {
        16: TileConfig(64, 64, 4, 2),
        32: TileConfig(64, 64, 4, 1),
        64: TileConfig(64, 64, 4, 1),
        128: TileConfig(32, 64, 4, 1),
        256: TileConfig(16, 64, 4, 2),
    },
}
FLASH_ATTN_BWD_DKDV["gfx1151"] = FLASH_ATTN_BWD_DKDV["gfx1201"]
FLASH_ATTN_BWD_DQ: dict[str, dict[int, TileConfig]] = {
    "generic": {
        16: TileConfig(64, 32, 4, 2),
        32: TileConfig(64, 32, 4, 2),
        64: TileConfig(64, 32, 4, 2),
        128: TileConfig(64, 32, 4, 2),
        256: TileConfig(32, 16, 4, 1),
    },
    # Same sweep: 64x32 with 4 warps at D=64 (320 TFLOP/s vs 310 for 128x32), 128x64 with 8
    # warps and 3 stages at D=128.
    "sm90": {
        16: TileConfig(64, 32, 4, 3),
        32: TileConfig(64, 32, 4, 3),
        64: TileConfig(64, 32, 4, 3),
        128: TileConfig(128, 64, 8, 3),
        256: TileConfig(64, 32, 8, 1),
    },
    # RDNA (attn_bwd_dq sweep): the largest tiles that do not spill.
    "gfx1201": {
        16: TileConfig(64, 64, 4, 2),
        32: TileConfig(64, 64, 4, 1),
        64: TileConfig(64, 32, 8, 2),
        128: TileConfig(32, 16, 8, 2),
        256: TileConfig(64, 16, 8, 1),
    },
    # CDNA 3 (attn_bwd_dq sweep): the largest tiles that do not spill.
    "gfx942": {
        16: TileConfig(64, 64, 4, 2),
        32: TileConfig(64, 64, 4, 2),
        64: TileConfig(64, 64, 4, 2),
        128: TileConfig(32, 64, 4, 2),
        256: TileConfig(64, 32, 4, 2),
    },
}
FLASH_ATTN_BWD_DQ["gfx1151"] = FLASH_ATTN_BWD_DQ["gfx1201"]
# fp32 backward: small tiles everywhere (see the fp32 forward above). On gfx942 the generic fp32
# rows compile and fit (docs/targets.md), so CDNA has no fp32 rows of its own.
FLASH_ATTN_BWD_DKDV_FP32: dict[str, dict[int, TileConfig]] = {
    "generic": {16: TileConfig(32, 32, 4, 1), 32: TileConfig(32, 32, 4, 1), 64: TileConfig(32, 32, 4, 1),
                128: TileConfig(16, 32, 4, 1), 256: TileConfig(16, 16, 4, 1)},
    # RDNA: the attn_bwd_dkdv_fp32 sweep was not run to its end (each D=256 candidate spills over
    # 10 KB and takes minutes to compile); 16x16 with 8 warps, the 16-bit sweep's least-spilling
    # tile, until it is. docs/targets.md shows what it spills (targets.SPILL_ALLOWANCES).
    "gfx1201": {16: TileConfig(16, 16, 8, 1), 128: TileConfig(16, 16, 8, 1), 256: TileConfig(16, 16, 8, 1)},
}
FLASH_ATTN_BWD_DKDV_FP32["gfx1151"] = FLASH_ATTN_BWD_DKDV_FP32["gfx1201"]
FLASH_ATTN_BWD_DQ_FP32: dict[str, dict[int, TileConfig]] = {
    "generic": {16: TileConfig(32, 32, 4, 1), 32: TileConfig(32, 32, 4, 1), 64: TileConfig(32, 32, 4, 1),
                128: TileConfig(32, 16, 4, 1), 256: TileConfig(16, 16, 4, 1)},
    # RDNA (attn_bwd_dq_fp32 sweep; the samples exercise D=1 and D=256): at D=256 every candidate
    # spills, 16x16 with 8 warps least (targets.SPILL_ALLOWANCES).
    "gfx1201": {16: TileConfig(32, 32, 4, 2), 256: TileConfig(16, 16, 8, 1)},
}
FLASH_ATTN_BWD_DQ_FP32["gfx1151"] = FLASH_ATTN_BWD_DQ_FP32["gfx1201"]

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


def compiling() -> str | None:
    """The architecture of the enclosing :func:`compiling_for` block, None outside one."""
    return _COMPILING_FOR.get()


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


def _arch_row(table: dict, device: torch.device):
    """``device``'s architecture's row of a table of one row per architecture, else the generic one."""
    return table.get(arch_id(device), table["generic"])


def kvcache_config(device: torch.device, bucket: int, *, fp32: bool, per_key_pages: bool = False,
                   max_keys: int | None = None) -> TileConfig:
    """The flash_attn_with_kvcache tile for this device and head-dim bucket: FLASH_ATTN_KVCACHE's
    row (the generic one for fp32 where that row does not fit); for a 16-bit cache,
    FLASH_ATTN_KVCACHE_SHORT's when ``max_keys`` (the most keys a sequence holds, None if unknown)
    is at most KVCACHE_SHORT_KEYS, else FLASH_ATTN_KVCACHE_PER_KEY_PAGES's for pages that do not
    hold whole key blocks (``per_key_pages``): each where the architecture has that row. Read at
    each call, so that a sweep replacing a row is seen."""
    arch = arch_id(device)
    if fp32:
        if arch in FLASH_ATTN_KVCACHE_FP32_GENERIC:
            return FLASH_ATTN_KVCACHE["generic"][bucket]
        return lookup(FLASH_ATTN_KVCACHE, device, bucket)
    if max_keys is not None and max_keys <= KVCACHE_SHORT_KEYS:
        row = FLASH_ATTN_KVCACHE_SHORT.get(arch, {}).get(bucket)
    else:
        row = FLASH_ATTN_KVCACHE_PER_KEY_PAGES.get(arch, {}).get(bucket) if per_key_pages else None
    return row or lookup(FLASH_ATTN_KVCACHE, device, bucket)


def kvcache_pages_ahead(device: torch.device) -> bool:
    """Whether the decode kernel loads a block's per-key pages (its PAGES 2) a step ahead. NVIDIA:
    yes; without it Triton's pipeliner gives the K and V loads half the lookahead (see
    FLASH_ATTN_KVCACHE_PER_KEY_PAGES); on the H200, pages of 16 at 4k keys read 4190 GB/s against
    4091 (tune_decode, best tile of each, one run). AMD: no; its pipeliner (Triton 3.6, gfx942's
    TTGIR) streamed these loads through no shared buffer with or without it, and with it one
    registered sample (D=80, pages of 7, 128 x 32 tile) spilled 20 bytes a thread."""
    return not arch_id(device).startswith("gfx")


@dataclass(frozen=True)
class KVCacheLayout:
    """How the decode kernel walks a cache's pages: its constexprs PAGES, POW2_PAGE, PAGE and
    PAGES_AHEAD."""
    pages: int          # 0 one page per sequence (a contiguous cache), 1 pages holding whole key
                        # blocks (no left padding): a lookup per block, 2 a lookup per key
    pow2_page: bool     # layout 2 with pages of a power of two: shifts, not divisions
    page: int           # layout 2 with blocks of whole pages: their size, a lookup per page (else 0)
    pages_ahead: bool   # layout 2: each block's pages loaded a step ahead (kvcache_pages_ahead)


def kvcache_tile(device: torch.device, bucket: int, *, fp32: bool, page_size: int, one_page: bool,
                 leftpad: bool, max_keys: int | None = None,
                 interpreted: bool = False) -> tuple[TileConfig, KVCacheLayout]:
    """(tile, page layout) of the decode kernel for a cache of pages of ``page_size`` tokens
    (``one_page``: a block table one page wide, as a contiguous cache is passed) whose sequences
    hold at most ``max_keys`` keys (None: unknown), with or without left padding. A lookup per key
    may take a row of its own (kvcache_config). ``interpreted``: the Triton interpreter's tile."""
    def pages_of(block_n):
        if one_page:
            return 0
        return 1 if page_size % block_n == 0 and not leftpad else 2

    if interpreted:
        cfg = INTERPRETER
    else:
        cfg = kvcache_config(device, bucket, fp32=fp32, max_keys=max_keys)
        if pages_of(cfg.block_n) == 2:
            cfg = kvcache_config(device, bucket, fp32=fp32, per_key_pages=True, max_keys=max_keys)
    pages = pages_of(cfg.block_n)
    per_key = pages == 2
    return cfg, KVCacheLayout(pages=pages, pow2_page=per_key and page_size & (page_size - 1) == 0,
                              page=kvcache_block_pages(pages, page_size, cfg.block_n, leftpad),
                              pages_ahead=per_key and kvcache_pages_ahead(device))


def kvcache_block_pages(pages: int, page_size: int, block_n: int, leftpad: bool) -> int:
    """The decode kernel's PAGE: with a page lookup per key (layout 2), the page size where each
    block of ``block_n`` keys holds whole pages (a power of two dividing block_n, no left
    padding), so that the kernel loads one table entry per page instead of per key; else 0. On
    sm90 (`benchmarks.sass`), pages of 16 then issue 408 instructions per block of 64 keys instead
    of 669, and 383 per block of 32 instead of 654 (2 table loads instead of 16 a thread). On
    the H200 that alone did not change the speed (`benchmarks.ab`, pages of 16: 4460 / 4480 GB/s
    against 4451 / 4433 at 32k keys, 4304 / 4301 against 4308 / 4311 at 4k); it made the 64-key
    tile the fastest for such pages (FLASH_ATTN_KVCACHE_PER_KEY_PAGES)."""
    whole = pages == 2 and not leftpad and page_size & (page_size - 1) == 0 and block_n % page_size == 0
    return page_size if whole else 0


def _block16(n: int) -> int:
    """The least power of two that holds n, and at least 16 (the smallest tile tl.dot takes)."""
    return max(16, 1 << max(n - 1, 0).bit_length())


def head_dim_block(d: int) -> int:
    """The block the attention kernels pad a head dim to: a power of two, at least 16."""
    return _block16(d)


def kvcache_block_m(cfg: TileConfig, rows: int) -> int:
    """The decode kernel's block of (query, head) rows: cfg.block_m, or the least power of two at
    least 16 that holds ``rows`` (decode: Sq * group is small)."""
    return min(cfg.block_m, _block16(rows))


def resident_programs(device: torch.device, cfg: TileConfig, stage_bytes: int) -> int:
    """How many programs of ``cfg`` one SM (CU) holds at once, by shared memory (num_stages
    buffers of ``stage_bytes``) and by threads: an estimate for sizing a grid, not a promise."""
    if device.type != "cuda":
        return 1
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_multiprocessor", 0) or 64 * 1024
    threads = getattr(props, "max_threads_per_multi_processor", 0) or 2048
    by_smem = smem // max(cfg.num_stages * stage_bytes + 1024, 1)   # ~1 KB a program for the runtime
    by_threads = threads // (cfg.num_warps * getattr(props, "warp_size", 32))
    return max(1, min(by_smem, by_threads, 32))
