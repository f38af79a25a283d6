"""8-bit matmuls: fp8 scaled_mm (per tensor, rowwise, 128 x 128 blocks), MXFP8 mx_mm, int8_mm,
the quantized linears (w8a8_linear, fp8_linear, w8a16_linear), and the 4-bit weight-only linears
(w4a16_linear: AWQ/GPTQ int4; mxfp4_linear: OCP MXFP4, gpt-oss's layout), the int4 GEMMs on the
int8 dot (w4a8_linear: int4 weights, int8 activations; int4_mm: int4 x int4), and SVDQuant's W4A4
linear with its low-rank branch (svdquant_w4a4_linear)."""

from lanekit.gemm.api import (fp8_linear, int4_mm, int8_mm, mx_mm, mxfp4_linear, scaled_mm, svdquant_w4a4_linear,
                              w4a8_linear, w4a16_linear, w8a8_linear, w8a16_linear)

__all__ = ["scaled_mm", "mx_mm", "int8_mm", "w8a8_linear", "fp8_linear", "w8a16_linear", "w4a16_linear",
           "mxfp4_linear", "w4a8_linear", "int4_mm", "svdquant_w4a4_linear"]
