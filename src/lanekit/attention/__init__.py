"""Attention: FlashAttention-compatible functions, and FlashMLA's MLA decode."""

from lanekit.attention.api import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                  flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                  flash_attn_varlen_qkvpacked_func)
from lanekit.attention.api_kvcache import flash_attn_with_kvcache
from lanekit.attention.api_mla import flash_mla_with_kvcache, get_mla_metadata

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
           "flash_mla_with_kvcache", "get_mla_metadata"]
