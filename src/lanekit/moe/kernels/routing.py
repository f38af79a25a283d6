"""Routing: each token's top-k experts and their weights, BLOCK_M tokens a program, every expert's
score of a token in registers (E up to 512 in one [BLOCK_M, BLOCK_E] tile).

- ``_topk_softmax_kernel``: the softmax over experts in fp32, then the top-k by repeated arg-max
  (equal scores: the lower expert id), optionally renormalized over the chosen.
- ``_grouped_topk_kernel``: DeepSeek-V3's group-limited routing: softmax or sigmoid scores, the
  choice made on scores + bias, the best ``topk_group`` groups (each scored by its best or, with
  the bias, its two best choice scores; equal: the lower group id), then the top-k experts among
  them; the weights are the unbiased scores.
Both write the k picks highest first, as the oracle orders them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.moe import tuning
from lanekit.runtime.alloc import empty
from lanekit.runtime.lanes import triton_interpreted

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()


@triton.jit
def _scores(X, stride_xm, stride_xe, M, E, SIGMOID: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_E: tl.constexpr):
    """(rows, cols, row mask, col mask, scores fp32 [BLOCK_M, BLOCK_E]): softmax (or sigmoid) of
    this program's tokens; columns past E score 0."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < M
    cmask = cols < E
    m = rmask[:, None] & cmask[None, :]
    x = tl.load(X + rows[:, None] * stride_xm + cols.to(tl.int64)[None, :] * stride_xe, mask=m,
                other=-float("inf")).to(tl.float32)
    if SIGMOID:
        s = tl.where(m, tl.sigmoid(x), 0.0)
    else:
        top = tl.max(x, axis=1)
        top = tl.where(rmask, top, 0.0)     # a row past M (padding only); a real row of -inf gives NaN, as torch
        p = tl.where(m, tl.exp(x - top[:, None]), 0.0)
        total = tl.sum(p, axis=1)
        s = p / tl.where(total == 0.0, 1.0, total)[:, None]
    return rows, cols, rmask, cmask, s


@triton.jit
def _arg_max(v, cols, BIG: tl.constexpr):
    """(max, index) of each row of v, equal values to the lower index. NaN ranks above every
    number, as in torch.sort (the oracle's): NaN never equals the max, so without this the index
    would be BIG, out of [0, E)."""
    key = tl.where(v != v, float("inf"), v)
    idx = tl.min(tl.where(key == tl.max(key, axis=1)[:, None], cols[None, :], BIG), axis=1)
    best = tl.sum(tl.where(cols[None, :] == idx[:, None], v, 0.0), axis=1)    # v at idx, NaN kept
    return best, idx


@triton.jit
def _arg_max_of(v, avail, cols, BIG: tl.constexpr):
    """The index of each row's max of v among the entries where avail != 0, equal values (-inf
    and NaN included, NaN above every number) to the lowest such index. Taken entries are marked
    in avail, not by a value: a value could tie with a real -inf score and be taken twice."""
    ok = avail != 0
    key = tl.where(ok, tl.where(v != v, float("inf"), v), -float("inf"))
    return tl.min(tl.where(ok & (key == tl.max(key, axis=1)[:, None]), cols[None, :], BIG), axis=1)


@triton.jit
def _store_topk(W, stride_wm, stride_wk, IDS, stride_im, stride_ik, rows, rmask, weights, ids,
                topk, TOPK: tl.constexpr):
    kcol = tl.arange(0, TOPK)
    m = rmask[:, None] & (kcol < topk)[None, :]
    k64 = kcol.to(tl.int64)[None, :]
    tl.store(W + rows[:, None] * stride_wm + k64 * stride_wk, weights, mask=m)
    tl.store(IDS + rows[:, None] * stride_im + k64 * stride_ik, ids, mask=m)


@triton.jit
def _topk_softmax_kernel(X, stride_xm, stride_xe, W, stride_wm, stride_wk, IDS, stride_im, stride_ik,
                         M, E, topk, RENORMALIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_E: tl.constexpr, TOPK: tl.constexpr):
    rows, cols, rmask, cmask, s = _scores(X, stride_xm, stride_xe, M, E, False, BLOCK_M, BLOCK_E)
    left = tl.where(cmask[None, :], s, -1.0)            # [BLOCK_M, BLOCK_E]: padding never chosen
    kcol = tl.arange(0, TOPK)
    weights = tl.zeros([BLOCK_M, TOPK], dtype=tl.float32)
    ids = tl.zeros([BLOCK_M, TOPK], dtype=tl.int32)
    for j in range(topk):
        best, idx = _arg_max(left, cols, BLOCK_E)
        weights = tl.where(kcol[None, :] == j, best[:, None], weights)
        ids = tl.where(kcol[None, :] == j, idx[:, None], ids)
        left = tl.where(cols[None, :] == idx[:, None], -2.0, left)
    if RENORMALIZE:
        total = tl.sum(weights, axis=1)
        weights = weights / tl.where(total == 0.0, 1.0, total)[:, None]    # rows past M: all 0
    _store_topk(W, stride_wm, stride_wk, IDS, stride_im, stride_ik, rows, rmask, weights, ids, topk, TOPK)


@triton.jit
def _grouped_topk_kernel(X, stride_xm, stride_xe, BIAS, stride_b, W, stride_wm, stride_wk, IDS,
                         stride_im, stride_ik, M, E, topk, num_groups, group_size, topk_group,
                         scaling, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                         RENORMALIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_G: tl.constexpr, TOPK: tl.constexpr):
    rows, cols, rmask, cmask, s = _scores(X, stride_xm, stride_xe, M, E, SIGMOID, BLOCK_M, BLOCK_E)
    NEG: tl.constexpr = -float("inf")
    choice = s
    if HAS_BIAS:
        bias = tl.load(BIAS + cols.to(tl.int64) * stride_b, mask=cmask, other=0.0).to(tl.float32)
        choice = s + bias[None, :]
    choice = tl.where(cmask[None, :], choice, NEG)                 # [BLOCK_M, BLOCK_E]
    group = cols // group_size                                      # [BLOCK_E]
    gcols = tl.arange(0, BLOCK_G)
    group_scores = tl.full([BLOCK_M, BLOCK_G], NEG, tl.float32)
    for g in range(num_groups):
        mine = (group == g)[None, :] & cmask[None, :]
        in_group = tl.where(mine, choice, NEG)
        best, idx = _arg_max(in_group, cols, BLOCK_E)
        score = best
        if HAS_BIAS:                                                # the sum of its two best
            second = tl.max(tl.where(cols[None, :] == idx[:, None], NEG, in_group), axis=1)
            score = best + tl.where(second == NEG, 0.0, second)    # a group of one expert: its best
        group_scores = tl.where(gcols[None, :] == g, score[:, None], group_scores)
    keep = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.int32)
    gavail = tl.where(gcols[None, :] < num_groups, 1, 0) + tl.zeros([BLOCK_M, BLOCK_G], dtype=tl.int32)
    for j in range(topk_group):
        gbest = _arg_max_of(group_scores, gavail, gcols, BLOCK_G)
        gavail = tl.where(gcols[None, :] == gbest[:, None], 0, gavail)
        keep = tl.where(group[None, :] == gbest[:, None], 1, keep)
    avail = tl.where(cmask[None, :], keep, 0)                       # the kept groups' experts
    kcol = tl.arange(0, TOPK)
    weights = tl.zeros([BLOCK_M, TOPK], dtype=tl.float32)
    ids = tl.zeros([BLOCK_M, TOPK], dtype=tl.int32)
    for j in range(topk):
        idx = _arg_max_of(choice, avail, cols, BLOCK_E)
        w = tl.sum(tl.where(cols[None, :] == idx[:, None], s, 0.0), axis=1)   # the unbiased score
        weights = tl.where(kcol[None, :] == j, w[:, None], weights)
        ids = tl.where(kcol[None, :] == j, idx[:, None], ids)
        avail = tl.where(cols[None, :] == idx[:, None], 0, avail)
    if RENORMALIZE:
        total = tl.sum(weights, axis=1)
        weights = weights / tl.where(total == 0.0, 1.0, total)[:, None]    # rows past M: all 0
    weights = weights * scaling
    _store_topk(W, stride_wm, stride_wk, IDS, stride_im, stride_ik, rows, rmask, weights, ids, topk, TOPK)


def _launch(gating_output, topk):
    M, E = gating_output.shape
    cfg = tuning.routing_config(gating_output.device, E)
    weights = empty((M, topk), dtype=torch.float32, device=gating_output.device)
    ids = empty((M, topk), dtype=torch.int32, device=gating_output.device)
    return cfg, weights, ids, (tuning.cdiv(M, cfg.block_m),)


def topk_softmax_fwd(*, gating_output, topk, renormalize):
    """gating_output (M, E) fp16/bf16/fp32, any strides. Returns (topk_weights fp32 (M, topk),
    topk_ids int32 (M, topk))."""
    M, E = gating_output.shape
    cfg, weights, ids, grid = _launch(gating_output, topk)
    if M:
        _topk_softmax_kernel[grid](gating_output, *gating_output.stride(), weights, *weights.stride(),
                                   ids, *ids.stride(), M, E, topk, RENORMALIZE=renormalize,
                                   BLOCK_M=cfg.block_m, BLOCK_E=tuning.next_pow2(E),
                                   TOPK=tuning.next_pow2(topk), num_warps=cfg.num_warps)
    return weights, ids


def grouped_topk_fwd(*, gating_output, topk, num_expert_group, topk_group, renormalize,
                     scoring_func, e_score_correction_bias, routed_scaling_factor):
    M, E = gating_output.shape
    cfg, weights, ids, grid = _launch(gating_output, topk)
    if M:
        bias = e_score_correction_bias
        _grouped_topk_kernel[grid](
            gating_output, *gating_output.stride(), bias if bias is not None else gating_output,
            bias.stride(0) if bias is not None else 0, weights, *weights.stride(), ids, *ids.stride(),
            M, E, topk, num_expert_group, E // num_expert_group, topk_group,
            float(routed_scaling_factor), SIGMOID=scoring_func == "sigmoid", HAS_BIAS=bias is not None,
            RENORMALIZE=renormalize, BLOCK_M=cfg.block_m, BLOCK_E=tuning.next_pow2(E),
            BLOCK_G=tuning.next_pow2(num_expert_group), TOPK=tuning.next_pow2(topk),
            num_warps=cfg.num_warps)
    return weights, ids
