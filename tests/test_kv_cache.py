"""The paged KV cache (lanekit.kv_cache): every registered op against its oracle with poisoned outputs,
the rounding ties and clamps of the codes written out by hand, pages a sequence does not own never
read, any page_size, PagedKVCache's lifecycle, merge_attn_states against attention over all the keys,
bad input, and (GPU) more than 2^31 elements."""

import math
import pickle

import numpy as np

import pytest
import torch

import lanekit
import lanekit.kv_cache as KV
from lanekit import check
from lanekit.attention.registry import ATTENTION_FWD
from lanekit.families import registry
from lanekit.kv_cache.registry import E4M3_TIES, INT8_TIES
from lanekit.reference import attention as ref_attn
from lanekit.reference import kv_cache as ref
from lanekit.testing import assert_close, assert_same_bits, poisoned_outputs, randn

LANES = ["triton", "reference"]
E4M3 = torch.float8_e4m3fn
KV_OPS = sorted(name for name, op in registry().items() if op.family == "kv_cache")


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, so that equality is exact for fp8 (and -0.0 != 0.0)."""
    return t.view(torch.uint8) if t.dtype == E4M3 else t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("name", KV_OPS)
@pytest.mark.parametrize("lane", LANES)
def test_every_registered_sample_matches_its_oracle_with_outputs_poisoned(device, name, lane):
    result = check.check_lane(registry()[name], lane, device)   # poisons the outputs it allocates
    assert result.total > 0 and not result.failures, "; ".join(f"{s.name}: {s.detail}" for s in result.failures)


# ---- the codes: ties to even, clamps, bit for bit ----

# Expected int8 codes of INT8_TIES at scale 1, and the e4m3 values of E4M3_TIES.
INT8_EXPECTED = [0, 0, 2, -2, 2, -2, -128, -128, -128, 127, 126, -128, 4, 0]
E4M3_EXPECTED = [1.0, -1.0, 1.25, -1.25, 16.0, -20.0, 448.0, -448.0, 448.0, -448.0, 0.0, -0.0,
                 2.0 ** -8, 0.5]


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("dtype, ties, expected", [
    (torch.int8, INT8_TIES, INT8_EXPECTED), (E4M3, E4M3_TIES, E4M3_EXPECTED)], ids=["int8", "e4m3"])
def test_codes_round_half_to_even_and_clamp_at_a_given_scale(device, lane, dtype, ties, expected):
    x = torch.tensor([ties, [-t for t in ties]], dtype=torch.float32, device=device)
    with poisoned_outputs():
        codes, scale = KV.quantize_kv(x, dtype, scale=torch.ones((), device=device), lane=lane)
    assert codes.float()[0].tolist() == expected
    if dtype == torch.int8:   # the negated row: 128.5 -> 127, 129 and 200 clamp, -127.5 -> -128 (even)
        assert codes[1].tolist() == [0, 0, -2, 2, -2, 2, 127, 127, 127, -128, -126, 127, -4, 0]
    else:
        assert codes.float()[1].tolist() == [-e for e in expected]
    assert torch.equal(scale, torch.ones(2, device=device))
    ref_codes, _ = ref.quantize_kv(x, dtype, torch.ones((), device=device))
    assert torch.equal(bits(codes), bits(ref_codes))


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("dtype", [torch.int8, E4M3], ids=["int8", "e4m3"])
def test_ties_and_the_int8_low_end_reach_the_cache_through_reshape_and_cache(device, lane, dtype):
    """Row 0 at a given scale 1 (the -128 end reachable); row 1 with amax = qmax, so that
    amax / qmax = 1 exactly and the ties hold at the computed scale."""
    ties, expected = (INT8_TIES, INT8_EXPECTED) if dtype == torch.int8 else (E4M3_TIES, E4M3_EXPECTED)
    qmax = 127.0 if dtype == torch.int8 else 448.0
    inner = [(t, e) for t, e in zip(ties, expected) if abs(t) < qmax]
    D = len(ties)
    key = torch.zeros(2, 1, D, device=device)
    key[0, 0] = torch.tensor(ties)
    key[1, 0, 0] = qmax
    key[1, 0, 1:1 + len(inner)] = torch.tensor([t for t, _ in inner])
    cache = torch.zeros(3, 2, 1, D, dtype=dtype, device=device)
    scales = torch.full((3, 2, 1), 7.0, device=device)
    v_cache, v_scales = cache.clone(), scales.clone()
    slots = torch.tensor([5, 0], device=device)
    # row 0 with k_scale 1 (v: its amax / qmax), row 1 with its amax / qmax: two calls
    KV.reshape_and_cache(key[:1], key[:1], cache, v_cache, slots[:1], torch.ones(1, 1, device=device), None,
                         k_cache_scale=scales, v_cache_scale=v_scales, lane=lane)
    KV.reshape_and_cache(key[1:], key[1:], cache, v_cache, slots[1:], None, None,
                         k_cache_scale=scales, v_cache_scale=v_scales, lane=lane)
    assert cache[2, 1, 0].float().tolist() == expected                        # slot 5, given scale
    assert cache[0, 0, 0, 1:1 + len(inner)].float().tolist() == [e for _, e in inner]   # slot 0
    assert cache[0, 0, 0, 0].float().item() == qmax
    assert scales[2, 1, 0].item() == 1.0 and scales[0, 0, 0].item() == 1.0
    assert v_scales[0, 0, 0].item() == 1.0 and torch.equal(bits(v_cache[0, 0]), bits(cache[0, 0]))
    if dtype == torch.int8:  # slot 5's v got amax / qmax = 200 / 127 instead: no -128 there
        assert int(v_cache[2, 1, 0].min()) == -127
    untouched = torch.ones(3, 2, dtype=torch.bool)
    untouched[2, 1] = untouched[0, 0] = False
    assert (scales[untouched] == 7.0).all() and (cache[untouched].float() == 0).all()


@pytest.mark.parametrize("lane", LANES)
def test_an_all_zero_row_has_scale_one_and_zero_codes(device, lane):
    x = torch.zeros(3, 64, dtype=torch.bfloat16, device=device)
    x[1, 5] = -2.0
    for dtype in (torch.int8, E4M3):
        codes, scale = KV.quantize_kv(x, dtype, lane=lane)
        qmax = 127.0 if dtype == torch.int8 else 448.0
        assert scale.tolist() == [1.0, (torch.tensor(2.0) / torch.tensor(qmax)).item(), 1.0]
        assert codes.float()[[0, 2]].abs().sum() == 0
        assert codes.float()[1, 5].item() == -qmax


@pytest.mark.parametrize("lane", LANES)
def test_dequantize_is_one_fp32_product_then_the_dtype(device, lane):
    g = gen(1)
    x = randn(4, 3, 80, dtype=torch.float32, device=device, generator=g, scale=5.0)
    for dtype in (torch.int8, E4M3):
        codes, scale = KV.quantize_kv(x, dtype, lane=lane)
        for out_dtype in (torch.float32, torch.bfloat16):
            y = KV.dequantize_kv(codes, scale, out_dtype, lane=lane)
            assert torch.equal(y, (codes.float() * scale[..., None]).to(out_dtype))
        if dtype == torch.int8:   # within half a code of x
            error = (KV.dequantize_kv(codes, scale, lane=lane) - x).abs()
            assert (error <= 0.5001 * scale[..., None]).all()


# ---- writes and gathers ----

def _filled_cache(device, *, blocks, page_size, H, D, dtype=torch.bfloat16, fill=7.0):
    return (torch.full((blocks, page_size, H, D), fill, dtype=dtype, device=device),
            torch.full((blocks, page_size, H, D), fill, dtype=dtype, device=device))


@pytest.mark.parametrize("lane", LANES)
def test_negative_slots_are_skipped_and_nothing_else_is_written(device, lane):
    g = gen(2)
    k_cache, v_cache = _filled_cache(device, blocks=3, page_size=3, H=2, D=16)
    key = randn(4, 2, 16, dtype=torch.bfloat16, device=device, generator=g)
    value = randn(4, 2, 16, dtype=torch.bfloat16, device=device, generator=g)
    KV.reshape_and_cache(key, value, k_cache, v_cache, torch.tensor([-1, 5, -3, 0], device=device), lane=lane)
    flat_k, flat_v = k_cache.view(9, 2, 16), v_cache.view(9, 2, 16)
    assert torch.equal(flat_k[5], key[1]) and torch.equal(flat_k[0], key[3])
    assert torch.equal(flat_v[5], value[1]) and torch.equal(flat_v[0], value[3])
    others = [i for i in range(9) if i not in (0, 5)]
    assert (flat_k[others] == 7.0).all() and (flat_v[others] == 7.0).all()


@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["bf16", "int8"])
@pytest.mark.parametrize("lane", LANES)
def test_k_and_v_caches_as_views_of_one_buffer(device, kv_dtype, lane):
    """vLLM's (num_blocks, 2, page_size, Hkv, D) buffer: k_cache and v_cache are strided views."""
    g = gen(8)
    buf = torch.zeros(5, 2, 3, 2, 16, dtype=kv_dtype or torch.bfloat16, device=device)
    k_cache, v_cache = buf[:, 0], buf[:, 1]
    scales = {}
    if kv_dtype is not None:
        sbuf = torch.ones(5, 3, 2, 2, device=device)       # scales interleaved in the last dim
        scales = dict(k_cache_scale=sbuf[..., 0], v_cache_scale=sbuf[..., 1])
    key = randn(6, 2, 16, dtype=torch.bfloat16, device=device, generator=g)
    value = randn(6, 2, 16, dtype=torch.bfloat16, device=device, generator=g)
    slots = torch.tensor([14, 0, 7, -1, 3, 4], device=device)
    expected = ref.reshape_and_cache(key, value, k_cache.contiguous(), v_cache.contiguous(), slots,
                                     **{k: v.contiguous() for k, v in scales.items()})
    KV.reshape_and_cache(key, value, k_cache, v_cache, slots, **scales, lane=lane)
    for got, want in zip((k_cache, v_cache, *scales.values()), expected):
        assert torch.equal(got, want)
    table = torch.tensor([[4, 0, 1], [2, 1, 1]], dtype=torch.int32, device=device)
    lens = torch.tensor([8, 2], dtype=torch.int32, device=device)
    with poisoned_outputs():
        k, v = KV.gather_cache(k_cache, v_cache, table, lens, **scales, lane=lane)
    want = ref.gather_cache(k_cache.contiguous(), v_cache.contiguous(), table, lens,
                            *(t.contiguous() for t in scales.values()))
    assert torch.equal(k, want[0]) and torch.equal(v, want[1])



@pytest.mark.parametrize("case, launches", [("bf16", 1), ("int8", 1), ("int8, k_scale only", 2)])
def test_keys_and_values_are_written_in_one_launch_where_they_pair(device, case, launches, monkeypatch):
    """reshape_and_cache and flash_attn_with_kvcache's append into a cache of codes write keys and
    values in one launch (values on the grid's second row) when they pair up (the same dtypes,
    scales given alike); values of another head dim too. Otherwise each takes its own launch. Into
    an unquantized cache, flash_attn_with_kvcache's attention kernel appends them itself (no
    launch of kv_cache's). Both against the oracle."""
    from lanekit.kv_cache import kernels

    calls = []
    real = kernels._scatter
    monkeypatch.setattr(kernels, "_scatter", lambda *a: calls.append(1) or real(*a))
    g = gen(12)
    quant = case.startswith("int8")
    dtype = torch.int8 if quant else torch.bfloat16
    k_cache = torch.full((4, 3, 2, 16), 7, dtype=dtype, device=device)
    v_cache = torch.full((4, 3, 2, 8), 7, dtype=dtype, device=device)    # Dv = 8 beside D = 16
    scales = dict(k_cache_scale=torch.ones(4, 3, 2, device=device),
                  v_cache_scale=torch.ones(4, 3, 2, device=device)) if quant else {}
    given = dict(k_scale=torch.full((5, 2), 0.02, device=device)) if case.endswith("only") else {}
    key = randn(5, 2, 16, dtype=torch.bfloat16, device=device, generator=g)
    value = randn(5, 2, 8, dtype=torch.bfloat16, device=device, generator=g)
    slots = torch.tensor([11, 0, -1, 6, 3], device=device)
    expected = ref.reshape_and_cache(key, value, k_cache.clone(), v_cache.clone(), slots, **given,
                                     **{k: v.clone() for k, v in scales.items()})
    KV.reshape_and_cache(key, value, k_cache, v_cache, slots, **given, **scales, lane="triton")
    assert len(calls) == launches
    for got, want in zip((k_cache, v_cache, *scales.values()), expected):
        assert torch.equal(bits(got), bits(want))

    calls.clear()      # the append of flash_attn_with_kvcache, paged
    q = randn(2, 1, 4, 16, dtype=torch.bfloat16, device=device, generator=g)
    k_new = randn(2, 1, 2, 16, dtype=torch.bfloat16, device=device, generator=g)
    v_new = randn(2, 1, 2, 8, dtype=torch.bfloat16, device=device, generator=g)
    table = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32, device=device)
    lens = torch.tensor([4, 2], dtype=torch.int32, device=device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_scales = {k: v.clone() for k, v in scales.items()}
    lanekit.flash_attn_with_kvcache(q, want_k, want_v, k_new, v_new, cache_seqlens=lens, block_table=table,
                                    **want_scales, lane="reference")
    lanekit.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, block_table=table,
                                   **scales, lane="triton")
    assert len(calls) == (1 if quant else 0)
    for got, want in zip((k_cache, v_cache, *scales.values()), (want_k, want_v, *want_scales.values())):
        assert torch.equal(bits(got), bits(want))

def _sequences(device, *, page_size, lengths, H=2, D=32, kv_dtype=None, seed=3):
    """A PagedKVCache holding sequences 0..B-1 of ``lengths`` random tokens, and those tokens."""
    g = gen(seed)
    pages = sum(-(-n // page_size) for n in lengths) + 2
    cache = KV.PagedKVCache(pages, page_size, H, D, torch.bfloat16, device, kv_dtype, lane="triton")
    slots = cache.append(list(range(len(lengths))), lengths)
    key = randn(sum(lengths), H, D, dtype=torch.bfloat16, device=device, generator=g)
    value = randn(sum(lengths), H, D, dtype=torch.bfloat16, device=device, generator=g)
    cache.write(key, value, slots)
    return cache, key, value


def test_a_strided_cache_seqlens_is_read_as_its_values(device):
    cache, key, value = _sequences(device, page_size=4, lengths=[9, 3])
    table = cache.block_table([0, 1])
    lengths = torch.tensor([9, 3], dtype=torch.int32, device=device)
    spaced = torch.tensor([9, 1000, 3, 1000], dtype=torch.int32, device=device)[::2]   # gaps not read
    with poisoned_outputs():
        want = KV.gather_cache(cache.k_cache, cache.v_cache, table, lengths, lane="triton")
        got = KV.gather_cache(cache.k_cache, cache.v_cache, table, spaced, lane="triton")
    # what was written, sequence by sequence, then zeros (the oracle of a 16-bit cache: exact)
    for b, (start, n) in enumerate(((0, 9), (9, 3))):
        assert torch.equal(want[0][b, :n], key[start:start + n]) and (want[0][b, n:] == 0).all()
        assert torch.equal(want[1][b, :n], value[start:start + n]) and (want[1][b, n:] == 0).all()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("page_size", [1, 2, 3, 5, 7, 16, 100, 256])
def test_any_page_size_gives_back_what_was_written(device, page_size):
    lengths = [2 * page_size + 1, 0, 3]
    cache, key, value = _sequences(device, page_size=page_size, lengths=lengths)
    with poisoned_outputs():
        k, v = cache.gather([0, 1, 2])
    assert k.shape == (3, max(lengths), 2, 32)
    starts = [0, lengths[0], lengths[0]]
    for b, n in enumerate(lengths):
        assert torch.equal(k[b, :n], key[starts[b]:starts[b] + n])
        assert torch.equal(v[b, :n], value[starts[b]:starts[b] + n])
        assert (k[b, n:] == 0).all() and (v[b, n:] == 0).all()


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, E4M3], ids=["bf16", "int8", "e4m3"])
@pytest.mark.parametrize("lane", LANES)
def test_pages_a_sequence_does_not_own_filled_with_nan_change_nothing(device, kv_dtype, lane):
    cache, _, _ = _sequences(device, page_size=5, lengths=[7, 0, 11], kv_dtype=kv_dtype)
    ids = [0, 1, 2]
    table, lens = cache.block_table(ids), cache.cache_seqlens(ids)
    scales = dict(k_cache_scale=cache.k_scale, v_cache_scale=cache.v_scale)
    before = KV.gather_cache(cache.k_cache, cache.v_cache, table, lens, **scales, lane=lane)
    live = torch.zeros(cache.num_blocks, 5, dtype=torch.bool)
    for s in ids:
        for t in range(cache.seq_len(s)):
            live[cache.pages(s)[t // 5], t % 5] = True
    dead = ~live.to(device)
    assert dead.sum() > 5   # spare pages and the tails of last pages
    for t in (cache.k_cache, cache.v_cache) if kv_dtype is None else (cache.k_scale, cache.v_scale):
        t[dead] = math.nan
    pages_used = (lens + 4) // 5                                # entries past a row's pages: not read
    table[torch.arange(table.shape[1], device=device)[None, :] >= pages_used[:, None]] = -3
    with poisoned_outputs():
        after = KV.gather_cache(cache.k_cache, cache.v_cache, table, lens, **scales, lane=lane)
    for x, y in zip(before, after):
        assert not torch.isnan(y).any()
        assert torch.equal(x, y)


def test_paged_kv_cache_lifecycle(device):
    cache = KV.PagedKVCache(6, 4, 2, 16, torch.float32, device, lane="triton")
    g = gen(4)

    def tokens(n):
        return (randn(n, 2, 16, dtype=torch.float32, device=device, generator=g),
                randn(n, 2, 16, dtype=torch.float32, device=device, generator=g))

    slots = cache.append([0, 1], [5, 3])
    assert slots.tolist() == [0, 1, 2, 3, 4, 8, 9, 10] and slots.dtype == torch.int64
    assert cache.pages(0) == [0, 1] and cache.pages(1) == [2] and cache.num_free_pages == 3
    k01, v01 = tokens(8)
    cache.write(k01, v01, slots)
    slots = cache.append(0, 4)                                  # across a page boundary
    assert slots.tolist() == [5, 6, 7, 12] and cache.pages(0) == [0, 1, 3]
    k0b, v0b = tokens(4)
    cache.write(k0b, v0b, slots)
    assert cache.block_table([0, 1]).tolist() == [[0, 1, 3], [2, 0, 0]]
    assert cache.block_table([1], max_pages=4).tolist() == [[2, 0, 0, 0]]
    assert cache.cache_seqlens([1, 0]).tolist() == [3, 9]
    k, v = cache.gather([0, 1])
    assert torch.equal(k[0], torch.cat((k01[:5], k0b))) and torch.equal(v[1, :3], v01[5:])

    with pytest.raises(KV.KVCacheFullError, match="need 6 more pages of 4 slots, the pool has 2 free"):
        cache.append([5, 0], [20, 4])
    assert cache.num_free_pages == 2 and cache.sequences == [0, 1] and cache.seq_len(0) == 9

    cache.free(1)
    cache.trim(0, 4)                                            # 9 -> 5 tokens: page 3 emptied
    assert cache.seq_len(0) == 5 and cache.pages(0) == [0, 1] and cache.num_free_pages == 4
    slots = cache.append(7, 6)                                  # reuses the freed pages 2 and 3
    assert cache.pages(7) == [2, 3] and slots.tolist() == [8, 9, 10, 11, 12, 13]
    k7, v7 = tokens(6)
    cache.write(k7, v7, slots)
    k, v = cache.gather([0, 7])
    assert torch.equal(k[0, :5], k01[:5]) and torch.equal(v[1], v7) and (k[0, 5:] == 0).all()
    cache.trim(7, 6)
    assert cache.seq_len(7) == 0 and cache.pages(7) == [] and cache.num_free_pages == 4
    k, _ = cache.gather([7])
    assert k.shape == (1, 0, 2, 16)
    assert cache.append(0, 3).tolist() == [5, 6, 7]             # the trimmed sequence grows again


@pytest.mark.parametrize("kv_dtype", [torch.int8, E4M3], ids=["int8", "e4m3"])
def test_a_quantized_cache_gives_back_the_dequantized_codes_of_what_was_written(device, kv_dtype):
    cache, key, value = _sequences(device, page_size=3, lengths=[4, 7], kv_dtype=kv_dtype)
    assert cache.k_cache.dtype == kv_dtype and cache.k_scale.dtype == torch.float32
    k, v = cache.gather([0, 1], dtype=torch.float32)
    for got, x in ((k, key), (v, value)):
        codes, scale = ref.quantize_kv(x, kv_dtype)
        expected = ref.dequantize_kv(codes, scale, torch.float32)
        assert torch.equal(got[0, :4], expected[:4]) and torch.equal(got[1], expected[4:])
    assert cache.gather([1])[0].dtype == torch.bfloat16   # the model's dtype by default


# ---- merge_attn_states ----

@pytest.mark.parametrize("lane", LANES)
def test_an_empty_partial_contributes_nothing_and_two_make_zero(device, lane):
    g = gen(5)
    out_a = randn(1, 4, 2, 64, dtype=torch.bfloat16, device=device, generator=g)
    out_b = randn(1, 4, 2, 64, dtype=torch.bfloat16, device=device, generator=g)
    lse_a = torch.randn(1, 2, 4, generator=g).to(device)
    lse_b = torch.randn(1, 2, 4, generator=g).to(device)
    lse_a[0, :, 0] = -math.inf                  # a empty: b exactly, even with NaN in a's out
    out_a[0, 0] = math.nan
    lse_b[0, :, 1] = -math.inf                  # b empty
    lse_a[0, :, 2] = lse_b[0, :, 2] = -math.inf  # both empty
    lse_a[0, :, 3] = math.inf                   # FlashAttention 2's empty row
    with poisoned_outputs():
        out, lse = KV.merge_attn_states(out_a, lse_a, out_b, lse_b, lane=lane)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[0, 0], out_b[0, 0]) and torch.equal(lse[0, :, 0], lse_b[0, :, 0])
    assert torch.equal(out[0, 1], out_a[0, 1]) and torch.equal(lse[0, :, 1], lse_a[0, :, 1])
    assert (out[0, 2] == 0).all() and torch.isneginf(lse[0, :, 2]).all()
    assert torch.equal(out[0, 3], out_b[0, 3]) and torch.equal(lse[0, :, 3], lse_b[0, :, 3])


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("split", [0, 13, 30], ids=["A empty", "13 + 17 keys", "B empty"])
def test_merging_two_halves_is_attention_over_all_the_keys(device, lane, dtype, split):
    g = gen(6)
    q = randn(2, 7, 4, 64, dtype=dtype, device=device, generator=g)
    k = randn(2, 30, 2, 64, dtype=dtype, device=device, generator=g)
    v = randn(2, 30, 2, 64, dtype=dtype, device=device, generator=g)
    halves = [lanekit.flash_attn_func(q, k[:, part], v[:, part], return_attn_probs=True, lane="reference")[:2]
              for part in (slice(0, split), slice(split, 30))]
    (out_a, lse_a), (out_b, lse_b) = halves
    out, lse = KV.merge_attn_states(out_a, lse_a, out_b, lse_b, lane=lane)
    f64 = torch.float64
    full_out, full_lse = ref_attn.flash_attn(q.to(f64), k.to(f64), v.to(f64), softmax_scale=64 ** -0.5)
    assert_close(out, full_out, ATTENTION_FWD)
    assert_close(lse, full_lse, "lse")
    if split in (0, 30):   # one half empty: the other, exactly
        assert torch.equal(out, out_b if split == 0 else out_a)


# ---- bad input: a clear error naming the argument; nothing launched, nothing modified ----

def _write_args(device, kv_dtype=None):
    k_cache = torch.zeros(4, 3, 2, 16, dtype=kv_dtype or torch.bfloat16, device=device)
    args = dict(key=torch.ones(5, 2, 16, dtype=torch.bfloat16, device=device),
                value=torch.ones(5, 2, 16, dtype=torch.bfloat16, device=device),
                k_cache=k_cache, v_cache=k_cache.clone(),
                slot_mapping=torch.tensor([0, 1, -1, 7, 11], device=device))
    if kv_dtype is not None:
        args.update(k_cache_scale=torch.ones(4, 3, 2, device=device),
                    v_cache_scale=torch.ones(4, 3, 2, device=device))
    return args


@pytest.mark.parametrize("change, quantized, arg, error", [
    (dict(slot_mapping=torch.tensor([0, 1, -1, 7, 12])), False, "slot_mapping", ValueError),
    (dict(slot_mapping=torch.tensor([0, 1, -1, 7, 7])), False, "slot_mapping", ValueError),
    (dict(slot_mapping=torch.tensor([0., 1, 2, 3, 4])), False, "slot_mapping", TypeError),
    (dict(slot_mapping=torch.tensor([0, 1, 2])), False, "slot_mapping", ValueError),
    (dict(key=torch.ones(5, 2, 16, dtype=torch.float16)), False, "key", TypeError),
    (dict(key=torch.ones(5, 3, 16, dtype=torch.bfloat16)), False, "key", ValueError),
    (dict(value=torch.ones(4, 2, 16, dtype=torch.bfloat16)), False, "value", ValueError),
    (dict(v_cache=torch.zeros(4, 3, 2, 16, dtype=torch.float16)), False, "v_cache", TypeError),
    (dict(v_cache=torch.zeros(4, 2, 2, 16, dtype=torch.bfloat16)), False, "v_cache", ValueError),
    (dict(k_cache_scale=torch.ones(4, 3, 2)), False, "k_cache_scale", ValueError),
    (dict(k_scale=torch.ones(1)), False, "k_scale", ValueError),
    (dict(key=torch.ones(5, 2, 16, dtype=torch.bfloat16, device="meta")), False, "key", ValueError),
    (dict(v_cache_scale=None), True, "v_cache_scale", ValueError),
    (dict(k_cache_scale=torch.ones(4, 3, 1)), True, "k_cache_scale", ValueError),
    (dict(k_cache_scale=torch.ones(4, 3, 2, dtype=torch.float64)), True, "k_cache_scale", TypeError),
    (dict(k_scale=torch.tensor([1.0, 0.0])), True, "k_scale", ValueError),
    (dict(v_scale=torch.tensor([1.0, math.inf])), True, "v_scale", ValueError),
    (dict(v_scale=torch.ones(3)), True, "v_scale", ValueError),
], ids=["slot past the cache", "slot repeated", "float slots", "slots for 3 of 5 tokens",
        "key dtype not the cache's", "key heads", "value tokens", "v_cache dtype", "v_cache page_size",
        "scales for a values cache", "k_scale for a values cache", "key on another device",
        "codes without v scales", "k_cache_scale shape", "k_cache_scale dtype", "k_scale zero",
        "v_scale infinite", "v_scale shape"])
def test_bad_writes_name_the_argument_and_modify_nothing(device, change, quantized, arg, error, monkeypatch):
    monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")   # slot values checked on the host, before the write
    args = _write_args(device, torch.int8 if quantized else None)
    args.update({k: v.to(device) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v
                 for k, v in change.items()})
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    with pytest.raises(error, match=rf"^{arg}: "):
        KV.reshape_and_cache(**args, lane="triton")
    for k, v in before.items():
        assert torch.equal(args[k], v), k


@pytest.mark.parametrize("case, arg", [
    ("v_cache is k_cache", "v_cache"), ("one tensor for both scales", "v_cache_scale"),
    ("an expanded cache", "k_cache"), ("key inside k_cache", "k_cache"),
])
def test_writes_into_memory_written_twice_or_read_are_refused_and_modify_nothing(device, case, arg):
    # each would write an element twice (the values over the keys, or the v scales over the k
    # scales), or overwrite the key being read
    args = _write_args(device, torch.int8 if "scales" in case else None)
    if case == "v_cache is k_cache":
        args["v_cache"] = args["k_cache"]
    elif case == "one tensor for both scales":
        args["v_cache_scale"] = args["k_cache_scale"]
    elif case == "an expanded cache":
        args["k_cache"] = args["k_cache"][:1].expand(4, 3, 2, 16)
    else:
        args["key"] = args["k_cache"].view(12, 2, 16)[7:]
    before = {k: v.clone() for k, v in args.items()}
    for lane in LANES:
        with pytest.raises(ValueError, match=rf"^{arg}: expected"):
            KV.reshape_and_cache(**args, lane=lane)
        for k, v in before.items():
            assert torch.equal(args[k], v), k


def _gather_args(device):
    k_cache = torch.zeros(4, 3, 2, 16, dtype=torch.bfloat16, device=device)
    return dict(k_cache=k_cache, v_cache=k_cache.clone(),
                block_table=torch.tensor([[0, 2], [3, -1]], dtype=torch.int32, device=device),
                cache_seqlens=torch.tensor([5, 2], dtype=torch.int32, device=device))


@pytest.mark.parametrize("change, arg, error", [
    (dict(block_table=torch.tensor([[0, 4], [3, -1]], dtype=torch.int32)), "block_table", ValueError),
    (dict(block_table=torch.tensor([[0, 2], [-1, 1]], dtype=torch.int32)), "block_table", ValueError),
    (dict(block_table=torch.tensor([[0, 2], [3, 1]])), "block_table", TypeError),
    (dict(cache_seqlens=torch.tensor([7, 2], dtype=torch.int32)), "cache_seqlens", ValueError),
    (dict(cache_seqlens=torch.tensor([5, -1], dtype=torch.int32)), "cache_seqlens", ValueError),
    (dict(cache_seqlens=torch.tensor([5], dtype=torch.int32)), "cache_seqlens", ValueError),
    (dict(max_seqlen=4), "max_seqlen", ValueError),
    (dict(dtype=torch.int8), "dtype", TypeError),
    (dict(k_cache_scale=torch.ones(4, 3, 2)), "k_cache_scale", ValueError),
    (dict(k_cache=torch.zeros(4, 3, 2, 16, dtype=torch.int8), v_cache=torch.zeros(4, 3, 2, 16, dtype=torch.int8)),
     "k_cache_scale", ValueError),
], ids=["page past num_blocks", "negative page in use", "int64 table", "length past the row's pages",
        "negative length", "lengths for 1 of 2 rows", "max_seqlen too small", "int8 dtype",
        "scales for a values cache", "codes without scales"])
def test_bad_gathers_name_the_argument(device, change, arg, error, monkeypatch):
    monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")   # lengths and pages checked on the host
    args = _gather_args(device)
    args.update({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in change.items()})
    with pytest.raises(error, match=rf"^{arg}: "):
        KV.gather_cache(**args, lane="triton")


def _out(x):
    return x[None, :, None]          # (B, Sq, H, D) = (1, 4, 1, 8)


def _lse(x):
    return x[None, None, :, 0]       # (B, H, Sq) = (1, 1, 4)


def _partials(x, **change):
    parts = dict(out_a=_out(x), lse_a=_lse(x), out_b=_out(x), lse_b=_lse(x))
    parts.update(change)
    return parts["out_a"], parts["lse_a"], parts["out_b"], parts["lse_b"]


@pytest.mark.parametrize("call, arg, error", [
    (lambda x: KV.quantize_kv(x, torch.float16), "dtype", TypeError),
    (lambda x: KV.quantize_kv(x.int(), torch.int8), "x", TypeError),
    (lambda x: KV.quantize_kv(x[:, :0], torch.int8), "x", ValueError),
    (lambda x: KV.quantize_kv(x, torch.int8, scale=-torch.ones(4, device=x.device)), "scale", ValueError),
    (lambda x: KV.quantize_kv(x, torch.int8, scale=torch.ones(3, device=x.device)), "scale", ValueError),
    (lambda x: KV.dequantize_kv(x, torch.ones(4, device=x.device)), "codes", TypeError),
    (lambda x: KV.dequantize_kv(x.to(torch.int8), torch.ones(2, device=x.device)), "scale", ValueError),
    (lambda x: KV.dequantize_kv(x.to(torch.int8), torch.ones(4, device=x.device), torch.int8), "dtype", TypeError),
    (lambda x: KV.merge_attn_states(*_partials(x, lse_b=_lse(x).bfloat16())), "lse_b", TypeError),
    (lambda x: KV.merge_attn_states(*_partials(x, lse_a=_lse(x)[..., :3])), "lse_a", ValueError),
    (lambda x: KV.merge_attn_states(*_partials(x, out_b=_out(x).half())), "out_b", TypeError),
], ids=["quantize to fp16", "int x", "D 0", "negative scale", "scale shape", "float codes",
        "dequantize scale shape", "dequantize to int8", "bf16 lse", "lse shape", "out_b dtype"])
def test_bad_standalone_calls_name_the_argument(device, call, arg, error):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(error, match=rf"^{arg}: "):
        call(x)


def test_a_sequence_id_is_an_int_str_bytes_or_tuple_and_numpy_or_tensor_ints_count_as_ints(device):
    cache = KV.PagedKVCache(8, 2, 1, 16, device=device)
    assert cache.append(("req", 2), 3).tolist() == [0, 1, 2]        # a tuple is one id: a list holds several
    assert cache.sequences == [("req", 2)] and cache.seq_len(("req", 2)) == 3
    assert cache.append([("req", 2), "x"], [np.int64(1), 2]).tolist() == [3, 4, 5]   # a list holds several
    assert cache.append(np.int64(7), 1).tolist() == [6]
    assert cache.append(torch.tensor([7]), [1]).tolist() == [7]     # the same sequence 7
    assert cache.sequences == [("req", 2), "x", 7] and cache.seq_len(7) == 2
    assert cache.cache_seqlens(torch.tensor(7)).tolist() == [2] and cache.cache_seqlens(range(0)).tolist() == []
    assert cache.cache_seqlens(s for s in ("x", 7)).tolist() == [2, 2]   # any other iterable holds several


def test_bad_paged_kv_cache_calls_name_the_argument_and_change_nothing(device):
    with pytest.raises(ValueError, match="^page_size: "):
        KV.PagedKVCache(4, 0, 2, 16, device=device)
    with pytest.raises(TypeError, match="^kv_dtype: "):
        KV.PagedKVCache(4, 2, 2, 16, device=device, kv_dtype=torch.float16)
    cache = KV.PagedKVCache.allocate(4, 2, 2, 16, torch.bfloat16, device)
    cache.append([0], [3])
    with pytest.raises(ValueError, match="^num_tokens: "):
        cache.append([1, 2], [3])
    with pytest.raises(ValueError, match="^seq_ids: "):
        cache.append([1, 1], [1, 1])
    with pytest.raises(TypeError, match="^num_tokens: "):
        cache.append(1, 2.0)
    with pytest.raises(TypeError, match="^seq_ids: "):
        cache.append([[1]], [2])
    with pytest.raises(ValueError, match="^lane: "):
        KV.PagedKVCache(4, 2, 2, 16, device=device, lane="bogus")
    with pytest.raises(ValueError, match="^n: "):
        cache.trim(0, 4)
    with pytest.raises(ValueError, match="^seq_id: "):
        cache.free(9)
    with pytest.raises(ValueError, match="^max_pages: "):
        cache.block_table([0], max_pages=1)
    with pytest.raises(TypeError, match="^key: "):   # the model dtype is bf16
        cache.write(torch.ones(3, 2, 16, device=device), torch.ones(3, 2, 16, device=device),
                    torch.tensor([0, 1, 2], device=device))
    assert cache.sequences == [0] and cache.seq_len(0) == 3 and cache.num_free_pages == 2
    assert (cache.k_cache == 0).all()


@pytest.mark.parametrize("bad", [torch.tensor(1.0), np.float64(2.0), 2.0, True, np.bool_(False), None,
                                 torch.tensor(1, dtype=torch.bool), ("req", 1.5), [[1]], object()],
                         ids=["float tensor", "numpy float", "float", "bool", "numpy bool", "None",
                              "bool tensor", "tuple holding a float", "list in a list", "object"])
def test_a_sequence_id_that_is_not_an_int_str_bytes_or_tuple_of_them_is_a_type_error(device, bad):
    # a float tensor would be keyed by identity (its pages never reachable again), np.float64(2.0)
    # would be the id 2
    cache = KV.PagedKVCache(8, 2, 1, 16, device=device)
    cache.append(2, 3)
    with pytest.raises(TypeError, match="^seq_ids: expected ids that are ints, str, bytes or tuples of them"):
        cache.append(bad, 1)
    with pytest.raises(TypeError, match="^seq_id: "):
        cache.free(bad)
    assert cache.sequences == [2] and cache.seq_len(2) == 3 and cache.num_free_pages == 6
    assert cache.append(b"r", 1).tolist() == [4] and cache.seq_len(np.int64(2)) == cache.seq_len(torch.tensor(2)) == 3


def _filled(cache, seq_ids, lengths, value):
    """Append to the sequences and write ``value`` into every new slot; returns the slot_mapping."""
    slots = cache.append(seq_ids, lengths)
    x = torch.full((slots.shape[0], 2, 16), float(value), dtype=cache.dtype, device=cache.device)
    cache.write(x, x, slots)
    return slots


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("given_back", ["free", "trim"])
def test_writing_slots_given_back_since_is_refused_and_changes_nothing(device, lane, given_back):
    # after free(0) and append(1, 4) the pool hands sequence 0's pages to sequence 1: sequence 0's
    # old slot_mapping names sequence 1's slots now, and must not overwrite them
    cache = KV.PagedKVCache(4, 2, 2, 16, torch.float32, device, lane=lane)
    old = _filled(cache, 0, 3, 1.0)
    if given_back == "free":
        cache.free(0)
        assert _filled(cache, 1, 4, 2.0).tolist()[:3] == old.tolist()
        holder, expected = 1, torch.full((1, 4, 2, 16), 2.0, device=device)
    else:
        cache.trim(0, 2)
        assert _filled(cache, 0, 2, 3.0).tolist() == old.tolist()[1:]
        holder, expected = 0, torch.tensor([1.0, 3.0, 3.0], device=device)[None, :, None, None].expand(1, 3, 2, 16)
    pool = (cache.k_cache.clone(), cache.v_cache.clone())
    x = torch.full((3, 2, 16), 9.0, device=device)

    with pytest.raises(ValueError, match="^slot_mapping: expected slots that the sequences hold now, got the "
                                         "result of an append whose slots were given back since"):
        cache.write(x, x, old)
    with pytest.raises(ValueError, match="^slot_mapping: expected the tensor this cache's append"):
        cache.write(x, x, old.clone())          # a copy of the values cannot say whose they are either
    assert torch.equal(cache.k_cache, pool[0]) and torch.equal(cache.v_cache, pool[1])
    assert torch.equal(cache.gather(holder)[0], expected)


def test_write_takes_slices_of_what_append_returned_but_not_copies_or_changed_tensors(device):
    cache = KV.PagedKVCache(8, 2, 2, 16, torch.float32, device, lane="reference")
    slots = cache.append([0, 1], [3, 2])
    x = randn(5, 2, 16, dtype=torch.float32, device=device, generator=gen(3))
    cache.write(x[:2], x[:2], slots[:2])        # a prefill in chunks
    cache.write(x[2:], x[2:], slots[2:])
    k, v = cache.gather([0, 1])
    assert torch.equal(k[0], x[:3]) and torch.equal(v[1, :2], x[3:])
    for other in (slots.clone(), torch.cat((slots[:2], slots[2:])), slots.to(torch.int32)):
        with pytest.raises(ValueError, match="^slot_mapping: expected the tensor this cache's append"):
            cache.write(x, x, other)
    slots[0] = slots[4]                         # changed in place: its values are no longer the cache's
    with pytest.raises(ValueError, match="^slot_mapping: expected the tensor this cache's append"):
        cache.write(x, x, slots)
    with pytest.raises(ValueError, match="^slot_mapping: expected the tensor this cache's append"):
        KV.PagedKVCache(8, 2, 2, 16, torch.float32, device).write(x, x, cache.append(2, 5))   # another cache's
    copy = pickle.loads(pickle.dumps(cache))    # a copy keeps the sequences, not the tensors' identities
    assert copy.sequences == [0, 1, 2] and copy.seq_len(2) == 5
    with pytest.raises(ValueError, match="^slot_mapping: expected the tensor this cache's append"):
        copy.write(x[:2], x[:2], cache.append(3, 2))
    copy.write(x[:2], x[:2], copy.append(3, 2))


def test_numpy_and_0d_tensor_ints_are_ints_and_floats_are_type_errors(device, monkeypatch):
    monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")   # max_seqlen against the lengths: read back in the debug mode
    cache = KV.PagedKVCache(np.int64(8), torch.tensor(2), 2, 16, torch.float32, device)
    slots = cache.append([0, 1], [np.int32(3), torch.tensor(2)])
    cache.write(torch.ones(5, 2, 16, device=device), torch.ones(5, 2, 16, device=device), slots)
    table, lens = cache.block_table([0, 1], max_pages=np.int64(3)), cache.cache_seqlens([0, 1])
    for max_seqlen in (np.int64(6), torch.tensor(6), 6):
        k, _ = KV.gather_cache(cache.k_cache, cache.v_cache, table, lens, max_seqlen=max_seqlen)
        assert k.shape == (2, 6, 2, 16) and (k[0, :3] == 1).all() and (k[0, 3:] == 0).all()
    with pytest.raises(ValueError, match=r"^max_seqlen: expected an int >= 3 \(the longest sequence\), got 2$"):
        KV.gather_cache(cache.k_cache, cache.v_cache, table, lens, max_seqlen=np.int64(2))
    for call, arg in ((lambda: KV.gather_cache(cache.k_cache, cache.v_cache, table, lens, max_seqlen=6.0), "max_seqlen"),
                      (lambda: cache.trim(0, 1.0), "n"), (lambda: cache.trim(0, True), "n"),
                      (lambda: cache.block_table([0], max_pages=2.0), "max_pages"),
                      (lambda: cache.append(0, np.float64(1.0)), "num_tokens"),
                      (lambda: KV.PagedKVCache(4.0, 2, 2, 16, device=device), "num_blocks")):
        with pytest.raises(TypeError, match=f"^{arg}: expected an int"):
            call()
    cache.trim(np.int64(0), np.int64(1))
    assert cache.seq_len(0) == 2 and cache.sequences == [0, 1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_a_cache_on_a_device_this_machine_lacks_is_a_clear_error():
    with pytest.raises(ValueError, match=r"^device: expected a device this machine has, got 'cuda' "
                                         r"\(torch\.cuda\.is_available\(\) is False"):
        KV.PagedKVCache(4, 2, 2, 16, device="cuda")
    with pytest.raises(ValueError, match="^device: expected a device name"):
        KV.PagedKVCache(4, 2, 2, 16, device="gpu")
    with pytest.raises(TypeError, match="^device: expected a str or torch.device, got int"):
        KV.PagedKVCache(4, 2, 2, 16, device=0)


@pytest.mark.parametrize("lane", LANES)
def test_a_cache_that_requires_grad_is_not_written_in_grad_mode(device, lane):
    # the write is not differentiable: autograd would silently miss it (or, for a leaf, PyTorch
    # refuses in-place writes); refused before anything is written, as under no_grad it goes
    args = _write_args(device, None)
    args["k_cache"] = args["k_cache"].float().requires_grad_()
    args["v_cache"] = args["v_cache"].float()
    args["key"], args["value"] = args["key"].float(), args["value"].float()
    before = args["k_cache"].detach().clone()
    with pytest.raises(ValueError, match="^k_cache: expected a tensor that does not require grad"):
        KV.reshape_and_cache(**args, lane=lane)
    assert torch.equal(args["k_cache"].detach(), before)
    with torch.no_grad():
        KV.reshape_and_cache(**args, lane=lane)
    assert not torch.equal(args["k_cache"].detach(), before)


# ---- GPU only ----

def test_write_gather_and_merge_under_torch_compile(device):
    """The custom ops trace (the caches are mutated in the graph); the validation's reads of slot
    and table values are graph breaks, so not fullgraph."""
    cache = KV.PagedKVCache(8, 16, 2, 64, torch.bfloat16, device, lane="triton")
    slots = cache.append([0, 1], [20, 5])
    table, lens = cache.block_table([0, 1]), cache.cache_seqlens([0, 1])
    key = randn(25, 2, 64, dtype=torch.bfloat16, device=device, generator=gen(7))

    def step(key, k_cache, v_cache):
        KV.reshape_and_cache(key, key * 2, k_cache, v_cache, slots, lane="triton")
        k, v = KV.gather_cache(k_cache, v_cache, table, lens, max_seqlen=20, lane="triton")
        lse = torch.zeros(2, 2, 20, device=key.device)
        return KV.merge_attn_states(k, lse, v, lse, lane="triton")[0]

    eager_caches = (cache.k_cache.clone(), cache.v_cache.clone())
    eager = step(key, *eager_caches)
    compiled = torch.compile(step)(key, cache.k_cache, cache.v_cache)
    assert torch.equal(eager, compiled)
    assert torch.equal(cache.k_cache, eager_caches[0]) and torch.equal(cache.v_cache, eager_caches[1])
    assert torch.equal(compiled[1, :5], (key[20:] * 1.5).to(torch.bfloat16))


@pytest.mark.bigmem
@pytest.mark.skipif(not torch.cuda.is_available(), reason="more than 2^31 elements needs GPU memory")
def test_a_cache_of_more_than_2_to_the_31_elements(device):
    """int64 offsets: the last slot of a 2^31 + 16384-element cache is written and read back."""
    page_size, H, D = 16, 8, 128
    blocks = 2 ** 31 // (page_size * H * D) + 1
    k_cache = torch.zeros(blocks, page_size, H, D, dtype=torch.bfloat16, device=device)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(2, H, D, dtype=torch.bfloat16, device=device)
    last = blocks * page_size - 1
    KV.reshape_and_cache(key, key, k_cache, v_cache, torch.tensor([last, 0], device=device))
    table = torch.tensor([[blocks - 1]], dtype=torch.int32, device=device)
    k, v = KV.gather_cache(k_cache, v_cache, table, torch.tensor([page_size], dtype=torch.int32, device=device))
    assert torch.equal(k[0, -1], key[0]) and torch.equal(v[0, -1], key[0])
    assert torch.equal(k_cache[0, 0], key[1]) and (k[0, :-1] == 0).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device syncs are a GPU's")
def test_a_write_through_the_cache_reads_nothing_back_from_the_device(device):
    cache = KV.PagedKVCache(64, 16, 2, 64, torch.bfloat16, device)
    slots = cache.append([0, 1], [20, 5])
    key = randn(25, 2, 64, dtype=torch.bfloat16, device=device, generator=gen(9))
    cache.write(key, key, slots)               # compiles the kernel
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cache.write(key * 2, key, slots)        # the slots are checked on the host, from append's record
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(cache.gather([0])[0][0], (key[:20] * 2).to(torch.bfloat16))


# ---- the NaN-visible rule (docs/semantics.md): a row holding a NaN or inf stays visible ----

def _hostile_rows(device, H=2, D=16):
    """x (4, H, D) bf16: token 0 finite; token 1 a NaN in head 0; token 2 +inf in head 1;
    token 3 -inf in head 0."""
    x = randn(4, H, D, dtype=torch.bfloat16, device=device, generator=gen(37))
    x[1, 0, 3], x[2, 1, 7], x[3, 0, D - 1] = float("nan"), float("inf"), float("-inf")
    return x


def _expect_visible(codes, scale, dtype):
    """Rows (1, 0), (2, 1), (3, 0) non-finite: NaN scale, codes 0x7F (e4m3) or 0 (int8);
    the rest finite."""
    bad = torch.zeros(scale.shape, dtype=torch.bool)
    bad[1, 0] = bad[2, 1] = bad[3, 0] = True
    s = scale.cpu()
    assert torch.equal(torch.isnan(s), bad) and torch.isfinite(s[~bad]).all()
    c = codes.cpu()
    want = 0x7F if dtype == E4M3 else 0
    assert (bits(c)[bad] == want).all()
    if dtype == E4M3:
        assert not (bits(c)[~bad] == 0x7F).any()


@pytest.mark.parametrize("dtype", [torch.int8, E4M3])
def test_quantize_kv_a_row_with_a_nan_or_inf_gets_a_nan_scale_and_nan_codes_on_both_lanes(device, dtype):
    x = _hostile_rows(device)
    codes, scale = KV.quantize_kv(x, dtype, lane="triton")
    rc, rs = KV.quantize_kv(x, dtype, lane="reference")
    assert_same_bits(codes, rc, "codes")
    assert_same_bits(scale, rs, "scale")
    _expect_visible(codes, scale, dtype)
    for lane in LANES:     # and it reads back as NaN, the rest as before
        y = KV.dequantize_kv(codes, scale, lane=lane).cpu()
        assert torch.equal(torch.isnan(y).any(-1), torch.isnan(scale.cpu()))
    # a given scale: the NaN value alone is NaN (e4m3) or 0 (int8); +-inf saturates
    given = torch.full((4, 2), 0.01, device=device)
    codes, _ = KV.quantize_kv(x, dtype, given, lane="triton")
    rc, _ = KV.quantize_kv(x, dtype, given, lane="reference")
    assert_same_bits(codes, rc, "codes with a given scale")
    c = codes.cpu()
    qmax = 127 if dtype == torch.int8 else 448.0
    assert c[2, 1, 7].float() == qmax and c[3, 0, 15].float() == (-128 if dtype == torch.int8 else -qmax)
    assert bits(c)[1, 0, 3] == (0x7F if dtype == E4M3 else 0)


@pytest.mark.parametrize("dtype", [torch.int8, E4M3])
def test_reshape_and_cache_and_paged_write_keep_a_nan_row_visible_on_both_lanes(device, dtype):
    x = _hostile_rows(device)
    written = {}
    for lane in LANES:
        kc = torch.zeros(3, 4, 2, 16, dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        ks = torch.zeros(3, 4, 2, device=device)
        vs = torch.zeros_like(ks)
        slots = torch.tensor([5, 0, 11, 2], device=device)
        KV.reshape_and_cache(x, x.flip(0), kc, vc, slots, k_cache_scale=ks, v_cache_scale=vs, lane=lane)
        written[lane] = (kc, vc, ks, vs)
        rows_k = kc.view(12, 2, 16)[slots.cpu()]
        _expect_visible(rows_k, ks.view(12, 2)[slots.cpu()], dtype)
    for t, r, what in zip(written["triton"], written["reference"], ("k_cache", "v_cache", "k_scale", "v_scale")):
        assert_same_bits(t, r, what)
    cache = KV.PagedKVCache(4, 4, 2, 16, device=device, kv_dtype=dtype)
    slots = cache.append([0, 1], [3, 1])
    cache.write(x, x, slots)
    k, v = cache.gather([0, 1])
    assert torch.isnan(k[0, 1, 0]).all() and torch.isnan(k[0, 2, 1]).all() and torch.isnan(k[1, 0, 0]).all()
    assert torch.isfinite(k[0, 0]).all() and torch.isfinite(k[0, 1, 1]).all()
# ---- index values not read back (DESIGN.md's hot path): masked in the kernels, recorded ----

@pytest.fixture
def unchecked(monkeypatch):
    """Index values left to the kernels (LANEKIT_CHECK_INDICES unset); the error flags start clear."""
    from lanekit.runtime import errors

    monkeypatch.delenv("LANEKIT_CHECK_INDICES", raising=False)
    try:
        errors.check_errors()
    except ValueError:
        pass
    return errors


def test_a_slot_past_the_cache_is_skipped_and_recorded_not_written(device, unchecked):
    args = _write_args(device)
    args["slot_mapping"] = torch.tensor([0, 1, -1, 12, 11], device=device)   # 12 = num_blocks * page_size
    KV.reshape_and_cache(**args, lane="triton")
    with pytest.raises(ValueError, match="slot at or past num_blocks"):
        lanekit.check_errors()
    lanekit.check_errors()                                           # cleared: nothing more
    want = torch.zeros(12, 2, 16, dtype=torch.bfloat16, device=device)
    want[[0, 1, 11]] = 1
    assert torch.equal(args["k_cache"].view(12, 2, 16), want)       # tokens 0, 1 and 4 only


def test_gather_with_max_seqlen_reads_no_page_out_of_range_and_records_it(device, unchecked):
    args = _gather_args(device)
    args["k_cache"].copy_(torch.arange(1, 5, device=device, dtype=torch.bfloat16)[:, None, None, None].expand(4, 3, 2, 16))
    args["v_cache"].copy_(args["k_cache"])
    args["block_table"] = torch.tensor([[0, 9], [3, -1]], dtype=torch.int32, device=device)   # page 9 is past the pool
    k, v = KV.gather_cache(**args, max_seqlen=6, lane="triton")
    with pytest.raises(ValueError, match="gather_cache: a cache_seqlens value outside"):
        lanekit.check_errors()
    assert torch.equal(k[0, :3], torch.ones_like(k[0, :3]))             # page 0 (value 1)
    assert torch.equal(k[0, 3:], torch.zeros_like(k[0, 3:]))            # page 9 never read: zeros
    assert torch.equal(k[1, :2], torch.full_like(k[1, :2], 4))          # page 3 (value 4)
    assert torch.equal(k[1, 2:], torch.zeros_like(k[1, 2:]))
    args["block_table"] = torch.tensor([[0, 2], [3, -1]], dtype=torch.int32, device=device)
    args["cache_seqlens"] = torch.tensor([7, -2], dtype=torch.int32, device=device)          # past the row, negative
    k, _ = KV.gather_cache(**args, max_seqlen=6, lane="triton")
    with pytest.raises(ValueError, match="gather_cache"):
        lanekit.check_errors()
    assert torch.equal(k, torch.zeros_like(k))                           # neither sequence read


def test_valid_calls_record_nothing(device, unchecked):
    args = _write_args(device)
    KV.reshape_and_cache(**args, lane="triton")
    KV.gather_cache(**_gather_args(device), max_seqlen=6, lane="triton")
    lanekit.check_errors()                                              # no error recorded
