"""The fused expert MLP with MXFP4 experts and 16-bit activations (gpt-oss's experts; vLLM's
``mxfp4_w4a16`` scheme), over the same aligned blocks as ``fused``:

- ``_fused_moe_mxfp4_gemm1_kernel``: as fused's GEMM1, w1's gate and up rows decoded from e2m1
  codes (two a byte along K, element 2i in the low nibble) in the B loads: a K step of 32, one
  e8m0 scale per output column a step; the e2m1 values (exact in bf16/fp16) are multiplied by
  ``tl.dot`` in fp32 and each 32-wide partial sum times its scale, as ``mxfp4_linear``; then
  act(gate) * up rounded to x's dtype (fused's epilogue).
- ``_fused_moe_mxfp4_gemm2_kernel``: the intermediate times w2's decoded rows (the reduction over
  N in steps of 32, one scale per output column a step), times the routing weight, into fp32
  per-slot rows that fused's sum pass adds in slot order.

K and N are multiples of 32 (the api checks): no partial scale group. Padding rows and idle
blocks (remote or out-of-range experts) are neither read nor written; offsets are int64; a
column past N (GEMM1) or K (GEMM2) reads code 0 and scale 2^0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.common.numerics import e2m1_pairs_in, e8m0_scale
from lanekit.moe import tuning
from lanekit.moe.kernels import fused
from lanekit.runtime.alloc import empty
from lanekit.runtime.lanes import triton_interpreted

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()

_block_rows = fused._block_rows
_swizzle = fused._swizzle
MX = 32                  # elements per e8m0 scale, along the reduction


@triton.jit
def _mx_tile(W, S, rows, r_mask, k0, stride_wr, stride_wk, stride_sr, stride_sk,
             DTYPE: tl.constexpr, MX_K: tl.constexpr):
    """Rows ``rows`` [BLOCK_N] of an MXFP4 matrix (R, K/2 bytes; R, K/32 scales) at K step k0:
    (values [MX_K, BLOCK_N] in DTYPE, exact; scales [BLOCK_N] fp32)."""
    kb = k0 // 2 + tl.arange(0, MX_K // 2).to(tl.int64)
    byte = tl.load(W + rows[None, :] * stride_wr + kb[:, None] * stride_wk,
                   mask=r_mask[None, :], other=0).to(tl.int32)                     # [MX_K / 2, BLOCK_N]
    e = tl.load(S + rows * stride_sr + (k0 // MX_K) * stride_sk, mask=r_mask, other=127)
    return e2m1_pairs_in(byte, DTYPE), e8m0_scale(e.to(tl.int32))


@triton.jit
def _fused_moe_mxfp4_gemm1_kernel(X, W1, W1S, A, TOPK_W, SORTED, EXPERT_IDS, NUM_POST,
                                  stride_xm, stride_xk, stride_we, stride_wn, stride_wk,
                                  stride_se, stride_sn, stride_sk, stride_am, stride_an, stride_tw,
                                  N, K, EM, num_blocks, num_valid, E, TOPK: tl.constexpr,
                                  ACT: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  MX_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    pid_m, pid_n = _swizzle(pid, num_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    idle, expert, rows, flat, valid = _block_rows(SORTED, EXPERT_IDS, NUM_POST, pid_m, EM,
                                                  num_valid, E, BLOCK_M)
    if idle:
        return
    dtype = X.dtype.element_ty
    token = tl.where(valid, flat // TOPK, 0)                           # [BLOCK_M] rows of x
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)      # [BLOCK_N] gate rows
    offs_k = tl.arange(0, MX_K).to(tl.int64)
    n_mask = offs_n < N
    x_ptrs = X + token[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w = W1 + expert * stride_we
    s = W1S + expert * stride_se
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, MX_K):                                       # K % 32 == 0: no K mask
        x = tl.load(x_ptrs, mask=valid[:, None], other=0.0)           # [BLOCK_M, MX_K]
        wg, sg = _mx_tile(w, s, offs_n, n_mask, k0, stride_wn, stride_wk, stride_sn, stride_sk, dtype, MX_K)
        wu, su = _mx_tile(w, s, offs_n + N, n_mask, k0, stride_wn, stride_wk, stride_sn, stride_sk, dtype, MX_K)
        acc_g += tl.dot(x, wg) * sg[None, :]                           # each 32-wide sum times its scale
        acc_u += tl.dot(x, wu) * su[None, :]
        x_ptrs += MX_K * tl.cast(stride_xk, tl.int64)
    fused._gemm1_epilogue(A, acc_g, acc_u, TOPK_W, flat, stride_tw, rows, offs_n, valid, n_mask,
                          stride_am, stride_an, ACT, MUL_WEIGHT)


@triton.jit
def _fused_moe_mxfp4_gemm2_kernel(A, W2, W2S, Y, TOPK_W, SORTED, EXPERT_IDS, NUM_POST,
                                  stride_am, stride_an, stride_we, stride_wk, stride_wn,
                                  stride_se, stride_sk, stride_sn, stride_ys, stride_ym, stride_yk,
                                  stride_tw, K, N, EM, num_blocks, num_valid, E,
                                  MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr, MX_K: tl.constexpr,
                                  GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr):
    # output columns are the hidden size K (BLOCK_N of them), the reduction is over N (MX_K a step)
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    pid_m, pid_n = _swizzle(pid, num_blocks, tl.cdiv(K, BLOCK_N), GROUP_M)
    idle, expert, rows, flat, valid = _block_rows(SORTED, EXPERT_IDS, NUM_POST, pid_m, EM,
                                                  num_valid, E, BLOCK_M)
    if idle:
        return
    dtype = A.dtype.element_ty
    offs_k = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)      # [BLOCK_N] output columns
    k_mask = offs_k < K
    chunk = tl.cdiv(tl.cdiv(N, SPLIT_K), MX_K) * MX_K                  # a multiple of 32
    start = split * chunk
    end = tl.minimum(start + chunk, N)
    offs_n = tl.arange(0, MX_K).to(tl.int64)
    w = W2 + expert * stride_we
    s = W2S + expert * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for n0 in range(start, end, MX_K):                                 # N % 32 == 0: whole steps
        a = tl.load(A + rows[:, None] * stride_am + (n0 + offs_n)[None, :] * stride_an,
                    mask=valid[:, None], other=0.0)                    # [BLOCK_M, MX_K]
        b, sb = _mx_tile(w, s, offs_k, k_mask, n0, stride_wk, stride_wn, stride_sk, stride_sn, dtype, MX_K)
        acc += tl.dot(a, b) * sb[None, :]
    if MUL_WEIGHT:
        wt = tl.load(TOPK_W + flat * stride_tw, mask=valid, other=0.0).to(tl.float32)
        acc = acc * wt[:, None]
    y_ptrs = Y + split * stride_ys + flat[:, None] * stride_ym + offs_k[None, :] * stride_yk
    tl.store(y_ptrs, acc, mask=valid[:, None] & k_mask[None, :])


def fused_moe_mxfp4_fwd(*, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                        apply_router_weight_on_input, expert_map, out, w1_scale, w2_scale):
    """As ``fused.fused_moe_fwd`` with MXFP4 experts: w1 uint8 (E, 2N, K/2), w2 uint8 (E, K, N/2),
    w1_scale uint8 (E, 2N, K/32), w2_scale uint8 (E, K, N/32) (checked by lanekit.moe.fused_moe);
    writes out (M, K)."""
    M, K = hidden_states.shape
    E, N = w1.shape[0], w2.shape[2] * 2
    topk = topk_ids.shape[1]
    if M == 0 or K == 0:
        return out
    if N == 0:
        return out.zero_()
    device = hidden_states.device
    num_global = expert_map.shape[0] if expert_map is not None else E
    cfg = tuning.fused_moe_mxfp4_config(device, M, K, N)
    sorted_ids, expert_ids, num_post = fused._align(topk_ids, cfg.block_m, num_global, expert_map)
    EM = min(sorted_ids.shape[0], expert_ids.shape[0] * cfg.block_m)
    blocks_m = fused._blocks_in_use(EM, M * topk, num_global, cfg.block_m)
    flat_w = topk_weights.reshape(-1)
    on_input = bool(apply_router_weight_on_input)
    opts = cfg.options()
    inter = empty((EM, N), dtype=hidden_states.dtype, device=device)
    _fused_moe_mxfp4_gemm1_kernel[(blocks_m * triton.cdiv(N, cfg.block_n1),)](
        hidden_states, w1, w1_scale, inter, flat_w, sorted_ids, expert_ids, num_post,
        *hidden_states.stride(), *w1.stride(), *w1_scale.stride(), *inter.stride(), flat_w.stride(0),
        N, K, EM, blocks_m, M * topk, E, TOPK=topk, ACT=fused.ACTIVATIONS[activation],
        MUL_WEIGHT=on_input, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, MX_K=MX,
        GROUP_M=cfg.group_m, **opts)
    split = cfg.split_k2
    y = empty((split, M * topk, K), dtype=torch.float32, device=device)
    _fused_moe_mxfp4_gemm2_kernel[(blocks_m * triton.cdiv(K, cfg.block_n2), split)](
        inter, w2, w2_scale, y, flat_w, sorted_ids, expert_ids, num_post,
        *inter.stride(), *w2.stride(), *w2_scale.stride(), *y.stride(), flat_w.stride(0),
        K, N, EM, blocks_m, M * topk, E, MUL_WEIGHT=not on_input, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n2, MX_K=MX, GROUP_M=cfg.group_m, SPLIT_K=split, **opts)
    return fused.sum_slots(y, out, topk_ids, expert_map, E, split)
