"""Numerics several families share: ``numerics`` (Triton); the oracles' side is ``lanekit.reference.numerics``."""
