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

# ---- routing: topk_softmax, grouped_topk ----


# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----


# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----
