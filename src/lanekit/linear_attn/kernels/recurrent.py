"""The step-by-step recurrence (decode), forward: ``_fused_recurrent_fwd_kernel`` and its launcher.

One program per (sequence * head, V block) holds its block of the state (K, BV) in fp32 registers
and walks the tokens in order: S = exp(g_t) S + k_t^T v_t, o_t = scale * q_t S. Its backward is the
chunked one (kernels/chunk.py): the same function, so the same gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lanekit.linear_attn.kernels.chunk import _on_device, _sequence, _strides, _tiles, layout
from lanekit.runtime import alloc
from lanekit.runtime.tuning import block16


@triton.jit(do_not_specialize=["T"])
def _fused_recurrent_fwd_kernel(
    Q, K_, V_, G, H0, O, HT, CU,
    stride_qb, stride_qt, stride_qh, stride_qk,
    stride_kb, stride_kt, stride_kh, stride_kk,
    stride_vb, stride_vt, stride_vh, stride_vv,
    stride_gb, stride_gt, stride_gh,
    stride_h0n, stride_h0h, stride_h0k, stride_h0v,
    stride_ob, stride_ot, stride_oh, stride_ov,
    scale, T, H, DK, DV,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_G: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_nh = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1).to(tl.int64)
    i_n, i_h = i_nh // H, i_nh % H
    b, bos, eos, _ = _sequence(i_n, CU, CU, T, 0, IS_VARLEN)
    offs_k = tl.arange(0, BK).to(tl.int64)
    offs_v = i_v * BV + tl.arange(0, BV)
    k_in, v_in = offs_k < DK, offs_v < DV
    kv_in = k_in[:, None] & v_in[None, :]
    h = tl.zeros([BK, BV], dtype=tl.float32)                                      # [BK, BV]
    if HAS_H0:
        h += tl.load(H0 + i_n * stride_h0n + i_h * stride_h0h + offs_k[:, None] * stride_h0k
                     + offs_v[None, :] * stride_h0v, mask=kv_in, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        q = tl.load(Q + b * stride_qb + t * stride_qt + i_h * stride_qh + offs_k * stride_qk,
                    mask=k_in, other=0.0).to(tl.float32)                           # [BK]
        k = tl.load(K_ + b * stride_kb + t * stride_kt + i_h * stride_kh + offs_k * stride_kk,
                    mask=k_in, other=0.0).to(tl.float32)                           # [BK]
        v = tl.load(V_ + b * stride_vb + t * stride_vt + i_h * stride_vh + offs_v * stride_vv,
                    mask=v_in, other=0.0).to(tl.float32)                           # [BV]
        if HAS_G:
            h *= tl.exp(tl.load(G + b * stride_gb + t * stride_gt + i_h * stride_gh).to(tl.float32))
        h += k[:, None] * v[None, :]
        o = tl.sum(h * q[:, None], 0) * scale                                     # [BV]
        tl.store(O + b * stride_ob + t * stride_ot + i_h * stride_oh + offs_v * stride_ov,
                 o.to(O.dtype.element_ty), mask=v_in)
    if STORE_FINAL:
        tl.store(HT + (i_nh * DK + offs_k[:, None]) * DV + offs_v[None, :], h, mask=kv_in)


def recurrent_fwd(*, q, k, v, g, initial_state, cu_seqlens, scale, output_final_state, out_dtype):
    """(o (B, T, H, V) in out_dtype, final state (N, H, K, V) fp32 or an empty tensor). T > 0."""
    B, T, H, DK = q.shape
    DV = v.shape[3]
    tiles = _tiles(q)
    cfg = tiles.recurrent
    lay = layout(q, cu_seqlens, tiles.chunk)
    o = alloc.empty((B, T, H, DV), dtype=out_dtype, device=q.device)
    final = alloc.empty((lay.N, H, DK, DV), dtype=torch.float32, device=q.device) if output_final_state else None
    BV = min(cfg.block_v, block16(DV))
    with _on_device(q):
        _fused_recurrent_fwd_kernel[(lay.N * H, triton.cdiv(DV, BV))](
            q, k, v, g if g is not None else q, initial_state if initial_state is not None else q, o,
            final if final is not None else q, lay.cu if lay.varlen else q,
            *q.stride(), *k.stride(), *v.stride(), *_strides(g, 3), *_strides(initial_state, 4), *o.stride(),
            scale, T, H, DK, DV,
            BK=block16(DK), BV=BV, HAS_G=g is not None, HAS_H0=initial_state is not None,
            STORE_FINAL=final is not None, IS_VARLEN=lay.varlen, **cfg.options())
    return o, final if final is not None else q.new_empty(0, dtype=torch.float32)
