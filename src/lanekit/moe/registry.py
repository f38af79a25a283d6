"""The mixture-of-experts family's registry entries: sample builders, tolerances, and the
``register`` calls of its ops.

Each sample is in the lanes' normalized form (the keyword arguments of ``lanekit.moe.op``'s lane
functions); its values come from a generator seeded by its name. Routing samples keep their
scores apart (no two within a few fp32 steps unless exactly equal), so that the float64 oracle
and the fp32 kernels choose the same experts.
"""

from __future__ import annotations

import torch

from lanekit.runtime.registry import Op, Sample, register
from lanekit.testing import CODES, EXACT, Tolerance, generator, randn
from lanekit.testing import noncontiguous

# ---- routing: topk_softmax, grouped_topk ----


# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----


# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----

# -- fused_moe --

FUSED_MOE = Tolerance(
    name="fused_moe",
    ulps=2.0,
    reason=(
        "the kernels round the expert MLP's intermediate act(gate) * up to the activation dtype "
        "between the two GEMMs (as vLLM does), the oracle does not: measured up to 1.05 steps "
        "over 144 bf16/fp16 silu/gelu cases (K 200, N 72; top-2 to top-8), where the same "
        "computation by PyTorch in the activation dtype errs by up to 3.2 steps; two steps, "
        "within FlashAttention's rule (no more than twice PyTorch's error)"
    ),
)


def fused_moe_case(name, device, *, M, K, N, E, topk, dtype=torch.bfloat16, activation="silu",
                   on_input=False, remote_half=False, idle_expert=None, equal_weights=False,
                   weights_dtype=torch.float32, transposed_weights=False, strided_x=False) -> Sample:
    """A ``fused_moe`` sample from readable parameters. Routing is the top-k of a softmax over
    random logits (E_global = 2E with ``remote_half``: the odd global experts live elsewhere);
    ``idle_expert`` gets no token; ``equal_weights`` gives every slot 1 / topk;
    ``transposed_weights`` passes w1 and w2 as transposed views (strides other than packed),
    ``strided_x`` x as every other row of a buffer."""
    g = generator(name)
    x = randn(M, K, dtype=dtype, device=device, generator=g)
    if strided_x:
        x = noncontiguous(x)
    w1 = randn(E, 2 * N, K, dtype=dtype, device=device, generator=g, scale=K ** -0.5)
    w2 = randn(E, K, N, dtype=dtype, device=device, generator=g, scale=N ** -0.5)
    if transposed_weights:
        w1 = w1.transpose(1, 2).contiguous().transpose(1, 2)
        w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    num_global = 2 * E if remote_half else E
    logits = randn(M, num_global, dtype=torch.float32, device="cpu", generator=g, scale=3.0)
    if idle_expert is not None:
        logits[:, idle_expert] = -float("inf")
    scores, ids = torch.sort(torch.softmax(logits, -1), dim=-1, descending=True, stable=True)
    weights, ids = scores[:, :topk], ids[:, :topk].to(torch.int32)
    if equal_weights:
        weights = torch.full_like(weights, 1.0 / topk)
    expert_map = None
    if remote_half:
        local = torch.full((num_global,), -1, dtype=torch.int32)
        local[0::2] = torch.arange(E, dtype=torch.int32)
        expert_map = local.to(device)
    return Sample(name, dict(hidden_states=x, w1=w1, w2=w2, topk_weights=weights.to(weights_dtype).to(device),
                             topk_ids=ids.to(device), activation=activation,
                             apply_router_weight_on_input=on_input, expert_map=expert_map))


def _fused_moe_samples(device):
    yield fused_moe_case("M 1 (decode), E 8 top-2", device, M=1, K=64, N=32, E=8, topk=2)
    yield fused_moe_case("M 3, E 64 top-8", device, M=3, K=64, N=32, E=64, topk=8)
    yield fused_moe_case("K 200, N 72, M 17, E 8 top-2", device, M=17, K=200, N=72, E=8, topk=2)
    yield fused_moe_case("E 1 top-1, M 5", device, M=5, K=48, N=40, E=1, topk=1)
    yield fused_moe_case("expert 2 of 4 gets no token, M 9 top-2", device, M=9, K=64, N=32, E=4,
                         topk=2, idle_expert=2)
    yield fused_moe_case("equal top-k weights, M 6 top-4", device, M=6, K=64, N=32, E=8, topk=4,
                         equal_weights=True)
    yield fused_moe_case("expert_map: half the experts remote, M 11 top-3", device, M=11, K=64, N=32,
                         E=4, topk=3, remote_half=True)
    yield fused_moe_case("router weight on the input, top-1, M 7", device, M=7, K=64, N=48, E=4,
                         topk=1, on_input=True)
    yield fused_moe_case("gelu, M 13 top-2", device, M=13, K=80, N=40, E=4, topk=2, activation="gelu")
    yield fused_moe_case("fp16, routing weights in fp16, M 10 top-2", device, M=10, K=96, N=64,
                         E=4, topk=2, dtype=torch.float16, weights_dtype=torch.float16)
    yield fused_moe_case("transposed w1 and w2 views, strided x, M 8 top-2", device, M=8, K=64, N=32,
                         E=4, topk=2, transposed_weights=True, strided_x=True)
    yield fused_moe_case("M 300 (the prefill tiles), K 144, N 48, E 4 top-2", device, M=300, K=144, N=48,
                         E=4, topk=2)
    yield fused_moe_case("M 300, K 136, N 40 (unaligned: the smaller tiles)", device, M=300, K=136,
                         N=40, E=4, topk=2)
    yield fused_moe_case("M 0", device, M=0, K=64, N=32, E=4, topk=2)


register(Op(
    name="fused_moe", family="moe", oracle="lanekit.reference.moe:fused_moe",
    lanes={"triton": "lanekit.moe.op:fused_moe_triton", "reference": "lanekit.moe.op:fused_moe_reference"},
    samples=_fused_moe_samples, outputs=(("out", FUSED_MOE),),
    doc="vLLM's fused_experts: act(x w1_gate) * (x w1_up) w2 per routed expert, weighted sum per token",
))


# -- fused_moe, quantized experts (fp8 W8A8, int8 W8A16) --

FUSED_MOE_QUANT = Tolerance(
    name="fused_moe_quant",
    ulps=2.0,
    reason=(
        "against the oracle of the same quantization (fused_moe_quantized: the same e4m3/int8 "
        "codes of x, the weights and the bf16-rounded intermediate, dequantized exactly): the "
        "kernels differ only by their fp32 accumulation, which can move the intermediate's bf16 "
        "rounding, and with it an e4m3 code, in rare cases. Measured 0.50 steps (the output's own "
        "rounding; the reference lane too) on every "
        "registered sample interpreted (all four schemes, K 200 N 72, top-8, remote experts, "
        "static scales, M 300); two steps as fused_moe's, for the GPU's other summation order"
    ),
)

_QUANT_SCHEMES = {
    # scheme: (fused_moe keywords)
    "fp8 per tensor": dict(use_fp8_w8a8=True),
    "fp8 per token x channel": dict(use_fp8_w8a8=True, per_channel_quant=True),
    "fp8 128x128 blocks": dict(use_fp8_w8a8=True, block_shape=[128, 128]),
    "int8 W8A16": dict(use_int8_w8a16=True),
}


def quantize_weight(w: torch.Tensor, scheme: str):
    """Codes and scales of expert weights w (E, rows, cols) for a scheme of _QUANT_SCHEMES (as a
    checkpoint stores them: scale = amax / qmax per expert, output channel or 128 x 128 block)."""
    from lanekit.reference.numerics import QUANT_MAX, to_codes

    E, R, C = w.shape
    dtype = torch.int8 if scheme == "int8 W8A16" else torch.float8_e4m3fn
    wf = w.float()
    if scheme == "fp8 128x128 blocks":
        rb, cb = -(-R // 128), -(-C // 128)
        p = torch.nn.functional.pad(wf, (0, cb * 128 - C, 0, rb * 128 - R)).view(E, rb, 128, cb, 128)
        scale = p.abs().amax((2, 4)) / QUANT_MAX[dtype]
        codes = to_codes(p / scale[:, :, None, :, None], dtype).view(E, rb * 128, cb * 128)[:, :R, :C]
        return codes.contiguous(), scale
    if scheme == "fp8 per tensor":
        scale = wf.abs().amax((1, 2)) / QUANT_MAX[dtype]
        return to_codes(wf / scale[:, None, None], dtype), scale
    scale = wf.abs().amax(2, keepdim=True) / QUANT_MAX[dtype]
    return to_codes(wf / scale, dtype), scale


def fused_moe_quant_case(name, device, *, scheme, static_scales=False, **case) -> Sample:
    """A quantized ``fused_moe`` sample: :func:`fused_moe_case`'s (bf16 unless told), its weights
    quantized per ``scheme`` (a key of _QUANT_SCHEMES); ``static_scales`` (per tensor): a1_scale
    and a2_scale given (x's amax / 448, and 0.01: some intermediate values saturate)."""
    kw = dict(fused_moe_case(name, device, **case).kwargs)
    w1, s1 = quantize_weight(kw["w1"], scheme)
    w2, s2 = quantize_weight(kw["w2"], scheme)
    kw.update(w1=w1, w2=w2, w1_scale=s1, w2_scale=s2, use_fp8_w8a8=False, use_int8_w8a16=False,
              per_channel_quant=False, block_shape=None, a1_scale=None, a2_scale=None,
              intermediate_dtype=kw["hidden_states"].dtype)
    kw.update(_QUANT_SCHEMES[scheme])
    if static_scales:
        x = kw["hidden_states"].float()
        kw["a1_scale"] = (x.abs().amax() / 448).reshape(1)
        kw["a2_scale"] = torch.full((1,), 0.01, dtype=torch.float32, device=device)
    return Sample(name, kw)


def _fused_moe_quant_samples(device):
    for scheme in _QUANT_SCHEMES:
        yield fused_moe_quant_case(f"{scheme}: M 1 (decode), E 8 top-2", device, scheme=scheme, M=1,
                                   K=64, N=32, E=8, topk=2)
        yield fused_moe_quant_case(f"{scheme}: M 3, E 64 top-8", device, scheme=scheme, M=3, K=64,
                                   N=32, E=64, topk=8)
        yield fused_moe_quant_case(f"{scheme}: K 200, N 72, M 17 top-2", device, scheme=scheme, M=17,
                                   K=200, N=72, E=8, topk=2)
        yield fused_moe_quant_case(f"{scheme}: K 272, N 160 (partial 128 blocks), M 6", device,
                                   scheme=scheme, M=6, K=272, N=160, E=2, topk=2)
        yield fused_moe_quant_case(f"{scheme}: expert 2 of 4 gets no token, M 9", device, scheme=scheme,
                                   M=9, K=64, N=32, E=4, topk=2, idle_expert=2)
        yield fused_moe_quant_case(f"{scheme}: expert_map, half remote, M 11 top-3", device,
                                   scheme=scheme, M=11, K=64, N=32, E=4, topk=3, remote_half=True)
        yield fused_moe_quant_case(f"{scheme}: E 1 top-1, M 5", device, scheme=scheme, M=5, K=48,
                                   N=40, E=1, topk=1)
    yield fused_moe_quant_case("fp8 per tensor: static a1/a2 scales, M 8", device,
                               scheme="fp8 per tensor", static_scales=True, M=8, K=64, N=32, E=4, topk=2)
    yield fused_moe_quant_case("fp8 128x128 blocks: router weight on the input, gelu, M 7", device,
                               scheme="fp8 128x128 blocks", M=7, K=64, N=48, E=4, topk=1, on_input=True,
                               activation="gelu")
    yield fused_moe_quant_case("fp8 128x128 blocks: fp16, M 10", device, scheme="fp8 128x128 blocks",
                               M=10, K=96, N=64, E=4, topk=2, dtype=torch.float16)
    yield fused_moe_quant_case("int8 W8A16: fp16, M 10", device, scheme="int8 W8A16", M=10, K=96,
                               N=64, E=4, topk=2, dtype=torch.float16)
    yield fused_moe_quant_case("fp8 128x128 blocks: M 300 (the prefill tiles), K 256, N 128", device,
                               scheme="fp8 128x128 blocks", M=300, K=256, N=128, E=4, topk=2)
    yield fused_moe_quant_case("fp8 per tensor: M 0", device, scheme="fp8 per tensor", M=0, K=64,
                               N=32, E=4, topk=2)
    yield fused_moe_quant_case("fp8 128x128 blocks: M 0", device, scheme="fp8 128x128 blocks", M=0,
                               K=64, N=32, E=4, topk=2)


register(Op(
    name="fused_moe_quant", family="moe", oracle="lanekit.reference.moe:fused_moe",
    lanes={"triton": "lanekit.moe.op:fused_moe_quant_triton",
           "reference": "lanekit.moe.op:fused_moe_quant_reference"},
    samples=_fused_moe_quant_samples, outputs=(("out", FUSED_MOE_QUANT),),
    doc="fused_moe with quantized experts: fp8 e4m3 W8A8 (per tensor, per token x channel, 128x128 "
        "blocks; activations quantized on the fly) and int8 W8A16 (per-channel)",
))
