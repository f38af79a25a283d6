"""The fused expert MLP (vLLM's ``fused_experts``, unquantized): three launches over the tokens
aligned by expert in blocks of BLOCK_M rows (``moe_align_block_size``):

- ``_fused_moe_gemm1_kernel``: a block of aligned rows of one expert times that expert's gate and
  up rows of w1 (two accumulators), the gather of the tokens' rows of x fused into its loads and
  act(gate) * up into its epilogue; writes the intermediate (EM, N), rounded to x's dtype, at the
  rows' aligned positions.
- ``_fused_moe_gemm2_kernel``: the intermediate times w2[e]^T, scaled by the routing weight (unless
  it was applied on the input), written in fp32 per (token, slot) row and per split of the
  reduction over N (SPLIT_K).
- ``_fused_moe_sum_kernel``: each token's slots s = 0, 1, ... and splits in order, summed in fp32
  and rounded once: deterministic, no atomics. It reads topk_ids (and expert_map), so it is the
  one place where ids out of range are recorded in the device's error flag; their rows, and the
  rows of remote experts (expert_map -1), count zero and are never read.

Padding rows (the sentinel M * topk) are masked in every load and store; blocks past
num_tokens_post_padded, and blocks of experts not on this rank or out of range, return at once.
Offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.common.numerics import sigmoid
from lanekit.moe import tuning
from lanekit.moe.kernels.align import align_lengths, moe_align_block_size_fwd, split_align_output
from lanekit.runtime import errors
from lanekit.runtime.alloc import empty
from lanekit.runtime.lanes import triton_interpreted

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

ACTIVATIONS = {"silu": 0, "gelu": 1}
_INV_SQRT_2 = tl.constexpr(0.7071067811865476)

# The device-side error fused_moe records (lanekit.runtime.errors).
BAD_EXPERT_ID = errors.register(
    "fused_moe: an id of topk_ids outside [0, E) (E: expert_map's length when given), or an "
    "expert_map entry outside [-1, E_local): that slot counted zero, nothing was read for it")


@triton.jit
def _block_rows(SORTED, EXPERT_IDS, NUM_POST, pid_m, EM, num_valid, E, BLOCK_M: tl.constexpr):
    """(idle, expert, rows, flat, valid) of aligned block pid_m: idle for a block past the padded
    length or of an expert not here (remote, or out of range); flat are its rows' flat indices
    (t * topk + s), valid masks the padding (sentinel) rows."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)        # [BLOCK_M]
    num_post = tl.load(NUM_POST).to(tl.int64)
    expert = tl.load(EXPERT_IDS + pid_m).to(tl.int64)               # pid_m < num_blocks <= cdiv(EM, BLOCK_M)
    idle = (pid_m * BLOCK_M >= num_post) | (expert < 0) | (expert >= E)
    flat = tl.load(SORTED + rows, mask=rows < EM, other=num_valid).to(tl.int64)
    valid = (flat < num_valid) & (flat >= 0)
    return idle, expert, rows, flat, valid


@triton.jit
def _swizzle(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n): programs walk GROUP_M row blocks for each column block, so that a group's
    weight tiles are reused from L2."""
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    return pid_m, pid_n


@triton.jit
def _gemm1_epilogue(A, acc_g, acc_u, TOPK_W, flat, stride_tw, rows, offs_n, valid, n_mask,
                    stride_am, stride_an, ACT: tl.constexpr, MUL_WEIGHT: tl.constexpr):
    """GEMM1's epilogue (also the quantized GEMM1's): the router weight on the input if asked,
    (w x) W = w (x W), then act(gate) * up rounded to A's dtype and stored per sorted row."""
    if MUL_WEIGHT:
        w = tl.load(TOPK_W + flat * stride_tw, mask=valid, other=0.0).to(tl.float32)
        acc_g = acc_g * w[:, None]
        acc_u = acc_u * w[:, None]
    if ACT == 0:
        act = acc_g * sigmoid(acc_g)
    else:
        act = 0.5 * acc_g * (1.0 + tl.erf(acc_g * _INV_SQRT_2))
    a_ptrs = A + rows[:, None] * stride_am + offs_n[None, :] * stride_an        # [BLOCK_M, BLOCK_N]
    tl.store(a_ptrs, (act * acc_u).to(A.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _fused_moe_gemm1_kernel(X, W1, A, TOPK_W, SORTED, EXPERT_IDS, NUM_POST,
                            stride_xm, stride_xk, stride_we, stride_wn, stride_wk,
                            stride_am, stride_an, stride_tw,
                            N, K, EM, num_blocks, num_valid, E, TOPK: tl.constexpr, ACT: tl.constexpr,
                            MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    pid_m, pid_n = _swizzle(pid, num_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    idle, expert, rows, flat, valid = _block_rows(SORTED, EXPERT_IDS, NUM_POST, pid_m, EM,
                                                  num_valid, E, BLOCK_M)
    if idle:
        return
    token = tl.where(valid, flat // TOPK, 0)                           # [BLOCK_M] rows of x
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)      # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)                        # [BLOCK_K]
    x_ptrs = X + token[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_base = W1 + expert * stride_we + offs_k[:, None] * stride_wk
    g_ptrs = w_base + offs_n[None, :] * stride_wn
    u_ptrs = w_base + (offs_n[None, :] + N) * stride_wn                # the up rows follow the gate rows
    n_mask = offs_n < N
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        x = tl.load(x_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)       # [BLOCK_M, BLOCK_K]
        w_mask = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(g_ptrs, mask=w_mask, other=0.0)                                # [BLOCK_K, BLOCK_N]
        wu = tl.load(u_ptrs, mask=w_mask, other=0.0)
        acc_g = tl.dot(x, wg, acc_g)
        acc_u = tl.dot(x, wu, acc_u)
        x_ptrs += BLOCK_K * tl.cast(stride_xk, tl.int64)
        g_ptrs += BLOCK_K * tl.cast(stride_wk, tl.int64)
        u_ptrs += BLOCK_K * tl.cast(stride_wk, tl.int64)
    _gemm1_epilogue(A, acc_g, acc_u, TOPK_W, flat, stride_tw, rows, offs_n, valid, n_mask,
                    stride_am, stride_an, ACT, MUL_WEIGHT)


@triton.jit
def _fused_moe_gemm2_kernel(A, W2, Y, TOPK_W, SORTED, EXPERT_IDS, NUM_POST,
                            stride_am, stride_an, stride_we, stride_wk, stride_wn,
                            stride_ys, stride_ym, stride_yk, stride_tw,
                            K, N, EM, num_blocks, num_valid, E, MUL_WEIGHT: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
    chunk = tl.cdiv(tl.cdiv(N, SPLIT_K), BLOCK_K) * BLOCK_K            # this split's share of N
    start = split * chunk
    end = tl.minimum(start + chunk, N)
    offs_n = start + tl.arange(0, BLOCK_K).to(tl.int64)                # [BLOCK_K] reduction index
    a_ptrs = A + rows[:, None] * stride_am + offs_n[None, :] * stride_an
    w_ptrs = W2 + expert * stride_we + offs_k[None, :] * stride_wk + offs_n[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_K):
        n_mask = offs_n < end - (n0 - start)
        a = tl.load(a_ptrs, mask=valid[:, None] & n_mask[None, :], other=0.0)       # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)      # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K * tl.cast(stride_an, tl.int64)
        w_ptrs += BLOCK_K * tl.cast(stride_wn, tl.int64)
    if MUL_WEIGHT:
        wt = tl.load(TOPK_W + flat * stride_tw, mask=valid, other=0.0).to(tl.float32)
        acc = acc * wt[:, None]
    y_ptrs = Y + split * stride_ys + flat[:, None] * stride_ym + offs_k[None, :] * stride_yk
    tl.store(y_ptrs, acc, mask=valid[:, None] & k_mask[None, :])


@triton.jit
def _fused_moe_sum_kernel(Y, OUT, IDS, EXPERT_MAP, FLAG, stride_ys, stride_ym, stride_yk,
                          stride_om, stride_ok, stride_it, stride_is, K, E_global, E_local, bad_bit,
                          TOPK: tl.constexpr, SPLIT_K: tl.constexpr, HAS_MAP: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1)
    cols = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K).to(tl.int64)  # [BLOCK_K]
    c_mask = cols < K
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    bad = 0
    for s in tl.static_range(TOPK):
        e = tl.load(IDS + t * stride_it + s * stride_is).to(tl.int64)
        in_range = (e >= 0) & (e < E_global)
        if HAS_MAP:
            e = tl.load(EXPERT_MAP + tl.where(in_range, e, 0)).to(tl.int64)
            ok = in_range & (e >= -1) & (e < E_local)
        else:
            ok = in_range
        bad += tl.where(ok, 0, 1)
        live = ok & (e >= 0)
        for split in tl.static_range(SPLIT_K):
            # where, not c_mask & live: Triton 3.9's interpreter refuses a mask & a scalar
            y = tl.load(Y + split * stride_ys + (t * TOPK + s) * stride_ym + cols * stride_yk,
                        mask=tl.where(live, c_mask, False), other=0.0)
            acc += y
    tl.store(OUT + t * stride_om + cols * stride_ok, acc.to(OUT.dtype.element_ty), mask=c_mask)
    tl.atomic_or(FLAG, bad_bit, mask=(bad > 0) & (pid_k == 0))


def _align(topk_ids, block_m, num_experts, expert_map):
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) of vLLM's moe_align_block_size, by
    the align's Triton kernel (one launch at decode; no sync)."""
    out = moe_align_block_size_fwd(topk_ids=topk_ids, block_size=block_m, num_experts=num_experts,
                                   expert_map=expert_map)
    return split_align_output(out, *align_lengths(topk_ids.numel(), block_m, num_experts))


def _blocks_in_use(EM, slots, num_experts, block_m):
    """The most aligned blocks that can hold a slot, from shapes alone (no sync): an expert with
    c slots takes ceil(c / block_m) <= floor(c / block_m) + 1 blocks, and at most min(E, slots)
    experts have one, so slots // block_m + min(E, slots) (8 at decode with top-8, where the
    padded length would give E). The align puts them first; the grid covers only them."""
    return min(triton.cdiv(EM, block_m), slots // block_m + min(num_experts, slots))


def fused_moe_block_m(hidden_states, w1, w2) -> int:
    """The align's block size (rows of one expert) that fused_moe_fwd uses for these shapes."""
    return tuning.fused_moe_config(hidden_states.device, hidden_states.shape[0], w1.shape[2],
                                   w2.shape[2]).block_m


def fused_moe_fwd(*, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                  apply_router_weight_on_input, expert_map, out, aligned=None):
    """hidden_states (M, K), w1 (E, 2N, K), w2 (E, K, N), topk_weights (M, topk),
    topk_ids int32 (M, topk), expert_map int32 (E_global,) or None; writes out (M, K).
    ``aligned``: the align's result for these ids at :func:`fused_moe_block_m`'s block size,
    computed once by a caller that reuses it (the benchmark times the kernels alone so)."""
    M, K = hidden_states.shape
    E, N = w1.shape[0], w2.shape[2]
    topk = topk_ids.shape[1]
    if M == 0 or K == 0:
        return out
    if N == 0:
        return out.zero_()
    device = hidden_states.device
    num_global = expert_map.shape[0] if expert_map is not None else E
    cfg = tuning.fused_moe_config(device, M, K, N)
    if aligned is None:
        aligned = _align(topk_ids, cfg.block_m, num_global, expert_map)
    sorted_ids, expert_ids, num_post = aligned
    EM = min(sorted_ids.shape[0], expert_ids.shape[0] * cfg.block_m)   # every block has its expert id
    flat_w = topk_weights.reshape(-1)            # (M * topk,): a view (checked contiguous rows)
    on_input = bool(apply_router_weight_on_input)
    opts = cfg.options()
    inter = empty((EM, N), dtype=hidden_states.dtype, device=device)
    blocks_m = _blocks_in_use(EM, M * topk, num_global, cfg.block_m)
    _fused_moe_gemm1_kernel[(blocks_m * triton.cdiv(N, cfg.block_n1),)](
        hidden_states, w1, inter, flat_w, sorted_ids, expert_ids, num_post,
        *hidden_states.stride(), *w1.stride(), *inter.stride(), flat_w.stride(0),
        N, K, EM, blocks_m, M * topk, E, TOPK=topk, ACT=ACTIVATIONS[activation], MUL_WEIGHT=on_input,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k1, GROUP_M=cfg.group_m, **opts)
    split = cfg.split_k2
    y = empty((split, M * topk, K), dtype=torch.float32, device=device)
    _fused_moe_gemm2_kernel[(blocks_m * triton.cdiv(K, cfg.block_n2), split)](
        inter, w2, y, flat_w, sorted_ids, expert_ids, num_post,
        *inter.stride(), *w2.stride(), *y.stride(), flat_w.stride(0),
        K, N, EM, blocks_m, M * topk, E, MUL_WEIGHT=not on_input,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2, GROUP_M=cfg.group_m,
        SPLIT_K=split, **opts)
    return sum_slots(y, out, topk_ids, expert_map, E, split)


def sum_slots(y, out, topk_ids, expert_map, E, split):
    """The last pass of every fused_moe path: out (M, K) = each token's slots' rows of y (and their
    split-K parts) summed in fp32, in order (_fused_moe_sum_kernel). Returns out."""
    M, K = out.shape
    device = out.device
    num_global = expert_map.shape[0] if expert_map is not None else E
    # the kernel reads expert_map[e] at EXPERT_MAP + e (as the align does): a strided view as its copy
    emap = expert_map.contiguous() if expert_map is not None else topk_ids   # unread without HAS_MAP
    block_k = tuning.fused_moe_sum_block(device, K)
    _fused_moe_sum_kernel[(M, triton.cdiv(K, block_k))](
        y, out, topk_ids, emap, errors.error_flag(device), *y.stride(), *out.stride(), *topk_ids.stride(),
        K, num_global, E, BAD_EXPERT_ID, TOPK=topk_ids.shape[1], SPLIT_K=split, HAS_MAP=expert_map is not None,
        BLOCK_K=block_k, num_warps=tuning.FUSED_MOE_SUM_WARPS)
    return out
