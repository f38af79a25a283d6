"""Public fused layers: validated, dispatched to a lane, differentiable (except the quantizer)."""

from __future__ import annotations

import math

import torch

from lanekit.layers import op as _lanes
from lanekit.runtime.errors import check_indices_eagerly as _check_indices_eagerly
from lanekit.runtime.lanes import select_lane as _select_lane
from lanekit.runtime.validate import (check_inplace as _check_inplace, check_writable as _check_writable,
                                      flag as _flag, int_at_least as _int_at_least, is_int as _is_int,
                                      lane_for as _lane, real as _real, shape as _shape, tensor as _tensor)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_WITH_F64 = _DTYPES + (torch.float64,)   # float64 runs on the reference lane only
_QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def _eps(eps) -> float:
    return _real("eps", eps, "a finite number >= 0", lambda e: e >= 0 and math.isfinite(e))


def _x_and_residual(x, residual):
    _tensor("x", x, dtypes=_WITH_F64)
    if x.dim() == 0:
        raise ValueError("x: expected at least 1 dimension (..., N), got a 0-d tensor")
    if residual is not None:
        _tensor("residual", residual, dtypes=(x.dtype,), like=x)
        _shape("residual", residual, x.shape, "x's shape")


def _feature_param(name, t, x, what="(N,), x's last dim"):
    if t is not None:
        _tensor(name, t, dtypes=_WITH_F64, like=x)
        _shape(name, t, (x.shape[-1],), what)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6,
             residual: torch.Tensor | None = None, offset: float = 0.0, *, lane: str | None = None):
    """RMSNorm over the last dim, optionally fused with the residual add before it.

    ``y = h / sqrt(mean(h^2) + eps) * (offset + weight)``, with h = x, or h = x + residual. All in
    fp32, rounded once to x's dtype. Right wherever the output is representable: a row whose
    fp32 sum of squares would over- or underflow (|h| past about 1e19, or tiny) is normalized as
    h * 2^k, exactly (docs/semantics.md, "Non-finite values": norms at fp32's ends).

    Arguments:
        x: (..., N), fp16, bf16 or fp32 (fp64 on the reference lane). Any strides; any N the GPU
            can hold (rows wider than a tile are walked in blocks, so 65536 features work).
        weight: (N,), any float dtype, or None for no scaling.
        eps: added to the mean square, >= 0.
        residual: (..., N) like x, or None. With it, the sum h = x + residual is normalized and
            also returned (in x's dtype), the fused add-and-norm between transformer blocks.
        offset: added to weight: 0.0 (Llama) or 1.0 (Gemma, whose weights are stored minus one).
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        y (..., N) in x's dtype; with residual, (y, h).

    Differentiable in x, weight and residual (the gradient of h flows back too).

    Raises:
        TypeError: a non-tensor or an unsupported dtype; residual of another dtype.
        ValueError: weight not (N,), residual not x's shape, tensors on different devices, eps
            negative or not finite, an unknown lane.

    Source: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019), as in Llama; the
    offset form as Gemma's; the fused residual as vLLM's ``fused_add_rms_norm``.
    """
    _x_and_residual(x, residual)
    _feature_param("weight", weight, x)
    eps = _eps(eps)
    offset = _real("offset", offset, "a finite number")
    chosen = _lane(x, lane)
    return getattr(_lanes, f"rms_norm_{chosen}")(x=x, weight=weight, eps=eps, residual=residual,
                                                 offset=offset)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float = 1e-5, residual: torch.Tensor | None = None, *, lane: str | None = None):
    """LayerNorm over the last dim, optionally fused with the residual add before it.

    ``y = (h - mean(h)) / sqrt(var(h) + eps) * weight + bias`` (biased variance), h = x or
    x + residual; fp32 inside, rounded once to x's dtype. As :func:`rms_norm`, right at fp32's
    ends.

    Arguments:
        x: (..., N), fp16, bf16 or fp32 (fp64 on the reference lane), any strides.
        weight, bias: (N,) or None.
        eps: added to the variance, >= 0.
        residual: (..., N) like x, or None; with it, h is also returned.
        lane: as in :func:`rms_norm`.

    Returns:
        y (..., N) in x's dtype; with residual, (y, h). Differentiable in every tensor input.

    Raises:
        TypeError / ValueError: as :func:`rms_norm`.

    Source: ``torch.nn.functional.layer_norm(x, (N,), weight, bias, eps)``.
    """
    _x_and_residual(x, residual)
    _feature_param("weight", weight, x)
    _feature_param("bias", bias, x)
    eps = _eps(eps)
    chosen = _lane(x, lane)
    return getattr(_lanes, f"layer_norm_{chosen}")(x=x, weight=weight, bias=bias, eps=eps,
                                                   residual=residual)


def adaln(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
          gate: torch.Tensor | None = None, eps: float = 1e-6,
          residual: torch.Tensor | None = None, *, lane: str | None = None):
    """Adaptive LayerNorm (DiT's adaLN): ``y = LayerNorm(h) * (1 + scale) + shift``.

    The LayerNorm has no weights of its own. With a residual, h = residual + gate * x (gate 1 when
    None) is the gated residual add that ends one DiT block (``x = x + gate * block(x)``), fused
    with the next block's modulated norm, and h is also returned. As :func:`rms_norm`, right at
    fp32's ends.

    Arguments:
        x: (B, S, N) or (rows, N), fp16, bf16 or fp32 (fp64 on the reference lane).
        scale, shift: (B, N), one row per batch entry broadcast over its S tokens (x 3-d), or
            (rows, N), one per row of x (x 2-d); x's dtype or fp32.
        gate: like scale, or None. Needs residual.
        eps: added to the variance, >= 0.
        residual: like x, or None.
        lane: as in :func:`rms_norm`.

    Returns:
        y like x; with residual, (y, h). Differentiable in every tensor input.

    Raises:
        TypeError: a non-tensor or an unsupported dtype.
        ValueError: x not 2-d or 3-d, scale/shift/gate of the wrong shape, gate without residual,
            tensors on different devices, eps negative.

    Source: Peebles & Xie, "Scalable Diffusion Models with Transformers" (DiT, 2023), adaLN-Zero.
    """
    _x_and_residual(x, residual)
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected (B, S, N) or (rows, N), got shape {tuple(x.shape)}")
    mod_shape = (x.shape[0], x.shape[-1])
    what = "(B, N)" if x.dim() == 3 else "(rows, N)"
    for name, t in (("scale", scale), ("shift", shift), ("gate", gate)):
        if t is None and name != "gate":
            raise TypeError(f"{name}: expected a torch.Tensor, got None")
        if t is not None:
            _tensor(name, t, dtypes=_WITH_F64, like=x)
            _shape(name, t, mod_shape, what)
    if gate is not None and residual is None:
        raise ValueError("gate: the gated form adds gate * x to a residual; pass residual= too")
    eps = _eps(eps)
    chosen = _lane(x, lane)
    return getattr(_lanes, f"adaln_{chosen}")(x=x, scale=scale, shift=shift, gate=gate, eps=eps,
                                              residual=residual)


def _rotary_common(name, x, cos, sin, rotary_dim, position_ids, seqlen_offsets, *, tail=False, read=True):
    """Validate RoPE's cos/sin/rotary_dim/positions for x (B, S, H, D) or (T, H, D);
    returns rotary_dim. ``read``: check position_ids' values too (a device sync); without it the
    kernel masks and records a position outside cos's rows (rotary.BAD_POSITION)."""
    D = x.shape[-1]
    for n, t in (("cos", cos), ("sin", sin)):
        _tensor(n, t, dtypes=_WITH_F64, ndim=2, like=x)
    if cos.shape != sin.shape:
        raise ValueError(f"sin: expected cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if rotary_dim is None:
        rotary_dim = 2 * cos.shape[1]
    if not _is_int(rotary_dim):
        raise TypeError(f"rotary_dim: expected an even int in [2, {D}] ({name}'s head dim), got "
                        f"{type(rotary_dim).__name__}")
    rotary_dim = int(rotary_dim)
    if not (0 < rotary_dim <= D and rotary_dim % 2 == 0):
        raise ValueError(f"rotary_dim: expected an even int in [2, {D}] ({name}'s head dim), got {rotary_dim!r}")
    if cos.shape[1] != rotary_dim // 2:
        raise ValueError(f"cos: expected (S_ro, rotary_dim / 2) = (S_ro, {rotary_dim // 2}), got {tuple(cos.shape)}")
    if position_ids is not None:
        _tensor("position_ids", position_ids, dtypes=(torch.int32, torch.int64), like=x)
        tokens = tuple(x.shape[:-2])
        if tuple(position_ids.shape) != tokens and not (
                position_ids.dim() == 2 and len(tokens) == 2 and position_ids.shape[0] == 1
                and position_ids.shape[1] == tokens[1]):
            raise ValueError(f"position_ids: expected shape {tokens} (one position per token) or "
                             f"(1, S), got {tuple(position_ids.shape)}")
        if read and position_ids.numel() and (int(position_ids.min()) < 0 or int(position_ids.max()) >= cos.shape[0]):
            raise ValueError(f"position_ids: expected values in [0, {cos.shape[0]}) (cos's rows), got "
                             f"[{int(position_ids.min())}, {int(position_ids.max())}]")
        position_ids = position_ids.expand(tokens)
    if _is_int(seqlen_offsets):
        seqlen_offsets = _int_at_least("seqlen_offsets", seqlen_offsets, 0, " (or a (B,) int tensor)")
    elif isinstance(seqlen_offsets, torch.Tensor):
        _tensor("seqlen_offsets", seqlen_offsets, dtypes=(torch.int32, torch.int64), ndim=1, like=x)
    else:
        raise TypeError(f"seqlen_offsets: expected an int >= 0 or a (B,) int tensor, got "
                        f"{type(seqlen_offsets).__name__}")
    if position_ids is not None and (isinstance(seqlen_offsets, torch.Tensor) or seqlen_offsets != 0):
        raise ValueError("seqlen_offsets: position_ids give every position already; pass one or the other")
    if isinstance(seqlen_offsets, torch.Tensor):
        seqlen_offsets = seqlen_offsets.contiguous()  # the kernels read it as a packed vector
    return rotary_dim, position_ids, seqlen_offsets


def _check_rope_range(S, cos, seqlen_offsets, position_ids, read=True):
    """Positions s + offset must index a row of cos: checked here, never read out of bounds.
    ``read`` False: an offsets tensor's values are left to the kernel (no device sync)."""
    if position_ids is not None or S == 0:
        return
    if not read and isinstance(seqlen_offsets, torch.Tensor):
        return
    top = (int(seqlen_offsets.max()) if isinstance(seqlen_offsets, torch.Tensor) and seqlen_offsets.numel()
           else seqlen_offsets if isinstance(seqlen_offsets, int) else 0)
    if isinstance(seqlen_offsets, torch.Tensor) and seqlen_offsets.numel() and int(seqlen_offsets.min()) < 0:
        raise ValueError(f"seqlen_offsets: expected values >= 0, got {int(seqlen_offsets.min())}")
    if S + top > cos.shape[0]:
        raise ValueError(f"cos: expected at least {S + top} rows (sequence length {S} + offset {top}), "
                         f"got {cos.shape[0]}")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                 rotary_dim: int | None = None, position_ids: torch.Tensor | None = None,
                 inplace: bool = False, *, cu_seqlens: torch.Tensor | None = None,
                 max_seqlen: int | None = None, seqlen_offsets: int | torch.Tensor = 0,
                 lane: str | None = None) -> torch.Tensor:
    """Rotary position embedding (RoPE) of x's first ``rotary_dim`` features; the rest pass through.

    Pair i of features is rotated by the angle whose cos and sin are row p (the token's position)
    of ``cos``/``sin``: (a, b) -> (a cos - b sin, b cos + a sin). Pairing: GPT-NeoX's half split
    (i, i + rotary_dim / 2) by default (Llama, Mistral, Qwen), GPT-J's (2i, 2i + 1) with
    ``interleaved=True``.

    Arguments:
        x: (B, S, H, D), or packed (T, H, D) with ``cu_seqlens`` or ``position_ids``; fp16, bf16
            or fp32 (fp64 on the reference lane). Any strides.
        cos, sin: (S_ro, rotary_dim / 2), any float dtype, on x's device (FlashAttention's
            ``apply_rotary_emb`` layout). Row p covers position p.
        interleaved: the pairing, above.
        rotary_dim: features rotated, even, at most D; default ``2 * cos.shape[1]``.
        position_ids: int32/int64 positions, (B, S) or (1, S) for 4-d x, (T,) for packed x;
            default: the token's index in its sequence plus ``seqlen_offsets``. Positions that
            live on the device (position_ids, a seqlen_offsets tensor) are not read back (no
            device sync) unless ``LANEKIT_CHECK_INDICES=1`` or on the reference lane: the kernel
            writes 0 for the rotated features of a position outside cos's rows and records it
            for :func:`lanekit.check_errors`.
        inplace: write into x (and return it). Differentiable too, where autograd allows writing x
            in place (not a leaf that requires grad, nor a view of one, as PyTorch's own in-place
            ops).
        cu_seqlens: (B + 1,) int32 cumulative sequence lengths of packed x (FlashAttention's
            varlen layout); each sequence's positions start at 0 (+ seqlen_offsets).
        max_seqlen: the longest sequence in cu_seqlens; computed from it (a device sync) if None.
        seqlen_offsets: int, or (B,) int tensor, added to every position (decode with a cache).
        lane: as in :func:`rms_norm`.

    Returns:
        (x's shape) in x's dtype. Differentiable in x (the backward rotates back); not in cos/sin.

    Raises:
        TypeError: a non-tensor, an unsupported dtype; interleaved or inplace not a bool;
            rotary_dim, max_seqlen or seqlen_offsets not an int.
        ValueError: x not 3-d or 4-d; cos/sin of the wrong shape or too few rows for the positions
            used; rotary_dim odd, non-positive or over D; position_ids or cu_seqlens malformed;
            with inplace=True, an x that autograd refuses to see written in place (a leaf that
            requires grad, a view of one, a view made under no_grad or by unbind/split, an
            inference tensor outside inference mode): said before anything runs, x unchanged.

    Source: Su et al., "RoFormer" (2021); conventions of FlashAttention's ``apply_rotary_emb``.
    """
    _tensor("x", x, dtypes=_WITH_F64, ndim=(3, 4))
    # positions from the device are checked by the kernel (masked, recorded for check_errors),
    # on the host only in the debug mode or on the reference lane
    selected = _select_lane(x.device, lane)
    read = selected == "reference" or _check_indices_eagerly()
    rotary_dim, position_ids, seqlen_offsets = _rotary_common("x", x, cos, sin, rotary_dim, position_ids,
                                                              seqlen_offsets, read=read)
    if x.dim() == 3 and cu_seqlens is None and position_ids is None:
        raise ValueError("x: a packed (T, H, D) input needs cu_seqlens or position_ids")
    if cu_seqlens is not None:
        if x.dim() != 3:
            raise ValueError(f"cu_seqlens: expected with a packed (T, H, D) x, got x of shape {tuple(x.shape)}")
        _tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32,), ndim=1, like=x)
        lengths = cu_seqlens.diff()
        if cu_seqlens.numel() < 1 or int(cu_seqlens[0]) != 0 or (lengths < 0).any() or int(cu_seqlens[-1]) != x.shape[0]:
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T={x.shape[0]}, got "
                             f"{cu_seqlens.tolist() if cu_seqlens.numel() <= 16 else tuple(cu_seqlens.shape)}")
        longest = int(lengths.max()) if lengths.numel() else 0
        if max_seqlen is None:
            max_seqlen = longest
        else:
            max_seqlen = _int_at_least("max_seqlen", max_seqlen, longest, " (the longest sequence)")
        if isinstance(seqlen_offsets, torch.Tensor) and seqlen_offsets.shape[0] != cu_seqlens.shape[0] - 1:
            raise ValueError(f"seqlen_offsets: expected ({cu_seqlens.shape[0] - 1},), got {tuple(seqlen_offsets.shape)}")
        _check_rope_range(max_seqlen, cos, seqlen_offsets, position_ids, read)
    else:
        if max_seqlen is not None:
            raise ValueError("max_seqlen: expected only with cu_seqlens (packed sequences), got "
                             f"{max_seqlen!r} without")
        if isinstance(seqlen_offsets, torch.Tensor) and x.dim() == 4 and seqlen_offsets.shape[0] != x.shape[0]:
            raise ValueError(f"seqlen_offsets: expected ({x.shape[0]},), got {tuple(seqlen_offsets.shape)}")
        _check_rope_range(x.shape[1] if x.dim() == 4 else x.shape[0], cos, seqlen_offsets, position_ids, read)
    interleaved, inplace = _flag("interleaved", interleaved), _flag("inplace", inplace)
    if inplace:
        _check_writable("x", x)
        _check_inplace("x", x, "inplace=True")
    chosen = _lane(x, lane, chosen=selected)
    return getattr(_lanes, f"apply_rotary_{chosen}")(
        x=x, cos=cos, sin=sin, interleaved=interleaved, rotary_dim=rotary_dim,
        position_ids=position_ids, cu_seqlens=cu_seqlens.contiguous() if cu_seqlens is not None else None,
        max_seqlen=max_seqlen or 0, seqlen_offsets=seqlen_offsets, inplace=inplace)


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    interleaved: bool = False, rotary_dim: int | None = None,
                    position_ids: torch.Tensor | None = None, seqlen_offsets: int | torch.Tensor = 0, *,
                    lane: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k in one launch: :func:`apply_rotary` of each, at the
    same positions (the attention block's RoPE; Liger's ``liger_rotary_pos_emb`` takes q and k
    together too).

    Arguments:
        q: (B, S, Hq, D); k: (B, S, Hkv, D) (any Hkv, GQA/MQA), q's dtype and device, same B, S
            and D; fp16, bf16 or fp32 (fp64 on the reference lane). Any strides (q and k may be
            head slices of one fused qkv buffer).
        cos, sin, interleaved, rotary_dim, position_ids ((B, S) or (1, S)), seqlen_offsets (an
            int or a (B,) tensor): as in :func:`apply_rotary`, the same for q and k. Positions
            that live on the device are not read back (no device sync) unless
            ``LANEKIT_CHECK_INDICES=1`` or on the reference lane: a position outside cos's rows
            gets 0 for its rotated features and is recorded for :func:`lanekit.check_errors`.
        lane: as in :func:`rms_norm`.

    Returns:
        (q', k') in q's dtype, new tensors (contiguous). Differentiable in q and k (the backward
        rotates both back in one launch); not in cos/sin.

    Raises:
        TypeError: a non-tensor, an unsupported dtype, k's dtype not q's; interleaved not a bool;
            rotary_dim or seqlen_offsets not an int.
        ValueError: q or k not 4-d, k's B, S or D not q's, devices that differ; and the errors of
            :func:`apply_rotary` (cos/sin shapes and rows, rotary_dim, position_ids,
            seqlen_offsets).

    Source: Su et al., "RoFormer" (2021); Llama's ``apply_rotary_pos_emb(q, k, cos, sin)``; pairs
    and layout as FlashAttention's ``apply_rotary_emb``.
    """
    _tensor("q", q, dtypes=_WITH_F64, ndim=4)
    _tensor("k", k, dtypes=(q.dtype,), ndim=4, like=q)
    if k.shape[0] != q.shape[0] or k.shape[1] != q.shape[1] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k: expected (B, S, Hkv, D) = ({q.shape[0]}, {q.shape[1]}, Hkv, {q.shape[3]}) "
                         f"as q's, got {tuple(k.shape)}")
    interleaved = _flag("interleaved", interleaved)
    selected = _select_lane(q.device, lane)
    read = selected == "reference" or _check_indices_eagerly()
    rotary_dim, position_ids, seqlen_offsets = _rotary_common("q", q, cos, sin, rotary_dim, position_ids,
                                                              seqlen_offsets, read=read)
    if isinstance(seqlen_offsets, torch.Tensor) and seqlen_offsets.shape[0] != q.shape[0]:
        raise ValueError(f"seqlen_offsets: expected ({q.shape[0]},), got {tuple(seqlen_offsets.shape)}")
    _check_rope_range(q.shape[1], cos, seqlen_offsets, position_ids, read)
    chosen = _lane(q, lane, "q", chosen=selected)
    return getattr(_lanes, f"apply_rotary_qk_{chosen}")(
        q=q, k=k, cos=cos, sin=sin, interleaved=interleaved, rotary_dim=rotary_dim,
        position_ids=position_ids, seqlen_offsets=seqlen_offsets)


def _qk_common(q, k, q_weight, k_weight, cos, sin, eps, offset, interleaved, rotary_dim,
               position_ids, seqlen_offsets, dtypes):
    _tensor("q", q, dtypes=dtypes, ndim=4)
    _tensor("k", k, dtypes=(q.dtype,), ndim=4, like=q)
    if k.shape[0] != q.shape[0] or k.shape[1] != q.shape[1] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k: expected (B, S, Hkv, D) = ({q.shape[0]}, {q.shape[1]}, Hkv, {q.shape[3]}) "
                         f"as q's, got {tuple(k.shape)}")
    _feature_param("q_weight", q_weight, q, "(D,), the head dim")
    _feature_param("k_weight", k_weight, q, "(D,), the head dim")
    _flag("interleaved", interleaved)
    rotary_dim, position_ids, seqlen_offsets = _rotary_common("q", q, cos, sin, rotary_dim, position_ids,
                                                              seqlen_offsets)
    if isinstance(seqlen_offsets, torch.Tensor) and seqlen_offsets.shape[0] != q.shape[0]:
        raise ValueError(f"seqlen_offsets: expected ({q.shape[0]},), got {tuple(seqlen_offsets.shape)}")
    _check_rope_range(q.shape[1], cos, seqlen_offsets, position_ids)
    offset = _real("offset", offset, "a finite number")
    return _eps(eps), offset, rotary_dim, position_ids, seqlen_offsets


def rms_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                  k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                  eps: float = 1e-6, offset: float = 0.0, interleaved: bool = False,
                  rotary_dim: int | None = None, position_ids: torch.Tensor | None = None,
                  seqlen_offsets: int | torch.Tensor = 0, *, lane: str | None = None):
    """QK-norm then RoPE, q and k in one launch: RMSNorm of every head vector, then rotary.

    For q and k: ``n = x / sqrt(mean(x^2) + eps) * (offset + weight)`` over D per (token, head),
    then :func:`apply_rotary` of n's first rotary_dim features (the models with QK-norm: Qwen3,
    OLMo 2, Gemma 3 with offset=1). As :func:`rms_norm`, right at fp32's ends, forward and
    backward.

    Arguments:
        q: (B, S, Hq, D); k: (B, S, Hkv, D), same dtype; fp16, bf16 or fp32 (fp64 reference lane).
        q_weight, k_weight: (D,) or None.
        cos, sin, interleaved, rotary_dim, position_ids ((B, S) or (1, S)), seqlen_offsets: as in
            :func:`apply_rotary`.
        eps, offset: as in :func:`rms_norm`.
        lane: as in :func:`rms_norm`.

    Returns:
        (q', k') in q's dtype. Differentiable in q, k and the weights.

    Raises:
        TypeError / ValueError: as :func:`apply_rotary` and :func:`rms_norm`, naming the argument.

    Source: Qwen3's ``q_norm``/``k_norm`` before ``apply_rotary_pos_emb``; Henry et al.,
    "Query-Key Normalization for Transformers" (2020).
    """
    eps, offset, rotary_dim, position_ids, seqlen_offsets = _qk_common(
        q, k, q_weight, k_weight, cos, sin, eps, offset, interleaved, rotary_dim, position_ids,
        seqlen_offsets,
        _WITH_F64)
    chosen = _lane(q, lane, "q")
    return getattr(_lanes, f"rms_norm_rope_{chosen}")(
        q=q, k=k, q_weight=q_weight, k_weight=k_weight, cos=cos, sin=sin, eps=eps, offset=offset,
        interleaved=bool(interleaved), rotary_dim=rotary_dim, position_ids=position_ids,
        seqlen_offsets=seqlen_offsets)


def qk_norm_rope_quant(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                       eps: float = 1e-6, offset: float = 0.0, interleaved: bool = False,
                       rotary_dim: int | None = None, position_ids: torch.Tensor | None = None,
                       seqlen_offsets: int | torch.Tensor = 0,
                       quant_dtype: torch.dtype = torch.float8_e4m3fn, *, lane: str | None = None):
    """QK-norm, RoPE on the last ``rotary_dim`` features, then per-(token, head) quantization.

    Per head vector x of q and k: n = RMSNorm(x) * (offset + weight); RoPE on n's *tail*
    features [D - rotary_dim, D) (as MLA-style models place their rotary part last); then
    scale = max|n| / qmax (qmax 448 for e4m3, 127 for int8; 1 for an all-zero vector) and codes =
    n / scale rounded to nearest, ties to even, clamped (int8 to [-128, 127]). Dequantize with
    codes * scale. Forward only.

    The codes are bit-exact against ``lanekit.reference.layers.qk_norm_rope_quant``, and depend on
    no sum: the norm's factor rstd, the same for a whole head vector, divides out of n / scale, so
    they are taken from u = RoPE(x * (offset + w)) as u * min(qmax / max|u|, 2^127), each step
    one correctly rounded fp32 operation in the order that oracle documents (no fused
    multiply-adds; rows whose max|u| lies at the ends of fp32's range, because of x or the
    weights, from x scaled first by a power of two that brings max|u| into [1, 2); that holds
    for cos and sin of a rotation, |cos|, |sin| <= 1, and the oracle says what happens far from
    it). They
    equal n / scale's up to where rounding ties fall. The scales carry rstd, within the project's
    "norm" tolerance (fp32, 8 steps). eps and offset are used as their nearest fp32 values. A head
    vector holding inf or NaN, or whose u overflows fp32 even so, gets a NaN scale, and every
    code of it is the NaN code 0x7F (e4m3) or 0 (int8): docs/semantics.md, "Non-finite values".

    Arguments:
        q: (B, S, Hq, D); k: (B, S, Hkv, D); fp16, bf16 or fp32.
        q_weight, k_weight: (D,) or None.
        cos, sin: (S_ro, rotary_dim / 2); rotary_dim, interleaved, position_ids, seqlen_offsets:
            as in :func:`apply_rotary`.
        quant_dtype: torch.float8_e4m3fn or torch.int8.
        lane: as in :func:`rms_norm`.

    Returns:
        (q_codes, q_scale, k_codes, k_scale): codes in quant_dtype with q's/k's shape, scales
        (B, S, H) fp32.

    Raises:
        TypeError: a non-tensor; q not fp16/bf16/fp32; quant_dtype not int8 or float8_e4m3fn.
        ValueError: as :func:`rms_norm_rope`.

    Source: the fused QK-norm + RoPE + quantization of FP8 attention in vLLM and SGLang;
    rounding as ``torch.round`` and PyTorch's float8 casts.
    """
    if quant_dtype not in _QUANT_DTYPES:
        raise TypeError(f"quant_dtype: expected torch.int8 or torch.float8_e4m3fn, got {quant_dtype!r}")
    eps, offset, rotary_dim, position_ids, seqlen_offsets = _qk_common(
        q, k, q_weight, k_weight, cos, sin, eps, offset, interleaved, rotary_dim, position_ids,
        seqlen_offsets,
        _DTYPES)
    eps32 = float(torch.tensor(eps, dtype=torch.float32))
    off32 = float(torch.tensor(offset, dtype=torch.float32))
    chosen = _lane(q, lane, "q")
    return getattr(_lanes, f"qk_norm_rope_quant_{chosen}")(
        q=q, k=k, q_weight=q_weight, k_weight=k_weight, cos=cos, sin=sin, eps=eps32, offset=off32,
        interleaved=bool(interleaved), rotary_dim=rotary_dim, position_ids=position_ids,
        seqlen_offsets=seqlen_offsets, quant_dtype=quant_dtype)


def _glu(name, gate, up, out, activation, lane):
    _tensor("gate", gate, dtypes=_WITH_F64)
    if gate.dim() == 0:
        raise ValueError("gate: expected at least 1 dimension, got a 0-d tensor")
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(f"gate: a fused (..., 2N) input needs an even last dim, got {tuple(gate.shape)}")
        out_shape = (*gate.shape[:-1], gate.shape[-1] // 2)
    else:
        _tensor("up", up, dtypes=(gate.dtype,), like=gate)
        _shape("up", up, gate.shape, "gate's shape")
        out_shape = tuple(gate.shape)
    if out is not None:
        _tensor("out", out, dtypes=(gate.dtype,), like=gate)
        _shape("out", out, out_shape, "the result's shape")
        try:
            out.view(math.prod(out.shape[:-1]), out.shape[-1])
        except RuntimeError:
            raise ValueError(f"out: expected leading dims that merge into rows without a copy, got "
                             f"strides {out.stride()}") from None
        _check_writable("out", out, gate, up)
        if torch.is_grad_enabled() and (gate.requires_grad or (up is not None and up.requires_grad)):
            raise ValueError(f"out: {name} with out= does not support autograd (as PyTorch's out= "
                             "functions); call it without out= to differentiate")
        _check_inplace("out", out, "out=", differentiable=False)
    chosen = _lane(gate, lane, "gate")
    return getattr(_lanes, f"glu_{chosen}")(gate=gate, up=up, activation=activation, out=out)


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
           lane: str | None = None) -> torch.Tensor:
    """SwiGLU's gating: ``silu(gate) * up``, silu(g) = g * sigmoid(g); fp32 inside.

    Arguments:
        gate: (..., N), fp16, bf16 or fp32 (fp64 on the reference lane), any strides. With up
            None, gate is the fused (..., 2N) output of one gate-and-up projection: its first N
            features are the gate, the last N the up (vLLM's ``silu_and_mul`` layout).
        up: (..., N) like gate, or None.
        out: (..., N) to write into, in gate's dtype; may be a non-contiguous view such as
            ``buf[:, :N]``. Not differentiable (as PyTorch's out= functions).
        lane: as in :func:`rms_norm`.

    Returns:
        (..., N) in gate's dtype. Differentiable: d(up) = dy * silu(g),
        d(gate) = dy * up * s * (1 + g * (1 - s)) with s = sigmoid(g); a fused input gets its
        gradient in the same fused layout.

    Raises:
        TypeError: a non-tensor or an unsupported dtype. ValueError: shapes that do not match,
        an odd fused width, out= with autograd (gate, up or out requiring grad in grad mode), an
        out that is an inference tensor outside inference mode.

    Source: Shazeer, "GLU Variants Improve Transformer" (2020); Llama's MLP.
    """
    return _glu("swiglu", gate, up, out, "silu", lane)


def geglu(gate: torch.Tensor, up: torch.Tensor | None = None, approximate: str = "none", *,
          out: torch.Tensor | None = None, lane: str | None = None) -> torch.Tensor:
    """GeGLU's gating: ``gelu(gate) * up``, gelu as ``torch.nn.functional.gelu(approximate=...)``:
    "none" (erf) or "tanh" (Gemma's ``gelu_pytorch_tanh``). Arguments, returns and errors as
    :func:`swiglu`; d(gate) = dy * up * gelu'(gate).

    Source: Shazeer, "GLU Variants Improve Transformer" (2020).
    """
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")
    return _glu("geglu", gate, up, out, "gelu" if approximate == "none" else "gelu_tanh", lane)
