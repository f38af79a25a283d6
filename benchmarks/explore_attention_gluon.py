"""Issue 35's Gluon candidate: an sm90 attention forward written against Hopper's own instructions
(TMA copies into a ring of shared-memory buffers, mbarriers, asynchronous warpgroup MMA), timed by
``benchmarks.explore_attention_sm90`` beside the ``tl`` variants and cuDNN.

Two designs, the steps FlashAttention-3's ablation measures:

- ``pipelined``: one set of warps (8: two warpgroups over 128 query rows) issues the TMA loads of
  K and V ``STAGES - 1`` key blocks ahead into a ring of buffers and computes each block's
  S = Q K^T (wgmma, Q and K from shared memory), the online softmax in registers, and O += P V
  (wgmma, P from registers). The loads overlap the math; the math does not overlap itself.
- ``warp_specialized``: the same math in the default partition; one producer warp (24
  registers) issues the TMA loads, the ring's buffers handed over by an empty / ready mbarrier
  pair each (``gl.warp_specialize``).

Not yet built (the next steps once these are measured): issuing the next block's Q K^T before this
block's softmax (intra-warpgroup overlap), two consumer warpgroups in ping-pong, setmaxnreg
rebalancing beyond the worker's 24 registers.

Scope of the experiment: bf16, q, k, v, o (B, H, S, D) contiguous, S a multiple of the tiles,
D 64 or 128, causal or not (the diagonal blocks masked), no other option. Neither design has run
on a GPU when this was written (2026-12-07): each is compiled for sm90 by ``--compile-only`` and
its output compared with SDPA's before it is timed. This module needs Gluon (Triton 3.6's
``triton.experimental.gluon``) and is imported only by the explore script.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lanekit.runtime import alloc

# name -> (BLOCK_M, BLOCK_N, STAGES, num_warps, warp specialized)
DESIGNS = {
    "gluon pipelined 128x128 w8 s2": (128, 128, 2, 8, False),
    "gluon pipelined 128x64 w8 s3": (128, 64, 3, 8, False),
    "gluon ws 128x128 w8 s2": (128, 128, 2, 8, True),
    "gluon ws 128x64 w8 s3": (128, 64, 3, 8, True),
}


@gluon.jit
def _softmax_step(s, m_i, l_i, acc, start_m, start_n, sm_scale_log2,
                  s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  MASKED: gl.constexpr):
    """One key block's online-softmax update: returns (p in 16 bits, m, l, rescaled acc)."""
    s = s * sm_scale_log2
    if MASKED:   # causal: key j visible to query i when j <= i
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(rows[:, None] >= cols[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    p = gl.exp2(s - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return p, m_new, l_i, acc


@gluon.jit
def _consume(q_smem, k_smem, v_smem, ready, empty, k_desc, v_desc, row0, start_m, n_full, n_blocks,
             sm_scale_log2, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
             STAGES: gl.constexpr, num_warps: gl.constexpr, WS: gl.constexpr):
    """The math over key blocks 0 .. n_blocks - 1 (the last n_blocks - n_full masked), each read
    from ring buffer j % STAGES once ``ready`` says it landed. Warp-specialized (WS), the buffer is
    handed back to the producer through ``empty``; else these warps issue block j + STAGES - 1's
    loads into the buffer block j - 1 used, after a barrier of the whole block (every warpgroup's
    MMAs on it complete). Returns (acc, l_i) in the output's layout."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    for j in range(n_blocks):
        if not WS:
            ahead = j + STAGES - 1
            if ahead < n_blocks:
                gl.thread_barrier()
                _issue(k_desc, v_desc, k_smem, v_smem, ready, row0, ahead, STAGES, BLOCK_N)
        buf = j % STAGES
        mbarrier.wait(ready.index(buf), (j // STAGES) & 1)
        k = k_smem.index(buf)
        v = v_smem.index(buf)
        s = warpgroup_mma(q_smem, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        if j < n_full:
            p, m_i, l_i, acc = _softmax_step(s, m_i, l_i, acc, start_m, j * BLOCK_N, sm_scale_log2, s_layout,
                                             o_layout, BLOCK_M, BLOCK_N, False)
        else:
            p, m_i, l_i, acc = _softmax_step(s, m_i, l_i, acc, start_m, j * BLOCK_N, sm_scale_log2, s_layout,
                                             o_layout, BLOCK_M, BLOCK_N, True)
        p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        acc = warpgroup_mma(p16, v, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if WS:
            mbarrier.arrive(empty.index(buf), count=1)
    return acc, gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))


@gluon.jit
def _issue(k_desc, v_desc, k_smem, v_smem, ready, row0, j, STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    buf = j % STAGES
    mbarrier.expect(ready.index(buf), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row0 + j * BLOCK_N, 0], ready.index(buf), k_smem.index(buf))
    tma.async_copy_global_to_shared(v_desc, [row0 + j * BLOCK_N, 0], ready.index(buf), v_smem.index(buf))


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, ready, empty, row0, n_blocks,
              STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """The worker partition: every key block's K and V into the ring, each buffer once the consumer
    handed it back (mbarriers start as if their phase 1 completed: the first lap waits on none)."""
    for j in range(n_blocks):
        mbarrier.wait(empty.index(j % STAGES), ((j // STAGES) & 1) ^ 1)
        _issue(k_desc, v_desc, k_smem, v_smem, ready, row0, j, STAGES, BLOCK_N)


@gluon.jit
def _default(q_smem, k_smem, v_smem, ready, empty, k_desc, v_desc, row0, start_m, n_full, n_blocks, sm_scale_log2,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
             num_warps: gl.constexpr):
    """The default partition: the math, handing each buffer back to the producer."""
    return _consume(q_smem, k_smem, v_smem, ready, empty, k_desc, v_desc, row0, start_m, n_full, n_blocks,
                    sm_scale_log2, BLOCK_M, BLOCK_N, D, STAGES, num_warps, True)


@gluon.jit
def _fwd_kernel(q_desc, k_desc, v_desc, o_desc, sm_scale_log2, S,
                STAGES: gl.constexpr, CAUSAL: gl.constexpr, WS: gl.constexpr, num_warps: gl.constexpr):
    """One program: BLOCK_M queries of one (batch, head); the descriptors view q, k, v, o as
    (B * H * S, D)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    start_m = gl.program_id(0) * BLOCK_M
    row0 = gl.program_id(1) * S
    if CAUSAL:
        n_full = start_m // BLOCK_N
        n_blocks = (start_m + BLOCK_M) // BLOCK_N
    else:
        n_full = S // BLOCK_N
        n_blocks = n_full

    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + start_m, 0], q_bar, q_smem)

    if WS:
        mbarrier.wait(q_bar, 0)
        acc, l_i = gl.warp_specialize([
            (_default, (q_smem, k_smem, v_smem, ready, empty, k_desc, v_desc, row0, start_m, n_full, n_blocks,
                        sm_scale_log2, BLOCK_M, BLOCK_N, D, STAGES, num_warps)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, ready, empty, row0, n_blocks, STAGES, BLOCK_N)),
        ], [1], [24])
    else:
        # the software pipeline: STAGES - 1 blocks in flight, one more issued per block consumed
        for j in gl.static_range(STAGES - 1):
            if j < n_blocks:
                _issue(k_desc, v_desc, k_smem, v_smem, ready, row0, j, STAGES, BLOCK_N)
        mbarrier.wait(q_bar, 0)
        acc, l_i = _consume(q_smem, k_smem, v_smem, ready, empty, k_desc, v_desc, row0, start_m, n_full, n_blocks,
                            sm_scale_log2, BLOCK_M, BLOCK_N, D, STAGES, num_warps, False)

    out = acc / l_i[:, None]
    o_smem = gl.allocate_shared_memory(o_desc.dtype, o_desc.block_type.shape, o_desc.layout)
    o_smem.store(out.to(o_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row0 + start_m, 0], o_smem)
    tma.store_wait(pendings=0)


def _layouts(design, D: int):
    bm, bn = design[0], design[1]
    return (gl.NVMMASharedLayout.get_default_for([bm, D], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([bn, D], gl.bfloat16))


def compile_for_sm90(D: int, causal: bool, design) -> dict:
    """Compile one design for sm90 (no GPU needed): its shared memory and what the PTX holds."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bm, bn, stages, warps, ws = design
    q_layout, kv_layout = _layouts(design, D)
    signature = {"q_desc": f"tensordesc<bf16[{bm}, {D}],{q_layout!r}>",
                 "k_desc": f"tensordesc<bf16[{bn}, {D}],{kv_layout!r}>",
                 "v_desc": f"tensordesc<bf16[{bn}, {D}],{kv_layout!r}>",
                 "o_desc": f"tensordesc<bf16[{bm}, {D}],{q_layout!r}>",
                 "sm_scale_log2": "fp32", "S": "i32", "STAGES": "constexpr", "CAUSAL": "constexpr",
                 "WS": "constexpr", "num_warps": "constexpr"}
    constexprs = {"STAGES": stages, "CAUSAL": causal, "WS": ws, "num_warps": warps}
    try:
        kernel = triton.compile(GluonASTSource(_fwd_kernel, signature, constexprs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    except Exception as e:   # the compiler's own error, its last line
        return {"error": (str(e).strip().splitlines() or [type(e).__name__])[-1][:160]}
    from benchmarks.explore_attention_sm90 import report

    return report(kernel)


def run(design, q, k, v, causal: bool) -> torch.Tensor:
    """o (B, H, S, D) of one design, on a GPU."""
    bm, bn, stages, warps, ws = design
    B, H, S, D = q.shape
    q_layout, kv_layout = _layouts(design, D)
    o = alloc.empty(q.shape, dtype=q.dtype, device=q.device)
    flat = [t.view(B * H * S, D) for t in (q, k, v, o)]
    descs = [TensorDescriptor.from_tensor(flat[0], [bm, D], q_layout),
             TensorDescriptor.from_tensor(flat[1], [bn, D], kv_layout),
             TensorDescriptor.from_tensor(flat[2], [bn, D], kv_layout),
             TensorDescriptor.from_tensor(flat[3], [bm, D], q_layout)]
    _fwd_kernel[(S // bm, B * H)](*descs, D ** -0.5 * 1.4426950408889634, S, STAGES=stages, CAUSAL=causal,
                                  WS=ws, num_warps=warps)
    return o
