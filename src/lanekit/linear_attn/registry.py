"""Linear attention's registry entries: sample builders, tolerances, and the ``register`` calls of
chunk_linear_attn, fused_recurrent_linear_attn, chunk_simple_gla and fused_recurrent_simple_gla,
forward and backward.

Each sample is in the lanes' normalized form (the keyword arguments of ``lanekit.linear_attn.op``'s
lane functions); its values come from a generator seeded by its name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lanekit.runtime.registry import Op, Sample, register
from lanekit.testing import Tolerance, generator, randn

LINEAR_ATTN_FWD = Tolerance(
    name="linear_attn_fwd",
    ulps=2.0,
    fp32_ulps=64.0,
    reason=(
        "o_t sums two tensor-core products whose operands are rounded to the input format: the "
        "carried state (fp32) as it enters q h, and the chunk's masked, decayed scores before they "
        "multiply v (FlashAttention rounds its probabilities the same way), each adding up to "
        "half a step of the input format at the output's magnitude; measured up to 1.1 steps "
        "(bf16, varlen). fp32: IEEE products, fp32 sums over the chunk and the state."
    ),
)

LINEAR_ATTN_STATE = Tolerance(
    name="linear_attn_state",
    ulps=1.0,
    fp32_ulps=65536.0,
    reason=(
        "fp32 results (the final state, the key sum z, dg, and the gradient of an fp32 initial "
        "state) of products of 16-bit inputs: with decay the kernels round the decayed keys "
        "(queries, in the backward) and the chunk states to the input format before the tensor "
        "cores multiply them, as fla does, so these carry the input format's relative rounding "
        "(bf16: 2^-8 = 65536 fp32 steps); measured up to 0.9 bf16 steps. Without decay and for "
        "fp32 inputs the error is a few fp32 steps, far inside it; a wrong element (an O(1) "
        "relative error, 2^23 steps) still fails."
    ),
)

LINEAR_ATTN_DG = Tolerance(
    name="linear_attn_dg",
    ulps=2.0,
    fp32_ulps=131072.0,
    reason=(
        "dg_t sums, from the chunk's end, q_u . dq_u - k_u . dk_u (and at the chunk's last token "
        "<dh, h> of the state leaving it): products of gradients with the input format's rounding "
        "(LINEAR_ATTN_BWD) whose difference is smaller than either; measured up to 0.30 bf16 "
        "steps on the samples (an fp32 dg of bf16 inputs: 19495 fp32 steps). Two steps of the "
        "input format, in fp32 steps for an fp32 dg of 16-bit inputs (2^17). fla's dg is "
        "computed the same way, chunk by chunk (summing those terms over the whole sequence "
        "instead measured 1.09 bf16 steps here and 8 at 16k tokens on the H200)."
    ),
)

LINEAR_ATTN_BWD = Tolerance(
    name="linear_attn_bwd",
    ulps=2.0,
    fp32_ulps=65536.0,
    reason=(
        "each gradient sums tensor-core products over the chunk and the V (or K) blocks whose "
        "operands are rounded to the input format (the recomputed chunk states, the state "
        "gradients, the masked scores and their gradients), as fla's backward does; measured up "
        "to 0.9 steps (bf16). fp32 outputs from 16-bit inputs (dg, an fp32 initial state's "
        "gradient) carry the input format's rounding, as LINEAR_ATTN_STATE says."
    ),
)


def linear_attn_case(name, device, *, B=2, T=40, H=2, K=32, V=48, dtype=torch.bfloat16, decay=True,
                     g_dtype=torch.float32, h0=True, final=True, normalize=None, cu=None, scale=None,
                     strided=False, grads=False) -> Sample:
    """A sample in the lanes' normalized form. ``decay``: with g (simple GLA; None for linear
    attention: no g key at all); ``normalize``: linear attention's flag (None: simple GLA);
    ``cu``: the lengths of the packed sequences (B = 1, T their sum); ``strided``: q, k, v as
    views of (B, H, T, D) tensors; ``grads``: also do and (with ``final``) dht (and dzt)."""
    gen = generator(name)
    if cu is not None:
        B, T = 1, sum(cu)
    N = len(cu) if cu is not None else B

    def draw(*shape):
        if strided:  # (B, T, H, D) views of (B, H, T, D) buffers
            return randn(shape[0], shape[2], shape[1], shape[3], dtype=dtype, device=device,
                         generator=gen).transpose(1, 2)
        return randn(*shape, dtype=dtype, device=device, generator=gen)

    q, k, v = draw(B, T, H, K), draw(B, T, H, K), draw(B, T, H, V)
    if normalize:  # positive features, as after a feature map (elu + 1): positive denominators
        q, k = (F.elu(t.float()).add(1).to(dtype) for t in (q, k))
    kw = dict(q=q, k=k, v=v)
    if normalize is None:
        g = F.logsigmoid(torch.randn(B, T, H, generator=gen)).to(dtype=g_dtype, device=device) if decay else None
        kw["g"] = g
    kw["scale"] = float(K ** -0.5 if scale is None else scale)
    kw["initial_state"] = randn(N, H, K, V, dtype=torch.float32, device=device, generator=gen, scale=0.5) if h0 else None
    if normalize is not None:
        kw["initial_z"] = (torch.rand(N, 1, H, K, generator=gen).to(device) * 2) if (normalize and h0) else None
        kw["normalize"] = normalize
    kw["output_final_state"] = final
    kw["cu_seqlens"] = (torch.tensor([0, *torch.tensor(cu).cumsum(0).tolist()], dtype=torch.int32, device=device)
                        if cu is not None else None)
    if grads:
        kw["do"] = randn(B, T, H, V, dtype=dtype, device=device, generator=gen)
        kw["dht"] = randn(N, H, K, V, dtype=torch.float32, device=device, generator=gen) if final else None
        if normalize is not None:
            kw["dzt"] = randn(N, 1, H, K, dtype=torch.float32, device=device, generator=gen) if normalize and final else None
    return Sample(name, kw)


def _simple_gla_samples(grads=False, short=False):
    """Odd lengths (1, 37, 40: not chunk multiples), K != V and odd head dims, every dtype, with
    and without initial and final states, varlen with a zero-length sequence, strided views."""
    f16, f32 = torch.float16, torch.float32

    def samples(device):
        def case(name, **kw):
            return linear_attn_case(name, device, grads=grads, **kw)

        yield case("B2 T40 H2 K32 V48 bf16 h0 final")
        yield case("varlen 17,0,23 bf16 h0 final", cu=[17, 0, 23])
        yield case("B1 T1 H3 K16 V16 fp16 bf16 g", B=1, T=1, H=3, K=16, V=16, dtype=f16, g_dtype=torch.bfloat16)
        if short:
            return
        yield case("B2 T37 K24 V40 fp32 scale 0.3 no h0", K=24, V=40, dtype=f32, h0=False, scale=0.3)
        yield case("B2 T17 bf16 no final state", T=17, final=False)
        yield case("B1 T33 strided views fp16", B=1, T=33, dtype=f16, strided=True)

    return samples


def _linear_attn_samples(grads=False, short=False):
    """As simple GLA's, without decay, with and without normalize (and its key sum z)."""
    f16, f32 = torch.float16, torch.float32

    def samples(device):
        def case(name, normalize=False, **kw):
            return linear_attn_case(name, device, grads=grads, normalize=normalize, **kw)

        yield case("B2 T40 H2 K32 V48 bf16 h0 final")
        yield case("normalize B2 T40 bf16 h0 z0 final", normalize=True)
        yield case("B1 T1 H3 K16 V16 fp16", B=1, T=1, H=3, K=16, V=16, dtype=f16)
        if short:
            return
        yield case("normalize varlen 17,0,23 fp16 final", normalize=True, cu=[17, 0, 23], dtype=f16, h0=False)
        yield case("B2 T37 K24 V40 fp32 no h0", K=24, V=40, dtype=f32, h0=False)
        yield case("varlen 17,0,23 bf16 h0 final", cu=[17, 0, 23])
        yield case("B2 T17 normalize bf16 no final state", T=17, normalize=True, final=False)

    return samples


_DOCS = {
    "chunk_simple_gla": "fla's chunk_simple_gla: S_t = exp(g_t) S_{t-1} + k_t^T v_t, o_t = scale q_t S_t, "
                        "chunked (state pass, then chunks in parallel)",
    "fused_recurrent_simple_gla": "fla's fused_recurrent_simple_gla: the same recurrence step by step (decode)",
    "chunk_linear_attn": "fla's chunk_linear_attn: S_t = S_{t-1} + k_t^T v_t, o_t = scale q_t S_t "
                         "(normalize: / scale q_t . z_t), chunked",
    "fused_recurrent_linear_attn": "fla's fused_recurrent_linear_attn: the same recurrence step by step (decode)",
}

for _name in ("chunk_simple_gla", "fused_recurrent_simple_gla", "chunk_linear_attn", "fused_recurrent_linear_attn"):
    _gla = _name.endswith("simple_gla")
    _samples = _simple_gla_samples if _gla else _linear_attn_samples
    # the recurrent ops step through every token (slow interpreted) and their backward is the
    # chunked one: fewer samples
    _short = _name.startswith("fused")
    register(Op(
        name=_name,
        family="linear_attn",
        oracle=f"lanekit.reference.linear_attn:{_name}",
        lanes={"triton": f"lanekit.linear_attn.op:{_name}_triton",
               "reference": f"lanekit.linear_attn.op:{_name}_reference"},
        samples=_samples(short=_short),
        outputs=(("o", LINEAR_ATTN_FWD), ("final_state", LINEAR_ATTN_STATE))
        + (() if _gla else (("final_z", LINEAR_ATTN_STATE),)),
        doc=_DOCS[_name],
    ))
    _grads = ("dq", "dk", "dv", "dg", "dinitial_state") if _gla else ("dq", "dk", "dv", "dinitial_state", "dinitial_z")
    register(Op(
        name=f"{_name}.backward",
        family="linear_attn",
        oracle=f"lanekit.reference.linear_attn:{_name}_backward",
        lanes={"triton": f"lanekit.linear_attn.op:{_name}_backward_triton",
               "reference": f"lanekit.linear_attn.op:{_name}_backward_reference"},
        samples=_samples(grads=True, short=_short),
        outputs=tuple((n, LINEAR_ATTN_DG if n == "dg" else LINEAR_ATTN_STATE if n.startswith("dinitial") else LINEAR_ATTN_BWD)
                      for n in _grads),
        doc=f"Gradients of {_name} by autograd: q, k, v, " + ("g, " if _gla else "")
            + "the initial state" + ("" if _gla else " and z") + " (empty where absent)",
    ))
