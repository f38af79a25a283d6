"""lanekit on top of other libraries: transformers attention and experts, greedy generation, and
8-bit and 4-bit linears (``quantize_linears``; ``load_quantized_linears`` for AWQ and GPTQ
checkpoints)."""

from lanekit.integrations.quantize import load_quantized_linears, quantize_linears

__all__ = ["load_quantized_linears", "quantize_linears"]
