"""Triton kernels for attention, and their launchers, one module per pass:

- ``fwd``: the forward (FlashAttention-2), dense, varlen (packed) and paged: ``flash_attn_fwd``;
- ``bwd``: its backward (preprocessing, dK/dV, dQ): ``flash_attn_bwd``;
- ``decode``: attention over a KV cache (decode and chunked prefill, split-KV): ``flash_attn_kvcache``;
- ``common``: what several of them share (varlen and page-table addressing, host helpers).
"""

from lanekit.attention.kernels.bwd import flash_attn_bwd
from lanekit.attention.kernels.decode import flash_attn_kvcache
from lanekit.attention.kernels.fwd import flash_attn_fwd

__all__ = ["flash_attn_bwd", "flash_attn_fwd", "flash_attn_kvcache"]
