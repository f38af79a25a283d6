"""The registry's entries: every op, its oracle, its lanes, its sample inputs and its tolerance.

Adding an op means adding one ``register(Op(...))`` here; the execution matrix, ``lanekit check``
and the registry-driven tests pick it up from there.
"""

from __future__ import annotations

import itertools
import math
import zlib

import torch

from lanekit.runtime.lanes import Op, Sample, register
from lanekit.testing import randn


def attention_case(name, device, *, B=1, Sq=17, Sk=17, Hq=2, Hkv=None, D=64, Dv=None,
                   dtype=torch.float16, causal=False, window_size=(-1, -1), softcap=0.0,
                   alibi=None, bias_shape=None, mask_shape=None, dropout_p=0.0, seed=0,
                   kv_transposed=False) -> Sample:
    """A ``flash_attn_func`` sample in the lanes' normalized form, from readable parameters.

    ``alibi``: None, "head" (Hq,) or "batch" (B, Hq). ``bias_shape``/``mask_shape``: a shape
    broadcastable to (B, Hq, Sq, Sk). ``kv_transposed``: k and v are non-contiguous views.
    """
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # the same inputs in every process
    Hkv = Hkv or Hq
    Dv = Dv or D
    q = randn(B, Sq, Hq, D, dtype=dtype, device=device, generator=g)
    if kv_transposed:  # (B, Hkv, Sk, D) storage viewed as (B, Sk, Hkv, D)
        k = randn(B, Hkv, Sk, D, dtype=dtype, device=device, generator=g).transpose(1, 2)
        v = randn(B, Hkv, Sk, Dv, dtype=dtype, device=device, generator=g).transpose(1, 2)
    else:
        k = randn(B, Sk, Hkv, D, dtype=dtype, device=device, generator=g)
        v = randn(B, Sk, Hkv, Dv, dtype=dtype, device=device, generator=g)
    slopes = None
    if alibi is not None:
        slopes = (torch.rand(Hq if alibi == "head" else (B, Hq), generator=g) * 0.5).to(device)
        slopes = slopes.expand(B, Hq)
    bias = mask = None
    if bias_shape is not None:
        bias = randn(*bias_shape, dtype=dtype, device=device, generator=g, scale=2.0).expand(B, Hq, Sq, Sk)
    if mask_shape is not None:
        mask = (torch.rand(*mask_shape, generator=g) > 0.3).to(device).expand(B, Hq, Sq, Sk)
    left, right = window_size
    return Sample(name, dict(
        q=q, k=k, v=v, softmax_scale=D ** -0.5, window_size=(left, 0 if causal else right),
        softcap=softcap, alibi_slopes=slopes, attn_bias=bias, attn_mask=mask,
        dropout_p=dropout_p, seed=seed, offset=0,
    ))


def _attention_samples(device):
    bf16, f32 = torch.bfloat16, torch.float32
    yield attention_case("mha d64 bf16 S97", device, B=2, Sq=97, Sk=97, Hq=3, D=64, dtype=bf16)
    yield attention_case("gqa 6:2 causal Sq17 Sk129 d72", device, Sq=17, Sk=129, Hq=6, Hkv=2, D=72, causal=True)
    yield attention_case("causal Sq129 Sk37 d80 (empty rows)", device, Sq=129, Sk=37, D=80, dtype=bf16, causal=True)
    yield attention_case("mqa 4:1 window(4,0) Sq1 Sk37 d59", device, Sq=1, Sk=37, Hq=4, Hkv=1, D=59, window_size=(4, 0))
    yield attention_case("window(8,3) S97 d96", device, Sq=97, Sk=97, D=96, dtype=bf16, window_size=(8, 3))
    yield attention_case("softcap30 alibi(B,H) d96", device, B=2, Sq=33, Sk=65, D=96, softcap=30.0, alibi="batch")
    yield attention_case("alibi(H) causal d128", device, Sq=48, Sk=48, D=128, alibi="head", causal=True, dtype=bf16)
    yield attention_case("bias+mask d111", device, B=2, Sq=19, Sk=41, Hq=2, D=111, dtype=bf16,
                         bias_shape=(1, 2, 19, 41), mask_shape=(2, 1, 1, 41))
    yield attention_case("Dqk192 Dv128", device, Sq=20, Sk=33, D=192, Dv=128)
    yield attention_case("d256 fp32", device, Sq=17, Sk=40, D=256, dtype=f32)
    yield attention_case("d1 fp32 causal", device, Sq=9, Sk=9, D=1, dtype=f32, causal=True)
    yield attention_case("dropout0.2 d32", device, Sq=33, Sk=47, D=32, dropout_p=0.2, seed=1234)
    yield attention_case("k,v transposed views d64", device, Sq=21, Sk=50, Hq=4, Hkv=2, D=64, kv_transposed=True)
    yield attention_case("Sk0", device, Sq=5, Sk=0, D=16)


def _attention_bwd_samples(device):
    """The forward's samples, each with a gradient of out (dout), plus an empty query."""
    cases = list(_attention_samples(device))
    cases.append(attention_case("Sq0", device, Sq=0, Sk=7, D=16))
    yield from _with_dout(cases, device)


def _with_dout(cases, device):
    """Each attention sample with a gradient of its out, dout (q's shape with v's head dim),
    drawn from a generator seeded by the sample's name."""
    for case in cases:
        q, v = case.kwargs["q"], case.kwargs["v"]
        g = torch.Generator().manual_seed(zlib.crc32(b"dout " + case.name.encode()))
        dout = randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=device, generator=g)
        yield Sample(case.name, dict(case.kwargs, dout=dout))


register(Op(
    name="flash_attn_func",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn",
    lanes={"triton": "lanekit.attention.op:flash_attn_triton",
           "reference": "lanekit.attention.op:flash_attn_reference"},
    samples=_attention_samples,
    outputs=(("out", "attention_fwd"), ("lse", "lse")),
    doc="FlashAttention-compatible attention forward: MHA/GQA/MQA, causal/window, softcap, ALiBi, bias, mask, dropout",
))

register(Op(
    name="flash_attn_func.backward",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn_backward",
    lanes={"triton": "lanekit.attention.op:flash_attn_backward_triton",
           "reference": "lanekit.attention.op:flash_attn_backward_reference"},
    samples=_attention_bwd_samples,
    outputs=(("dq", "attention_bwd"), ("dk", "attention_bwd"), ("dv", "attention_bwd"),
             ("dbias", "attention_dbias")),
    doc="Gradients of flash_attn_func by autograd: dq, dk, dv, and the bias's gradient when it has one",
))



def varlen_case(name, device, *, seqlens_q, seqlens_k, Hq=2, Hkv=None, D=64, dtype=torch.float16,
                causal=False, window_size=(-1, -1), softcap=0.0, alibi=False, dropout_p=0.0, seed=0,
                page_size=None, num_blocks=None) -> Sample:
    """A ``flash_attn_varlen_func`` sample in the lanes' normalized form: packed q, k, v for the
    given per-sequence lengths; with ``page_size``, k and v in a paged cache whose pages are
    handed out in a shuffled order (and a spare page nobody owns)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    Hkv = Hkv or Hq
    B = len(seqlens_q)
    cu_q = torch.tensor([0, *itertools.accumulate(seqlens_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(seqlens_k)], dtype=torch.int32)
    q = randn(int(cu_q[-1]), Hq, D, dtype=dtype, device=device, generator=g)
    block_table = None
    if page_size is None:
        k = randn(int(cu_k[-1]), Hkv, D, dtype=dtype, device=device, generator=g)
        v = randn(int(cu_k[-1]), Hkv, D, dtype=dtype, device=device, generator=g)
    else:
        pages = [-(-n // page_size) for n in seqlens_k]
        max_pages = max(pages + [1])
        num_blocks = num_blocks or sum(pages) + 1
        k = randn(num_blocks, page_size, Hkv, D, dtype=dtype, device=device, generator=g)
        v = randn(num_blocks, page_size, Hkv, D, dtype=dtype, device=device, generator=g)
        order = torch.randperm(num_blocks, generator=g).tolist()
        rows = []
        for n in pages:
            rows.append(order[:n] + [0] * (max_pages - n))
            order = order[n:]
        block_table = torch.tensor(rows, dtype=torch.int32).to(device)
    slopes = (torch.rand(B, Hq, generator=g) * 0.5).to(device) if alibi else None
    left, right = window_size
    return Sample(name, dict(
        q=q, k=k, v=v, cu_seqlens_q=cu_q.to(device), cu_seqlens_k=cu_k.to(device),
        max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k), block_table=block_table,
        softmax_scale=D ** -0.5, window_size=(left, 0 if causal else right), softcap=softcap,
        alibi_slopes=slopes, dropout_p=dropout_p, seed=seed, offset=0,
    ))


def _varlen_samples(device, *, paged=True):
    bf16, f32 = torch.bfloat16, torch.float32
    yield varlen_case("gqa 9:3 d64 causal Sq[0,1,0,1] Sk[0,3,0,5]", device, seqlens_q=[0, 1, 0, 1],
                      seqlens_k=[0, 3, 0, 5], Hq=9, Hkv=3, D=64, causal=True)
    yield varlen_case("bf16 d80 Sq[33,1,70] Sk[40,0,70] causal", device, seqlens_q=[33, 1, 70],
                      seqlens_k=[40, 0, 70], Hq=4, Hkv=2, D=80, dtype=bf16, causal=True)
    yield varlen_case("window(5,2) softcap alibi d96", device, seqlens_q=[17, 40], seqlens_k=[50, 40],
                      D=96, window_size=(5, 2), softcap=20.0, alibi=True)
    yield varlen_case("fp32 d128 Sq>Sk", device, seqlens_q=[20, 9], seqlens_k=[7, 33], D=128, dtype=f32)
    yield varlen_case("dropout0.2 d32", device, seqlens_q=[9, 21], seqlens_k=[30, 21], D=32,
                      dropout_p=0.2, seed=77)
    if paged:
        yield varlen_case("paged page3 gqa 4:2 causal d64", device, seqlens_q=[1, 7, 0], seqlens_k=[10, 7, 4],
                          Hq=4, Hkv=2, D=64, dtype=bf16, causal=True, page_size=3)
        yield varlen_case("paged page16 d128 window(8,0)", device, seqlens_q=[5, 16], seqlens_k=[37, 16],
                          D=128, window_size=(8, 0), page_size=16)


def _varlen_bwd_samples(device):
    yield from _with_dout(_varlen_samples(device, paged=False), device)


register(Op(
    name="flash_attn_varlen_func",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn_varlen",
    lanes={"triton": "lanekit.attention.op:flash_attn_varlen_triton",
           "reference": "lanekit.attention.op:flash_attn_varlen_reference"},
    samples=_varlen_samples,
    outputs=(("out", "attention_fwd"), ("lse", "lse")),
    doc="Attention over packed variable-length sequences (FlashAttention's varlen), packed or paged K/V",
))

register(Op(
    name="flash_attn_varlen_func.backward",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn_varlen_backward",
    lanes={"triton": "lanekit.attention.op:flash_attn_varlen_backward_triton",
           "reference": "lanekit.attention.op:flash_attn_varlen_backward_reference"},
    samples=_varlen_bwd_samples,
    outputs=(("dq", "attention_bwd"), ("dk", "attention_bwd"), ("dv", "attention_bwd")),
    doc="Gradients of flash_attn_varlen_func (packed K/V) by autograd: dq, dk, dv",
))


def kvcache_case(name, device, *, B=2, Sq=1, Hq=4, Hkv=2, D=64, Dv=None, dtype=torch.bfloat16,
                 seqlens=(5, 29), S_new=1, capacity=40, page_size=None, rotary_dim=0, interleaved=True,
                 leftpad=None, batch_idx=None, causal=True, window_size=(-1, -1), softcap=0.0,
                 alibi=False, quant=None, num_splits=1, max_seqlen_k=None) -> Sample:
    """A ``flash_attn_with_kvcache`` sample in the lanes' normalized form: a contiguous cache of
    ``capacity`` tokens per row, or a paged one whose pages are shuffled (with spare pages nobody
    owns), filled with random values (or their int8 / e4m3 codes and scales)."""
    from lanekit.reference.kv_cache import quantize_kv

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    Dv = Dv or D
    q = randn(B, Sq, Hq, D, dtype=dtype, device=device, generator=g)
    block_table = None
    if page_size is None:
        rows = B if batch_idx is None else max(batch_idx) + 2
        shape = (rows, capacity)
    else:
        max_pages = -(-capacity // page_size)
        num_blocks = B * max_pages + 3
        order = torch.randperm(num_blocks, generator=g)[: B * max_pages]
        block_table = order.reshape(B, max_pages).to(torch.int32).to(device)
        shape = (num_blocks, page_size)
    k_cache = randn(*shape, Hkv, D, dtype=torch.float32, device=device, generator=g)
    v_cache = randn(*shape, Hkv, Dv, dtype=torch.float32, device=device, generator=g)
    k_scale = v_scale = None
    if quant is not None:
        k_cache, k_scale = quantize_kv(k_cache, quant)
        v_cache, v_scale = quantize_kv(v_cache, quant)
    else:
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    k = v = None
    if S_new:
        k = randn(B, S_new, Hkv, D, dtype=dtype, device=device, generator=g)
        v = randn(B, S_new, Hkv, Dv, dtype=dtype, device=device, generator=g)
    cos = sin = None
    if rotary_dim:
        angles = torch.rand(capacity + Sq, rotary_dim // 2, generator=g, dtype=torch.float64) * 6.0
        cos, sin = angles.cos().float().to(device), angles.sin().float().to(device)
    left, right = window_size
    return Sample(name, dict(
        q=q, k_cache=k_cache, v_cache=v_cache,
        cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device), k=k, v=v,
        rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
        cache_batch_idx=torch.tensor(batch_idx, dtype=torch.int32, device=device) if batch_idx else None,
        cache_leftpad=torch.tensor(leftpad, dtype=torch.int32, device=device) if leftpad else None,
        block_table=block_table, k_cache_scale=k_scale, v_cache_scale=v_scale, kv_dtype=k_cache.dtype,
        rotary_dtype=dtype, softmax_scale=D ** -0.5, window_size=(left, 0 if causal else right),
        softcap=softcap, alibi_slopes=(torch.rand(B, Hq, generator=g) * 0.5).to(device) if alibi else None,
        num_splits=num_splits, max_seqlen_k=max_seqlen_k,
    ))


def _kvcache_samples(device):
    f16, f32 = torch.float16, torch.float32
    yield kvcache_case("decode gqa 4:2 d64", device)
    yield kvcache_case("decode splits 3, no append", device, S_new=0, seqlens=(0, 40), num_splits=3)
    yield kvcache_case("paged page 7, splits 2, mqa 6:1 d80", device, Hq=6, Hkv=1, D=80, page_size=7,
                       seqlens=(13, 0), num_splits=2)
    yield kvcache_case("paged page 64 (whole key blocks), splits 3", device, page_size=64, capacity=200,
                       seqlens=(130, 61), num_splits=3)
    yield kvcache_case("paged page 1, Sq 3 append 3, d96 fp16", device, Sq=3, S_new=3, D=96, dtype=f16,
                       page_size=1, seqlens=(4, 9), capacity=16)
    yield kvcache_case("rotary NeoX half dim, leftpad, batch_idx", device, rotary_dim=32, interleaved=False,
                       leftpad=(2, 11), batch_idx=(2, 0), seqlens=(6, 30))
    yield kvcache_case("rotary interleaved, non-causal Sq 2", device, Sq=2, S_new=2, rotary_dim=64,
                       causal=False, seqlens=(3, 20))
    yield kvcache_case("window(7,0) softcap alibi splits 4", device, window_size=(7, 0), softcap=15.0,
                       alibi=True, num_splits=4, seqlens=(30, 2))
    yield kvcache_case("int8 cache paged page 5 splits 2", device, quant=torch.int8, page_size=5, num_splits=2)
    yield kvcache_case("e4m3 cache Dv 32", device, quant=torch.float8_e4m3fn, Dv=32, seqlens=(10, 35))
    yield kvcache_case("fp32 d128 Sq 4 gqa 8:2", device, Hq=8, Sq=4, S_new=0, D=128, dtype=f32, seqlens=(40, 25))
    # D=128 in 16 bits takes the rows tuned for the H200 (tuning.FLASH_ATTN_KVCACHE and its short and
    # per-key-pages forms), chosen by the layout and by max_seqlen_k (None: the long-cache rows)
    yield kvcache_case("d128 gqa 8:2 (short-cache rows)", device, Hq=8, D=128, seqlens=(7, 39), max_seqlen_k=40)
    yield kvcache_case("d128 gqa 8:2, capacity 8200 (long-cache rows)", device, Hq=8, D=128, capacity=8200,
                       seqlens=(70, 300))
    yield kvcache_case("d128 pages of 256, splits 2 (short-cache rows)", device, D=128, page_size=256,
                       capacity=512, seqlens=(300, 77), num_splits=2, max_seqlen_k=301)
    yield kvcache_case("d128 pages of 256, a table of 8448 (long-cache rows)", device, D=128, page_size=256,
                       capacity=8448, seqlens=(260, 31))
    # pages of 16 fill the key blocks of both rows whole: one table load per page, not per key
    yield kvcache_case("d128 pages of 16, window (90, 0), splits 3 (long-cache rows)", device, Hq=8, D=128,
                       page_size=16, capacity=320, seqlens=(250, 57), window_size=(90, 0), num_splits=3)
    yield kvcache_case("d128 int8 pages of 8, splits 2 (short-cache rows)", device, Hq=8, D=128, page_size=8,
                       capacity=200, seqlens=(150, 9), quant=torch.int8, num_splits=2, max_seqlen_k=151)


register(Op(
    name="flash_attn_with_kvcache",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn_with_kvcache",
    lanes={"triton": "lanekit.attention.op:flash_attn_with_kvcache_triton",
           "reference": "lanekit.attention.op:flash_attn_with_kvcache_reference"},
    samples=_kvcache_samples,
    outputs=(("out", "attention_fwd"), ("lse", "lse"), ("k_cache", "eltwise"), ("v_cache", "eltwise")),
    doc="Decode over a contiguous or paged (quantized) KV cache: append, RoPE, split-KV (FlashAttention's with_kvcache)",
))

# ---- fused layers (lanekit.layers) ----

def _gen(name: str, salt: str = "") -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32((salt + name).encode()))


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view with a row stride twice the width (every other row of a buffer)."""
    buf = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    buf[..., : t.shape[-1]] = t
    return buf[..., : t.shape[-1]]


def _param(N, g, device, layout="contiguous", dtype=torch.float32):
    """A (N,) parameter: contiguous, "strided" (every other element of a buffer) or "expanded"
    (one value broadcast, stride 0)."""
    if layout == "expanded":
        return randn(1, dtype=dtype, device=device, generator=g).expand(N)
    if layout == "strided":
        return randn(2 * N, dtype=dtype, device=device, generator=g)[::2]
    return randn(N, dtype=dtype, device=device, generator=g)


def norm_case(name, device, *, shape, dtype=torch.bfloat16, weight=True, bias=False,
              residual=False, offset=0.0, noncontiguous=False, eps=1e-6, kind="rms",
              params="contiguous", mean=0.0) -> Sample:
    """An ``rms_norm`` / ``layer_norm`` sample (``kind``), from readable parameters. ``params``:
    the weight's and bias's layout (see _param); ``mean``: added to every x."""
    g = _gen(name)
    N = shape[-1]
    x = (randn(*shape, dtype=torch.float32, device=device, generator=g) + mean).to(dtype)
    if noncontiguous:
        x = _noncontiguous(x)
    kw = dict(x=x, weight=_param(N, g, device, params) if weight else None,
              eps=eps, residual=randn(*shape, dtype=dtype, device=device, generator=g) if residual else None)
    if kind == "rms":
        kw["offset"] = offset
    else:
        kw["bias"] = _param(N, g, device, params) if bias else None
    return Sample(name, kw)


def _rms_norm_samples(device):
    f16, f32 = torch.float16, torch.float32
    yield norm_case("N100 rows 1", device, shape=(1, 100))
    yield norm_case("N300 rows 17 fp16 residual", device, shape=(17, 300), dtype=f16, residual=True)
    yield norm_case("N700 (2,3) rows, gemma offset 1", device, shape=(2, 3, 700), offset=1.0)
    yield norm_case("N16384 rows 3 residual", device, shape=(3, 16384), residual=True)
    yield norm_case("N4096 fp32 non-contiguous", device, shape=(5, 4096), dtype=f32, noncontiguous=True)
    yield norm_case("N37 no weight", device, shape=(9, 37), weight=False)
    yield norm_case("rows 0", device, shape=(0, 64))
    yield norm_case("N0 features", device, shape=(3, 0))
    yield norm_case("N300 weight expanded from one value", device, shape=(5, 300), params="expanded")


def _layer_norm_samples(device):
    yield norm_case("N100 rows 1", device, shape=(1, 100), kind="ln", bias=True, eps=1e-5)
    yield norm_case("N300 rows 17 residual", device, shape=(17, 300), kind="ln", bias=True, residual=True)
    yield norm_case("N700 fp16 no bias", device, shape=(4, 700), kind="ln", dtype=torch.float16)
    yield norm_case("N20000 (looped) rows 2", device, shape=(2, 20000), kind="ln", bias=True)
    yield norm_case("N4096 fp32 rows of mean 100, strided weight and bias", device, shape=(3, 4096),
                    kind="ln", bias=True, dtype=torch.float32, mean=100.0, params="strided")
    yield norm_case("N20000 (looped) fp32 rows of mean 100", device, shape=(2, 20000), kind="ln",
                    bias=True, dtype=torch.float32, mean=100.0)
    yield norm_case("N4096 bf16 rows of mean 100", device, shape=(3, 4096), kind="ln", bias=True, mean=100.0)
    yield norm_case("N96 non-contiguous no affine", device, shape=(6, 96), kind="ln", weight=False,
                    noncontiguous=True)


def adaln_case(name, device, *, shape, per_batch=True, gate=False, residual=False,
               dtype=torch.bfloat16, mod_dtype=None) -> Sample:
    g = _gen(name)
    N = shape[-1]
    mod_rows = shape[0]
    mod = mod_dtype or dtype

    def m():
        return randn(mod_rows, N, dtype=mod, device=device, generator=g, scale=0.5)

    x = randn(*shape, dtype=dtype, device=device, generator=g)
    return Sample(name, dict(
        x=x, scale=m(), shift=m(), gate=m() if gate else None, eps=1e-6,
        residual=randn(*shape, dtype=dtype, device=device, generator=g) if residual else None))


def _adaln_samples(device):
    yield adaln_case("N96 (B=2, S=17) per batch", device, shape=(2, 17, 96))
    yield adaln_case("N160 rows 17 per row, gated residual", device, shape=(17, 160), gate=True, residual=True)
    yield adaln_case("N384 (B=3, S=5) gated residual fp32 mods", device, shape=(3, 5, 384), gate=True,
                     residual=True, mod_dtype=torch.float32)
    yield adaln_case("N384 rows 1 fp16 residual", device, shape=(1, 384), residual=True, dtype=torch.float16)
    # S divisible by 4 and by 2: programs of several rows sharing their batch entry's scale, shift
    yield adaln_case("N160 (B=3, S=12) per batch, rows sharing a load", device, shape=(3, 12, 160))
    yield adaln_case("N96 (B=2, S=6) gated residual, rows sharing a load", device, shape=(2, 6, 96),
                     gate=True, residual=True)


def _with_douts(samples):
    """Each forward sample with a gradient for each output: dout (and dh for a returned residual
    sum; dk for rms_norm_rope's k')."""
    for case in samples:
        kw = dict(case.kwargs)
        g = _gen(case.name, "dout ")
        if "q" in kw:
            x, kw["dk"] = kw["q"], randn(*kw["k"].shape, dtype=kw["k"].dtype, device=kw["k"].device, generator=g)
            out_shape = x.shape
        elif "activation" in kw:
            x = kw["gate"]
            out_shape = x.shape if kw["up"] is not None else (*x.shape[:-1], x.shape[-1] // 2)
        else:
            x = kw["x"]
            out_shape = x.shape
        kw["dout"] = randn(*out_shape, dtype=x.dtype, device=x.device, generator=g)
        if kw.get("residual") is not None:
            kw["dh"] = randn(*x.shape, dtype=x.dtype, device=x.device, generator=g)
        yield Sample(case.name, kw)


def rotary_case(name, device, *, shape, rotary_dim=None, interleaved=False, dtype=torch.bfloat16,
                S_ro=None, position_ids=False, seqlen_offsets=0, cu_seqlens=None, noncontiguous=False,
                sin_strided=False):
    g = _gen(name)
    D = shape[-1]
    rd = rotary_dim or D
    x = randn(*shape, dtype=dtype, device=device, generator=g)
    if noncontiguous:
        x = _noncontiguous(x)
    S_ro = S_ro or 64
    angles = torch.rand(S_ro, rd // 2, generator=g) * 6.3
    sin = angles.sin().to(device)
    if sin_strided:  # a column slice of a wider buffer: strides unlike cos's
        sin = _noncontiguous(sin)
    kw = dict(x=x, cos=angles.cos().to(device), sin=sin, interleaved=interleaved,
              rotary_dim=rd, position_ids=None, cu_seqlens=None, max_seqlen=0, seqlen_offsets=seqlen_offsets)
    if position_ids:
        kw["position_ids"] = torch.randint(0, S_ro, shape[:-2], generator=g).to(device)
    if cu_seqlens is not None:
        cu = torch.tensor(cu_seqlens, dtype=torch.int32)
        kw.update(cu_seqlens=cu.to(device), max_seqlen=int(cu.diff().max()))
    if isinstance(seqlen_offsets, list):
        kw["seqlen_offsets"] = torch.tensor(seqlen_offsets, dtype=torch.int32, device=device)
    return Sample(name, kw)


def _rotary_samples(device):
    yield rotary_case("NeoX D80 (2, 17, 3)", device, shape=(2, 17, 3, 80))
    yield rotary_case("interleaved D96 (1, 9, 4) fp16", device, shape=(1, 9, 4, 96), interleaved=True,
                      dtype=torch.float16)
    yield rotary_case("partial 32 of D80, offsets per batch", device, shape=(2, 5, 2, 80), rotary_dim=32,
                      seqlen_offsets=[3, 40])
    yield rotary_case("position_ids interleaved partial 64 of D96", device, shape=(2, 7, 2, 96),
                      rotary_dim=64, position_ids=True, interleaved=True)
    yield rotary_case("packed cu_seqlens [0,5,5,17] D80 offset 2", device, shape=(17, 3, 80),
                      cu_seqlens=[0, 5, 5, 17], seqlen_offsets=2)
    yield rotary_case("packed position_ids D64 fp32", device, shape=(11, 2, 64), position_ids=True,
                      dtype=torch.float32)
    yield rotary_case("non-contiguous D128 S1", device, shape=(3, 1, 2, 128), noncontiguous=True)
    yield rotary_case("sin with strides unlike cos's D64", device, shape=(1, 6, 2, 64), sin_strided=True)


def qk_case(name, device, *, B=2, S=9, Hq=4, Hkv=2, D=80, rotary_dim=None, dtype=torch.bfloat16,
            weights=True, interleaved=False, position_ids=False, seqlen_offsets=0, offset=0.0,
            quant_dtype=None, params="contiguous", fused_qkv=False, k_weight_dtype=None,
            k_heads_first=False):
    """weights: both, none, or "q" (q's only). fused_qkv: q and k as head slices of one
    (B, S, Hq + 2 Hkv, D) buffer (strides unlike either's own). k_weight_dtype: k's weight in
    another dtype than q's. k_heads_first: k a (B, S, Hkv, D) view of a (B, Hkv, S, D) tensor
    (token and head strides unlike q's)."""
    g = _gen(name)
    rd = rotary_dim or D
    if fused_qkv:
        qkv = randn(B, S, Hq + 2 * Hkv, D, dtype=dtype, device=device, generator=g, scale=2.0)
        q, k = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv]
    else:
        q = randn(B, S, Hq, D, dtype=dtype, device=device, generator=g, scale=2.0)
        k = randn(B, S, Hkv, D, dtype=dtype, device=device, generator=g, scale=2.0)
    if k_heads_first:
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    angles = torch.rand(64, rd // 2, generator=g) * 6.3
    kw = dict(q=q, k=k,
              q_weight=_param(D, g, device, params, dtype) if weights else None,
              k_weight=_param(D, g, device, params, k_weight_dtype or dtype)
              if weights and weights != "q" else None,
              cos=angles.cos().to(device), sin=angles.sin().to(device),
              eps=float(torch.tensor(1e-6, dtype=torch.float32)), offset=offset,
              interleaved=interleaved, rotary_dim=rd, position_ids=None, seqlen_offsets=seqlen_offsets)
    if position_ids:
        kw["position_ids"] = torch.randint(0, 64, (B, S), generator=g).to(device)
    if quant_dtype is not None:
        kw["quant_dtype"] = quant_dtype
    return Sample(name, kw)


def _rms_norm_rope_samples(device):
    yield qk_case("GQA 4:2 D80", device)
    yield qk_case("D96 interleaved partial 64, gemma offset", device, D=96, rotary_dim=64,
                  interleaved=True, offset=1.0, S=17, B=1)
    yield qk_case("D128 fp16 no weights, position_ids", device, D=128, dtype=torch.float16,
                  weights=False, position_ids=True, S=3)
    yield qk_case("D64 S1 offset 30", device, D=64, S=1, seqlen_offsets=30)
    yield qk_case("strided weights D80 S5", device, S=5, params="strided")
    yield qk_case("q, k slices of one qkv buffer, Hq 3 Hkv 5 D64", device, Hq=3, Hkv=5, D=64, S=7,
                  fused_qkv=True)
    yield qk_case("q weight only, k weight absent D64", device, D=64, S=4, weights="q")
    yield qk_case("k laid out heads first, Hq 2 Hkv 3 D80", device, Hq=2, Hkv=3, S=6, k_heads_first=True)


def _qk_quant_samples(device):
    for qd, tag in ((torch.float8_e4m3fn, "e4m3"), (torch.int8, "int8")):
        yield qk_case(f"{tag} GQA 4:2 D128 rope on last 64", device, D=128, rotary_dim=64, quant_dtype=qd)
        yield qk_case(f"{tag} D80 interleaved, fp16, position_ids", device, D=80, interleaved=True,
                      dtype=torch.float16, position_ids=True, quant_dtype=qd)
        yield qk_case(f"{tag} D96 rope on all, S17 B1", device, D=96, S=17, B=1, quant_dtype=qd)
        yield qk_case(f"{tag} strided weights D64 S3", device, D=64, S=3, quant_dtype=qd, params="strided")
        yield qk_case(f"{tag} q, k slices of one qkv buffer, Hq 6 Hkv 1 D128 rope on last 32", device,
                      Hq=6, Hkv=1, D=128, S=5, rotary_dim=32, fused_qkv=True, quant_dtype=qd)
    yield qk_case("int8 k laid out heads first, Hq 4 Hkv 2 D64", device, D=64, S=6, k_heads_first=True,
                  quant_dtype=torch.int8)
    yield qk_case("e4m3 weights of two dtypes D64 S3, fp16", device, D=64, S=3, dtype=torch.float16,
                  k_weight_dtype=torch.float32, quant_dtype=torch.float8_e4m3fn)


def glu_case(name, device, *, shape, fused=False, dtype=torch.bfloat16, noncontiguous=False, act="silu",
             gate_scale=2.0):
    g = _gen(name)
    if fused:
        return Sample(name, dict(gate=randn(*shape[:-1], 2 * shape[-1], dtype=dtype, device=device,
                                            generator=g, scale=gate_scale), up=None, activation=act))
    gate = randn(*shape, dtype=dtype, device=device, generator=g, scale=gate_scale)
    up = randn(*shape, dtype=dtype, device=device, generator=g)
    if noncontiguous:
        gate, up = _noncontiguous(gate), _noncontiguous(up)
    return Sample(name, dict(gate=gate, up=up, activation=act))


def _glu_samples(act):
    def samples(device):
        yield glu_case("7 x 24 x 40", device, shape=(7, 24, 40), act=act)
        yield glu_case("fused (17, 2 x 300)", device, shape=(17, 300), fused=True, act=act)
        yield glu_case("rows 1, N 4097, fp16", device, shape=(1, 4097), dtype=torch.float16, act=act)
        yield glu_case("non-contiguous (5, 96) fp32", device, shape=(5, 96), dtype=torch.float32,
                       noncontiguous=True, act=act)
        yield glu_case("fp32 gate ~ N(0, 16): saturated activations", device, shape=(5, 64),
                       dtype=torch.float32, act=act, gate_scale=4.0)
        yield glu_case("N0", device, shape=(3, 0), act=act)
        if act == "gelu":
            yield glu_case("tanh approximation (9, 72)", device, shape=(9, 72), act="gelu_tanh")
            yield glu_case("tanh approximation fp32, gate ~ N(0, 16)", device, shape=(5, 64),
                           dtype=torch.float32, act="gelu_tanh", gate_scale=4.0)
    return samples


from lanekit.reference.layers import GRAD_INPUTS  # noqa: E402 (no Triton import there)

_LAYERS = "lanekit.layers.op"
_REF = "lanekit.reference.layers"

def _without_residual(samples):
    return lambda device: (s for s in samples(device) if s.kwargs.get("residual") is None)


def _with_residual(samples):
    return lambda device: (s for s in samples(device) if s.kwargs.get("residual") is not None)


for _name, _samples, _doc in (
    ("rms_norm", _rms_norm_samples, "RMSNorm over the last dim (Gemma's 1 + w with offset=1)"),
    ("layer_norm", _layer_norm_samples, "LayerNorm over the last dim"),
    ("adaln", _adaln_samples, "DiT's adaptive LayerNorm, LN(x) * (1 + scale) + shift"),
):
    _lanes = {"triton": f"{_LAYERS}:{_name}_triton", "reference": f"{_LAYERS}:{_name}_reference"}
    register(Op(name=_name, family="layers", oracle=f"{_REF}:{_name}", lanes=_lanes,
                samples=_without_residual(_samples), outputs=(("y", "norm"),), doc=_doc))
    register(Op(name=f"{_name}+residual", family="layers", oracle=f"{_REF}:{_name}", lanes=_lanes,
                samples=_with_residual(_samples), outputs=(("y", "norm"), ("h", "exact")),
                doc=f"{_name} of h = x + residual ({'gate * x, ' if _name == 'adaln' else ''}fused), h returned too"))
    register(Op(
        name=f"{_name}.backward", family="layers", oracle=f"{_REF}:{_name}_backward",
        lanes={"triton": f"{_LAYERS}:{_name}_backward_triton",
               "reference": f"{_LAYERS}:{_name}_backward_reference"},
        samples=lambda device, _s=_samples: _with_douts(_s(device)),
        outputs=tuple((f"d{n}", "layers_bwd") for n in GRAD_INPUTS[_name]),
        doc=f"Gradients of {_name} (with or without residual) by autograd: "
            + ", ".join(f"d{n}" for n in GRAD_INPUTS[_name]),
    ))

register(Op(
    name="apply_rotary", family="layers", oracle=f"{_REF}:apply_rotary",
    lanes={"triton": f"{_LAYERS}:apply_rotary_triton", "reference": f"{_LAYERS}:apply_rotary_reference"},
    samples=_rotary_samples, outputs=(("out", "eltwise"),), doc="RoPE, NeoX or interleaved pairs, partial rotary, positions, packed",
))
register(Op(
    name="apply_rotary.backward", family="layers", oracle=f"{_REF}:apply_rotary_backward",
    lanes={"triton": f"{_LAYERS}:apply_rotary_backward_triton",
           "reference": f"{_LAYERS}:apply_rotary_backward_reference"},
    samples=lambda device: _with_douts(_rotary_samples(device)), outputs=(("dx", "eltwise"),),
    doc="Gradient of apply_rotary: the rotation back",
))
register(Op(
    name="rms_norm_rope", family="layers", oracle=f"{_REF}:rms_norm_rope",
    lanes={"triton": f"{_LAYERS}:rms_norm_rope_triton", "reference": f"{_LAYERS}:rms_norm_rope_reference"},
    samples=_rms_norm_rope_samples, outputs=(("q", "norm"), ("k", "norm")),
    doc="QK-norm: per-head RMSNorm then RoPE of q and k",
))
register(Op(
    name="rms_norm_rope.backward", family="layers", oracle=f"{_REF}:rms_norm_rope_backward",
    lanes={"triton": f"{_LAYERS}:rms_norm_rope_backward_triton",
           "reference": f"{_LAYERS}:rms_norm_rope_backward_reference"},
    samples=lambda device: _with_douts(_rms_norm_rope_samples(device)),
    outputs=(("dq", "layers_bwd"), ("dk", "layers_bwd"), ("dq_weight", "layers_bwd"),
             ("dk_weight", "layers_bwd")),
    doc="Gradients of rms_norm_rope: dq, dk, dq_weight, dk_weight",
))
register(Op(
    name="qk_norm_rope_quant", family="layers", oracle=f"{_REF}:qk_norm_rope_quant",
    lanes={"triton": f"{_LAYERS}:qk_norm_rope_quant_triton",
           "reference": f"{_LAYERS}:qk_norm_rope_quant_reference"},
    samples=_qk_quant_samples,
    outputs=(("q_codes", "codes"), ("q_scale", "norm"), ("k_codes", "codes"), ("k_scale", "norm")),
    doc="QK-norm, RoPE on the tail dims, per-(token, head) fp8 e4m3 / int8 codes (bit-exact) and scales",
))
for _name, _act in (("swiglu", "silu"), ("geglu", "gelu")):
    register(Op(
        name=_name, family="layers", oracle=f"{_REF}:glu",
        lanes={"triton": f"{_LAYERS}:glu_triton", "reference": f"{_LAYERS}:glu_reference"},
        samples=_glu_samples(_act), outputs=(("out", "eltwise"),), doc=f"{_act}(gate) * up, separate or from one fused (..., 2N) tensor",
    ))
    register(Op(
        name=f"{_name}.backward", family="layers", oracle=f"{_REF}:glu_backward",
        lanes={"triton": f"{_LAYERS}:glu_backward_triton", "reference": f"{_LAYERS}:glu_backward_reference"},
        samples=lambda device, _a=_act: _with_douts(_glu_samples(_a)(device)),
        outputs=(("dgate", "eltwise"), ("dup", "eltwise")),
        doc=f"Gradients of {_name}: d(gate), d(up) (one fused gradient for a fused input)",
    ))


# ------------------------------------------------------------------------------------------- rnn

RNN_GATES = {"lstm_cell": 4, "gru_cell": 3, "rnn_cell": 1}


def rnn_case(name, device, cell, *, B=17, In=13, H=27, dtype=torch.bfloat16, bias=True, hx=True,
             strided=False, nonlinearity="tanh", grads=False) -> Sample:
    """A sample of ``cell`` ("lstm_cell", "gru_cell" or "rnn_cell") in the lanes' normalized form.

    Weights are drawn as PyTorch's modules initialize them, U(-1/sqrt(H), 1/sqrt(H)); input and
    state are N(0, 1). ``strided``: input and w_ih are transposed views, h (and c) column slices
    of wider tensors. ``grads``: also the gradients of the outputs (dh_next, and dc_next for
    the LSTM), for the backward ops.
    """
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # the same inputs in every process
    G = RNN_GATES[cell]

    def uniform(*shape):
        return ((torch.rand(*shape, generator=g) * 2 - 1) * H ** -0.5).to(dtype=dtype, device=device)

    def state():
        if strided:  # every other column of a (B, 2H) tensor
            return randn(B, 2 * H, dtype=dtype, device=device, generator=g)[:, ::2]
        return randn(B, H, dtype=dtype, device=device, generator=g)

    if strided:
        x = randn(In, B, dtype=dtype, device=device, generator=g).t()
        w_ih = uniform(In, G * H).t()
    else:
        x = randn(B, In, dtype=dtype, device=device, generator=g)
        w_ih = uniform(G * H, In)
    kwargs = dict(input=x, h=state() if hx else None)
    if cell == "lstm_cell":
        kwargs["c"] = state() if hx else None
    kwargs.update(w_ih=w_ih, w_hh=uniform(G * H, H),
                  b_ih=uniform(G * H) if bias else None, b_hh=uniform(G * H) if bias else None)
    if cell == "rnn_cell":
        kwargs["nonlinearity"] = nonlinearity
    if grads:
        kwargs["dh_next"] = randn(B, H, dtype=dtype, device=device, generator=g)
        if cell == "lstm_cell":
            kwargs["dc_next"] = randn(B, H, dtype=dtype, device=device, generator=g)
    return Sample(name, kwargs)


def _rnn_samples(cell, grads=False):
    """Odd sizes (In=13, H=27; In=40, H=70), batches 17, 1 and 0, every dtype, no bias, no state,
    strided views; the Elman cell with tanh and relu."""
    f16, f32 = torch.float16, torch.float32

    def samples(device):
        def case(name, **kw):
            return rnn_case(name, device, cell, grads=grads, **kw)

        yield case("B17 In13 H27 bf16")
        yield case("B1 In13 H27 fp16 no bias", B=1, dtype=f16, bias=False)
        yield case("B17 In13 H27 fp32", dtype=f32)
        yield case("B17 In40 H70 bf16 no state", In=40, H=70, hx=False)
        yield case("B17 strided views fp16", dtype=f16, strided=True)
        if cell == "rnn_cell":
            yield case("B17 In13 H27 relu bf16", nonlinearity="relu")
            yield case("B1 In13 H27 relu fp32 no bias", B=1, dtype=f32, bias=False, nonlinearity="relu")
        yield case("B0", B=0)

    return samples


_RNN_DOCS = {
    "lstm_cell": "torch.nn.LSTMCell's step (gates i, f, g, o): h', c' from one fused launch",
    "gru_cell": "torch.nn.GRUCell's step (gates r, z, n; reset applied to W_hn h + b_hn): h' from one fused launch",
    "rnn_cell": "torch.nn.RNNCell's step, tanh or relu: h' from one fused launch",
}
_RNN_GRADS = {
    "lstm_cell": ("dinput", "dh", "dc", "dw_ih", "dw_hh", "db_ih", "db_hh"),
    "gru_cell": ("dinput", "dh", "dw_ih", "dw_hh", "db_ih", "db_hh"),
    "rnn_cell": ("dinput", "dh", "dw_ih", "dw_hh", "db_ih", "db_hh"),
}

for _cell in ("lstm_cell", "gru_cell", "rnn_cell"):
    register(Op(
        name=_cell,
        family="rnn",
        oracle=f"lanekit.reference.rnn:{_cell}",
        lanes={"triton": f"lanekit.rnn.op:{_cell}_triton", "reference": f"lanekit.rnn.op:{_cell}_reference"},
        samples=_rnn_samples(_cell),
        outputs=(("h", "rnn_fwd"), ("c", "rnn_fwd")) if _cell == "lstm_cell" else (("h", "rnn_fwd"),),
        doc=_RNN_DOCS[_cell],
    ))
    register(Op(
        name=f"{_cell}.backward",
        family="rnn",
        oracle=f"lanekit.reference.rnn:{_cell}_backward",
        lanes={"triton": f"lanekit.rnn.op:{_cell}_backward_triton",
               "reference": f"lanekit.rnn.op:{_cell}_backward_reference"},
        samples=_rnn_samples(_cell, grads=True),
        outputs=tuple((name, "rnn_bwd") for name in _RNN_GRADS[_cell]),
        doc=f"Gradients of {_cell} by autograd: input, state, weights and biases (empty where absent)",
    ))


# -------------------------------------------------------------------------------------- kv cache

_KV = "lanekit.kv_cache.op"
_KV_REF = "lanekit.reference.kv_cache"
_E4M3 = torch.float8_e4m3fn

# Round-half-even cases of the codes at scale 1, and the clamps: int8 ties +-0.5, +-1.5, +-2.5 go
# to 0, +-2, +-2; -128.5 to -128 (even), -129 and -200 clamp to -128, 127.5 to 127 (128 clamps);
# e4m3 (spacing 1/8 on [1, 2), 2 on [16, 32), 32 on [256, 448]): 1.0625 -> 1, 1.1875 -> 1.25,
# 17 -> 16, 19 -> 20, 432 -> 448, 464 and 500 clamp to 448, subnormal ties 2^-10 -> 0 and
# 3 * 2^-10 -> 2^-8. Rows of these values need fp32 (bf16 has no -128.5).
INT8_TIES = (0.5, -0.5, 1.5, -1.5, 2.5, -2.5, -128.5, -129.0, -200.0, 127.5, 126.5, -127.5, 3.5, 0.0)
E4M3_TIES = (1.0625, -1.0625, 1.1875, -1.1875, 17.0, -19.0, 432.0, -432.0, 464.0, -500.0,
             2.0 ** -10, -(2.0 ** -10), 3 * 2.0 ** -10, 0.53125)


def tie_rows(dtype: torch.dtype, rows: int, D: int, *, with_amax: bool, generator) -> torch.Tensor:
    """(rows, D) fp32 rows holding the tie cases of ``dtype``'s codes (repeated, with small random
    values after them). ``with_amax``: the first feature of every row is qmax (127 or 448), so that
    amax / qmax is exactly 1 and the ties hold without a given scale (then the clamped cases are
    dropped: they would raise amax)."""
    ties = INT8_TIES if dtype == torch.int8 else E4M3_TIES
    qmax = 127.0 if dtype == torch.int8 else 448.0
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
    g = _gen(name)
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
    g = _gen(name)
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
    for kv, tag in _QUANT_TAGS:
        g = _gen(tag, "quantize_kv ")
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
    g = _gen("dequantize_kv")
    yield Sample("int8 (5, 3, 80) to bf16", dict(
        codes=_random_codes((5, 3, 80), torch.int8, g).to(device),
        scale=(torch.rand(5, 3, generator=g) * 0.1).to(device), dtype=torch.bfloat16))
    yield Sample("e4m3 (7, 64) to fp32", dict(
        codes=_random_codes((7, 64), _E4M3, g).to(device),
        scale=(torch.rand(7, generator=g) * 3).to(device), dtype=torch.float32))
    yield Sample("int8 (2, 1, 128) to fp16, one scale per tensor", dict(
        codes=_random_codes((2, 1, 128), torch.int8, g).to(device),
        scale=torch.full((), 0.02, device=device), dtype=torch.float16))


def merge_case(name, device, *, B=2, Sq=17, H=3, D=64, dtype=torch.bfloat16, empty_rows=True,
               noncontiguous=False) -> Sample:
    """Two partials with random LSEs; with ``empty_rows``: rows where a is empty (-inf, its out
    NaN), b is empty, both are, and a holds +inf (FlashAttention 2's empty row)."""
    g = _gen(name)
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
    samples=_kv_write_samples, outputs=(("k_cache", "exact"), ("v_cache", "exact")),
    doc="New tokens' keys and values written at their slots of a paged cache (negative slots skipped)",
))
register(Op(
    name="reshape_and_cache.quantized", family="kv_cache", oracle=f"{_KV_REF}:reshape_and_cache",
    lanes={"triton": f"{_KV}:reshape_and_cache_triton", "reference": f"{_KV}:reshape_and_cache_reference"},
    samples=_kv_write_quant_samples,
    outputs=(("k_cache", "codes"), ("v_cache", "codes"), ("k_cache_scale", "codes"), ("v_cache_scale", "codes")),
    doc="reshape_and_cache into int8 / fp8 e4m3 codes with per-(token, head) scales, bit-exact",
))
register(Op(
    name="gather_cache", family="kv_cache", oracle=f"{_KV_REF}:gather_cache",
    lanes={"triton": f"{_KV}:gather_cache_triton", "reference": f"{_KV}:gather_cache_reference"},
    samples=_kv_gather_samples, outputs=(("k", "exact"), ("v", "exact")),
    doc="Sequences read back from their pages through the block table, dense and zero-padded",
))
register(Op(
    name="gather_cache.dequantized", family="kv_cache", oracle=f"{_KV_REF}:gather_cache",
    lanes={"triton": f"{_KV}:gather_cache_triton", "reference": f"{_KV}:gather_cache_reference"},
    samples=_kv_gather_quant_samples, outputs=(("k", "exact"), ("v", "exact")),
    doc="gather_cache of an int8 / fp8 e4m3 cache: codes * scale in fp32, rounded to the dtype asked for",
))
register(Op(
    name="quantize_kv", family="kv_cache", oracle=f"{_KV_REF}:quantize_kv",
    lanes={"triton": f"{_KV}:quantize_kv_triton", "reference": f"{_KV}:quantize_kv_reference"},
    samples=_quantize_kv_samples, outputs=(("codes", "codes"), ("scale", "codes")),
    doc="Per-row int8 / fp8 e4m3 codes and scales (amax / qmax, or given), bit-exact, ties to even",
))
register(Op(
    name="dequantize_kv", family="kv_cache", oracle=f"{_KV_REF}:dequantize_kv",
    lanes={"triton": f"{_KV}:dequantize_kv_triton", "reference": f"{_KV}:dequantize_kv_reference"},
    samples=_dequantize_kv_samples, outputs=(("x", "exact"),),
    doc="codes * scale per row in fp32, rounded to the dtype asked for",
))
register(Op(
    name="merge_attn_states", family="kv_cache", oracle=f"{_KV_REF}:merge_attn_states",
    lanes={"triton": f"{_KV}:merge_attn_states_triton", "reference": f"{_KV}:merge_attn_states_reference"},
    samples=_merge_samples, outputs=(("out", "eltwise"), ("lse", "lse")),
    doc="Two attention partials merged by their LSEs (empty partials, -inf or +inf, contribute nothing)",
))
