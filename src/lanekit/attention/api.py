"""Public attention functions: FlashAttention's API, validated, dispatched to a lane."""

from __future__ import annotations

import math

import torch

from lanekit.attention import op as _lanes
from lanekit.attention import tuning
from lanekit.kv_cache import checks
from lanekit.runtime.errors import check_indices_eagerly
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.validate import (argument_errors, check_inplace, check_outputs, flag, int_at_least, int_in,
                                      int_pair, is_int, is_real, lane_for, tensor)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


_FP32_MAX = 3.4028234663852886e38


def _broadcast_4d(name: str, t: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    if t.dim() > 4:
        raise ValueError(f"{name}: expected at most 4 dimensions broadcastable to (B, Hq, Sq, Sk)={shape}, "
                         f"got shape {tuple(t.shape)}")
    try:
        return t.expand(shape) if t.dim() == 4 else t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)).expand(shape)
    except RuntimeError:
        raise ValueError(f"{name}: expected a shape broadcastable to (B, Hq, Sq, Sk)={shape}, "
                         f"got {tuple(t.shape)}") from None


def _check_heads(q_shape, D: int, Dv: int, Hq: int, Hkv: int, kv_name: str = "k, v") -> None:
    """Head dims within 1..MAX_HEAD_DIM, at least one query head, Hkv dividing Hq (GQA/MQA)."""
    for name, d in (("q/k head dim", D), ("v head dim", Dv)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: expected 1..{MAX_HEAD_DIM}, got {d}")
    if Hq == 0:
        raise ValueError(f"q: expected at least one head, got shape {tuple(q_shape)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"{kv_name}: expected a number of heads that divides Hq={Hq}, got Hkv={Hkv}")


def _options(D: int, Sq: int, Sk: int, dropout_p, softmax_scale, softcap, causal, window_size):
    """Check the scalar options of the attention functions; returns (softmax_scale, left, right)
    with the default scale filled in and the causal mask folded into the window. Ints and bools
    follow runtime.validate's one rule (NumPy's and 0-d tensors count; a bool is not an int)."""
    if not (is_real(dropout_p) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}")
    if softmax_scale is None:
        softmax_scale = D ** -0.5
    elif not (is_real(softmax_scale) and math.isfinite(softmax_scale) and abs(softmax_scale) < _FP32_MAX):
        raise ValueError(f"softmax_scale: expected a finite float (fp32 range) or None, got {softmax_scale!r}")
    if not (is_real(softcap) and softcap >= 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap: expected a finite float >= 0, got {softcap!r}")
    causal = flag("causal", causal)
    left, right = int_pair("window_size", window_size, " (left, right)")
    if left < -1 or right < -1:
        raise ValueError(f"window_size: expected values >= -1 (-1 is unbounded), got {(left, right)}")
    # A side that reaches past every key is unbounded (FlashAttention also turns window sizes
    # >= Sk into -1); this keeps the kernel's int32 window arithmetic in range.
    if left >= Sk:
        left = -1
    if right >= max(Sq, Sk):
        right = -1
    if causal:
        right = 0
    return float(softmax_scale), left, right


def _alibi(alibi_slopes, B: int, Hq: int, q: torch.Tensor) -> torch.Tensor | None:
    """ALiBi slopes (Hq,) or (B, Hq) fp32 on q's device, checked and expanded to (B, Hq)."""
    if alibi_slopes is None:
        return None
    tensor("alibi_slopes", alibi_slopes, dtypes=(torch.float32,), ndim=(1, 2), like=q, like_name="q")
    if tuple(alibi_slopes.shape) not in ((Hq,), (B, Hq)):
        raise ValueError(f"alibi_slopes: expected shape ({Hq},) or ({B}, {Hq}), got {tuple(alibi_slopes.shape)}")
    return alibi_slopes.expand(B, Hq)


def _dropout_seed(dropout_p: float, dropout_seed, dropout_offset) -> int:
    """The Philox seed and offset of the dropout mask as Python ints: checked, the seed drawn from
    PyTorch's CPU generator when None."""
    checked = {}
    for name, val in (("dropout_offset", dropout_offset),) + ((("dropout_seed", dropout_seed),) if dropout_seed is not None else ()):
        if not is_int(val):
            raise TypeError(f"{name}: expected an int in [0, 2**63), got {type(val).__name__}")
        if not 0 <= int(val) < 2**63:
            raise ValueError(f"{name}: expected an int in [0, 2**63), got {int(val)!r}")
        checked[name] = int(val)
    if dropout_p > 0 and dropout_seed is None:
        return int(torch.randint(0, 2**62, (1,), device="cpu").item()), checked["dropout_offset"]
    return checked.get("dropout_seed", 0), checked["dropout_offset"]


_QUANT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _sinks(sinks, Hq: int, q: torch.Tensor) -> torch.Tensor | None:
    """sinks: None, or (Hq,) fp32 (fp64 too for a float64 q) on q's device."""
    if sinks is None:
        return None
    tensor("sinks", sinks, dtypes=(torch.float32,) + ((torch.float64,) if q.dtype == torch.float64 else ()),
           ndim=1, like=q, like_name="q")
    if sinks.shape[0] != Hq:
        raise ValueError(f"sinks: expected shape ({Hq},) (one logit per query head), got {tuple(sinks.shape)}")
    return sinks


def _quant(q: torch.Tensor, B: int, Hkv: int, q_descale, k_descale, v_descale, out_dtype, dropout_p,
           grads: tuple = ()) -> tuple[tuple, torch.dtype | None]:
    """fp8/int8 attention's arguments: for an fp8 or int8 q, the (B, Hkv) fp32 descales (None: 1)
    and out_dtype (bf16, fp16 or fp32; None: bf16), no dropout, and no tensor of ``grads``
    (name, tensor) requiring grad (forward only). For any other q: descales None and out_dtype
    None or q's dtype. Returns ((q_descale, k_descale, v_descale), out_dtype)."""
    descales = (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
    if q.dtype not in _QUANT_DTYPES:
        for name, d in descales:
            if d is not None:
                raise ValueError(f"{name}: expected None for {q.dtype} inputs (descales go with fp8 "
                                 f"e4m3/e5m2 or int8 q, k, v), got a tensor")
        if out_dtype is not None and out_dtype != q.dtype:
            raise ValueError(f"out_dtype: expected None or q's dtype ({q.dtype}) for {q.dtype} inputs, "
                             f"got {out_dtype}")
        return (None, None, None), None
    if out_dtype is None:
        out_dtype = torch.bfloat16
    elif out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {[str(d) for d in _OUT_DTYPES]} or None, got {out_dtype!r}")
    if dropout_p != 0:
        raise ValueError(f"dropout_p: expected 0.0 with {q.dtype} inputs (fp8/int8 attention is "
                         f"inference only, as FlashAttention-3's), got {dropout_p!r}")
    if torch.is_grad_enabled():
        for name, t in grads:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise ValueError(f"{name}: fp8 and int8 attention is forward only (as FlashAttention-3's): "
                                 "expected no tensor requiring grad, got one (use torch.no_grad() or detach)")
    if q.is_cuda and q.dtype != torch.int8 and torch.version.hip is None \
            and torch.cuda.get_device_capability(q.device) < (8, 9):
        raise ValueError(f"q: {q.dtype} attention needs an NVIDIA GPU of compute capability 8.9 or later "
                         f"(no fp8 conversions before; int8 runs there), got "
                         f"{torch.cuda.get_device_capability(q.device)}")
    out = []
    for name, d in descales:
        if d is None:
            d = torch.ones((), dtype=torch.float32, device=q.device).expand(B, Hkv)
        else:
            tensor(name, d, dtypes=(torch.float32,), ndim=2, like=q, like_name="q")
            if tuple(d.shape) != (B, Hkv):
                raise ValueError(f"{name}: expected shape ({B}, {Hkv}) (batch, KV heads), got {tuple(d.shape)}")
        out.append(d)
    return tuple(out), out_dtype


@argument_errors
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
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
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
        sinks: (Hq,) fp32, attention sinks (gpt-oss): a learned logit per query head that joins
            every row's softmax denominator with no value,
            ``out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j))``; the LSE includes it, and
            a row that sees no key gives 0 with LSE = sink. Differentiable (its gradient is
            ``-sum over rows of exp(sink - lse) * (rowsum(dO * O) - dLSE)``). Finite or -inf.
        q_descale, k_descale, v_descale: (B, Hkv) fp32, FlashAttention-3's descales for fp8
            (torch.float8_e4m3fn, torch.float8_e5m2) or int8 q, k, v (None: 1). The scores are
            ``(q k^T) * q_descale * k_descale * softmax_scale``, then softcap, ALiBi and attn_bias
            (never multiplied by the descales); v_descale multiplies the output. P.V runs in
            V's fp8 format (P rounded to it; e5m2 x e5m2 for e5m2 V); for int8, P in fp16 against
            V's codes. Forward only, no dropout. fp8 needs sm89+ on NVIDIA (int8 runs on sm80).
        out_dtype: the output's dtype for fp8/int8 inputs: torch.bfloat16 (default), float16 or
            float32; for other inputs None or q's dtype.

    Returns:
        out: (B, Sq, Hq, Dv) in q's dtype (fp8/int8: out_dtype). A query row that sees no key gives 0.
        With ``return_attn_probs``: ``(out, softmax_lse, None)``, softmax_lse (B, Hq, Sq) fp32, the
        natural-log sum of exp of the (scaled, softcapped, biased) visible scores; -inf for a row
        that sees no key. The third item (FlashAttention's dropout-masked probabilities, for
        testing only) is not materialized.

    Masked keys' values must be finite: a NaN or inf in a V row that a query cannot see (masked
    by causal, window_size or attn_mask) can still make that query's output NaN (0 * NaN in P @ V), as
    in FlashAttention and PyTorch's SDPA; which masked queries do is not specified (the Triton
    lane never reads key blocks a tile sees none of). A NaN in a masked K row is harmless.
    (docs/semantics.md, "Non-finite values".)

    Raises:
        TypeError: an argument is not a tensor, or has an unsupported dtype, or dtypes differ; a
            flag (causal, deterministic, return_attn_probs) not a bool, window_size not a pair of
            ints (a tuple, list, tensor or array of two; NumPy's ints and 0-d or 1-element
            tensors count, floats and bools do not) or a dropout seed/offset not an int.
        ValueError: wrong rank or shape, Hq not a multiple of Hkv, head dim outside 1..256,
            devices differ, window sizes below -1, dropout_p outside [0, 1), softcap < 0, a bias
            or mask not broadcastable to (B, Hq, Sq, Sk), or an unknown lane; sinks not (Hq,);
            descales not (B, Hkv) or given for 16-bit inputs, an out_dtype outside bf16/fp16/fp32,
            dropout or a tensor requiring grad with fp8/int8 inputs.
        Each is a RuntimeError too (``lanekit.runtime.validate.ArgumentError`` and
        ``ArgumentTypeError``), as FlashAttention's argument errors are.

    Gradients: differentiable in q, k, v and ``attn_bias`` (its gradient is summed over the
    dimensions it was broadcast along; FlashAttention has no bias). A gradient of the returned
    ``softmax_lse`` is honoured too. The Triton lane runs FlashAttention-2's backward (the
    probabilities recomputed from the LSE, the dropout mask regenerated from its seed and
    offset); the reference lane differentiates the float64 oracle. Works under
    ``torch.compile(fullgraph=True)``: both directions are custom ops with fake implementations.

    Semantics: FlashAttention 2.7 (Dao et al.), incl. bottom-right aligned causal/window masks,
    ALiBi and softcap; sinks as gpt-oss's attention (and vLLM's ``sinks=``); fp8 descales as
    FlashAttention-3's ``flash_attn_func``; docs/semantics.md lists where lanekit differs or goes
    beyond.
    """
    tensor("q", q, dtypes=_DTYPES + (torch.float64,) + _QUANT_DTYPES, ndim=4)
    tensor("k", k, ndim=4, like=q, like_name="q", like_dtype=True)
    tensor("v", v, ndim=4, like=q, like_name="q", like_dtype=True)
    B, Sq, Hq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"k, v: expected batch size {B} (that of q), got {k.shape[0]} and {v.shape[0]}")
    Sk, Hkv = k.shape[1], k.shape[2]
    if v.shape[1] != Sk or v.shape[2] != Hkv:
        raise ValueError(f"v: expected (B, Sk, Hkv, Dv) with Sk={Sk}, Hkv={Hkv} (from k), got {tuple(v.shape)}")
    if k.shape[3] != D:
        raise ValueError(f"k: expected head dim {D} (that of q), got {k.shape[3]}")
    Dv = v.shape[3]
    _check_heads(q.shape, D, Dv, Hq, Hkv)
    softmax_scale, left, right = _options(D, Sq, Sk, dropout_p, softmax_scale, softcap, causal, window_size)
    flag("deterministic", deterministic)
    return_attn_probs = flag("return_attn_probs", return_attn_probs)
    shape4 = (B, Hq, Sq, Sk)
    alibi_slopes = _alibi(alibi_slopes, B, Hq, q)
    if attn_bias is not None:
        tensor("attn_bias", attn_bias, dtypes=_DTYPES + (torch.float64,), ndim=(0, 1, 2, 3, 4), like=q,
               like_name="q")
        attn_bias = _broadcast_4d("attn_bias", attn_bias, shape4)
    if attn_mask is not None:
        tensor("attn_mask", attn_mask, dtypes=(torch.bool,), ndim=(0, 1, 2, 3, 4), like=q, like_name="q")
        attn_mask = _broadcast_4d("attn_mask", attn_mask, shape4)
    dropout_seed, dropout_offset = _dropout_seed(dropout_p, dropout_seed, dropout_offset)
    sinks = _sinks(sinks, Hq, q)
    descales, out_dtype = _quant(q, B, Hkv, q_descale, k_descale, v_descale, out_dtype, dropout_p,
                                 (("q", q), ("k", k), ("v", v), ("attn_bias", attn_bias), ("sinks", sinks)))
    extra = {}
    if sinks is not None or q.dtype in _QUANT_DTYPES:
        extra = dict(sinks=sinks, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                     out_dtype=out_dtype)
    chosen = lane_for(q, lane, "q")
    # The lane functions the registry names (ops.py), looked up by attribute rather than through
    # the registry's importlib, which torch.compile cannot trace.
    out, lse = getattr(_lanes, f"flash_attn_{chosen}")(
        q=q, k=k, v=v, softmax_scale=softmax_scale, window_size=(left, right),
        softcap=float(softcap), alibi_slopes=alibi_slopes, attn_bias=attn_bias, attn_mask=attn_mask,
        dropout_p=float(dropout_p), seed=dropout_seed, offset=dropout_offset, **extra,
    )
    if return_attn_probs:
        return out, lse, None
    return out


@argument_errors
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
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """:func:`flash_attn_func` on q, k and v packed in one tensor, FlashAttention-2's signature.

    Arguments:
        qkv: (B, S, 3, H, D), fp16, bf16 or fp32 (fp64 on the reference lane): q, k and v along
            dimension 2 (self-attention, as many key/value heads as query heads). The gradient is
            returned in the same layout.
        The rest (sinks, descales and out_dtype included): as :func:`flash_attn_func`.

    Returns: as :func:`flash_attn_func`, out (B, S, H, D).

    Raises:
        TypeError: qkv is not a tensor, or has an unsupported dtype.
        ValueError: qkv is not 5-D with size 3 in dimension 2; and as :func:`flash_attn_func`.
    """
    tensor("qkv", qkv, dtypes=_DTYPES + (torch.float64,) + _QUANT_DTYPES, ndim=5)
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv: expected shape (B, S, 3, H, D), got {tuple(qkv.shape)}")
    return flash_attn_func(
        qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, deterministic, return_attn_probs, attn_bias=attn_bias, attn_mask=attn_mask,
        dropout_seed=dropout_seed, dropout_offset=dropout_offset, lane=lane, sinks=sinks,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
    )


@argument_errors
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
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """:func:`flash_attn_func` with k and v packed in one tensor, FlashAttention-2's signature.

    Arguments:
        q: (B, Sq, Hq, D), fp16, bf16 or fp32.
        kv: (B, Sk, 2, Hkv, D), q's dtype: k and v along dimension 2; Hq a multiple of Hkv.
        The rest (sinks, descales and out_dtype included): as :func:`flash_attn_func`.

    Returns: as :func:`flash_attn_func`, out (B, Sq, Hq, D).

    Raises:
        TypeError: kv is not a tensor, or has an unsupported dtype or one other than q's.
        ValueError: kv is not 5-D with size 2 in dimension 2; and as :func:`flash_attn_func`.
    """
    tensor("kv", kv, dtypes=_DTYPES + (torch.float64,) + _QUANT_DTYPES, ndim=5)
    if isinstance(q, torch.Tensor) and kv.dtype != q.dtype:
        raise TypeError(f"kv: expected the dtype of q ({q.dtype}), got {kv.dtype}")
    if kv.shape[2] != 2:
        raise ValueError(f"kv: expected shape (B, Sk, 2, Hkv, D), got {tuple(kv.shape)}")
    return flash_attn_func(
        q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
        alibi_slopes, deterministic, return_attn_probs, attn_bias=attn_bias, attn_mask=attn_mask,
        dropout_seed=dropout_seed, dropout_offset=dropout_offset, lane=lane, sinks=sinks,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
    )


def _capturing() -> bool:
    """Inside a CUDA graph capture, where reading a device value back would break the capture."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _read_indices(lane: str) -> bool:
    """Whether this call reads its device-resident index values back to check them on the host
    (a device sync): in the debug mode ``LANEKIT_CHECK_INDICES=1``, and always on the reference
    lane (the float64 oracle, off the hot path, which would index out of range); never inside a
    CUDA graph capture. Otherwise the kernels mask what is out of range and record it for
    :func:`lanekit.check_errors` (DESIGN.md's hot path)."""
    return (lane == "reference" or check_indices_eagerly()) and not _capturing()


def _cu_seqlens(name: str, cu, B: int | None, q: torch.Tensor) -> int:
    """Check cumulative sequence lengths' type, shape and device: (B + 1,) int32 on q's. Returns B."""
    tensor(name, cu, dtypes=(torch.int32,), ndim=1, like=q, like_name="q")
    if cu.shape[0] < 1 or (B is not None and cu.shape[0] != B + 1):
        raise ValueError(f"{name}: expected shape ({'B + 1' if B is None else B + 1},) (B + 1 cumulative "
                         f"lengths), got {tuple(cu.shape)}")
    return cu.shape[0] - 1


def _cu_seqlens_values(name: str, vals: list[int], total: int, max_seqlen: int) -> None:
    """Check cumulative sequence lengths read back: from 0 up to ``total`` (-1: any), non-decreasing,
    no sequence longer than ``max_seqlen``."""
    lengths = [b - a for a, b in zip(vals, vals[1:])]
    if vals[0] != 0 or any(n < 0 for n in lengths) or (total >= 0 and vals[-1] != total):
        raise ValueError(f"{name}: expected non-decreasing values from 0 to {total if total >= 0 else 'the cache size'}, "
                         f"got {vals if len(vals) <= 16 else vals[:8] + ['...'] + vals[-4:]}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{name}: expected no sequence longer than its max_seqlen ({max_seqlen}), "
                         f"got one of {max(lengths)}")


@argument_errors
def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    lane: str | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """Attention over a packed batch of sequences of different lengths, FlashAttention-2's
    ``flash_attn_varlen_func`` with the same arguments.

    Sequence b holds query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and key rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v, and attends only within itself: each
    sequence is :func:`flash_attn_func` on its own, with causal, window and ALiBi positions aligned
    bottom-right by its own lengths (query i at key position i + Sk_b - Sq_b). A sequence of zero
    queries or zero keys is valid: it produces nothing, or zeros (LSE -inf), and gets zero gradients.

    Arguments:
        q: (total_q, Hq, D), fp16, bf16 or fp32 (fp64 on the reference lane). Any strides.
        k: (total_k, Hkv, D), and v: (total_k, Hkv, Dv), q's dtype and device, Hq a multiple of
            Hkv; or, with ``block_table``, a paged cache (num_blocks, page_size, Hkv, D), any
            page_size >= 1.
        cu_seqlens_q, cu_seqlens_k: (B + 1,) int32, the cumulative lengths: 0, then
            non-decreasing up to total_q (total_k; with a block table, the sequence's cached
            tokens, each at most max_pages * page_size).
        max_seqlen_q, max_seqlen_k: ints, at least every sequence's length. Bounds, not sizes:
            the grid covers no more than the tokens in q and k (a generous bound costs nothing);
            max_seqlen_k also spaces the dropout counters (below).
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic, dropout_seed,
        dropout_offset, lane: as :func:`flash_attn_func`. The dropout draw of (head h, packed
            query row r, key j) has Philox counter dropout_offset + (h * total_q + r) *
            max_seqlen_k + j.
        alibi_slopes: (Hq,) or (B, Hq) fp32.
        return_attn_probs: also return the LSE (see Returns).
        block_table: (B, max_pages) int32, the pages of sequence b's keys in order (FlashAttention
            2.6's paged varlen). Inference only: no gradient flows through a paged k or v.
        sinks, out_dtype: as :func:`flash_attn_func` (sinks (Hq,) fp32, differentiable).
        q_descale, k_descale, v_descale: (B, Hkv) fp32 for fp8/int8 q, k, v, row b for
            sequence b: as :func:`flash_attn_func` (forward only).

    Returns:
        out: (total_q, Hq, Dv) in q's dtype. With ``return_attn_probs``: ``(out, softmax_lse,
        None)``, softmax_lse (Hq, total_q) fp32 (FlashAttention's varlen layout), natural log;
        -inf for a row that sees no key.

    Masked keys' values must be finite: a NaN or inf in a V row that a query cannot see (masked
    by causal or window_size) can still make that query's output NaN (0 * NaN in P @ V), as
    in FlashAttention and PyTorch's SDPA; which masked queries do is not specified (the Triton
    lane never reads key blocks a tile sees none of). A NaN in a masked K row is harmless.
    Other sequences' keys are never read.
    (docs/semantics.md, "Non-finite values".)

    Raises:
        TypeError: a non-tensor, an unsupported dtype, cu_seqlens or block_table not int32; a
            max_seqlen not an int, a flag not a bool.
        ValueError: wrong ranks or shapes, cu_seqlens not from 0 to the total or decreasing, a
            sequence longer than its max_seqlen, a block_table too short for a sequence or naming
            a page that does not exist, and the errors of :func:`flash_attn_func`. The values of
            cu_seqlens and block_table are checked on the host only in the debug mode
            ``LANEKIT_CHECK_INDICES=1`` and on the reference lane (a device sync; never inside a
            CUDA graph capture).

    Index values (no device sync): on the Triton lane the values of cu_seqlens and block_table
    are not read back. The kernels keep every read and write in bounds: cu_seqlens are clamped
    on the device (non-decreasing within the totals; paged lengths within the table's pages), a
    page id outside [0, num_blocks) masks its keys, and each is recorded in a device-side error
    flag that :func:`lanekit.check_errors` reads and raises (a ``ValueError``, also a
    RuntimeError). Rows of a sequence whose own range was invalid are not written then
    (docs/semantics.md, "Index values"). Each error is a RuntimeError too, as in
    :func:`flash_attn_func`.

    Semantics: FlashAttention 2.7's ``flash_attn_varlen_func`` (Dao et al.); the LSE layout
    (Hq, total_q) is its own.
    """
    tensor("q", q, dtypes=_DTYPES + (torch.float64,) + _QUANT_DTYPES, ndim=3)
    tensor("k", k, ndim=4 if block_table is not None else 3, like=q, like_name="q", like_dtype=True)
    tensor("v", v, ndim=k.dim(), like=q, like_name="q", like_dtype=True)
    total_q, Hq, D = q.shape
    Hkv, Dv = k.shape[-2], v.shape[-1]
    if k.shape[-1] != D:
        raise ValueError(f"k: expected head dim {D} (that of q), got {k.shape[-1]}")
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise ValueError(f"v: expected {tuple(k.shape[:-1]) + ('Dv',)} (k's leading dimensions), got {tuple(v.shape)}")
    _check_heads(q.shape, D, Dv, Hq, Hkv)
    max_seqlen_q = int_at_least("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = int_at_least("max_seqlen_k", max_seqlen_k)
    B = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, q)
    _cu_seqlens("cu_seqlens_k", cu_seqlens_k, B, q)
    if block_table is not None:
        checks.table(block_table, q, "q", B, "one per sequence of cu_seqlens_q")
    chosen = lane_for(q, lane, "q")
    if _read_indices(chosen):  # both read back in one transfer: one device sync
        both = torch.cat((cu_seqlens_q, cu_seqlens_k)).tolist()
        _cu_seqlens_values("cu_seqlens_q", both[:B + 1], total_q, max_seqlen_q)
        _cu_seqlens_values("cu_seqlens_k", both[B + 1:], -1 if block_table is not None else k.shape[0],
                           max_seqlen_k)
        if block_table is not None:
            checks.pages(block_table, cu_seqlens_k.diff(), k.shape[0], k.shape[1])
    softmax_scale, left, right = _options(D, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                                          softcap, causal, window_size)
    flag("deterministic", deterministic)
    return_attn_probs = flag("return_attn_probs", return_attn_probs)
    alibi_slopes = _alibi(alibi_slopes, B, Hq, q)
    dropout_seed, dropout_offset = _dropout_seed(dropout_p, dropout_seed, dropout_offset)
    sinks = _sinks(sinks, Hq, q)
    descales, out_dtype = _quant(q, B, Hkv, q_descale, k_descale, v_descale, out_dtype, dropout_p,
                                 (("q", q), ("k", k), ("v", v), ("sinks", sinks)))
    extra = {}
    if sinks is not None or q.dtype in _QUANT_DTYPES:
        extra = dict(sinks=sinks, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                     out_dtype=out_dtype)

    out, lse = getattr(_lanes, f"flash_attn_varlen_{chosen}")(
        q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q.contiguous(), cu_seqlens_k=cu_seqlens_k.contiguous(),
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        block_table=block_table.contiguous() if block_table is not None else None,
        softmax_scale=softmax_scale, window_size=(left, right), softcap=float(softcap),
        alibi_slopes=alibi_slopes, dropout_p=float(dropout_p), seed=dropout_seed, offset=dropout_offset,
        **extra,
    )
    if return_attn_probs:
        return out, lse, None
    return out



@argument_errors
def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    lane: str | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """:func:`flash_attn_varlen_func` on q, k and v packed in one tensor, FlashAttention-2's
    ``flash_attn_varlen_qkvpacked_func`` with the same arguments (self-attention of each packed
    sequence on itself).

    Arguments:
        qkv: (total, 3, H, D), fp16, bf16 or fp32 (fp64 on the reference lane): q, k and v of
            every token along dimension 1, as many key/value heads as query heads. The
            gradient is returned in the same layout.
        cu_seqlens: (B + 1,) int32, the cumulative lengths, the same for queries and keys: 0, then
            non-decreasing up to total.
        max_seqlen: int, at least every sequence's length.
        The rest: as :func:`flash_attn_varlen_func` (alibi_slopes (H,) or (B, H); sinks,
            descales and out_dtype included).

    Returns: as :func:`flash_attn_varlen_func`, out (total, H, D); with ``return_attn_probs``,
    ``(out, softmax_lse, None)``, softmax_lse (H, total) fp32.

    Raises:
        TypeError: qkv is not a tensor or has an unsupported dtype; and as
            :func:`flash_attn_varlen_func`.
        ValueError: qkv is not (total, 3, H, D); and as :func:`flash_attn_varlen_func`.
        Each is a RuntimeError too (:class:`lanekit.runtime.validate.ArgumentError`).

    Semantics: FlashAttention 2.7's ``flash_attn_varlen_qkvpacked_func`` (Dao et al.).
    """
    tensor("qkv", qkv, dtypes=_DTYPES + (torch.float64,) + _QUANT_DTYPES, ndim=4)
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv: expected shape (total, 3, H, D), got {tuple(qkv.shape)}")
    return flash_attn_varlen_func(
        qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
        dropout_seed=dropout_seed, dropout_offset=dropout_offset, lane=lane, sinks=sinks,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
    )


@argument_errors
def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    lane: str | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """:func:`flash_attn_varlen_func` with k and v packed in one tensor, FlashAttention-2's
    ``flash_attn_varlen_kvpacked_func`` with the same arguments.

    Arguments:
        q: (total_q, Hq, D), fp16, bf16 or fp32 (fp64 on the reference lane).
        kv: (total_k, 2, Hkv, D), q's dtype: k and v of every key token along dimension 1; Hq a
            multiple of Hkv (MQA/GQA). The gradient is returned in the same layout.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k and the rest (sinks, descales
            and out_dtype included): as :func:`flash_attn_varlen_func`.

    Returns: as :func:`flash_attn_varlen_func`, out (total_q, Hq, D); with
    ``return_attn_probs``, ``(out, softmax_lse, None)``, softmax_lse (Hq, total_q) fp32.

    Raises:
        TypeError: kv is not a tensor, or has an unsupported dtype or one other than q's; and as
            :func:`flash_attn_varlen_func`.
        ValueError: kv not (total_k, 2, Hkv, D); and as :func:`flash_attn_varlen_func`. Each is a
            RuntimeError too (:class:`lanekit.runtime.validate.ArgumentError`).

    Semantics: FlashAttention 2.7's ``flash_attn_varlen_kvpacked_func`` (Dao et al.).
    """
    tensor("kv", kv, dtypes=_DTYPES + (torch.float64,) + _QUANT_DTYPES, ndim=4)
    if isinstance(q, torch.Tensor) and kv.dtype != q.dtype:
        raise TypeError(f"kv: expected the dtype of q ({q.dtype}), got {kv.dtype}")
    if kv.shape[1] != 2:
        raise ValueError(f"kv: expected shape (total_k, 2, Hkv, D), got {tuple(kv.shape)}")
    return flash_attn_varlen_func(
        q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
        dropout_seed=dropout_seed, dropout_offset=dropout_offset, lane=lane, sinks=sinks,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
    )


MAX_SPLITS = 128


def num_splits_heuristic(batch_programs: int, max_seqlen_k: int | None, device: torch.device,
                         block_n: int = 64, programs_per_sm: int = 1) -> int:
    """How many programs split each row's keys: the resident slots (``programs_per_sm`` a SM) over
    ``batch_programs``, rounded to the nearest integer (so the programs come nearest one wave),
    while each keeps at least four key blocks of the longest
    sequence (``max_seqlen_k``, the used length, not the cache's capacity; None inside a CUDA
    graph capture, where it cannot be read: occupancy alone decides, and the programs past a
    sequence's end exit at once). On the H200 (``benchmarks.tune_decode``, B=32, 8 KV heads, D=128,
    4k keys): the 128-key tile (one program per SM) at 4298 GB/s unsplit against at most 4163 in
    two (the two per SM this heuristic aimed at before). On 2026-12-02 (tune_decode): the 64-key
    tile (two an SM) at 4k read 4328 GB/s unsplit and 3742 in two (264 resident: 256 programs fill
    one wave, 512 start a second); with pages of 16 at 32k keys the per-key row (32 keys, 2 warps,
    4 stages), which this heuristic splits in two, 4379 in two, 3601 in three, 3192 unsplit. Since
    2026-12-03 that row is the 64-key one (tuning.FLASH_ATTN_KVCACHE_PER_KEY_PAGES), left unsplit:
    4448 GB/s, and 3793 in two."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    programs = max(batch_programs, 1)
    splits = (2 * sms * max(programs_per_sm, 1) + programs) // (2 * programs)   # rounded to nearest
    if max_seqlen_k is not None:
        splits = min(splits, max(1, -(-max_seqlen_k // block_n) // 4))
    return max(1, min(splits, MAX_SPLITS))


def kvcache_num_splits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_table: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                       max_seqlen_k: int | None = None) -> int:
    """The split count ``flash_attn_with_kvcache(..., num_splits=0)`` picks for these tensors:
    :func:`num_splits_heuristic` with the decode tile this device takes for the cache's layout.

    Arguments: q (B, Sq, Hq, D); k_cache (B_cache, S_cache, Hkv, D) or paged (num_blocks,
    page_size, Hkv, D), any dtype the cache takes; v_cache (..., Dv); block_table (B, max_pages)
    int32 or None; cache_leftpad (B,) int32 or None; max_seqlen_k the longest used length in keys
    (None: unknown, as inside a CUDA graph capture: the long-cache tile, occupancy alone), as
    ``flash_attn_with_kvcache``'s max_seqlen_k. Only shapes, dtypes and the device are read,
    never values, so nothing syncs. Returns an int in 1..MAX_SPLITS. Raises nothing of its own:
    the arguments are those ``flash_attn_with_kvcache`` has already checked.

    Source: lanekit's heuristic (FlashDecoding's split-KV, sized by occupancy as FlashAttention's
    ``num_splits_heuristic`` is)."""
    B, Sq, Hq, D = q.shape
    page_size, Hkv, Dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    block_d, block_dv = tuning.head_dim_block(D), tuning.head_dim_block(Dv)
    cfg, _ = tuning.kvcache_tile(q.device, max(block_d, block_dv), fp32=q.dtype == torch.float32,
                                 page_size=page_size, one_page=block_table is None or block_table.shape[1] == 1,
                                 leftpad=cache_leftpad is not None,
                                 max_keys=max_seqlen_k,
                                 interpreted=triton_interpreted())
    resident = tuning.resident_programs(q.device, cfg, cfg.block_n * (block_d + block_dv) * k_cache.element_size())
    rows = Sq * (Hq // Hkv)   # (query, head) rows, in the launcher's blocks of them
    m_blocks = -(-rows // tuning.kvcache_block_m(cfg, rows))
    return num_splits_heuristic(B * Hkv * max(m_blocks, 1), max_seqlen_k, q.device, cfg.block_n, resident)


@argument_errors
def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    k_cache_scale: torch.Tensor | None = None,
    v_cache_scale: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    lane: str | None = None,
    sinks: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """Attention of new queries over a KV cache, appending new keys and values to it first:
    FlashAttention-2's ``flash_attn_with_kvcache`` with the same arguments (decode, chunked
    prefill).

    Sequence b's keys are its cache positions ``cache_leftpad[b]`` (default 0) up to
    ``cache_seqlens[b]``, plus the new ``k``, ``v`` (if given), which are first rotated (k only)
    and written into the caches in place at positions cache_seqlens[b], cache_seqlens[b] + 1, ...
    Masks and ALiBi are aligned bottom-right over those keys (query i at key position
    i + Sk_b - Sq, Sk_b = cache_seqlens[b] + S_new - leftpad[b]).

    Arguments:
        q: (B, Sq, Hq, D), fp16, bf16 or fp32 (fp64 on the reference lane).
        k_cache, v_cache: (B_cache, S_cache, Hkv, D) and (..., Dv) (B_cache may be 0 with a
            batch of 0: empty results), or paged (num_blocks >= 1,
            page_size, Hkv, D) with ``block_table``, any page_size >= 1; q's dtype, or int8 /
            torch.float8_e4m3fn codes with ``k_cache_scale``/``v_cache_scale``. Written in place
            when k, v are given.
        k, v: (B, S_new, Hkv, D) and (B, S_new, Hkv, Dv), q's dtype, or None (no append). Into a
            cache of codes they are quantized per (token, head) as :func:`lanekit.kv_cache.reshape_and_cache` does.
        rotary_cos, rotary_sin: (S_ro, rotary_dim / 2), rotary_dim even and <= D: RoPE applied to
            the new k at positions cache_seqlens[b] + t and to q at cache_seqlens[b] + i when causal
            or local (else all of q at cache_seqlens[b]), FlashAttention's rule. Pairing:
            ``rotary_interleaved`` (GPT-J's (2i, 2i + 1), the default as in FlashAttention) or
            NeoX's (i, i + rotary_dim / 2).
        cache_seqlens: (B,) int32, or an int for every sequence: tokens already cached (the end
            position, leftpad included). Required with new k, v or a block_table (as in
            FlashAttention); else the default is S_cache (a full contiguous cache).
        cache_batch_idx: (B,) int32: the cache row of sequence b (contiguous caches only);
            distinct rows when k, v are appended. Default b.
        cache_leftpad: (B,) int32: the position where sequence b's keys start (left padding).
        block_table: (B, max_pages) int32, sequence b's pages in order (paged caches).
        softmax_scale, causal, window_size, softcap, alibi_slopes: as :func:`flash_attn_func`.
        num_splits: split each row's keys across this many programs and merge the partial
            results by their LSE (split-KV); 0 picks by :func:`num_splits_heuristic` from the
            used lengths (``max_seqlen_k``), never the allocated capacity. At most 128.
        return_softmax_lse: also return the LSE.
        k_cache_scale, v_cache_scale: (lanekit) the (B_cache, S_cache, Hkv) or (num_blocks,
            page_size, Hkv) fp32 scales of a cache of codes (value = code * scale); updated in
            place with the appended tokens' scales.
        max_seqlen_k: (lanekit) an int at least every sequence's key count after the append (its
            cache_seqlens[b] + S_new), or None: the cache's capacity (S_cache, or the table's
            pages times page_size). Metadata the caller knows (lengths are never read back for
            it): it picks the decode tile (attention/tuning.py: smaller tiles for short caches on
            some GPUs) and bounds num_splits=0's split count; a bound below a length costs
            speed, never correctness (checked only with LANEKIT_CHECK_INDICES=1). Pass it in
            decode loops (a serving engine's length bucket inside a CUDA graph). The tile
            orders the sums differently: outputs for two bounds differ by rounding.
        lane: as :func:`flash_attn_func`.
        sinks: (Hq,) fp32, as :func:`flash_attn_func` (added once, after the split merge).
        q_descale, k_descale, v_descale, out_dtype: an fp8 (e4m3, e5m2) or int8 q over caches
            of q's dtype (values, no per-token scales) with FlashAttention-3's (B, Hkv) fp32
            descales, as :func:`flash_attn_func`: paged or not, split or not; no append (k, v)
            and no rotary there (write the cache with :mod:`lanekit.kv_cache` first). The
            per-token-scaled int8/e4m3 caches above take a 16-bit q.

    Returns:
        out (B, Sq, Hq, Dv) in q's dtype; with ``return_softmax_lse``, ``(out, softmax_lse)``,
        softmax_lse (B, Hq, Sq) fp32 natural log, -inf for a row that sees no key. The same for
        every num_splits up to rounding. Forward only, as FlashAttention's: the output carries no
        autograd graph (train through :func:`flash_attn_func` or :func:`flash_attn_varlen_func`).

    Masked keys' values must be finite: a NaN or inf in a V row that a query cannot see (masked
    by causal or window_size) can still make that query's output NaN (0 * NaN in P @ V), as
    in FlashAttention and PyTorch's SDPA; which masked queries do is not specified (the Triton
    lane never reads key blocks a tile sees none of). A NaN in a masked K row is harmless.
    Cache positions past cache_seqlens[b] (after the append) are never read.
    (docs/semantics.md, "Non-finite values".)

    Raises:
        TypeError: a non-tensor, an unsupported dtype, index tensors not int32, a num_splits,
            max_seqlen_k or cache_seqlens of another type (an int: Python's, NumPy's or a 0-d
            tensor), a flag (causal, rotary_interleaved, return_softmax_lse) not a bool.
        ValueError: wrong shapes; cache_seqlens, cache_leftpad or a new token past the cache's
            capacity (S_cache; for a paged cache, block_table's pages: named block_table) or
            negative; cache_seqlens None with k, v; leftpad past cache_seqlens; a page that does
            not exist; repeated cache_batch_idx rows with an append; with an append, a paged
            slot written twice or where a sequence's cached token lies (a page shared beyond
            its cached tokens), a cache (or scale) whose elements share memory (an expanded
            view) or that overlaps q, k or v, or that requires grad in grad mode (the append is
            not differentiable) or is an inference tensor outside inference mode, and two of the written tensors (caches, scales)
            starting at the same element (one tensor passed for both); rotary
            positions past S_ro; scales missing or superfluous; num_splits outside 0..128;
            max_seqlen_k negative (or, checked, below a sequence's key count); and the errors
            of :func:`flash_attn_func`. The errors about index values (lengths, left padding,
            rows, pages, slots, rotary positions, max_seqlen_k against the lengths) are raised
            here only in the debug mode ``LANEKIT_CHECK_INDICES=1`` and on the reference lane
            (one device sync; never inside a CUDA graph capture). Nothing is written when an
            argument is rejected. Each error is a RuntimeError too, as in :func:`flash_attn_func`
            (FlashAttention raises RuntimeError for a block_table too narrow for cache_seqlens).

    Index values (no device sync): on the Triton lane cache_seqlens, cache_leftpad,
    cache_batch_idx and block_table are not read back. The kernels keep every read and write in
    bounds: a sequence whose length, left padding or row is out of range reads no key (its rows
    come out 0, LSE -inf) and appends nothing, a page id outside [0, num_blocks) masks its keys,
    a rotary position past S_ro rotates by nothing (its rotated features come out 0), and each
    is recorded in a device-side error flag that :func:`lanekit.check_errors` reads and raises.
    Appends that collide (two sequences' new tokens in one slot, or over another sequence's
    cached token) are the caller's to avoid, as in vLLM and FlashAttention: only the debug mode
    finds them.

    Semantics: FlashAttention 2.7's ``flash_attn_with_kvcache`` (Dao et al.); beyond it: any
    page_size, paged caches with num_splits and with cache_leftpad, quantized caches.
    """
    if isinstance(q, torch.Tensor) and q.dtype in _QUANT_DTYPES:
        S_new = _kvcache_quant_tensors(q, k_cache, v_cache, k, v, k_cache_scale, v_cache_scale, rotary_cos,
                                       rotary_sin, block_table is not None)
    else:
        S_new = _kvcache_tensors(q, k_cache, v_cache, k, v, k_cache_scale, v_cache_scale, block_table is not None)
    cache_seqlens, capacity = _kvcache_indices(q, k_cache, S_new, cache_seqlens, cache_batch_idx,
                                               cache_leftpad, block_table)
    S_ro = _kvcache_rotary(q, rotary_cos, rotary_sin, rotary_interleaved)
    rotary_interleaved = bool(rotary_interleaved)
    num_splits = _split_count(num_splits)
    B, Sq, Hq, D = q.shape
    softmax_scale, left, right = _options(D, Sq, capacity, 0.0, softmax_scale, softcap, causal, window_size)
    return_softmax_lse = flag("return_softmax_lse", return_softmax_lse)
    alibi_slopes = _alibi(alibi_slopes, B, Hq, q)
    sinks = _sinks(sinks, Hq, q)
    descales, out_dtype = _quant(q, B, k_cache.shape[2], q_descale, k_descale, v_descale, out_dtype, 0.0)
    extra = {}
    if sinks is not None or q.dtype in _QUANT_DTYPES:
        extra = dict(sinks=sinks, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                     out_dtype=out_dtype)

    chosen = lane_for(q, lane, "q")
    max_used = None
    if _read_indices(chosen):
        max_used = _check_cache_values(cache_seqlens, cache_leftpad, cache_batch_idx, block_table, S_new,
                                       capacity, k_cache.shape[0], k_cache.shape[1], Sq, S_ro,
                                       left >= 0 or right >= 0)
    bound = _key_bound(max_seqlen_k, max_used, capacity)
    if num_splits == 0:
        num_splits = kvcache_num_splits(q, k_cache, v_cache, block_table, cache_leftpad, bound)

    # the kernels index these as packed vectors and rows: a strided view is read as its copy
    cache_seqlens = cache_seqlens.contiguous()
    cache_leftpad = cache_leftpad.contiguous() if cache_leftpad is not None else None
    block_table = block_table.contiguous() if block_table is not None else None
    impl = _lanes.flash_attn_with_kvcache_inplace if chosen == "triton" else _lanes.flash_attn_with_kvcache_reference_inplace
    out, lse = impl(
        q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k=k, v=v,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
        k_cache_scale=k_cache_scale, v_cache_scale=v_cache_scale, softmax_scale=softmax_scale,
        window_size=(left, right), softcap=float(softcap), alibi_slopes=alibi_slopes, num_splits=num_splits,
        max_seqlen_k=bound, **extra,
    )
    return (out, lse) if return_softmax_lse else out


# ---- flash_attn_with_kvcache's checks, in the order it runs them ----

def _kvcache_tensors(q, k_cache, v_cache, k, v, k_cache_scale, v_cache_scale, paged: bool) -> int:
    """q, the caches (the KV-cache ops' own checks: v_cache like k_cache, non-empty but for a
    contiguous cache's rows, the scales of a codes cache) and the new k, v; an append writes the
    caches (and their scales) in place, each element once, into no input, none that autograd
    would track. Returns S_new (0 without k, v)."""
    tensor("q", q, dtypes=_DTYPES + (torch.float64,), ndim=4)
    tensor("k_cache", k_cache, dtypes=(q.dtype,) + checks.CODE_DTYPES, ndim=4, like=q, like_name="q")
    B, Sq, Hq, D = q.shape
    checks.caches(k_cache, v_cache, k_cache_scale, v_cache_scale, float64=q.dtype == torch.float64, paged=paged)
    Hkv, Dv = k_cache.shape[2], v_cache.shape[3]
    if k_cache.shape[3] != D:
        raise ValueError(f"k_cache: expected head dim {D} (that of q), got {k_cache.shape[3]}")
    _check_heads(q.shape, D, Dv, Hq, Hkv, "k_cache")
    if (k is None) != (v is None):
        raise ValueError(f"k, v: expected both or neither, got k={'a tensor' if k is not None else None}, "
                         f"v={'a tensor' if v is not None else None}")
    if k is None:
        return 0
    tensor("k", k, dtypes=(q.dtype,), ndim=4)
    tensor("v", v, dtypes=(q.dtype,), ndim=4)
    S_new = k.shape[1]
    for name, t, d in (("k", k, D), ("v", v, Dv)):
        if tuple(t.shape) != (B, S_new, Hkv, d) or t.device != q.device:
            raise ValueError(f"{name}: expected shape ({B}, S_new, {Hkv}, {d}) on {q.device} (q's batch, "
                             f"the cache's heads and head dim), got {tuple(t.shape)} on {t.device}")
    if S_new:
        written = (("k_cache", k_cache), ("v_cache", v_cache), ("k_cache_scale", k_cache_scale),
                   ("v_cache_scale", v_cache_scale))
        check_outputs(written, q, k, v)
        for name, t in written:
            if t is not None:
                check_inplace(name, t, "the append of k, v", differentiable=False)
    return S_new


def _kvcache_quant_tensors(q, k_cache, v_cache, k, v, k_cache_scale, v_cache_scale, rotary_cos, rotary_sin,
                           paged: bool) -> int:
    """An fp8/int8 q (FlashAttention-3's fp8 decode): caches of q's dtype holding values (no
    per-token scales), no append, no rotary. Returns S_new (0)."""
    tensor("q", q, ndim=4)
    tensor("k_cache", k_cache, ndim=4, like=q, like_name="q", like_dtype=True)
    tensor("v_cache", v_cache, ndim=4, like=q, like_name="q", like_dtype=True)
    blocks, page_size, Hkv, D = k_cache.shape
    if tuple(v_cache.shape[:3]) != (blocks, page_size, Hkv):
        raise ValueError(f"v_cache: expected (num_blocks, page_size, Hkv, Dv) = ({blocks}, {page_size}, {Hkv}, Dv) "
                         f"as k_cache's, got {tuple(v_cache.shape)}")
    if (blocks == 0 and paged) or page_size * Hkv == 0:
        raise ValueError(f"k_cache: expected num_blocks, page_size and Hkv >= 1, got {tuple(k_cache.shape)}")
    for name, t in (("k_cache_scale", k_cache_scale), ("v_cache_scale", v_cache_scale), ("k", k), ("v", v),
                    ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if t is not None:
            raise ValueError(f"{name}: expected None with a {q.dtype} q (fp8/int8 attention reads caches of "
                             f"q's dtype through q/k/v_descale; append and rotate with lanekit.kv_cache "
                             f"first), got a tensor")
    if k_cache.shape[3] != q.shape[3]:
        raise ValueError(f"k_cache: expected head dim {q.shape[3]} (that of q), got {k_cache.shape[3]}")
    _check_heads(q.shape, q.shape[3], v_cache.shape[3], q.shape[2], Hkv, "k_cache")
    return 0


def _kvcache_indices(q, k_cache, S_new: int, cache_seqlens, cache_batch_idx, cache_leftpad,
                     block_table) -> tuple[torch.Tensor, int]:
    """The index arguments' types and shapes (their values: _check_cache_values): block_table or
    cache_batch_idx, cache_seqlens (an int is checked here and becomes a (B,) tensor), cache_leftpad.
    Returns (cache_seqlens, capacity): the tokens a sequence can hold, S_cache or, paged, the
    table's pages of S_cache."""
    B = q.shape[0]
    n_rows, S_cache = k_cache.shape[:2]
    paged = block_table is not None
    if paged:
        checks.table(block_table, q, "q", B, "one per sequence of q")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: expected None with a block_table (the table names "
                             "each sequence's pages), got a tensor")
        capacity = block_table.shape[1] * S_cache
    else:
        capacity = S_cache
        if cache_batch_idx is not None:
            checks.index_vector("cache_batch_idx", cache_batch_idx, B, "one per sequence of q", q, "q")
        elif n_rows != B:
            raise ValueError(f"k_cache: expected {B} rows (q's batch) without cache_batch_idx, got {n_rows}")
    if cache_seqlens is None:
        if paged or S_new:
            raise ValueError("cache_seqlens: expected a (B,) int32 tensor or an int "
                             f"{'with a block_table' if paged else 'with new k, v (where they go)'}, got None")
        cache_seqlens = S_cache
    if is_int(cache_seqlens):
        cache_seqlens = int(cache_seqlens)
        if paged:
            checks.table_width(cache_seqlens + S_new, S_cache, block_table.shape[1])
        if not 0 <= cache_seqlens <= capacity - S_new:
            raise ValueError(f"cache_seqlens: expected 0..{capacity - S_new} (capacity {capacity} less "
                             f"{S_new} new tokens), got {cache_seqlens}")
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, torch.Tensor):
        checks.index_vector("cache_seqlens", cache_seqlens, B, "one per sequence of q", q, "q")
    else:
        raise TypeError(f"cache_seqlens: expected a (B,) int32 tensor, an int or None, got "
                        f"{type(cache_seqlens).__name__}")
    if cache_leftpad is not None:
        checks.index_vector("cache_leftpad", cache_leftpad, B, "one per sequence of q", q, "q")
    return cache_seqlens, capacity


def _kvcache_rotary(q, rotary_cos, rotary_sin, rotary_interleaved) -> int | None:
    """rotary_cos and rotary_sin: both or neither, (S_ro, rotary_dim / 2) on q's device with
    rotary_dim in 2..D; rotary_interleaved a bool. Returns S_ro (None without rotary)."""
    D = q.shape[3]
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos, rotary_sin: expected both or neither")
    if rotary_cos is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            tensor(name, t, dtypes=_DTYPES + (torch.float64,), ndim=2)
            if t.device != q.device or tuple(t.shape) != tuple(rotary_cos.shape):
                raise ValueError(f"{name}: expected (S_ro, rotary_dim / 2) on {q.device} as rotary_cos, "
                                 f"got {tuple(t.shape)} on {t.device}")
        rotary_dim = 2 * rotary_cos.shape[1]
        if not 0 < rotary_dim <= D:
            raise ValueError(f"rotary_cos: expected rotary_dim = 2 * shape[1] in 2..{D} (the head dim), got {rotary_dim}")
    flag("rotary_interleaved", rotary_interleaved)
    return rotary_cos.shape[0] if rotary_cos is not None else None


def _split_count(num_splits) -> int:
    """num_splits: an int in 0..MAX_SPLITS (0: the heuristic picks)."""
    return int_in("num_splits", num_splits, 0, MAX_SPLITS, " (0: a heuristic)")


def _check_cache_values(cache_seqlens, cache_leftpad, cache_batch_idx, block_table, S_new, capacity,
                        n_rows, page_size, Sq, S_ro, bounded) -> int:
    """The index values (cache_seqlens, cache_leftpad and cache_batch_idx read back once; the
    table's pages and slots checked on its device): lengths within the capacity, left padding
    within the length, existing rows and pages, appended tokens in slots of their own, rotary
    positions within cos/sin. Returns the longest sequence's key count after the append (the used
    length)."""
    seqlens = cache_seqlens.cpu().to(torch.int64)
    ends = seqlens + S_new
    # (a paged cache's capacity is its table's width: checks.pages names block_table)
    checks.lengths(seqlens, S_new, capacity if block_table is None else None)
    starts = torch.zeros_like(seqlens)
    if cache_leftpad is not None:
        starts = cache_leftpad.cpu().to(torch.int64)
        if starts.numel() and (bool((starts < 0).any()) or bool((starts > seqlens).any())):
            raise ValueError(f"cache_leftpad: expected 0 <= cache_leftpad <= cache_seqlens, got "
                             f"{starts.tolist()[:16]} for cache_seqlens {seqlens.tolist()[:16]}")
    if cache_batch_idx is not None:
        rows = cache_batch_idx.cpu()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n_rows):
            raise ValueError(f"cache_batch_idx: expected rows in [0, {n_rows}), got {rows.tolist()[:16]}")
        if S_new and rows.unique().numel() != rows.numel():
            raise ValueError("cache_batch_idx: expected distinct rows when k, v are appended (two "
                             f"sequences would write one row), got {rows.tolist()[:16]}")
    if block_table is not None:
        checks.pages(block_table, ends, n_rows, page_size)
        if S_new and seqlens.numel():
            checks.appended_slots(block_table, seqlens, S_new, page_size)
    if S_ro is not None:
        top = int((seqlens + max(S_new, Sq if bounded else 1)).max()) if seqlens.numel() else 0
        if top > S_ro:
            raise ValueError(f"rotary_cos: expected rows for positions up to {top - 1} (cache_seqlens plus "
                             f"the new tokens), got {S_ro} rows")
    return int((ends - starts).max()) if ends.numel() else 0


def _key_bound(max_seqlen_k, max_used: int | None, capacity: int) -> int:
    """max_seqlen_k checked (an int, at least the used length when it was read); returns the bound
    that picks the decode tile and the split count: max_seqlen_k, else the cache's capacity
    (metadata: never a length read back, so the choice is the same with and without
    LANEKIT_CHECK_INDICES)."""
    if max_seqlen_k is None:
        return capacity
    if not is_int(max_seqlen_k):
        raise TypeError(f"max_seqlen_k: expected an int or None, got {type(max_seqlen_k).__name__}")
    max_seqlen_k = int(max_seqlen_k)
    if max_seqlen_k < 0 or (max_used is not None and max_seqlen_k < max_used):
        raise ValueError(f"max_seqlen_k: expected at least every sequence's key count after the append "
                         f"({max_used if max_used is not None else 0}), got {max_seqlen_k}")
    return max_seqlen_k
