"""Public mixture-of-experts functions: validated, dispatched to a lane.

Shapes: M tokens, K hidden size, N an expert's intermediate size, E experts, topk experts per
token. Routing is the pair ``topk_weights`` fp32 (M, topk) and ``topk_ids`` int32 (M, topk), as
vLLM's ``fused_moe`` takes it. Index values that live on the device (expert ids, group offsets)
are not read back on every call: the kernels mask what is out of range and record it in the
device's error flag (``lanekit.check_errors()``; ``LANEKIT_CHECK_INDICES=1`` checks them on the
host before each launch instead: ``lanekit.runtime.errors``).
"""

from __future__ import annotations

import torch

from lanekit.moe import op as _lanes
from lanekit.runtime import errors as _errors
from lanekit.runtime.errors import check_indices_eagerly as _check_indices_eagerly
from lanekit.runtime.lanes import select_lane as _select_lane
from lanekit.runtime.validate import flag as _flag
from lanekit.runtime.validate import int_at_least as _int_at_least
from lanekit.runtime.validate import is_int as _is_int
from lanekit.runtime.validate import lane_for as _lane
from lanekit.runtime.validate import lane_for as _lane_for
from lanekit.runtime.validate import real as _real
from lanekit.runtime.validate import shape as _shape
from lanekit.runtime.validate import tensor as _tensor

__all__: list[str] = []

# ---- routing: topk_softmax, grouped_topk ----

__all__ += ["topk_softmax", "grouped_topk"]

_MAX_EXPERTS = 512   # a token's scores sit in one program's registers


def _gating(gating_output, topk, lane):
    _tensor("gating_output", gating_output,
            dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64), ndim=2)
    E = gating_output.shape[1]
    if not 1 <= E <= _MAX_EXPERTS:
        raise ValueError(f"gating_output: expected (M, E) with 1 <= E <= {_MAX_EXPERTS}, got shape "
                         f"{tuple(gating_output.shape)}")
    topk = _int_at_least("topk", topk, 1)
    if topk > E:
        raise ValueError(f"topk: expected an int in [1, E = {E}] (gating_output's experts), got {topk}")
    return E, topk, _lane_for(gating_output, lane, "gating_output")


def topk_softmax(gating_output: torch.Tensor, topk: int, renormalize: bool = False, *,
                 lane: str | None = None):
    """Each token's ``topk`` experts by softmax score, and their weights.

    ``scores = softmax(gating_output)`` over the experts, in fp32; the topk largest, highest first
    (equal scores: the lower expert id); with ``renormalize`` the chosen weights are divided by
    their sum (Mixtral, Qwen-MoE), else they are the scores themselves.

    Arguments:
        gating_output: (M, E) router logits, fp16, bf16 or fp32 (fp64 on the reference lane), any
            strides; 1 <= E <= 512.
        topk: experts per token, an int in [1, E].
        renormalize: a bool.
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        topk_weights: (M, topk) fp32.
        topk_ids: (M, topk) int32, in [0, E), distinct per token (NaN scores rank first, as in
            torch.sort).
        topk_weights is differentiable in gating_output on every lane (the ids held fixed; vLLM's
        is not differentiable), so a router trains through it.

    Raises:
        TypeError: a non-tensor or an unsupported dtype; topk not an int; renormalize not a bool.
        ValueError: gating_output not 2-d or E outside [1, 512]; topk outside [1, E]; an unknown
            lane.

    Source: vLLM's ``topk_softmax`` (``vllm.model_executor.layers.fused_moe``), ties fixed to the
    lower expert id.
    """
    E, topk, chosen = _gating(gating_output, topk, lane)
    renormalize = _flag("renormalize", renormalize)
    return getattr(_lanes, f"topk_softmax_{chosen}")(gating_output=gating_output, topk=topk,
                                                     renormalize=renormalize)


def grouped_topk(gating_output: torch.Tensor, topk: int, num_expert_group: int, topk_group: int,
                 renormalize: bool = False, scoring_func: str = "softmax",
                 e_score_correction_bias: torch.Tensor | None = None,
                 routed_scaling_factor: float = 1.0, *, lane: str | None = None):
    """DeepSeek-V3's group-limited routing: the best ``topk_group`` groups of experts, then the
    best ``topk`` experts among them.

    scores = softmax or sigmoid of ``gating_output`` in fp32. The E experts form
    ``num_expert_group`` groups of E / num_expert_group consecutive ones. The *choice* is made
    on scores + ``e_score_correction_bias`` when given (a group then scores the sum of its two
    best), else on the scores (a group scores its best); equal choice scores go to the lower
    group or expert id. The weights are the chosen experts' *unbiased* scores, divided by their
    sum if ``renormalize``, then times ``routed_scaling_factor``.

    Arguments:
        gating_output: (M, E) router logits, fp16, bf16 or fp32 (fp64 on the reference lane),
            any strides; 1 <= E <= 512.
        topk: experts per token, in [1, topk_group * E / num_expert_group].
        num_expert_group: groups, a positive int dividing E.
        topk_group: groups kept, in [1, num_expert_group].
        renormalize: a bool.
        scoring_func: "softmax" or "sigmoid" (DeepSeek-V3).
        e_score_correction_bias: (E,) float on gating_output's device, or None.
        routed_scaling_factor: a finite number (DeepSeek-V3: 2.5).
        lane: as in :func:`topk_softmax`.

    Returns:
        topk_weights (M, topk) fp32 and topk_ids (M, topk) int32, highest choice score first.
        topk_weights is differentiable in gating_output (the ids held fixed; the bias gets no
        gradient: it chooses, it does not weigh).

    Raises:
        TypeError: a non-tensor or an unsupported dtype; an int or bool argument of another type.
        ValueError: shapes as above; num_expert_group not dividing E; topk_group or topk out of
            range; scoring_func unknown; routed_scaling_factor not finite; an unknown lane.

    Source: vLLM's ``grouped_topk`` (DeepSeek-V2/V3's ``MoEGate``), ties fixed to the lower id.
    """
    E, topk, chosen = _gating(gating_output, topk, lane)
    groups = _int_at_least("num_expert_group", num_expert_group, 1)
    if E % groups:
        raise ValueError(f"num_expert_group: expected a divisor of E = {E}, got {groups}")
    topk_group = _int_at_least("topk_group", topk_group, 1)
    if topk_group > groups:
        raise ValueError(f"topk_group: expected an int in [1, num_expert_group = {groups}], got {topk_group}")
    if topk > topk_group * (E // groups):
        raise ValueError(f"topk: expected at most topk_group * E / num_expert_group = "
                         f"{topk_group * (E // groups)} (the experts of the kept groups), got {topk}")
    renormalize = _flag("renormalize", renormalize)
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func: expected 'softmax' or 'sigmoid', got {scoring_func!r}")
    if e_score_correction_bias is not None:
        _tensor("e_score_correction_bias", e_score_correction_bias,
                dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64), ndim=1,
                like=gating_output, like_name="gating_output")
        if e_score_correction_bias.shape[0] != E:
            raise ValueError(f"e_score_correction_bias: expected shape ({E},) (E), got "
                             f"{tuple(e_score_correction_bias.shape)}")
    routed_scaling_factor = _real("routed_scaling_factor", routed_scaling_factor, "a finite number")
    return getattr(_lanes, f"grouped_topk_{chosen}")(
        gating_output=gating_output, topk=topk, num_expert_group=groups, topk_group=topk_group,
        renormalize=renormalize, scoring_func=scoring_func,
        e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor)



# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----

__all__ += ["moe_align_block_size"]


_MAX_SORTED_EXPERTS = 1024   # the sort's per-expert counts sit in one program's registers


def _num_experts(num_experts) -> int:
    num_experts = _int_at_least("num_experts", num_experts, 1)
    if num_experts > _MAX_SORTED_EXPERTS:
        raise ValueError(f"num_experts: expected an int in [1, {_MAX_SORTED_EXPERTS}], got {num_experts}")
    return num_experts


def _topk_ids(topk_ids, num_experts: int, like: torch.Tensor | None = None, like_name: str | None = None):
    """topk_ids int32 (M, topk) with 1 <= topk <= num_experts, on like's device; with
    LANEKIT_CHECK_INDICES=1 its values too (a sync)."""
    _tensor("topk_ids", topk_ids, dtypes=(torch.int32,), ndim=2, like=like, like_name=like_name)
    topk = topk_ids.shape[1]
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk_ids: expected (M, topk) with 1 <= topk <= num_experts = {num_experts}, "
                         f"got shape {tuple(topk_ids.shape)}")
    if _errors.check_indices_eagerly() and topk_ids.numel():
        bad = (topk_ids < 0) | (topk_ids >= num_experts)
        if bool(bad.any()):
            value = int(topk_ids[bad][0])
            raise ValueError(f"topk_ids: expected expert ids in [0, {num_experts}), got {value} "
                             f"(LANEKIT_CHECK_INDICES=1)")


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                         expert_map: torch.Tensor | None = None, *, lane: str | None = None):
    """Sort the routed slots by expert and pad each expert's run to a multiple of ``block_size``,
    so that every block of ``block_size`` rows belongs to one expert (the layout of vLLM's fused
    MoE GEMM).

    Slot s of token t has the *flat index* i = t * topk + s. The result lists expert 0's flat
    indices (ascending), padded with the sentinel M * topk to a multiple of block_size, then
    expert 1's, and so on; an expert with no token takes no block. Every lane gives the same
    values, bit for bit.

    Arguments:
        topk_ids: (M, topk) int32, each token's experts (``topk_softmax``'s ids), any strides;
            1 <= topk <= num_experts. Entries are read on the device: one outside
            [0, num_experts) is never used as an address; it is dropped (takes no slot) and
            recorded in the device's error flag (``lanekit.check_errors()`` raises it), or, with
            ``LANEKIT_CHECK_INDICES=1``, raises here at once.
        block_size: rows per block of the expert GEMM, a positive int (vLLM uses 16, 32, 64, 128).
        num_experts: E, the global number of experts, an int in [1, 1024].
        expert_map: (E,) int32 or None: global -> local expert id, -1 for an expert on another
            rank. With it, expert_ids holds the local ids (the sort still counts every expert).
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        sorted_token_ids: (max_num_tokens_padded,) int32; max_num_tokens_padded =
            M * topk + E * (block_size - 1), or M * topk * block_size where that is smaller
            (fewer slots than experts). Past num_tokens_post_padded: the sentinel M * topk.
        expert_ids: (ceil(max_num_tokens_padded / block_size),) int32, each block's expert; the
            blocks past the last used one hold 0 (with expert_map: expert_map[0]).
        num_tokens_post_padded: (1,) int32, the padded length in use.
        Not differentiable. No device sync.

    Raises:
        TypeError: topk_ids or expert_map not an int32 tensor; block_size or num_experts not an int.
        ValueError: topk_ids not 2-d or topk outside [1, num_experts]; block_size below 1 or
            max_num_tokens_padded (below) not below 2^31; num_experts outside [1, 1024]; expert_map not (E,) or on another device; an unknown lane; with
            LANEKIT_CHECK_INDICES=1, an expert id outside [0, num_experts).

    Source: vLLM's ``moe_align_block_size`` (``vllm.model_executor.layers.fused_moe``), with the
    order within one expert fixed (ascending flat index).
    """
    block_size = _int_at_least("block_size", block_size, 1)
    num_experts = _num_experts(num_experts)
    _topk_ids(topk_ids, num_experts)
    numel = topk_ids.numel()
    padded = numel + num_experts * (block_size - 1)
    padded = min(numel * block_size, padded) if numel < num_experts else padded
    if padded >= 2 ** 31:
        raise ValueError(f"block_size: expected max_num_tokens_padded = M * topk + num_experts * (block_size - 1) "
                         f"below 2^31 (int32 positions), got {padded} for block_size = {block_size}")
    if expert_map is not None:
        _tensor("expert_map", expert_map, dtypes=(torch.int32,), ndim=1, like=topk_ids, like_name="topk_ids")
        if expert_map.shape[0] != num_experts:
            raise ValueError(f"expert_map: expected shape ({num_experts},) (num_experts), got "
                             f"{tuple(expert_map.shape)}")
    chosen = _select_lane(topk_ids.device, lane)
    return getattr(_lanes, f"moe_align_block_size_{chosen}")(
        topk_ids=topk_ids, block_size=block_size, num_experts=num_experts, expert_map=expert_map)



__all__ += ["moe_dispatch", "moe_combine"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)   # float64: reference lane only


def moe_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, *, lane: str | None = None):
    """Gather the rows of ``x`` in expert order: the input of ``grouped_mm`` (no padding).

    Row j of ``permuted`` is the token of the j-th routed slot when the M * topk slots (flat index
    t * topk + s) are sorted by expert, ascending flat index within one expert.

    Arguments:
        x: (M, K) fp16, bf16 or fp32 (fp64 on the reference lane), any strides.
        topk_ids: (M, topk) int32 on x's device, 1 <= topk <= num_experts, any strides. Read on
            the device: an id outside [0, num_experts) is never used as an address; its slot is
            placed after every expert's rows (past offs[E - 1], in flat order) and recorded in the
            device's error flag (``lanekit.check_errors()``); ``LANEKIT_CHECK_INDICES=1`` raises
            here instead.
        num_experts: E, an int in [1, 1024].
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        permuted: (M * topk, K) in x's dtype, an exact copy of rows of x. Differentiable in x:
            dx[t] = sum over s of dpermuted[inv_permuted_idx[t, s]], in slot order.
        offs: (E,) int32, the cumulative end of each expert's rows (``grouped_mm``'s offs).
        inv_permuted_idx: (M, topk) int32, the row of permuted holding slot (t, s), which
            :func:`moe_combine` reads back.
        No device sync.

    Raises:
        TypeError: a non-tensor; x not a float dtype (float64 off the reference lane); topk_ids
            not int32; num_experts not an int.
        ValueError: x not 2-d; topk_ids not (M, topk) for x's M, or on another device, or
            topk outside [1, num_experts]; num_experts outside [1, 1024]; an unknown lane; with
            LANEKIT_CHECK_INDICES=1, an expert id out of range.

    Source: the permute of vLLM's modular MoE kernels (``moe_permute``) and of PyTorch's
    ``grouped_mm`` users, with the order within one expert fixed (ascending flat index).
    """
    _tensor("x", x, dtypes=_FLOATS, ndim=2)
    num_experts = _num_experts(num_experts)
    _topk_ids(topk_ids, num_experts, like=x, like_name="x")
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids: expected ({x.shape[0]}, topk) (x's M), got {tuple(topk_ids.shape)}")
    chosen = _lane_for(x, lane)
    return getattr(_lanes, f"moe_dispatch_{chosen}")(x=x, topk_ids=topk_ids, num_experts=num_experts)


def moe_combine(y: torch.Tensor, topk_weights: torch.Tensor, inv_permuted_idx: torch.Tensor, *,
                lane: str | None = None) -> torch.Tensor:
    """The weighted sum back in token order: ``out[t] = sum over s of topk_weights[t, s] *
    y[inv_permuted_idx[t, s]]``.

    The kernel sums s = 0, 1, ... in fp32 in that order (no atomics: the same bits on every run)
    and rounds once to y's dtype; the weights enter unrounded.

    Arguments:
        y: (R, K) fp16, bf16 or fp32 (fp64 on the reference lane), any strides: the experts'
            outputs in :func:`moe_dispatch`'s row order (R >= M * topk rows; more are allowed).
        topk_weights: (M, topk) float (fp32 as ``topk_softmax`` gives), on y's device.
        inv_permuted_idx: (M, topk) int32, :func:`moe_dispatch`'s. Read on the device: an entry
            outside [0, R) is never used as an address; that slot contributes nothing and it is
            recorded in the device's error flag (``lanekit.check_errors()``);
            ``LANEKIT_CHECK_INDICES=1`` raises here instead.
        lane: as in :func:`moe_dispatch`.

    Returns:
        (M, K) in y's dtype. Differentiable in y and topk_weights: dy[inv[t, s]] =
        topk_weights[t, s] * dout[t] (rows no slot names get 0; an index named twice, which
        dispatch never gives, has an unspecified gradient), d topk_weights[t, s] =
        dout[t] . y[inv[t, s]] (fp32).

    Raises:
        TypeError: a non-tensor; y or topk_weights not a float dtype (float64 off the reference
            lane); inv_permuted_idx not int32.
        ValueError: y not 2-d; topk_weights not 2-d, or inv_permuted_idx not its shape; tensors on
            different devices; an unknown lane; with LANEKIT_CHECK_INDICES=1, an index out of
            range.

    Source: the unpermute-and-reduce of vLLM's MoE (``moe_unpermute``), fp32 accumulation as its
    ``moe_sum``, in a fixed order.
    """
    _tensor("y", y, dtypes=_FLOATS, ndim=2)
    _tensor("topk_weights", topk_weights, dtypes=_FLOATS, ndim=2, like=y, like_name="y")
    _tensor("inv_permuted_idx", inv_permuted_idx, dtypes=(torch.int32,), ndim=2, like=y, like_name="y")
    if inv_permuted_idx.shape != topk_weights.shape:
        raise ValueError(f"inv_permuted_idx: expected shape {tuple(topk_weights.shape)} (topk_weights'), "
                         f"got {tuple(inv_permuted_idx.shape)}")
    if _errors.check_indices_eagerly() and inv_permuted_idx.numel():
        bad = (inv_permuted_idx < 0) | (inv_permuted_idx >= y.shape[0])
        if bool(bad.any()):
            raise ValueError(f"inv_permuted_idx: expected rows of y in [0, {y.shape[0]}), got "
                             f"{int(inv_permuted_idx[bad][0])} (LANEKIT_CHECK_INDICES=1)")
    chosen = _lane_for(y, lane, "y")
    if topk_weights.dtype == torch.float64 and chosen != "reference":
        raise TypeError("topk_weights: expected fp16, bf16 or fp32 on the triton lane, got torch.float64")
    return getattr(_lanes, f"moe_combine_{chosen}")(y=y, topk_weights=topk_weights,
                                                   inv_permuted_idx=inv_permuted_idx)


# ---- grouped GEMM and the fused expert MLP: grouped_mm, fused_moe ----

__all__ += ["grouped_mm"]

_GEMM_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # float64: reference lane


def _check_offs_values(offs: torch.Tensor, M: int) -> None:
    """LANEKIT_CHECK_INDICES=1: offs read back (a sync) and checked before the launch."""
    values = offs.cpu()
    if values.numel() and (bool((values.diff() < 0).any()) or int(values[0]) < 0 or int(values[-1]) != M):
        raise ValueError(f"offs: expected non-decreasing int32 group ends from >= 0 to M_total = {M}, got "
                         f"{values.tolist()}")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype | None = None,
               *, lane: str | None = None) -> torch.Tensor:
    """Grouped matrix product: the rows of ``a`` in E groups, group e times ``b[e]``.

    ``out[offs[e-1]:offs[e]] = a[offs[e-1]:offs[e]] @ b[e]`` (offs[-1] taken as 0), accumulated
    in fp32 and rounded once to ``out_dtype``; a group of no rows gives nothing. This is the MoE
    experts' GEMM: a holds the tokens sorted by expert (``moe_dispatch``), b the experts' weights.

    Arguments:
        a: (M_total, K), bf16, fp16 or fp32 (fp64 on the reference lane); any strides.
        b: (E, K, N), a's dtype; any strides: the transpose ``w.transpose(1, 2)`` of weights stored
            (E, N, K), as models store them, is read in place (no copy).
        offs: (E,) int32 on a's device: the cumulative end of each group's rows, non-decreasing,
            offs[E-1] = M_total (``counts.cumsum(0)``). Its values are not read on the host (no
            sync): the kernel clamps each group to [the previous groups' largest end, M_total],
            writes zeros past the last end, and records invalid offs in the device's error flag,
            which ``lanekit.check_errors()`` raises; with ``LANEKIT_CHECK_INDICES=1`` they are
            checked on the host before the launch instead (a ValueError).
        out_dtype: a's dtype (the default) or torch.float32.
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.

    Returns:
        out (M_total, N) in out_dtype. Differentiable in a and b: d a = grouped_mm(dout, b^T)
        (b's transpose read in place), d b[e] = a[rows of e]^T @ dout[rows of e] (zeros for a group
        of no rows), by a second kernel that reduces over each group's rows.

    Raises:
        TypeError: a non-tensor; a or b not bf16/fp16/fp32, b not a's dtype, offs not int32,
            out_dtype not a's dtype nor fp32.
        ValueError: a not 2-D, b not 3-D, K of a and b differ, offs not (E,), tensors on different
            devices, an unknown lane; with LANEKIT_CHECK_INDICES=1, offs values invalid.

    Example (the first GEMM of an expert MLP, weights stored (E, N, K))::

        counts = torch.bincount(topk_ids.flatten(), minlength=E)      # rows of each expert
        h = grouped_mm(x_sorted, w.transpose(1, 2), counts.cumsum(0).to(torch.int32))

    Source: ``torch.nn.functional.grouped_mm(a, b, offs=offs, out_dtype=out_dtype)`` for a 2-D a
    and a 3-D b (PyTorch leaves the rows past offs[E-1] unspecified and does not check offs'
    values; here they are zeros and invalid offs are recorded, as the MoE issue asks).
    """
    _tensor("a", a, dtypes=_GEMM_DTYPES, ndim=2)
    _tensor("b", b, ndim=3, like=a, like_name="a", like_dtype=True)
    _tensor("offs", offs, dtypes=(torch.int32,), ndim=1, like=a, like_name="a")
    if b.shape[1] != a.shape[1]:
        raise ValueError(f"b: expected shape (E, K={a.shape[1]}, N) (K of a (M_total, K)), got {tuple(b.shape)}")
    if b.shape[0] == 0:
        raise ValueError(f"b: expected at least one group (E >= 1), got shape {tuple(b.shape)}")
    if offs.shape[0] != b.shape[0]:
        raise ValueError(f"offs: expected shape ({b.shape[0]},) (E, b's groups), got {tuple(offs.shape)}")
    if out_dtype is None:
        out_dtype = a.dtype
    if out_dtype not in (a.dtype, torch.float32):
        raise TypeError(f"out_dtype: expected None, {a.dtype} (a's dtype) or torch.float32, got {out_dtype}")
    chosen = _lane_for(a, lane, "a")
    if _errors.check_indices_eagerly():
        _check_offs_values(offs, a.shape[0])
    return getattr(_lanes, f"grouped_mm_{chosen}")(a=a, b=b, offs=offs, out_dtype=out_dtype)



# -- fused_moe --

__all__ += ["fused_moe"]

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float64)   # float64: the reference lane only


def _check_fused_moe_indices(topk_ids, expert_map, num_global, num_local):
    """LANEKIT_CHECK_INDICES=1: the device-resident ids checked on the host (a sync)."""
    if topk_ids.numel():
        low, high = int(topk_ids.min()), int(topk_ids.max())
        if low < 0 or high >= num_global:
            raise ValueError(f"topk_ids: expected ids in [0, {num_global}) (the experts), got [{low}, {high}]")
    if expert_map is not None and expert_map.numel():
        low, high = int(expert_map.min()), int(expert_map.max())
        if low < -1 or high >= num_local:
            raise ValueError(f"expert_map: expected local ids in [-1, {num_local}) (w1's experts; -1: not "
                             f"on this rank), got [{low}, {high}]")


def _fused_moe_quant_flags(use_fp8_w8a8, use_int8_w8a16, per_channel_quant, block_shape) -> bool:
    """Whether the experts are quantized; the flags' combinations checked (their types: fused_moe)."""
    if use_fp8_w8a8 and use_int8_w8a16:
        raise ValueError("use_int8_w8a16: expected one quantization scheme, got use_fp8_w8a8 and use_int8_w8a16")
    if block_shape is not None:
        if not use_fp8_w8a8:
            raise ValueError(f"block_shape: expected None without use_fp8_w8a8, got {block_shape!r}")
        if per_channel_quant:
            raise ValueError(f"block_shape: expected None with per_channel_quant, got {block_shape!r}")
        if (not isinstance(block_shape, (list, tuple)) or not all(map(_is_int, block_shape))
                or list(block_shape) != [128, 128]):
            raise ValueError(f"block_shape: expected [128, 128] (DeepSeek-V3's blocks), got {block_shape!r}")
    return use_fp8_w8a8 or use_int8_w8a16


def _check_fused_moe_scales(x, E, N, K, use_fp8_w8a8, per_channel_quant, block_shape, w1_scale,
                            w2_scale, a1_scale, a2_scale):
    """The scales' presence, dtypes, devices and shapes for the scheme (metadata only)."""
    def cdiv(a, b):
        return -(-a // b)

    if block_shape is not None:
        shapes = ((E, cdiv(2 * N, 128), cdiv(K, 128)), (E, cdiv(K, 128), cdiv(N, 128)))
        what = ("(E, ceil(2N/128), ceil(K/128)): per 128 x 128 block", "(E, ceil(K/128), ceil(N/128)): per 128 x 128 block")
    elif per_channel_quant or not use_fp8_w8a8:
        shapes = ((E, 2 * N, 1), (E, K, 1))
        what = ("(E, 2N, 1): per output channel", "(E, K, 1): per output channel")
    else:
        shapes = None
    for i, (name, s) in enumerate((("w1_scale", w1_scale), ("w2_scale", w2_scale))):
        if s is None:
            raise ValueError(f"{name}: expected the weights' scales with quantized experts, got None")
        _tensor(name, s, dtypes=(torch.float32,), like=x, like_name="hidden_states")
        if shapes is None:
            if tuple(s.shape) not in ((E,), (1,)):
                raise ValueError(f"{name}: expected shape ({E},) or (1,) (per tensor), got {tuple(s.shape)}")
        else:
            _shape(name, s, shapes[i], what[i])
    for name, s in (("a1_scale", a1_scale), ("a2_scale", a2_scale)):
        if s is None:
            continue
        if block_shape is not None or per_channel_quant or not use_fp8_w8a8:
            raise ValueError(f"{name}: expected None (the activations' scales are dynamic in this "
                             f"scheme; static only per tensor with use_fp8_w8a8), got a tensor")
        _tensor(name, s, dtypes=(torch.float32,), like=x, like_name="hidden_states")
        _shape(name, s, (1,), "a static per-tensor scale")



def _check_routing(hidden_states, E, topk_weights, topk_ids, expert_map, activation,
                   apply_router_weight_on_input):
    """fused_moe's routing arguments against x (M, K) and E local experts (metadata only);
    returns (E_global, apply_router_weight_on_input as a bool)."""
    M = hidden_states.shape[0]
    _tensor("topk_ids", topk_ids, dtypes=(torch.int32,), ndim=2, like=hidden_states, like_name="hidden_states")
    topk = topk_ids.shape[1]
    if topk_ids.shape[0] != M:
        raise ValueError(f"topk_ids: expected (M, topk) with M = {M} (hidden_states' rows), got shape {tuple(topk_ids.shape)}")
    _tensor("topk_weights", topk_weights, dtypes=tuple(dict.fromkeys((torch.float32, hidden_states.dtype))),
            like=hidden_states, like_name="hidden_states")
    _shape("topk_weights", topk_weights, tuple(topk_ids.shape), "topk_ids' shape (M, topk)")
    num_global = E
    if expert_map is not None:
        _tensor("expert_map", expert_map, dtypes=(torch.int32,), ndim=1, like=hidden_states, like_name="hidden_states")
        num_global = expert_map.shape[0]
        if num_global < E:
            raise ValueError(f"expert_map: expected (E_global,) with E_global >= E = {E} (w1's local experts), "
                             f"got shape {tuple(expert_map.shape)}")
    if not 1 <= topk <= num_global:
        raise ValueError(f"topk_ids: expected 1 <= topk <= {num_global} (the experts), got topk = {topk}")
    if activation not in ("silu", "gelu"):
        raise ValueError(f"activation: expected 'silu' or 'gelu', got {activation!r}")
    apply_router_weight_on_input = _flag("apply_router_weight_on_input", apply_router_weight_on_input)
    if apply_router_weight_on_input and topk != 1:
        raise ValueError(f"apply_router_weight_on_input: expected topk = 1 (as vLLM), got topk = {topk}")
    return num_global, apply_router_weight_on_input


def fused_moe(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
              apply_router_weight_on_input: bool = False, expert_map: torch.Tensor | None = None,
              *, use_fp8_w8a8: bool = False, use_int8_w8a16: bool = False,
              per_channel_quant: bool = False, block_shape: list[int] | None = None,
              w1_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              a1_scale: torch.Tensor | None = None, a2_scale: torch.Tensor | None = None,
              use_mxfp4_w4a16: bool = False, lane: str | None = None) -> torch.Tensor:
    """The fused expert MLP of a mixture-of-experts layer (vLLM's ``fused_experts``), unquantized
    or with quantized experts (the keywords ``use_fp8_w8a8`` ... ``a2_scale`` and
    ``use_mxfp4_w4a16``, below).

    For each token t and slot s, with e = topk_ids[t, s] (through ``expert_map`` when given):
    ``out[t] += topk_weights[t, s] * w2[e] @ (act(w1[e, :N] @ x[t]) * (w1[e, N:] @ x[t]))``.
    Tokens are aligned by expert in blocks (vLLM's ``moe_align_block_size``); the first GEMM
    gathers each block's rows of x in its loads and applies act(gate) * up in its epilogue; its
    result, the (rows, N) intermediate, is rounded to x's dtype before the second GEMM (as vLLM
    does); the second GEMM's rows are kept in fp32 and each token's top-k rows summed in slot
    order in fp32, rounded once: the result is deterministic (no atomics).

    Arguments:
        hidden_states: (M, K) x, bf16 or fp16 (fp64 on the reference lane); any strides.
        w1: (E, 2N, K), x's dtype: each expert's gate rows (N), then its up rows (N).
        w2: (E, K, N), x's dtype: each expert's down projection.
        topk_weights: (M, topk), fp32 or x's dtype: the router's weights of each token's experts.
        topk_ids: (M, topk) int32: each token's experts, global ids in [0, E_global); 1 <= topk
            <= E_global.
        activation: "silu" (SwiGLU) or "gelu" (GeGLU, the exact erf GELU).
        apply_router_weight_on_input: scale x by the weight before the first GEMM instead of the
            expert's output (Llama 4's form; vLLM allows it with topk = 1 only, and so do we).
        expert_map: (E_global,) int32 or None: expert parallelism. Maps a global expert id to its
            row of w1/w2 on this rank, -1 for an expert on another rank, whose slots contribute
            zero. w1 and w2 then hold the E local experts and topk_ids global ids, E_global =
            len(expert_map) (vLLM's ``global_num_experts``); without it E_global = E.
        use_fp8_w8a8: w1 and w2 are torch.float8_e4m3fn codes, and x and the intermediate are
            quantized to e4m3 on the fly (W8A8). Three schemes, as vLLM's:
            per tensor (default): w1_scale and w2_scale (E,) or (1,); x's scale a1_scale (1,) and
            the intermediate's a2_scale (1,), static, or None: dynamic, amax / 448 of the whole
            tensor;
            ``per_channel_quant``: per token (x's rows, the intermediate's slots: dynamic) times
            per output channel, w1_scale (E, 2N, 1), w2_scale (E, K, 1);
            ``block_shape`` [128, 128] (DeepSeek-V3's): w1_scale (E, ceil(2N/128), ceil(K/128)),
            w2_scale (E, ceil(K/128), ceil(N/128)), activations per token and group of 128
            columns (vLLM's ``per_token_group_quant_fp8``, dynamic).
            A dynamic scale is amax / 448 in fp32 (not a power of two; 1 for an all-zero group),
            codes x / scale rounded half to even and saturated at +-448; the GEMMs multiply the
            codes in fp8 and accumulate in fp32, scaled per block in the K loop or in the epilogue.
            act(gate) * up is rounded to x's dtype, then quantized for the second GEMM.
        use_int8_w8a16: w1 and w2 are torch.int8 codes with per-output-channel scales w1_scale
            (E, 2N, 1) and w2_scale (E, K, 1); x stays in its dtype (weights widened in the loads).
        per_channel_quant, block_shape, w1_scale, w2_scale, a1_scale, a2_scale: see above; all
            scales fp32 on x's device. Quantized experts are inference only: inputs that require
            grad are refused. The oracle is ``lanekit.reference.moe.fused_moe_quantized``.
        use_mxfp4_w4a16: OCP MXFP4 experts with 16-bit activations (gpt-oss's experts; vLLM's
            ``mxfp4_w4a16_moe_quant_config``, whose weight dtype is "mxfp4" and activations
            unquantized): w1 uint8 (E, 2N, K/2) and w2 uint8 (E, K, N/2), two e2m1 codes a byte
            along the reduction (element 2i in the low nibble; gpt-oss's blocks (E, 2N, K/32, 16)
            and (E, K, N/32, 16) also taken), w1_scale (E, 2N, K/32) and w2_scale (E, K, N/32)
            uint8 or float8_e8m0fnu e8m0 bytes, 2^(e - 127), 0xFF NaN. K and N multiples of 32. The
            codes are decoded in the GEMMs' weight loads (exact in bf16/fp16), each 32-wide fp32
            partial sum times its scale (as ``lanekit.gemm.mxfp4_linear``); the intermediate is
            rounded to x's dtype. Gate rows then up rows as above (gpt-oss's checkpoints
            interleave them and add biases and a clamped SwiGLU: not this op). Inference only
            (inputs that require grad refused). The oracle is
            ``lanekit.reference.moe.fused_moe_mxfp4`` (dequantize, then the fused_moe oracle).
        lane: "triton" or "reference"; default triton for CUDA/ROCm tensors, reference otherwise.
            fp8 W8A8 on the Triton lane needs e4m3 (sm89+ or AMD); on sm80 it does not compile.

    Returns:
        (M, K) in x's dtype. Unquantized, differentiable on every lane in hidden_states, w1, w2
        and topk_weights (the Triton lane's backward is its own op, ``lanekit::fused_moe_bwd``).

    Ids that live on the device are not read back: a topk_ids entry outside [0, E_global), or an
    expert_map entry outside [-1, E), makes that slot count zero (nothing is read for it) and is
    reported by ``lanekit.check_errors()``; ``LANEKIT_CHECK_INDICES=1`` raises a ValueError here
    instead, before the launch.

    Raises:
        TypeError: a non-tensor; x not bf16/fp16, w1 or w2 not of x's dtype (quantized: not e4m3
            or int8 codes), topk_weights not fp32 or x's dtype, topk_ids or expert_map not int32, a
            scale not fp32; a quantization flag not a bool.
        ValueError (quantized experts): both schemes at once; a weight scale missing, or of the
            wrong shape for the scheme; block_shape other than [128, 128], or with W8A16 or
            per_channel_quant; a1/a2_scale given with a dynamic-only scheme or not (1,); inputs
            that require grad.
        ValueError (MXFP4 experts): use_mxfp4_w4a16 with another scheme or with block_shape,
            per_channel_quant, a1_scale or a2_scale; K or N not a multiple of 32; a weight or
            scale of the wrong shape; inputs that require grad. TypeError: weights not uint8,
            scales not uint8 or float8_e8m0fnu.
        ValueError: wrong ranks; w1 with no expert; w1 and w2 of different E; 2N odd; K of w1 or w2 not x's; N of
            w2 not half of w1's 2N; topk_weights not topk_ids' shape, or M not x's; topk < 1 or
            topk > E_global; expert_map not 1-d or shorter than E; apply_router_weight_on_input
            with topk > 1; an unknown activation; tensors on different devices; an unknown lane.

    Source: vLLM's ``fused_experts`` (``vllm.model_executor.layers.fused_moe``) and its
    ``silu_and_mul`` / ``gelu_and_mul``; the oracle is ``lanekit.reference.moe.fused_moe``.
    MXFP4: OCP Microscaling Formats (MX) v1.0; openai/gpt-oss ``torch/weights.py`` (the packing).
    """
    _tensor("hidden_states", hidden_states, dtypes=_FUSED_DTYPES, ndim=2)
    M, K = hidden_states.shape
    if _flag("use_mxfp4_w4a16", use_mxfp4_w4a16):
        return _fused_moe_mxfp4(hidden_states, w1, w2, topk_weights, topk_ids, activation,
                                apply_router_weight_on_input, expert_map, use_fp8_w8a8, use_int8_w8a16,
                                per_channel_quant, block_shape, w1_scale, w2_scale, a1_scale, a2_scale, lane)
    use_fp8_w8a8, use_int8_w8a16, per_channel_quant = (
        _flag("use_fp8_w8a8", use_fp8_w8a8), _flag("use_int8_w8a16", use_int8_w8a16),
        _flag("per_channel_quant", per_channel_quant))
    quantized = _fused_moe_quant_flags(use_fp8_w8a8, use_int8_w8a16, per_channel_quant, block_shape)
    for name, w in (("w1", w1), ("w2", w2)):
        _tensor(name, w, ndim=3, like=hidden_states, like_name="hidden_states")
        if quantized:
            _tensor(name, w, dtypes=(torch.float8_e4m3fn,) if use_fp8_w8a8 else (torch.int8,))
        else:
            _tensor(name, w, like=hidden_states, like_name="hidden_states", like_dtype=True)
    E, two_n, _ = w1.shape
    if E == 0:
        raise ValueError(f"w1: expected (E, 2N, K) with at least one expert (E >= 1), got shape {tuple(w1.shape)}")
    if w2.shape[0] != E:
        raise ValueError(f"w2: expected E = {E} experts (w1's), got shape {tuple(w2.shape)}")
    if two_n % 2:
        raise ValueError(f"w1: expected (E, 2N, K) with an even 2N (gate rows, then up rows), got shape {tuple(w1.shape)}")
    N = two_n // 2
    if w1.shape[2] != K:
        raise ValueError(f"w1: expected (E, 2N, K) with K = {K} (hidden_states'), got shape {tuple(w1.shape)}")
    _shape("w2", w2, (E, K, N), "(E, K, N): E and N of w1, K of hidden_states")
    num_global, apply_router_weight_on_input = _check_routing(
        hidden_states, E, topk_weights, topk_ids, expert_map, activation, apply_router_weight_on_input)
    if quantized:
        _check_fused_moe_scales(hidden_states, E, N, K, use_fp8_w8a8, per_channel_quant, block_shape,
                                w1_scale, w2_scale, a1_scale, a2_scale)
        grads = [name for name, t in (("hidden_states", hidden_states), ("topk_weights", topk_weights),
                                      ("w1", w1), ("w2", w2), ("w1_scale", w1_scale), ("w2_scale", w2_scale), ("a1_scale", a1_scale),
                                      ("a2_scale", a2_scale)) if t is not None and t.requires_grad]
        if torch.is_grad_enabled() and grads:
            raise ValueError(f"{grads[0]}: expected no requires_grad with quantized experts (inference "
                             f"only: no gradient flows through fp8/int8 experts), got requires_grad=True")
    else:
        given = [name for name, v in (("w1_scale", w1_scale), ("w2_scale", w2_scale), ("a1_scale", a1_scale),
                                      ("a2_scale", a2_scale), ("block_shape", block_shape)) if v is not None]
        given += ["per_channel_quant"] if per_channel_quant else []
        if given:
            raise ValueError(f"{given[0]}: expected no scales, block_shape or per_channel_quant without "
                             f"use_fp8_w8a8 or use_int8_w8a16, got {', '.join(given)}")
    chosen = _lane(hidden_states, lane, "hidden_states")
    if _check_indices_eagerly():
        _check_fused_moe_indices(topk_ids, expert_map, num_global, E)
    if quantized:
        return getattr(_lanes, f"fused_moe_quant_{chosen}")(
            hidden_states=hidden_states, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
            activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
            expert_map=expert_map, use_fp8_w8a8=use_fp8_w8a8, use_int8_w8a16=use_int8_w8a16,
            per_channel_quant=per_channel_quant,
            block_shape=None if block_shape is None else [int(b) for b in block_shape],
            w1_scale=w1_scale, w2_scale=w2_scale, a1_scale=a1_scale, a2_scale=a2_scale)
    return getattr(_lanes, f"fused_moe_{chosen}")(
        hidden_states=hidden_states, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
        activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
        expert_map=expert_map)


# ---- fused_moe with MXFP4 experts (use_mxfp4_w4a16) ----

MX_GROUP = 32


def _mxfp4_expert(name, w, scale_name, scale, E, R, C, x):
    """An MXFP4 expert weight: w uint8 (E, R, C/2) or gpt-oss's blocks (E, R, C/32, 16), its
    scales uint8 / float8_e8m0fnu (E, R, C/32); returns both as (E, R, C/2) and (E, R, C/32) uint8."""
    _tensor(name, w, dtypes=(torch.uint8,), ndim=(3, 4), like=x, like_name="hidden_states")
    if w.dim() == 4:
        _shape(name, w, (E, R, C // MX_GROUP, MX_GROUP // 2), "gpt-oss's blocks (E, rows, cols/32, 16)")
        w = w.reshape(E, R, C // 2)
    _shape(name, w, (E, R, C // 2), "(E, rows, cols/2): two e2m1 codes a byte")
    if scale is None:
        raise ValueError(f"{scale_name}: expected the e8m0 scales (E, rows, cols/32) with use_mxfp4_w4a16, got None")
    e8m0 = getattr(torch, "float8_e8m0fnu", torch.uint8)
    _tensor(scale_name, scale, dtypes=tuple(dict.fromkeys((torch.uint8, e8m0))), ndim=3, like=x,
            like_name="hidden_states")
    _shape(scale_name, scale, (E, R, C // MX_GROUP), "(E, rows, cols/32): one e8m0 scale per 32")
    return w, scale if scale.dtype == torch.uint8 else scale.view(torch.uint8)


def _fused_moe_mxfp4(x, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input,
                     expert_map, use_fp8_w8a8, use_int8_w8a16, per_channel_quant, block_shape,
                     w1_scale, w2_scale, a1_scale, a2_scale, lane):
    """fused_moe(use_mxfp4_w4a16=True): the checks (metadata only), then the lane."""
    others = [name for name, v in (("use_fp8_w8a8", _flag("use_fp8_w8a8", use_fp8_w8a8)),
                                   ("use_int8_w8a16", _flag("use_int8_w8a16", use_int8_w8a16)),
                                   ("per_channel_quant", _flag("per_channel_quant", per_channel_quant)),
                                   ("block_shape", block_shape is not None), ("a1_scale", a1_scale is not None),
                                   ("a2_scale", a2_scale is not None)) if v]
    if others:
        raise ValueError(f"{others[0]}: expected it unset with use_mxfp4_w4a16 (16-bit activations, "
                         f"e8m0 weight scales per 32), got it set")
    M, K = x.shape
    _tensor("w1", w1, ndim=(3, 4), like=x, like_name="hidden_states")
    _tensor("w2", w2, ndim=(3, 4), like=x, like_name="hidden_states")
    E, two_n = w1.shape[0], w1.shape[1]
    if E == 0:
        raise ValueError(f"w1: expected (E, 2N, K/2) with at least one expert (E >= 1), got shape {tuple(w1.shape)}")
    if K % MX_GROUP:
        raise ValueError(f"hidden_states: expected K a multiple of {MX_GROUP} with use_mxfp4_w4a16 (one e8m0 "
                         f"scale per 32 along K), got K = {K}")
    if two_n % (2 * MX_GROUP):
        raise ValueError(f"w1: expected (E, 2N, K/2) with N a multiple of {MX_GROUP} (w2's reduction has one "
                         f"e8m0 scale per 32 of N), got shape {tuple(w1.shape)}")
    N = two_n // 2
    w1, w1_scale = _mxfp4_expert("w1", w1, "w1_scale", w1_scale, E, 2 * N, K, x)
    w2, w2_scale = _mxfp4_expert("w2", w2, "w2_scale", w2_scale, E, K, N, x)
    num_global, apply_router_weight_on_input = _check_routing(
        x, E, topk_weights, topk_ids, expert_map, activation, apply_router_weight_on_input)
    grads = [name for name, t in (("hidden_states", x), ("topk_weights", topk_weights)) if t.requires_grad]
    if torch.is_grad_enabled() and grads:
        raise ValueError(f"{grads[0]}: expected no requires_grad with MXFP4 experts (inference only: no "
                         f"gradient flows through them), got requires_grad=True")
    chosen = _lane(x, lane, "hidden_states")
    if _check_indices_eagerly():
        _check_fused_moe_indices(topk_ids, expert_map, num_global, E)
    return getattr(_lanes, f"fused_moe_mxfp4_{chosen}")(
        hidden_states=x, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
        activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
        expert_map=expert_map, w1_scale=w1_scale, w2_scale=w2_scale)
