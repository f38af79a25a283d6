"""The KV cache's lanes, and the custom ops that make the Triton lane opaque to torch.compile.

Each public function in ``lanekit.kv_cache`` validates its arguments, then calls ``<op>_<lane>``
here with keyword arguments. The Triton lanes go through ``torch.library`` custom ops with fakes
(``write_cache`` mutates the caches it is given); the reference lanes run the oracle, which is
exact for these ops (moves, bit-exact codes), and round only where the oracle computes in a wider
type (``merge_attn_states``).

The registry's ``reshape_and_cache`` lanes are the functional form of ``write_cache``: they write
into copies of the caches and return them, so that ``lanekit check`` can compare them.
"""

from __future__ import annotations

import torch

from lanekit.runtime.custom_ops import call as _call, custom_op as _custom_op
from lanekit.reference import kv_cache as ref

Tensor = torch.Tensor


def _kernels():
    from lanekit.kv_cache import kernels  # imported on first use: see runtime.lanes

    return kernels


# ---- writing new tokens at their slots ----

@_custom_op("lanekit::reshape_and_cache",
            mutates_args=("k_cache", "v_cache", "k_cache_scale", "v_cache_scale"))
def _write_cache_op(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                    slot_mapping: Tensor, k_scale: Tensor | None, v_scale: Tensor | None,
                    k_cache_scale: Tensor | None, v_cache_scale: Tensor | None) -> None:
    kernels = _kernels()
    kernels.scatter_kv(x=key, cache=k_cache, slots=slot_mapping, scale_in=k_scale, scale_out=k_cache_scale,
                       second=(value, v_cache, v_scale, v_cache_scale))   # keys and values in one launch


def write_cache_triton(*, key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None,
                       k_cache_scale=None, v_cache_scale=None):
    """In place; given scales broadcast to (N, Hkv) (views, stride 0 where broadcast)."""
    k_scale = k_scale.expand(key.shape[:-1]) if k_scale is not None else None
    v_scale = v_scale.expand(value.shape[:-1]) if v_scale is not None else None
    _call(_write_cache_op, key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
          k_cache_scale, v_cache_scale)


def write_cache_reference(*, k_cache, v_cache, k_cache_scale=None, v_cache_scale=None, **kw):
    new = ref.reshape_and_cache(k_cache=k_cache, v_cache=v_cache, k_cache_scale=k_cache_scale,
                                v_cache_scale=v_cache_scale, **kw)
    with torch.no_grad():
        for cache, values in zip((k_cache, v_cache, k_cache_scale, v_cache_scale), new):
            cache.copy_(values)


def _functional(write):
    def reshape_and_cache(*, k_cache, v_cache, k_cache_scale=None, v_cache_scale=None,
                          kv_dtype=None, **kw):
        """Writes into copies of the caches; returns (k_cache, v_cache[, k_cache_scale,
        v_cache_scale]). ``kv_dtype`` is for the oracle's sake (it sees float64 copies of fp8
        caches): it must be the caches' dtype."""
        if kv_dtype is not None and kv_dtype != k_cache.dtype:
            raise TypeError(f"kv_dtype: expected the caches' dtype {k_cache.dtype}, got {kv_dtype}")
        caches = [t.clone() if t is not None else None
                  for t in (k_cache, v_cache, k_cache_scale, v_cache_scale)]
        write(k_cache=caches[0], v_cache=caches[1], k_cache_scale=caches[2],
              v_cache_scale=caches[3], **kw)
        return tuple(t for t in caches if t is not None)
    return reshape_and_cache


reshape_and_cache_triton = _functional(write_cache_triton)


def reshape_and_cache_reference(**kw):
    return ref.reshape_and_cache(**kw)


# ---- reading sequences back ----

@_custom_op("lanekit::gather_cache")
def _gather_cache_op(k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor,
                     k_cache_scale: Tensor | None, v_cache_scale: Tensor | None, max_seqlen: int,
                     dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    kernels = _kernels()
    return tuple(kernels.gather_kv(cache=cache, scale=scale, block_table=block_table,
                                   seqlens=cache_seqlens, max_seqlen=max_seqlen, dtype=dtype)
                 for cache, scale in ((k_cache, k_cache_scale), (v_cache, v_cache_scale)))


@_gather_cache_op.register_fake
def _(k_cache, v_cache, block_table, cache_seqlens, k_cache_scale, v_cache_scale, max_seqlen, dtype):
    B = block_table.shape[0]
    return tuple(c.new_empty((B, max_seqlen, *c.shape[2:]), dtype=dtype) for c in (k_cache, v_cache))


def _gather_defaults(k_cache, k_cache_scale, cache_seqlens, dtype, max_seqlen):
    if dtype is None:
        dtype = torch.float32 if k_cache_scale is not None else k_cache.dtype
    if max_seqlen is None:
        max_seqlen = int(cache_seqlens.max()) if cache_seqlens.numel() else 0
    return dtype, max_seqlen


def gather_cache_triton(*, k_cache, v_cache, block_table, cache_seqlens, k_cache_scale=None,
                        v_cache_scale=None, dtype=None, max_seqlen=None):
    dtype, max_seqlen = _gather_defaults(k_cache, k_cache_scale, cache_seqlens, dtype, max_seqlen)
    return _call(_gather_cache_op, k_cache, v_cache, block_table, cache_seqlens, k_cache_scale,
                 v_cache_scale, max_seqlen, dtype)


def gather_cache_reference(**kw):
    return ref.gather_cache(**kw)


# ---- standalone quantization ----

@_custom_op("lanekit::quantize_kv")
def _quantize_kv_op(x: Tensor, scale: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    D = x.shape[-1]
    rows = x.reshape(-1, D)
    given = scale.expand(x.shape[:-1]).reshape(-1) if scale is not None else None
    codes, s = _kernels().quantize_kv_fwd(x=rows, dtype=dtype, scale=given)
    return codes.view(x.shape), s.view(x.shape[:-1])


@_quantize_kv_op.register_fake
def _(x, scale, dtype):
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(x.shape[:-1], dtype=torch.float32)


def quantize_kv_triton(*, x, dtype, scale=None):
    return _call(_quantize_kv_op, x, scale, dtype)


def quantize_kv_reference(*, x, dtype, scale=None):
    return ref.quantize_kv(x, dtype, scale)


@_custom_op("lanekit::dequantize_kv")
def _dequantize_kv_op(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    D = codes.shape[-1]
    out = _kernels().dequantize_kv_fwd(codes=codes.reshape(-1, D),
                                       scale=scale.expand(codes.shape[:-1]).reshape(-1), dtype=dtype)
    return out.view(codes.shape)


@_dequantize_kv_op.register_fake
def _(codes, scale, dtype):
    return codes.new_empty(codes.shape, dtype=dtype)


def dequantize_kv_triton(*, codes, scale, dtype):
    return _call(_dequantize_kv_op, codes, scale, dtype)


def dequantize_kv_reference(*, codes, scale, dtype):
    return ref.dequantize_kv(codes, scale, dtype)


# ---- merging attention partials ----

@_custom_op("lanekit::merge_attn_states")
def _merge_attn_states_op(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    return _kernels().merge_attn_states_fwd(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)


@_merge_attn_states_op.register_fake
def _(out_a, lse_a, out_b, lse_b):
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape, dtype=torch.float32)


def merge_attn_states_triton(*, out_a, lse_a, out_b, lse_b):
    return _call(_merge_attn_states_op, out_a, lse_a, out_b, lse_b)


def merge_attn_states_reference(*, out_a, lse_a, out_b, lse_b):
    """The oracle in float64; out in out_a's dtype, lse fp32."""
    f64 = torch.float64
    out, lse = ref.merge_attn_states(out_a.to(f64), lse_a.to(f64), out_b.to(f64), lse_b.to(f64))
    return out.to(out_a.dtype), lse.to(torch.float32)
