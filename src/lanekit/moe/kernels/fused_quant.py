"""The fused expert MLP with quantized experts (vLLM's ``fused_experts`` with ``use_fp8_w8a8`` or
``use_int8_w8a16``), over the same aligned blocks as ``fused``:

- ``_fused_moe_quant_kernel`` (and ``_fused_moe_amax_kernel`` for a dynamic per-tensor scale):
  rows of x, or of the intermediate, to e4m3 codes and their scales: per group of 128 columns,
  per row, or per tensor. scale = amax / 448 (1 for an all-zero group), codes = x / scale, both
  correctly rounded (``div_rn``), saturated at +-448 and cast to e4m3 (round half to even).
- ``_fused_moe_quant_gemm1_kernel``: as fused's GEMM1 on codes: fp8 x fp8 ``tl.dot`` accumulating
  in fp32 (W8A16: int8 codes widened to x's dtype in the loads); block scales applied per K step
  (BLOCK_K divides 128), per-tensor and per-channel scales in the epilogue; act(gate) * up
  rounded to x's dtype.
- ``_fused_moe_quant_gemm2_kernel``: the quantized intermediate times w2's codes, scaled the
  same way, times the routing weight, into fp32 per-slot rows that fused's sum pass adds in slot
  order.

Padding rows and the rows of idle blocks (remote or out-of-range experts) are neither read nor
written; offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.common.numerics import cast_codes, finite_abs, quant_scale, quantize
from lanekit.moe import tuning
from lanekit.moe.kernels import fused
from lanekit.runtime.alloc import empty
from lanekit.runtime.lanes import triton_interpreted

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

_block_rows = fused._block_rows
_swizzle = fused._swizzle

# schemes (constexpr SCHEME)
PER_TENSOR, PER_CHANNEL, BLOCK, W8A16 = 0, 1, 2, 3
FP8_MAX = tl.constexpr(448.0)
GROUP = 128          # the block scheme's 128 x 128 blocks; per-token groups of 128 columns of K


@triton.jit
def _row_live(SORTED, EXPERT_IDS, row, num_valid, E, HAS_ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Whether row ``row`` holds data: always for x; for the aligned intermediate, a slot's row
    (not padding) of a block whose expert is on this rank."""
    if HAS_ROWS:
        flat = tl.load(SORTED + row).to(tl.int64)
        expert = tl.load(EXPERT_IDS + row // BLOCK_M).to(tl.int64)
        return (flat >= 0) & (flat < num_valid) & (expert >= 0) & (expert < E)
    return row >= 0


@triton.jit
def _fused_moe_amax_kernel(X, AMAX, SORTED, EXPERT_IDS, stride_xm, stride_xk, C, num_valid, E,
                           HAS_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if not _row_live(SORTED, EXPERT_IDS, row, num_valid, E, HAS_ROWS, BLOCK_M):
        return
    offs = tl.arange(0, BLOCK).to(tl.int64)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK):
        x = tl.load(X + row * stride_xm + (c0 + offs) * stride_xk, mask=offs < C - c0, other=0.0)
        amax = tl.maximum(amax, finite_abs(x.to(tl.float32)))
    tl.atomic_max(AMAX, tl.max(amax, axis=0))   # amax >= 0: order-free; +inf for a NaN or inf


@triton.jit
def _fused_moe_quant_kernel(X, Q, S, AMAX, SORTED, EXPERT_IDS, stride_xm, stride_xk, stride_qm,
                            stride_qk, stride_sm, stride_sk, C, group, num_valid, E,
                            HAS_ROWS: tl.constexpr, TENSOR: tl.constexpr, STATIC: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, group): TENSOR: one scale for all (STATIC: S given; else from AMAX, stored
    in S by program (0, 0)); else the group's own, stored at S[row, g]."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    if TENSOR:
        if STATIC:
            scale = tl.load(S).to(tl.float32)
        else:
            amax = tl.load(AMAX)
            scale = quant_scale(amax, FP8_MAX, 1.0)
            if (row == 0) & (g == 0):     # stored whether or not row 0 holds data
                tl.store(S, scale)
    if not _row_live(SORTED, EXPERT_IDS, row, num_valid, E, HAS_ROWS, BLOCK_M):
        return
    start = g * group
    end = tl.minimum(start + group, C)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    if not TENSOR:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(start, end, BLOCK):
            x = tl.load(X + row * stride_xm + (c0 + offs) * stride_xk, mask=offs < end - c0, other=0.0)
            acc = tl.maximum(acc, finite_abs(x.to(tl.float32)))
        amax = tl.max(acc, axis=0)
        scale = quant_scale(amax, FP8_MAX, 1.0)     # NaN for a group holding a NaN or inf
        tl.store(S + row * stride_sm + g * stride_sk, scale)
    for c0 in range(start, end, BLOCK):
        mask = offs < end - c0
        x = tl.load(X + row * stride_xm + (c0 + offs) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        codes = quantize(tl.math.div_rn(x, scale), FP8_MAX, 2)
        tl.store(Q + row * stride_qm + (c0 + offs) * stride_qk, cast_codes(codes, Q.dtype.element_ty, 2),
                 mask=mask)


@triton.jit
def _fused_moe_quant_gemm1_kernel(X, XS, W1, W1S, A, TOPK_W, SORTED, EXPERT_IDS, NUM_POST,
                                  stride_xm, stride_xk, stride_xsm, stride_xsk,
                                  stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                                  stride_am, stride_an, stride_tw,
                                  N, K, EM, num_blocks, num_valid, E, TOPK: tl.constexpr,
                                  ACT: tl.constexpr, MUL_WEIGHT: tl.constexpr, SCHEME: tl.constexpr,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    pid_m, pid_n = _swizzle(pid, num_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    idle, expert, rows, flat, valid = _block_rows(SORTED, EXPERT_IDS, NUM_POST, pid_m, EM,
                                                  num_valid, E, BLOCK_M)
    if idle:
        return
    token = tl.where(valid, flat // TOPK, 0)                           # [BLOCK_M] rows of x
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)      # [BLOCK_N] gate rows
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    n_mask = offs_n < N
    x_ptrs = X + token[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_base = W1 + expert * stride_we + offs_k[:, None] * stride_wk
    g_ptrs = w_base + offs_n[None, :] * stride_wn
    u_ptrs = w_base + (offs_n[None, :] + N) * stride_wn
    s_base = W1S + expert * stride_se
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        x = tl.load(x_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)       # [BLOCK_M, BLOCK_K]
        w_mask = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(g_ptrs, mask=w_mask, other=0.0)                                  # [BLOCK_K, BLOCK_N]
        wu = tl.load(u_ptrs, mask=w_mask, other=0.0)
        if SCHEME == 3:   # W8A16: int8 codes are exact in bf16/fp16
            wg = wg.to(X.dtype.element_ty)
            wu = wu.to(X.dtype.element_ty)
        if SCHEME == 2:   # block scales: this K step lies in 128-block k0 // 128
            kb = k0 // 128
            xs = tl.load(XS + token * stride_xsm + kb * stride_xsk, mask=valid, other=0.0)
            sg = tl.load(s_base + (offs_n // 128) * stride_sn + kb * stride_sk, mask=n_mask, other=0.0)
            su = tl.load(s_base + ((offs_n + N) // 128) * stride_sn + kb * stride_sk, mask=n_mask, other=0.0)
            acc_g += tl.dot(x, wg, max_num_imprecise_acc=0) * (xs[:, None] * sg[None, :])
            acc_u += tl.dot(x, wu, max_num_imprecise_acc=0) * (xs[:, None] * su[None, :])
        else:
            acc_g = tl.dot(x, wg, acc_g, max_num_imprecise_acc=0)
            acc_u = tl.dot(x, wu, acc_u, max_num_imprecise_acc=0)
        x_ptrs += BLOCK_K * tl.cast(stride_xk, tl.int64)
        g_ptrs += BLOCK_K * tl.cast(stride_wk, tl.int64)
        u_ptrs += BLOCK_K * tl.cast(stride_wk, tl.int64)
    if SCHEME == 0:       # per tensor: x's scale times the expert's
        s = tl.load(XS) * tl.load(s_base)
        acc_g = acc_g * s
        acc_u = acc_u * s
    elif SCHEME == 1:     # per token times per output channel
        xs = tl.load(XS + token * stride_xsm, mask=valid, other=0.0)
        sg = tl.load(s_base + offs_n * stride_sn, mask=n_mask, other=0.0)
        su = tl.load(s_base + (offs_n + N) * stride_sn, mask=n_mask, other=0.0)
        acc_g = acc_g * (xs[:, None] * sg[None, :])
        acc_u = acc_u * (xs[:, None] * su[None, :])
    elif SCHEME == 3:     # per output channel
        sg = tl.load(s_base + offs_n * stride_sn, mask=n_mask, other=0.0)
        su = tl.load(s_base + (offs_n + N) * stride_sn, mask=n_mask, other=0.0)
        acc_g = acc_g * sg[None, :]
        acc_u = acc_u * su[None, :]
    fused._gemm1_epilogue(A, acc_g, acc_u, TOPK_W, flat, stride_tw, rows, offs_n, valid, n_mask,
                          stride_am, stride_an, ACT, MUL_WEIGHT)


@triton.jit
def _fused_moe_quant_gemm2_kernel(A, AS, W2, W2S, Y, TOPK_W, SORTED, EXPERT_IDS, NUM_POST,
                                  stride_am, stride_an, stride_asm, stride_asn,
                                  stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn,
                                  stride_ys, stride_ym, stride_yk, stride_tw,
                                  K, N, EM, num_blocks, num_valid, E, MUL_WEIGHT: tl.constexpr,
                                  SCHEME: tl.constexpr, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr):
    # output columns are the hidden size K (BLOCK_N of them), the reduction is over N (BLOCK_K)
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    pid_m, pid_n = _swizzle(pid, num_blocks, tl.cdiv(K, BLOCK_N), GROUP_M)
    idle, expert, rows, flat, valid = _block_rows(SORTED, EXPERT_IDS, NUM_POST, pid_m, EM,
                                                  num_valid, E, BLOCK_M)
    if idle:
        return
    offs_k = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)      # [BLOCK_N] output columns
    k_mask = offs_k < K
    chunk = tl.cdiv(tl.cdiv(N, SPLIT_K), BLOCK_K) * BLOCK_K            # a multiple of BLOCK_K
    start = split * chunk
    end = tl.minimum(start + chunk, N)
    offs_n = start + tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = A + rows[:, None] * stride_am + offs_n[None, :] * stride_an
    w_ptrs = W2 + expert * stride_we + offs_k[None, :] * stride_wk + offs_n[:, None] * stride_wn
    s_base = W2S + expert * stride_se
    row_ok = valid & (rows < EM)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_K):
        n_mask = offs_n < end - (n0 - start)
        a = tl.load(a_ptrs, mask=valid[:, None] & n_mask[None, :], other=0.0)       # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)        # [BLOCK_K, BLOCK_N]
        if SCHEME == 3:
            w = w.to(A.dtype.element_ty)
        if SCHEME == 2:
            nb = n0 // 128
            as_ = tl.load(AS + rows * stride_asm + nb * stride_asn, mask=row_ok, other=0.0)
            ws = tl.load(s_base + (offs_k // 128) * stride_sk + nb * stride_sn, mask=k_mask, other=0.0)
            acc += tl.dot(a, w, max_num_imprecise_acc=0) * (as_[:, None] * ws[None, :])
        else:
            acc = tl.dot(a, w, acc, max_num_imprecise_acc=0)
        a_ptrs += BLOCK_K * tl.cast(stride_an, tl.int64)
        w_ptrs += BLOCK_K * tl.cast(stride_wn, tl.int64)
    if SCHEME == 0:
        acc = acc * (tl.load(AS) * tl.load(s_base))
    elif SCHEME == 1:
        as_ = tl.load(AS + rows * stride_asm, mask=row_ok, other=0.0)
        ws = tl.load(s_base + offs_k * stride_sk, mask=k_mask, other=0.0)
        acc = acc * (as_[:, None] * ws[None, :])
    elif SCHEME == 3:
        ws = tl.load(s_base + offs_k * stride_sk, mask=k_mask, other=0.0)
        acc = acc * ws[None, :]
    if MUL_WEIGHT:
        wt = tl.load(TOPK_W + flat * stride_tw, mask=valid, other=0.0).to(tl.float32)
        acc = acc * wt[:, None]
    y_ptrs = Y + split * stride_ys + flat[:, None] * stride_ym + offs_k[None, :] * stride_yk
    tl.store(y_ptrs, acc, mask=valid[:, None] & k_mask[None, :])


def scheme_of(use_fp8_w8a8, per_channel_quant, block_shape) -> int:
    if not use_fp8_w8a8:
        return W8A16
    if block_shape is not None:
        return BLOCK
    return PER_CHANNEL if per_channel_quant else PER_TENSOR


def _quantize_rows(x, scheme, static_scale, aligned=None, block_m=1, num_valid=0, E=0, rows=None):
    """e4m3 codes of x (R, C) and their scales per the scheme: (1,) per tensor, (R, 1) per row,
    (R, ceil(C / 128)) per 128 columns. ``aligned``: x is the aligned intermediate; only the rows
    of slots of this rank's experts are read and written (``rows``: how many rows to visit)."""
    R, C = x.shape
    device = x.device
    codes = empty((R, C), dtype=torch.float8_e4m3fn, device=device)
    has_rows = aligned is not None
    sorted_ids, expert_ids = (aligned[0], aligned[1]) if has_rows else (x, x)   # unread without rows
    rows = R if rows is None else rows
    cfg = tuning.FUSED_MOE_QUANT_BLOCK
    if scheme == PER_TENSOR:
        if static_scale is not None:
            scale = static_scale.reshape(1)
            amax = scale
        else:
            scale = empty((1,), dtype=torch.float32, device=device)
            amax = torch.zeros((1,), dtype=torch.float32, device=device)
            if rows:
                _fused_moe_amax_kernel[(rows,)](
                    x, amax, sorted_ids, expert_ids, *x.stride(), C, num_valid, E, HAS_ROWS=has_rows,
                    BLOCK_M=block_m, BLOCK=min(cfg, triton.next_power_of_2(max(C, 16))))
        group, groups, s_strides = C, 1, (0, 0)
    else:
        group = GROUP if scheme == BLOCK else C
        groups = triton.cdiv(C, group)
        scale = empty((R, groups), dtype=torch.float32, device=device)
        s_strides = scale.stride()
        amax = scale
    if rows and C:
        _fused_moe_quant_kernel[(rows, groups)](
            x, codes, scale, amax, sorted_ids, expert_ids, *x.stride(), *codes.stride(), *s_strides,
            C, group, num_valid, E, HAS_ROWS=has_rows, TENSOR=scheme == PER_TENSOR,
            STATIC=static_scale is not None, BLOCK_M=block_m,
            BLOCK=min(cfg, triton.next_power_of_2(max(min(group, C), 16))))
    if scheme == PER_TENSOR and static_scale is None and not (rows and C):
        scale.fill_(1.0)
    return codes, scale


def _scale3(scale, E):
    """A weight scale as (E, rows, cols) strides: per tensor (E,) or (1,) as (E, 1, 1) (stride 0
    for the one scale of all experts), per channel (E, rows, 1), per block as it is."""
    if scale.dim() == 3:
        return scale
    return scale.reshape(-1, 1, 1).expand(E, 1, 1)


def fused_moe_quant_fwd(*, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                        apply_router_weight_on_input, expert_map, out, use_fp8_w8a8,
                        per_channel_quant, block_shape, w1_scale, w2_scale, a1_scale, a2_scale):
    """As ``fused.fused_moe_fwd``, with fp8 e4m3 codes (W8A8) or int8 weight codes (W8A16) and
    their scales (shapes checked by ``lanekit.moe.fused_moe``); writes out (M, K)."""
    M, K = hidden_states.shape
    E, N = w1.shape[0], w2.shape[2]
    topk = topk_ids.shape[1]
    if M == 0 or K == 0:
        return out
    if N == 0:
        return out.zero_()
    scheme = scheme_of(use_fp8_w8a8, per_channel_quant, block_shape)
    device = hidden_states.device
    num_global = expert_map.shape[0] if expert_map is not None else E
    cfg = tuning.fused_moe_quant_config(device, M, K, N)
    sorted_ids, expert_ids, num_post = fused._align(topk_ids, cfg.block_m, num_global, expert_map)
    EM = min(sorted_ids.shape[0], expert_ids.shape[0] * cfg.block_m)
    blocks_m = fused._blocks_in_use(EM, M * topk, num_global, cfg.block_m)
    flat_w = topk_weights.reshape(-1)
    on_input = bool(apply_router_weight_on_input)
    opts = cfg.options()
    if scheme == W8A16:
        x, xs = hidden_states, w1_scale.reshape(-1)[:1]          # xs unread
    else:
        x, xs = _quantize_rows(hidden_states, scheme, a1_scale)
    xs2 = xs if xs.dim() == 2 else xs.reshape(1, 1)
    inter = empty((EM, N), dtype=hidden_states.dtype, device=device)
    w1s = _scale3(w1_scale, E)
    _fused_moe_quant_gemm1_kernel[(blocks_m * triton.cdiv(N, cfg.block_n1),)](
        x, xs2, w1, w1s, inter, flat_w, sorted_ids, expert_ids, num_post,
        *x.stride(), *xs2.stride(), *w1.stride(), *w1s.stride(), *inter.stride(), flat_w.stride(0),
        N, K, EM, blocks_m, M * topk, E, TOPK=topk, ACT=fused.ACTIVATIONS[activation],
        MUL_WEIGHT=on_input, SCHEME=scheme, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1,
        BLOCK_K=cfg.block_k1, GROUP_M=cfg.group_m, **opts)
    if scheme == W8A16:
        a, a_s = inter, w2_scale.reshape(-1)[:1]                 # a_s unread
    else:
        a, a_s = _quantize_rows(inter, scheme, a2_scale, aligned=(sorted_ids, expert_ids),
                                block_m=cfg.block_m, num_valid=M * topk, E=E,
                                rows=min(blocks_m * cfg.block_m, EM))
    as2 = a_s if a_s.dim() == 2 else a_s.reshape(1, 1)
    w2s = _scale3(w2_scale, E)
    split = cfg.split_k2
    y = empty((split, M * topk, K), dtype=torch.float32, device=device)
    _fused_moe_quant_gemm2_kernel[(blocks_m * triton.cdiv(K, cfg.block_n2), split)](
        a, as2, w2, w2s, y, flat_w, sorted_ids, expert_ids, num_post,
        *a.stride(), *as2.stride(), *w2.stride(), *w2s.stride(), *y.stride(), flat_w.stride(0),
        K, N, EM, blocks_m, M * topk, E, MUL_WEIGHT=not on_input, SCHEME=scheme,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2, GROUP_M=cfg.group_m,
        SPLIT_K=split, **opts)
    return fused.sum_slots(y, out, topk_ids, expert_map, E, split)
