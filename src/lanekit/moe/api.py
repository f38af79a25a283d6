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
from lanekit.runtime import errors as _errors
from lanekit.runtime.lanes import select_lane as _select_lane
from lanekit.runtime.validate import int_at_least as _int_at_least, tensor as _tensor

__all__: list[str] = []

# ---- routing: topk_softmax, grouped_topk ----


# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----

__all__ += ["moe_align_block_size"]


def _topk_ids(topk_ids, num_experts: int, like: torch.Tensor | None = None, like_name: str | None = None):
    """topk_ids int32 (M, topk) with 1 <= topk <= num_experts, on like's device; with
    LANEKIT_CHECK_INDICES=1 its values too (a sync)."""
    _tensor("topk_ids", topk_ids, dtypes=(torch.int32,), ndim=2, like=like, like_name=like_name)
    topk = topk_ids.shape[1]
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk_ids: expected (M, topk) with 1 <= topk <= num_experts = {num_experts}, "
                         f"got shape {tuple(topk_ids.shape)}")
    if _errors.check_indices_eagerly() and topk_ids.numel():
        bad = (topk_ids < 0) | (topk_ids >= num_experts)
        if bool(bad.any()):
            value = int(topk_ids[bad][0])
            raise ValueError(f"topk_ids: expected expert ids in [0, {num_experts}), got {value} "
                             f"(LANEKIT_CHECK_INDICES=1)")


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                         expert_map: torch.Tensor | None = None, *, lane: str | None = None):
    """Sort the routed slots by expert and pad each expert's run to a multiple of ``block_size``,
    so that every block of ``block_size`` rows belongs to one expert (the layout of vLLM's fused
    MoE GEMM).

    Slot s of token t has the *flat index* i = t * topk + s. The result lists expert 0's flat
    indices (ascending), padded with the sentinel M * topk to a multiple of block_size, then
    expert 1's, and so on; an expert with no token takes no block. Every lane gives the same
    values, bit for bit.

    Arguments:
        topk_ids: (M, topk) int32, each token's experts (``topk_softmax``'s ids), any strides;
            1 <= topk <= num_experts. Entries are read on the device: one outside
            [0, num_experts) is never used as an address; it is dropped (takes no slot) and
            recorded in the device's error flag (``lanekit.check_errors()`` raises it), or, with
            ``LANEKIT_CHECK_INDICES=1``, raises here at once.
        block_size: rows per block of the expert GEMM, a positive int (vLLM uses 16, 32, 64, 128).
        num_experts: E, the global number of experts, a positive int.
        expert_map: (E,) int32 or None: global -> local expert id, -1 for an expert on another
            rank. With it, expert_ids holds the local ids (the sort still counts every expert).
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        sorted_token_ids: (max_num_tokens_padded,) int32; max_num_tokens_padded =
            M * topk + E * (block_size - 1), or M * topk * block_size where that is smaller
            (fewer slots than experts). Past num_tokens_post_padded: the sentinel M * topk.
        expert_ids: (ceil(max_num_tokens_padded / block_size),) int32, each block's expert; the
            blocks past the last used one hold 0 (with expert_map: expert_map[0]).
        num_tokens_post_padded: (1,) int32, the padded length in use.
        Not differentiable. No device sync.

    Raises:
        TypeError: topk_ids or expert_map not an int32 tensor; block_size or num_experts not an int.
        ValueError: topk_ids not 2-d or topk outside [1, num_experts]; block_size or num_experts
            below 1; expert_map not (E,) or on another device; an unknown lane; with
            LANEKIT_CHECK_INDICES=1, an expert id outside [0, num_experts).

    Source: vLLM's ``moe_align_block_size`` (``vllm.model_executor.layers.fused_moe``), with the
    order within one expert fixed (ascending flat index).
    """
    block_size = _int_at_least("block_size", block_size, 1)
    num_experts = _int_at_least("num_experts", num_experts, 1)
    _topk_ids(topk_ids, num_experts)
    if expert_map is not None:
        _tensor("expert_map", expert_map, dtypes=(torch.int32,), ndim=1, like=topk_ids, like_name="topk_ids")
        if expert_map.shape[0] != num_experts:
            raise ValueError(f"expert_map: expected shape ({num_experts},) (num_experts), got "
                             f"{tuple(expert_map.shape)}")
    chosen = _select_lane(topk_ids.device, lane)
    return getattr(_lanes, f"moe_align_block_size_{chosen}")(
        topk_ids=topk_ids, block_size=block_size, num_experts=num_experts, expert_map=expert_map)



# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----
