"""Attention: FlashAttention-compatible functions."""

from lanekit.attention.api import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func"]
