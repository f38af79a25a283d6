"""FlashAttention 2's ``flash_attn`` package on lanekit's kernels (see :mod:`lanekit.compat`:
``lanekit.compat.install()`` makes ``import flash_attn`` give this package).

The functions are lanekit's (:mod:`lanekit.attention`), which take FlashAttention 2's arguments
in its order, plus keyword-only extras; ``__version__`` is the FlashAttention release whose API
this follows. Where they differ from FlashAttention: ``return_attn_probs=True`` gives
``(out, softmax_lse, None)`` (the dropout-encoded probabilities, a testing aid of FlashAttention's
CUDA kernels, are not materialized); argument errors are ValueError/TypeError subclasses that are
RuntimeErrors too, as FlashAttention's are."""

from lanekit.compat.flash_attn.flash_attn_interface import (flash_attn_func, flash_attn_kvpacked_func,
                                                           flash_attn_qkvpacked_func, flash_attn_varlen_func,
                                                           flash_attn_varlen_kvpacked_func,
                                                           flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

__version__ = "2.8.4"

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
