"""Quantize kernels: fp8 (e4m3fn, e5m2) and int8 codes of rows, per tensor, per token or per
group of columns, and their dequantization; vLLM's names and semantics (``scaled_fp8_quant``,
``per_token_group_quant_fp8``, ``scaled_int8_quant``); int4 packing (``pack_int4``, ``unpack_int4``) and
SVDQuant's W4A4 quantizers (``quantize_w4a4_act``, ``quantize_w4a4_wgt``; nunchaku's names)."""

from lanekit.quant import api as _api

__all__ = [name for name in getattr(_api, "__all__", ())]
globals().update({name: getattr(_api, name) for name in __all__})
