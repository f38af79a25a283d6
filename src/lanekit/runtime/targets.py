"""The GPU targets lanekit's kernels are written for, by architecture id (see ``tuning.arch_id``).

A target with no device on a machine can still be compiled for there (Triton compiles for a GPU
that is not present) and its assembly inspected; the execution matrix has a column for each
target that no recorded check run covers.
"""

from __future__ import annotations

# NVIDIA Ampere and Hopper; AMD CDNA 3 (MI300), RDNA 3.5 (Strix Halo), RDNA 4.
TARGETS: tuple[str, ...] = ("sm80", "sm90", "gfx942", "gfx1151", "gfx1201")
