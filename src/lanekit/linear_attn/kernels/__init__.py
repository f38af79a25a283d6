"""Triton kernels of linear attention and its decayed form (fla's simple GLA), and their launchers:

- ``chunk``: the chunked forward (a state pass over the chunks, then every chunk's output in
  parallel) and the backward (the state pass again, the state-gradient pass in reverse, dq, dk, dv
  per chunk, and the decay's gradient as a reverse cumulative sum).
- ``recurrent``: the step-by-step forward (decode); its backward is the chunked one.
"""

from lanekit.linear_attn.kernels.chunk import chunk_bwd, chunk_fwd
from lanekit.linear_attn.kernels.recurrent import recurrent_fwd

__all__ = ["chunk_bwd", "chunk_fwd", "recurrent_fwd"]
