"""Test-session setup: choose native or interpreted Triton before any kernel module is imported.

With no GPU, Triton's interpreter runs the kernels on the CPU (TRITON_INTERPRET must be set before
the kernels are decorated, i.e. before lanekit's kernel modules are imported). Tests take their
device from the ``device`` fixture: "cuda" when a GPU is present, else "cpu".
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE
