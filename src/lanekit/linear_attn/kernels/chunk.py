"""The chunked kernels of linear attention and its decayed form (fla's simple GLA), and their
launchers: forward and backward.

Per sequence and head, with chunks of C tokens, the state h_n (K, V) entering chunk n, gc_t the
cumulative log decay within the chunk (gc_t = g_first + ... + g_t; 0 without decay) and G its
total:

    o_t     = scale * (exp(gc_t) q_t h_n + sum_{s <= t in the chunk} exp(gc_t - gc_s) (q_t . k_s) v_s)
    h_{n+1} = exp(G) h_n + sum_s exp(G - gc_s) k_s^T v_s

Forward: ``_chunk_state_fwd_kernel`` walks the chunks of one (sequence, head, V block) in order,
storing every h_n (in the input dtype for 16-bit inputs: it is a tl.dot operand; the carried state
is fp32) and the final state (fp32); ``_chunk_output_kernel`` then computes every chunk's output
in parallel. Backward: the state pass runs again; ``_chunk_state_bwd_kernel`` walks the chunks in
reverse carrying dh (the gradient of the state leaving a chunk), storing it per chunk and writing
the initial state's gradient; ``_chunk_grad_kernel`` computes dq, dk, dv per chunk in parallel and,
with decay, the gradient of L by the chunk-local cumulative decay gc_t: q_t . dq_t - k_t . dk_t,
plus, at the chunk's last token (gc there is G), dL/dG = <dh_{n+1}, h_{n+1}> = exp(G) <dh, h_n> +
sum_s k_s . dk_s (the inter-chunk part of dk). ``_dg_kernel`` sums those from the chunk's end into
dg. Everything a chunk's decay does to later chunks passes through h_{n+1}, so dg needs no sum
across chunks: the per-token terms of a sequence sum to nearly zero (a shift of every g changes
nothing), and a sum of them over thousands of tokens would carry the rounding of every term (at
16k tokens, 8 bf16 steps of dg, against about one this way, as fla's kernels do it).

Varlen (``cu_seqlens``): sequences packed along T of batch row 0. The host sanitizes the offsets
on the device (clamped to [0, T], made non-decreasing: kernels never leave the tensors, and a
device-side error flag records that they were invalid) and numbers the chunks of all sequences
(``cu_chunks``, their cumulative counts), without a device sync: the parallel kernels launch
cdiv(T, C) + N programs along the chunks, at least as many as there are chunks, and each finds its
sequence by binary search in cu_chunks (the spare ones store nothing).

Every address is int64 arithmetic; every tensor is read by its strides.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lanekit.linear_attn import tuning
from lanekit.runtime import alloc, errors
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.tuning import block16

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()  # bf16 tl.dot and casts as on the GPU


@triton.jit
def _sequence(i_n, CU, CU_CHUNKS, T, NT, IS_VARLEN: tl.constexpr):
    """(batch row, first token, end token, index of its first chunk) of sequence i_n."""
    if IS_VARLEN:
        bos = tl.load(CU + i_n).to(tl.int64)
        eos = tl.load(CU + i_n + 1).to(tl.int64)
        chunk0 = tl.load(CU_CHUNKS + i_n).to(tl.int64)
        b = i_n * 0
    else:
        bos = i_n * 0
        eos = bos + T
        chunk0 = i_n * NT
        b = i_n
    return b, bos, eos, chunk0


@triton.jit
def _chunk_of(i_c, i_bh, CU, CU_CHUNKS, T, NT, H, NSEQ, SEARCH_STEPS,
              CHUNK: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(batch row, head, first token of the chunk, end of its sequence, index of its stored state,
    sequence) of program (i_c, i_bh) of a parallel kernel; a spare varlen program gets an empty
    chunk."""
    if IS_VARLEN:
        lo = i_c * 0
        hi = lo + NSEQ
        for _ in range(SEARCH_STEPS):  # binary search: the last sequence n with cu_chunks[n] <= i_c
            mid = (lo + hi) // 2
            go = tl.load(CU_CHUNKS + mid) <= i_c
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        bos = tl.load(CU + lo).to(tl.int64)
        eos = tl.load(CU + lo + 1).to(tl.int64)
        t0 = bos + (i_c.to(tl.int64) - tl.load(CU_CHUNKS + lo).to(tl.int64)) * CHUNK
        valid = i_c < tl.load(CU_CHUNKS + NSEQ)
        return t0 * 0, i_bh.to(tl.int64), t0, tl.where(valid, eos, t0), i_c.to(tl.int64), lo.to(tl.int64)
    else:
        i_n = (i_bh // H).to(tl.int64)
        t0 = i_c.to(tl.int64) * CHUNK
        return i_n, (i_bh % H).to(tl.int64), t0, t0 * 0 + T, i_n * NT + i_c, i_n


@triton.jit
def _decay(G, b, t, t_in, i_h, stride_gb, stride_gt, stride_gh):
    """([C] cumulative log decay within the chunk, its total) in fp32; 0 past the sequence."""
    g = tl.load(G + b * stride_gb + t * stride_gt + i_h * stride_gh, mask=t_in, other=0.0).to(tl.float32)
    return tl.cumsum(g, 0), tl.sum(g, 0)


@triton.jit
def _rows(P, b, t, t_in, i_h, offs, o_in, stride_b, stride_t, stride_h, stride_d):
    # [C, BD] tile of a (B, T, H, D) tensor: rows t, columns offs; 0 outside
    ptr = P + b * stride_b + i_h * stride_h + t[:, None] * stride_t + offs[None, :] * stride_d
    return tl.load(ptr, mask=t_in[:, None] & o_in[None, :], other=0.0)


@triton.jit
def _rows_t(P, b, t, t_in, i_h, offs, o_in, stride_b, stride_t, stride_h, stride_d):
    # [BD, C] the same tile, transposed (a tl.dot operand)
    ptr = P + b * stride_b + i_h * stride_h + t[None, :] * stride_t + offs[:, None] * stride_d
    return tl.load(ptr, mask=t_in[None, :] & o_in[:, None], other=0.0)


@triton.jit
def _state_ptr(P, index, H, i_h, offs_k, offs_v, DK, DV):
    # [BK, BV] addresses of state `index` of a contiguous (n, H, K, V) buffer
    return P + (index * H + i_h) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]


@triton.jit(do_not_specialize=["T", "NT"])
def _chunk_state_fwd_kernel(
    K_, V_, G, H0, HBUF, HT, CU, CU_CHUNKS,
    stride_kb, stride_kt, stride_kh, stride_kk,
    stride_vb, stride_vt, stride_vh, stride_vv,
    stride_gb, stride_gt, stride_gh,
    stride_h0n, stride_h0h, stride_h0k, stride_h0v,
    T, NT, H, DK, DV,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_G: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    i_nh = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1).to(tl.int64)
    i_k = tl.program_id(2).to(tl.int64)                                          # a block of K rows of the state
    i_n, i_h = i_nh // H, i_nh % H
    b, bos, eos, chunk0 = _sequence(i_n, CU, CU_CHUNKS, T, NT, IS_VARLEN)
    offs_k = i_k * BK + tl.arange(0, BK).to(tl.int64)
    offs_v = i_v * BV + tl.arange(0, BV)
    offs_c = tl.arange(0, CHUNK)
    k_in, v_in = offs_k < DK, offs_v < DV
    kv_in = k_in[:, None] & v_in[None, :]
    h = tl.zeros([BK, BV], dtype=tl.float32)                                      # the carried state
    if HAS_H0:
        h += tl.load(H0 + i_n * stride_h0n + i_h * stride_h0h + offs_k[:, None] * stride_h0k
                     + offs_v[None, :] * stride_h0v, mask=kv_in, other=0.0).to(tl.float32)
    for n in range(0, tl.cdiv(eos - bos, CHUNK)):
        tl.store(_state_ptr(HBUF, chunk0 + n, H, i_h, offs_k, offs_v, DK, DV),
                 h.to(HBUF.dtype.element_ty), mask=kv_in)                         # h_n, entering chunk n
        t = bos + n * CHUNK + offs_c
        t_in = t < eos
        kt = _rows_t(K_, b, t, t_in, i_h, offs_k, k_in, stride_kb, stride_kt, stride_kh, stride_kk)  # [BK, C]
        v = _rows(V_, b, t, t_in, i_h, offs_v, v_in, stride_vb, stride_vt, stride_vh, stride_vv)     # [C, BV]
        if HAS_G:
            gc, g_total = _decay(G, b, t, t_in, i_h, stride_gb, stride_gt, stride_gh)
            h *= tl.exp(g_total)
            kt = (kt.to(tl.float32) * tl.exp(g_total - gc)[None, :]).to(v.dtype)
        h = tl.dot(kt, v, h, input_precision=INPUT_PRECISION)
    if STORE_FINAL:
        tl.store(_state_ptr(HT, i_n, H, i_h, offs_k, offs_v, DK, DV), h, mask=kv_in)


@triton.jit(do_not_specialize=["T", "NT", "NSEQ", "SEARCH_STEPS"])
def _chunk_output_kernel(
    Q, K_, V_, G, HBUF, O, CU, CU_CHUNKS,
    stride_qb, stride_qt, stride_qh, stride_qk,
    stride_kb, stride_kt, stride_kh, stride_kk,
    stride_vb, stride_vt, stride_vh, stride_vv,
    stride_gb, stride_gt, stride_gh,
    stride_ob, stride_ot, stride_oh, stride_ov,
    scale, T, NT, H, DK, DV, NSEQ, SEARCH_STEPS,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_v = tl.program_id(1).to(tl.int64)
    i_bh = tl.program_id(2)
    b, i_h, t0, eos, hidx, _ = _chunk_of(i_c, i_bh, CU, CU_CHUNKS, T, NT, H, NSEQ, SEARCH_STEPS, CHUNK, IS_VARLEN)
    offs_k = tl.arange(0, BK).to(tl.int64)
    offs_v = i_v * BV + tl.arange(0, BV)
    offs_c = tl.arange(0, CHUNK)
    t = t0 + offs_c
    t_in = t < eos
    k_in, v_in = offs_k < DK, offs_v < DV
    q = _rows(Q, b, t, t_in, i_h, offs_k, k_in, stride_qb, stride_qt, stride_qh, stride_qk)         # [C, BK]
    kt = _rows_t(K_, b, t, t_in, i_h, offs_k, k_in, stride_kb, stride_kt, stride_kh, stride_kk)     # [BK, C]
    v = _rows(V_, b, t, t_in, i_h, offs_v, v_in, stride_vb, stride_vt, stride_vh, stride_vv)        # [C, BV]
    h = tl.load(_state_ptr(HBUF, hidx, H, i_h, offs_k, offs_v, DK, DV),
                mask=tl.where(t0 < eos, k_in[:, None] & v_in[None, :], False), other=0.0)                        # [BK, BV]
    a = tl.dot(q, kt, input_precision=INPUT_PRECISION)                                             # [C, C]
    o = tl.dot(q, h.to(q.dtype), input_precision=INPUT_PRECISION)                                  # [C, BV]
    causal = offs_c[:, None] >= offs_c[None, :]
    if HAS_G:
        gc, _ = _decay(G, b, t, t_in, i_h, stride_gb, stride_gt, stride_gh)
        o *= tl.exp(gc)[:, None]
        a = tl.where(causal, a * tl.exp(gc[:, None] - gc[None, :]), 0.0)
    else:
        a = tl.where(causal, a, 0.0)
    o = tl.dot(a.to(v.dtype), v, o, input_precision=INPUT_PRECISION) * scale
    tl.store(O + b * stride_ob + i_h * stride_oh + t[:, None] * stride_ot + offs_v[None, :] * stride_ov,
             o.to(O.dtype.element_ty), mask=t_in[:, None] & v_in[None, :])


@triton.jit(do_not_specialize=["T", "NT"])
def _chunk_state_bwd_kernel(
    Q, DO, G, DHT, DHBUF, DH0, CU, CU_CHUNKS,
    stride_qb, stride_qt, stride_qh, stride_qk,
    stride_db, stride_dt, stride_dh, stride_dv,
    stride_gb, stride_gt, stride_gh,
    stride_htn, stride_hth, stride_htk, stride_htv,
    scale, T, NT, H, DK, DV,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_G: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    i_nh = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1).to(tl.int64)
    i_k = tl.program_id(2).to(tl.int64)                                          # a block of K rows of the state
    i_n, i_h = i_nh // H, i_nh % H
    b, bos, eos, chunk0 = _sequence(i_n, CU, CU_CHUNKS, T, NT, IS_VARLEN)
    offs_k = i_k * BK + tl.arange(0, BK).to(tl.int64)
    offs_v = i_v * BV + tl.arange(0, BV)
    offs_c = tl.arange(0, CHUNK)
    k_in, v_in = offs_k < DK, offs_v < DV
    kv_in = k_in[:, None] & v_in[None, :]
    dh = tl.zeros([BK, BV], dtype=tl.float32)               # dL/d(state leaving the chunk)
    if HAS_DHT:
        dh += tl.load(DHT + i_n * stride_htn + i_h * stride_hth + offs_k[:, None] * stride_htk
                      + offs_v[None, :] * stride_htv, mask=kv_in, other=0.0).to(tl.float32)
    chunks = tl.cdiv(eos - bos, CHUNK)
    for i in range(0, chunks):
        n = chunks - 1 - i
        tl.store(_state_ptr(DHBUF, chunk0 + n, H, i_h, offs_k, offs_v, DK, DV),
                 dh.to(DHBUF.dtype.element_ty), mask=kv_in)
        t = bos + n * CHUNK + offs_c
        t_in = t < eos
        qt = _rows_t(Q, b, t, t_in, i_h, offs_k, k_in, stride_qb, stride_qt, stride_qh, stride_qk)    # [BK, C]
        do = _rows(DO, b, t, t_in, i_h, offs_v, v_in, stride_db, stride_dt, stride_dh, stride_dv)      # [C, BV]
        if HAS_G:
            gc, g_total = _decay(G, b, t, t_in, i_h, stride_gb, stride_gt, stride_gh)
            dh *= tl.exp(g_total)
            qt = (qt.to(tl.float32) * tl.exp(gc)[None, :]).to(Q.dtype.element_ty)
        dh += scale * tl.dot(qt, do.to(Q.dtype.element_ty), input_precision=INPUT_PRECISION)
    if STORE_DH0:
        tl.store(_state_ptr(DH0, i_n, H, i_h, offs_k, offs_v, DK, DV), dh.to(DH0.dtype.element_ty), mask=kv_in)


@triton.jit(do_not_specialize=["T", "NT", "NSEQ", "SEARCH_STEPS"])
def _chunk_grad_kernel(
    Q, K_, V_, G, DO, HBUF, DHBUF, DQ, DK_, DV_, DG, CU, CU_CHUNKS,
    stride_qb, stride_qt, stride_qh, stride_qk,
    stride_kb, stride_kt, stride_kh, stride_kk,
    stride_vb, stride_vt, stride_vh, stride_vv,
    stride_gb, stride_gt, stride_gh,
    stride_db, stride_dt, stride_dh, stride_dv,
    stride_dgb, stride_dgt, stride_dgh,
    scale, T, NT, H, DK, DV, NSEQ, SEARCH_STEPS,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    # dq, dk, dv of one chunk (the gradient buffers are contiguous (B, T, H, D)); with decay also
    # dg, the reverse cumulative sum within the chunk of dL/d(gc_t) (gc the chunk-local cumulative
    # decay; dL/dG joins at the last token)
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    b, i_h, t0, eos, hidx, _ = _chunk_of(i_c, i_bh, CU, CU_CHUNKS, T, NT, H, NSEQ, SEARCH_STEPS, CHUNK, IS_VARLEN)
    offs_k = tl.arange(0, BK).to(tl.int64)
    offs_c = tl.arange(0, CHUNK)
    t = t0 + offs_c
    t_in = t < eos
    k_in = offs_k < DK
    dt = Q.dtype.element_ty
    q = _rows(Q, b, t, t_in, i_h, offs_k, k_in, stride_qb, stride_qt, stride_qh, stride_qk)         # [C, BK]
    k = _rows(K_, b, t, t_in, i_h, offs_k, k_in, stride_kb, stride_kt, stride_kh, stride_kk)        # [C, BK]
    # a_t[s, t] = scale * exp(gc_t - gc_s) k_s . q_t for s <= t: the transposed scores, for dv
    a_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * scale                         # [C, C]
    causal_t = offs_c[:, None] <= offs_c[None, :]
    if HAS_G:
        gc, g_total = _decay(G, b, t, t_in, i_h, stride_gb, stride_gt, stride_gh)
        a_t = tl.where(causal_t, a_t * tl.exp(gc[None, :] - gc[:, None]), 0.0)
        k_end = (k.to(tl.float32) * tl.exp(g_total - gc)[:, None]).to(dt)    # k_s decayed to the chunk's end
    else:
        a_t = tl.where(causal_t, a_t, 0.0)
        k_end = k
    a_t = a_t.to(dt)
    dq = tl.zeros([CHUNK, BK], dtype=tl.float32)        # do h^T, summed over V
    dk = tl.zeros([CHUNK, BK], dtype=tl.float32)        # v dh^T, summed over V
    ds = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)     # do v^T, summed over V
    hdh = tl.zeros([], dtype=tl.float32)                 # <dh_{n+1}, h_n>, summed over V
    state_in = tl.where(t0 < eos, k_in[:, None], False)   # (where, not &: Triton 3.9's interpreter
    #                                                          makes a tensor & scalar bool non-boolean)
    for i_v in range(0, tl.cdiv(DV, BV)):
        offs_v = i_v * BV + tl.arange(0, BV).to(tl.int64)
        v_in = offs_v < DV
        v = _rows(V_, b, t, t_in, i_h, offs_v, v_in, stride_vb, stride_vt, stride_vh, stride_vv)        # [C, BV]
        do = _rows(DO, b, t, t_in, i_h, offs_v, v_in, stride_db, stride_dt, stride_dh, stride_dv).to(dt)
        h = tl.load(_state_ptr(HBUF, hidx, H, i_h, offs_k, offs_v, DK, DV),
                    mask=state_in & v_in[None, :], other=0.0).to(dt)                                  # [BK, BV]
        dh = tl.load(_state_ptr(DHBUF, hidx, H, i_h, offs_k, offs_v, DK, DV),
                     mask=state_in & v_in[None, :], other=0.0).to(dt)                                 # [BK, BV]
        if HAS_G:
            hdh += tl.sum(tl.sum(h.to(tl.float32) * dh.to(tl.float32), 1), 0)
        ds = tl.dot(do, tl.trans(v), ds, input_precision=INPUT_PRECISION)
        dq = tl.dot(do, tl.trans(h), dq, input_precision=INPUT_PRECISION)
        dk = tl.dot(v, tl.trans(dh), dk, input_precision=INPUT_PRECISION)
        dv = tl.dot(a_t, do, input_precision=INPUT_PRECISION)
        dv = tl.dot(k_end, dh, dv, input_precision=INPUT_PRECISION)                                   # [C, BV]
        tl.store(DV_ + ((b * T + t[:, None]) * H + i_h) * DV + offs_v[None, :], dv.to(DV_.dtype.element_ty),
                 mask=t_in[:, None] & v_in[None, :])
    causal = offs_c[:, None] >= offs_c[None, :]
    if HAS_G:
        ds = tl.where(causal, ds * (scale * tl.exp(gc[:, None] - gc[None, :])), 0.0)
        dq *= (scale * tl.exp(gc))[:, None]
        dk *= tl.exp(g_total - gc)[:, None]
        # dL/dG (G = gc at the chunk's last token): <dh_{n+1}, h_{n+1}>, h_{n+1} = exp(G) h_n + sum_s
        # exp(G - gc_s) k_s^T v_s, so exp(G) <dh, h_n> + sum_s k_s . dk_s with dk the inter-chunk part
        d_total = tl.exp(g_total) * hdh + tl.sum(tl.sum(k.to(tl.float32) * dk, 1), 0)
    else:
        ds = tl.where(causal, ds * scale, 0.0)
        dq *= scale
    ds = ds.to(dt)
    dq = tl.dot(ds, k, dq, input_precision=INPUT_PRECISION)
    dk = tl.dot(tl.trans(ds), q, dk, input_precision=INPUT_PRECISION)
    out = ((b * T + t[:, None]) * H + i_h) * DK + offs_k[None, :]
    tl.store(DQ + out, dq.to(DQ.dtype.element_ty), mask=t_in[:, None] & k_in[None, :])
    tl.store(DK_ + out, dk.to(DK_.dtype.element_ty), mask=t_in[:, None] & k_in[None, :])
    if HAS_G:
        # dL/d(gc_t) = q_t . dq_t - k_t . dk_t (the decay enters as exp(gc_t - gc_s)), + dL/dG at the end
        dgl = tl.sum(q.to(tl.float32) * dq, 1) - tl.sum(k.to(tl.float32) * dk, 1)
        last = tl.minimum(eos - t0, CHUNK) - 1
        dgl = tl.where(offs_c == last, dgl + d_total, dgl)
        dg = tl.cumsum(dgl, 0, reverse=True)                 # dg_t = sum_{u >= t in the chunk} dL/d(gc_u)
        tl.store(DG + b * stride_dgb + t * stride_dgt + i_h * stride_dgh, dg.to(DG.dtype.element_ty), mask=t_in)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------

MAX_GRID_YZ = 65535  # CUDA's limit on grid dimensions 1 and 2
MAX_BLOCK_K = 256    # the largest key head dim (api.MAX_HEAD_DIM_K): a whole key row in one tile

BAD_CU_SEQLENS = errors.register(
    "linear attention: cu_seqlens not non-decreasing from 0 to T (the packed tokens); the kernels "
    "read them clamped to [0, T] and made non-decreasing, and left tokens outside them unwritten")


@dataclass(frozen=True)
class Layout:
    """Where the sequences and their chunks lie: N sequences; ``chunks`` programs along the chunks
    of a parallel kernel (NT per sequence, or an upper bound on all sequences' chunks in varlen);
    ``states`` stored states; ``cu`` and ``cu_chunks`` (int64, varlen only) the sanitized offsets
    and the cumulative chunk counts; ``search_steps`` the binary search's steps."""

    varlen: bool
    N: int
    NT: int
    chunks: int
    states: int
    cu: torch.Tensor | None
    cu_chunks: torch.Tensor | None
    search_steps: int


def sanitized_cu_seqlens(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """cu_seqlens as int64, clamped to [0, T] and made non-decreasing on the device (no sync); an
    input that needed it (or does not start at 0 and end at T) sets BAD_CU_SEQLENS in the error flag."""
    cu = cu_seqlens.to(torch.int64)
    clean = torch.cummax(cu.clamp(0, T), 0).values
    bad = (clean != cu).any() | (cu[0] != 0) | (cu[-1] != T)
    flag = errors.error_flag(cu.device)
    flag.bitwise_or_(bad.to(torch.int32) * BAD_CU_SEQLENS)
    return clean


def layout(q: torch.Tensor, cu_seqlens: torch.Tensor | None, chunk: int) -> Layout:
    B, T = q.shape[0], q.shape[1]
    if cu_seqlens is None:
        NT = triton.cdiv(T, chunk)
        return Layout(False, B, NT, NT, B * NT, None, None, 0)
    N = cu_seqlens.shape[0] - 1
    cu = sanitized_cu_seqlens(cu_seqlens, T)
    cu_chunks = torch.zeros(N + 1, dtype=torch.int64, device=q.device)
    torch.cumsum((cu[1:] - cu[:-1] + chunk - 1) // chunk, 0, out=cu_chunks[1:])
    bound = triton.cdiv(T, chunk) + N   # each sequence adds at most one partial chunk
    return Layout(True, N, 0, bound, bound, cu, cu_chunks, max(N, 1).bit_length())


def _strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * n


def _precision(q: torch.Tensor) -> str | None:
    return "ieee" if q.dtype == torch.float32 else None   # fp32: IEEE products, never TF32


def _block(n: int, cap: int) -> int:
    return min(cap, block16(n))


def _tiles(q: torch.Tensor) -> tuning.LinearAttnTiles:
    return tuning.INTERPRETER if triton_interpreted() else tuning.tiles(q.device, q.dtype)


def _on_device(t: torch.Tensor):
    """Triton launches on the current device: make it t's."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _check_grid(heads: int, what: str) -> None:
    if heads > MAX_GRID_YZ:
        raise ValueError(f"q: the Triton lane runs at most {MAX_GRID_YZ} {what}, got {heads}")


def _states_fwd(*, k, v, g, initial_state, lay: Layout, tiles, H, final, state_dtype):
    """The state pass: every chunk's entering state (``lay.states`` rows, ``state_dtype``), and the
    final state (fp32) into ``final`` when it is a tensor."""
    T, DK, DV = k.shape[1], k.shape[3], v.shape[3]
    cfg = tiles.state_fwd
    hbuf = alloc.empty((lay.states, H, DK, DV), dtype=state_dtype, device=k.device)
    BV = _block(DV, cfg.block_v)
    cu = lay.cu if lay.varlen else k
    BK = _block(DK, cfg.block_k or MAX_BLOCK_K)
    _chunk_state_fwd_kernel[(lay.N * H, triton.cdiv(DV, BV), triton.cdiv(DK, BK))](
        k, v, g if g is not None else k, initial_state if initial_state is not None else k,
        hbuf if hbuf.numel() else k, final if final is not None else k, cu,
        lay.cu_chunks if lay.varlen else k,
        *k.stride(), *v.stride(), *_strides(g, 3), *_strides(initial_state, 4),
        T, lay.NT, H, DK, DV,
        CHUNK=tiles.chunk, BK=BK, BV=BV, HAS_G=g is not None, HAS_H0=initial_state is not None,
        STORE_FINAL=final is not None, IS_VARLEN=lay.varlen, INPUT_PRECISION=_precision(k), **cfg.options())
    return hbuf


def chunk_fwd(*, q, k, v, g, initial_state, cu_seqlens, scale, output_final_state, out_dtype):
    """(o (B, T, H, V) in out_dtype, final state (N, H, K, V) fp32, or an empty tensor when not
    asked for). T > 0."""
    B, T, H, DK = q.shape
    DV = v.shape[3]
    tiles = _tiles(q)
    lay = layout(q, cu_seqlens, tiles.chunk)
    heads = H if lay.varlen else B * H
    _check_grid(heads, "batch * heads" if not lay.varlen else "heads")
    o = alloc.empty((B, T, H, DV), dtype=out_dtype, device=q.device)
    final = alloc.empty((lay.N, H, DK, DV), dtype=torch.float32, device=q.device) if output_final_state else None
    with _on_device(q):
        hbuf = _states_fwd(k=k, v=v, g=g, initial_state=initial_state, lay=lay, tiles=tiles, H=H,
                           final=final, state_dtype=q.dtype)
        cfg = tiles.output
        BV = _block(DV, cfg.block_v)
        cu = lay.cu if lay.varlen else q
        _chunk_output_kernel[(lay.chunks, triton.cdiv(DV, BV), heads)](
            q, k, v, g if g is not None else q, hbuf, o, cu, lay.cu_chunks if lay.varlen else q,
            *q.stride(), *k.stride(), *v.stride(), *_strides(g, 3), *o.stride(),
            scale, T, lay.NT, H, DK, DV, lay.N, lay.search_steps,
            CHUNK=tiles.chunk, BK=block16(DK), BV=BV, HAS_G=g is not None, IS_VARLEN=lay.varlen,
            INPUT_PRECISION=_precision(q), **cfg.options())
    return o, final if final is not None else q.new_empty(0, dtype=torch.float32)


def chunk_bwd(*, q, k, v, g, initial_state, cu_seqlens, scale, do, dht):
    """(dq, dk, dv, dg (g's shape and dtype; empty without g), d initial_state (its dtype; empty
    without one)) for the gradients do (B, T, H, V) of o and dht (N, H, K, V) of the final state
    (None: unused). T > 0."""
    if do.dtype == torch.float32 and q.dtype != torch.float32:
        # an fp32 output's gradient (the normalized form): computed in fp32, rounded once at the end
        grads = chunk_bwd(q=q.float(), k=k.float(), v=v.float(), g=g, initial_state=initial_state,
                          cu_seqlens=cu_seqlens, scale=scale, do=do, dht=dht)
        return (grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype), *grads[3:])
    B, T, H, DK = q.shape
    DV = v.shape[3]
    tiles = _tiles(q)
    lay = layout(q, cu_seqlens, tiles.chunk)
    heads = H if lay.varlen else B * H
    _check_grid(heads, "batch * heads" if not lay.varlen else "heads")
    dev = q.device
    dq = alloc.empty((B, T, H, DK), dtype=q.dtype, device=dev)
    dk = alloc.empty((B, T, H, DK), dtype=k.dtype, device=dev)
    dv = alloc.empty((B, T, H, DV), dtype=v.dtype, device=dev)
    dg = alloc.empty(tuple(g.shape), dtype=g.dtype, device=dev) if g is not None else q.new_empty(0)
    dh0 = (alloc.empty((lay.N, H, DK, DV), dtype=initial_state.dtype, device=dev)
           if initial_state is not None else None)
    cu = lay.cu if lay.varlen else q
    cu_chunks = lay.cu_chunks if lay.varlen else q
    BK = block16(DK)
    with _on_device(q):
        hbuf = _states_fwd(k=k, v=v, g=g, initial_state=initial_state, lay=lay, tiles=tiles, H=H,
                           final=None, state_dtype=q.dtype)
        cfg = tiles.state_bwd
        BV = _block(DV, cfg.block_v)
        dhbuf = alloc.empty((lay.states, H, DK, DV), dtype=q.dtype, device=dev)
        BKs = _block(DK, cfg.block_k or MAX_BLOCK_K)
        _chunk_state_bwd_kernel[(lay.N * H, triton.cdiv(DV, BV), triton.cdiv(DK, BKs))](
            q, do, g if g is not None else q, dht if dht is not None else q, dhbuf,
            dh0 if dh0 is not None else q, cu, cu_chunks,
            *q.stride(), *do.stride(), *_strides(g, 3), *_strides(dht, 4),
            scale, T, lay.NT, H, DK, DV,
            CHUNK=tiles.chunk, BK=BKs, BV=BV, HAS_G=g is not None, HAS_DHT=dht is not None,
            STORE_DH0=dh0 is not None, IS_VARLEN=lay.varlen, INPUT_PRECISION=_precision(q), **cfg.options())
        cfg = tiles.grad
        _chunk_grad_kernel[(lay.chunks, heads)](
            q, k, v, g if g is not None else q, do, hbuf, dhbuf, dq, dk, dv,
            dg if g is not None else q, cu, cu_chunks,
            *q.stride(), *k.stride(), *v.stride(), *_strides(g, 3), *do.stride(), *_strides(dg if g is not None else None, 3),
            scale, T, lay.NT, H, DK, DV, lay.N, lay.search_steps,
            CHUNK=tiles.chunk, BK=BK, BV=_block(DV, cfg.block_v), HAS_G=g is not None, IS_VARLEN=lay.varlen,
            INPUT_PRECISION=_precision(q), **cfg.options())
    return dq, dk, dv, dg, dh0 if dh0 is not None else q.new_empty(0)
