"""MLA decode (lanekit.flash_mla_with_kvcache) beside PyTorch: `python -m benchmarks.run mla`.

DeepSeek V3's absorbed MLA decode: B=64 sequences of one query, H=128 and H=16 query heads of 576
(512 latent + 64 rope) over one cached latent row per token, V its first 512 features; 4k and 32k
cached tokens a sequence, in pages of 64 shuffled over the pool; the cache bf16, or fp8 e4m3 codes
with one fp32 scale a token (lanekit.kv_cache.quantize_kv's layout). The unit is GB/s of the latent
cache read (its codes and scales: what decode cannot avoid reading), and each row's lines under the
table give lanekit's fraction of the GPU's HBM peak (H100 SXM 3.35 TB/s, H200 4.8 TB/s, by device
name) and its TFLOP/s: at H=128 each cached row feeds 2 * 128 * (576 + 512) FLOPs, which puts bf16
above the H200's ridge point (docs/tuning/mla.md). The peer is the PyTorch a model would write
without a kernel: gather the sequence's pages, dequantize, q K^T, softmax, P V, in bf16 (fp32
softmax), in batched matmuls. Beside them is a bound rather than a peer, "read-only": a kernel
that reads the same cache where it lies and does no attention. lanekit's split count is the one flash_mla_with_kvcache picks with the
schedule metadata from get_mla_metadata (made once, outside the timing, as FlashMLA's loop does).
Two families: ``mla_graphs`` replays CUDA graphs (the GPU's time), ``mla_eager`` calls eagerly
(what a Python caller sees); ``mla`` names both.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

import lanekit
from lanekit.attention.registry import ATTENTION_FWD
from lanekit.reference import mla as ref
from lanekit.testing import compare, upcast

UNIT = "GB/s"
CUDA_GRAPHS = True
B, D, DV, PAGE = 64, 576, 512, 64
BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
# HBM peak by device name (the first that the name contains), in GB/s: NVIDIA's datasheets.
HBM_PEAK = (("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("H800", 3350.0),
            ("GH200", 4000.0), ("A100", 2039.0))
# Dense bf16 tensor-core peak by device name, TFLOP/s (datasheets; for the roofline lines).
BF16_PEAK = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("H800", 989.0), ("A100", 312.0))


def cases(quick: bool = False):
    for sk in ((4096,) if quick else (4096, 32768)):
        for heads in (128, 16):
            for cache in (("bf16",) if quick else ("bf16", "e4m3")):
                yield dict(sk=sk, H=heads, cache=cache)


def name(c) -> str:
    return f"mla B={B} Sk={c['sk'] // 1024}k H={c['H']} {c['cache']}"


def cache_bytes(c) -> float:
    """Bytes of the latent cache the sequences hold: D features a token (2 bytes in bf16; 1 byte
    and a 4-byte scale in e4m3)."""
    per_token = D * 2 if c["cache"] == "bf16" else D + 4
    return B * c["sk"] * per_token


bytes_moved = cache_bytes


def flops(c) -> float:
    """2 * H * (D + DV) per cached token and query: q K^T over 576 features, P V over 512."""
    return 2.0 * B * c["sk"] * c["H"] * (D + DV)


def make_inputs(c, device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    sk, H, batch = c["sk"], c["H"], c.get("B", B)   # B: the smoke test's tiny batch
    pages = sk // PAGE
    q = (torch.randn(batch, 1, H, D, generator=g, device=device) * 0.5).to(BF16)
    table = torch.randperm(batch * pages, generator=g, device=device).reshape(batch, pages).to(torch.int32)
    latent = torch.randn(batch * pages, PAGE, 1, D, generator=g, device=device).to(BF16)
    scale = None
    if c["cache"] == "bf16":
        cache = latent
    else:
        cache, scale = lanekit.kv_cache.quantize_kv(latent, E4M3)
    seqlens = torch.full((batch,), sk, dtype=torch.int32, device=device)
    meta, _ = lanekit.get_mla_metadata(seqlens, H, 1)
    return [q, cache, scale, table, seqlens, meta]


def _lanekit(q, cache, scale, table, seqlens, meta):
    return lambda: lanekit.flash_mla_with_kvcache(q, cache, table, seqlens, DV, meta, None, k_cache_scale=scale)


def _torch(q, cache, scale, table, seqlens, meta):
    """Gather each sequence's pages into a dense (B, S, D) latent, dequantize, and attend in bf16
    with batched matmuls (the softmax in fp32, as models upcast it)."""
    B, S = table.shape[0], table.shape[1] * PAGE

    def run():
        rows = cache[table.long()].reshape(B, S, D)                           # (B, S, D) gather
        if scale is not None:
            rows = (rows.to(torch.float32) * scale[table.long()].reshape(B, S, 1)).to(BF16)
        qh = q[:, 0]                                                          # (B, H, D)
        s = torch.bmm(qh, rows.transpose(1, 2)).float() * D ** -0.5           # (B, H, S)
        p = torch.softmax(s, dim=-1).to(BF16)
        return torch.bmm(p, rows[..., :DV])                                   # (B, H, DV)

    return run


def check(c, q, cache, scale, table, seqlens, meta) -> str | None:
    """The first and the last sequence against the float64 oracle (which gathers and upcasts only
    their pages), out and LSE, under the project's tolerance."""
    out, lse = _lanekit(q, cache, scale, table, seqlens, meta)()
    seqs = [0, q.shape[0] - 1]
    want, want_lse = ref.flash_mla_with_kvcache(upcast(q[seqs]), cache, table[seqs], seqlens[seqs], DV,
                                                softmax_scale=D ** -0.5, k_cache_scale=scale)
    for what, got, expected, tol in (("out", out[seqs], want, ATTENTION_FWD), ("lse", lse[seqs], want_lse, "lse")):
        result = compare(got, expected, tol)
        if not result.ok:
            return f"{what}: {result.detail}"
    return None


@triton.jit
def _read_latent_kernel(C, S, BT, Out, stride_cp, stride_cn, stride_sp, pages_per_program, pages,
                        PAGE: tl.constexpr, ROWS: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                        HAS_SCALE: tl.constexpr):
    """Out[b, part] = the sums of the cached rows (and scales) of sequence b's pages part * n ..
    (part + 1) * n - 1 (n = pages_per_program), features [0, DV) and [DV, DV + DR) apart: every
    byte MLA decode reads, page by page as it does, ROWS rows a step, and no attention."""
    b = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    rows = tl.arange(0, ROWS)
    dv = tl.arange(0, DV)
    dr = tl.arange(0, DR)
    acc_v = tl.zeros([ROWS, DV], tl.float32)
    acc_r = tl.zeros([ROWS, DR], tl.float32)
    for i in range(part * pages_per_program, tl.minimum((part + 1) * pages_per_program, pages)):
        page = tl.load(BT + b * pages + i).to(tl.int64)
        for r0 in range(0, PAGE, ROWS):
            row = C + page * stride_cp + (r0 + rows)[:, None] * stride_cn
            acc_v += tl.load(row + dv[None, :]).to(tl.float32)
            acc_r += tl.load(row + DV + dr[None, :]).to(tl.float32)
            if HAS_SCALE:
                acc_r += tl.load(S + page * stride_sp + r0 + rows)[:, None]
    base = Out + (b * tl.num_programs(1) + part) * (DV + DR)
    tl.store(base + dv, tl.sum(acc_v, 0))
    tl.store(base + DV + dr, tl.sum(acc_r, 0))


def _read_only(q, cache, scale, table, seqlens, meta):
    """A kernel that reads the latent cache (and its scales) MLA decode reads, where it lies, page by
    page, 4 programs a sequence (256 at B=64, about two an SM), and does nothing else: the most a
    decode kernel could reach on this cache, beside which lanekit's share shows how far the
    arithmetic (H=128) or the page walk (H=16) keeps it. Its sums are checked on the first call."""
    batch, pages = table.shape
    parts = 4
    out = torch.empty(batch, parts, D, device=cache.device, dtype=torch.float32)
    checked = []

    def run():
        _read_latent_kernel[(batch, parts)](
            cache, scale if scale is not None else cache, table, out, cache.stride(0), cache.stride(1),
            scale.stride(0) if scale is not None else 0, -(-pages // parts), pages,
            PAGE=cache.shape[1], ROWS=16, DV=DV, DR=D - DV, HAS_SCALE=scale is not None, num_warps=8, num_stages=3)
        if not checked:
            rows = cache[table.long()].reshape(batch, parts, -1, D).to(torch.float32).sum(2)
            if scale is not None:
                rows[..., DV:] += scale[table.long()].reshape(batch, parts, -1).sum(2)[..., None]
            torch.testing.assert_close(out, rows, rtol=1e-4, atol=0.05)
            checked.append(True)
        return out

    return run


def runners(c, q, cache, scale, table, seqlens, meta):
    ours = {"lanekit": _lanekit(q, cache, scale, table, seqlens, meta),
            "torch gather+bmm": _torch(q, cache, scale, table, seqlens, meta)}
    if cache.is_cuda:
        ours["read-only"] = _read_only(q, cache, scale, table, seqlens, meta)
    return ours


def _peak(table) -> float | None:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((v for key, v in table if key in name), None)


def annotate(rows: list[dict]) -> list[str]:
    """Per row: lanekit's fraction of the HBM peak and its TFLOP/s (and of the bf16 peak), added to
    the row (``of_hbm_peak``, ``tflops``) and returned as lines to print under the table."""
    hbm, tensor = _peak(HBM_PEAK), _peak(BF16_PEAK)
    by_name = {name(c): c for c in cases(False)}
    lines = []
    for row in rows:
        gbps = (row.get("gbps") or {}).get("lanekit")
        c = by_name.get(row["case"].removesuffix(" eager"))
        if gbps is None or c is None:
            continue
        tf = gbps * 1e9 * flops(c) / cache_bytes(c) / 1e12
        row["tflops"] = tf
        parts = [f"{row['case']}: {gbps:.0f} GB/s", f"{tf:.0f} TFLOP/s"]
        if hbm:
            row["of_hbm_peak"] = gbps / hbm
            parts.append(f"{gbps / hbm:.0%} of HBM peak ({hbm:.0f} GB/s)")
        if tensor:
            parts.append(f"{tf / tensor:.0%} of the dense bf16 peak ({tensor:.0f} TFLOP/s)")
        lines.append(", ".join(parts))
    return lines


def _eager_cases(quick: bool = False):
    yield from cases(quick)


EAGER = SimpleNamespace(
    __doc__="flash_mla_with_kvcache eagerly (host time included) beside the PyTorch peer (see benchmarks.mla).",
    UNIT="GB/s", CUDA_GRAPHS=False, cases=_eager_cases, name=lambda c: name(c) + " eager",
    bytes_moved=bytes_moved, make_inputs=make_inputs, check=check, runners=runners, annotate=annotate)

FAMILIES = {"mla_graphs": sys.modules[__name__], "mla_eager": EAGER}


def smoke(device: str = "cpu") -> list[str]:
    """Every case's form at a tiny size (2 sequences of 128 cached tokens) on ``device``: inputs, the
    check and each runner once (on a CPU lanekit runs its reference lane). Returns a line per case;
    raises on a failed check."""
    lines = []
    for c in cases(False):
        c = dict(c, sk=128, B=2)
        inputs = make_inputs(c, device)
        error = check(c, *inputs)
        if error is not None:
            raise AssertionError(f"{name(c)}: {error}")
        shapes = {peer: tuple(fn()[0].shape) for peer, fn in runners(c, *inputs).items()}
        lines.append(f"{name(c)}: ok, {shapes}")
    return lines
