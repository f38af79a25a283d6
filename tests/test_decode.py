"""Serving paths: flash_attn_varlen_func (packed batches, paged K/V) and flash_attn_with_kvcache
(decode over a contiguous or paged cache, split-KV): the issue's cases against the oracle, outputs
poisoned with NaN, pages and keys that must not be read filled with NaN, and bad input."""

import importlib
import math

import numpy as np
import pytest
import torch

import lanekit
from lanekit.attention.registry import ATTENTION_BWD, ATTENTION_FWD
from lanekit.reference import attention as ref
from lanekit.testing import assert_close, poisoned_outputs, randn, ulp, upcast

LANES = ["triton", "reference"]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def cu(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


# ---- flash_attn_varlen_func ----

def varlen_inputs(device, lq, lk, Hq=9, Hkv=3, D=64, dtype=torch.float16, seed=0):
    g = gen(seed)
    q = randn(sum(lq), Hq, D, dtype=dtype, device=device, generator=g)
    k = randn(sum(lk), Hkv, D, dtype=dtype, device=device, generator=g)
    v = randn(sum(lk), Hkv, D, dtype=dtype, device=device, generator=g)
    return q, k, v, cu(lq, device), cu(lk, device)


def oracle_varlen(q, k, v, cq, ck, lq, lk, causal=True):
    return ref.flash_attn_varlen(upcast(q), upcast(k), upcast(v), cu_seqlens_q=cq.cpu(), cu_seqlens_k=ck.cpu(),
                                 max_seqlen_q=max(lq), max_seqlen_k=max(lk), softmax_scale=q.shape[-1] ** -0.5,
                                 window_size=(-1, 0 if causal else -1))


@pytest.mark.parametrize("lane", LANES)
def test_varlen_gqa_9_3_zero_length_sequences_and_fewer_tokens_than_sequences(device, lane):
    # query lengths [0, 1, 0, 1], key lengths [0, 3, 0, 5]: 2 query tokens for 4 sequences
    lq, lk = [0, 1, 0, 1], [0, 3, 0, 5]
    q, k, v, cq, ck = varlen_inputs(device, lq, lk)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with poisoned_outputs():
        out, lse, _ = lanekit.flash_attn_varlen_func(*leaves, cq, ck, max(lq), max(lk), causal=True,
                                                     return_attn_probs=True, lane=lane)
    ref_out, ref_lse = oracle_varlen(q, k, v, cq, ck, lq, lk)
    assert out.shape == (2, 9, 64) and lse.shape == (9, 2)
    assert_close(out, ref_out, ATTENTION_FWD)
    assert_close(lse, ref_lse, "lse")
    dout = randn(*out.shape, dtype=out.dtype, device=device, generator=gen(1))
    with poisoned_outputs():
        grads = torch.autograd.grad(out, leaves, dout)
    ref_grads = ref.flash_attn_varlen_backward(
        upcast(dout), upcast(q), upcast(k), upcast(v), cu_seqlens_q=cq.cpu(), cu_seqlens_k=ck.cpu(),
        max_seqlen_q=1, max_seqlen_k=5, softmax_scale=64 ** -0.5, window_size=(-1, 0))
    for got, want in zip(grads, ref_grads):
        assert torch.isfinite(got).all()
        assert_close(got, want, ATTENTION_BWD)


def test_varlen_each_sequence_equals_flash_attn_func_on_it_alone(device):
    lq, lk = [33, 1, 70], [40, 0, 70]
    q, k, v, cq, ck = varlen_inputs(device, lq, lk, Hq=4, Hkv=2, D=80, dtype=torch.bfloat16, seed=3)
    with poisoned_outputs():
        out = lanekit.flash_attn_varlen_func(q, k, v, cq, ck, 70, 70, causal=True, lane="triton")
    qs, ks = cq.tolist(), ck.tolist()
    for b in range(3):
        if lq[b] == 0:
            continue
        alone = lanekit.flash_attn_func(q[None, qs[b]:qs[b + 1]], k[None, ks[b]:ks[b + 1]],
                                        v[None, ks[b]:ks[b + 1]], causal=True, lane="triton")[0]
        assert torch.equal(out[qs[b]:qs[b + 1]], alone), f"sequence {b}"


def test_varlen_zero_length_sequences_get_zero_gradients(device):
    lq, lk = [3, 0, 4], [0, 6, 4]   # sequence 0: queries with no key; sequence 1: keys with no query
    q, k, v, cq, ck = varlen_inputs(device, lq, lk, Hq=2, Hkv=2, D=32, seed=5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with poisoned_outputs():
        out = lanekit.flash_attn_varlen_func(*leaves, cq, ck, 4, 6, lane="triton")
        dq, dk, dv = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert (out[:3] == 0).all() and (dq[:3] == 0).all()
    assert (dk[:6] == 0).all() and (dv[:6] == 0).all()
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all()


def test_varlen_paged_keys_equal_packed_keys(device):
    lq, lk = [2, 5], [19, 5]
    q, k, v, cq, ck = varlen_inputs(device, lq, lk, Hq=4, Hkv=2, D=64, seed=7)
    page_size, max_pages = 4, 5
    k_cache = torch.full((12, page_size, 2, 64), math.nan, dtype=k.dtype, device=device)  # unowned: NaN
    v_cache = torch.full_like(k_cache, math.nan)
    table = torch.tensor([[7, 2, 9, 0, 4], [11, 5, 1, 1, 1]], dtype=torch.int32, device=device)
    for b, n in enumerate(lk):
        for t in range(n):
            page, row = table[b, t // page_size], t % page_size
            k_cache[page, row] = k[ck[b] + t]
            v_cache[page, row] = v[ck[b] + t]
    with poisoned_outputs():
        paged = lanekit.flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, 5, 19, causal=True, block_table=table,
                                               lane="triton")
    packed = lanekit.flash_attn_varlen_func(q, k, v, cq, ck, 5, 19, causal=True, lane="triton")
    assert torch.isfinite(paged).all()
    assert torch.equal(paged, packed)


# ---- flash_attn_with_kvcache ----

def decode_inputs(device, B=1, Sk=4096, Hq=16, Hkv=8, D=128, capacity=None, seed=0):
    g = gen(seed)
    capacity = capacity or Sk
    q = randn(B, 1, Hq, D, dtype=torch.bfloat16, device=device, generator=g)
    k_cache = randn(B, capacity, Hkv, D, dtype=torch.bfloat16, device=device, generator=g)
    v_cache = randn(B, capacity, Hkv, D, dtype=torch.bfloat16, device=device, generator=g)
    return q, k_cache, v_cache, torch.full((B,), Sk, dtype=torch.int32, device=device)


def test_output_does_not_depend_on_num_splits_and_lse_is_the_unsplit_one(device):
    # 4096 keys on a GPU; 1024 interpreted (the suite's slowest test at 4096: 290 s on 2 cores), still
    # several key blocks a split at 16, and splits of one block or none at 32
    q, kc, vc, seqlens = decode_inputs(device, Sk=4096 if device == "cuda" else 1024)
    runs = {}
    for splits in (1, 16, 32):
        with poisoned_outputs():
            runs[splits] = lanekit.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=splits,
                                                           return_softmax_lse=True, lane="triton")
    out1, lse1 = runs[1]
    assert lse1.shape == (1, 16, 1)
    ref_out, ref_lse = ref.flash_attn(upcast(q), upcast(kc), upcast(vc), softmax_scale=128 ** -0.5)
    for splits, (out, lse) in runs.items():
        assert_close(out, ref_out, ATTENTION_FWD)
        assert_close(lse, ref_lse, "lse")
        # beyond rounding nothing changes: two bf16 steps at the output's magnitude at most
        assert (out.float() - out1.float()).abs().max() <= 2 * ulp(torch.bfloat16, out1.float().abs().max().item())


@pytest.mark.parametrize("D,capacity", [(64, 1000), (128, 9000)])   # D=128: the H200's short/long rows
def test_output_does_not_depend_on_the_allocated_capacity_given_max_seqlen_k(device, D, capacity):
    # max_seqlen_k picks the decode tile (else the capacity does: then the two differ by rounding)
    q, kc, vc, seqlens = decode_inputs(device, B=2, Sk=300, Hq=4, Hkv=2, D=D, capacity=300, seed=1)
    big_k = torch.full((2, capacity, 2, D), math.nan, dtype=kc.dtype, device=device)   # past the end: NaN
    big_v = torch.full_like(big_k, math.nan)
    big_k[:, :300], big_v[:, :300] = kc, vc
    for splits in (1, 3):
        with poisoned_outputs():
            small = lanekit.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=splits,
                                                    max_seqlen_k=300, lane="triton")
            big = lanekit.flash_attn_with_kvcache(q, big_k, big_v, cache_seqlens=seqlens, num_splits=splits,
                                                  max_seqlen_k=300, lane="triton")
            unbounded = lanekit.flash_attn_with_kvcache(q, big_k, big_v, cache_seqlens=seqlens, num_splits=splits,
                                                        lane="triton")
        assert torch.equal(small, big)
        assert_close(unbounded, small, ATTENTION_FWD)


def test_split_count_follows_max_seqlen_k_else_the_capacity_never_a_length_read_back(device, monkeypatch):
    # (DESIGN.md's hot path: the lengths live on the device and are not read back per call)
    from lanekit.attention import api_kvcache as api

    seen = []
    heuristic = api.num_splits_heuristic
    monkeypatch.setattr(api, "num_splits_heuristic", lambda *a, **kw: seen.append(a) or heuristic(*a, **kw))
    picks = {}
    for capacity in (300, 1000):   # same used length (300 + 1 appended), two allocated capacities
        q, kc, vc, seqlens = decode_inputs(device, B=1, Sk=300, Hq=2, Hkv=1, D=64, capacity=capacity)
        new = torch.zeros(1, 1, 1, 64, dtype=q.dtype, device=device)
        seqlens = torch.full_like(seqlens, 299)
        lanekit.flash_attn_with_kvcache(q, kc, vc, new, new, cache_seqlens=seqlens, max_seqlen_k=300, lane="triton")
        picks[capacity] = seen[-1]
        lanekit.flash_attn_with_kvcache(q, kc, vc, new, new, cache_seqlens=seqlens, lane="triton")
        assert seen[-1][1] == capacity                  # no bound given: the capacity
    assert picks[300] == picks[1000]
    assert picks[300][1] == 300                         # the caller's bound, the appended key included
    one = api.kvcache_num_splits(q, kc, vc, max_seqlen_k=4096)
    assert one > 1                                      # one program per row: split to fill the SMs
    many = torch.zeros(512, 1, 2, 64, dtype=torch.bfloat16, device=device)
    wide = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16, device=device).expand(512, 300, 1, 64)
    assert api.kvcache_num_splits(many, wide, wide, max_seqlen_k=300) == 1    # the batch fills them
    assert api.kvcache_num_splits(q, kc, vc, max_seqlen_k=16) == 1             # too short to split


def test_sm90_decode_tile_follows_the_layout_and_the_longest_sequence():
    # the rows the H200 was tuned to (attention/tuning.py): paged caches take the contiguous rows (the
    # kernel loads pages a step ahead), pages smaller than the long row's key block a row of their
    # own, and smaller tiles serve up to KVCACHE_SHORT_KEYS keys (max_seqlen_k: the used length,
    # or the caller's bound; None, as in a capture: long)
    from lanekit.attention import tuning
    from lanekit.runtime.tuning import compiling_for

    cpu = torch.device("cpu")

    def tile(page_size, one_page, max_keys, fp32=False, leftpad=False):
        with compiling_for("sm90"):
            return tuning.kvcache_tile(cpu, 128, fp32=fp32, page_size=page_size, one_page=one_page,
                                       leftpad=leftpad, max_keys=max_keys)

    short, long_ = tuning.KVCACHE_SHORT_KEYS, tuning.KVCACHE_SHORT_KEYS + 1
    short_row, long_row = tuning.FLASH_ATTN_KVCACHE_SHORT["sm90"][128], tuning.FLASH_ATTN_KVCACHE["sm90"][128]
    per_key_row = tuning.FLASH_ATTN_KVCACHE_PER_KEY_PAGES["sm90"][128]
    Layout = tuning.KVCacheLayout   # (pages, pow2_page, page, pages_ahead)
    one_page, whole_pages = Layout(0, False, 0, False), Layout(1, False, 0, False)
    # pages of 16 fill the short and the per-key rows' blocks whole: a table load per page, loaded
    # a block ahead on NVIDIA
    pages_of_16 = Layout(2, True, 16, True)
    assert tile(32768, True, short) == (short_row, one_page)
    assert tile(32768, True, long_) == tile(32768, True, None) == (long_row, one_page)
    assert tile(256, False, short) == (short_row, whole_pages)
    assert tile(256, False, long_) == tile(256, False, None) == (long_row, whole_pages)
    assert tile(16, False, short) == (short_row, pages_of_16)          # 16 % 64 != 0: layout 2
    assert tile(16, False, long_) == (per_key_row, whole_pages if 16 % per_key_row.block_n == 0 else pages_of_16)
    assert tile(256, False, short, fp32=True)[0] == tuning.FLASH_ATTN_KVCACHE["generic"][128]
    # left padding shifts the keys off the page starts: a lookup per key; so do pages of 12, by
    # division (not a power of two)
    for max_keys in (short, long_):
        assert tile(16, False, max_keys, leftpad=True)[1] == Layout(2, True, 0, True)
    assert tile(12, False, short)[1] == Layout(2, False, 0, True)
    assert tuning.kvcache_block_pages(2, 12, 64, leftpad=False) == 0       # not a power of two
    assert tuning.kvcache_block_pages(2, 128, 64, leftpad=False) == 0      # larger than the block


def test_max_seqlen_k_bounds_the_lengths_and_is_checked(device, monkeypatch):
    q, kc, vc, seqlens = decode_inputs(device, B=2, Sk=300, Hq=4, Hkv=2, D=128, capacity=400, seed=2)
    new = randn(2, 1, 2, 128, dtype=q.dtype, device=device, generator=gen(3))
    want = lanekit.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), new, new, cache_seqlens=seqlens,
                                           lane="reference")   # the float64 oracle
    for bound in (None, 301, 9000):   # the used length after the append, and one past the short rows
        with poisoned_outputs():
            got = lanekit.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), new, new, cache_seqlens=seqlens,
                                                  max_seqlen_k=bound, lane="triton")
        assert_close(got, want, ATTENTION_FWD)
    kc0, vc0 = kc.clone(), vc.clone()
    monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")   # the lengths live on the device: read back in the debug mode
    with pytest.raises(ValueError, match="max_seqlen_k: expected at least .*301.*got 300"):
        lanekit.flash_attn_with_kvcache(q, kc, vc, new, new, cache_seqlens=seqlens, max_seqlen_k=300)
    with pytest.raises(TypeError, match="max_seqlen_k: expected an int or None, got float"):
        lanekit.flash_attn_with_kvcache(q, kc, vc, new, new, cache_seqlens=seqlens, max_seqlen_k=301.0)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)   # nothing appended when rejected


def test_split_heuristic_rounds_to_the_nearest_wave():
    from lanekit.attention import api_kvcache as api

    cpu = torch.device("cpu")   # 4 "SMs" off the GPU
    assert api.num_splits_heuristic(4, None, cpu, programs_per_sm=1) == 1    # one full wave
    assert api.num_splits_heuristic(5, None, cpu, programs_per_sm=1) == 1    # not a second wave a fifth full
    assert api.num_splits_heuristic(3, None, cpu, programs_per_sm=1) == 1    # 3 of 4 slots: 6 would need two waves
    assert api.num_splits_heuristic(3, None, cpu, programs_per_sm=2) == 3    # 9 programs for 8 slots
    assert api.num_splits_heuristic(1, None, cpu, programs_per_sm=4) == 16
    assert api.num_splits_heuristic(1, 128, cpu, block_n=16) == 2          # four blocks a split at least
    assert api.num_splits_heuristic(512, None, cpu) == 1


@pytest.mark.parametrize("ahead", [True, False], ids=["pages_ahead", "pages_in_step"])
@pytest.mark.parametrize("quant", [None, torch.int8])
def test_power_of_two_pages_with_left_padding_match_the_oracle(device, quant, ahead, monkeypatch):
    # pages of 4 take the per-key lookup (a shift, not a division) on every tile; left padding
    # keeps pages from holding whole blocks. Both ways the kernel can find those pages: a block
    # ahead (NVIDIA) or in the block's own step (AMD: tuning.kvcache_pages_ahead); each split
    # walks several blocks, so the pages carried into the next step are used
    from lanekit import check
    from lanekit.attention import tuning
    from lanekit.attention.registry import kvcache_case
    from lanekit.families import get_op

    monkeypatch.setattr(tuning, "kvcache_pages_ahead", lambda device: ahead)

    sample = kvcache_case("page 4 leftpad", device, page_size=4, leftpad=(3, 9), seqlens=(70, 100),
                          capacity=120, quant=quant, num_splits=2)
    result = check.check_sample(get_op("flash_attn_with_kvcache"), "triton", sample)
    assert result.ok, result.detail


def test_whole_block_pages_with_a_window_and_splits_match_the_oracle(device):
    # pages of 64 hold whole key blocks (one lookup a block, loaded a step ahead); the window
    # starts mid-block, so the first block of a split is rounded down to its block start
    from lanekit import check
    from lanekit.attention.registry import kvcache_case
    from lanekit.families import get_op

    sample = kvcache_case("page 64 window splits 2", device, page_size=64, window_size=(45, 0),
                          seqlens=(150, 100), capacity=192, num_splits=2)
    result = check.check_sample(get_op("flash_attn_with_kvcache"), "triton", sample)
    assert result.ok, result.detail


def test_keys_outside_the_window_and_unowned_pages_are_never_read(device):
    # The kernel's property (the oracle reads whole caches): the Triton lane, interpreted on a CPU.
    g = gen(2)
    B, page, Hkv, D = 2, 16, 2, 64
    q = randn(B, 1, 4, D, dtype=torch.bfloat16, device=device, generator=g)
    table = torch.tensor([[3, 0, 5, 1], [2, 7, 6, 4]], dtype=torch.int32, device=device)
    seqlens = torch.tensor([50, 64], dtype=torch.int32, device=device)
    k_cache = randn(10, page, Hkv, D, dtype=torch.bfloat16, device=device, generator=g)
    v_cache = randn(10, page, Hkv, D, dtype=torch.bfloat16, device=device, generator=g)
    clean = lanekit.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                            window_size=(20, 0), num_splits=2, lane="triton")
    want = lanekit.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                           window_size=(20, 0), lane="reference")   # the float64 oracle
    assert_close(clean, want, ATTENTION_FWD)
    # poison: pages 8, 9 (nobody's), sequence 0's tokens past 50, and keys before each window
    for cache in (k_cache, v_cache):
        cache[8:] = math.nan
        cache[1, 50 - 48:] = math.nan         # sequence 0's last page (3rd of its table is page 5: tokens 32..47)
        cache[3, :] = math.nan                 # sequence 0's tokens 0..15: before its window [29, 49]
        cache[2, :] = math.nan                 # sequence 1's tokens 0..15: before its window [43, 63]
    with poisoned_outputs():
        poisoned = lanekit.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                                   window_size=(20, 0), num_splits=2, lane="triton")
    assert torch.isfinite(poisoned).all()
    assert torch.equal(clean, poisoned)


@pytest.mark.parametrize("ahead", [True, False], ids=["pages_ahead", "pages_in_step"])
@pytest.mark.parametrize("page_size", [2, 8, 16])
def test_blocks_of_whole_pages_read_only_the_keys_they_own(device, page_size, ahead, monkeypatch):
    # Pages of a power of two that divides the key block take one table load per page, each
    # entry repeated for the page's keys (tuning.kvcache_block_pages): the interpreter's block
    # is 32 keys, sm90's 32 or 64. Pages in random order; every key a sequence does not own or
    # its window does not reach is NaN, spare pages included; splits start mid-sequence.
    from lanekit.attention import tuning
    from lanekit.runtime.lanes import triton_interpreted

    monkeypatch.setattr(tuning, "kvcache_pages_ahead", lambda device: ahead)
    g = gen(page_size)
    B, Hq, Hkv, D, window = 3, 8, 2, 64, 37
    seqlens = [83, 40, 1]
    max_pages = -(-max(seqlens) // page_size) + 1
    num_blocks = B * max_pages + 5
    table = torch.randperm(num_blocks, generator=g)[: B * max_pages].reshape(B, max_pages).to(torch.int32)
    q = randn(B, 1, Hq, D, dtype=torch.bfloat16, device=device, generator=g)
    k_cache = randn(num_blocks, page_size, Hkv, D, dtype=torch.bfloat16, device=device, generator=g)
    v_cache = randn(num_blocks, page_size, Hkv, D, dtype=torch.bfloat16, device=device, generator=g)
    _, layout = tuning.kvcache_tile(q.device, D, fp32=False, page_size=page_size, one_page=False, leftpad=False,
                                    max_keys=max(seqlens), interpreted=triton_interpreted())
    assert (layout.page, layout.pages_ahead) == (page_size, ahead)
    args = dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device),
                block_table=table.to(device), window_size=(window, 0))
    want = lanekit.flash_attn_with_kvcache(q, k_cache, v_cache, lane="reference", **args)  # the float64 oracle
    owned = torch.zeros(num_blocks, page_size, dtype=torch.bool)
    for b, n in enumerate(seqlens):
        for t in range(max(n - 1 - window, 0), n):
            owned[table[b, t // page_size], t % page_size] = True
    k_cache[~owned.to(device)] = math.nan
    v_cache[~owned.to(device)] = math.nan
    for num_splits in (1, 3):
        with poisoned_outputs():
            got = lanekit.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=num_splits, lane="triton", **args)
        assert_close(got, want, ATTENTION_FWD)


def test_paged_two_sequences_four_pages_of_256_split_in_two_writes_every_row(device):
    g = gen(3)
    q = randn(2, 1, 8, 64, dtype=torch.bfloat16, device=device, generator=g)
    kc = randn(9, 256, 2, 64, dtype=torch.bfloat16, device=device, generator=g)
    vc = randn(9, 256, 2, 64, dtype=torch.bfloat16, device=device, generator=g)
    table = torch.tensor([[0, 2, 4, 6], [1, 3, 5, 7]], dtype=torch.int32, device=device)
    seqlens = torch.tensor([1024, 700], dtype=torch.int32, device=device)
    with poisoned_outputs():
        out, lse = lanekit.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                                   num_splits=2, return_softmax_lse=True, lane="triton")
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    for b in range(2):
        n = int(seqlens[b])
        keys = ref.paged_to_dense(kc, table[b].cpu(), n)[None]
        vals = ref.paged_to_dense(vc, table[b].cpu(), n)[None]
        ref_out, ref_lse = ref.flash_attn(upcast(q[b:b + 1]), upcast(keys), upcast(vals), softmax_scale=0.125)
        assert_close(out[b:b + 1], ref_out, ATTENTION_FWD)
        assert_close(lse[b:b + 1], ref_lse, "lse")


@pytest.mark.parametrize("lane", LANES)
def test_append_writes_the_rotated_keys_and_values_in_place(device, lane):
    g = gen(4)
    B, Hkv, D = 2, 2, 64
    q = randn(B, 1, 4, D, dtype=torch.float16, device=device, generator=g)
    kc = torch.zeros(B, 32, Hkv, D, dtype=torch.float16, device=device)
    vc = torch.zeros_like(kc)
    k = randn(B, 1, Hkv, D, dtype=torch.float16, device=device, generator=g)
    v = randn(B, 1, Hkv, D, dtype=torch.float16, device=device, generator=g)
    seqlens = torch.tensor([3, 10], dtype=torch.int32, device=device)
    angles = torch.rand(64, 16, generator=g) * 6
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    with poisoned_outputs():
        lanekit.flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, seqlens, causal=True, lane=lane)
    rotated = ref.flash_attn_with_kvcache  # the oracle's own write, for the expected cache
    _, _, want_k, want_v = rotated(upcast(q), upcast(torch.zeros_like(kc)), upcast(torch.zeros_like(vc)),
                                   k=upcast(k), v=upcast(v), rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
                                   kv_dtype=torch.float16, rotary_dtype=torch.float16, softmax_scale=0.125,
                                   window_size=(-1, 0))
    assert_close(kc, want_k, "eltwise")
    assert torch.equal(vc, want_v.to(torch.float16))
    assert (kc[0, 4:] == 0).all() and (kc[1, :10] == 0).all()   # nothing else written


def test_an_append_after_a_checked_call_of_its_signature_still_checks_the_memory_it_writes(device):
    # The checks of a signature seen before are skipped (runtime.signature), but not those of the
    # memory an append writes: v_cache given as k_cache, or an inference tensor, has the metadata
    # of a good call and still raises, writing nothing. (The Triton lane: the reference lane reads
    # index values back, so it checks everything on every call.)
    g = gen(5)
    B, Hkv, D = 2, 2, 16
    q = randn(B, 1, 4, D, dtype=torch.float16, device=device, generator=g)
    k = randn(B, 1, Hkv, D, dtype=torch.float16, device=device, generator=g)
    seqlens = torch.tensor([3, 10], dtype=torch.int32, device=device)
    kc, vc = torch.zeros(B, 32, Hkv, D, dtype=torch.float16, device=device), torch.zeros(B, 32, Hkv, D, dtype=torch.float16, device=device)
    lanekit.flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=seqlens, causal=True, lane="triton")
    kc.zero_()
    with pytest.raises(ValueError, match="v_cache: expected memory of its own"):
        lanekit.flash_attn_with_kvcache(q, kc, kc, k, k, cache_seqlens=seqlens, causal=True, lane="triton")
    with torch.inference_mode():
        kc_inf = torch.zeros(B, 32, Hkv, D, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="k_cache: expected a tensor that can be written in place"):
        lanekit.flash_attn_with_kvcache(q, kc_inf, vc, k, k, cache_seqlens=seqlens, causal=True, lane="triton")
    assert (kc == 0).all() and (kc_inf == 0).all()


def test_a_0d_cache_seqlens_is_checked_and_widened_on_every_call_of_its_signature(device):
    # A 0-d integer cache_seqlens is an int (one length for every sequence): its value is checked
    # and made a (B,) tensor on every call. Kept by the signature cache, a later call of another
    # value went to the kernel unchecked as a 0-d tensor, which read it past its one element.
    g = gen(6)
    B, Hkv, D = 2, 2, 16
    q = randn(B, 1, 4, D, dtype=torch.float16, device=device, generator=g)
    kc = randn(B, 32, Hkv, D, dtype=torch.float16, device=device, generator=g)
    vc = randn(B, 32, Hkv, D, dtype=torch.float16, device=device, generator=g)
    for n in (20, 7):
        with poisoned_outputs():
            got = lanekit.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor(n, device=device),
                                                  causal=True, lane="triton")
        want = ref.flash_attn_with_kvcache(upcast(q), upcast(kc), upcast(vc), softmax_scale=D ** -0.5,
                                           cache_seqlens=torch.full((B,), n, dtype=torch.int32, device=device),
                                           window_size=(-1, 0))[0]
        assert_close(got, want, ATTENTION_FWD)
    with pytest.raises(ValueError, match="cache_seqlens: expected 0..32"):
        lanekit.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor(1000, device=device), causal=True,
                                        lane="triton")


# each case and the argument its error names
BAD_KVCACHE = {
    "cache_seqlens past capacity": "cache_seqlens", "leftpad past seqlens": "cache_leftpad",
    "page out of range": "block_table", "table too short": "block_table",
    "repeated batch_idx with append": "cache_batch_idx", "rotary too short": "rotary_cos",
    "num_splits too big": "num_splits", "num_splits a float": "num_splits", "k without v": "k, v",
    "codes without scales": "k_cache_scale", "int64 seqlens": "cache_seqlens",
    "cache_seqlens a float": "cache_seqlens", "no cache_seqlens with append": "cache_seqlens",
    "v_cache is k_cache with append": "v_cache", "one tensor for both scales with append": "v_cache_scale",
    "expanded cache with append": "k_cache", "two sequences append into one page": "block_table",
    "an append over another sequence's cached token": "block_table",
    "a cache that requires grad with append": "k_cache", "return_softmax_lse not a bool": "return_softmax_lse",
    "rotary_interleaved an int": "rotary_interleaved", "cache_seqlens a bool": "cache_seqlens",
}


@pytest.mark.parametrize("case", list(BAD_KVCACHE))
def test_kvcache_bad_input_raises_and_writes_nothing(device, case, monkeypatch):
    monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")   # index values checked on the host, before anything runs
    g = gen(5)
    q = randn(2, 1, 4, 32, dtype=torch.float16, device=device, generator=g)
    kc = randn(2, 16, 2, 32, dtype=torch.float16, device=device, generator=g)
    vc = kc.clone()
    k = randn(2, 1, 2, 32, dtype=torch.float16, device=device, generator=g)
    kw = dict(k=k, v=k.clone(), cache_seqlens=torch.tensor([3, 5], dtype=torch.int32, device=device))
    if case == "cache_seqlens past capacity":
        kw["cache_seqlens"] = torch.tensor([3, 16], dtype=torch.int32, device=device)
    elif case == "leftpad past seqlens":
        kw["cache_leftpad"] = torch.tensor([4, 0], dtype=torch.int32, device=device)
    elif case == "page out of range":
        kw["block_table"] = torch.tensor([[0], [7]], dtype=torch.int32, device=device)
    elif case == "table too short":
        kc = randn(4, 2, 2, 32, dtype=torch.float16, device=device, generator=g)
        vc = kc.clone()
        kw["block_table"] = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    elif case == "repeated batch_idx with append":
        kw["cache_batch_idx"] = torch.tensor([1, 1], dtype=torch.int32, device=device)
    elif case == "rotary too short":
        kw["rotary_cos"] = kw["rotary_sin"] = torch.ones(4, 8, device=device)
    elif case == "num_splits too big":
        kw["num_splits"] = 129
    elif case == "num_splits a float":
        kw["num_splits"] = 2.0
    elif case == "cache_seqlens a float":
        kw["cache_seqlens"] = 3.0
    elif case == "no cache_seqlens with append":   # FlashAttention's rule: where would k, v go?
        del kw["cache_seqlens"]
    elif case == "one tensor for both scales with append":   # the v scales would land on the k scales
        kc, vc = kc.to(torch.int8), vc.to(torch.int8)
        kw["k_cache_scale"] = kw["v_cache_scale"] = torch.ones(2, 16, 2, device=device)
    elif case == "two sequences append into one page":       # both new tokens at slot 3 of page 0
        kw["block_table"] = torch.tensor([[0], [0]], dtype=torch.int32, device=device)
        kw["cache_seqlens"] = torch.tensor([3, 3], dtype=torch.int32, device=device)
    elif case == "an append over another sequence's cached token":   # slot 3 of page 0 holds sequence 1's token 3
        kw["block_table"] = torch.tensor([[0], [0]], dtype=torch.int32, device=device)
        kw["cache_seqlens"] = torch.tensor([3, 5], dtype=torch.int32, device=device)
    elif case == "k without v":
        kw["v"] = None
    elif case == "codes without scales":
        kc, vc = kc.to(torch.int8), vc.to(torch.int8)
    elif case == "int64 seqlens":
        kw["cache_seqlens"] = kw["cache_seqlens"].long()
    elif case == "v_cache is k_cache with append":   # the new values would land on the new keys
        vc = kc
    elif case == "expanded cache with append":       # one row of memory behind every sequence
        kc = kc[:1].expand(2, 16, 2, 32)
    elif case == "a cache that requires grad with append":   # the append is not differentiable
        kc = kc.float().requires_grad_()
        q, vc, kw["k"], kw["v"] = q.float(), vc.float(), k.float(), k.float()
    elif case == "return_softmax_lse not a bool":
        kw["return_softmax_lse"] = "yes"
    elif case == "rotary_interleaved an int":
        kw["rotary_interleaved"] = 1
    elif case == "cache_seqlens a bool":
        kw["cache_seqlens"] = True
    before = [t.clone() for t in (kc, vc, kw.get("k_cache_scale"), kw.get("v_cache_scale")) if t is not None]
    with pytest.raises((ValueError, TypeError), match=rf"^{BAD_KVCACHE[case]}: .*expected"):
        lanekit.flash_attn_with_kvcache(q, kc, vc, **kw)
    after = [t for t in (kc, vc, kw.get("k_cache_scale"), kw.get("v_cache_scale")) if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize("lane", LANES)
def test_sequences_sharing_full_prefix_pages_append_into_their_own(device, lane):
    # pages 0 and 1 hold a 32-token prefix both sequences read; each appends into a page of its own
    # (one at its start, one partway), which the checks against racing writes must let through
    g = gen(8)
    q = randn(2, 1, 4, 32, dtype=torch.float16, device=device, generator=g)
    kc = randn(5, 16, 2, 32, dtype=torch.float16, device=device, generator=g)
    vc = randn(5, 16, 2, 32, dtype=torch.float16, device=device, generator=g)
    k = randn(2, 1, 2, 32, dtype=torch.float16, device=device, generator=g)
    v = randn(2, 1, 2, 32, dtype=torch.float16, device=device, generator=g)
    table = torch.tensor([[0, 1, 2], [0, 1, 4]], dtype=torch.int32, device=device)
    seqlens = torch.tensor([32, 37], dtype=torch.int32, device=device)
    want_k, want_v = kc.clone(), vc.clone()
    want_k[2, 0], want_v[2, 0], want_k[4, 5], want_v[4, 5] = k[0, 0], v[0, 0], k[1, 0], v[1, 0]
    want = [ref.flash_attn(upcast(q[b:b + 1]), upcast(ref.paged_to_dense(want_k, table[b].cpu(), n)[None]),
                           upcast(ref.paged_to_dense(want_v, table[b].cpu(), n)[None]), softmax_scale=32 ** -0.5)[0]
            for b, n in enumerate((33, 38))]
    with poisoned_outputs():
        out = lanekit.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table, lane=lane)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    for b in range(2):
        assert_close(out[b:b + 1], want[b], ATTENTION_FWD)


def test_strided_index_tensors_are_read_as_their_values(device):
    # a view such as t[::2] holds its values at a stride: the kernels must not read the gaps
    g = gen(6)
    q = randn(2, 1, 4, 32, dtype=torch.bfloat16, device=device, generator=g)
    kc = randn(8, 16, 2, 32, dtype=torch.bfloat16, device=device, generator=g)
    vc = randn(8, 16, 2, 32, dtype=torch.bfloat16, device=device, generator=g)

    def spaced(values, filler):   # the values at even positions of a vector twice as long
        t = torch.full((len(values), 2), filler, dtype=torch.int32, device=device)
        t[:, 0] = torch.tensor(values, dtype=torch.int32)
        return t.flatten()[::2]

    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device=device)
    spaced_table = torch.full((2, 6), 99, dtype=torch.int32, device=device)
    spaced_table[:, ::2] = table
    plain = dict(cache_seqlens=torch.tensor([20, 37], dtype=torch.int32, device=device), block_table=table,
                 cache_leftpad=torch.tensor([3, 5], dtype=torch.int32, device=device))
    strided = dict(cache_seqlens=spaced([20, 37], 0), block_table=spaced_table[:, ::2],
                   cache_leftpad=spaced([3, 5], 1000))
    assert not strided["block_table"].is_contiguous() and not strided["cache_seqlens"].is_contiguous()
    with poisoned_outputs():
        want = lanekit.flash_attn_with_kvcache(q, kc, vc, **plain, num_splits=2, lane="triton")
        got = lanekit.flash_attn_with_kvcache(q, kc, vc, **strided, num_splits=2, lane="triton")
    oracle = lanekit.flash_attn_with_kvcache(upcast(q), upcast(kc), upcast(vc), **plain, lane="reference")
    assert_close(want, oracle, ATTENTION_FWD)
    assert torch.equal(got, want)

    qp = randn(10, 4, 32, dtype=torch.bfloat16, device=device, generator=g)
    kp = randn(10, 2, 32, dtype=torch.bfloat16, device=device, generator=g)
    cu_q = torch.tensor([0, 3, 10], dtype=torch.int32, device=device)
    with poisoned_outputs():
        want = lanekit.flash_attn_varlen_func(qp, kp, kp, cu_q, cu_q, 7, 7, causal=True, lane="triton")
        got = lanekit.flash_attn_varlen_func(qp, kp, kp, spaced([0, 3, 10], 99), spaced([0, 3, 10], 99), 7, 7,
                                             causal=True, lane="triton")
    assert_close(want, oracle_varlen(qp, kp, kp, cu_q, cu_q, [3, 7], [3, 7])[0], ATTENTION_FWD)
    assert torch.equal(got, want)


def test_reference_lane_takes_an_empty_batch_and_float64(device):
    g = gen(7)
    q = randn(2, 1, 4, 32, dtype=torch.float64, device=device, generator=g)
    kc = randn(2, 16, 2, 32, dtype=torch.float64, device=device, generator=g)
    seqlens = torch.tensor([5, 16], dtype=torch.int32, device=device)
    with poisoned_outputs():
        out = lanekit.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=seqlens, lane="reference")
    want, _ = ref.flash_attn(q[1:], kc[1:], kc[1:], softmax_scale=32 ** -0.5)
    assert out.dtype == torch.float64 and torch.allclose(out[1:], want)
    no_pages = torch.zeros(0, 1, dtype=torch.int32, device=device)   # a paged cache, no sequence
    empty = lanekit.flash_attn_with_kvcache(q[:0], kc, kc, cache_seqlens=seqlens[:0], block_table=no_pages,
                                            lane="reference")
    assert empty.shape == (0, 1, 4, 32)


@pytest.mark.parametrize("lane", LANES)
def test_an_empty_batch_with_a_contiguous_cache_gives_empty_results(device, lane):
    # B = 0 sequences: a contiguous cache of B rows has none, and FlashAttention's layout allows it
    q = torch.zeros(0, 1, 4, 16, device=device)
    kc, vc, k = torch.zeros(0, 8, 2, 16, device=device), torch.zeros(0, 8, 2, 16, device=device), torch.zeros(0, 1, 2, 16, device=device)
    none = torch.zeros(0, dtype=torch.int32, device=device)
    for kw in (dict(), dict(cache_seqlens=none), dict(k=k, v=k, cache_seqlens=none, causal=True)):
        out, lse = lanekit.flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, lane=lane, **kw)
        assert out.shape == (0, 1, 4, 16) and lse.shape == (0, 4, 1) and lse.dtype == torch.float32
    with pytest.raises(ValueError, match=r"^k_cache: expected S_cache, Hkv and D >= 1"):
        lanekit.flash_attn_with_kvcache(q, kc[:, :0], vc[:, :0], lane=lane)


def test_kvcache_takes_numpy_and_0d_tensor_ints_and_bools(device):
    g = gen(11)
    q = randn(2, 1, 4, 32, dtype=torch.float32, device=device, generator=g)
    kc = randn(2, 16, 2, 32, dtype=torch.float32, device=device, generator=g)
    angles = torch.rand(32, 8, generator=g)
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    want = lanekit.flash_attn_with_kvcache(q, kc, kc, rotary_cos=cos, rotary_sin=sin, cache_seqlens=9,
                                           num_splits=2, return_softmax_lse=True, rotary_interleaved=False,
                                           max_seqlen_k=12)
    got = lanekit.flash_attn_with_kvcache(q, kc, kc, rotary_cos=cos, rotary_sin=sin, cache_seqlens=torch.tensor(9),
                                          num_splits=np.int64(2), return_softmax_lse=np.bool_(True),
                                          rotary_interleaved=torch.tensor(False), max_seqlen_k=np.int32(12))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class _Grids:
    """A kernel stand-in that records the grid of every launch and runs the kernel, unless the
    grid's first dimension passes ``most`` (then it fails at once rather than run for minutes)."""

    def __init__(self, kernel, most):
        self.kernel, self.most, self.grids = kernel, most, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        assert grid[0] <= self.most, f"a grid of {grid} for 7 tokens"
        return self.kernel[grid]


def test_varlen_grid_follows_the_tokens_there_not_max_seqlen(device, monkeypatch):
    # max_seqlen_q = 10**7 for 7 tokens launched 10**7 / BLOCK_M programs that found no row
    # (minutes interpreted): every grid is bounded by the tokens in q and k, forward and backward
    fwd, bwd = (importlib.import_module(f"lanekit.attention.kernels.{m}") for m in ("fwd", "bwd"))
    q, k, v, cq, ck = varlen_inputs(device, [3, 4], [5, 2], Hq=2, Hkv=1, D=16, dtype=torch.float32)
    dout = randn(*q.shape, dtype=torch.float32, device=device, generator=gen(12))

    def run(max_q, max_k):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with poisoned_outputs():
            out = lanekit.flash_attn_varlen_func(*leaves, cq, ck, max_q, max_k, causal=True, lane="triton")
            grads = torch.autograd.grad(out, leaves, dout)
        return out, grads

    want = run(4, 5)
    recorders = {}
    for module, name in ((fwd, "_flash_attn_fwd_kernel"), (bwd, "_flash_attn_bwd_dkdv_kernel"),
                         (bwd, "_flash_attn_bwd_dq_kernel")):
        recorders[name] = _Grids(getattr(module, name), most=1)
        monkeypatch.setattr(module, name, recorders[name])
    got = run(10**7, np.int64(10**7))
    assert torch.equal(got[0], want[0]) and all(map(torch.equal, got[1], want[1]))
    for name, recorder in recorders.items():
        (grid,) = recorder.grids
        assert grid[0] == 1 and grid[2] == 2, (name, grid)   # 7 queries, 7 keys: one block of each
    assert_close(want[0], oracle_varlen(q, k, v, cq, ck, [3, 4], [5, 2])[0], ATTENTION_FWD)


def test_varlen_flags_and_ints_follow_the_one_rule(device):
    q, k, v, cq, ck = varlen_inputs(device, [2, 3], [4, 4], Hq=2, Hkv=2, D=16)
    want = lanekit.flash_attn_varlen_func(q, k, v, cq, ck, 3, 4, causal=True)
    assert torch.equal(lanekit.flash_attn_varlen_func(q, k, v, cq, ck, np.int64(3), torch.tensor(4),
                                                      causal=np.bool_(True)), want)
    for kw, arg in ((dict(return_attn_probs="no"), "return_attn_probs"), (dict(deterministic="x"), "deterministic"),
                    (dict(causal=1), "causal"), (dict(window_size=(2.0, 0)), "window_size")):
        with pytest.raises(TypeError, match=f"^{arg}: expected"):
            lanekit.flash_attn_varlen_func(q, k, v, cq, ck, 3, 4, **kw)


@pytest.mark.parametrize("case", ["cu_seqlens not ending at total", "decreasing", "longer than max_seqlen",
                                  "int64 cu_seqlens", "batch mismatch", "block_table too short",
                                  "max_seqlen_q a float"])
def test_varlen_bad_input_raises_a_clear_error(device, case, monkeypatch):
    monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")   # cu_seqlens and pages read back and checked
    q, k, v, cq, ck = varlen_inputs(device, [2, 3], [4, 4], Hq=2, Hkv=2, D=16)
    args = [q, k, v, cq, ck, 3, 4]
    kw = {}
    if case == "cu_seqlens not ending at total":
        args[3] = torch.tensor([0, 2, 4], dtype=torch.int32, device=device)
    elif case == "decreasing":
        args[4] = torch.tensor([0, 9, 8], dtype=torch.int32, device=device)
    elif case == "longer than max_seqlen":
        args[5] = 2
    elif case == "int64 cu_seqlens":
        args[3] = cq.long()
    elif case == "batch mismatch":
        args[4] = torch.tensor([0, 8], dtype=torch.int32, device=device)
    elif case == "block_table too short":
        args[1] = k.reshape(4, 2, 2, 16)
        args[2] = v.reshape(4, 2, 2, 16)
        kw["block_table"] = torch.tensor([[0], [1]], dtype=torch.int32, device=device)
    elif case == "max_seqlen_q a float":
        args[5] = 3.0
    with pytest.raises(TypeError if case == "max_seqlen_q a float" else (ValueError, TypeError)) as info:
        lanekit.flash_attn_varlen_func(*args, **kw)
    assert "expected" in str(info.value)


# ---- index values not read back (DESIGN.md's hot path): masked in the kernels, recorded ----

def _clear_errors():
    try:
        lanekit.check_errors()
    except ValueError:
        pass


# case: (the kind of error recorded, whether sequence 1's output rows come out 0)
UNCHECKED_KVCACHE = {
    "cache_seqlens past capacity": ("cache_seqlens, cache_leftpad or cache_batch_idx value out of range", True),
    "page out of range": ("a row past the cache, or a page past the pool", True),   # a one-page table
    "table too short": ("cache_seqlens, cache_leftpad or cache_batch_idx value out of range", True),
    "page out of range, two-page table": ("block_table page id outside", False),
    "rotary too short": ("rotary: a position", False),
}


@pytest.mark.parametrize("case", list(UNCHECKED_KVCACHE))
def test_kvcache_index_values_out_of_range_are_masked_and_recorded_not_read(device, case, monkeypatch):
    monkeypatch.delenv("LANEKIT_CHECK_INDICES", raising=False)
    _clear_errors()
    g = gen(5)
    q = randn(2, 1, 4, 32, dtype=torch.float16, device=device, generator=g)
    kc = randn(2, 16, 2, 32, dtype=torch.float16, device=device, generator=g)
    k = randn(2, 1, 2, 32, dtype=torch.float16, device=device, generator=g)
    kw = dict(cache_seqlens=torch.tensor([3, 5], dtype=torch.int32, device=device))
    if case == "cache_seqlens past capacity":
        kw["cache_seqlens"] = torch.tensor([3, 16], dtype=torch.int32, device=device)
    elif case == "page out of range":
        kw["block_table"] = torch.tensor([[0], [7]], dtype=torch.int32, device=device)
    elif case == "table too short":
        kc = randn(4, 2, 2, 32, dtype=torch.float16, device=device, generator=g)
        kw["block_table"] = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    elif case == "page out of range, two-page table":   # sequence 1's first page (keys 0..3) is past the pool
        kc = randn(4, 4, 2, 32, dtype=torch.float16, device=device, generator=g)
        kw["block_table"] = torch.tensor([[0, 1], [9, 3]], dtype=torch.int32, device=device)
    elif case == "rotary too short":
        kw["rotary_cos"] = kw["rotary_sin"] = torch.ones(5, 8, dtype=torch.float16, device=device)
    vc = kc.clone()
    with poisoned_outputs():
        out = lanekit.flash_attn_with_kvcache(q, kc, vc, k, k.clone(), lane="triton", **kw)
    kind, zero = UNCHECKED_KVCACHE[case]
    with pytest.raises(RuntimeError, match=kind):     # a ValueError, catchable as a RuntimeError
        lanekit.check_errors()
    lanekit.check_errors()                            # cleared
    # sequence 0 is valid: the same as alone, with the same caches
    one = {n: (t[:1] if isinstance(t, torch.Tensor) and n in ("cache_seqlens", "block_table") else t)
           for n, t in kw.items()}
    rows = slice(None) if "block_table" in kw else slice(0, 1)   # a contiguous cache: sequence 0's row
    alone = lanekit.flash_attn_with_kvcache(q[:1], kc[rows].clone(), vc[rows].clone(), k[:1], k[:1].clone(),
                                            lane="triton", **one)
    assert torch.equal(out[:1], alone)
    assert not out.isnan().any()
    if zero:
        assert (out[1] == 0).all()


@pytest.mark.parametrize("case", ["cu_seqlens not ending at total", "decreasing", "longer than max_seqlen",
                                  "block_table too short"])
def test_varlen_index_values_out_of_range_are_clamped_and_recorded(device, case, monkeypatch):
    monkeypatch.delenv("LANEKIT_CHECK_INDICES", raising=False)
    _clear_errors()
    q, k, v, cq, ck = varlen_inputs(device, [2, 3], [4, 4], Hq=2, Hkv=2, D=16)
    args = [q, k, v, cq, ck, 3, 4]
    kw = {}
    if case == "cu_seqlens not ending at total":
        args[3] = torch.tensor([0, 2, 4], dtype=torch.int32, device=device)
    elif case == "decreasing":
        args[4] = torch.tensor([0, 9, 8], dtype=torch.int32, device=device)
    elif case == "longer than max_seqlen":
        args[5] = 2
    elif case == "block_table too short":
        args[1] = k.reshape(4, 2, 2, 16)
        args[2] = v.reshape(4, 2, 2, 16)
        kw["block_table"] = torch.tensor([[0], [1]], dtype=torch.int32, device=device)
    out = lanekit.flash_attn_varlen_func(*args, lane="triton", **kw)
    with pytest.raises(ValueError, match="flash_attn_varlen_func: cu_seqlens_q or cu_seqlens_k"):
        lanekit.check_errors()
    if case == "decreasing":   # key rows clamped to [0, 8, 8]: sequence 1 sees no key
        assert (out[2:] == 0).all() and not out[:2].isnan().any()


def test_valid_cache_calls_record_no_error(device, monkeypatch):
    monkeypatch.delenv("LANEKIT_CHECK_INDICES", raising=False)
    _clear_errors()
    q, k, v, cq, ck = varlen_inputs(device, [2, 3], [4, 4], Hq=2, Hkv=2, D=16)
    lanekit.flash_attn_varlen_func(q, k, v, cq, ck, 3, 4, lane="triton")
    kc = randn(4, 4, 2, 16, dtype=q.dtype, device=device, generator=gen(2))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    lanekit.flash_attn_with_kvcache(q[:2, None], kc, kc.clone(), cache_seqlens=torch.tensor([8, 0], dtype=torch.int32,
                                    device=device), block_table=table, lane="triton")
    lanekit.check_errors()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device syncs are a GPU's")
def test_decode_and_varlen_read_nothing_back_from_the_device(device, monkeypatch):
    monkeypatch.delenv("LANEKIT_CHECK_INDICES", raising=False)
    q, k, v, cq, ck = varlen_inputs(device, [2, 3], [4, 4], Hq=2, Hkv=2, D=16)
    kc = randn(8, 4, 2, 16, dtype=q.dtype, device=device, generator=gen(2))
    vc = kc.clone()
    table = torch.tensor([[0, 1, 4], [2, 3, 5]], dtype=torch.int32, device=device)
    seqlens = torch.tensor([7, 2], dtype=torch.int32, device=device)
    new = randn(2, 1, 2, 16, dtype=q.dtype, device=device, generator=gen(3))
    slots = torch.tensor([30, 31], device=device)   # a copy from the host (a sync itself): made before the checked calls

    def calls():
        lanekit.flash_attn_varlen_func(q, k, v, cq, ck, 3, 4, causal=True)
        lanekit.flash_attn_with_kvcache(q[:2, None], kc, vc, new, new, cache_seqlens=seqlens, block_table=table,
                                        causal=True)
        lanekit.kv_cache.reshape_and_cache(new[:, 0], new[:, 0], kc, vc, slots)
        lanekit.kv_cache.gather_cache(kc, vc, table, seqlens, max_seqlen=12)

    calls()                          # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    lanekit.check_errors()
