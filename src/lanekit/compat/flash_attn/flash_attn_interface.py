"""FlashAttention 2's ``flash_attn.flash_attn_interface`` on lanekit's kernels.

The public functions are lanekit's own (:mod:`lanekit.attention.api` and
:mod:`lanekit.attention.api_kvcache`: FlashAttention 2's signatures, semantics and return shapes). Beside them, the module-level names FlashAttention's
own tests and libraries built on its entry points (ring attention, say) import:
``_flash_attn_forward`` and ``_flash_attn_varlen_forward`` (forward only, FlashAttention's argument
order and 4-tuple result), ``_flash_attn_backward`` and ``_flash_attn_varlen_backward`` (the
gradients from a saved out and LSE, written into dq, dk, dv), ``_get_block_size_n`` and
``USE_TRITON_ROCM``.
"""

from __future__ import annotations

import torch

from lanekit.attention import op as _lanes
from lanekit.attention import tuning
from lanekit.attention.api_checks import _alibi, _capturing, _cu_seqlens, _cu_seqlens_values, _options
from lanekit.attention.api import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                  flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                  flash_attn_varlen_qkvpacked_func)
from lanekit.attention.api_kvcache import flash_attn_with_kvcache
from lanekit.runtime.tuning import lookup
from lanekit.runtime.validate import ArgumentError, argument_errors, int_in, lane_for, shape, tensor

# FlashAttention's flag for its Triton backend on ROCm (where its CUDA extension's checks, such as
# the one for the retired ``generator`` argument, are absent). lanekit is neither that backend nor
# the CUDA extension: there is no ``flash_attn_gpu`` here.
USE_TRITON_ROCM = False


def _get_block_size_n(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """The key-block size of the forward kernel for this head dim on ``device`` (lanekit's tile
    table; FlashAttention's tests use it to decode the dropout-encoded probabilities, which lanekit
    does not return). ``is_dropout`` and ``is_causal`` do not change lanekit's tile."""
    return lookup(tuning.FLASH_ATTN_FWD, torch.device(device), tuning.head_dim_block(head_dim)).block_n


def _rng_state(dropout_p: float, device) -> tuple[int | None, torch.Tensor]:
    """The dropout seed (drawn from PyTorch's CPU generator, as lanekit's default is) and
    FlashAttention's rng_state, (2,) int64 [seed, offset] on ``device``."""
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else 0
    return (seed if dropout_p > 0 else None), torch.tensor([seed, 0], dtype=torch.int64, device=device)


@argument_errors
def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                        softcap=0.0, alibi_slopes=None, return_softmax=False):
    """FlashAttention's forward entry point: ``flash_attn_func`` on q (B, Sq, Hq, D), k, v
    (B, Sk, Hkv, D), without autograd. Returns ``(out, softmax_lse, S_dmask, rng_state)``:
    out (B, Sq, Hq, Dv), softmax_lse (B, Hq, Sq) fp32, S_dmask an empty tensor (the
    dropout-encoded probabilities are not materialized), rng_state (2,) int64 [seed, offset].
    Errors: those of :func:`lanekit.flash_attn_func`."""
    seed, rng_state = _rng_state(dropout_p, q.device if isinstance(q, torch.Tensor) else "cpu")
    with torch.no_grad():
        out, lse, _ = flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, (window_size_left, window_size_right),
                                      softcap, alibi_slopes, False, True, dropout_seed=seed)
    return out, lse, q.new_empty(0), rng_state


@argument_errors
def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0):
    """FlashAttention's varlen forward entry point: ``flash_attn_varlen_func`` without autograd.

    ``seqused_k`` (B,) int32: sequence b attends to only the first seqused_k[b] of its keys
    (read back: one sync). ``num_splits``: 0 or 1 (lanekit's varlen forward does not split the
    keys). ``leftpad_k`` is not supported (an ArgumentError); ``zero_tensors`` has no effect.
    Returns ``(out, softmax_lse, S_dmask, rng_state)``: out (total_q, Hq, Dv), softmax_lse
    (Hq, total_q) fp32, S_dmask empty, rng_state (2,) int64.
    Errors: those of :func:`lanekit.flash_attn_varlen_func`; num_splits > 1 and leftpad_k."""
    if int_in("num_splits", num_splits, 0, 2**31 - 1) > 1:
        raise ArgumentError(f"num_splits > 1 is not supported: lanekit's varlen forward does not split the keys "
                            f"(expected 0 or 1, got {num_splits})")
    if leftpad_k is not None:
        raise ArgumentError("leftpad_k: expected None (not supported by lanekit's varlen forward), got a tensor")
    if seqused_k is not None:
        tensor("seqused_k", seqused_k, dtypes=(torch.int32,), ndim=1, like=q, like_name="q")
        if seqused_k.shape[0] != cu_seqlens_k.shape[0] - 1:
            raise ArgumentError(f"seqused_k: expected shape ({cu_seqlens_k.shape[0] - 1},) (one per sequence), "
                                f"got {tuple(seqused_k.shape)}")
        k, v, cu_seqlens_k = _used_keys(k, v, cu_seqlens_k, seqused_k, block_table is not None)
    seed, rng_state = _rng_state(dropout_p, q.device)
    with torch.no_grad():
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             dropout_p, softmax_scale, causal, (window_size_left, window_size_right),
                                             softcap, alibi_slopes, False, True, block_table, dropout_seed=seed)
    return out, lse, q.new_empty(0), rng_state


def _used_keys(k, v, cu_seqlens_k, seqused_k, paged: bool):
    """k, v and cu_seqlens_k of only the first seqused_k[b] keys of each sequence: for a paged
    cache, lengths from seqused_k (the pages stay); for packed keys, the used rows gathered."""
    used = seqused_k.to(torch.int64)
    cu_used = torch.nn.functional.pad(used.cumsum(0), (1, 0)).to(torch.int32)
    if paged:
        return k, v, cu_used
    lengths = cu_seqlens_k.diff().to(torch.int64)
    if bool((used < 0).any()) or bool((used > lengths).any()):
        raise ArgumentError(f"seqused_k: expected 0 <= seqused_k <= each sequence's keys {lengths.tolist()[:16]}, "
                            f"got {used.tolist()[:16]}")
    starts = torch.repeat_interleave(cu_seqlens_k[:-1].to(torch.int64), used)
    rows = starts + torch.arange(int(used.sum()), device=k.device) - torch.repeat_interleave(cu_used[:-1].to(torch.int64), used)
    return k.index_select(0, rows), v.index_select(0, rows), cu_used



def _seed(rng_state, dropout_p) -> int:
    """The dropout seed a forward entry point returned in its rng_state ([seed, offset])."""
    if rng_state is None:
        if dropout_p > 0:
            raise ArgumentError("rng_state: expected the (2,) int64 tensor the forward returned (with dropout "
                                "the backward regenerates its mask from it), got None")
        return 0
    tensor("rng_state", rng_state, dtypes=(torch.int64,), ndim=1)
    return int(rng_state[0])


def _written(name, given, grad):
    """FlashAttention's entry points write the gradients into dq, dk, dv when given."""
    if given is None:
        return grad
    tensor(name, given, like=grad, like_name=name[1:])
    shape(name, given, grad.shape, "the shape of its input")
    given.copy_(grad)
    return given


@argument_errors
def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                         deterministic=False, rng_state=None):
    """FlashAttention's backward entry point: the gradients of ``flash_attn_func`` from the
    forward's saved ``out`` (B, Sq, Hq, Dv) and ``softmax_lse`` (B, Hq, Sq) fp32, for the gradient
    ``dout`` of out, written into ``dq``, ``dk``, ``dv`` when given (else new tensors). With dropout,
    ``rng_state`` is the one the forward entry point returned. Returns softmax_d (B, Hq, Sq) fp32,
    rowsum(dout * out). The Triton lane runs lanekit's backward kernels on the saved out and LSE;
    the reference lane differentiates the float64 oracle. Not differentiable itself.
    Errors: those of :func:`lanekit.flash_attn_func` for q, k, v and the options; dout, out and the
    gradients not of the shapes of out, q, k, v."""
    tensor("q", q, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64), ndim=4)
    for name, t in (("k", k), ("v", v), ("out", out), ("dout", dout)):
        tensor(name, t, ndim=4, like=q, like_name="q", like_dtype=True)
    B, Sq, Hq, D = q.shape
    shape("out", out, (B, Sq, Hq, v.shape[3]), "q's (B, Sq, Hq) and v's head dim")
    shape("dout", dout, out.shape, "the shape of out")
    tensor("softmax_lse", softmax_lse, dtypes=(torch.float32,), like=q, like_name="q")
    shape("softmax_lse", softmax_lse, (B, Hq, Sq), "(B, Hq, Sq)")
    scale, left, right = _options(D, Sq, k.shape[1], dropout_p, softmax_scale, softcap, causal,
                                  (window_size_left, window_size_right))
    slopes = _alibi(alibi_slopes, B, Hq, q)
    seed = _seed(rng_state, dropout_p)
    with torch.no_grad():
        if lane_for(q, None, "q") == "triton":
            grads = _lanes._flash_attn_bwd_op(dout, q, k, v, out, softmax_lse, None, None, None, slopes, scale, left,
                                              right, float(softcap), float(dropout_p), seed, 0, False)[:3]
        else:
            grads = _lanes.flash_attn_backward_reference(
                dout=dout, q=q, k=k, v=v, softmax_scale=scale, window_size=(left, right), softcap=float(softcap),
                alibi_slopes=slopes, attn_bias=None, attn_mask=None, dropout_p=float(dropout_p), seed=seed,
                offset=0)[:3]
        for name, given, grad in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
            _written(name, given, grad)
        return (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()


@argument_errors
def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left=-1,
                                window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
                                rng_state=None, zero_tensors=False):
    """FlashAttention's varlen backward entry point: the gradients of ``flash_attn_varlen_func``
    (packed q (total_q, Hq, D), k, v (total_k, Hkv, D)) from the saved ``out`` (total_q, Hq, Dv) and
    ``softmax_lse`` (Hq, total_q) fp32, written into dq, dk, dv when given. Returns softmax_d
    (Hq, total_q) fp32, rowsum(dout * out). As :func:`_flash_attn_backward` otherwise;
    ``zero_tensors`` has no effect."""
    tensor("q", q, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64), ndim=3)
    for name, t in (("k", k), ("v", v), ("out", out), ("dout", dout)):
        tensor(name, t, ndim=3, like=q, like_name="q", like_dtype=True)
    total_q, Hq, D = q.shape
    shape("out", out, (total_q, Hq, v.shape[2]), "q's (total_q, Hq) and v's head dim")
    shape("dout", dout, out.shape, "the shape of out")
    tensor("softmax_lse", softmax_lse, dtypes=(torch.float32,), like=q, like_name="q")
    shape("softmax_lse", softmax_lse, (Hq, total_q), "(Hq, total_q)")
    # the forward's checks of the lengths (values read back: one sync) and of the options
    max_seqlen_q = int_in("max_seqlen_q", max_seqlen_q, 0, 2**31 - 1)
    max_seqlen_k = int_in("max_seqlen_k", max_seqlen_k, 0, 2**31 - 1)
    B = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, q)
    _cu_seqlens("cu_seqlens_k", cu_seqlens_k, B, q)
    if not _capturing():
        both = torch.cat((cu_seqlens_q, cu_seqlens_k)).tolist()
        _cu_seqlens_values("cu_seqlens_q", both[:B + 1], total_q, max_seqlen_q)
        _cu_seqlens_values("cu_seqlens_k", both[B + 1:], k.shape[0], max_seqlen_k)
    scale, left, right = _options(D, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, softcap, causal,
                                  (window_size_left, window_size_right))
    slopes = _alibi(alibi_slopes, B, Hq, q)
    seed = _seed(rng_state, dropout_p)
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    with torch.no_grad():
        if lane_for(q, None, "q") == "triton":
            grads = _lanes._flash_attn_varlen_bwd_op(dout, q, k, v, out, softmax_lse, None, cu_q, cu_k, slopes,
                                                     max_seqlen_q, max_seqlen_k, scale, left, right,
                                                     float(softcap), float(dropout_p), seed, 0)
        else:
            grads = _lanes.flash_attn_varlen_backward_reference(
                dout=dout, q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, block_table=None, softmax_scale=scale, window_size=(left, right),
                softcap=float(softcap), alibi_slopes=slopes, dropout_p=float(dropout_p), seed=seed, offset=0)
        for name, given, grad in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
            _written(name, given, grad)
        return (dout.float() * out.float()).sum(-1).transpose(0, 1).contiguous()

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
