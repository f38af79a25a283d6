"""Attention: FlashAttention-compatible functions."""

from lanekit.attention.api import flash_attn_func

__all__ = ["flash_attn_func"]
