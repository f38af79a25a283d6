"""Tile tables of the attention kernels, and what their compiles may show.

The tables are data, keyed by architecture id (``lanekit.runtime.tuning.arch_id``), then by the
padded head dim; the machinery that reads them (``TileConfig``, ``lookup``, ``compiling_for``)
lives in ``lanekit.runtime.tuning``. Launchers read a table at each call, so that a sweep replacing
a row (``benchmarks.tune_attention``, ``tune_decode``, ``tune_targets``) is seen. What was tried on
the way to each row, with dates and figures, is in docs/tuning/attention.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lanekit.runtime.tuning import INTERPRETER, TileConfig, arch_id, arch_row, block16, lookup


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
    # RDNA (wave32; `benchmarks.tune_targets --sweep attn_fwd`): each warp holds whole k and v tiles
    # as WMMA operands, so the generic 64x64 spilled at D=128; narrower key blocks and 8 warps do
    # not. gfx1151 (RDNA 3.5) takes the same rows: same wave size and LDS.
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
    # sm90 (`benchmarks.tune_decode`): caches of more than KVCACHE_SHORT_KEYS keys, contiguous or in
    # pages holding whole blocks, read fastest at 128 keys, 8 warps, 3 stages; shorter caches and
    # smaller pages take FLASH_ATTN_KVCACHE_SHORT and _PER_KEY_PAGES. Tried: docs/tuning/attention.md.
    "sm90": {128: TileConfig(64, 128, 8, 3)},
    # CDNA 3 (`benchmarks.tune_targets --target gfx942 --sweep attn_kvcache`): 64 keys a step
    # spilled, and at D=128 with 2 stages needed 68 KiB of LDS; 32 keys fit. The samples exercise
    # D=64 and D=128 only.
    "gfx942": {64: TileConfig(128, 32, 4, 2), 128: TileConfig(128, 32, 4, 2)},
    # RDNA (the same sweep, gfx1201): 32 keys a step at D=64; at D=128 every candidate spills (its
    # fp32 sample), 16 keys with 8 warps least (targets.SPILL_ALLOWANCES).
    "gfx1201": {64: TileConfig(128, 32, 4, 2), 128: TileConfig(128, 16, 8, 1)},
    # A100 (compile reports only): the generic D=128 tile over 8 warps; with 4 the int8 cache in
    # pages of 8 spilled 8 bytes at 168 registers, with 8 every D=128 sample fits in 80-168
    "sm80": {128: TileConfig(64, 64, 8, 2)},
}
# Paged caches take the same rows as contiguous ones: the kernel loads each block's pages a step
# ahead, so its K and V loads get num_stages - 1 buffers, as a contiguous cache's do.
#
# Rows for 16-bit caches of more than KVCACHE_SHORT_KEYS keys whose pages do not hold whole key
# blocks of the long row (a lookup per key, or per page: kvcache_block_pages). sm90: 64 keys, 4
# warps, 3 stages, unsplit, led pages of 16 at 32k keys. Tried (TMA among it): docs/tuning/attention.md.
FLASH_ATTN_KVCACHE_PER_KEY_PAGES: dict[str, dict[int, TileConfig]] = {
    "sm90": {128: TileConfig(64, 64, 4, 3)},
    # CDNA 3: one stage at D=64. With two, the e4m3 cache in pages of 5 (a division per key, the
    # descales) took 20 bytes of scratch for its SGPR spills at any tile and warp count tried
    "gfx942": {64: TileConfig(128, 32, 4, 1)},
}
# Rows that replace FLASH_ATTN_KVCACHE's (and _PER_KEY_PAGES's) when every sequence holds at most
# KVCACHE_SHORT_KEYS keys (kvcache_config): smaller tiles, two programs an SM, so that B=32 x 8 KV
# heads run as one wave. sm90 led at 4k keys, lost at 32k; the bound between them is a guess.
KVCACHE_SHORT_KEYS = 8192
FLASH_ATTN_KVCACHE_SHORT: dict[str, dict[int, TileConfig]] = {"sm90": {128: TileConfig(64, 64, 4, 3)}}
# Architectures whose FLASH_ATTN_KVCACHE rows do not fit an fp32 cache, which takes the generic rows
# there. sm90: 128 fp32 keys of D=128 over 3 stages need 272 KB of shared memory (the H200 has 227).
FLASH_ATTN_KVCACHE_FP32_GENERIC = ("sm90",)


# fp32 inputs: twice the bytes per tile, and fp32 is chosen for accuracy rather than speed, so
# small tiles on every architecture: with every feature on, the 16-bit tiles need up to 295 KB of
# shared memory on sm90, over the H200's 227 KB.
FLASH_ATTN_FWD_FP32: dict[str, dict[int, TileConfig]] = {
    "generic": {
        16: TileConfig(64, 64, 4, 2),
        32: TileConfig(64, 64, 4, 2),
        64: TileConfig(64, 64, 4, 2),
        128: TileConfig(64, 32, 4, 2),
        256: TileConfig(32, 32, 4, 1),
    },
    # NVIDIA: the products run on the FMA units, each thread holding its share of both operands; the
    # tiles that `tune_attention --fp32` timed fastest on the H200 with little or no spill (sm80:
    # from its compile report, not timed). Figures: docs/tuning/attention.md.
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
FLASH_ATTN_BWD_DQ_FP32: dict[str, dict[int, TileConfig]] = {
    "generic": {16: TileConfig(32, 32, 4, 1), 32: TileConfig(32, 32, 4, 1), 64: TileConfig(32, 32, 4, 1),
                128: TileConfig(32, 16, 4, 1), 256: TileConfig(16, 16, 4, 1)},
    # RDNA (attn_bwd_dq_fp32 sweep; the samples exercise D=1 and D=256): at D=256 every candidate
    # spills, 16x16 with 8 warps least (targets.SPILL_ALLOWANCES).
    "gfx1201": {16: TileConfig(32, 32, 4, 2), 256: TileConfig(16, 16, 8, 1)},
}


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
    FLASH_ATTN_KVCACHE_PER_KEY_PAGES). AMD: no; its pipeliner streamed these loads through no
    shared buffer either way, and with it one registered sample spilled (docs/tuning/attention.md)."""
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
    padding), so that the kernel loads one table entry per page instead of per key (2 table loads
    a thread instead of 16 at pages of 16 on sm90); else 0. What it changed:
    docs/tuning/attention.md."""
    whole = pages == 2 and not leftpad and page_size & (page_size - 1) == 0 and block_n % page_size == 0
    return page_size if whole else 0


def head_dim_block(d: int) -> int:
    """The block the attention kernels pad a head dim to: a power of two, at least 16."""
    return block16(d)


def kvcache_block_m(cfg: TileConfig, rows: int) -> int:
    """The decode kernel's block of (query, head) rows: cfg.block_m, or the least power of two at
    least 16 that holds ``rows`` (decode: Sq * group is small)."""
    return min(cfg.block_m, block16(rows))


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


# flash_mla_with_kvcache (MLA decode, attention/kernels/mla.py): block_m rows of (query, head) pairs
# that share each cached row (BLOCK_H), block_n cached rows a step. One table row per architecture,
# for the one head dim MLA has (576 = 512 latent + 64 rope; other sizes take the same row). The
# accumulator is block_m x 512 fp32 and both q chunks stay resident, so block_m is what the
# registers allow; the cache tile (block_n x 576) is what the loop streams. What was tried, and
# the roofline that bounds it: docs/tuning/mla.md.
FLASH_MLA_KVCACHE: dict[str, TileConfig] = {
    # a portable guess (the interpreter takes its own); every GPU target has a row of its own below
    "generic": TileConfig(64, 32, 4, 1),
    # Ampere (from the compile report, `python -m lanekit export --target sm80`): 64 rows with 16
    # cached rows a step, 8 warps, 2 stages (94 KB of shared memory) spill nothing; 32 a step spilled
    # 16 bytes at H = 128. (The e4m3 cache does not compile for sm80: Triton has no fp8e4nv there.)
    "sm80": TileConfig(64, 16, 8, 2),
    # CDNA 3 (wave64, 64 KB of LDS: q's 72 KB stays in registers): 32 rows and 16 cached rows a step
    # with 4 warps spill nothing (at most 330 of 512 VGPRs); 64 rows spilled 860 bytes at H = 128.
    "gfx942": TileConfig(32, 16, 4, 1),
    # RDNA (wave32, 256 VGPRs; gfx1151 takes the same row): each warp holds a whole 512-wide operand
    # of the dots, so every tile tried spills (SPILL_ALLOWANCES); 16 rows x 16 cached rows, 8 warps
    # spill least (64-80 bytes bf16, up to 520 for a cache of codes).
    "gfx1201": TileConfig(16, 16, 8, 1),
    # Hopper: 64 heads a program (wgmma's 64 rows per warpgroup; H = 128 is two programs reading
    # the same rows side by side, as FlashMLA splits its 128 heads), 2 warpgroups splitting the
    # 512-wide accumulator, 32 cached rows a step over 3 stages (3 x 36 KB of shared memory beside
    # q's 72 KB: 180 KB of the H100's and H200's 227 KB). 64 rows a step spilled 16 bytes at H = 128
    # with 2 stages (216 KB) and 2 KB with 4 warps; from the compile report, not yet timed.
    "sm90": TileConfig(64, 32, 8, 3),
}
# The merge of split partials reads num_splits x MLA_MERGE_CHUNK fp32 values a step: 512-wide
# values in four chunks keep 128 splits x 128 features at 128 registers a thread (4 warps).
MLA_MERGE_CHUNK = 128


def mla_tile(device: torch.device, rows: int, *, interpreted: bool = False) -> TileConfig:
    """The MLA decode tile for ``device`` (FLASH_MLA_KVCACHE's row of its architecture, or the
    generic one; the interpreter's own under Triton's interpreter). ``rows``: Sq * H / Hkv, the
    (query, head) rows that share a cached row; read at each call, so a sweep replacing a row is
    seen."""
    if interpreted:
        return INTERPRETER
    return arch_row(FLASH_MLA_KVCACHE, device)


def mla_block_h(cfg: TileConfig, rows: int) -> int:
    """The MLA kernel's block of (query, head) rows: cfg.block_m, or the least power of two at
    least 16 that holds ``rows`` (H = 16 heads: one block of 16)."""
    return min(cfg.block_m, block16(rows))


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
_RDNA_MLA = ("MLA decode's 512-wide latent: each wave32 warp holds a whole [512, block_n] operand of the score "
             "dot beside its share of the 512-wide accumulator, over 256 VGPRs at every tile tried down to 16 rows x "
             "16 cached rows (FLASH_MLA_KVCACHE, docs/tuning/mla.md); bf16 caches spill 64-80 bytes, codes up to 520 "
             "(their 16-bit copy of the tile)")
_NVIDIA_UNCOUNTED = ("spills that ptxas reports as STACK, which the record read as 0 until 2026-12-02 (it "
                     "read LOCAL only): found then, not yet tuned away; ")
_NVIDIA_OTHERS = _NVIDIA_UNCOUNTED + "the worst are a bias with a mask at D=111 and the backward at odd head dims"
_NVIDIA_FWD = _NVIDIA_UNCOUNTED + ("the worst is a bias with a mask at D=111 (on sm80 ptxas falls to 32 registers "
                                   "and 7 KB of stack with the 16-bit D=128 row); fp32 at D=64, 128 and 256 has "
                                   "rows of its own since (FLASH_ATTN_FWD_FP32: 584 bytes at most, sm90's D=128 "
                                   "row, the fastest timed)")
_TRITON_371 = ("Triton 3.7.1 spills more on sm90 than the pinned 3.6.0, whose figures the record keeps (a "
               "ceiling here, so that export passes under the Triton of torch 2.12's and 2.13's GPU wheels)")
SPILL_ALLOWANCES: dict[tuple[str, str], tuple[int, str]] = {
    **{(kernel, rdna): (limit, why) for rdna in ("gfx1151", "gfx1201") for kernel, limit, why in (
        ("_flash_attn_fwd_kernel", 796, _RDNA_FP32_D256),
        ("_flash_attn_bwd_dkdv_kernel", 2608, _RDNA_DKDV),
        ("_flash_attn_bwd_dq_kernel", 2556, _RDNA_DQ_FP32),
    )},
    ("_flash_attn_kvcache_kernel", "gfx1151"): (168, _RDNA_KVCACHE),
    ("_flash_mla_kvcache_kernel", "gfx1201"): (520, _RDNA_MLA),
    ("_flash_mla_kvcache_kernel", "gfx1151"): (1500, _RDNA_MLA + "; RDNA 3.5 (gfx1151, the same row) spills "
                                                "930-1500 bytes, 4 and 16 warps no less"),
    ("_flash_attn_kvcache_kernel", "gfx1201"): (36, _RDNA_KVCACHE),
    # NVIDIA: the spills there since before the record counted them (largest per kernel; the
    # record itself pins each specialization's figure, so any change still fails --check)
    ("_flash_attn_fwd_kernel", "sm80"): (7336, _NVIDIA_FWD),
    # sm90 under Triton 3.7.1 (torch 2.12's and 2.13's): bias+mask D=111 spills 2768 where 3.6.0 spills
    # 2088, and fp32 D=128 decode with GQA 8:2 spills 8 where 3.6.0 spills none (export, 2026-12-04)
    ("_flash_attn_fwd_kernel", "sm90"): (2768, _NVIDIA_FWD + "; " + _TRITON_371),
    ("_flash_attn_kvcache_kernel", "sm90"): (8, _TRITON_371),
    **{(kernel, target): (limit, _NVIDIA_OTHERS) for kernel, target, limit in (
        ("_flash_attn_bwd_dkdv_kernel", "sm80", 976), ("_flash_attn_bwd_dkdv_kernel", "sm90", 2112),
        ("_flash_attn_bwd_dq_kernel", "sm80", 656), ("_flash_attn_bwd_dq_kernel", "sm90", 1416),
    )},
}

_DECODE_ROWS = ("decode and short appends (Sq x group <= 16 rows of (query, head) pairs) take a 16-row tile, "
                "under wgmma's 64 rows per warpgroup, so Triton uses mma.sync there, still on the tensor cores")
_MLA_ROWS = ("MLA decode with fewer than 64 (query, head) rows a cache head (Sq x H / Hkv: H = 16 heads, say) "
             "takes a tile of 16 or 32 rows, under wgmma's 64 rows per warpgroup, so Triton uses mma.sync there, "
             "still on the tensor cores; H = 128 takes wgmma")
MATRIX_ALLOWANCES: dict[tuple[str, str], tuple[str, str]] = {
    ("_flash_attn_kvcache_kernel", "sm90"): (r"\bmma\.sync\.aligned\.\S+", _DECODE_ROWS),
    ("_flash_mla_kvcache_kernel", "sm90"): (r"\bmma\.sync\.aligned\.\S+", _MLA_ROWS),
}
