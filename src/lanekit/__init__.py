"""lanekit: fused Triton kernels for transformer inference and training, each checked against a
readable PyTorch oracle (``lanekit.reference``)."""

from lanekit import kv_cache, layers, linear_attn, moe, rnn
from lanekit.attention.api import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                  flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                  flash_attn_varlen_qkvpacked_func)
from lanekit.attention.api_kvcache import flash_attn_with_kvcache
from lanekit.attention.api_mla import flash_mla_with_kvcache, get_mla_metadata
from lanekit.kv_cache.api import merge_attn_states
from lanekit.runtime.errors import check_errors

__version__ = "0.1.0"
__all__ = ["kv_cache", "layers", "linear_attn", "moe", "rnn", "check_errors", "flash_attn_func", "flash_attn_kvpacked_func",
           "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache", "merge_attn_states", "flash_mla_with_kvcache",
           "get_mla_metadata"]
