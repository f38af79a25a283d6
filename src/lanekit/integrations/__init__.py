"""lanekit on top of other libraries: transformers attention and experts, greedy generation, and
8-bit linears (``quantize_linears``)."""

from lanekit.integrations.quantize import quantize_linears

__all__ = ["quantize_linears"]
