"""Public linear-attention functions, with flash-linear-attention's (fla's) names, arguments and
layout: validated, dispatched to a lane."""

from __future__ import annotations

import torch

from lanekit.linear_attn import op as _lanes
from lanekit.runtime import errors as _errors
from lanekit.runtime.validate import flag, lane_for, real, tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ALL = _DTYPES + (torch.float64,)
MAX_HEAD_DIM_K = 256   # the chunked kernels hold a whole key row (padded to a power of two) in one tile


def _cu_seqlens(cu_seqlens, q) -> int | None:
    """Check cu_seqlens' type, shape and device (and its values where reading them costs no device
    sync, or LANEKIT_CHECK_INDICES=1 asks for it). Returns the number of sequences, or None."""
    if cu_seqlens is None:
        return None
    tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32, torch.int64), ndim=1, like=q, like_name="q")
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected shape (N + 1,) with N >= 1 sequences, got {tuple(cu_seqlens.shape)}")
    if q.shape[0] != 1:
        raise ValueError(f"q: expected batch size 1 with cu_seqlens (the sequences packed along T), got "
                         f"shape {tuple(q.shape)}")
    if cu_seqlens.device.type == "cpu" or _errors.check_indices_eagerly():
        vals = cu_seqlens.tolist()
        T = q.shape[1]
        if vals[0] != 0 or vals[-1] != T or any(b < a for a, b in zip(vals, vals[1:])):
            shown = vals if len(vals) <= 16 else vals[:8] + ["..."] + vals[-4:]
            raise ValueError(f"cu_seqlens: expected non-decreasing values from 0 to T={T} (q's length), got {shown}")
    return cu_seqlens.shape[0] - 1


def _state(name, t, q, shape, what):
    if t is None:
        return
    tensor(name, t, dtypes=_ALL, like=q, like_name="q")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({what}), got {tuple(t.shape)}")


def _validate(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, initial_z=None):
    """Check every argument before anything runs; returns (scale as a float, output_final_state)."""
    tensor("q", q, dtypes=_ALL, ndim=4)
    B, T, H, K = q.shape
    tensor("k", k, like=q, like_name="q", like_dtype=True)
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k: expected shape {tuple(q.shape)} (that of q: (B, T, H, K)), got {tuple(k.shape)}")
    tensor("v", v, like=q, like_name="q", like_dtype=True)
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v: expected shape ({B}, {T}, {H}, V) (q's B, T, H), got {tuple(v.shape)}")
    if not 1 <= K <= MAX_HEAD_DIM_K:
        raise ValueError(f"q: expected a key head dim K in [1, {MAX_HEAD_DIM_K}], got {K}")
    if v.shape[3] < 1:
        raise ValueError(f"v: expected a value head dim V >= 1, got {v.shape[3]}")
    if g is not None:
        tensor("g", g, dtypes=_ALL, like=q, like_name="q")
        if tuple(g.shape) != (B, T, H):
            raise ValueError(f"g: expected shape ({B}, {T}, {H}) ((B, T, H): one log decay per token and "
                             f"head), got {tuple(g.shape)}")
    if scale is not None:
        real("scale", scale, "a finite float or None (K ** -0.5)")
    output_final_state = flag("output_final_state", output_final_state)
    N = _cu_seqlens(cu_seqlens, q)
    N, what = (B, "(B, H, K, V)") if N is None else (N, "(N, H, K, V), one per sequence of cu_seqlens")
    _state("initial_state", initial_state, q, (N, H, K, v.shape[3]), what)
    _state("initial_state[1]", initial_z, q, (N, 1, H, K), "(N, 1, H, K): the key sum z, fla's z_state")
    return float(K ** -0.5 if scale is None else scale), output_final_state


def chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    lane: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear attention with a per-head, data-dependent scalar decay (RetNet / Lightning Attention /
    Mamba-2 style; fla's simple GLA), chunked: for prefill and training.

    Per sequence and head, with the state S (K, V): ``S_t = exp(g_t) S_{t-1} + k_t^T v_t`` and
    ``o_t = scale * q_t S_t``. The Triton lane cuts the sequence into chunks of 64 tokens: a pass
    over the chunks carries the state (fp32), then every chunk's output is computed in parallel
    (intra-chunk ``q k^T`` with a causal mask and the decays, plus ``q h`` with the carried state),
    tl.dot in the input dtype with fp32 accumulation.

    Arguments:
        q, k: (B, T, H, K), fp16, bf16 or fp32 (also fp64 on the reference lane), K <= 256. Any strides.
        v: (B, T, H, V), q's dtype.
        g: (B, T, H), the log decay of each token and head (e.g. ``F.logsigmoid(x)``), any float
            dtype (computed in fp32); None for no decay (plain linear attention).
        scale: the query scale; default ``K ** -0.5``.
        initial_state: (N, H, K, V), any float dtype: the state before the first token of each
            sequence (N = B, or the number of sequences of cu_seqlens); None for zeros.
        output_final_state: also return each sequence's state after its last token.
        cu_seqlens: (N + 1,) int32 or int64, the cumulative lengths of N sequences packed along T
            of a batch of one (B = 1), FlashAttention's varlen convention; a zero-length sequence
            passes its initial state through. Values are checked on the host where that costs
            no device sync (CPU tensors) or with LANEKIT_CHECK_INDICES=1; otherwise invalid ones
            are clamped on the device and reported by ``lanekit.check_errors()``.
        lane: "triton" or "reference"; default: triton for CUDA/ROCm tensors, reference otherwise,
            overridden by the LANEKIT_LANE environment variable.

    Returns:
        (o, final_state): o (B, T, H, V) in q's dtype; final_state (N, H, K, V) fp32, or None when
        output_final_state is False. The state hands over to :func:`fused_recurrent_simple_gla`
        (decode) and back: same layout.

    Raises:
        TypeError: a non-tensor, an unsupported dtype, k or v not of q's dtype, cu_seqlens not
            int32/int64, scale not a number, output_final_state not a bool, fp64 off the
            reference lane.
        ValueError: a wrong rank or shape (each error names the argument, the expected shape and
            where its sizes come from), K > 256, a device other than q's, B != 1 with cu_seqlens,
            cu_seqlens values (checked where said above), an unknown lane.

    Gradients: differentiable in q, k, v, g and initial_state (a Triton backward: the state pass
    again, the state gradients in reverse, dq, dk, dv per chunk, and dg as a reverse cumulative
    sum of ``q_t . dq_t - k_t . dk_t``). Works under ``torch.compile(fullgraph=True)`` (custom ops).

    Semantics: fla's ``fla.ops.simple_gla.chunk_simple_gla`` (layout head_first=False, scale,
    states, cu_seqlens); docs/semantics.md lists the choices. The oracle is the prefix recurrence
    in ``lanekit.reference.linear_attn``.
    """
    scale, output_final_state = _validate(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)
    chosen = lane_for(q, lane, "q")
    o, final = getattr(_lanes, f"chunk_simple_gla_{chosen}")(
        q=q, k=k, v=v, g=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens)
    return o, final if output_final_state else None


def fused_recurrent_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    lane: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence of :func:`chunk_simple_gla` step by step: for decode (a few tokens per call,
    carrying the state between calls).

    One program per (sequence, head, block of V) holds the state in fp32 registers and walks the
    tokens in order. Arguments, returns, errors and semantics as :func:`chunk_simple_gla` (fla's
    ``fused_recurrent_simple_gla``); the same state layout (N, H, K, V), so that a prefill by
    :func:`chunk_simple_gla` hands its final state over to this function and back.

    Gradients: the chunked backward of :func:`chunk_simple_gla` (the same function, so the same
    gradients).
    """
    scale, output_final_state = _validate(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)
    chosen = lane_for(q, lane, "q")
    o, final = getattr(_lanes, f"fused_recurrent_simple_gla_{chosen}")(
        q=q, k=k, v=v, g=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens)
    return o, final if output_final_state else None


def _linear_attn(name, q, k, v, scale, initial_state, output_final_state, normalize, cu_seqlens, lane):
    normalize = flag("normalize", normalize)
    initial_z = None
    if isinstance(initial_state, (tuple, list)):
        if not normalize or len(initial_state) != 2:
            raise TypeError("initial_state: expected a tensor (N, H, K, V) or None"
                            + (", or with normalize=True a pair (state, z)" if normalize else "")
                            + f", got {type(initial_state).__name__} of length {len(initial_state)}")
        initial_state, initial_z = initial_state
    scale, output_final_state = _validate(q, k, v, None, scale, initial_state, output_final_state, cu_seqlens,
                                          initial_z)
    chosen = lane_for(q, lane, "q")
    o, final, z = getattr(_lanes, f"{name}_{chosen}")(
        q=q, k=k, v=v, scale=scale, initial_state=initial_state, initial_z=initial_z,
        output_final_state=output_final_state, normalize=normalize, cu_seqlens=cu_seqlens)
    if not output_final_state:
        return o, None
    return o, (final, z) if normalize else final


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | tuple | None = None,
    output_final_state: bool = False,
    normalize: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    lane: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | tuple | None]:
    """Causal linear attention (Katharopoulos et al., 2020), chunked: for prefill and training.

    Per sequence and head, with the state S (K, V): ``S_t = S_{t-1} + k_t^T v_t`` and
    ``o_t = scale * q_t S_t`` (:func:`chunk_simple_gla` without decay, the same kernels). With
    ``normalize``, also the key sum ``z_t = z_{t-1} + k_t`` and ``o_t / (scale * q_t . z_t + 1e-10)``
    (fla's normalization; q and k are then expected positive, e.g. after a feature map).

    Arguments:
        q, k, v, scale, cu_seqlens, lane: as :func:`chunk_simple_gla`.
        initial_state: (N, H, K, V) or None; with ``normalize``, also a pair ``(state, z)`` with z
            (N, 1, H, K) the key sum to start from (fla's z_state; either may be None for zeros).
        output_final_state: also return the final state.
        normalize: divide by the running normalizer (default False).

    Returns:
        (o, final): o (B, T, H, V) in q's dtype; final None unless output_final_state, else the
        state (N, H, K, V) fp32, or with ``normalize`` the pair (state, z (N, 1, H, K) fp32), which
        :func:`fused_recurrent_linear_attn` continues from.

    Raises:
        TypeError, ValueError: as :func:`chunk_simple_gla`; also normalize not a bool, and a pair
        initial_state without normalize.

    Gradients: differentiable in q, k, v and the initial state (and z); Triton backward as
    :func:`chunk_simple_gla`'s. The normalized form runs the recurrence twice (the outputs, and
    the denominators as the recurrence of a value of ones, whose state is z), then divides.

    Semantics: fla's ``fla.ops.linear_attn.chunk_linear_attn`` except its default, normalize=True
    there; docs/semantics.md.
    """
    return _linear_attn("chunk_linear_attn", q, k, v, scale, initial_state, output_final_state, normalize,
                        cu_seqlens, lane)


def fused_recurrent_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | tuple | None = None,
    output_final_state: bool = False,
    normalize: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    lane: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | tuple | None]:
    """The recurrence of :func:`chunk_linear_attn` step by step (decode): arguments, returns,
    errors, gradients and semantics as there (fla's ``fused_recurrent_linear_attn``, without its
    ``reverse``); the same state layout, so that a prefill by :func:`chunk_linear_attn` hands its
    final state over to this function and back.

    Example::

        o, S = chunk_linear_attn(q[:, :100], k[:, :100], v[:, :100], output_final_state=True)
        o_next, S = fused_recurrent_linear_attn(q[:, 100:], k[:, 100:], v[:, 100:],
                                                initial_state=S, output_final_state=True)
    """
    return _linear_attn("fused_recurrent_linear_attn", q, k, v, scale, initial_state, output_final_state,
                        normalize, cu_seqlens, lane)
