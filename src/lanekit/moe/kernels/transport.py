"""Dispatch and combine: the rows of x gathered in expert order, and the weighted sum back in
token order.

- ``moe_dispatch_fwd``: the sort of ``align`` (block size 1) gives each slot (t, s) its row
  ``inv[t, s]`` of the permuted matrix; ``_moe_gather_kernel`` copies x[t] there (for decode the
  sort's one program copies the rows itself: one launch).
- ``_moe_combine_kernel``: out[t] = sum over s = 0, 1, ... of w[t, s] * y[inv[t, s]], in fp32 in
  that order, rounded once (no atomics: deterministic). Without weights it is dispatch's
  backward (each token's rows summed).
- ``_moe_combine_bwd_kernel``: one program per slot (t, s): dy[inv[t, s]] = w[t, s] * dout[t] and
  d w[t, s] = dout[t] . y[inv[t, s]] (fp32, over K in blocks in order).
An ``inv`` entry outside [0, R) (R: y's rows) is never used as an address: that slot contributes
nothing (its weight's gradient is 0) and ``BAD_ROW`` is recorded in the device's error flag.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.moe import tuning
from lanekit.moe.kernels.align import expert_order_fwd, split_order
from lanekit.runtime import errors
from lanekit.runtime.alloc import empty
from lanekit.runtime.lanes import triton_interpreted

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

BAD_ROW = errors.register(
    "moe: an inv_permuted_idx entry outside [0, rows of y) (never used as an address: that slot "
    "contributed nothing to the combine)")


@triton.jit
def _moe_gather_kernel(X, stride_xm, stride_xk, INV, P, stride_pm, stride_pk, numel, topk, K,
                       ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    flat = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)          # [ROWS]
    k = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K).to(tl.int64)       # [BLOCK_K]
    in_range = flat < numel
    pos = tl.load(INV + flat, mask=in_range, other=0).to(tl.int64)       # in [0, numel): the sort's
    m = in_range[:, None] & (k < K)[None, :]                              # [ROWS, BLOCK_K]
    rows = tl.load(X + (flat // topk)[:, None] * stride_xm + k[None, :] * stride_xk, mask=m)
    tl.store(P + pos[:, None] * stride_pm + k[None, :] * stride_pk, rows, mask=m)


@triton.jit
def _moe_combine_kernel(Y, stride_ym, stride_yk, W, stride_wm, stride_ws, INV, stride_im,
                        stride_is, OUT, stride_om, stride_ok, R, topk, K, ERR, ERR_BIT,
                        HAS_WEIGHTS: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1)
    k = kb.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K).to(tl.int64)
    kmask = k < K
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for s in range(topk):                                 # in order: the same sum on every run
        row = tl.load(INV + t * stride_im + s * stride_is).to(tl.int64)
        ok = (row >= 0) & (row < R)
        tl.atomic_or(ERR, ERR_BIT, mask=(ok == 0) & (kb == 0))
        # [BLOCK_K]: where, not kmask & ok (Triton 3.9's interpreter refuses a mask & a scalar)
        y = tl.load(Y + row * stride_ym + k * stride_yk, mask=tl.where(ok, kmask, False), other=0.0)
        y = y.to(tl.float32)
        if HAS_WEIGHTS:
            w = tl.load(W + t * stride_wm + s * stride_ws).to(tl.float32)
            acc += w * y
        else:
            acc += y
    tl.store(OUT + t * stride_om + k * stride_ok, acc.to(OUT.dtype.element_ty), mask=kmask)


@triton.jit
def _moe_combine_bwd_kernel(DOUT, stride_dm, stride_dk, Y, stride_ym, stride_yk, W, stride_wm,
                            stride_ws, INV, stride_im, stride_is, DY, stride_gm, stride_gk, DW,
                            R, topk, K, ERR, ERR_BIT, BLOCK_K: tl.constexpr):
    f = tl.program_id(0).to(tl.int64)
    t, s = f // topk, f % topk
    row = tl.load(INV + t * stride_im + s * stride_is).to(tl.int64)
    ok = (row >= 0) & (row < R)
    tl.atomic_or(ERR, ERR_BIT, mask=ok == 0)
    w = tl.load(W + t * stride_wm + s * stride_ws).to(tl.float32)
    dot = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        m = tl.where(ok, k < K, False)       # [BLOCK_K]: Triton 3.9's interpreter refuses a mask & a scalar
        dout = tl.load(DOUT + t * stride_dm + k * stride_dk, mask=m, other=0.0).to(tl.float32)
        y = tl.load(Y + row * stride_ym + k * stride_yk, mask=m, other=0.0).to(tl.float32)
        tl.store(DY + row * stride_gm + k * stride_gk, (w * dout).to(DY.dtype.element_ty), mask=m)
        dot += dout * y
    tl.store(DW + f, tl.sum(dot, axis=0).to(DW.dtype.element_ty))


def _block_k(K, cfg):
    return max(16, min(tuning.next_pow2(max(K, 1)), cfg.row_block))


def moe_dispatch_fwd(*, x, topk_ids, num_experts):
    """x (M, K) any strides, topk_ids int32 (M, topk). Returns (permuted (M * topk, K) in x's
    dtype, one int32 buffer of inv_permuted_idx (M, topk) then offs (E,): align.split_order)."""
    M, topk = topk_ids.shape
    K = x.shape[1]
    numel = M * topk
    permuted = empty((numel, K), dtype=x.dtype, device=x.device)
    order, gathered = expert_order_fwd(topk_ids=topk_ids, num_experts=num_experts, x=x,
                                       permuted=permuted)
    if not gathered and numel and K:
        inv, _ = split_order(order, M, topk)
        cfg = tuning.align_config(x.device)
        block_k = _block_k(K, cfg)
        grid = (tuning.cdiv(numel, cfg.rows), tuning.cdiv(K, block_k))
        _moe_gather_kernel[grid](x, *x.stride(), inv, permuted, *permuted.stride(), numel, topk, K,
                                 ROWS=cfg.rows, BLOCK_K=block_k, num_warps=cfg.num_warps)
    return permuted, order


def moe_combine_fwd(*, y, topk_weights, inv_permuted_idx, out_dtype=None):
    """y (R, K), topk_weights (M, topk) or None (every weight 1: dispatch's backward),
    inv_permuted_idx int32 (M, topk); any strides. Returns (M, K) in out_dtype (y's)."""
    M, topk = inv_permuted_idx.shape
    R, K = y.shape
    out = empty((M, K), dtype=out_dtype or y.dtype, device=y.device)
    if M == 0 or K == 0:
        return out
    cfg = tuning.align_config(y.device)
    block_k = _block_k(K, cfg)
    w = topk_weights if topk_weights is not None else inv_permuted_idx
    _moe_combine_kernel[(M, tuning.cdiv(K, block_k))](
        y, *y.stride(), w, *w.stride(), inv_permuted_idx, *inv_permuted_idx.stride(), out,
        *out.stride(), R, topk, K, errors.error_flag(y.device), BAD_ROW,
        HAS_WEIGHTS=topk_weights is not None, BLOCK_K=block_k, num_warps=cfg.num_warps)
    return out


def moe_combine_bwd(*, dout, y, topk_weights, inv_permuted_idx):
    """The gradients of moe_combine: (dy (R, K) like y, zero in rows no slot names; d topk_weights
    (M, topk) like topk_weights)."""
    M, topk = inv_permuted_idx.shape
    R, K = y.shape
    dy = torch.zeros((R, K), dtype=y.dtype, device=y.device)
    dw = empty((M, topk), dtype=topk_weights.dtype, device=y.device)
    if M == 0:
        return dy, dw
    cfg = tuning.align_config(y.device)
    _moe_combine_bwd_kernel[(M * topk,)](
        dout, *dout.stride(), y, *y.stride(), topk_weights, *topk_weights.stride(),
        inv_permuted_idx, *inv_permuted_idx.stride(), dy, *dy.stride(), dw, R, topk, K,
        errors.error_flag(y.device), BAD_ROW, BLOCK_K=_block_k(K, cfg), num_warps=cfg.num_warps)
    return dy, dw
