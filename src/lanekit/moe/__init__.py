"""Mixture of experts: routing (top-k softmax, DeepSeek-V3's grouped top-k), the align of tokens
by expert, dispatch and combine, the grouped GEMM and the fused expert MLP; vLLM's names and
semantics (``fused_moe``), PyTorch's for the grouped GEMM (``torch.nn.functional.grouped_mm``)."""

from lanekit.moe import api as _api

__all__ = [name for name in getattr(_api, "__all__", ())]
globals().update({name: getattr(_api, name) for name in __all__})
