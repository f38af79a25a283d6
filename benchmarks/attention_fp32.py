"""fp32 attention forward: lanekit beside PyTorch SDPA's memory-efficient backend, same run.

fp32 is chosen for accuracy: lanekit multiplies in IEEE fp32 on the FMA units (no tensor cores),
and SDPA's flash and cuDNN backends take 16-bit inputs only. Shapes: D in {32, 64, 128, 256}, Sq =
Sk = 2048, B = 8, 2048 / D heads, causal and not. FLOPs as benchmarks.attention counts them.
"""

from __future__ import annotations

import torch

from benchmarks.attention import check, flops, make_inputs, name, runners  # noqa: F401 (the family's API)


def cases(quick: bool = False):
    for D in (32, 64, 128, 256):
        for causal in (False, True):
            yield dict(D=D, S=2048, causal=causal, B=8, H=2048 // D, dtype=torch.float32)
