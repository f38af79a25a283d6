"""MLA decode (flash_mla_with_kvcache, get_mla_metadata): the issue's cases against the float64
oracle with outputs poisoned, caches quantized through lanekit.kv_cache.quantize_kv, the split
merge, the metadata's reuse, device-side index errors, and bad input."""

import pytest
import torch

import lanekit
from lanekit.attention.registry import ATTENTION_FWD
from lanekit.attention.registry_mla import mla_case
from lanekit.reference import attention as attention_ref
from lanekit.reference import mla as ref
from lanekit.runtime import errors
from lanekit.testing import assert_close, poisoned_outputs, upcast

LANES = ["triton", "reference"]
ON_GPU = torch.cuda.is_available()


def call(kw, lane, **extra):
    args = dict(softmax_scale=kw["softmax_scale"], causal=kw["causal"], num_splits=kw["num_splits"],
                k_cache_scale=kw["k_cache_scale"], lane=lane)
    args.update(extra)
    with poisoned_outputs():
        return lanekit.flash_mla_with_kvcache(kw["q"], kw["k_cache"], kw["block_table"], kw["cache_seqlens"],
                                              kw["head_dim_v"], **args)


def oracle(kw):
    # the cache as it is: the oracle upcasts the pages it reads
    return ref.flash_mla_with_kvcache(
        upcast(kw["q"]), kw["k_cache"], kw["block_table"], kw["cache_seqlens"], kw["head_dim_v"],
        softmax_scale=kw["softmax_scale"], causal=kw["causal"], k_cache_scale=upcast(kw["k_cache_scale"]))


def check(kw, lane, **extra):
    out, lse = call(kw, lane, **extra)
    want_out, want_lse = oracle(kw)
    assert out.dtype == kw["q"].dtype and lse.dtype == torch.float32
    assert_close(out, want_out, ATTENTION_FWD)
    assert_close(lse, want_lse, "lse")
    return out, lse


@pytest.mark.parametrize("lane", LANES)
def test_deepseek_shape_576_512_lengths_0_1_and_70(device, lane):
    kw = mla_case("test 576/512", device, B=3, H=16, seqlens=(0, 1, 70)).kwargs
    out, lse = check(kw, lane)
    assert out.shape == (3, 1, 16, 512) and lse.shape == (3, 16, 1)
    # a sequence with no cached token: out 0, lse -inf (never NaN)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_split_counts_agree_with_the_oracle(device, splits):
    kw = mla_case("test splits", device, D=80, Dv=64, H=6, page_size=5, seqlens=(41, 9, 0),
                  B=3, num_splits=splits).kwargs
    check(kw, "triton")


def test_split_zero_and_none_pick_a_count(device):
    kw = mla_case("test heuristic", device, D=80, Dv=64, H=4, page_size=8, seqlens=(50, 3)).kwargs
    for splits in (0, None):
        kw["num_splits"] = splits
        check(kw, "triton")


@pytest.mark.parametrize("lane", LANES)
def test_causal_multi_token_is_bottom_right_aligned(device, lane):
    # Sq = 4 over 2 and 20 keys: in sequence 0, query i sees keys j <= i - 2, so rows 0 and 1 see none
    kw = mla_case("test causal", device, Sq=4, H=3, D=80, Dv=64, page_size=6, seqlens=(2, 20), causal=True,
                  num_splits=2).kwargs
    out, lse = check(kw, lane)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2])) and torch.isneginf(lse[0, :, :2]).all()
    assert torch.isfinite(lse[0, :, 2:]).all()


@pytest.mark.parametrize("lane", LANES)
def test_causal_at_one_query_is_not_causal(device, lane):
    # the one query row is the last: bottom-right aligned, it sees every key
    kw = mla_case("test causal Sq1", device, H=4, D=80, Dv=64, page_size=16, seqlens=(30, 7)).kwargs
    assert not kw["causal"]
    a = call(kw, lane, causal=True)
    b = call(kw, lane, causal=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    want_out, want_lse = oracle(kw)
    assert_close(a[0], want_out, ATTENTION_FWD)
    assert_close(a[1], want_lse, "lse")


@pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_caches_quantized_by_quantize_kv(device, codes):
    # a bf16 latent cache quantized with lanekit's own quantize_kv: codes and (num_blocks, page_size, 1) scales
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 8, 576, generator=g).to(torch.bfloat16).to(device)
    latent = torch.randn(9, 16, 1, 576, generator=g).to(torch.bfloat16).to(device)
    cache, scale = lanekit.kv_cache.quantize_kv(latent, codes)
    assert cache.dtype == codes and scale.shape == (9, 16, 1)
    table = torch.tensor([[4, 0, 7], [2, 8, 1]], dtype=torch.int32, device=device)
    seqlens = torch.tensor([40, 17], dtype=torch.int32, device=device)
    kw = dict(q=q, k_cache=cache, block_table=table, cache_seqlens=seqlens, head_dim_v=512,
              softmax_scale=576 ** -0.5, causal=False, num_splits=2, k_cache_scale=scale)
    check(kw, "triton", is_fp8_kvcache=codes != torch.int8)


def test_quantized_cache_is_close_to_the_values_it_codes(device):
    # e4m3 codes of a bf16 cache give attention close to the bf16 cache's (the codes' rounding only)
    kw = mla_case("test e4m3 vs bf16", device, H=4, D=80, Dv=64, page_size=8, seqlens=(60, 25)).kwargs
    exact, _ = check(kw, "triton")
    codes, scale = lanekit.kv_cache.quantize_kv(kw["k_cache"].float().nan_to_num(), torch.float8_e4m3fn)
    coded, _ = check(dict(kw, k_cache=codes, k_cache_scale=scale), "triton")
    assert (coded.float() - exact.float()).abs().max() < 0.1


def test_gqa_cache_heads_and_strided_query(device):
    kw = mla_case("test gqa", device, H=6, Hkv=3, D=80, Dv=64, page_size=4, seqlens=(13, 22), q_strided=True).kwargs
    assert not kw["q"].is_contiguous()
    check(kw, "triton")


def test_without_rope_it_is_flash_attn_with_kvcache_mqa(device):
    # D = Dv: MLA is multi-query attention with V = K: the kernel against flash_attn_with_kvcache's
    # float64 oracle (other code than MLA's own oracle)
    kw = mla_case("test vs kvcache", device, H=4, D=64, Dv=64, page_size=16, seqlens=(37, 5)).kwargs
    out, lse = call(kw, "triton")
    cache = kw["k_cache"].nan_to_num()
    want, want_lse, _, _ = attention_ref.flash_attn_with_kvcache(
        upcast(kw["q"]), upcast(cache), upcast(cache), cache_seqlens=kw["cache_seqlens"],
        block_table=kw["block_table"].clamp(max=cache.shape[0] - 1), softmax_scale=kw["softmax_scale"])
    assert_close(out, want, ATTENTION_FWD)
    assert_close(lse, want_lse, "lse")


def test_metadata_is_filled_once_and_reused(device):
    kw = mla_case("test metadata", device, H=4, D=80, Dv=64, page_size=8, seqlens=(30, 12)).kwargs
    meta, second = lanekit.get_mla_metadata(kw["cache_seqlens"], 4, 1)
    assert second is None and meta.max_seqlen_k == 30 and meta.num_splits is None
    first = check(kw, "triton", tile_scheduler_metadata=meta, num_splits=None)
    assert meta.num_splits is not None and meta.config is not None
    chosen = meta.num_splits
    again = call(kw, "triton", tile_scheduler_metadata=meta, num_splits=None)
    assert meta.num_splits == chosen
    assert torch.equal(first[0], again[0])
    other = mla_case("test metadata other", device, H=8, D=80, Dv=64, page_size=8, seqlens=(30, 12)).kwargs
    with pytest.raises(ValueError, match="^tile_scheduler_metadata: expected the shapes"):
        call(other, "triton", tile_scheduler_metadata=meta, num_splits=None)


def test_metadata_positional_as_flash_mla_calls_it(device):
    # FlashMLA's order: (q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, ...)
    kw = mla_case("test positional", device, H=4, D=80, Dv=64, page_size=8, seqlens=(19, 2)).kwargs
    meta, num_splits = lanekit.get_mla_metadata(kw["cache_seqlens"], 4, 1)
    out, lse = lanekit.flash_mla_with_kvcache(kw["q"], kw["k_cache"], kw["block_table"], kw["cache_seqlens"], 64,
                                              meta, num_splits, kw["softmax_scale"], False, lane="triton")
    want_out, want_lse = oracle(kw)
    assert_close(out, want_out, ATTENTION_FWD)
    assert_close(lse, want_lse, "lse")


def _bad_index_case(device):
    kw = mla_case("test bad index", device, H=4, D=80, Dv=64, page_size=8, seqlens=(20, 12)).kwargs
    kw["k_cache"] = kw["k_cache"].nan_to_num()
    return kw


def test_bad_page_ids_are_masked_and_recorded(device):
    errors.check_errors()
    kw = _bad_index_case(device)
    table = kw["block_table"].clone()
    table[0, 1] = -3                                   # sequence 0's second page (keys 8..15)
    table[1, 0] = kw["k_cache"].shape[0]               # sequence 1's first page (keys 0..7)
    out, lse = call(dict(kw, block_table=table), "triton")
    with pytest.raises(ValueError, match="flash_mla_with_kvcache: .*block_table page id"):
        lanekit.check_errors()
    errors.check_errors()                              # cleared
    # the keys of a bad page count for nothing: the oracle over the other keys (order does not
    # matter without a mask), sequence 0 keeping pages 0 and 2 (8 + 4 keys), sequence 1 its page 1
    good = kw["block_table"].clone()
    good[0, 1] = kw["block_table"][0, 2]
    good[1, 0] = kw["block_table"][1, 1]
    lens = torch.tensor([12, 4], dtype=torch.int32, device=device)
    want_out, want_lse = oracle(dict(kw, block_table=good, cache_seqlens=lens))
    assert_close(out, want_out, ATTENTION_FWD)
    assert_close(lse, want_lse, "lse")


def test_lengths_past_the_table_are_clamped_and_recorded(device):
    errors.check_errors()
    kw = _bad_index_case(device)
    capacity = kw["block_table"].shape[1] * 8
    lens = torch.tensor([capacity + 5, -2], dtype=torch.int32, device=device)
    table = kw["block_table"].clone()
    table[:, :] = torch.arange(table.numel(), device=device).reshape(table.shape).remainder(kw["k_cache"].shape[0])
    out, lse = call(dict(kw, cache_seqlens=lens, block_table=table), "triton")
    clamped = dict(kw, cache_seqlens=torch.tensor([capacity, 0], dtype=torch.int32, device=device), block_table=table)
    want_out, want_lse = oracle(clamped)
    assert_close(out, want_out, ATTENTION_FWD)
    assert_close(lse, want_lse, "lse")
    with pytest.raises(ValueError, match="cache_seqlens value outside"):
        lanekit.check_errors()


def test_check_indices_eagerly_raises_at_the_call(device, monkeypatch):
    errors.check_errors()
    kw = _bad_index_case(device)
    table = kw["block_table"].clone()
    table[0, 0] = -1
    monkeypatch.setenv("LANEKIT_CHECK_INDICES", "1")
    with pytest.raises(ValueError, match="^block_table: expected pages in"):
        call(dict(kw, block_table=table), "triton")
    errors.check_errors()                              # nothing launched, nothing recorded


def test_reference_lane_checks_index_values():
    # host tensors: the reference lane reads their values, on a machine with a GPU or without
    kw = _bad_index_case("cpu")
    lens = torch.tensor([10_000, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="^cache_seqlens: expected at most"):
        call(dict(kw, cache_seqlens=lens), "reference")


BAD = {
    "q fp32": (TypeError, "q: expected dtype"),
    "q 3-d": (ValueError, "q: expected 4 dimensions"),
    "cache dtype": (TypeError, "k_cache: expected dtype"),
    "cache head dim": (ValueError, "k_cache: expected head dim 80"),
    "heads": (ValueError, "k_cache: expected a number of heads that divides H=4"),
    "head_dim_v 0": (ValueError, "head_dim_v: expected an int in"),
    "head_dim_v float": (TypeError, "head_dim_v: expected an int"),
    "rope too wide": (ValueError, "head_dim_v: expected at least"),
    "table int64": (TypeError, "block_table: expected dtype"),
    "table rows": (ValueError, "block_table: expected 2 rows"),
    "seqlens shape": (ValueError, "cache_seqlens: expected shape"),
    "scale missing": (ValueError, "k_cache_scale: a cache of torch.int8 codes needs its scales"),
    "scale given": (ValueError, "k_cache_scale: expected None for a cache of"),
    "scale shape": (ValueError, "k_cache_scale: expected shape"),
    "num_splits 129": (ValueError, "num_splits: expected an int in"),
    "num_splits tensor": (TypeError, "num_splits: expected an int"),
    "softmax_scale nan": (ValueError, "softmax_scale: expected a finite float"),
    "causal int": (TypeError, "causal: expected a bool"),
    "is_fp8 with bf16": (ValueError, "is_fp8_kvcache: True needs"),
    "metadata tensor": (TypeError, "tile_scheduler_metadata: expected the FlashMLASchedMeta"),
    "sparse indices": (ValueError, "indices: expected None"),
    "attn_sink": (ValueError, "attn_sink: expected None"),
    "max_seqlen_k negative": (ValueError, "max_seqlen_k: expected an int >= 0"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_raises_a_clear_error(device, case):
    kw = mla_case("test bad input", device, H=4, D=80, Dv=64, page_size=8, seqlens=(9, 3)).kwargs
    q, cache, table, lens = kw["q"], kw["k_cache"], kw["block_table"], kw["cache_seqlens"]
    args = [q, cache, table, lens, 64]
    extra = {}
    codes = lanekit.kv_cache.quantize_kv(cache.float().nan_to_num(), torch.int8)
    if case == "q fp32":
        args[0] = q.float()
    elif case == "q 3-d":
        args[0] = q[0]
    elif case == "cache dtype":
        args[1] = cache.half()
    elif case == "cache head dim":
        args[1] = cache[..., :72]
    elif case == "heads":
        args[1] = cache.expand(-1, -1, 3, -1)
    elif case == "head_dim_v 0":
        args[4] = 0
    elif case == "head_dim_v float":
        args[4] = 64.0
    elif case == "rope too wide":
        q2 = torch.zeros(2, 1, 4, 300, dtype=q.dtype, device=device)
        args[0], args[1], args[4] = q2, torch.zeros(3, 8, 1, 300, dtype=q.dtype, device=device), 100
    elif case == "table int64":
        args[2] = table.long()
    elif case == "table rows":
        args[2] = table[:1]
    elif case == "seqlens shape":
        args[3] = lens[:1]
    elif case == "scale missing":
        args[1] = codes[0]
    elif case == "scale given":
        extra["k_cache_scale"] = torch.ones(cache.shape[:3], device=device)
    elif case == "scale shape":
        args[1] = codes[0]
        extra["k_cache_scale"] = codes[1][:1]
    elif case == "num_splits 129":
        extra["num_splits"] = 129
    elif case == "num_splits tensor":
        extra["num_splits"] = torch.tensor([0, 1, 2], dtype=torch.int32)
    elif case == "softmax_scale nan":
        extra["softmax_scale"] = float("nan")
    elif case == "causal int":
        extra["causal"] = 1
    elif case == "is_fp8 with bf16":
        extra["is_fp8_kvcache"] = True
    elif case == "metadata tensor":
        extra["tile_scheduler_metadata"] = torch.zeros(4, 8, dtype=torch.int32)
    elif case == "sparse indices":
        extra["indices"] = torch.zeros(2, 1, 8, dtype=torch.int32)
    elif case == "attn_sink":
        extra["attn_sink"] = torch.zeros(4)
    elif case == "max_seqlen_k negative":
        extra["max_seqlen_k"] = -1
    error, message = BAD[case]
    with pytest.raises(error, match=f"^{message}"):
        lanekit.flash_mla_with_kvcache(*args, lane="triton", **extra)


def test_get_mla_metadata_checks_its_arguments():
    with pytest.raises(ValueError, match="^topk: expected None"):
        lanekit.get_mla_metadata(torch.tensor([3], dtype=torch.int32), 16, 1, 16, False, 2048)
    with pytest.raises(TypeError, match="^cache_seqlens: expected dtype"):
        lanekit.get_mla_metadata(torch.tensor([3]))
    with pytest.raises(ValueError, match="^cache_seqlens: expected values >= 0"):
        lanekit.get_mla_metadata(torch.tensor([3, -1], dtype=torch.int32))
    meta, _ = lanekit.get_mla_metadata(max_seqlen_k=4096)
    assert meta.max_seqlen_k == 4096


@pytest.mark.skipif(not ON_GPU, reason="device syncs and CUDA graphs are a GPU's")
def test_no_device_sync_and_cuda_graph_replay():
    kw = mla_case("test graph", "cuda", B=4, H=16, page_size=64, seqlens=(300, 64, 1, 0)).kwargs
    meta, _ = lanekit.get_mla_metadata(kw["cache_seqlens"])
    run = lambda: lanekit.flash_mla_with_kvcache(kw["q"], kw["k_cache"], kw["block_table"], kw["cache_seqlens"],  # noqa: E731
                                                 512, meta, None, kw["softmax_scale"])
    eager = run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])


def test_mla_benchmark_cases_run_and_check_on_the_cpu():
    # benchmarks.mla runs on the GPU only in the lead's sessions: its inputs, check and peers run here
    from benchmarks import mla, run

    assert set(run.GROUPS["mla"]) == set(mla.FAMILIES) <= set(run.FAMILIES)
    names = [m.name(c) for m in mla.FAMILIES.values() for c in m.cases(False)]
    assert len(names) == len(set(names)) == 16 and "mla B=64 Sk=32k H=128 bf16" in names
    assert mla.flops(dict(sk=4096, H=128, cache="bf16")) / mla.cache_bytes(dict(sk=4096, H=128, cache="bf16")) \
        == 2 * 128 * (576 + 512) / 1152
    lines = mla.smoke("cpu")
    assert len(lines) == 8 and all(": ok, " in line for line in lines), lines


@pytest.mark.skipif(not ON_GPU, reason="more than 2^31 elements needs GPU memory")
def test_a_cache_past_2_31_elements_is_addressed_in_int64():
    # 58300 pages of 64 rows of 576: 2.15e9 elements (4.3 GB bf16); the sequences read the last pages
    blocks = 58300
    cache = torch.zeros(blocks, 64, 1, 576, dtype=torch.bfloat16, device="cuda")
    assert cache.numel() > 2**31
    g = torch.Generator(device="cuda").manual_seed(5)
    cache[-8:] = torch.randn(8, 64, 1, 576, generator=g, device="cuda").to(torch.bfloat16)
    table = torch.arange(blocks - 8, blocks, dtype=torch.int32, device="cuda").reshape(2, 4)
    lens = torch.tensor([256, 130], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 1, 16, 576, generator=g, device="cuda").to(torch.bfloat16)
    kw = dict(q=q, k_cache=cache, block_table=table, cache_seqlens=lens, head_dim_v=512,
              softmax_scale=576 ** -0.5, causal=False, num_splits=3, k_cache_scale=None)
    check(kw, "triton")


def test_works_under_torch_compile_fullgraph(device):
    kw = mla_case("test compile", device, H=4, D=80, Dv=64, page_size=8, seqlens=(21, 6), num_splits=2).kwargs

    def step(q, cache, table, lens):
        out, lse = lanekit.flash_mla_with_kvcache(q, cache, table, lens, 64, None, 2,
                                                  softmax_scale=kw["softmax_scale"], lane="triton")
        return out.float().sum(-1), lse

    # on the CPU the kernels run interpreted, so the graph runs eagerly (aot_eager); on the GPU,
    # inductor compiles everything around the custom op
    compiled = torch.compile(step, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    args = (kw["q"], kw["k_cache"], kw["block_table"], kw["cache_seqlens"])
    with poisoned_outputs():
        ours = compiled(*args)
        eager = step(*args)
    assert torch.equal(ours[1], eager[1])
    assert_close(ours[0], eager[0].double(), "eltwise", dtype=torch.float32)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("B,Sq", [(0, 1), (2, 0)], ids=["batch 0", "Sq 0"])
def test_empty_batch_or_queries_give_empty_results(device, lane, B, Sq):
    q = torch.zeros(B, Sq, 4, 80, dtype=torch.bfloat16, device=device)
    cache = torch.zeros(3, 8, 1, 80, dtype=torch.bfloat16, device=device)
    table = torch.zeros(B, 2, dtype=torch.int32, device=device)
    lens = torch.zeros(B, dtype=torch.int32, device=device)
    out, lse = lanekit.flash_mla_with_kvcache(q, cache, table, lens, 64, lane=lane)
    assert out.shape == (B, Sq, 4, 64) and lse.shape == (B, 4, Sq) and lse.dtype == torch.float32


def test_argument_errors_are_runtime_errors_too(device):
    # FlashMLA's checks raise RuntimeError (TORCH_CHECK); code written for it catches that
    kw = mla_case("test runtime error", device, H=4, D=80, Dv=64, page_size=8, seqlens=(9, 3)).kwargs
    with pytest.raises(RuntimeError, match="^head_dim_v: expected an int in"):
        lanekit.flash_mla_with_kvcache(kw["q"], kw["k_cache"], kw["block_table"], kw["cache_seqlens"], 0)
    with pytest.raises(RuntimeError, match="^q: expected dtype"):
        lanekit.flash_mla_with_kvcache(kw["q"].float(), kw["k_cache"], kw["block_table"], kw["cache_seqlens"], 64)
    with pytest.raises(RuntimeError, match="^topk: expected None"):
        lanekit.get_mla_metadata(None, 4, 1, 4, False, 64)


@pytest.mark.parametrize("lane", LANES)
def test_a_nan_in_a_query_or_a_seen_key_gives_nan_rows_as_the_oracle(device, lane):
    # the oracle once took a NaN lse for "sees no key" and gave 0 there: NaN must stay visible,
    # and in the same rows on both lanes (a whole sequence for a key, one head for a query)
    kw = mla_case("test nan rows", device, B=2, H=4, D=80, Dv=64, page_size=8, seqlens=(9, 3)).kwargs
    q = kw["q"].clone()
    q[0, 0, 1, 5] = float("nan")                                  # sequence 0, head 1
    cache = kw["k_cache"].clone()
    cache[kw["block_table"][1, 0].long(), 2, 0, 70] = float("nan")  # sequence 1's token 2 (a rope feature)
    kw = {**kw, "q": q, "k_cache": cache}
    out, lse = call(kw, lane)
    want_out, want_lse = oracle(kw)
    rows = torch.zeros(2, 1, 4, dtype=torch.bool)
    rows[0, 0, 1] = rows[1] = True
    for got, want in ((out.cpu(), want_out.cpu()), (lse.cpu().permute(0, 2, 1), want_lse.cpu().permute(0, 2, 1))):
        got_nan = got.isnan() if got.dim() == 3 else got.isnan().all(-1)
        want_nan = want.isnan() if want.dim() == 3 else want.isnan().all(-1)
        assert torch.equal(got_nan, rows) and torch.equal(want_nan, rows)
    assert_close(out[~rows.to(out.device)], want_out[~rows.to(out.device)], ATTENTION_FWD)


@pytest.mark.parametrize("lane", LANES)
def test_an_infinite_score_gives_nan_where_the_oracle_does(device, lane):
    # a +inf score (an inf rope feature of a seen key): the oracle's logsumexp gave lse +inf where
    # the kernel (and attention's oracle) give NaN; a -inf score is a key that counts for nothing
    kw = mla_case("test inf score", device, B=2, H=4, D=80, Dv=64, page_size=8, seqlens=(9, 3)).kwargs
    cache = kw["k_cache"].clone()
    cache[kw["block_table"][1, 0].long(), 1, 0, 70] = float("inf")   # sequence 1's token 1
    kw = {**kw, "k_cache": cache}
    out, lse = call(kw, lane)
    want_out, want_lse = oracle(kw)
    nan_rows = want_lse.isnan()
    assert nan_rows[1].any() and not nan_rows.all()                  # heads with q[70] > 0 only
    assert torch.equal(lse.isnan().cpu(), nan_rows.cpu())
    assert torch.equal(out.isnan().all(-1).cpu(), nan_rows.permute(0, 2, 1).cpu())
    keep = ~nan_rows.permute(0, 2, 1)
    assert_close(out[keep.to(out.device)], want_out[keep.to(want_out.device)], ATTENTION_FWD)
    assert_close(lse[~nan_rows.to(lse.device)], want_lse[~nan_rows.to(want_lse.device)], "lse")
