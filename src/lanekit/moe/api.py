"""Public mixture-of-experts functions: validated, dispatched to a lane.

Shapes: M tokens, K hidden size, N an expert's intermediate size, E experts, topk experts per
token. Routing is the pair ``topk_weights`` fp32 (M, topk) and ``topk_ids`` int32 (M, topk), as
vLLM's ``fused_moe`` takes it. Index values that live on the device (expert ids, group offsets)
are not read back on every call: the kernels mask what is out of range and record it in the
device's error flag (``lanekit.check_errors()``; ``LANEKIT_CHECK_INDICES=1`` checks them on the
host before each launch instead: ``lanekit.runtime.errors``).
"""

from __future__ import annotations

__all__: list[str] = []

# ---- routing: topk_softmax, grouped_topk ----


# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----


# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----
