"""Public attention functions: FlashAttention's API, validated, dispatched to a lane."""

from __future__ import annotations

import math

import torch

from lanekit.attention import op as _lanes
from lanekit.runtime.lanes import select_lane

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


_FP32_MAX = 3.4028234663852886e38


def _is_real(x) -> bool:
    """An int or float, and not a bool (True would silently mean 1.0)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_tensor(name: str, t, ndim: int | tuple[int, ...], dtypes=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if t.dim() not in ndims:
        raise ValueError(f"{name}: expected {' or '.join(map(str, ndims))} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def _broadcast_4d(name: str, t: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    if t.dim() > 4:
        raise ValueError(f"{name}: expected at most 4 dimensions broadcastable to (B, Hq, Sq, Sk)={shape}, "
                         f"got shape {tuple(t.shape)}")
    try:
        return t.expand(shape) if t.dim() == 4 else t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)).expand(shape)
    except RuntimeError:
        raise ValueError(f"{name}: expected a shape broadcastable to (B, Hq, Sq, Sk)={shape}, "
                         f"got {tuple(t.shape)}") from None


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    attn_bias: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    lane: str | None = None,
):
    """Scaled dot-product attention, FlashAttention-2's ``flash_attn_func`` with the same arguments.

    Computes ``softmax(q k^T * softmax_scale [softcapped] + alibi + attn_bias, masked) v`` per head.
    Multi-query and grouped-query attention (MQA/GQA) are supported by passing k and v with fewer
    heads than q: query head h reads key/value head ``h // (Hq // Hkv)``.

    Arguments:
        q: (B, Sq, Hq, D), fp16, bf16 or fp32 (also fp64 on the reference lane, to check a model
            in float64). Any strides.
        k: (B, Sk, Hkv, D), same dtype and device as q; Hq must be a multiple of Hkv.
        v: (B, Sk, Hkv, Dv), same dtype and device; Dv may differ from D. 1 <= D, Dv <= 256.
        dropout_p: probability of dropping an attention probability, in [0, 1). The kept ones are
            scaled by 1 / (1 - dropout_p). Set 0.0 for evaluation.
        softmax_scale: multiplies q k^T before the softmax. Default ``D ** -0.5``.
        causal: mask out keys after the query, aligned bottom-right: query i sits at key position
            i + Sk - Sq. Same as ``window_size=(left, 0)``.
        window_size: (left, right). Query i (at key position p = i + Sk - Sq) sees keys j with
            p - left <= j <= p + right; -1 leaves that side unbounded.
        softcap: if > 0, scores become ``softcap * tanh(score / softcap)`` (Gemma 2, Grok).
        alibi_slopes: (Hq,) or (B, Hq) fp32: adds ``-slope * |i + Sk - Sq - j|`` to the scores.
        deterministic: accepted for FlashAttention compatibility. lanekit's backward is always
            deterministic (no atomic adds: backward runs on the same inputs give bit-identical
            gradients); on the H200 the atomic variant FlashAttention uses by default measured
            slower in Triton.
        return_attn_probs: also return the LSE (see Returns).
        attn_bias: (lanekit) additive float bias broadcastable to (B, Hq, Sq, Sk), added after
            scaling and softcap: ``softmax(q k^T * scale + attn_bias)``. Not in FlashAttention.
        attn_mask: (lanekit) bool, broadcastable to (B, Hq, Sq, Sk); True keeps a key.
        dropout_seed, dropout_offset: (lanekit) the Philox seed and counter offset of the dropout
            mask, as Python ints. The same pair gives the same mask. Default seed: drawn from
            PyTorch's default CPU generator, so ``torch.manual_seed`` makes runs repeatable.
        lane: (lanekit) "triton" or "reference"; default: triton for CUDA/ROCm tensors, reference
            otherwise, overridden by the LANEKIT_LANE environment variable.

    Returns:
        out: (B, Sq, Hq, Dv) in q's dtype. A query row that sees no key gives 0.
        With ``return_attn_probs``: ``(out, softmax_lse, None)``, softmax_lse (B, Hq, Sq) fp32, the
        natural-log sum of exp of the (scaled, softcapped, biased) visible scores; -inf for a row
        that sees no key. The third item (FlashAttention's dropout-masked probabilities, for
        testing only) is not materialized.

    Raises:
        TypeError: an argument is not a tensor, or has an unsupported dtype, or dtypes differ.
        ValueError: wrong rank or shape, Hq not a multiple of Hkv, head dim outside 1..256,
            devices differ, window sizes below -1, dropout_p outside [0, 1), softcap < 0, a bias
            or mask not broadcastable to (B, Hq, Sq, Sk), or an unknown lane.

    Gradients: differentiable in q, k, v and ``attn_bias`` (its gradient is summed over the
    dimensions it was broadcast along; FlashAttention has no bias). A gradient of the returned
    ``softmax_lse`` is honoured too. The Triton lane runs FlashAttention-2's backward (the
    probabilities recomputed from the LSE, the dropout mask regenerated from its seed and
    offset); the reference lane differentiates the float64 oracle. Works under
    ``torch.compile(fullgraph=True)``: both directions are custom ops with fake implementations.

    Semantics: FlashAttention 2.7 (Dao et al.), incl. bottom-right aligned causal/window masks,
    ALiBi and softcap; docs/semantics.md lists where lanekit differs or goes beyond.
    """
    _check_tensor("q", q, 4, _DTYPES + (torch.float64,))
    _check_tensor("k", k, 4)
    _check_tensor("v", v, 4)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected the dtype of q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected the device of q ({q.device}), got {t.device}")
    B, Sq, Hq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"k, v: expected batch size {B} (that of q), got {k.shape[0]} and {v.shape[0]}")
    Sk, Hkv = k.shape[1], k.shape[2]
    if v.shape[1] != Sk or v.shape[2] != Hkv:
        raise ValueError(f"v: expected (B, Sk, Hkv, Dv) with Sk={Sk}, Hkv={Hkv} (from k), got {tuple(v.shape)}")
    if k.shape[3] != D:
        raise ValueError(f"k: expected head dim {D} (that of q), got {k.shape[3]}")
    Dv = v.shape[3]
    for name, d in (("q/k head dim", D), ("v head dim", Dv)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: expected 1..{MAX_HEAD_DIM}, got {d}")
    if Hq == 0:
        raise ValueError(f"q: expected at least one head, got shape {tuple(q.shape)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"k, v: expected a number of heads that divides Hq={Hq}, got Hkv={Hkv}")
    if not (_is_real(dropout_p) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}")
    if softmax_scale is None:
        softmax_scale = D ** -0.5
    elif not (_is_real(softmax_scale) and math.isfinite(softmax_scale) and abs(softmax_scale) < _FP32_MAX):
        raise ValueError(f"softmax_scale: expected a finite float (fp32 range) or None, got {softmax_scale!r}")
    if not (_is_real(softcap) and softcap >= 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap: expected a finite float >= 0, got {softcap!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"window_size: expected values >= -1 (-1 is unbounded), got {tuple(window_size)}")
    # A side that reaches past every key is unbounded (FlashAttention also turns window sizes
    # >= Sk into -1); this keeps the kernel's int32 window arithmetic in range.
    if left >= Sk:
        left = -1
    if right >= max(Sq, Sk):
        right = -1
    if causal:
        right = 0
    shape4 = (B, Hq, Sq, Sk)
    if alibi_slopes is not None:
        _check_tensor("alibi_slopes", alibi_slopes, (1, 2), (torch.float32,))
        if tuple(alibi_slopes.shape) not in ((Hq,), (B, Hq)):
            raise ValueError(f"alibi_slopes: expected shape ({Hq},) or ({B}, {Hq}), got {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes: expected the device of q ({q.device}), got {alibi_slopes.device}")
        alibi_slopes = alibi_slopes.expand(B, Hq)
    if attn_bias is not None:
        _check_tensor("attn_bias", attn_bias, (0, 1, 2, 3, 4), _DTYPES + (torch.float64,))
        if attn_bias.device != q.device:
            raise ValueError(f"attn_bias: expected the device of q ({q.device}), got {attn_bias.device}")
        attn_bias = _broadcast_4d("attn_bias", attn_bias, shape4)
    if attn_mask is not None:
        _check_tensor("attn_mask", attn_mask, (0, 1, 2, 3, 4), (torch.bool,))
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask: expected the device of q ({q.device}), got {attn_mask.device}")
        attn_mask = _broadcast_4d("attn_mask", attn_mask, shape4)
    for name, val in (("dropout_offset", dropout_offset),) + ((("dropout_seed", dropout_seed),) if dropout_seed is not None else ()):
        if not isinstance(val, int) or isinstance(val, bool) or not 0 <= val < 2**63:
            raise ValueError(f"{name}: expected an int in [0, 2**63), got {val!r}")
    if dropout_p > 0 and dropout_seed is None:
        dropout_seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())

    chosen = select_lane(q.device, lane)
    if q.dtype == torch.float64 and chosen != "reference":
        raise TypeError(f"q: expected dtype in {[str(d) for d in _DTYPES]} on the {chosen} lane, got "
                        "torch.float64 (float64 runs on the reference lane only: lane='reference')")
    # The lane functions the registry names (ops.py), looked up by attribute rather than through
    # the registry's importlib, which torch.compile cannot trace.
    out, lse = getattr(_lanes, f"flash_attn_{chosen}")(
        q=q, k=k, v=v, softmax_scale=float(softmax_scale), window_size=(left, right),
        softcap=float(softcap), alibi_slopes=alibi_slopes, attn_bias=attn_bias, attn_mask=attn_mask,
        dropout_p=float(dropout_p), seed=dropout_seed or 0, offset=dropout_offset,
    )
    if return_attn_probs:
        return out, lse, None
    return out


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    attn_bias: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    lane: str | None = None,
):
    """:func:`flash_attn_func` on q, k and v packed in one tensor, FlashAttention-2's signature.

    Arguments:
        qkv: (B, S, 3, H, D), fp16, bf16 or fp32 (fp64 on the reference lane): q, k and v along
            dimension 2 (self-attention, as many key/value heads as query heads). The gradient is
            returned in the same layout.
        The rest: as :func:`flash_attn_func`.

    Returns: as :func:`flash_attn_func`, out (B, S, H, D).

    Raises:
        TypeError: qkv is not a tensor, or has an unsupported dtype.
        ValueError: qkv is not 5-D with size 3 in dimension 2; and as :func:`flash_attn_func`.
    """
    _check_tensor("qkv", qkv, 5, _DTYPES + (torch.float64,))
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv: expected shape (B, S, 3, H, D), got {tuple(qkv.shape)}")
    return flash_attn_func(
        qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, deterministic, return_attn_probs, attn_bias=attn_bias, attn_mask=attn_mask,
        dropout_seed=dropout_seed, dropout_offset=dropout_offset, lane=lane,
    )


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    attn_bias: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    lane: str | None = None,
):
    """:func:`flash_attn_func` with k and v packed in one tensor, FlashAttention-2's signature.

    Arguments:
        q: (B, Sq, Hq, D), fp16, bf16 or fp32.
        kv: (B, Sk, 2, Hkv, D), q's dtype: k and v along dimension 2; Hq a multiple of Hkv.
        The rest: as :func:`flash_attn_func`.

    Returns: as :func:`flash_attn_func`, out (B, Sq, Hq, D).

    Raises:
        TypeError: kv is not a tensor, or has an unsupported dtype or one other than q's.
        ValueError: kv is not 5-D with size 2 in dimension 2; and as :func:`flash_attn_func`.
    """
    _check_tensor("kv", kv, 5, _DTYPES + (torch.float64,))
    if isinstance(q, torch.Tensor) and kv.dtype != q.dtype:
        raise TypeError(f"kv: expected the dtype of q ({q.dtype}), got {kv.dtype}")
    if kv.shape[2] != 2:
        raise ValueError(f"kv: expected shape (B, Sk, 2, Hkv, D), got {tuple(kv.shape)}")
    return flash_attn_func(
        q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, deterministic, return_attn_probs, attn_bias=attn_bias, attn_mask=attn_mask,
        dropout_seed=dropout_seed, dropout_offset=dropout_offset, lane=lane,
    )
