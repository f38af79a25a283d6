"""8-bit matmuls: fp8 scaled_mm (per tensor, rowwise, 128 x 128 blocks), MXFP8 mx_mm, int8_mm,
and the quantized linears (w8a8_linear, fp8_linear, w8a16_linear)."""

from lanekit.gemm.api import fp8_linear, int8_mm, mx_mm, scaled_mm, w8a8_linear, w8a16_linear

__all__ = ["scaled_mm", "mx_mm", "int8_mm", "w8a8_linear", "fp8_linear", "w8a16_linear"]
