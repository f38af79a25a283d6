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


def fused_moe(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
              apply_router_weight_on_input: bool = False, expert_map: torch.Tensor | None = None,
              *, lane: str | None = None) -> torch.Tensor:
    """The fused expert MLP of a mixture-of-experts layer, unquantized (vLLM's ``fused_experts``).

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
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        (M, K) in x's dtype. Not differentiable yet on the Triton lane (the backward is its own op).

    Ids that live on the device are not read back: a topk_ids entry outside [0, E_global), or an
    expert_map entry outside [-1, E), makes that slot count zero (nothing is read for it) and is
    reported by ``lanekit.check_errors()``; ``LANEKIT_CHECK_INDICES=1`` raises a ValueError here
    instead, before the launch.

    Raises:
        TypeError: a non-tensor; x not bf16/fp16, w1 or w2 not of x's dtype, topk_weights not fp32
            or x's dtype, topk_ids or expert_map not int32.
        ValueError: wrong ranks; w1 and w2 of different E; 2N odd; K of w1 or w2 not x's; N of
            w2 not half of w1's 2N; topk_weights not topk_ids' shape, or M not x's; topk < 1 or
            topk > E_global; expert_map not 1-d or shorter than E; apply_router_weight_on_input
            with topk > 1; an unknown activation; tensors on different devices; an unknown lane.

    Source: vLLM's ``fused_experts`` (``vllm.model_executor.layers.fused_moe``) and its
    ``silu_and_mul`` / ``gelu_and_mul``; the oracle is ``lanekit.reference.moe.fused_moe``.
    """
    _tensor("hidden_states", hidden_states, dtypes=_FUSED_DTYPES, ndim=2)
    M, K = hidden_states.shape
    for name, w in (("w1", w1), ("w2", w2)):
        _tensor(name, w, ndim=3, like=hidden_states, like_name="hidden_states")
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
    chosen = _lane(hidden_states, lane, "hidden_states")
    if _check_indices_eagerly():
        _check_fused_moe_indices(topk_ids, expert_map, num_global, E)
    return getattr(_lanes, f"fused_moe_{chosen}")(
        hidden_states=hidden_states, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
        activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
        expert_map=expert_map)
