"""The paged KV cache's registry entries: sample builders and the ``register`` calls of
reshape_and_cache, gather_cache (plain and quantized), quantize_kv, dequantize_kv and
merge_attn_states.

Each sample is in the lanes' normalized form (the keyword arguments of ``lanekit.kv_cache.op``'s
lane functions); its values come from a generator seeded by its name. Everything a kernel must not
read is NaN (pages nobody owns, slots past a sequence), so a read out of bounds fails the check.
"""

from __future__ import annotations

import math

import torch

from lanekit.runtime.registry import Op, Sample, register
from lanekit.testing import CODES, ELTWISE, EXACT, LSE, generator, noncontiguous as _noncontiguous, randn

_KV = "lanekit.kv_cache.op"
_KV_REF = "lanekit.reference.kv_cache"
_E4M3 = torch.float8_e4m3fn
_E5M2 = torch.float8_e5m2

# Round-half-even cases of the codes at scale 1, and the clamps: int8 ties +-0.5, +-1.5, +-2.5 go
# to 0, +-2, +-2; -128.5 to -128 (even), -129 and -200 clamp to -128, 127.5 to 127 (128 clamps);
# e4m3 (spacing 1/8 on [1, 2), 2 on [16, 32), 32 on [256, 448]): 1.0625 -> 1, 1.1875 -> 1.25,
# 17 -> 16, 19 -> 20, 432 -> 448, 464 and 500 clamp to 448, subnormal ties 2^-10 -> 0 and
# 3 * 2^-10 -> 2^-8. Rows of these values need fp32 (bf16 has no -128.5).
# e5m2 (spacing 1/4 on [1, 2), 1/2 on [2, 4), 8192 on [32768, 57344]): 1.125 -> 1, 1.375 -> 1.5,
# 3.25 -> 3, 3.75 -> 4, 53248 -> 57344 (even), 61440 and 70000 clamp to 57344.
E5M2_TIES = (1.125, -1.125, 1.375, -1.375, 3.25, -3.75, 53248.0, -53248.0, 61440.0, -70000.0, 0.0)
INT8_TIES = (0.5, -0.5, 1.5, -1.5, 2.5, -2.5, -128.5, -129.0, -200.0, 127.5, 126.5, -127.5, 3.5, 0.0)
E4M3_TIES = (1.0625, -1.0625, 1.1875, -1.1875, 17.0, -19.0, 432.0, -432.0, 464.0, -500.0,
             2.0 ** -10, -(2.0 ** -10), 3 * 2.0 ** -10, 0.53125)


def tie_rows(dtype: torch.dtype, rows: int, D: int, *, with_amax: bool, generator) -> torch.Tensor:
    """(rows, D) fp32 rows holding the tie cases of ``dtype``'s codes (repeated, with small random
    values after them). ``with_amax``: the first feature of every row is qmax (127 or 448), so that
    amax / qmax is exactly 1 and the ties hold without a given scale (then the clamped cases are
    dropped: they would raise amax)."""
    ties = {torch.int8: INT8_TIES, _E5M2: E5M2_TIES}.get(dtype, E4M3_TIES)
    qmax = {torch.int8: 127.0, _E5M2: 57344.0}.get(dtype, 448.0)
    if with_amax:
        ties = (qmax,) + tuple(t for t in ties if abs(t) < qmax)
    x = torch.rand(rows, D, generator=generator) - 0.5      # small values after the ties
    n = min(D, len(ties))
    x[:, :n] = torch.tensor(ties[:n])
    return x


def _random_codes(shape, dtype, generator):
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=generator, dtype=torch.int8)
    return (torch.randn(shape, generator=generator) * 60).clamp(-448, 448).to(dtype)


def _kv_tensors(name, device, *, blocks, page_size, Hkv, D, Dv, dtype, kv_dtype, g):
    """Caches of random finite content: values, or codes with positive scales."""
    if kv_dtype is None:
        k = randn(blocks, page_size, Hkv, D, dtype=dtype, device=device, generator=g)
        v = randn(blocks, page_size, Hkv, Dv, dtype=dtype, device=device, generator=g)
        return dict(k_cache=k, v_cache=v, k_cache_scale=None, v_cache_scale=None)
    return dict(
        k_cache=_random_codes((blocks, page_size, Hkv, D), kv_dtype, g).to(device),
        v_cache=_random_codes((blocks, page_size, Hkv, Dv), kv_dtype, g).to(device),
        k_cache_scale=(torch.rand(blocks, page_size, Hkv, generator=g) + 0.01).to(device),
        v_cache_scale=(torch.rand(blocks, page_size, Hkv, generator=g) + 0.01).to(device))


def kv_write_case(name, device, *, N, blocks, page_size, Hkv=3, D=64, Dv=None, dtype=torch.bfloat16,
                  kv_dtype=None, padding=(), given_scales=None, ties=False) -> Sample:
    """A ``reshape_and_cache`` sample: N new tokens to distinct random slots of the cache, the
    tokens at the indices ``padding`` on slot -1. ``given_scales``: None, "head" ((Hkv,) for k,
    (N, Hkv) for v) or "one" (scale 1 for every row, as the tie rows need). ``ties``: the keys are
    :func:`tie_rows` (fp32 keys)."""
    g = generator(name)
    Dv = Dv or D
    if ties:
        key = tie_rows(kv_dtype, N * Hkv, D, with_amax=given_scales is None, generator=g)
        key, dtype = key.view(N, Hkv, D).to(device), torch.float32
    else:
        key = randn(N, Hkv, D, dtype=dtype, device=device, generator=g, scale=3.0)
    value = randn(N, Hkv, Dv, dtype=dtype, device=device, generator=g, scale=3.0)
    if N:
        value[0, 0] = 0   # an all-zero row: scale 1
    slots = torch.randperm(blocks * page_size, generator=g)[:N]
    slots[list(padding)] = -1
    kw = dict(key=key, value=value)
    kw.update(_kv_tensors(name, device, blocks=blocks, page_size=page_size, Hkv=Hkv, D=D, Dv=Dv,
                          dtype=dtype, kv_dtype=kv_dtype, g=g))
    kw.update(slot_mapping=slots.to(device), k_scale=None, v_scale=None,
              kv_dtype=kv_dtype or dtype)
    if given_scales == "head":
        kw["k_scale"] = (torch.rand(Hkv, generator=g) * 0.05 + 0.01).to(device)
        kw["v_scale"] = (torch.rand(N, Hkv, generator=g) * 0.05 + 0.01).to(device)
    elif given_scales == "one":
        kw["k_scale"] = kw["v_scale"] = torch.ones(1, dtype=torch.float32, device=device)
    return Sample(name, kw)


def _kv_write_samples(device):
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    yield kv_write_case("ps16 Hkv3 D80 bf16, 2 padding slots", device, N=23, blocks=6, page_size=16,
                        D=80, padding=(3, 17))
    yield kv_write_case("ps1 Hkv1 D64 fp16", device, N=17, blocks=40, page_size=1, Hkv=1, dtype=f16)
    yield kv_write_case("ps256 Hkv3 D128 fp32 decode N5", device, N=5, blocks=2, page_size=256, D=128,
                        dtype=f32)
    yield kv_write_case("ps3 Hkv1 D80 Dv64, padding first and last", device, N=11, blocks=9,
                        page_size=3, Hkv=1, D=80, Dv=64, padding=(0, 10))
    yield kv_write_case("every slot padding", device, N=4, blocks=2, page_size=3, padding=(0, 1, 2, 3))
    yield kv_write_case("N0", device, N=0, blocks=2, page_size=16)


# e4m3 before int8 (as qk_norm_rope_quant's samples): where every sample fails, a record's worst
# entry is then a NaN code rather than an int8 count of differing codes (tests/test_check.py).
_QUANT_TAGS = ((_E4M3, "e4m3"), (torch.int8, "int8"))


def _kv_write_quant_samples(device):
    for kv, tag in _QUANT_TAGS:
        yield kv_write_case(f"{tag} ps16 Hkv3 D128 bf16, padding", device, N=21, blocks=4,
                            page_size=16, D=128, kv_dtype=kv, padding=(5,))
        yield kv_write_case(f"{tag} ps3 Hkv1 D80 fp16, given scales", device, N=9, blocks=5,
                            page_size=3, Hkv=1, D=80, dtype=torch.float16, kv_dtype=kv,
                            given_scales="head")
        yield kv_write_case(f"{tag} ps1 D64 ties at scale 1 (given)", device, N=6, blocks=8,
                            page_size=1, kv_dtype=kv, given_scales="one", ties=True)
        yield kv_write_case(f"{tag} ps256 Hkv3 D64 ties at amax / qmax = 1", device, N=4, blocks=1,
                            page_size=256, kv_dtype=kv, ties=True, padding=(2,))


def kv_gather_case(name, device, *, lengths, page_size, Hkv=3, D=64, Dv=None, dtype=torch.bfloat16,
                   kv_dtype=None, spare_pages=2, max_seqlen=None, out_dtype=None) -> Sample:
    """A ``gather_cache`` sample: sequences of ``lengths`` on random distinct pages. Everything a
    gather must not read is NaN: the pages no sequence owns and the slots of a last page past its
    sequence (NaN values, or NaN scales for codes); block_table entries past a sequence's pages
    are -7, out of range."""
    g = generator(name)
    Dv = Dv or D
    pages_per = [-(-n // page_size) for n in lengths]
    blocks = sum(pages_per) + spare_pages
    kw = _kv_tensors(name, device, blocks=blocks, page_size=page_size, Hkv=Hkv, D=D, Dv=Dv,
                     dtype=dtype, kv_dtype=kv_dtype, g=g)
    order = torch.randperm(blocks, generator=g)
    table = torch.full((len(lengths), max(pages_per, default=0) + 1), -7, dtype=torch.int32)
    live = torch.zeros(blocks * page_size, dtype=torch.bool)
    start = 0
    for b, (n, p) in enumerate(zip(lengths, pages_per)):
        pages = order[start:start + p]
        start += p
        table[b, :p] = pages.to(torch.int32)
        pos = torch.arange(n)
        live[pages.long()[pos // page_size] * page_size + pos % page_size] = True
    dead = ~live.view(blocks, page_size).to(device)
    if kv_dtype is None:
        kw["k_cache"][dead] = math.nan
        kw["v_cache"][dead] = math.nan
    else:
        kw["k_cache_scale"][dead] = math.nan
        kw["v_cache_scale"][dead] = math.nan
    return Sample(name, dict(k_cache=kw["k_cache"], v_cache=kw["v_cache"], block_table=table.to(device),
                             cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device),
                             k_cache_scale=kw["k_cache_scale"], v_cache_scale=kw["v_cache_scale"],
                             dtype=out_dtype, max_seqlen=max_seqlen))


def _kv_gather_samples(device):
    yield kv_gather_case("ps16 Hkv3 D80 bf16, B3 with an empty sequence", device, lengths=[37, 0, 16],
                         page_size=16, D=80)
    yield kv_gather_case("ps1 Hkv1 D64 fp16", device, lengths=[5, 9], page_size=1, Hkv=1,
                         dtype=torch.float16)
    yield kv_gather_case("ps256 Hkv3 D128 fp32", device, lengths=[300, 1], page_size=256, D=128,
                         dtype=torch.float32)
    yield kv_gather_case("ps3 Hkv1 D80 Dv64, max_seqlen 12 past the longest", device, lengths=[7, 0, 11],
                         page_size=3, Hkv=1, D=80, Dv=64, max_seqlen=12)
    yield kv_gather_case("every sequence empty", device, lengths=[0, 0], page_size=16)


def _kv_gather_quant_samples(device):
    yield kv_gather_case("int8 ps16 Hkv3 D128 to bf16", device, lengths=[20, 0, 33], page_size=16,
                         D=128, kv_dtype=torch.int8, out_dtype=torch.bfloat16)
    yield kv_gather_case("e4m3 ps3 Hkv1 D80 to fp32", device, lengths=[10, 4], page_size=3, Hkv=1,
                         D=80, kv_dtype=_E4M3, out_dtype=torch.float32)
    yield kv_gather_case("e4m3 ps256 Hkv3 D64 to fp16", device, lengths=[260], page_size=256,
                         kv_dtype=_E4M3, out_dtype=torch.float16)
    yield kv_gather_case("int8 ps1 Hkv1 D64 Dv80, default dtype (fp32)", device, lengths=[3, 0, 6],
                         page_size=1, Hkv=1, D=64, Dv=80, kv_dtype=torch.int8)


def _quantize_kv_samples(device):
    for kv, tag in _QUANT_TAGS + ((_E5M2, "e5m2"),):   # e5m2: quantize_kv only (MLA caches)
        g = generator(tag, "quantize_kv ")
        x = randn(5, 3, 80, dtype=torch.bfloat16, device=device, generator=g, scale=4.0)
        x[1, 2] = 0
        yield Sample(f"{tag} (5, 3, 80) bf16 with a zero row", dict(x=x, dtype=kv, scale=None))
        yield Sample(f"{tag} (7, 64) fp16 non-contiguous",
                     dict(x=_noncontiguous(randn(7, 64, dtype=torch.float16, device=device, generator=g)),
                          dtype=kv, scale=None))
        yield Sample(f"{tag} (2, 4, 128) fp32, given per-row scales",
                     dict(x=randn(2, 4, 128, dtype=torch.float32, device=device, generator=g, scale=9.0),
                          dtype=kv, scale=(torch.rand(2, 4, generator=g) * 0.1 + 0.01).to(device)))
        yield Sample(f"{tag} ties at a given scale 1", dict(
            x=tie_rows(kv, 3, 64, with_amax=False, generator=g).to(device), dtype=kv,
            scale=torch.ones((), device=device)))
        yield Sample(f"{tag} ties at amax / qmax = 1", dict(
            x=tie_rows(kv, 3, 64, with_amax=True, generator=g).to(device), dtype=kv, scale=None))


def _dequantize_kv_samples(device):
    g = generator("dequantize_kv")
    yield Sample("int8 (5, 3, 80) to bf16", dict(
        codes=_random_codes((5, 3, 80), torch.int8, g).to(device),
        scale=(torch.rand(5, 3, generator=g) * 0.1).to(device), dtype=torch.bfloat16))
    yield Sample("e4m3 (7, 64) to fp32", dict(
        codes=_random_codes((7, 64), _E4M3, g).to(device),
        scale=(torch.rand(7, generator=g) * 3).to(device), dtype=torch.float32))
    yield Sample("e5m2 (3, 2, 576) to bf16", dict(
        codes=(torch.randn(3, 2, 576, generator=g) * 3000).to(_E5M2).to(device),
        scale=(torch.rand(3, 2, generator=g) * 2).to(device), dtype=torch.bfloat16))
    yield Sample("int8 (2, 1, 128) to fp16, one scale per tensor", dict(
        codes=_random_codes((2, 1, 128), torch.int8, g).to(device),
        scale=torch.full((), 0.02, device=device), dtype=torch.float16))


def merge_case(name, device, *, B=2, Sq=17, H=3, D=64, dtype=torch.bfloat16, empty_rows=True,
               noncontiguous=False) -> Sample:
    """Two partials with random LSEs; with ``empty_rows``: rows where a is empty (-inf, its out
    NaN), b is empty, both are, and a holds +inf (FlashAttention 2's empty row)."""
    g = generator(name)
    out_a = randn(B, Sq, H, D, dtype=dtype, device=device, generator=g)
    out_b = randn(B, Sq, H, D, dtype=dtype, device=device, generator=g)
    if noncontiguous:
        out_a, out_b = _noncontiguous(out_a), _noncontiguous(out_b)
    lse_a = (torch.randn(B, H, Sq, generator=g) * 4).to(device)
    lse_b = (torch.randn(B, H, Sq, generator=g) * 4).to(device)
    if empty_rows and Sq >= 4:
        lse_a[0, 0, 0] = -math.inf
        out_a[0, 0, 0] = math.nan
        lse_b[0, 0, 1] = -math.inf
        lse_a[0, 0, 2] = lse_b[0, 0, 2] = -math.inf
        lse_a[-1, -1, 3] = math.inf
    return Sample(name, dict(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b))


def _merge_samples(device):
    yield merge_case("bf16 (2, 17, 3, 64) with empty partials", device)
    yield merge_case("fp16 (1, 1, 1, 80)", device, B=1, Sq=1, H=1, D=80, dtype=torch.float16)
    yield merge_case("fp32 (1, 9, 2, 128) with empty partials", device, B=1, Sq=9, H=2, D=128,
                     dtype=torch.float32)
    yield merge_case("bf16 non-contiguous (3, 5, 1, 96)", device, B=3, Sq=5, H=1, D=96, noncontiguous=True)
    yield merge_case("Sq0", device, Sq=0)


register(Op(
    name="reshape_and_cache", family="kv_cache", oracle=f"{_KV_REF}:reshape_and_cache",
    lanes={"triton": f"{_KV}:reshape_and_cache_triton", "reference": f"{_KV}:reshape_and_cache_reference"},
    samples=_kv_write_samples, outputs=(("k_cache", EXACT), ("v_cache", EXACT)),
    doc="New tokens' keys and values written at their slots of a paged cache (negative slots skipped)",
))
register(Op(
    name="reshape_and_cache.quantized", family="kv_cache", oracle=f"{_KV_REF}:reshape_and_cache",
    lanes={"triton": f"{_KV}:reshape_and_cache_triton", "reference": f"{_KV}:reshape_and_cache_reference"},
    samples=_kv_write_quant_samples,
    outputs=(("k_cache", CODES), ("v_cache", CODES), ("k_cache_scale", CODES), ("v_cache_scale", CODES)),
    doc="reshape_and_cache into int8 / fp8 e4m3 codes with per-(token, head) scales, bit-exact",
))
register(Op(
    name="gather_cache", family="kv_cache", oracle=f"{_KV_REF}:gather_cache",
    lanes={"triton": f"{_KV}:gather_cache_triton", "reference": f"{_KV}:gather_cache_reference"},
    samples=_kv_gather_samples, outputs=(("k", EXACT), ("v", EXACT)),
    doc="Sequences read back from their pages through the block table, dense and zero-padded",
))
register(Op(
    name="gather_cache.dequantized", family="kv_cache", oracle=f"{_KV_REF}:gather_cache",
    lanes={"triton": f"{_KV}:gather_cache_triton", "reference": f"{_KV}:gather_cache_reference"},
    samples=_kv_gather_quant_samples, outputs=(("k", EXACT), ("v", EXACT)),
    doc="gather_cache of an int8 / fp8 e4m3 cache: codes * scale in fp32, rounded to the dtype asked for",
))
register(Op(
    name="quantize_kv", family="kv_cache", oracle=f"{_KV_REF}:quantize_kv",
    lanes={"triton": f"{_KV}:quantize_kv_triton", "reference": f"{_KV}:quantize_kv_reference"},
    samples=_quantize_kv_samples, outputs=(("codes", CODES), ("scale", CODES)),
    doc="Per-row int8 / fp8 e4m3 codes and scales (amax / qmax, or given), bit-exact, ties to even",
))
register(Op(
    name="dequantize_kv", family="kv_cache", oracle=f"{_KV_REF}:dequantize_kv",
    lanes={"triton": f"{_KV}:dequantize_kv_triton", "reference": f"{_KV}:dequantize_kv_reference"},
    samples=_dequantize_kv_samples, outputs=(("x", EXACT),),
    doc="codes * scale per row in fp32, rounded to the dtype asked for",
))
register(Op(
    name="merge_attn_states", family="kv_cache", oracle=f"{_KV_REF}:merge_attn_states",
    lanes={"triton": f"{_KV}:merge_attn_states_triton", "reference": f"{_KV}:merge_attn_states_reference"},
    samples=_merge_samples, outputs=(("out", ELTWISE), ("lse", LSE)),
    doc="Two attention partials merged by their LSEs (empty partials, -inf or +inf, contribute nothing)",
))
