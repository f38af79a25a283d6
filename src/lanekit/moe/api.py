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
from lanekit.runtime.validate import lane_for as _lane_for, tensor as _tensor

__all__: list[str] = []

# ---- routing: topk_softmax, grouped_topk ----


# ---- align and transport: moe_align_block_size, moe_dispatch, moe_combine ----


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
