"""The mixture-of-experts family against its oracles (lanekit.reference.moe), on every lane, with
the project's tolerance rule; the cases the MoE issue names, each a test."""

from __future__ import annotations

import pytest
import torch

import lanekit
from lanekit.reference import moe as ref
from lanekit.runtime import errors


def test_device_errors_are_reported_once_and_cleared():
    bit = errors.register("test: an index out of range (masked)")
    assert errors.register("test: an index out of range (masked)") == bit
    flag = errors.error_flag(torch.device("cpu"))
    errors.check_errors()                       # nothing recorded: returns quietly
    flag |= bit
    with pytest.raises(ValueError, match="an index out of range"):
        lanekit.check_errors()
    assert int(flag.item()) == 0
    errors.check_errors()


# ---- routing: topk_softmax, grouped_topk ----


# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----


# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----
