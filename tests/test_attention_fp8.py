"""Attention sinks and fp8/int8 attention with FlashAttention-3's descales, against the float64 oracle.

The registered samples (flash_attn_func.fp8, flash_attn_varlen_func.fp8, flash_attn_with_kvcache.fp8,
and the sinks samples of the 16-bit ops) run on every lane through tests/test_check.py; these pin
the behaviours one by one.
"""

import pytest
import torch

import lanekit
from lanekit.attention.registry import ATTENTION_BWD, ATTENTION_DSINKS, ATTENTION_FP8, ATTENTION_FWD, LSE_FP8
from lanekit.reference import attention as ref
from lanekit.testing import assert_close, compare, poisoned_outputs, randn, upcast

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def qkv(B, Sq, Sk, Hq, Hkv, D, device, dtype=torch.bfloat16, seed=0, Dv=None):
    g = gen(seed)
    return (randn(B, Sq, Hq, D, dtype=dtype, device=device, generator=g),
            randn(B, Sk, Hkv, D, dtype=dtype, device=device, generator=g),
            randn(B, Sk, Hkv, Dv or D, dtype=dtype, device=device, generator=g))


def codes(x, dtype):
    """fp32 values as fp8/int8 codes (int8: rounded, about 4 standard deviations to 127)."""
    if dtype == torch.int8:
        return (x.float() * 31.75).round().clamp(-127, 127).to(dtype)
    return x.float().mul(8.0).to(dtype)


def descales(B, Hkv, device, seed):
    g = gen(seed)
    return [((torch.rand(B, Hkv, generator=g) + 0.5) / 8.0).to(device) for _ in range(3)]


# ---- sinks ----

def test_sinks_of_minus_infinity_add_nothing(device):
    q, k, v = qkv(1, 20, 33, 2, 1, 64, device)
    sinks = torch.full((2,), float("-inf"), device=device)
    with poisoned_outputs():
        plain, plain_lse, _ = lanekit.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, lane="triton")
        out, lse, _ = lanekit.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, sinks=sinks, lane="triton")
    assert torch.equal(out, plain) and torch.equal(lse, plain_lse)
    ref_out, ref_lse = ref.flash_attn(*map(upcast, (q, k, v)), softmax_scale=64 ** -0.5, window_size=(-1, 0))
    assert_close(out, ref_out, ATTENTION_FWD)
    assert_close(lse, ref_lse, "lse")


def test_a_row_that_sees_no_key_gives_zero_and_the_sink_as_lse(device):
    q, k, v = qkv(1, 6, 3, 2, 2, 32, device)
    sinks = torch.tensor([0.5, -2.0], device=device)
    with poisoned_outputs():
        out, lse, _ = lanekit.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, sinks=sinks, lane="triton")
    # Sq 6 > Sk 3, causal: queries 0..2 see no key
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    assert torch.allclose(lse[0, :, :3], sinks[:, None].expand(2, 3))
    ref_out, ref_lse = ref.flash_attn(*map(upcast, (q, k, v)), softmax_scale=32 ** -0.5, window_size=(-1, 0),
                                      sinks=upcast(sinks))
    assert_close(out, ref_out, ATTENTION_FWD)
    assert_close(lse, ref_lse, "lse")


def test_the_sink_takes_its_share_of_every_row(device):
    # one key of value 1 everywhere: out = e^s / (e^s + e^sink) exactly, the sink's value being 0
    q = torch.zeros(1, 1, 1, 16, dtype=torch.float32, device=device)
    k = torch.zeros(1, 1, 1, 16, dtype=torch.float32, device=device)
    v = torch.ones(1, 1, 1, 16, dtype=torch.float32, device=device)
    with poisoned_outputs():
        out = lanekit.flash_attn_func(q, k, v, sinks=torch.tensor([0.0], device=device), lane="triton")
    assert torch.allclose(out, torch.full_like(out, 0.5))



def test_a_sink_far_above_the_scores_takes_every_row_on_both_lanes(device):
    # e^{sink - m} overflowed float64 in the oracle (lse inf, where the kernel, which rescales to
    # max(m, sink), gives the sink); a sink of +inf gives NaN on both lanes (inf - inf), not 0 on one
    q, k, v = qkv(1, 4, 6, 2, 1, 16, device, seed=13)
    sinks = torch.tensor([800.0, float("inf")], device=device)
    outs = [lanekit.flash_attn_func(q, k, v, sinks=sinks, return_attn_probs=True, lane=lane)[:2]
            for lane in ("triton", "reference")]
    want_out, want_lse = ref.flash_attn(*map(upcast, (q, k, v)), softmax_scale=16 ** -0.5, window_size=(-1, -1),
                                        sinks=upcast(sinks))
    for out, lse in outs + [(want_out, want_lse)]:
        assert torch.equal(out[:, :, 0].float().cpu(), torch.zeros(1, 4, 16))   # every weight on the sink
        assert torch.equal(lse[:, 0].float().cpu(), torch.full((1, 4), 800.0))
        assert out[:, :, 1].isnan().all() and lse[:, 1].isnan().all()


@pytest.mark.parametrize("with_lse_grad", [False, True], ids=["dout", "dout+dlse"])
def test_sink_gradient_matches_the_float64_oracles_autograd(device, with_lse_grad):
    q, k, v = qkv(2, 24, 40, 4, 2, 64, device, dtype=torch.float16, seed=3)
    sinks = randn(4, dtype=torch.float32, device=device, generator=gen(4), scale=2.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    with poisoned_outputs():
        out, lse, _ = lanekit.flash_attn_func(*leaves[:3], causal=True, return_attn_probs=True, sinks=leaves[3],
                                              lane="triton")
        dout = randn(*out.shape, dtype=out.dtype, device=device, generator=gen(5))
        dlse = randn(*lse.shape, dtype=torch.float32, device=device, generator=gen(6))
        loss = (out.float() * dout.float()).sum() + ((lse * dlse).sum() if with_lse_grad else 0)
        grads = torch.autograd.grad(loss, leaves)
    r = [upcast(t).requires_grad_() for t in (q, k, v, sinks)]
    r_out, r_lse = ref.flash_attn(*r[:3], softmax_scale=64 ** -0.5, window_size=(-1, 0), sinks=r[3])
    r_loss = (r_out * upcast(dout)).sum() + ((r_lse * upcast(dlse)).sum() if with_lse_grad else 0)
    expected = torch.autograd.grad(r_loss, r)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected):
        assert compare(got, want, ATTENTION_BWD).ok, name
    assert grads[3].abs().max() > 0
    assert_close(grads[3], expected[3], ATTENTION_DSINKS)


def test_sink_gradient_by_hand_is_minus_the_sinks_share_times_delta():
    # the derivation the Triton lane uses, on the oracle in float64: d sink = -sum P_sink (dO . O - dLSE)
    g = gen(7)
    q, k, v = (torch.randn(2, 9, 3, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    out, lse = ref.flash_attn(q, k, v, softmax_scale=0.3, window_size=(-1, 0), sinks=sinks)
    dout, dlse = torch.randn(out.shape, generator=g, dtype=torch.float64), torch.randn(lse.shape, generator=g, dtype=torch.float64)
    (auto,) = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), sinks)
    delta = (dout * out).sum(-1).transpose(1, 2) - dlse                    # (B, Hq, Sq)
    by_hand = -(torch.exp(sinks.detach()[None, :, None] - lse.detach()) * delta.detach()).sum((0, 2))
    assert torch.allclose(auto, by_hand, rtol=1e-12, atol=1e-12)


def test_varlen_sink_gradient_matches_the_oracle(device):
    g = gen(8)
    cu = torch.tensor([0, 9, 9, 30], dtype=torch.int32, device=device)
    q = randn(30, 4, 32, dtype=torch.bfloat16, device=device, generator=g)
    k = randn(30, 2, 32, dtype=torch.bfloat16, device=device, generator=g)
    v = randn(30, 2, 32, dtype=torch.bfloat16, device=device, generator=g)
    sinks = randn(4, dtype=torch.float32, device=device, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    with poisoned_outputs():
        out = lanekit.flash_attn_varlen_func(*leaves[:3], cu, cu, 21, 21, causal=True, sinks=leaves[3], lane="triton")
        dout = randn(*out.shape, dtype=out.dtype, device=device, generator=g)
        grads = torch.autograd.grad(out, leaves, dout)
    expected = ref.flash_attn_varlen_backward(*map(upcast, (dout, q, k, v)), cu_seqlens_q=cu.cpu(),
                                              cu_seqlens_k=cu.cpu(), max_seqlen_q=21, max_seqlen_k=21,
                                              softmax_scale=32 ** -0.5, window_size=(-1, 0), sinks=upcast(sinks))
    for got, want in zip(grads[:3], expected[:3]):
        assert_close(got, want, ATTENTION_BWD)
    assert_close(grads[3], expected[3], ATTENTION_DSINKS)


def test_kvcache_sinks_are_added_once_whatever_the_split_count(device):
    g = gen(9)
    q = randn(2, 1, 4, 64, dtype=torch.bfloat16, device=device, generator=g)
    kc = randn(2, 50, 2, 64, dtype=torch.bfloat16, device=device, generator=g)
    vc = randn(2, 50, 2, 64, dtype=torch.bfloat16, device=device, generator=g)
    seqlens = torch.tensor([50, 3], dtype=torch.int32, device=device)
    sinks = randn(4, dtype=torch.float32, device=device, generator=g, scale=2.0)
    ref_out, ref_lse, _, _ = ref.flash_attn_with_kvcache(*map(upcast, (q, kc, vc)), cache_seqlens=seqlens,
                                                         softmax_scale=0.125, sinks=upcast(sinks))
    for splits in (1, 4):
        with poisoned_outputs():
            out, lse = lanekit.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=splits,
                                                       sinks=sinks, return_softmax_lse=True, lane="triton")
        assert_close(out, ref_out, ATTENTION_FWD)
        assert_close(lse, ref_lse, "lse")



@pytest.mark.parametrize("view", ["strided", "expanded"])
def test_strided_and_expanded_sinks_are_read_by_their_strides(device, view):
    # the kernels read sinks[h] at Sinks + h: a strided view was read as contiguous (wrong logits)
    # and an expanded one (stride 0) past its one element
    q, k, v = qkv(2, 5, 9, 4, 2, 32, device, seed=11)
    if view == "strided":
        base = randn(4, 2, dtype=torch.float32, device=device, generator=gen(12), scale=2.0).requires_grad_()
        as_view = lambda t: t[:, 0]  # noqa: E731
    else:
        base = torch.full((1,), 1.5, device=device, requires_grad=True)
        as_view = lambda t: t.expand(4)  # noqa: E731
    with poisoned_outputs():
        out, lse, _ = lanekit.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, sinks=as_view(base),
                                              lane="triton")
        (dbase,) = torch.autograd.grad(out.float().sum(), base)
    r_base = upcast(base.detach()).requires_grad_()
    ref_out, ref_lse = ref.flash_attn(*map(upcast, (q, k, v)), softmax_scale=32 ** -0.5, window_size=(-1, 0),
                                      sinks=as_view(r_base))
    assert_close(out, ref_out, ATTENTION_FWD)
    assert_close(lse, ref_lse, "lse")
    (want,) = torch.autograd.grad(ref_out.sum(), r_base)
    assert_close(dbase, want, ATTENTION_DSINKS)
    seqlens = torch.tensor([9, 4], dtype=torch.int32, device=device)
    want_out, want_lse, _, _ = ref.flash_attn_with_kvcache(*map(upcast, (q[:, :1], k, v)), cache_seqlens=seqlens,
                                                           softmax_scale=0.5, sinks=as_view(r_base.detach()))
    for splits in (1, 3):
        with poisoned_outputs():
            got, got_lse = lanekit.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=seqlens, softmax_scale=0.5,
                                                           num_splits=splits, sinks=as_view(base.detach()),
                                                           return_softmax_lse=True, lane="triton")
        assert_close(got, want_out, ATTENTION_FWD)
        assert_close(got_lse, want_lse, "lse")

# ---- fp8 and int8 ----

@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_each_fp8_format_is_within_one_step_of_its_own_rounding_of_p(device, dtype):
    # 300 keys whose scores grow along the sequence: the running max moves from block to block
    q, k, v = qkv(1, 32, 300, 2, 1, 64, device, dtype=torch.float32, seed=11)
    k = k + torch.linspace(0, 1.5, 300, device=device)[None, :, None, None]
    q8, k8, v8 = (codes(t, dtype) for t in (q, k, v))
    qd, kd, vd = descales(1, 1, device, 12)
    with poisoned_outputs():
        out = lanekit.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, lane="triton")
    assert out.dtype == torch.bfloat16
    expected, _ = ref.flash_attn_quantized(q8, k8, v8, softmax_scale=0.125, q_descale=qd, k_descale=kd, v_descale=vd)
    assert_close(out, expected, ATTENTION_FP8, dtype=dtype)   # one step of this format, not two e4m3 steps


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_p_is_rounded_to_vs_fp8_format_before_p_v(device, dtype):
    # 16 keys (one key block: the kernel's max is the row's): the oracle that rounds P as the
    # kernel does is within the 16-bit rule; the same oracle without that rounding is not. q and k
    # are small integers, so every score is exact whatever the tensor cores' fp8 accumulation
    # (LSE_FP8): P's rounding is then the kernel's and the oracle's alike.
    g = gen(22)
    q8, k8 = (torch.randint(-3, 4, shape, generator=g).float().to(device).to(dtype)
              for shape in ((1, 16, 2, 64), (1, 16, 1, 64)))
    v8 = codes(randn(1, 16, 1, 64, dtype=torch.float32, device=device, generator=g), dtype)
    one = torch.ones(1, 1, device=device)
    with poisoned_outputs():
        out = lanekit.flash_attn_func(q8, k8, v8, softmax_scale=0.125, q_descale=one, k_descale=one,
                                      v_descale=one / 8, lane="triton")
    kw = dict(softmax_scale=0.125, q_descale=upcast(one), k_descale=upcast(one), v_descale=upcast(one) / 8)
    rounded, _ = ref.flash_attn(*map(upcast, (q8, k8, v8)), p_dtype=dtype, **kw)
    unrounded, _ = ref.flash_attn(*map(upcast, (q8, k8, v8)), **kw)
    assert_close(out, rounded, ATTENTION_FWD)
    assert not compare(out, unrounded, ATTENTION_FWD).ok


@pytest.mark.parametrize("dtype", FP8 + (torch.int8,), ids=["e4m3", "e5m2", "int8"])
def test_descales_multiply_the_product_and_never_the_bias_or_alibi(device, dtype):
    # q_descale * 2 with softmax_scale / 2 is the same score; a bias and ALiBi that dwarf the
    # scores would be rescaled (and change the result) if the descales touched them.
    q, k, v = qkv(1, 17, 40, 2, 2, 64, device, dtype=torch.float32, seed=13)
    q8, k8, v8 = (codes(t, dtype) for t in (q, k, v))
    qd, kd, vd = descales(1, 2, device, 14)
    bias = randn(17, 40, dtype=torch.float32, device=device, generator=gen(15), scale=4.0)
    slopes = torch.tensor([0.3, 0.7], device=device)
    kw = dict(k_descale=kd, v_descale=vd, attn_bias=bias, alibi_slopes=slopes, causal=True, softcap=8.0)
    with poisoned_outputs():
        a = lanekit.flash_attn_func(q8, k8, v8, q_descale=qd, softmax_scale=0.1, lane="triton", **kw)
        b = lanekit.flash_attn_func(q8, k8, v8, q_descale=qd * 2, softmax_scale=0.05, lane="triton", **kw)
    expected, _ = ref.flash_attn_quantized(q8, k8, v8, softmax_scale=0.1, q_descale=qd, k_descale=kd, v_descale=vd,
                                           attn_bias=bias[None, None], alibi_slopes=slopes, window_size=(-1, 0),
                                           softcap=8.0)
    for out in (a, b):
        assert_close(out, expected, ATTENTION_FP8)
    assert_close(a.float(), b.float().double(), ATTENTION_FWD, dtype=torch.bfloat16)


def test_v_descale_scales_the_output_and_out_dtype_picks_its_format(device):
    q, k, v = qkv(1, 9, 20, 2, 1, 32, device, dtype=torch.float32, seed=16)
    q8, k8, v8 = (codes(t, torch.float8_e4m3fn) for t in (q, k, v))
    one = torch.ones(1, 1, device=device)
    with poisoned_outputs():
        base = lanekit.flash_attn_func(q8, k8, v8, q_descale=one, k_descale=one, v_descale=one,
                                       out_dtype=torch.float32, lane="triton")
        four = lanekit.flash_attn_func(q8, k8, v8, q_descale=one, k_descale=one, v_descale=4 * one,
                                       out_dtype=torch.float32, lane="triton")
        half = lanekit.flash_attn_func(q8, k8, v8, out_dtype=torch.float16, lane="triton")   # descales default to 1
    assert base.dtype == torch.float32 and half.dtype == torch.float16
    expected, _ = ref.flash_attn_quantized(q8, k8, v8, softmax_scale=32 ** -0.5, q_descale=one, k_descale=one,
                                           v_descale=one)
    assert_close(base, expected, ATTENTION_FP8)
    assert_close(half, expected, ATTENTION_FP8)
    assert torch.equal(four, 4 * base)   # a power of two: exact
    assert_close(half, base.double(), ATTENTION_FWD, dtype=torch.float16)


@pytest.mark.parametrize("dtype", FP8 + (torch.int8,), ids=["e4m3", "e5m2", "int8"])
def test_varlen_paged_fp8_equals_packed(device, dtype):
    g = gen(17)
    lens = [7, 0, 12]
    cu = torch.tensor([0, 7, 7, 19], dtype=torch.int32, device=device)
    q = codes(randn(19, 4, 64, dtype=torch.float32, device=device, generator=g), dtype)
    k = codes(randn(19, 2, 64, dtype=torch.float32, device=device, generator=g), dtype)
    v = codes(randn(19, 2, 64, dtype=torch.float32, device=device, generator=g), dtype)
    qd, kd, vd = descales(3, 2, device, 18)
    page = 4
    table = torch.zeros(3, 3, dtype=torch.int32)
    kp = torch.zeros(8, page, 2, 64, dtype=dtype, device=device)
    vp = torch.zeros_like(kp)
    nxt = 0
    for b, n in enumerate(lens):
        for p in range(-(-n // page)):
            table[b, p] = nxt
            rows = slice(int(cu[b]) + p * page, int(cu[b]) + min(n, (p + 1) * page))
            m = rows.stop - rows.start
            kp[nxt, :m], vp[nxt, :m] = k[rows], v[rows]
            nxt += 1
    kw = dict(causal=True, q_descale=qd, k_descale=kd, v_descale=vd, lane="triton")
    with poisoned_outputs():
        packed = lanekit.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, **kw)
        paged = lanekit.flash_attn_varlen_func(q, kp, vp, cu, cu, 12, 12, block_table=table.to(device), **kw)
    expected, _ = ref.flash_attn_varlen_quantized(q, k, v, cu_seqlens_q=cu.cpu(), cu_seqlens_k=cu.cpu(),
                                                  max_seqlen_q=12, max_seqlen_k=12, softmax_scale=0.125,
                                                  window_size=(-1, 0), q_descale=qd, k_descale=kd, v_descale=vd)
    assert_close(packed, expected, ATTENTION_FP8)
    assert torch.equal(packed, paged)


@pytest.mark.parametrize("dtype,Dv", [(torch.float8_e4m3fn, 40), (torch.int8, 48), (torch.float8_e5m2, 80)],
                         ids=["e4m3 Dv40", "int8 Dv48", "e5m2 Dv80"])
def test_kvcache_fp8_odd_value_heads_split_and_unsplit(device, dtype, Dv):
    g = gen(19)
    B, Hq, Hkv, D, page = 2, 4, 2, 64, 5
    q = codes(randn(B, 1, Hq, D, dtype=torch.float32, device=device, generator=g), dtype)
    kc = codes(randn(9, page, Hkv, D, dtype=torch.float32, device=device, generator=g), dtype)
    vc = codes(randn(9, page, Hkv, Dv, dtype=torch.float32, device=device, generator=g), dtype)
    table = torch.randperm(9, generator=g)[:8].reshape(B, 4).to(torch.int32).to(device)
    seqlens = torch.tensor([17, 20], dtype=torch.int32, device=device)
    qd, kd, vd = descales(B, Hkv, device, 20)
    expected, exp_lse, _, _ = ref.flash_attn_with_kvcache_quantized(
        q, kc, vc, cache_seqlens=seqlens, block_table=table, softmax_scale=D ** -0.5, q_descale=qd,
        k_descale=kd, v_descale=vd)
    for splits in (1, 3):
        with poisoned_outputs():
            out, lse = lanekit.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                                       num_splits=splits, q_descale=qd, k_descale=kd,
                                                       v_descale=vd, return_softmax_lse=True, lane="triton")
        assert out.shape == (B, 1, Hq, Dv) and out.dtype == torch.bfloat16
        assert_close(out, expected, ATTENTION_FP8)
        assert_close(lse, exp_lse, LSE_FP8)


def test_quantized_kvcache_with_per_token_scales_still_takes_a_16_bit_q(device):
    from lanekit.reference.kv_cache import quantize_kv

    g = gen(21)
    q = randn(1, 1, 2, 64, dtype=torch.bfloat16, device=device, generator=g)
    kc, ks = quantize_kv(randn(1, 30, 1, 64, dtype=torch.float32, device=device, generator=g), torch.float8_e4m3fn)
    vc, vs = quantize_kv(randn(1, 30, 1, 64, dtype=torch.float32, device=device, generator=g), torch.float8_e4m3fn)
    sinks = torch.tensor([1.0, -1.0], device=device)
    with poisoned_outputs():
        out = lanekit.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=30, k_cache_scale=ks, v_cache_scale=vs,
                                             sinks=sinks, lane="triton")
    expected, _, _, _ = ref.flash_attn_with_kvcache(upcast(q), kc, vc, cache_seqlens=torch.tensor([30]),
                                                    k_cache_scale=ks, v_cache_scale=vs, softmax_scale=0.125,
                                                    sinks=upcast(sinks))
    assert_close(out, expected, ATTENTION_FWD)


def _fp8_inputs(device):
    q, k, v = qkv(1, 5, 7, 2, 1, 16, device, dtype=torch.float32)
    return tuple(codes(t, torch.float8_e4m3fn) for t in (q, k, v))


BAD_FP8 = {   # case: (error, the message's start)
    "grad": (ValueError, "sinks: fp8 and int8 attention is forward only"),
    "descale grad": (ValueError, "v_descale: fp8 and int8 attention is forward only"),
    "varlen descale grad": (ValueError, "q_descale: fp8 and int8 attention is forward only"),
    "dropout": (ValueError, r"dropout_p: expected 0\.0 with torch\.float8_e4m3fn inputs"),
    "descale shape": (ValueError, r"q_descale: expected 2 dimensions, got shape \(2,\)"),
    "descale dtype": (TypeError, r"k_descale: expected dtype in \['torch\.float32'\], got torch\.float16"),
    "descale on bf16": (ValueError, r"v_descale: expected None for torch\.bfloat16 inputs"),
    "out_dtype int8": (ValueError, r"out_dtype: expected one of .* or None, got torch\.int8"),
    "out_dtype on bf16": (ValueError, r"out_dtype: expected None or q's dtype \(torch\.bfloat16\)"),
    "sinks shape": (ValueError, r"sinks: expected shape \(2,\) \(one logit per query head\), got \(3,\)"),
    "sinks dtype": (TypeError, r"sinks: expected dtype in \['torch\.float32'\], got torch\.float16"),
    "mixed dtypes": (TypeError, r"v: expected the dtype of q \(torch\.float8_e4m3fn\), got torch\.float8_e5m2"),
    "kvcache append": (ValueError, r"k: expected None with a torch\.float8_e4m3fn q"),
    "kvcache per-token scales": (ValueError, r"k_cache_scale: expected None with a torch\.float8_e4m3fn q"),
}


@pytest.mark.parametrize("case", list(BAD_FP8))
def test_bad_fp8_and_sinks_input_raises_a_clear_error(device, case):
    q, k, v = _fp8_inputs(device)
    one = torch.ones(1, 1, device=device)
    qb, kb, vb = (t.float().bfloat16() for t in (q, k, v))
    kc = torch.zeros(1, 10, 1, 16, device=device).to(q.dtype)
    calls = {
        # a learned sink in grad mode: fp8 attention has no backward
        "grad": lambda: lanekit.flash_attn_func(q, k, v, sinks=torch.zeros(2, device=device).requires_grad_()),
        # a descale that requires grad got no gradient, silently (the reference lane's had one)
        "descale grad": lambda: lanekit.flash_attn_func(q, k, v, v_descale=one.requires_grad_()),
        "varlen descale grad": lambda: lanekit.flash_attn_varlen_func(
            q[0], k[0], v[0], torch.tensor([0, 5], dtype=torch.int32, device=device),
            torch.tensor([0, 7], dtype=torch.int32, device=device), 5, 7, q_descale=one.requires_grad_()),
        "dropout": lambda: lanekit.flash_attn_func(q, k, v, dropout_p=0.1),
        "descale shape": lambda: lanekit.flash_attn_func(q, k, v, q_descale=torch.ones(2, device=device)),
        "descale dtype": lambda: lanekit.flash_attn_func(q, k, v, k_descale=one.half()),
        "descale on bf16": lambda: lanekit.flash_attn_func(qb, kb, vb, v_descale=one),
        "out_dtype int8": lambda: lanekit.flash_attn_func(q, k, v, out_dtype=torch.int8),
        "out_dtype on bf16": lambda: lanekit.flash_attn_func(qb, kb, vb, out_dtype=torch.float32),
        "sinks shape": lambda: lanekit.flash_attn_func(q, k, v, sinks=torch.zeros(3, device=device)),
        "sinks dtype": lambda: lanekit.flash_attn_func(q, k, v, sinks=torch.zeros(2, device=device).half()),
        "mixed dtypes": lambda: lanekit.flash_attn_func(q, k, v.float().to(torch.float8_e5m2)),
        "kvcache append": lambda: lanekit.flash_attn_with_kvcache(q, kc, kc.clone(), k=k[:, :1], v=v[:, :1],
                                                                  cache_seqlens=3),
        "kvcache per-token scales": lambda: lanekit.flash_attn_with_kvcache(
            q, kc, kc.clone(), cache_seqlens=3, k_cache_scale=torch.ones(1, 10, 1, device=device),
            v_cache_scale=torch.ones(1, 10, 1, device=device)),
    }
    err, message = BAD_FP8[case]
    with pytest.raises(err, match=f"^{message}"):
        calls[case]()


def test_packed_functions_pass_sinks_and_descales_through(device):
    g = gen(23)
    qkv = randn(2, 11, 3, 2, 32, dtype=torch.bfloat16, device=device, generator=g)
    sinks = randn(2, dtype=torch.float32, device=device, generator=g)
    q, k, v = qkv.unbind(2)
    cu = torch.tensor([0, 11, 22], dtype=torch.int32, device=device)
    with poisoned_outputs():
        expected = lanekit.flash_attn_func(q, k, v, causal=True, sinks=sinks, lane="triton")
        assert torch.equal(lanekit.flash_attn_qkvpacked_func(qkv, causal=True, sinks=sinks, lane="triton"), expected)
        packed = lanekit.flash_attn_varlen_qkvpacked_func(qkv.flatten(0, 1), cu, 11, causal=True, sinks=sinks,
                                                          lane="triton")
    assert_close(packed, ref.flash_attn(*map(upcast, (q, k, v)), softmax_scale=32 ** -0.5, window_size=(-1, 0),
                                        sinks=upcast(sinks))[0].flatten(0, 1), ATTENTION_FWD)
    q8, kv8 = codes(q.flatten(0, 1), torch.int8), codes(qkv[:, :, 1:].flatten(0, 1), torch.int8)
    qd, kd, vd = descales(2, 2, device, 24)
    with poisoned_outputs():
        out = lanekit.flash_attn_varlen_kvpacked_func(q8, kv8, cu, cu, 11, 11, q_descale=qd, k_descale=kd,
                                                      v_descale=vd, lane="triton")
    expected8, _ = ref.flash_attn_varlen_quantized(q8, kv8[:, 0], kv8[:, 1], cu_seqlens_q=cu.cpu(),
                                                   cu_seqlens_k=cu.cpu(), max_seqlen_q=11, max_seqlen_k=11,
                                                   softmax_scale=32 ** -0.5, q_descale=qd, k_descale=kd,
                                                   v_descale=vd)
    assert_close(out, expected8, ATTENTION_FP8)
