"""The fused layers' registry entries: sample builders, tolerances, and the ``register`` calls of
the norms (RMSNorm, LayerNorm, AdaLN, with and without a fused residual), RoPE, QK-norm (with
quantization) and the GLUs, forward and backward.

Each sample is in the lanes' normalized form (the keyword arguments of ``lanekit.layers.op``'s lane
functions); its values come from a generator seeded by its name.
"""

from __future__ import annotations

import torch

from lanekit.reference.layers import GRAD_INPUTS
from lanekit.runtime.registry import Op, Sample, register
from lanekit.testing import (CODES, ELTWISE, EXACT, Tolerance, generator, noncontiguous as _noncontiguous, randn,
                             with_output_grads)

# The tolerances of the layers' outputs (the project's rule and the shared ones: lanekit.testing).
NORM = Tolerance(
    name="norm",
    ulps=1.0,
    fp32_ulps=8.0,
    reason=(
        "16-bit outputs are one rounding of an fp32 result: one step. fp32 outputs carry the "
        "rounding of the mean and mean square, sums of N fp32 terms in an order that depends on "
        "the tile: measured up to 1.2 steps, also on rows of mean 100 at N=4096 and 20000 (the "
        "mean is kept as an unevaluated sum of two fp32, where PyTorch in fp32 errs by 14 "
        "steps); eight steps"
    ),
)

LAYERS_BWD = Tolerance(
    name="layers_bwd",
    ulps=1.0,
    fp32_ulps=16.0,
    reason=(
        "16-bit gradients are one rounding of an fp32 result (measured at most 0.5 steps, where "
        "PyTorch in the same precision errs by up to 1.9). fp32 gradients of the parameters "
        "(dweight, dscale, dgate) are sums over rows in fp32, each term rounded at 2^-24: "
        "measured up to 2.2 steps over 17 rows (PyTorch in fp32: 1.5); sixteen steps leaves "
        "room for thousands of rows"
    ),
)


def _param(N, g, device, layout="contiguous", dtype=torch.float32):
    """A (N,) parameter: contiguous, "strided" (every other element of a buffer) or "expanded"
    (one value broadcast, stride 0)."""
    if layout == "expanded":
        return randn(1, dtype=dtype, device=device, generator=g).expand(N)
    if layout == "strided":
        return randn(2 * N, dtype=dtype, device=device, generator=g)[::2]
    return randn(N, dtype=dtype, device=device, generator=g)


def at_the_ends(x: torch.Tensor, tiny_factor: float) -> torch.Tensor:
    """x (..., N) with its rows, in turn, near the largest normal of x's dtype (|x| up to it), near
    its smallest (up to ``tiny_factor`` times it: many values subnormal), and near 1: rows whose
    fp32 sum of squares overflows or underflows, beside a row that does neither."""
    fi = torch.finfo(x.dtype)
    rows = x.reshape(-1, x.shape[-1]).double().clamp(-4, 4) / 4
    ends = torch.tensor([fi.max, fi.tiny * tiny_factor, 1.0], dtype=torch.float64, device=x.device)
    scale = ends[torch.arange(rows.shape[0], device=x.device) % 3]
    return (rows * scale[:, None]).to(x.dtype).reshape(x.shape)


def norm_case(name, device, *, shape, dtype=torch.bfloat16, weight=True, bias=False,
              residual=False, offset=0.0, noncontiguous=False, eps=1e-6, kind="rms",
              params="contiguous", mean=0.0, ends=None) -> Sample:
    """An ``rms_norm`` / ``layer_norm`` sample (``kind``), from readable parameters. ``params``:
    the weight's and bias's layout (see _param); ``mean``: added to every x; ``ends``: rows at
    the dtype's ends (:func:`at_the_ends`, that tiny_factor)."""
    g = generator(name)
    N = shape[-1]
    x = (randn(*shape, dtype=torch.float32, device=device, generator=g) + mean).to(dtype)
    if ends is not None:
        x = at_the_ends(x, ends)
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
    # rows near the format's largest and smallest normals: fp32's sum of squares over- or
    # underflows. eps 0, so that the tiny rows are their own scale and come out near 1, where the
    # tolerance (one step at the output's largest magnitude) sees them; many of their bf16 values
    # are subnormal (ends=32)
    yield norm_case("N300 rows near bf16's largest and smallest normals, eps 0", device, shape=(3, 300),
                    eps=0.0, ends=32.0)
    yield norm_case("N300 fp32 rows near fp32's largest and smallest normals, eps 0", device,
                    shape=(3, 300), dtype=f32, eps=0.0, ends=2.0 ** 10)
    yield norm_case("N256 fp16 rows near fp16's largest and smallest normals, eps 0", device,
                    shape=(3, 256), dtype=f16, eps=0.0, ends=32.0)
    yield norm_case("N20000 (looped) rows near bf16's largest and smallest normals, eps 0", device,
                    shape=(3, 20000), eps=0.0, ends=32.0)


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
    yield norm_case("N300 rows near bf16's largest and smallest normals, eps 0", device, shape=(3, 300),
                    kind="ln", bias=True, eps=0.0, ends=32.0)
    yield norm_case("N300 fp32 rows near fp32's largest and smallest normals, eps 0", device,
                    shape=(3, 300), kind="ln", bias=True, dtype=torch.float32, eps=0.0, ends=2.0 ** 10)
    yield norm_case("N20000 (looped) fp32 rows near fp32's largest and smallest normals", device,
                    shape=(3, 20000), kind="ln", bias=True, dtype=torch.float32, ends=2.0 ** 10, eps=0.0)


def adaln_case(name, device, *, shape, per_batch=True, gate=False, residual=False,
               dtype=torch.bfloat16, mod_dtype=None, ends=None, eps=1e-6) -> Sample:
    g = generator(name)
    N = shape[-1]
    mod_rows = shape[0]
    mod = mod_dtype or dtype

    def m():
        return randn(mod_rows, N, dtype=mod, device=device, generator=g, scale=0.5)

    x = randn(*shape, dtype=dtype, device=device, generator=g)
    if ends is not None:
        x = at_the_ends(x, ends)
    return Sample(name, dict(
        x=x, scale=m(), shift=m(), gate=m() if gate else None, eps=eps,
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
    yield adaln_case("N160 (B=2, S=3) rows near bf16's largest and smallest normals, eps 0", device,
                     shape=(2, 3, 160), eps=0.0, ends=32.0)
    yield adaln_case("N96 (B=1, S=3) fp32 rows near fp32's largest and smallest normals, eps 0", device,
                     shape=(1, 3, 96), dtype=torch.float32, eps=0.0, ends=2.0 ** 10)


def _with_douts(samples):
    """Each forward sample with a gradient for each output: dout (and dh for a returned residual
    sum; dk for rms_norm_rope's k')."""
    return with_output_grads(samples, _grads_of)


def _grads_of(kw):
    if "q" in kw:
        x, out_shape = kw["q"], kw["q"].shape
        grads = {"dk": (kw["k"].shape, kw["k"])}
    elif "activation" in kw:
        x, grads = kw["gate"], {}
        out_shape = x.shape if kw["up"] is not None else (*x.shape[:-1], x.shape[-1] // 2)
    else:
        x, grads = kw["x"], {}
        out_shape = x.shape
    grads["dout"] = (out_shape, x)
    if kw.get("residual") is not None:
        grads["dh"] = (x.shape, x)
    return grads


def rotary_case(name, device, *, shape, rotary_dim=None, interleaved=False, dtype=torch.bfloat16,
                S_ro=None, position_ids=False, seqlen_offsets=0, cu_seqlens=None, noncontiguous=False,
                sin_strided=False):
    g = generator(name)
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
            k_heads_first=False, ends=None, eps=1e-6):
    """weights: both, none, or "q" (q's only). fused_qkv: q and k as head slices of one
    (B, S, Hq + 2 Hkv, D) buffer (strides unlike either's own). k_weight_dtype: k's weight in
    another dtype than q's. k_heads_first: k a (B, S, Hkv, D) view of a (B, Hkv, S, D) tensor
    (token and head strides unlike q's). ends: head vectors at the dtype's ends (:func:`at_the_ends`,
    that tiny_factor)."""
    g = generator(name)
    rd = rotary_dim or D
    if fused_qkv:
        qkv = randn(B, S, Hq + 2 * Hkv, D, dtype=dtype, device=device, generator=g, scale=2.0)
        q, k = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv]
    else:
        q = randn(B, S, Hq, D, dtype=dtype, device=device, generator=g, scale=2.0)
        k = randn(B, S, Hkv, D, dtype=dtype, device=device, generator=g, scale=2.0)
    if k_heads_first:
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    if ends is not None:
        q, k = at_the_ends(q, ends), at_the_ends(k, ends)
    angles = torch.rand(64, rd // 2, generator=g) * 6.3
    kw = dict(q=q, k=k,
              q_weight=_param(D, g, device, params, dtype) if weights else None,
              k_weight=_param(D, g, device, params, k_weight_dtype or dtype)
              if weights and weights != "q" else None,
              cos=angles.cos().to(device), sin=angles.sin().to(device),
              eps=float(torch.tensor(eps, dtype=torch.float32)), offset=offset,
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
    yield qk_case("heads near bf16's largest and smallest normals, eps 0, D64 S3", device, D=64, S=3,
                  eps=0.0, ends=32.0)
    # D64: fp32 at D80 spills in the backward on sm90 (40 bytes a thread, before this sample too)
    yield qk_case("fp32 heads near fp32's largest and smallest normals, eps 0, D64 S2", device, D=64, S=2,
                  dtype=torch.float32, eps=0.0, ends=2.0 ** 10)


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


def _rotary_qk_samples(device):
    """q and k from qk_case, without the norm's arguments."""
    def drop(sample):
        kw = {n: v for n, v in sample.kwargs.items() if n not in ("q_weight", "k_weight", "eps", "offset")}
        if isinstance(kw["seqlen_offsets"], list):   # one per batch entry
            kw["seqlen_offsets"] = torch.tensor(kw["seqlen_offsets"], dtype=torch.int32, device=kw["q"].device)
        return Sample(sample.name, kw)

    yield drop(qk_case("GQA 4:2 D80", device, weights=False))
    yield drop(qk_case("D96 interleaved partial 64, S17 B1", device, D=96, rotary_dim=64, interleaved=True,
                       S=17, B=1, weights=False))
    yield drop(qk_case("D128 fp16 position_ids, Hq 8 Hkv 1", device, D=128, dtype=torch.float16, Hq=8, Hkv=1,
                       position_ids=True, S=3, weights=False))
    yield drop(qk_case("D64 S1 offset 30", device, D=64, S=1, seqlen_offsets=30, weights=False))
    yield drop(qk_case("q, k slices of one qkv buffer, Hq 3 Hkv 5 D64", device, Hq=3, Hkv=5, D=64, S=7,
                       fused_qkv=True, weights=False))
    yield drop(qk_case("k laid out heads first, Hq 2 Hkv 3 D80 offsets per batch", device, Hq=2, Hkv=3, S=6,
                       k_heads_first=True, seqlen_offsets=[3, 0], weights=False))


def glu_case(name, device, *, shape, fused=False, dtype=torch.bfloat16, noncontiguous=False, act="silu",
             gate_scale=2.0):
    g = generator(name)
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
                samples=_without_residual(_samples), outputs=(("y", NORM),), doc=_doc))
    register(Op(name=f"{_name}+residual", family="layers", oracle=f"{_REF}:{_name}", lanes=_lanes,
                samples=_with_residual(_samples), outputs=(("y", NORM), ("h", EXACT)),
                doc=f"{_name} of h = x + residual ({'gate * x, ' if _name == 'adaln' else ''}fused), h returned too"))
    register(Op(
        name=f"{_name}.backward", family="layers", oracle=f"{_REF}:{_name}_backward",
        lanes={"triton": f"{_LAYERS}:{_name}_backward_triton",
               "reference": f"{_LAYERS}:{_name}_backward_reference"},
        samples=lambda device, _s=_samples: _with_douts(_s(device)),
        outputs=tuple((f"d{n}", LAYERS_BWD) for n in GRAD_INPUTS[_name]),
        doc=f"Gradients of {_name} (with or without residual) by autograd: "
            + ", ".join(f"d{n}" for n in GRAD_INPUTS[_name]),
    ))

register(Op(
    name="apply_rotary", family="layers", oracle=f"{_REF}:apply_rotary",
    lanes={"triton": f"{_LAYERS}:apply_rotary_triton", "reference": f"{_LAYERS}:apply_rotary_reference"},
    samples=_rotary_samples, outputs=(("out", ELTWISE),), doc="RoPE, NeoX or interleaved pairs, partial rotary, positions, packed",
))
register(Op(
    name="apply_rotary.backward", family="layers", oracle=f"{_REF}:apply_rotary_backward",
    lanes={"triton": f"{_LAYERS}:apply_rotary_backward_triton",
           "reference": f"{_LAYERS}:apply_rotary_backward_reference"},
    samples=lambda device: _with_douts(_rotary_samples(device)), outputs=(("dx", ELTWISE),),
    doc="Gradient of apply_rotary: the rotation back",
))
register(Op(
    name="apply_rotary_qk", family="layers", oracle=f"{_REF}:apply_rotary_qk",
    lanes={"triton": f"{_LAYERS}:apply_rotary_qk_triton", "reference": f"{_LAYERS}:apply_rotary_qk_reference"},
    samples=_rotary_qk_samples, outputs=(("q", ELTWISE), ("k", ELTWISE)),
    doc="RoPE of q and k (GQA) in one launch, NeoX or interleaved, partial, positions",
))
register(Op(
    name="apply_rotary_qk.backward", family="layers", oracle=f"{_REF}:apply_rotary_qk_backward",
    lanes={"triton": f"{_LAYERS}:apply_rotary_qk_backward_triton",
           "reference": f"{_LAYERS}:apply_rotary_qk_backward_reference"},
    samples=lambda device: _with_douts(_rotary_qk_samples(device)), outputs=(("dq", ELTWISE), ("dk", ELTWISE)),
    doc="Gradients of apply_rotary_qk: both rotated back",
))
register(Op(
    name="rms_norm_rope", family="layers", oracle=f"{_REF}:rms_norm_rope",
    lanes={"triton": f"{_LAYERS}:rms_norm_rope_triton", "reference": f"{_LAYERS}:rms_norm_rope_reference"},
    samples=_rms_norm_rope_samples, outputs=(("q", NORM), ("k", NORM)),
    doc="QK-norm: per-head RMSNorm then RoPE of q and k",
))
register(Op(
    name="rms_norm_rope.backward", family="layers", oracle=f"{_REF}:rms_norm_rope_backward",
    lanes={"triton": f"{_LAYERS}:rms_norm_rope_backward_triton",
           "reference": f"{_LAYERS}:rms_norm_rope_backward_reference"},
    samples=lambda device: _with_douts(_rms_norm_rope_samples(device)),
    outputs=(("dq", LAYERS_BWD), ("dk", LAYERS_BWD), ("dq_weight", LAYERS_BWD),
             ("dk_weight", LAYERS_BWD)),
    doc="Gradients of rms_norm_rope: dq, dk, dq_weight, dk_weight",
))
register(Op(
    name="qk_norm_rope_quant", family="layers", oracle=f"{_REF}:qk_norm_rope_quant",
    lanes={"triton": f"{_LAYERS}:qk_norm_rope_quant_triton",
           "reference": f"{_LAYERS}:qk_norm_rope_quant_reference"},
    samples=_qk_quant_samples,
    outputs=(("q_codes", CODES), ("q_scale", NORM), ("k_codes", CODES), ("k_scale", NORM)),
    doc="QK-norm, RoPE on the tail dims, per-(token, head) fp8 e4m3 / int8 codes (bit-exact) and scales",
))
for _name, _act in (("swiglu", "silu"), ("geglu", "gelu")):
    register(Op(
        name=_name, family="layers", oracle=f"{_REF}:glu",
        lanes={"triton": f"{_LAYERS}:glu_triton", "reference": f"{_LAYERS}:glu_reference"},
        samples=_glu_samples(_act), outputs=(("out", ELTWISE),), doc=f"{_act}(gate) * up, separate or from one fused (..., 2N) tensor",
    ))
    register(Op(
        name=f"{_name}.backward", family="layers", oracle=f"{_REF}:glu_backward",
        lanes={"triton": f"{_LAYERS}:glu_backward_triton", "reference": f"{_LAYERS}:glu_backward_reference"},
        samples=lambda device, _a=_act: _with_douts(_glu_samples(_a)(device)),
        outputs=(("dgate", ELTWISE), ("dup", ELTWISE)),
        doc=f"Gradients of {_name}: d(gate), d(up) (one fused gradient for a fused input)",
    ))
