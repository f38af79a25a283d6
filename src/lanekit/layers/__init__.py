"""Fused layers: norms, rotary embeddings and gated units, forward and backward."""

from lanekit.layers.api import (adaln, apply_rotary, apply_rotary_qk, geglu, layer_norm, qk_norm_rope_quant,
                                rms_norm, rms_norm_rope, swiglu)

__all__ = ["adaln", "apply_rotary", "apply_rotary_qk", "geglu", "layer_norm", "qk_norm_rope_quant", "rms_norm",
           "rms_norm_rope", "swiglu"]
