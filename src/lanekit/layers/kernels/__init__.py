"""Triton kernels of the fused layers, and their launchers, one module per kind:

- ``norm``: ``_norm_fwd_kernel`` / ``_norm_bwd_kernel``, RMSNorm, LayerNorm and AdaLN with the fused
  residual (and gated residual) add.
- ``rotary``: ``_rotary_kernel``, RoPE; ``_rotary_qk_kernel``, RoPE of q and k in one launch.
- ``qk_norm``: ``_qk_norm_rope_fwd_kernel``, a per-head RMSNorm, RoPE and optionally a per-head
  quantization of q and k in one launch; ``_rms_norm_rope_bwd_kernel`` its backward (without
  quantization), q and k in one launch too.
- ``glu``: ``_glu_fwd_kernel`` / ``_glu_bwd_kernel``, SwiGLU and GeGLU.
- ``shared``: the helpers several of them use.

Every kernel computes in fp32 and casts once on the store (the quantized path's rare redone tiles
take their scales in fp64); offsets are int64, but in ``_qk_norm_rope_fwd_kernel``: int32 within a
row (its launcher checks they fit), and int32 for its rows too unless some tensor's offsets reach
2^31. The launchers are imported here, which imports every kernel module (``lanekit.layers.op``
calls ``kernels.norm_fwd`` and the others).
"""

from lanekit.layers.kernels.glu import glu_bwd, glu_fwd
from lanekit.layers.kernels.norm import norm_bwd, norm_fwd
from lanekit.layers.kernels.qk_norm import qk_norm_rope_fwd, rms_norm_rope_bwd
from lanekit.layers.kernels.rotary import rotary_fwd, rotary_qk_fwd

__all__ = ["glu_bwd", "glu_fwd", "norm_bwd", "norm_fwd", "qk_norm_rope_fwd", "rms_norm_rope_bwd", "rotary_fwd",
           "rotary_qk_fwd"]
