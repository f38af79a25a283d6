"""The lanes of MLA decode (``flash_mla_with_kvcache``), and the custom op that makes the Triton
lane opaque to torch.compile. Each lane takes the keyword arguments the public function produces
after validation (q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
k_cache_scale, num_splits) and returns ``(out, lse)``.
"""

from __future__ import annotations

import torch

from lanekit.reference import mla as ref
from lanekit.runtime.custom_ops import call as _call, custom_op as _custom_op


@_custom_op("lanekit::flash_mla_with_kvcache")
def _flash_mla_op(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                  cache_seqlens: torch.Tensor, k_cache_scale: torch.Tensor | None, head_dim_v: int,
                  softmax_scale: float, causal: bool, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    from lanekit.attention.kernels.mla import flash_mla_kvcache  # imported on first use: see runtime.lanes

    return flash_mla_kvcache(q=q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens,
                             head_dim_v=head_dim_v, softmax_scale=softmax_scale, causal=causal,
                             k_cache_scale=k_cache_scale, num_splits=num_splits)


@_flash_mla_op.register_fake
def _(q, k_cache, block_table, cache_seqlens, k_cache_scale, head_dim_v, softmax_scale, causal, num_splits):
    B, Sq, H, _ = q.shape
    return q.new_empty((B, Sq, H, head_dim_v)), q.new_empty((B, H, Sq), dtype=torch.float32)


def flash_mla_with_kvcache_triton(*, q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale,
                                  causal, k_cache_scale=None, num_splits=1):
    return _call(_flash_mla_op, q, k_cache, block_table, cache_seqlens, k_cache_scale, head_dim_v,
                 float(softmax_scale), bool(causal), int(num_splits))


def flash_mla_with_kvcache_reference(*, q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale,
                                     causal, k_cache_scale=None, num_splits=1):
    """The oracle as a lane: float64 inside (the cache's codes dequantized there), out in q's dtype
    and lse in fp32."""
    f64 = torch.float64
    out, lse = ref.flash_mla_with_kvcache(
        q.to(f64), k_cache if k_cache_scale is not None else k_cache.to(f64), block_table, cache_seqlens,
        head_dim_v, softmax_scale=softmax_scale, causal=causal, k_cache_scale=k_cache_scale,
        num_splits=num_splits)
    return out.to(q.dtype), lse.to(torch.float32)
