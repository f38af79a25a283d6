"""Triton kernels for the RNN cells, and their launchers.

Forward: one launch per step. A program owns block_b batch rows and block_h hidden units of every
gate; it computes the gate pre-activations x W_ih^T + h W_hh^T with ``tl.dot`` over K blocks
(fp32 accumulators, one per gate, so x and h tiles are read once for all gates), adds the biases,
applies the gate nonlinearities and writes h' (and c'). It also writes, in fp32, what the
backward needs (the gate activations), so that the backward never recomputes a GEMM.

Backward: one pointwise kernel turns the gradients of h' (and c') and the saved activations into
the gradients of the gate pre-activations (and of c, and for the GRU the part through the reset
gate); the host then runs torch matmuls for d(input), d(h), dW_ih, dW_hh and the bias sums.

Layouts follow torch.nn.LSTMCell / GRUCell / RNNCell: W_ih (G*H, In) and W_hh (G*H, H) with the
gates stacked along the rows (LSTM: i, f, g, o; GRU: r, z, n). Every address is computed in int64
(tensors over 2^31 elements, any strides); every load and store is masked.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from lanekit.common.numerics import sigmoid as _sigmoid, tanh as _tanh

from lanekit.rnn import tuning
from lanekit.runtime import alloc
from lanekit.runtime.host import cdiv, next_power_of_2
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.tuning import TileConfig, lookup

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()  # also: interpreted bf16 outputs round as on the GPU (one step holds)

MAX_GRID_Y = 65535  # CUDA's limit on grid dimension 1 (blocks of hidden units)


@triton.jit
def _load_tile(P, offs_b, b_in, offs_k, k_in, stride_b, stride_k):
    # [BLOCK_B, BLOCK_K] rows of x or h; 0 outside
    return tl.load(P + offs_b[:, None] * stride_b + offs_k[None, :] * stride_k,
                   mask=b_in[:, None] & k_in[None, :], other=0.0)


@triton.jit
def _dot_gate(acc, a, w_ptrs, w_mask, INPUT_PRECISION: tl.constexpr):
    # acc += a @ W_gate^T: w_ptrs address one gate's weight tile transposed, [BLOCK_K, BLOCK_H]
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    return tl.dot(a, w, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _bias(Bp, row0, offs_h, h_in, stride):
    # [1, BLOCK_H] fp32: the bias of one gate
    return tl.load(Bp + (row0 + offs_h) * stride, mask=h_in, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _store_gate(P, offs_b, row0, offs_h, mask, row_len, value):
    # a [BLOCK_B, BLOCK_H] block of a contiguous (B, row_len) buffer, at columns row0 + offs_h
    tl.store(P + offs_b[:, None] * row_len + (row0 + offs_h)[None, :], value.to(P.dtype.element_ty), mask=mask)


@triton.jit
def _load_gate(P, offs_b, row0, offs_h, mask, row_len):
    return tl.load(P + offs_b[:, None] * row_len + (row0 + offs_h)[None, :], mask=mask, other=0.0)


@triton.jit
def _store_gates4(P, offs_b, offs_h, mask, H64, v0, v1, v2, v3):
    # the four gates' [BLOCK_B, BLOCK_H] blocks of a contiguous (B, 4H) buffer (the saved activations)
    _store_gate(P, offs_b, 0 * H64, offs_h, mask, 4 * H64, v0)
    _store_gate(P, offs_b, 1 * H64, offs_h, mask, 4 * H64, v1)
    _store_gate(P, offs_b, 2 * H64, offs_h, mask, 4 * H64, v2)
    _store_gate(P, offs_b, 3 * H64, offs_h, mask, 4 * H64, v3)


@triton.jit
def _load_gates4(P, offs_b, offs_h, mask, H64):
    # the four gates' [BLOCK_B, BLOCK_H] blocks of a contiguous (B, 4H) buffer, as _store_gates4 wrote them
    v0 = _load_gate(P, offs_b, 0 * H64, offs_h, mask, 4 * H64)
    v1 = _load_gate(P, offs_b, 1 * H64, offs_h, mask, 4 * H64)
    v2 = _load_gate(P, offs_b, 2 * H64, offs_h, mask, 4 * H64)
    v3 = _load_gate(P, offs_b, 3 * H64, offs_h, mask, 4 * H64)
    return v0, v1, v2, v3


@triton.jit
def _load_state(P, offs_b, offs_h, mask, stride_b, stride_h):
    # [BLOCK_B, BLOCK_H] of a (B, H) tensor with any strides, in fp32
    return tl.load(P + offs_b[:, None] * stride_b + offs_h[None, :] * stride_h, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _cell_block(B, H, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr):
    """(offs_b, offs_h, b_in, h_in, H64): the batch rows and hidden units of this program, and H in
    int64 (a gate's offset in the stacked rows)."""
    offs_b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)     # [BLOCK_B]
    offs_h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)     # [BLOCK_H]
    return offs_b, offs_h, offs_b < B, offs_h < H, tl.cast(H, tl.int64)


@triton.jit
def _gates_gemm(acc0, acc1, acc2, acc3, A, stride_ab, stride_ak, W, stride_wn, stride_wk, K, offs_b, b_in,
                offs_h, h_in, H64, BLOCK_K: tl.constexpr, GATES: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """acc_g += A[offs_b, :K] @ W[g * H + offs_h, :K]^T for the first GATES gates g (W's gates stacked
    along its rows), walking K by BLOCK_K: each tile of A is read once for all gates. The
    accumulators past GATES pass through."""
    for k0 in range(0, K, BLOCK_K):
        offs_k = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        k_in = offs_k < K
        a = _load_tile(A, offs_b, b_in, offs_k, k_in, stride_ab, stride_ak)          # [BLOCK_B, BLOCK_K]
        w = W + offs_h[None, :] * stride_wn + offs_k[:, None] * stride_wk            # gate 0's tile
        w_mask = h_in[None, :] & k_in[:, None]
        gate = H64 * stride_wn                                                       # one gate's rows
        acc0 = _dot_gate(acc0, a, w, w_mask, INPUT_PRECISION)
        if GATES >= 2:
            acc1 = _dot_gate(acc1, a, w + 1 * gate, w_mask, INPUT_PRECISION)
        if GATES >= 3:
            acc2 = _dot_gate(acc2, a, w + 2 * gate, w_mask, INPUT_PRECISION)
        if GATES >= 4:
            acc3 = _dot_gate(acc3, a, w + 3 * gate, w_mask, INPUT_PRECISION)
    return acc0, acc1, acc2, acc3


@triton.jit
def _gates_bias(acc0, acc1, acc2, acc3, Bp, offs_h, h_in, stride, H64, GATES: tl.constexpr):
    """acc_g += the bias of gate g, for the first GATES gates; the others pass through."""
    acc0 += _bias(Bp, 0 * H64, offs_h, h_in, stride)
    if GATES >= 2:
        acc1 += _bias(Bp, 1 * H64, offs_h, h_in, stride)
    if GATES >= 3:
        acc2 += _bias(Bp, 2 * H64, offs_h, h_in, stride)
    if GATES >= 4:
        acc3 += _bias(Bp, 3 * H64, offs_h, h_in, stride)
    return acc0, acc1, acc2, acc3


# Batch sizes change from step to step; In and H are the model's and stay specialized.
@triton.jit(do_not_specialize=["B"])
def _lstm_cell_fwd_kernel(
    X, Hx, Cx, Wih, Whh, Bih, Bhh, Hout, Cout, Saved,
    stride_xb, stride_xk, stride_hb, stride_hk, stride_cb, stride_ch,
    stride_wih_n, stride_wih_k, stride_whh_n, stride_whh_k, stride_bih, stride_bhh,
    B, In, H,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_HX: tl.constexpr, HAS_BIH: tl.constexpr, HAS_BHH: tl.constexpr, SAVE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    offs_b, offs_h, b_in, h_in, H64 = _cell_block(B, H, BLOCK_B, BLOCK_H)
    acc_i = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    acc_f = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    acc_o = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    acc_i, acc_f, acc_g, acc_o = _gates_gemm(
        acc_i, acc_f, acc_g, acc_o, X, stride_xb, stride_xk, Wih, stride_wih_n, stride_wih_k, In,
        offs_b, b_in, offs_h, h_in, H64, BLOCK_K, 4, INPUT_PRECISION)
    if HAS_HX:  # without a state, h = 0: no second GEMM
        acc_i, acc_f, acc_g, acc_o = _gates_gemm(
            acc_i, acc_f, acc_g, acc_o, Hx, stride_hb, stride_hk, Whh, stride_whh_n, stride_whh_k, H,
            offs_b, b_in, offs_h, h_in, H64, BLOCK_K, 4, INPUT_PRECISION)
    if HAS_BIH:
        acc_i, acc_f, acc_g, acc_o = _gates_bias(acc_i, acc_f, acc_g, acc_o, Bih, offs_h, h_in, stride_bih, H64, 4)
    if HAS_BHH:
        acc_i, acc_f, acc_g, acc_o = _gates_bias(acc_i, acc_f, acc_g, acc_o, Bhh, offs_h, h_in, stride_bhh, H64, 4)

    i = _sigmoid(acc_i)
    f = _sigmoid(acc_f)
    g = _tanh(acc_g)
    o = _sigmoid(acc_o)
    tile = b_in[:, None] & h_in[None, :]
    c = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    if HAS_HX:
        c = _load_state(Cx, offs_b, offs_h, tile, stride_cb, stride_ch)
    c_next = f * c + i * g                                                       # the backward recomputes this
    h_next = o * _tanh(c_next)
    _store_gate(Hout, offs_b, 0, offs_h, tile, H64, h_next)
    _store_gate(Cout, offs_b, 0, offs_h, tile, H64, c_next)
    if SAVE:  # the activations, (B, 4H) fp32: all the backward needs besides c
        _store_gates4(Saved, offs_b, offs_h, tile, H64, i, f, g, o)


@triton.jit(do_not_specialize=["B"])
def _gru_cell_fwd_kernel(
    X, Hx, Wih, Whh, Bih, Bhh, Hout, Saved,
    stride_xb, stride_xk, stride_hb, stride_hk,
    stride_wih_n, stride_wih_k, stride_whh_n, stride_whh_k, stride_bih, stride_bhh,
    B, In, H,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_HX: tl.constexpr, HAS_BIH: tl.constexpr, HAS_BHH: tl.constexpr, SAVE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    offs_b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)     # [BLOCK_B]
    offs_h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)     # [BLOCK_H]
    b_in = offs_b < B
    h_in = offs_h < H
    H64 = tl.cast(H, tl.int64)
    # The prologue and the two GEMM loops are _cell_block's and _gates_gemm's, written out: on sm90
    # the helpers' inlining (its debug-line labels in the PTX) moved ptxas's spills of one
    # specialization (104 -> 128 bytes; docs/targets.json), the other kernels' not at all.
    # r and z sum both products; n keeps them apart, since the reset gate scales W_hn h + b_hn only
    acc_r = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    acc_z = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    acc_in = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    acc_hn = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    for k0 in range(0, In, BLOCK_K):
        offs_k = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        k_in = offs_k < In
        x = _load_tile(X, offs_b, b_in, offs_k, k_in, stride_xb, stride_xk)          # [BLOCK_B, BLOCK_K]
        w = Wih + offs_h[None, :] * stride_wih_n + offs_k[:, None] * stride_wih_k    # gate 0's tile
        w_mask = h_in[None, :] & k_in[:, None]
        gate = H64 * stride_wih_n                                                    # one gate's rows
        acc_r = _dot_gate(acc_r, x, w, w_mask, INPUT_PRECISION)
        acc_z = _dot_gate(acc_z, x, w + 1 * gate, w_mask, INPUT_PRECISION)
        acc_in = _dot_gate(acc_in, x, w + 2 * gate, w_mask, INPUT_PRECISION)
    if HAS_HX:
        for k0 in range(0, H, BLOCK_K):
            offs_k = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
            k_in = offs_k < H
            hk = _load_tile(Hx, offs_b, b_in, offs_k, k_in, stride_hb, stride_hk)     # [BLOCK_B, BLOCK_K]
            w = Whh + offs_h[None, :] * stride_whh_n + offs_k[:, None] * stride_whh_k
            w_mask = h_in[None, :] & k_in[:, None]
            gate = H64 * stride_whh_n
            acc_r = _dot_gate(acc_r, hk, w, w_mask, INPUT_PRECISION)
            acc_z = _dot_gate(acc_z, hk, w + 1 * gate, w_mask, INPUT_PRECISION)
            acc_hn = _dot_gate(acc_hn, hk, w + 2 * gate, w_mask, INPUT_PRECISION)
    if HAS_BIH:
        acc_r, acc_z, acc_in, _ = _gates_bias(acc_r, acc_z, acc_in, acc_in, Bih, offs_h, h_in, stride_bih, H64, 3)
    if HAS_BHH:
        acc_r, acc_z, acc_hn, _ = _gates_bias(acc_r, acc_z, acc_hn, acc_hn, Bhh, offs_h, h_in, stride_bhh, H64, 3)

    r = _sigmoid(acc_r)
    z = _sigmoid(acc_z)
    n = _tanh(acc_in + r * acc_hn)
    tile = b_in[:, None] & h_in[None, :]
    h_next = n
    if HAS_HX:
        h_next += z * (_load_state(Hx, offs_b, offs_h, tile, stride_hb, stride_hk) - n)   # (1 - z) n + z h
    else:
        h_next -= z * n
    _store_gate(Hout, offs_b, 0, offs_h, tile, H64, h_next)
    if SAVE:  # r, z, n and W_hn h + b_hn, (B, 4H) fp32
        _store_gate(Saved, offs_b, 0 * H64, offs_h, tile, 4 * H64, r)
        _store_gate(Saved, offs_b, 1 * H64, offs_h, tile, 4 * H64, z)
        _store_gate(Saved, offs_b, 2 * H64, offs_h, tile, 4 * H64, n)
        _store_gate(Saved, offs_b, 3 * H64, offs_h, tile, 4 * H64, acc_hn)


@triton.jit(do_not_specialize=["B"])
def _rnn_cell_fwd_kernel(
    X, Hx, Wih, Whh, Bih, Bhh, Hout, Saved,
    stride_xb, stride_xk, stride_hb, stride_hk,
    stride_wih_n, stride_wih_k, stride_whh_n, stride_whh_k, stride_bih, stride_bhh,
    B, In, H,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_HX: tl.constexpr, HAS_BIH: tl.constexpr, HAS_BHH: tl.constexpr, SAVE: tl.constexpr,
    RELU: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    offs_b, offs_h, b_in, h_in, H64 = _cell_block(B, H, BLOCK_B, BLOCK_H)
    acc = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    # (one gate: the other accumulators pass through)
    acc, _, _, _ = _gates_gemm(acc, acc, acc, acc, X, stride_xb, stride_xk, Wih, stride_wih_n, stride_wih_k, In,
                               offs_b, b_in, offs_h, h_in, H64, BLOCK_K, 1, INPUT_PRECISION)
    if HAS_HX:
        acc, _, _, _ = _gates_gemm(acc, acc, acc, acc, Hx, stride_hb, stride_hk, Whh, stride_whh_n, stride_whh_k,
                                   H, offs_b, b_in, offs_h, h_in, H64, BLOCK_K, 1, INPUT_PRECISION)
    if HAS_BIH:
        acc += _bias(Bih, 0 * H64, offs_h, h_in, stride_bih)
    if HAS_BHH:
        acc += _bias(Bhh, 0 * H64, offs_h, h_in, stride_bhh)
    if RELU:
        h_next = tl.maximum(acc, 0.0)
    else:
        h_next = _tanh(acc)
    tile = b_in[:, None] & h_in[None, :]
    _store_gate(Hout, offs_b, 0, offs_h, tile, H64, h_next)
    if SAVE:  # h' before rounding, (B, H) fp32: the derivative of tanh is 1 - h'^2, of relu h' > 0
        _store_gate(Saved, offs_b, 0, offs_h, tile, H64, h_next)


# --------------------------------------------------------------------------------------------
# Backward, pointwise part. With a = the gate pre-activations and the saved activations:
#   LSTM  c' = f c + i g, h' = o tanh(c'):  dc' += dh' o (1 - tanh^2 c'),  dc = dc' f,
#         da_i = dc' g i (1 - i), da_f = dc' c f (1 - f), da_g = dc' i (1 - g^2),
#         da_o = dh' tanh(c') o (1 - o)
#   GRU   h' = (1 - z) n + z h, n = tanh(a_in + r hn):  da_n = dh' (1 - z) (1 - n^2),
#         da_r = da_n hn r (1 - r), da_z = dh' (h - n) z (1 - z); the gradient of W_ih's rows is
#         (da_r, da_z, da_n) and of W_hh's (da_r, da_z, da_n r); h also gets dh' z directly
#   Elman da = dh' (1 - h'^2) (tanh) or dh' [h' > 0] (relu)
# The gate gradients are written in the input dtype, the operand type of the GEMMs that follow.
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["B"])
def _lstm_cell_bwd_kernel(
    DHn, DCn, Cx, Saved, DGates, DC,
    stride_dhb, stride_dhh, stride_dcb, stride_dch, stride_cb, stride_ch,
    B, H,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_DH: tl.constexpr, HAS_DC: tl.constexpr, HAS_CX: tl.constexpr,
):
    offs_b, offs_h, b_in, h_in, H64 = _cell_block(B, H, BLOCK_B, BLOCK_H)
    tile = b_in[:, None] & h_in[None, :]
    i, f, g, o = _load_gates4(Saved, offs_b, offs_h, tile, H64)                  # [BLOCK_B, BLOCK_H] each
    c = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    if HAS_CX:
        c = _load_state(Cx, offs_b, offs_h, tile, stride_cb, stride_ch)
    tc = _tanh(f * c + i * g)                                                    # tanh(c'), as the forward
    dc_next = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    if HAS_DC:
        dc_next = _load_state(DCn, offs_b, offs_h, tile, stride_dcb, stride_dch)
    d_o = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    if HAS_DH:
        dh_next = _load_state(DHn, offs_b, offs_h, tile, stride_dhb, stride_dhh)
        dc_next += dh_next * o * (1.0 - tc * tc)
        d_o = dh_next * tc * o * (1.0 - o)
    _store_gate(DGates, offs_b, 0 * H64, offs_h, tile, 4 * H64, dc_next * g * i * (1.0 - i))
    _store_gate(DGates, offs_b, 1 * H64, offs_h, tile, 4 * H64, dc_next * c * f * (1.0 - f))
    _store_gate(DGates, offs_b, 2 * H64, offs_h, tile, 4 * H64, dc_next * i * (1.0 - g * g))
    _store_gate(DGates, offs_b, 3 * H64, offs_h, tile, 4 * H64, d_o)
    if HAS_CX:
        _store_gate(DC, offs_b, 0, offs_h, tile, H64, dc_next * f)


@triton.jit(do_not_specialize=["B"])
def _gru_cell_bwd_kernel(
    DHn, Hx, Saved, DGi, DGh, DHdirect,
    stride_dhb, stride_dhh, stride_hb, stride_hk,
    B, H,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, HAS_HX: tl.constexpr,
):
    offs_b, offs_h, b_in, h_in, H64 = _cell_block(B, H, BLOCK_B, BLOCK_H)
    tile = b_in[:, None] & h_in[None, :]
    r, z, n, hn = _load_gates4(Saved, offs_b, offs_h, tile, H64)                 # [BLOCK_B, BLOCK_H] each
    h = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    if HAS_HX:
        h = _load_state(Hx, offs_b, offs_h, tile, stride_hb, stride_hk)
    dh_next = _load_state(DHn, offs_b, offs_h, tile, stride_dhb, stride_dhh)
    da_n = dh_next * (1.0 - z) * (1.0 - n * n)
    da_r = da_n * hn * r * (1.0 - r)
    da_z = dh_next * (h - n) * z * (1.0 - z)
    _store_gate(DGi, offs_b, 0 * H64, offs_h, tile, 3 * H64, da_r)
    _store_gate(DGi, offs_b, 1 * H64, offs_h, tile, 3 * H64, da_z)
    _store_gate(DGi, offs_b, 2 * H64, offs_h, tile, 3 * H64, da_n)
    _store_gate(DGh, offs_b, 0 * H64, offs_h, tile, 3 * H64, da_r)
    _store_gate(DGh, offs_b, 1 * H64, offs_h, tile, 3 * H64, da_z)
    _store_gate(DGh, offs_b, 2 * H64, offs_h, tile, 3 * H64, da_n * r)
    if HAS_HX:
        _store_gate(DHdirect, offs_b, 0, offs_h, tile, H64, dh_next * z)


@triton.jit(do_not_specialize=["B"])
def _rnn_cell_bwd_kernel(
    DHn, Saved, DPre,
    stride_dhb, stride_dhh,
    B, H,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, RELU: tl.constexpr,
):
    offs_b, offs_h, b_in, h_in, H64 = _cell_block(B, H, BLOCK_B, BLOCK_H)
    tile = b_in[:, None] & h_in[None, :]
    a = _load_gate(Saved, offs_b, 0, offs_h, tile, H64)                           # h' in fp32
    dh_next = _load_state(DHn, offs_b, offs_h, tile, stride_dhb, stride_dhh)
    if RELU:
        d = tl.where(a > 0.0, dh_next, 0.0)
    else:
        d = dh_next * (1.0 - a * a)
    _store_gate(DPre, offs_b, 0, offs_h, tile, H64, d)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _batch_bucket(B: int) -> int:
    return min(max(next_power_of_2(max(B, 1)), 16), 128)


def _fwd_config(dtype: torch.dtype, device: torch.device, B: int) -> tuning.RnnTileConfig:
    if triton_interpreted():
        return tuning.RNN_CELL_INTERPRETER
    table = tuning.RNN_CELL_FWD_FP32 if dtype == torch.float32 else tuning.RNN_CELL_FWD
    return lookup(table, device, _batch_bucket(B))


def _bwd_config(device: torch.device, B: int) -> TileConfig:
    if triton_interpreted():
        cfg = tuning.RNN_CELL_INTERPRETER
        return TileConfig(cfg.block_b, cfg.block_h, cfg.num_warps, cfg.num_stages, cfg.waves_per_eu)
    return lookup(tuning.RNN_CELL_BWD, device, _batch_bucket(B))


def _grid(B: int, H: int, block_b: int, block_h: int) -> tuple[int, int]:
    grid = (cdiv(B, block_b), cdiv(H, block_h))
    if grid[1] > MAX_GRID_Y:
        raise ValueError(f"w_hh: the Triton lane runs at most {MAX_GRID_Y * block_h} hidden units "
                         f"(grid dimension 1 at {block_h} per program), got H={H}")
    return grid


def _strides2(t: torch.Tensor | None) -> tuple[int, int]:
    return tuple(t.stride()) if t is not None else (0, 0)


def _stride1(t: torch.Tensor | None) -> int:
    return t.stride(0) if t is not None else 0


def _on_device(t: torch.Tensor):
    """Triton launches on the current device: make it t's."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _fwd_common(input, h, w_ih, w_hh, b_ih, b_hh, out):
    """Operands (x, h, w_ih, w_hh, b_ih, b_hh), their strides and flags, shared by the three forward
    kernels. An absent operand, or an empty one (In = 0: an empty tensor may have no address, which
    a launch rejects), is replaced by ``out``, which the kernel then never reads."""
    x, w_ih = (input, w_ih) if input.shape[1] > 0 else (out, out)
    operands = (x, h if h is not None else out, w_ih, w_hh,
                b_ih if b_ih is not None else out, b_hh if b_hh is not None else out)
    strides = (*input.stride(), *_strides2(h), *w_ih.stride(), *w_hh.stride(), _stride1(b_ih), _stride1(b_hh))
    flags = dict(HAS_HX=h is not None, HAS_BIH=b_ih is not None, HAS_BHH=b_hh is not None,
                 INPUT_PRECISION="ieee" if input.dtype == torch.float32 else None)
    return operands, strides, flags


def lstm_cell_fwd(*, input, h, c, w_ih, w_hh, b_ih, b_hh, save: bool):
    """Launch the LSTM forward on validated 2-D inputs: input (B, In), h and c (B, H) or both None,
    w_ih (4H, In), w_hh (4H, H), b_ih and b_hh (4H,) or None, any strides. Returns h', c' (B, H) in
    input's dtype and the saved activations i, f, g, o as (B, 4H) fp32 (empty unless ``save``)."""
    B, In = input.shape
    H = w_hh.shape[1]
    h_next = alloc.empty((B, H), dtype=input.dtype, device=input.device)
    c_next = alloc.empty((B, H), dtype=input.dtype, device=input.device)
    saved = alloc.empty((B, 4 * H) if save else (0,), dtype=torch.float32, device=input.device)
    if B * H == 0:
        return h_next, c_next, saved
    cfg = _fwd_config(input.dtype, input.device, B)
    grid = _grid(B, H, cfg.block_b, cfg.block_h)
    (x, hx, wih, whh, bih, bhh), strides, flags = _fwd_common(input, h, w_ih, w_hh, b_ih, b_hh, h_next)
    s_x, s_h, s_wih, s_whh, s_b = strides[0:2], strides[2:4], strides[4:6], strides[6:8], strides[8:10]
    with _on_device(input):
        _lstm_cell_fwd_kernel[grid](
            x, hx, c if c is not None else h_next, wih, whh, bih, bhh, h_next, c_next,
            saved if save else h_next,
            *s_x, *s_h, *_strides2(c), *s_wih, *s_whh, *s_b,
            B, In, H,
            BLOCK_B=cfg.block_b, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k, SAVE=save, **flags,
            **cfg.options(),
        )
    return h_next, c_next, saved


def gru_cell_fwd(*, input, h, w_ih, w_hh, b_ih, b_hh, save: bool):
    """Launch the GRU forward on validated 2-D inputs: input (B, In), h (B, H) or None, w_ih (3H, In),
    w_hh (3H, H), b_ih and b_hh (3H,) or None. Returns h' (B, H) in input's dtype and the saved
    r, z, n and W_hn h + b_hn as (B, 4H) fp32 (empty unless ``save``)."""
    B, In = input.shape
    H = w_hh.shape[1]
    h_next = alloc.empty((B, H), dtype=input.dtype, device=input.device)
    saved = alloc.empty((B, 4 * H) if save else (0,), dtype=torch.float32, device=input.device)
    if B * H == 0:
        return h_next, saved
    cfg = _fwd_config(input.dtype, input.device, B)
    grid = _grid(B, H, cfg.block_b, cfg.block_h)
    operands, strides, flags = _fwd_common(input, h, w_ih, w_hh, b_ih, b_hh, h_next)
    with _on_device(input):
        _gru_cell_fwd_kernel[grid](
            *operands, h_next, saved if save else h_next, *strides, B, In, H,
            BLOCK_B=cfg.block_b, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k, SAVE=save, **flags,
            **cfg.options(),
        )
    return h_next, saved


def rnn_cell_fwd(*, input, h, w_ih, w_hh, b_ih, b_hh, relu: bool, save: bool):
    """Launch the Elman forward on validated 2-D inputs: input (B, In), h (B, H) or None, w_ih (H, In),
    w_hh (H, H), b_ih and b_hh (H,) or None. Returns h' (B, H) in input's dtype and h' in fp32
    (B, H) for the backward (empty unless ``save``)."""
    B, In = input.shape
    H = w_hh.shape[1]
    h_next = alloc.empty((B, H), dtype=input.dtype, device=input.device)
    saved = alloc.empty((B, H) if save else (0,), dtype=torch.float32, device=input.device)
    if B * H == 0:
        return h_next, saved
    cfg = _fwd_config(input.dtype, input.device, B)
    grid = _grid(B, H, cfg.block_b, cfg.block_h)
    operands, strides, flags = _fwd_common(input, h, w_ih, w_hh, b_ih, b_hh, h_next)
    with _on_device(input):
        _rnn_cell_fwd_kernel[grid](
            *operands, h_next, saved if save else h_next, *strides, B, In, H,
            BLOCK_B=cfg.block_b, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k, SAVE=save, RELU=relu, **flags,
            **cfg.options(),
        )
    return h_next, saved


def lstm_cell_bwd(*, dh_next, dc_next, c, saved, dtype: torch.dtype):
    """The gate gradients of the LSTM: dh_next, dc_next (B, H) or None (any strides), c (B, H) or
    None, saved (B, 4H) fp32 from :func:`lstm_cell_fwd`. Returns d(gate pre-activations) (B, 4H)
    in ``dtype`` and dc (B, H) in ``dtype`` (empty when c is None)."""
    saved = saved.contiguous()  # read as (B, row) rows; the forward's output already is
    B, H = saved.shape[0], saved.shape[1] // 4
    dgates = alloc.empty((B, 4 * H), dtype=dtype, device=saved.device)
    dc = alloc.empty((B, H) if c is not None else (0,), dtype=dtype, device=saved.device)
    if B * H == 0:
        return dgates, dc
    cfg = _bwd_config(saved.device, B)
    with _on_device(saved):
        _lstm_cell_bwd_kernel[_grid(B, H, cfg.block_m, cfg.block_n)](
            dh_next if dh_next is not None else saved, dc_next if dc_next is not None else saved,
            c if c is not None else saved, saved, dgates, dc,
            *_strides2(dh_next), *_strides2(dc_next), *_strides2(c), B, H,
            BLOCK_B=cfg.block_m, BLOCK_H=cfg.block_n,
            HAS_DH=dh_next is not None, HAS_DC=dc_next is not None, HAS_CX=c is not None,
            **cfg.options(),
        )
    return dgates, dc


def gru_cell_bwd(*, dh_next, h, saved, dtype: torch.dtype):
    """The gate gradients of the GRU: dh_next (B, H) (any strides), h (B, H) or None, saved (B, 4H)
    fp32 from :func:`gru_cell_fwd`. Returns the gradients that multiply W_ih's rows and W_hh's rows,
    each (B, 3H) in ``dtype``, and dh' z, h's direct gradient (B, H) (empty when h is None)."""
    saved = saved.contiguous()  # read as (B, row) rows; the forward's output already is
    B, H = saved.shape[0], saved.shape[1] // 4
    dgi = alloc.empty((B, 3 * H), dtype=dtype, device=saved.device)
    dgh = alloc.empty((B, 3 * H), dtype=dtype, device=saved.device)
    dh_direct = alloc.empty((B, H) if h is not None else (0,), dtype=dtype, device=saved.device)
    if B * H == 0:
        return dgi, dgh, dh_direct
    cfg = _bwd_config(saved.device, B)
    with _on_device(saved):
        _gru_cell_bwd_kernel[_grid(B, H, cfg.block_m, cfg.block_n)](
            dh_next, h if h is not None else saved, saved, dgi, dgh, dh_direct,
            *dh_next.stride(), *_strides2(h), B, H,
            BLOCK_B=cfg.block_m, BLOCK_H=cfg.block_n, HAS_HX=h is not None,
            **cfg.options(),
        )
    return dgi, dgh, dh_direct


def rnn_cell_bwd(*, dh_next, saved, relu: bool, dtype: torch.dtype):
    """The pre-activation gradient of the Elman cell: dh_next (B, H) (any strides), saved (B, H)
    fp32 from :func:`rnn_cell_fwd`. Returns (B, H) in ``dtype``."""
    saved = saved.contiguous()  # read as (B, row) rows; the forward's output already is
    B, H = saved.shape
    dpre = alloc.empty((B, H), dtype=dtype, device=saved.device)
    if B * H == 0:
        return dpre
    cfg = _bwd_config(saved.device, B)
    with _on_device(saved):
        _rnn_cell_bwd_kernel[_grid(B, H, cfg.block_m, cfg.block_n)](
            dh_next, saved, dpre, *dh_next.stride(), B, H,
            BLOCK_B=cfg.block_m, BLOCK_H=cfg.block_n, RELU=relu,
            **cfg.options(),
        )
    return dpre
