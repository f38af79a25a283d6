"""Public mixture-of-experts functions: validated, dispatched to a lane.

Shapes: M tokens, K hidden size, N an expert's intermediate size, E experts, topk experts per
token. Routing is the pair ``topk_weights`` fp32 (M, topk) and ``topk_ids`` int32 (M, topk), as
vLLM's ``fused_moe`` takes it. Index values that live on the device (expert ids, group offsets)
are not read back on every call: the kernels mask what is out of range and record it in the
device's error flag (``lanekit.check_errors()``; ``LANEKIT_CHECK_INDICES=1`` checks them on the
host before each launch instead: ``lanekit.runtime.errors``).
"""

from __future__ import annotations

import torch

from lanekit.moe import op as _lanes
from lanekit.runtime.errors import check_indices_eagerly as _check_indices_eagerly
from lanekit.runtime.validate import lane_for as _lane
from lanekit.runtime.validate import shape as _shape
from lanekit.runtime.validate import tensor as _tensor

__all__: list[str] = []

# ---- routing: topk_softmax, grouped_topk ----


# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----


# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----

# -- fused_moe --

__all__ += ["fused_moe"]

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float64)   # float64: the reference lane only


def _check_fused_moe_indices(topk_ids, expert_map, num_global, num_local):
    """LANEKIT_CHECK_INDICES=1: the device-resident ids checked on the host (a sync)."""
    if topk_ids.numel():
        low, high = int(topk_ids.min()), int(topk_ids.max())
        if low < 0 or high >= num_global:
            raise ValueError(f"topk_ids: expected ids in [0, {num_global}) (the experts), got [{low}, {high}]")
    if expert_map is not None and expert_map.numel():
        low, high = int(expert_map.min()), int(expert_map.max())
        if low < -1 or high >= num_local:
            raise ValueError(f"expert_map: expected local ids in [-1, {num_local}) (w1's experts; -1: not "
                             f"on this rank), got [{low}, {high}]")


def _fused_moe_quant_flags(use_fp8_w8a8, use_int8_w8a16, per_channel_quant, block_shape) -> bool:
    """Whether the experts are quantized; the flags' types and combinations checked."""
    for name, flag in (("use_fp8_w8a8", use_fp8_w8a8), ("use_int8_w8a16", use_int8_w8a16),
                       ("per_channel_quant", per_channel_quant)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    if use_fp8_w8a8 and use_int8_w8a16:
        raise ValueError("use_int8_w8a16: expected one quantization scheme, got use_fp8_w8a8 and use_int8_w8a16")
    if block_shape is not None:
        if not use_fp8_w8a8:
            raise ValueError(f"block_shape: expected None without use_fp8_w8a8, got {block_shape!r}")
        if per_channel_quant:
            raise ValueError(f"block_shape: expected None with per_channel_quant, got {block_shape!r}")
        if not isinstance(block_shape, (list, tuple)) or [b for b in block_shape] != [128, 128]:
            raise ValueError(f"block_shape: expected [128, 128] (DeepSeek-V3's blocks), got {block_shape!r}")
    return use_fp8_w8a8 or use_int8_w8a16


def _check_fused_moe_scales(x, E, N, K, use_fp8_w8a8, per_channel_quant, block_shape, w1_scale,
                            w2_scale, a1_scale, a2_scale):
    """The scales' presence, dtypes, devices and shapes for the scheme (metadata only)."""
    def cdiv(a, b):
        return -(-a // b)

    if block_shape is not None:
        shapes = ((E, cdiv(2 * N, 128), cdiv(K, 128)), (E, cdiv(K, 128), cdiv(N, 128)))
        what = ("(E, ceil(2N/128), ceil(K/128)): per 128 x 128 block", "(E, ceil(K/128), ceil(N/128)): per 128 x 128 block")
    elif per_channel_quant or not use_fp8_w8a8:
        shapes = ((E, 2 * N, 1), (E, K, 1))
        what = ("(E, 2N, 1): per output channel", "(E, K, 1): per output channel")
    else:
        shapes = None
    for i, (name, s) in enumerate((("w1_scale", w1_scale), ("w2_scale", w2_scale))):
        if s is None:
            raise ValueError(f"{name}: expected the weights' scales with quantized experts, got None")
        _tensor(name, s, dtypes=(torch.float32,), like=x, like_name="hidden_states")
        if shapes is None:
            if tuple(s.shape) not in ((E,), (1,)):
                raise ValueError(f"{name}: expected shape ({E},) or (1,) (per tensor), got {tuple(s.shape)}")
        else:
            _shape(name, s, shapes[i], what[i])
    for name, s in (("a1_scale", a1_scale), ("a2_scale", a2_scale)):
        if s is None:
            continue
        if block_shape is not None or per_channel_quant or not use_fp8_w8a8:
            raise ValueError(f"{name}: expected None (the activations' scales are dynamic in this "
                             f"scheme; static only per tensor with use_fp8_w8a8), got a tensor")
        _tensor(name, s, dtypes=(torch.float32,), like=x, like_name="hidden_states")
        _shape(name, s, (1,), "a static per-tensor scale")


def fused_moe(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
              apply_router_weight_on_input: bool = False, expert_map: torch.Tensor | None = None,
              *, use_fp8_w8a8: bool = False, use_int8_w8a16: bool = False,
              per_channel_quant: bool = False, block_shape: list[int] | None = None,
              w1_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              a1_scale: torch.Tensor | None = None, a2_scale: torch.Tensor | None = None,
              lane: str | None = None) -> torch.Tensor:
    """The fused expert MLP of a mixture-of-experts layer (vLLM's ``fused_experts``), unquantized
    or with quantized experts (the keywords ``use_fp8_w8a8`` ... ``a2_scale``, below).

    For each token t and slot s, with e = topk_ids[t, s] (through ``expert_map`` when given):
    ``out[t] += topk_weights[t, s] * w2[e] @ (act(w1[e, :N] @ x[t]) * (w1[e, N:] @ x[t]))``.
    Tokens are aligned by expert in blocks (vLLM's ``moe_align_block_size``); the first GEMM
    gathers each block's rows of x in its loads and applies act(gate) * up in its epilogue; its
    result, the (rows, N) intermediate, is rounded to x's dtype before the second GEMM (as vLLM
    does); the second GEMM's rows are kept in fp32 and each token's top-k rows summed in slot
    order in fp32, rounded once: the result is deterministic (no atomics).

    Arguments:
        hidden_states: (M, K) x, bf16 or fp16 (fp64 on the reference lane); any strides.
        w1: (E, 2N, K), x's dtype: each expert's gate rows (N), then its up rows (N).
        w2: (E, K, N), x's dtype: each expert's down projection.
        topk_weights: (M, topk), fp32 or x's dtype: the router's weights of each token's experts.
        topk_ids: (M, topk) int32: each token's experts, global ids in [0, E_global); 1 <= topk
            <= E_global.
        activation: "silu" (SwiGLU) or "gelu" (GeGLU, the exact erf GELU).
        apply_router_weight_on_input: scale x by the weight before the first GEMM instead of the
            expert's output (Llama 4's form; vLLM allows it with topk = 1 only, and so do we).
        expert_map: (E_global,) int32 or None: expert parallelism. Maps a global expert id to its
            row of w1/w2 on this rank, -1 for an expert on another rank, whose slots contribute
            zero. w1 and w2 then hold the E local experts and topk_ids global ids, E_global =
            len(expert_map) (vLLM's ``global_num_experts``); without it E_global = E.
        use_fp8_w8a8: w1 and w2 are torch.float8_e4m3fn codes, and x and the intermediate are
            quantized to e4m3 on the fly (W8A8). Three schemes, as vLLM's:
            per tensor (default): w1_scale and w2_scale (E,) or (1,); x's scale a1_scale (1,) and
            the intermediate's a2_scale (1,), static, or None: dynamic, amax / 448 of the whole
            tensor;
            ``per_channel_quant``: per token (x's rows, the intermediate's slots: dynamic) times
            per output channel, w1_scale (E, 2N, 1), w2_scale (E, K, 1);
            ``block_shape`` [128, 128] (DeepSeek-V3's): w1_scale (E, ceil(2N/128), ceil(K/128)),
            w2_scale (E, ceil(K/128), ceil(N/128)), activations per token and group of 128
            columns (vLLM's ``per_token_group_quant_fp8``, dynamic).
            A dynamic scale is amax / 448 in fp32 (not a power of two; 1 for an all-zero group),
            codes x / scale rounded half to even and saturated at +-448; the GEMMs multiply the
            codes in fp8 and accumulate in fp32, scaled per block in the K loop or in the epilogue.
            act(gate) * up is rounded to x's dtype, then quantized for the second GEMM.
        use_int8_w8a16: w1 and w2 are torch.int8 codes with per-output-channel scales w1_scale
            (E, 2N, 1) and w2_scale (E, K, 1); x stays in its dtype (weights widened in the loads).
        per_channel_quant, block_shape, w1_scale, w2_scale, a1_scale, a2_scale: see above; all
            scales fp32 on x's device. Quantized experts are inference only: inputs that require
            grad are refused. The oracle is ``lanekit.reference.moe.fused_moe_quantized``.
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.
            fp8 W8A8 on the Triton lane needs e4m3 (sm89+ or AMD); on sm80 it does not compile.

    Returns:
        (M, K) in x's dtype. Not differentiable yet on the Triton lane (the backward is its own op).

    Ids that live on the device are not read back: a topk_ids entry outside [0, E_global), or an
    expert_map entry outside [-1, E), makes that slot count zero (nothing is read for it) and is
    reported by ``lanekit.check_errors()``; ``LANEKIT_CHECK_INDICES=1`` raises a ValueError here
    instead, before the launch.

    Raises:
        TypeError: a non-tensor; x not bf16/fp16, w1 or w2 not of x's dtype (quantized: not e4m3
            or int8 codes), topk_weights not fp32 or x's dtype, topk_ids or expert_map not int32, a
            scale not fp32; a quantization flag not a bool.
        ValueError (quantized experts): both schemes at once; a weight scale missing, or of the
            wrong shape for the scheme; block_shape other than [128, 128], or with W8A16 or
            per_channel_quant; a1/a2_scale given with a dynamic-only scheme or not (1,); inputs
            that require grad.
        ValueError: wrong ranks; w1 and w2 of different E; 2N odd; K of w1 or w2 not x's; N of
            w2 not half of w1's 2N; topk_weights not topk_ids' shape, or M not x's; topk < 1 or
            topk > E_global; expert_map not 1-d or shorter than E; apply_router_weight_on_input
            with topk > 1; an unknown activation; tensors on different devices; an unknown lane.

    Source: vLLM's ``fused_experts`` (``vllm.model_executor.layers.fused_moe``) and its
    ``silu_and_mul`` / ``gelu_and_mul``; the oracle is ``lanekit.reference.moe.fused_moe``.
    """
    _tensor("hidden_states", hidden_states, dtypes=_FUSED_DTYPES, ndim=2)
    M, K = hidden_states.shape
    quantized = _fused_moe_quant_flags(use_fp8_w8a8, use_int8_w8a16, per_channel_quant, block_shape)
    for name, w in (("w1", w1), ("w2", w2)):
        _tensor(name, w, ndim=3, like=hidden_states, like_name="hidden_states")
        if quantized:
            _tensor(name, w, dtypes=(torch.float8_e4m3fn,) if use_fp8_w8a8 else (torch.int8,))
        else:
            _tensor(name, w, like=hidden_states, like_name="hidden_states", like_dtype=True)
    E, two_n, _ = w1.shape
    if w2.shape[0] != E:
        raise ValueError(f"w2: expected E = {E} experts (w1's), got shape {tuple(w2.shape)}")
    if two_n % 2:
        raise ValueError(f"w1: expected (E, 2N, K) with an even 2N (gate rows, then up rows), got shape {tuple(w1.shape)}")
    N = two_n // 2
    if w1.shape[2] != K:
        raise ValueError(f"w1: expected (E, 2N, K) with K = {K} (hidden_states'), got shape {tuple(w1.shape)}")
    _shape("w2", w2, (E, K, N), "(E, K, N): E and N of w1, K of hidden_states")
    _tensor("topk_ids", topk_ids, dtypes=(torch.int32,), ndim=2, like=hidden_states, like_name="hidden_states")
    topk = topk_ids.shape[1]
    if topk_ids.shape[0] != M:
        raise ValueError(f"topk_ids: expected (M, topk) with M = {M} (hidden_states' rows), got shape {tuple(topk_ids.shape)}")
    _tensor("topk_weights", topk_weights, dtypes=tuple(dict.fromkeys((torch.float32, hidden_states.dtype))),
            like=hidden_states, like_name="hidden_states")
    _shape("topk_weights", topk_weights, tuple(topk_ids.shape), "topk_ids' shape (M, topk)")
    num_global = E
    if expert_map is not None:
        _tensor("expert_map", expert_map, dtypes=(torch.int32,), ndim=1, like=hidden_states, like_name="hidden_states")
        num_global = expert_map.shape[0]
        if num_global < E:
            raise ValueError(f"expert_map: expected (E_global,) with E_global >= E = {E} (w1's local experts), "
                             f"got shape {tuple(expert_map.shape)}")
    if not 1 <= topk <= num_global:
        raise ValueError(f"topk_ids: expected 1 <= topk <= {num_global} (the experts), got topk = {topk}")
    if activation not in ("silu", "gelu"):
        raise ValueError(f"activation: expected 'silu' or 'gelu', got {activation!r}")
    if not isinstance(apply_router_weight_on_input, bool):
        raise TypeError(f"apply_router_weight_on_input: expected a bool, got {type(apply_router_weight_on_input).__name__}")
    if apply_router_weight_on_input and topk != 1:
        raise ValueError(f"apply_router_weight_on_input: expected topk = 1 (as vLLM), got topk = {topk}")
    if quantized:
        _check_fused_moe_scales(hidden_states, E, N, K, use_fp8_w8a8, per_channel_quant, block_shape,
                                w1_scale, w2_scale, a1_scale, a2_scale)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_states, topk_weights)):
            raise ValueError("hidden_states: expected no requires_grad with quantized experts (inference "
                             "only: no gradient flows through fp8/int8 experts), got requires_grad=True")
    else:
        given = [name for name, v in (("w1_scale", w1_scale), ("w2_scale", w2_scale), ("a1_scale", a1_scale),
                                      ("a2_scale", a2_scale), ("block_shape", block_shape)) if v is not None]
        given += ["per_channel_quant"] if per_channel_quant else []
        if given:
            raise ValueError(f"{given[0]}: expected no scales, block_shape or per_channel_quant without "
                             f"use_fp8_w8a8 or use_int8_w8a16, got {', '.join(given)}")
    chosen = _lane(hidden_states, lane, "hidden_states")
    if _check_indices_eagerly():
        _check_fused_moe_indices(topk_ids, expert_map, num_global, E)
    if quantized:
        return getattr(_lanes, f"fused_moe_quant_{chosen}")(
            hidden_states=hidden_states, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
            activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
            expert_map=expert_map, use_fp8_w8a8=use_fp8_w8a8, use_int8_w8a16=use_int8_w8a16,
            per_channel_quant=per_channel_quant,
            block_shape=None if block_shape is None else [int(b) for b in block_shape],
            w1_scale=w1_scale, w2_scale=w2_scale, a1_scale=a1_scale, a2_scale=a2_scale)
    return getattr(_lanes, f"fused_moe_{chosen}")(
        hidden_states=hidden_states, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
        activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
        expert_map=expert_map)
