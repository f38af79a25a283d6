"""The mixture-of-experts lanes, and the custom ops that make the Triton lane opaque to
torch.compile (and give fused_moe and grouped_mm their autograd).

Every lane takes the normalized keyword arguments that the public functions produce after
validation; the reference lanes run the oracles of ``lanekit.reference.moe``.
"""

from __future__ import annotations

import torch

from lanekit.reference import moe as ref

Tensor = torch.Tensor

# ---- routing: topk_softmax, grouped_topk ----


# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----


# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----
