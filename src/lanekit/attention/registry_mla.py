"""The registry entry of MLA decode (``flash_mla_with_kvcache``): its sample builder and the
``register`` call. Imported by ``lanekit.attention.registry`` (the family's registry module).

Each sample's cache is paged with shuffled pages and spare pages nobody owns; what must never be
read holds poison: the cache slots past a sequence's length and every spare page are NaN (a codes
cache: NaN scales, and NaN codes where the format has one), and the block table's entries past a
sequence's pages are 2^31 - 1, a page that does not exist.
"""

from __future__ import annotations

import torch

from lanekit.attention.registry import ATTENTION_FWD
from lanekit.runtime.registry import Op, Sample, register
from lanekit.testing import LSE, generator, noncontiguous, randn

_NAN_CODES = (torch.float8_e4m3fn, torch.float8_e5m2)


def mla_case(name, device, *, B=2, Sq=1, H=16, Hkv=1, D=576, Dv=512, page_size=64, seqlens=(5, 70),
             causal=False, dtype=torch.bfloat16, quant=None, num_splits=1, q_strided=False,
             softmax_scale=None) -> Sample:
    """A ``flash_mla_with_kvcache`` sample in the lanes' normalized form (see the module's note on
    poison). ``quant``: int8, e4m3 or e5m2 codes with per-(slot, head) scales (quantize_kv's)."""
    from lanekit.reference.kv_cache import quantize_kv

    g = generator(name)
    q = randn(B, Sq, H, D, dtype=dtype, device=device, generator=g)
    if q_strided:
        q = noncontiguous(q)
    pages = [-(-n // page_size) for n in seqlens]
    max_pages = max(pages) + 1
    num_blocks = sum(pages) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((B, max_pages), 2**31 - 1, dtype=torch.int32)
    live = torch.zeros(num_blocks, page_size, dtype=torch.bool)
    for b, n in enumerate(seqlens):
        mine, order = order[: pages[b]], order[pages[b]:]
        table[b, : pages[b]] = torch.tensor(mine, dtype=torch.int32)
        for t in range(n):
            live[mine[t // page_size], t % page_size] = True
    cache = torch.randn(num_blocks, page_size, Hkv, D, generator=g)
    scale = None
    if quant is not None:
        cache, scale = quantize_kv(cache, quant)
        scale[~live] = float("nan")
        if quant in _NAN_CODES:   # (fp8 has no masked_fill: through its bytes)
            nan = torch.tensor(float("nan")).to(quant).view(torch.uint8)
            cache.view(torch.uint8)[~live] = nan
    else:
        cache = cache.to(dtype)
        cache[~live] = float("nan")
    return Sample(name, dict(
        q=q, k_cache=cache.to(device), block_table=table.to(device),
        cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device), head_dim_v=Dv,
        softmax_scale=softmax_scale if softmax_scale is not None else D ** -0.5, causal=causal,
        k_cache_scale=scale.to(device) if scale is not None else None, num_splits=num_splits,
    ))


def _mla_samples(device):
    f16 = torch.float16
    yield mla_case("H16 page 64, cache_seqlens 0, 1 and 70", device, B=3, seqlens=(0, 1, 70))
    yield mla_case("H5 page 7 fp16 splits 3", device, H=5, page_size=7, seqlens=(37, 13), dtype=f16, num_splits=3)
    yield mla_case("Sq3 causal H8 page 16 splits 2 (a row before every key)", device, Sq=3, H=8, page_size=16,
                   seqlens=(2, 40), causal=True, num_splits=2)
    yield mla_case("Sq2 not causal H6 page 3, q strided", device, Sq=2, H=6, page_size=3, seqlens=(9, 4),
                   q_strided=True)
    yield mla_case("H128 (several head blocks) page 64 splits 2", device, B=1, H=128, seqlens=(100,), num_splits=2)
    yield mla_case("e4m3 cache H16 page 5 splits 2", device, page_size=5, seqlens=(33, 8),
                   quant=torch.float8_e4m3fn, num_splits=2)
    yield mla_case("e5m2 cache H12 page 64 causal Sq2", device, H=12, Sq=2, causal=True, seqlens=(65, 3),
                   quant=torch.float8_e5m2)
    yield mla_case("int8 cache Hkv2 H6 page 1 fp16", device, H=6, Hkv=2, page_size=1, seqlens=(6, 11),
                   quant=torch.int8, dtype=f16)
    yield mla_case("D80 Dv64 (other sizes) page 4 splits 4", device, D=80, Dv=64, H=3, page_size=4,
                   seqlens=(30, 17), num_splits=4)
    yield mla_case("D64 = Dv (no rope) page 32, softmax_scale 0.3", device, D=64, Dv=64, H=4, page_size=32,
                   seqlens=(45, 0), softmax_scale=0.3)


register(Op(
    name="flash_mla_with_kvcache",
    family="attention",
    oracle="lanekit.reference.mla:flash_mla_with_kvcache",
    lanes={"triton": "lanekit.attention.op_mla:flash_mla_with_kvcache_triton",
           "reference": "lanekit.attention.op_mla:flash_mla_with_kvcache_reference"},
    samples=_mla_samples,
    outputs=(("out", ATTENTION_FWD), ("lse", LSE)),
    doc="MLA decode over a paged latent cache (bf16/fp16, int8, fp8 e4m3/e5m2 codes), split-KV (FlashMLA's with_kvcache)",
))
