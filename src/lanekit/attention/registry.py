"""The attention family's registry entries: sample builders, tolerances, and the ``register``
calls of flash_attn_func, flash_attn_varlen_func (and its packed variants) and flash_attn_with_kvcache
(forward and backward).

Each sample is in the lanes' normalized form (the keyword arguments of ``lanekit.attention.op``'s
lane functions); its values come from a generator seeded by its name, so every process draws the
same inputs.
"""

from __future__ import annotations

import itertools

import torch

from lanekit.runtime.registry import Op, Sample, register
from lanekit.testing import ELTWISE, LSE, Tolerance, every_other, generator, randn, with_output_grads

# The tolerances of attention's outputs (the project's rule and the shared ones: lanekit.testing).
ATTENTION_FWD = Tolerance(
    name="attention_fwd",
    ulps=3.0,
    fp32_ulps=64.0,
    reason=(
        "the probabilities P are rounded to the input format before the P.V product, as "
        "FlashAttention does to run it on the tensor cores. That adds up to u_in * max|v| "
        "(u_in: the input format's unit roundoff) on top of the final rounding: with "
        "max|v| about 3 * max|out|, as for random inputs, one to two more steps; measured "
        "up to 2.2 steps in bf16 (with an additive bias, whose largest probability is then "
        "not exactly 1) and 1.4 without. fp32: the online softmax and the length-Sk sums "
        "round at 2^-24 per term; 64 steps (2^-17 relative to max|out|) holds for Sk up to 64k."
    ),
)

ATTENTION_BWD = Tolerance(
    name="attention_bwd",
    ulps=6.0,
    fp32_ulps=64.0,
    reason=(
        "dQ sums Sk products and dK, dV sum Sq of them (times the query heads sharing a KV "
        "head), each with rounded factors: P and dS are rounded to the input format before "
        "their products, as in FlashAttention, and Delta = rowsum(dO * O) uses the rounded "
        "output. FlashAttention's rule for gradients is three times the error of the same "
        "computation done by PyTorch in the same precision; on the registered samples that "
        "PyTorch computation errs by up to 3.0 steps (fp16/bf16) and 7 steps (fp32), and "
        "lanekit by up to 1.9 and 12.6. Six steps is twice PyTorch's worst; fp32 as the forward. "
        "A fixed number of steps holds for these short rows only: over thousands of keys every "
        "16-bit computation errs more (lanekit 6.4 steps on dQ at 4096 keys), so long rows are "
        "held to the three-times-PyTorch rule itself (tests/test_attention_backward.py and "
        "every benchmark case)."
    ),
)

ATTENTION_DBIAS = Tolerance(
    name="attention_dbias",
    ulps=4.0,
    fp32_ulps=64.0,
    reason=(
        "dBias = P * (dP - Delta), rounded to the bias's format: the difference cancels, and "
        "Delta comes from the rounded output. PyTorch in the same precision errs by 2.3 steps "
        "on the bias sample, lanekit by 1.8."
    ),
)


ATTENTION_FP8 = Tolerance(
    name="attention_fp8",
    ulps=2.0,
    unit=torch.float8_e4m3fn,
    reason=(
        "fp8 attention: within one step of the fp8 format's rounding of P (lanekit.testing's note: "
        "the oracle rounds P where the kernel does, at the row's final max; the kernel rounds at "
        "its running max). Counted in e4m3 steps at max|out|; e5m2's step is two of them, so two "
        "steps (tests/test_attention_fp8.py holds each format to one step of its own). int8 "
        "samples (P in fp16) are within it by far."
    ),
)

LSE_FP8 = Tolerance(
    name="lse_fp8",
    ulps=1.0,
    fp32_ulps=4096.0,
    reason=(
        "the LSE of fp8 q k^T: Hopper's fp8 tensor cores add the products of one matrix "
        "instruction with about 14 bits kept after aligning them to the largest (DeepSeek-V3's "
        "report, 3.3.2), and Triton keeps that fast accumulation by default on sm90 "
        "(max_num_imprecise_acc), as FlashAttention-3's fp8 path does. Measured on an H100 over "
        "the registered samples: up to 1265 fp32 steps at max|lse| (2^-12.7 relative); the "
        "interpreter and sm80 (int8) are exact products summed in fp32. 2^-11 relative: 4096 steps."
    ),
)

ATTENTION_DSINKS = Tolerance(
    name="attention_dsinks",
    ulps=4.0,
    unit=torch.bfloat16,
    reason=(
        "d sink = -sum over B * Sq rows of exp(sink - lse) * (rowsum(dO * O) - dLSE): fp32, but "
        "from the output rounded to the inputs' 16-bit format (as FlashAttention's Delta), so "
        "each term carries that rounding and the sum may cancel. Counted in steps of bf16 (the "
        "coarser 16-bit input) at max|d sink|. On the registered samples PyTorch in the same "
        "precision errs by up to 3.4 steps (bf16), lanekit by 1.6: FlashAttention's rule (at "
        "most twice PyTorch's error) would allow 6.8; four steps."
    ),
)


def _quantized(x: torch.Tensor, dtype, B: int, Hkv: int, g) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 draws ``x`` as fp8/int8 codes (about 4 standard deviations to the format's top) and a
    (B, Hkv) fp32 descale drawn in [0.5, 1.5) over that factor: the values are codes * descale."""
    top = 127.0 if dtype == torch.int8 else min(torch.finfo(dtype).max, 448.0)
    c = top / 4.0
    codes = (x * c).clamp(-top, top)   # a draw past 4 deviations: the format's top, not NaN (e4m3 has no inf)
    codes = codes.round().to(dtype) if dtype == torch.int8 else codes.to(dtype)
    descale = (torch.rand(B, Hkv, generator=g) + 0.5) / c
    return codes, descale.to(x.device)


def _quant_kwargs(q, k, v, quant, B, Hkv, g, out_dtype=None) -> dict:
    """q, k, v as ``quant`` codes with their descales (and out_dtype), for a sample's kwargs."""
    q, qd = _quantized(q, quant, B, Hkv, g)
    k, kd = _quantized(k, quant, B, Hkv, g)
    v, vd = _quantized(v, quant, B, Hkv, g)
    return dict(q=q, k=k, v=v, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=out_dtype)


def _sink_logits(Hq: int, g, device) -> torch.Tensor:
    """(Hq,) fp32 sinks, about the size of gpt-oss's learned ones (a few units, either sign)."""
    return (torch.randn(Hq, generator=g) * 2.0).to(device)


def attention_case(name, device, *, B=1, Sq=17, Sk=17, Hq=2, Hkv=None, D=64, Dv=None,
                   dtype=torch.float16, causal=False, window_size=(-1, -1), softcap=0.0,
                   alibi=None, bias_shape=None, mask_shape=None, dropout_p=0.0, seed=0,
                   kv_transposed=False, sinks=False, quant=None, out_dtype=None) -> Sample:
    """A ``flash_attn_func`` sample in the lanes' normalized form, from readable parameters.

    ``alibi``: None, "head" (Hq,) or "batch" (B, Hq). ``bias_shape``/``mask_shape``: a shape
    broadcastable to (B, Hq, Sq, Sk). ``kv_transposed``: k and v are non-contiguous views.
    ``sinks``: a (Hq,) fp32 sink per head ("strided": a view of every other element). ``quant``:
    fp8/int8 q, k, v with (B, Hkv) descales
    (drawn in fp32, then quantized; ``dtype`` then only types the bias).
    """
    g = generator(name)
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
    extra = {}
    if sinks:
        extra["sinks"] = _sink_logits(Hq, g, device)
        if sinks == "strided":
            extra["sinks"] = every_other(extra["sinks"])
    if quant is not None:
        extra.update(_quant_kwargs(q.float(), k.float(), v.float(), quant, B, Hkv, g, out_dtype))
        q, k, v = extra.pop("q"), extra.pop("k"), extra.pop("v")
    return Sample(name, dict(
        q=q, k=k, v=v, softmax_scale=D ** -0.5, window_size=(left, 0 if causal else right),
        softcap=softcap, alibi_slopes=slopes, attn_bias=bias, attn_mask=mask,
        dropout_p=dropout_p, seed=seed, offset=0, **extra,
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
    yield attention_case("sinks gqa 4:2 causal d64 bf16", device, B=2, Sq=33, Sk=40, Hq=4, Hkv=2, D=64,
                         dtype=bf16, causal=True, sinks=True)
    yield attention_case("sinks window(8,0) softcap alibi d80", device, Sq=29, Sk=50, D=80, window_size=(8, 0),
                         softcap=20.0, alibi="head", sinks=True)
    yield attention_case("sinks Sk0 (every row: the sink alone)", device, Sq=5, Sk=0, D=16, sinks=True)
    yield attention_case("sinks a strided view, gqa 4:2 causal d64 bf16", device, B=2, Sq=33, Sk=40, Hq=4, Hkv=2,
                         D=64, dtype=bf16, causal=True, sinks="strided")


def _attention_fp8_samples(device):
    e4m3, e5m2, i8 = torch.float8_e4m3fn, torch.float8_e5m2, torch.int8
    bf16, f16 = torch.bfloat16, torch.float16
    yield attention_case("e4m3 gqa 6:2 causal Sq17 Sk129 d64", device, Sq=17, Sk=129, Hq=6, Hkv=2, D=64,
                         causal=True, quant=e4m3)
    yield attention_case("e5m2 d128 softcap30 alibi(B,H) B2", device, B=2, Sq=33, Sk=65, D=128, softcap=30.0,
                         alibi="batch", quant=e5m2)
    yield attention_case("e4m3 bias+mask window(8,3) d80 out fp16", device, B=2, Sq=19, Sk=41, D=80,
                         dtype=bf16, window_size=(8, 3), bias_shape=(1, 2, 19, 41), mask_shape=(2, 1, 1, 41),
                         quant=e4m3, out_dtype=f16)
    yield attention_case("int8 gqa 4:2 causal d96 sinks", device, Sq=40, Sk=40, Hq=4, Hkv=2, D=96, causal=True,
                         quant=i8, sinks=True)
    yield attention_case("int8 bias d64 Dv48 out fp32", device, Sq=9, Sk=70, D=64, Dv=48, dtype=f16,
                         bias_shape=(1, 1, 9, 70), quant=i8, out_dtype=torch.float32)
    yield attention_case("e5m2 mqa 4:1 Sq1 Sk37 d59 sinks", device, Sq=1, Sk=37, Hq=4, Hkv=1, D=59, quant=e5m2,
                         sinks=True)
    yield attention_case("e4m3 d16 (k of 16 in q k^T)", device, Sq=20, Sk=24, D=16, quant=e4m3)
    yield attention_case("int8 d8 Dv16", device, Sq=9, Sk=30, D=8, Dv=16, quant=i8)


def _attention_bwd_samples(device):
    """The forward's samples, each with a gradient of out (dout), plus an empty query."""
    cases = list(_attention_samples(device))
    cases.append(attention_case("Sq0", device, Sq=0, Sk=7, D=16))
    yield from _with_dout(cases, device)


def _with_dout(cases, device):
    """Each attention sample with a gradient of its out, dout (q's shape with v's head dim)."""
    return with_output_grads(cases, lambda kw: {"dout": ((*kw["q"].shape[:-1], kw["v"].shape[-1]), kw["q"])})

register(Op(
    name="flash_attn_func",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn",
    lanes={"triton": "lanekit.attention.op:flash_attn_triton",
           "reference": "lanekit.attention.op:flash_attn_reference"},
    samples=_attention_samples,
    outputs=(("out", ATTENTION_FWD), ("lse", LSE)),
    doc="FlashAttention-compatible attention forward: MHA/GQA/MQA, causal/window, softcap, ALiBi, bias, mask, dropout",
))

register(Op(
    name="flash_attn_func.backward",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn_backward",
    lanes={"triton": "lanekit.attention.op:flash_attn_backward_triton",
           "reference": "lanekit.attention.op:flash_attn_backward_reference"},
    samples=_attention_bwd_samples,
    outputs=(("dq", ATTENTION_BWD), ("dk", ATTENTION_BWD), ("dv", ATTENTION_BWD),
             ("dbias", ATTENTION_DBIAS), ("dsinks", ATTENTION_DSINKS)),
    doc="Gradients of flash_attn_func by autograd: dq, dk, dv, and the bias's and sinks' gradients when given",
))

register(Op(
    name="flash_attn_func.fp8",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn_quantized",
    lanes={"triton": "lanekit.attention.op:flash_attn_triton",
           "reference": "lanekit.attention.op:flash_attn_reference"},
    samples=_attention_fp8_samples,
    outputs=(("out", ATTENTION_FP8), ("lse", LSE_FP8)),
    doc="fp8 (e4m3, e5m2) and int8 flash_attn_func with FlashAttention-3's descales; P.V in V's fp8 format",
))


def varlen_case(name, device, *, seqlens_q, seqlens_k, Hq=2, Hkv=None, D=64, dtype=torch.float16,
                causal=False, window_size=(-1, -1), softcap=0.0, alibi=False, dropout_p=0.0, seed=0,
                page_size=None, num_blocks=None, sinks=False, quant=None) -> Sample:
    """A ``flash_attn_varlen_func`` sample in the lanes' normalized form: packed q, k, v for the
    given per-sequence lengths; with ``page_size``, k and v in a paged cache whose pages are
    handed out in a shuffled order (and a spare page nobody owns)."""
    g = generator(name)
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
    extra = {}
    if sinks:
        extra["sinks"] = _sink_logits(Hq, g, device)
    if quant is not None:   # (sinks, then) codes and descales, row b for sequence b
        extra.update(_quant_kwargs(q.float(), k.float(), v.float(), quant, B, Hkv, g))
        q, k, v = extra.pop("q"), extra.pop("k"), extra.pop("v")
    return Sample(name, dict(
        q=q, k=k, v=v, cu_seqlens_q=cu_q.to(device), cu_seqlens_k=cu_k.to(device),
        max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k), block_table=block_table,
        softmax_scale=D ** -0.5, window_size=(left, 0 if causal else right), softcap=softcap,
        alibi_slopes=slopes, dropout_p=dropout_p, seed=seed, offset=0, **extra,
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
        yield varlen_case("sinks paged page5 causal d64", device, seqlens_q=[3, 9], seqlens_k=[12, 9], Hq=4,
                          Hkv=2, D=64, dtype=bf16, causal=True, page_size=5, sinks=True)
    yield varlen_case("sinks gqa 4:2 Sq[17,0,9] Sk[30,4,0] causal d64", device, seqlens_q=[17, 0, 9],
                      seqlens_k=[30, 4, 0], Hq=4, Hkv=2, D=64, dtype=bf16, causal=True, sinks=True)


def _varlen_fp8_samples(device):
    e4m3, e5m2, i8 = torch.float8_e4m3fn, torch.float8_e5m2, torch.int8
    yield varlen_case("e4m3 gqa 4:2 causal Sq[17,1,40] Sk[30,9,40] d64", device, seqlens_q=[17, 1, 40],
                      seqlens_k=[30, 9, 40], Hq=4, Hkv=2, D=64, causal=True, quant=e4m3)
    yield varlen_case("e5m2 window(5,2) softcap alibi sinks d96", device, seqlens_q=[17, 40], seqlens_k=[50, 40],
                      D=96, window_size=(5, 2), softcap=20.0, alibi=True, sinks=True, quant=e5m2)
    yield varlen_case("int8 paged page3 causal Sk[10,7,4] d64", device, seqlens_q=[1, 7, 0], seqlens_k=[10, 7, 4],
                      Hq=4, Hkv=2, D=64, causal=True, page_size=3, quant=i8)
    yield varlen_case("e4m3 paged page16 d128 window(8,0)", device, seqlens_q=[5, 16], seqlens_k=[37, 16],
                      D=128, window_size=(8, 0), page_size=16, quant=e4m3)


def _varlen_bwd_samples(device):
    yield from _with_dout(_varlen_samples(device, paged=False), device)


register(Op(
    name="flash_attn_varlen_func",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn_varlen",
    lanes={"triton": "lanekit.attention.op:flash_attn_varlen_triton",
           "reference": "lanekit.attention.op:flash_attn_varlen_reference"},
    samples=_varlen_samples,
    outputs=(("out", ATTENTION_FWD), ("lse", LSE)),
    doc="Attention over packed variable-length sequences (FlashAttention's varlen), packed or paged K/V",
))

register(Op(
    name="flash_attn_varlen_func.backward",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn_varlen_backward",
    lanes={"triton": "lanekit.attention.op:flash_attn_varlen_backward_triton",
           "reference": "lanekit.attention.op:flash_attn_varlen_backward_reference"},
    samples=_varlen_bwd_samples,
    outputs=(("dq", ATTENTION_BWD), ("dk", ATTENTION_BWD), ("dv", ATTENTION_BWD), ("dsinks", ATTENTION_DSINKS)),
    doc="Gradients of flash_attn_varlen_func (packed K/V) by autograd: dq, dk, dv, and the sinks' when given",
))

register(Op(
    name="flash_attn_varlen_func.fp8",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn_varlen_quantized",
    lanes={"triton": "lanekit.attention.op:flash_attn_varlen_triton",
           "reference": "lanekit.attention.op:flash_attn_varlen_reference"},
    samples=_varlen_fp8_samples,
    outputs=(("out", ATTENTION_FP8), ("lse", LSE_FP8)),
    doc="fp8 (e4m3, e5m2) and int8 flash_attn_varlen_func with descales, packed or paged K/V",
))


def _packed(sample: Sample, qkv: bool) -> Sample:
    """A (non-paged) varlen sample in the packed variants' normalized form: q, k, v stacked along
    dimension 1 as qkv (total, 3, H, D) with one set of lengths, or k, v as kv (total_k, 2, Hkv, D)."""
    kw = dict(sample.kwargs)
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    kw.pop("block_table")
    if not qkv:
        return Sample(sample.name, dict(q=q, kv=torch.stack((k, v), dim=1), **kw))
    cu, max_seqlen = kw.pop("cu_seqlens_q"), kw.pop("max_seqlen_q")
    kw.pop("cu_seqlens_k"), kw.pop("max_seqlen_k")
    return Sample(sample.name, dict(qkv=torch.stack((q, k, v), dim=1), cu_seqlens=cu, max_seqlen=max_seqlen, **kw))


def _varlen_qkvpacked_samples(device):
    bf16, f32 = torch.bfloat16, torch.float32
    for lengths, kw in ((([17, 0, 33]), dict(name="d64 causal S[17,0,33]", D=64, causal=True)),
                        (([40, 9]), dict(name="bf16 d80 window(5,2) softcap alibi S[40,9]", D=80, dtype=bf16,
                                         window_size=(5, 2), softcap=20.0, alibi=True)),
                        (([20, 7]), dict(name="fp32 d128 S[20,7]", D=128, dtype=f32, Hq=3)),
                        (([9, 21]), dict(name="dropout0.2 d32 S[9,21]", D=32, dropout_p=0.2, seed=77))):
        name = kw.pop("name")
        yield _packed(varlen_case(name, device, seqlens_q=lengths, seqlens_k=lengths, **kw), qkv=True)


def _varlen_kvpacked_samples(device):
    bf16 = torch.bfloat16
    for (sq, sk), kw in ((([5, 33], [40, 33]), dict(name="gqa 6:2 d64 causal Sq[5,33] Sk[40,33]", Hq=6, Hkv=2,
                                                    D=64, causal=True)),
                         (([1, 17], [37, 0]), dict(name="mqa 4:1 bf16 d96 window(8,0) Sq[1,17] Sk[37,0]", Hq=4,
                                                   Hkv=1, D=96, dtype=bf16, window_size=(8, 0))),
                         (([20, 9], [7, 33]), dict(name="softcap alibi d59 Sq[20,9] Sk[7,33]", D=59, softcap=20.0,
                                                   alibi=True)),
                         (([9, 21], [30, 21]), dict(name="dropout0.2 d32 Sq[9,21] Sk[30,21]", D=32, dropout_p=0.2,
                                                    seed=77))):
        name = kw.pop("name")
        yield _packed(varlen_case(name, device, seqlens_q=sq, seqlens_k=sk, **kw), qkv=False)


register(Op(
    name="flash_attn_varlen_qkvpacked_func",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn_varlen_qkvpacked",
    lanes={"triton": "lanekit.attention.op:flash_attn_varlen_qkvpacked_triton",
           "reference": "lanekit.attention.op:flash_attn_varlen_qkvpacked_reference"},
    samples=_varlen_qkvpacked_samples,
    outputs=(("out", ATTENTION_FWD), ("lse", LSE)),
    doc="flash_attn_varlen_func on q, k, v packed as qkv (total, 3, H, D), one set of lengths",
))

register(Op(
    name="flash_attn_varlen_qkvpacked_func.backward",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn_varlen_qkvpacked_backward",
    lanes={"triton": "lanekit.attention.op:flash_attn_varlen_qkvpacked_backward_triton",
           "reference": "lanekit.attention.op:flash_attn_varlen_qkvpacked_backward_reference"},
    samples=lambda device: with_output_grads(
        _varlen_qkvpacked_samples(device), lambda kw: {"dout": (kw["qkv"][:, 0].shape, kw["qkv"])}),
    outputs=(("dqkv", ATTENTION_BWD),),
    doc="Gradient of flash_attn_varlen_qkvpacked_func by autograd: dqkv in qkv's layout",
))

register(Op(
    name="flash_attn_varlen_kvpacked_func",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn_varlen_kvpacked",
    lanes={"triton": "lanekit.attention.op:flash_attn_varlen_kvpacked_triton",
           "reference": "lanekit.attention.op:flash_attn_varlen_kvpacked_reference"},
    samples=_varlen_kvpacked_samples,
    outputs=(("out", ATTENTION_FWD), ("lse", LSE)),
    doc="flash_attn_varlen_func with k, v packed as kv (total_k, 2, Hkv, D)",
))

register(Op(
    name="flash_attn_varlen_kvpacked_func.backward",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn_varlen_kvpacked_backward",
    lanes={"triton": "lanekit.attention.op:flash_attn_varlen_kvpacked_backward_triton",
           "reference": "lanekit.attention.op:flash_attn_varlen_kvpacked_backward_reference"},
    samples=lambda device: with_output_grads(
        _varlen_kvpacked_samples(device), lambda kw: {"dout": (kw["q"].shape[:-1] + kw["kv"].shape[-1:], kw["q"])}),
    outputs=(("dq", ATTENTION_BWD), ("dkv", ATTENTION_BWD)),
    doc="Gradients of flash_attn_varlen_kvpacked_func by autograd: dq, and dkv in kv's layout",
))

def kvcache_case(name, device, *, B=2, Sq=1, Hq=4, Hkv=2, D=64, Dv=None, dtype=torch.bfloat16,
                 seqlens=(5, 29), S_new=1, capacity=40, page_size=None, rotary_dim=0, interleaved=True,
                 leftpad=None, batch_idx=None, causal=True, window_size=(-1, -1), softcap=0.0,
                 alibi=False, quant=None, num_splits=1, max_seqlen_k=None, sinks=False, descaled=None) -> Sample:
    """A ``flash_attn_with_kvcache`` sample in the lanes' normalized form: a contiguous cache of
    ``capacity`` tokens per row, or a paged one whose pages are shuffled (with spare pages nobody
    owns), filled with random values (or their int8 / e4m3 codes and scales). ``descaled``: an
    fp8/int8 q over caches of that dtype with (B, Hkv) descales (no append, no rotary)."""
    from lanekit.reference.kv_cache import quantize_kv

    g = generator(name)
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
    extra = {}
    if sinks:
        extra["sinks"] = _sink_logits(Hq, g, device)
    if descaled is not None:
        extra.update(_quant_kwargs(q.float(), k_cache.float(), v_cache.float(), descaled, B, Hkv, g))
        q, k_cache, v_cache = extra.pop("q"), extra.pop("k"), extra.pop("v")
    return Sample(name, dict(
        q=q, k_cache=k_cache, v_cache=v_cache,
        cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device), k=k, v=v,
        rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
        cache_batch_idx=torch.tensor(batch_idx, dtype=torch.int32, device=device) if batch_idx else None,
        cache_leftpad=torch.tensor(leftpad, dtype=torch.int32, device=device) if leftpad else None,
        block_table=block_table, k_cache_scale=k_scale, v_cache_scale=v_scale, kv_dtype=k_cache.dtype,
        rotary_dtype=dtype, softmax_scale=D ** -0.5, window_size=(left, 0 if causal else right),
        softcap=softcap, alibi_slopes=(torch.rand(B, Hq, generator=g) * 0.5).to(device) if alibi else None,
        num_splits=num_splits, max_seqlen_k=max_seqlen_k, **extra,
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
    # D=128 in 16 bits takes the rows tuned for the H200 (attention.tuning.FLASH_ATTN_KVCACHE, its short and
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
    yield kvcache_case("sinks paged page 7, splits 3, gqa 4:2", device, page_size=7, seqlens=(13, 30), num_splits=3,
                       sinks=True)
    yield kvcache_case("sinks unsplit, seqlens (0, 20): a row of the sink alone", device, S_new=0, seqlens=(0, 20),
                       sinks=True)


def _kvcache_fp8_samples(device):
    e4m3, e5m2, i8 = torch.float8_e4m3fn, torch.float8_e5m2, torch.int8
    # value heads of 40, 48 and 80 on paged fp8/int8 caches: the loads along Dv stop at Dv
    yield kvcache_case("e4m3 paged page 5 Dv40 splits 2", device, D=64, Dv=40, page_size=5, S_new=0,
                       seqlens=(13, 33), num_splits=2, descaled=e4m3)
    yield kvcache_case("int8 paged page 16 Dv48 splits 3 sinks", device, D=64, Dv=48, page_size=16, S_new=0,
                       seqlens=(40, 7), num_splits=3, sinks=True, descaled=i8)
    yield kvcache_case("e5m2 paged page 3 Dv80 gqa 6:1 window(9,0)", device, Hq=6, Hkv=1, D=80, Dv=80,
                       page_size=3, S_new=0, seqlens=(20, 11), window_size=(9, 0), descaled=e5m2)
    yield kvcache_case("int8 paged page 7 Dv80 softcap alibi splits 2", device, D=96, Dv=80, page_size=7, S_new=0,
                       seqlens=(25, 2), softcap=15.0, alibi=True, num_splits=2, descaled=i8)
    yield kvcache_case("e4m3 contiguous Sq 3 d128 sinks", device, Sq=3, Hq=8, D=128, S_new=0, seqlens=(30, 12),
                       sinks=True, descaled=e4m3)
    yield kvcache_case("int8 d16 Dv8 paged page 4", device, D=16, Dv=8, page_size=4, S_new=0, seqlens=(9, 14),
                       descaled=i8)


register(Op(
    name="flash_attn_with_kvcache",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn_with_kvcache",
    lanes={"triton": "lanekit.attention.op:flash_attn_with_kvcache_triton",
           "reference": "lanekit.attention.op:flash_attn_with_kvcache_reference"},
    samples=_kvcache_samples,
    outputs=(("out", ATTENTION_FWD), ("lse", LSE), ("k_cache", ELTWISE), ("v_cache", ELTWISE)),
    doc="Decode over a contiguous or paged (quantized) KV cache: append, RoPE, split-KV (FlashAttention's with_kvcache)",
))

register(Op(
    name="flash_attn_with_kvcache.fp8",
    family="attention",
    oracle="lanekit.reference.attention:flash_attn_with_kvcache_quantized",
    lanes={"triton": "lanekit.attention.op:flash_attn_with_kvcache_triton",
           "reference": "lanekit.attention.op:flash_attn_with_kvcache_reference"},
    samples=_kvcache_fp8_samples,
    outputs=(("out", ATTENTION_FP8), ("lse", LSE_FP8), ("k_cache", ELTWISE), ("v_cache", ELTWISE)),
    doc="fp8 (e4m3, e5m2) and int8 q over caches of its dtype with descales: paged, split-K (with_kvcache)",
))

# MLA decode (flash_mla_with_kvcache) registers from a module of its own
from lanekit.attention import registry_mla  # noqa: E402,F401
