"""The grouped GEMM: ``_grouped_mm_fwd_kernel``, out = a[rows of e] @ b[e] for the row groups that
``offs`` delimits, and ``_grouped_mm_bwd_kernel``, db[e] = a[rows of e]^T @ grad[rows of e] (the
weights' gradient: a 2-D x 2-D product whose reduction runs over one group's rows).

The map from a program to (group, tile) is computed on the device from ``offs`` (no host read):
every program loads the E offsets, makes them non-decreasing and clamps them to [0, M_total]
(``_group_bounds``), so that invalid offsets never cause an access out of bounds nor two programs
writing one row; program 0 records invalid offsets in the error flag (lanekit.runtime.errors).
The rows past the last group's end form one more group, E, whose tiles the forward writes with
zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.moe import tuning
from lanekit.runtime import errors
from lanekit.runtime.lanes import triton_interpreted

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

BAD_OFFS = errors.register(
    "grouped_mm: offs not non-decreasing, negative, or not ending at M_total (each group's rows were "
    "clamped to [the previous groups' largest end, M_total]; rows past the clamped last end are zero)")


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    """acc + a @ b: in fp32 (ieee, no TF32) when an operand is fp32, else in a's 16-bit type."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b.to(a.dtype), acc)


@triton.jit
def _group_bounds(OFFS, E, M, BLOCK_E: tl.constexpr):
    """(starts, ends) of the groups 0..E-1 and the tail group E = [end of E-1, M), as [BLOCK_E]
    int64 vectors: the offsets made non-decreasing (a running max) and clamped to [0, M], so the
    groups are disjoint and inside the rows."""
    g = tl.arange(0, BLOCK_E)
    raw = tl.load(OFFS + g, mask=g < E, other=0).to(tl.int64)             # [BLOCK_E]
    raw_prev = tl.load(OFFS + g - 1, mask=(g >= 1) & (g <= E), other=0).to(tl.int64)
    ends = tl.where(g < E, tl.minimum(tl.maximum(raw, 0), M), M)
    starts = tl.minimum(tl.maximum(raw_prev, 0), M)
    ends = tl.associative_scan(ends, 0, _max)
    starts = tl.associative_scan(starts, 0, _max)
    return starts, tl.maximum(ends, starts)


@triton.jit
def _record_bad_offs(OFFS, FLAG, E, M, ERR_BIT: tl.constexpr, BLOCK_E: tl.constexpr, SHORT_OK: tl.constexpr):
    """OR ERR_BIT into FLAG unless the offsets are non-decreasing, non-negative and end at M (at
    most M with SHORT_OK). One program calls it."""
    g = tl.arange(0, BLOCK_E)
    raw = tl.load(OFFS + g, mask=g < E, other=0)
    raw_prev = tl.load(OFFS + g - 1, mask=(g >= 1) & (g < E), other=0)
    bad = (g < E) & ((raw < raw_prev) | (raw < 0))
    if SHORT_OK:
        bad = bad | ((g == E - 1) & (raw > M))
    else:
        bad = bad | ((g == E - 1) & (raw != M))
    tl.atomic_or(FLAG, tl.where(tl.max(bad.to(tl.int32), 0) > 0, ERR_BIT, 0))


@triton.jit
def _row_tiles_bound(M, E, BLOCK_M: tl.constexpr):
    """At most this many row tiles cover the E + 1 groups (the tail too): each group of r > 0 rows
    takes floor(r / BLOCK_M) + 1 tiles at most, and at most min(E + 1, M) groups hold a row."""
    return M // BLOCK_M + tl.minimum(E + 1, M)


@triton.jit
def _grouped_mm_fwd_kernel(A, B, C, OFFS, FLAG, M, N, K, E,
                           stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
                           ERR_BIT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                           DOT_F32: tl.constexpr, EVEN_K: tl.constexpr, SHORT_OK: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = _row_tiles_bound(M, E, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # group-M swizzle: GROUP_M row tiles share each column tile of b while it is in L2
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    if pid == 0:
        _record_bad_offs(OFFS, FLAG, E, M, ERR_BIT, BLOCK_E, SHORT_OK)
    starts, ends = _group_bounds(OFFS, E, M, BLOCK_E)
    g = tl.arange(0, BLOCK_E)
    tiles = tl.where(g <= E, tl.cdiv(ends - starts, BLOCK_M), 0)          # [BLOCK_E]
    cum = tl.cumsum(tiles, 0)
    group = tl.sum((cum <= pid_m).to(tl.int32), 0)   # the first group whose tiles reach past pid_m
    if group > E:
        return
    mine = g == group
    row0 = tl.sum(tl.where(mine, starts, 0), 0) + (pid_m - tl.sum(tl.where(mine, cum - tiles, 0), 0)) * BLOCK_M
    row_end = tl.sum(tl.where(mine, ends, 0), 0)

    rows = row0 + tl.arange(0, BLOCK_M).to(tl.int64)                        # [BLOCK_M]
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)  # [BLOCK_N]
    mask_m = rows < row_end
    mask_n = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if group < E:
        ks = tl.arange(0, BLOCK_K).to(tl.int64)
        a_ptrs = A + rows[:, None] * stride_am + ks[None, :] * stride_ak                 # [BLOCK_M, BLOCK_K]
        b_ptrs = B + group.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=mask_m[:, None] & (ks[None, :] < K - k0), other=0.0)
                b = tl.load(b_ptrs, mask=(ks[:, None] < K - k0) & mask_n[None, :], other=0.0)
            acc = _dot(a, b, acc, DOT_F32)
            a_ptrs += BLOCK_K * tl.cast(stride_ak, tl.int64)
            b_ptrs += BLOCK_K * tl.cast(stride_bk, tl.int64)
    c_ptrs = C + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _grouped_mm_bwd_kernel(X, G, D, OFFS, FLAG, M, K, N, E,
                           stride_xm, stride_xk, stride_gm, stride_gn, stride_de, stride_dk, stride_dn,
                           ERR_BIT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                           SHORT_OK: tl.constexpr):
    pid = tl.program_id(0)
    group = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_k = pid // num_pid_n
    pid_n = pid % num_pid_n
    if (pid == 0) & (group == 0):
        _record_bad_offs(OFFS, FLAG, E, M, ERR_BIT, BLOCK_E, SHORT_OK)
    starts, ends = _group_bounds(OFFS, E, M, BLOCK_E)
    g = tl.arange(0, BLOCK_E)
    start = tl.sum(tl.where(g == group, starts, 0), 0)
    end = tl.sum(tl.where(g == group, ends, 0), 0)

    ks = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K).to(tl.int64)  # [BLOCK_K]
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)  # [BLOCK_N]
    mask_k = ks < K
    mask_n = cols < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):           # a group of no rows leaves zeros
        rows = m0 + tl.arange(0, BLOCK_M).to(tl.int64)                      # [BLOCK_M]
        mask_m = rows < end
        xt = tl.load(X + rows[None, :] * stride_xm + ks[:, None] * stride_xk,
                     mask=mask_k[:, None] & mask_m[None, :], other=0.0)     # [BLOCK_K, BLOCK_M]
        gr = tl.load(G + rows[:, None] * stride_gm + cols[None, :] * stride_gn,
                     mask=mask_m[:, None] & mask_n[None, :], other=0.0)     # [BLOCK_M, BLOCK_N]
        acc = _dot(xt, gr, acc, DOT_F32)
    d_ptrs = D + group.to(tl.int64) * stride_de + ks[:, None] * stride_dk + cols[None, :] * stride_dn
    tl.store(d_ptrs, acc.to(D.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :])


def _dot_f32(*ts) -> bool:
    """Whether the product runs in fp32 (an fp32 operand; ieee precision, no TF32), else in the
    operands' 16-bit type."""
    return any(t.dtype == torch.float32 for t in ts)


def _block_e(E: int) -> int:
    return triton.next_power_of_2(E + 1)


def grouped_mm_fwd(*, a, b, offs, out, short_ok=False, config=None):
    """out (M_total, N) = a (M_total, K) @ b (E, K, N) by the groups of int32 ``offs`` (E,); any
    strides (b may be the transpose of an (E, N, K) tensor); rows past the last group's end are
    written zero. Invalid offs are clamped and recorded in the device's error flag; with
    ``short_ok`` offs may end before M_total (fused_moe's backward puts the slots of experts on other
    ranks there). ``config``: a tile in place of the tuned one (benchmarks/tune_moe.py)."""
    M, K = a.shape
    E, _, N = b.shape
    if M == 0 or N == 0:
        return out
    dot_f32 = _dot_f32(a, b)
    cfg = config or tuning.grouped_mm_config(a.device, E=E, K=K, N=N, M=M,
                                             dtype=torch.float32 if dot_f32 else a.dtype)
    grid = ((M // cfg.block_m + min(E + 1, M)) * triton.cdiv(N, cfg.block_n),)   # _row_tiles_bound
    _grouped_mm_fwd_kernel[grid](
        a, b, out, offs, errors.error_flag(a.device), M, N, K, E, *a.stride(), *b.stride(), *out.stride(),
        ERR_BIT=BAD_OFFS, BLOCK_E=_block_e(E), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, DOT_F32=dot_f32, EVEN_K=K % cfg.block_k == 0,
        SHORT_OK=short_ok, **cfg.options())
    return out


def grouped_mm_bwd(*, a, grad, offs, db, short_ok=False, config=None):
    """db (E, K, N) = for each group e, a[rows of e]^T (K, rows) @ grad[rows of e] (rows, N), for
    a (M_total, K), grad (M_total, N), any strides; a group of no rows gets zeros."""
    M, K = a.shape
    N = grad.shape[1]
    E = db.shape[0]
    if K == 0 or N == 0:
        return db
    dot_f32 = _dot_f32(a, grad)
    cfg = config or tuning.grouped_mm_bwd_config(a.device, E=E, K=K, N=N, M=M,
                                                 dtype=torch.float32 if dot_f32 else a.dtype)
    grid = (triton.cdiv(K, cfg.block_m) * triton.cdiv(N, cfg.block_n), E)
    _grouped_mm_bwd_kernel[grid](
        a, grad, db, offs, errors.error_flag(a.device), M, K, N, E, *a.stride(), *grad.stride(), *db.stride(),
        ERR_BIT=BAD_OFFS, BLOCK_E=_block_e(E), BLOCK_M=cfg.block_k, BLOCK_K=cfg.block_m,
        BLOCK_N=cfg.block_n, DOT_F32=dot_f32, SHORT_OK=short_ok, **cfg.options())
    return db


def fused_moe_bwd(*, dout, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                  apply_router_weight_on_input, expert_map):
    """The gradients (d hidden_states, d w1, d w2, d topk_weights) of vLLM's ``fused_experts``
    (the oracle ``lanekit.reference.moe.fused_moe``) for the output's gradient ``dout`` (M, K).

    The forward's intermediates are recomputed per expert: the M * topk slots sorted by expert
    (stably, as ``moe_dispatch`` does; the slots of experts mapped to -1, or of ids outside the
    experts, go last and past ``offs``' end, so they get nothing and give nothing), then
    h = x @ w1[e]^T, act = act(gate) * up (the layers' GLU kernels, in the activation dtype as the
    forward rounds it), and y = act @ w2[e]^T where d topk_weights needs it. The weights' gradients
    come from the grouped GEMM's weight-gradient kernel; d x sums each token's slots in fp32 in slot
    order (deterministic); d topk_weights[t, s] = dout[t] . y[t, s] in fp32 (with
    apply_router_weight_on_input, d(x * w) . x)."""
    from lanekit.layers.kernels import glu_bwd, glu_fwd
    from lanekit.runtime.alloc import empty

    x = hidden_states
    M, K = x.shape
    E, two_n, _ = w1.shape
    N = two_n // 2
    topk = topk_ids.shape[1]
    R = M * topk
    dt, dev, f32 = x.dtype, x.device, torch.float32
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:   # global -> local; an id outside the map is no expert here
        known = (ids >= 0) & (ids < expert_map.shape[0])
        ids = torch.where(known, expert_map.long()[ids.clamp(0, expert_map.shape[0] - 1)], -1)
    key = torch.where((ids >= 0) & (ids < E), ids, E)                      # (R,): E for none here
    order = torch.sort(key, stable=True).indices                            # slots in expert order
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).index_add_(0, key, torch.ones_like(key))
    offs = counts[:E].cumsum(0).to(torch.int32)
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(R, device=dev))
    token = order // topk
    w_slot = topk_weights.reshape(-1)[order].to(f32)                        # (R,)
    x_rows = x[token]                                                      # (R, K)
    xs = x_rows * w_slot.to(dt)[:, None] if apply_router_weight_on_input else x_rows

    h = grouped_mm_fwd(a=xs, b=w1.transpose(1, 2), offs=offs, out=empty((R, two_n), dtype=dt, device=dev),
                       short_ok=True)
    gate, up = h[:, :N], h[:, N:]
    act = glu_fwd(gate=gate, up=up, activation=activation, out=empty((R, N), dtype=dt, device=dev))
    dout_rows = dout[token]                                                # (R, K)
    dy = dout_rows if apply_router_weight_on_input else (dout_rows.to(f32) * w_slot[:, None]).to(dt)
    dact = grouped_mm_fwd(a=dy, b=w2, offs=offs, out=empty((R, N), dtype=dt, device=dev), short_ok=True)
    dh = empty((R, two_n), dtype=dt, device=dev)
    glu_bwd(dy=dact, gate=gate, up=up, activation=activation, dgate=dh[:, :N], dup=dh[:, N:])
    dw2 = grouped_mm_bwd(a=dy, grad=act, offs=offs, db=empty(tuple(w2.shape), dtype=w2.dtype, device=dev),
                         short_ok=True)
    dw1 = grouped_mm_bwd(a=dh, grad=xs, offs=offs, db=empty(tuple(w1.shape), dtype=w1.dtype, device=dev),
                         short_ok=True)
    dxs = grouped_mm_fwd(a=dh, b=w1, offs=offs, out=empty((R, K), dtype=f32, device=dev), short_ok=True)
    if apply_router_weight_on_input:
        dw_slot = (dxs * x_rows.to(f32)).sum(-1)
        dxs = dxs * w_slot.to(dt).to(f32)[:, None]
    else:
        y = grouped_mm_fwd(a=act, b=w2.transpose(1, 2), offs=offs, out=empty((R, K), dtype=f32, device=dev),
                           short_ok=True)
        dw_slot = (dout_rows.to(f32) * y).sum(-1)
    dx = dxs[inv].view(M, topk, K).sum(1).to(dt)                            # slot order: deterministic
    return dx, dw1, dw2, dw_slot[inv].view(M, topk).to(topk_weights.dtype)
