"""Linear-attention oracles: the prefix recurrence, step by step, as flash-linear-attention (fla)
defines ``chunk_linear_attn`` / ``fused_recurrent_linear_attn`` and ``chunk_simple_gla`` /
``fused_recurrent_simple_gla``.

Per sequence and head, with the state S (K, V) starting at ``initial_state`` (or zeros):

    S_t = exp(g_t) * S_{t-1} + k_t^T v_t          (g_t = 0 for plain linear attention)
    o_t = scale * q_t S_t

and with ``normalize`` (linear attention only), z_t = z_0 + k_1 + ... + k_t (K,) and
``o_t / (scale * q_t . z_t + 1e-10)``. These compute in the dtype of their floating inputs (the
checks pass float64 copies). Layout (fla's, head_first=False): q, k (B, T, H, K), v (B, T, H, V),
g (B, T, H); states (N, H, K, V), N = B, or the number of sequences of ``cu_seqlens`` (B = 1, the
sequences packed along T). No Triton here.
"""

from __future__ import annotations

import torch

# fla's constant in the normalized denominator (``fla/ops/linear_attn/utils.py``).
NORMALIZE_EPS = 1e-10


def _sequences(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, first token, end token) of every sequence: each row of the batch, or each
    cu_seqlens span of row 0."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    bounds = [int(x) for x in cu_seqlens.tolist()]
    return [(0, bos, eos) for bos, eos in zip(bounds, bounds[1:])]


def recurrence(q, k, v, g=None, scale=None, initial_state=None, cu_seqlens=None, initial_z=None,
               normalize=False):
    """The prefix recurrence. Returns (o (B, T, H, V), S_T (N, H, K, V), z_T (N, 1, H, K) or None).

    ``initial_z`` (N, 1, H, K): the key sum a normalized run starts from (fla's z_state)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    seqs = _sequences(B, T, cu_seqlens)
    o = torch.zeros(B, T, H, V, dtype=v.dtype, device=v.device)
    finals, z_finals = [], []
    for n, (b, bos, eos) in enumerate(seqs):
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[n].to(q.dtype)
        z = q.new_zeros(H, K) if initial_z is None else initial_z[n, 0].to(q.dtype)
        for t in range(bos, eos):
            decay = 1.0 if g is None else torch.exp(g[b, t].to(q.dtype))[:, None, None]  # (H, 1, 1)
            S = decay * S + k[b, t][:, :, None] * v[b, t][:, None, :]                    # (H, K, V)
            o_t = scale * torch.einsum("hk,hkv->hv", q[b, t], S)
            if normalize:
                z = z + k[b, t]
                o_t = o_t / (scale * (q[b, t] * z).sum(-1, keepdim=True) + NORMALIZE_EPS)
            o[b, t] = o_t
        finals.append(S)
        z_finals.append(z)
    final = torch.stack(finals) if finals else q.new_zeros(0, H, K, V)
    z_final = (torch.stack(z_finals) if z_finals else q.new_zeros(0, H, K))[:, None] if normalize else None
    return o, final, z_final


def _empty(q):
    return q.new_zeros(0)


def chunk_simple_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """fla's ``chunk_simple_gla``: (o, final state) of the decayed recurrence; the final state is
    an empty tensor when not asked for (the registry compares tensors only)."""
    o, final, _ = recurrence(q, k, v, g, scale, initial_state, cu_seqlens)
    return o, final if output_final_state else _empty(q)


def fused_recurrent_simple_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None):
    """fla's ``fused_recurrent_simple_gla``: the same function as :func:`chunk_simple_gla`."""
    return chunk_simple_gla(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens)


def chunk_linear_attn(q, k, v, scale=None, initial_state=None, initial_z=None, output_final_state=False,
                      normalize=False, cu_seqlens=None):
    """fla's ``chunk_linear_attn``: (o, final state, final key sum z) with g = 0; the states are
    empty tensors where not asked for (z only exists with ``normalize``)."""
    o, final, z = recurrence(q, k, v, None, scale, initial_state, cu_seqlens, initial_z, normalize)
    if not output_final_state:
        return o, _empty(q), _empty(q)
    return o, final, z if normalize else _empty(q)


def fused_recurrent_linear_attn(q, k, v, scale=None, initial_state=None, initial_z=None,
                                output_final_state=False, normalize=False, cu_seqlens=None):
    """fla's ``fused_recurrent_linear_attn``: the same function as :func:`chunk_linear_attn`."""
    return chunk_linear_attn(q, k, v, scale, initial_state, initial_z, output_final_state, normalize, cu_seqlens)


# The differentiable inputs, in the order the backward ops return their gradients.
SIMPLE_GLA_INPUTS = ("q", "k", "v", "g", "initial_state")
LINEAR_ATTN_INPUTS = ("q", "k", "v", "initial_state", "initial_z")


def gradients(forward, grad_outputs, names, **kwargs):
    """The gradients of ``forward(**kwargs)`` for ``grad_outputs`` (one per output; None where an
    output gets none), by autograd: one per name, an empty tensor where that input is None."""
    leaves = {n: kwargs[n].detach().requires_grad_() for n in names if kwargs.get(n) is not None}
    with torch.enable_grad():
        out = forward(**{**kwargs, **leaves})
        pairs = [(o, d) for o, d in zip(out, grad_outputs) if d is not None and o.numel()]
        grads = torch.autograd.grad([o for o, _ in pairs], list(leaves.values()), [d for _, d in pairs],
                                    allow_unused=True)
    by_name = dict(zip(leaves, grads))
    empty = kwargs["q"].new_zeros(0)
    return tuple(empty if n not in by_name else
                 (by_name[n] if by_name[n] is not None else torch.zeros_like(leaves[n])) for n in names)


def chunk_simple_gla_backward(do, dht=None, **kwargs):
    """(dq, dk, dv, dg, d initial_state) of :func:`chunk_simple_gla` for the gradients ``do`` of o
    and ``dht`` of the final state (None: the final state is not used)."""
    return gradients(chunk_simple_gla, (do, dht), SIMPLE_GLA_INPUTS, **kwargs)


def fused_recurrent_simple_gla_backward(do, dht=None, **kwargs):
    return chunk_simple_gla_backward(do, dht, **kwargs)


def chunk_linear_attn_backward(do, dht=None, dzt=None, **kwargs):
    """(dq, dk, dv, d initial_state, d initial_z) of :func:`chunk_linear_attn` for the gradients of
    o, the final state and the final key sum (None where unused)."""
    return gradients(chunk_linear_attn, (do, dht, dzt), LINEAR_ATTN_INPUTS, **kwargs)


def fused_recurrent_linear_attn_backward(do, dht=None, dzt=None, **kwargs):
    return chunk_linear_attn_backward(do, dht, dzt, **kwargs)
