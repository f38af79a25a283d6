"""The GEMM family's kernels: ``scaled_mm`` (the 8-bit scaled GEMM and the per-row quantize
pass), ``weight_only`` (4-bit weights dequantized in the K loop: AWQ/GPTQ int4, MXFP4) and
``w4a8`` (int4 codes unpacked to int8 for the int8 dot: w4a8_linear, int4_mm) and ``svdquant``
(SVDQuant's W4A4 GEMM with its low-rank branch)."""

from lanekit.gemm.kernels.scaled_mm import quant_rows, scaled_mm_fwd
from lanekit.gemm.kernels.svdquant import svdquant_w4a4_fwd
from lanekit.gemm.kernels.w4a8 import int4_mm_fwd, w4a8_linear_fwd
from lanekit.gemm.kernels.weight_only import mxfp4_linear_fwd, w4a16_linear_fwd

__all__ = ["scaled_mm_fwd", "quant_rows", "w4a16_linear_fwd", "mxfp4_linear_fwd", "w4a8_linear_fwd",
           "int4_mm_fwd", "svdquant_w4a4_fwd"]
