"""Paged KV cache: FlashAttention's paged layout, vLLM's slot mapping, int8/fp8 codes with
per-(token, head) scales, and the merge of attention partials."""

from lanekit.kv_cache.api import (KVCacheFullError, PagedKVCache, dequantize_kv, gather_cache,
                                  merge_attn_states, quantize_kv, reshape_and_cache)

__all__ = ["KVCacheFullError", "PagedKVCache", "dequantize_kv", "gather_cache", "merge_attn_states",
           "quantize_kv", "reshape_and_cache"]
