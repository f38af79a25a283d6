"""Gated linear units, y = act(gate) * up: SwiGLU and GeGLU (erf or tanh), forward
(``_glu_fwd_kernel``) and backward (``_glu_bwd_kernel``), a block of one row's features a program."""

from __future__ import annotations

import math

import triton
import triton.language as tl

from lanekit.layers import tuning
from lanekit.runtime.host import cdiv, next_power_of_2
from lanekit.runtime.lanes import triton_interpreted
from lanekit.runtime.launch import launch

if triton_interpreted():
    from lanekit.runtime.interpreter import fix_interpreter

    fix_interpreter()


_SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2.0 / math.pi))
_INV_SQRT_2 = tl.constexpr(1.0 / math.sqrt(2.0))
_INV_SQRT_2PI = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _glu_act(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in fp32: 0 silu, 1 gelu (erf), 2 gelu (tanh approximation)."""
    # 1 - sigmoid(z) is taken as sigmoid(-z): subtracting from 1 loses it where sigmoid(z) ~ 1
    if ACT == 0:
        s = tl.sigmoid(g)
        return g * s, s * (1.0 + g * tl.sigmoid(-g))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * _INV_SQRT_2))
        return g * cdf, cdf + g * _INV_SQRT_2PI * tl.exp(-0.5 * g * g)
    else:
        # 0.5 * (1 + tanh(u)) = sigmoid(2u), and 1 - tanh(u)^2 = 4 s (1 - s): no cancellation
        inner = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        s = tl.sigmoid(2.0 * inner)
        d_inner = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * g * g)
        return g * s, s + 2.0 * g * s * tl.sigmoid(-2.0 * inner) * d_inner


@triton.jit
def _glu_block(N, BLOCK_N: tl.constexpr):
    """(row, columns, mask) of this program: programs walk the column blocks of row 0, then row 1..."""
    blocks = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0).to(tl.int64)
    row = pid // blocks
    cols = (pid % blocks) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    return row, cols, cols < N


@triton.jit
def _glu_fwd_kernel(G, U, Y, stride_gm, stride_gn, stride_um, stride_un, stride_ym, stride_yn,
                    N, ACT: tl.constexpr, BLOCK_N: tl.constexpr):
    row, cols, mask = _glu_block(N, BLOCK_N)
    g = tl.load(G + row * stride_gm + cols * stride_gn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_um + cols * stride_un, mask=mask, other=0.0).to(tl.float32)
    act, _ = _glu_act(g, ACT)
    tl.store(Y + row * stride_ym + cols * stride_yn, (act * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(DY, G, U, DG, DU, stride_dym, stride_dyn, stride_gm, stride_gn, stride_um,
                    stride_un, stride_dgm, stride_dgn, stride_dum, stride_dun,
                    N, ACT: tl.constexpr, BLOCK_N: tl.constexpr):
    row, cols, mask = _glu_block(N, BLOCK_N)
    dy = tl.load(DY + row * stride_dym + cols * stride_dyn, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_gm + cols * stride_gn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_um + cols * stride_un, mask=mask, other=0.0).to(tl.float32)
    act, dact = _glu_act(g, ACT)
    tl.store(DU + row * stride_dum + cols * stride_dun, (dy * act).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + row * stride_dgm + cols * stride_dgn, (dy * u * dact).to(DG.dtype.element_ty), mask=mask)


def _glu_grid(rows, N, device):
    """(grid, BLOCK_N, num_warps): the row's block, or where rows of several blocks (inputs that
    could not be flattened: _flat) leave the last block of each partly idle, the largest power of
    two down to block_n >> fit_shifts that divides N, with warps in proportion (N = 14336, half of
    each row's last 4096-block idle: 2048 and half the warps). A row of one block keeps it."""
    cfg = tuning.glu_config(device)
    block, num_warps = min(cfg.block_n, next_power_of_2(max(N, 1))), cfg.num_warps
    if rows > 1 and N > block and N % block:
        for shift in range(1, cfg.fit_shifts + 1):
            if N % (block >> shift) == 0:
                block, num_warps = block >> shift, max(1, num_warps >> shift)
                break
    return (rows * cdiv(N, block),), block, num_warps


def _flat(*ts):
    """The tensors as one (1, rows * N) row when all are contiguous: every program then gets a full
    block, where rows of N = 14336 leave the last block of each row partly idle."""
    if all(t.is_contiguous() for t in ts):
        return tuple(t.view(1, -1) for t in ts)
    return ts


def glu_fwd(*, gate, up, activation, out):
    """gate, up, out: (rows, N) views with any strides; writes act(gate) * up into out."""
    rows, N = gate.shape
    if rows == 0 or N == 0:
        return out
    gate, up, out_rows = _flat(gate, up, out)
    rows, N = gate.shape
    grid, block, num_warps = _glu_grid(rows, N, gate.device)
    launch(_glu_fwd_kernel, grid, gate, up, out_rows, *gate.stride(), *up.stride(), *out_rows.stride(), N,
                          ACT=ACTIVATIONS[activation], BLOCK_N=block, num_warps=num_warps)
    return out


def glu_bwd(*, dy, gate, up, activation, dgate, dup):
    """Writes d(gate) and d(up), (rows, N) views with any strides (halves of one fused gradient
    when the input was fused)."""
    rows, N = gate.shape
    if rows == 0 or N == 0:
        return
    dy, gate, up, dgate, dup = _flat(dy, gate, up, dgate, dup)
    rows, N = gate.shape
    grid, block, num_warps = _glu_grid(rows, N, gate.device)
    launch(_glu_bwd_kernel, grid, dy, gate, up, dgate, dup, *dy.stride(), *gate.stride(), *up.stride(),
                          *dgate.stride(), *dup.stride(), N, ACT=ACTIVATIONS[activation],
                          BLOCK_N=block, num_warps=num_warps)
