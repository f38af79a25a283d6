"""Linear attention and its decayed form (fla's simple GLA): chunked (prefill, training) and
step-by-step (decode), forward and backward, with flash-linear-attention's names and layout."""

from lanekit.linear_attn.api import (chunk_linear_attn, chunk_simple_gla, fused_recurrent_linear_attn,
                                     fused_recurrent_simple_gla)

__all__ = ["chunk_linear_attn", "chunk_simple_gla", "fused_recurrent_linear_attn", "fused_recurrent_simple_gla"]
