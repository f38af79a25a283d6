"""Oracles of the mixture-of-experts family: plain PyTorch that reads like the definitions. No
Triton here.

Names and semantics are vLLM's (``vllm.model_executor.layers.fused_moe``: ``topk_softmax``,
``grouped_topk``, ``moe_align_block_size``, ``fused_experts``); the grouped GEMM is
``torch.nn.functional.grouped_mm``'s. Shapes: M tokens, K hidden size, N an expert's intermediate
size, E experts, ``topk`` experts per token. A token's routing is the pair (``topk_weights`` fp32
(M, topk), ``topk_ids`` int32 (M, topk)); its *flat index* i = t * topk + s names slot s of token t.

Where an order must be chosen, it is fixed here so that every lane agrees bit for bit: top-k
lists are sorted by score, highest first, equal scores by the lower expert (or group) id; the
tokens of one expert, in the align and in the dispatch, are in ascending flat index.

The oracles compute in the dtype of their floating inputs (the checks pass float64 copies): the
expert MLP's intermediate, which the kernels round to the activation dtype between the two GEMMs,
is not rounded here; the family's tolerances (``lanekit.moe.registry``) say what that costs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lanekit.reference.numerics import quantize_groups

I32 = torch.int32


def _sorted_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of ``scores`` (..., n) along the last dim, highest first, equal values by the
    lower index (a stable descending sort; NaN ranks above every number). Returns (values,
    indices int64). Sorted on the CPU: CUDA's stable sort does not keep tied NaNs in index order
    (seen on an H100: an all-NaN row of group scores came back as groups 2, 3, 0, 1)."""
    values, indices = torch.sort(scores.cpu(), dim=-1, descending=True, stable=True)
    return values[..., :k].to(scores.device), indices[..., :k].to(scores.device)


def topk_softmax(gating_output: torch.Tensor, topk: int, renormalize: bool = False):
    """vLLM's ``topk_softmax``: softmax of ``gating_output`` (M, E) over the experts, then its
    ``topk`` largest (ties: the lower expert id); ``renormalize`` divides the chosen weights by
    their sum. The kernels compute the softmax in fp32. Returns (topk_weights (M, topk) in the
    compute dtype, topk_ids int32 (M, topk))."""
    scores = torch.softmax(gating_output, dim=-1)
    weights, ids = _sorted_topk(scores, topk)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(I32)


def grouped_topk(gating_output: torch.Tensor, topk: int, num_expert_group: int, topk_group: int,
                 renormalize: bool = False, scoring_func: str = "softmax",
                 e_score_correction_bias: torch.Tensor | None = None,
                 routed_scaling_factor: float = 1.0):
    """DeepSeek-V3's group-limited routing (vLLM's ``grouped_topk``).

    scores = softmax or sigmoid of ``gating_output`` (M, E). The E experts form
    ``num_expert_group`` groups of E / num_expert_group consecutive experts. With
    ``e_score_correction_bias`` (E,), the *choice* is made on scores + bias, and a group's score is
    the sum of its two highest biased scores; without, on the scores, and a group's score is its
    highest. The ``topk_group`` best groups are kept (ties: the lower group id), then the ``topk``
    best experts among them (ties: the lower expert id), highest choice score first. The weights
    are the *unbiased* scores of the chosen experts, divided by their sum if ``renormalize``, then
    multiplied by ``routed_scaling_factor``. Returns (topk_weights (M, topk), topk_ids int32)."""
    if scoring_func == "softmax":
        scores = torch.softmax(gating_output, dim=-1)
    else:
        scores = torch.sigmoid(gating_output)
    M, E = scores.shape
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.to(scores.dtype)
    grouped = choice.view(M, num_expert_group, E // num_expert_group)
    if e_score_correction_bias is None:
        group_scores = grouped.max(-1).values
    else:
        group_scores = _sorted_topk(grouped, 2)[0].sum(-1)
    _, groups = _sorted_topk(group_scores, topk_group)
    keep = torch.zeros(M, num_expert_group, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, groups, True)
    keep = keep.repeat_interleave(E // num_expert_group, dim=1)
    _, ids = _sorted_topk(choice.masked_fill(~keep, -math.inf), topk)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * routed_scaling_factor, ids.to(I32)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                         expert_map: torch.Tensor | None = None):
    """vLLM's ``moe_align_block_size``: the flat indices of ``topk_ids`` (M, topk) sorted by expert,
    each expert's run padded to a multiple of ``block_size``, so that each block of
    ``block_size`` rows belongs to one expert.

    Returns
      sorted_token_ids int32 (max_num_tokens_padded,): expert 0's flat indices (ascending), padded
        with the sentinel M * topk to a multiple of block_size, then expert 1's, ...; experts with
        no token take no block; the tail past ``num_tokens_post_padded`` is the sentinel too.
        max_num_tokens_padded = M * topk + E * (block_size - 1), or M * topk * block_size when
        that is smaller (fewer routed slots than experts).
      expert_ids int32 (max_num_tokens_padded / block_size, rounded up): each block's expert, 0
        for the blocks past the last; with ``expert_map`` (E,) int32 (global -> local id, -1 for an
        expert not on this rank), each entry mapped through it (the align itself counts every
        expert: ``num_experts`` is the global count).
      num_tokens_post_padded int32 (1,): the padded length in use.
    """
    numel = topk_ids.numel()
    flat = topk_ids.reshape(-1).long()
    padded_max = numel + num_experts * (block_size - 1)
    if numel < num_experts:
        padded_max = min(numel * block_size, padded_max)
    sorted_ids = torch.full((padded_max,), numel, dtype=I32, device=topk_ids.device)
    expert_ids = torch.zeros((padded_max + block_size - 1) // block_size, dtype=I32, device=topk_ids.device)
    position = 0
    for e in range(num_experts):
        tokens = (flat == e).nonzero().reshape(-1)      # ascending flat index
        if tokens.numel() == 0:
            continue
        sorted_ids[position:position + tokens.numel()] = tokens.to(I32)
        blocks = (tokens.numel() + block_size - 1) // block_size
        expert_ids[position // block_size:position // block_size + blocks] = e
        position += blocks * block_size
    if expert_map is not None:
        expert_ids = expert_map.to(I32)[expert_ids.long()]
    return sorted_ids, expert_ids, torch.tensor([position], dtype=I32, device=topk_ids.device)


def moe_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int):
    """Gather the rows of ``x`` (M, K) in expert order: row j of the result is the token of the
    j-th flat index when the M * topk flat indices are sorted by expert, ascending within one
    (no padding). Returns
      permuted (M * topk, K): x's dtype;
      offs int32 (E,): the cumulative end of each expert's rows (``grouped_mm``'s ``offs``);
      inv_permuted_idx int32 (M, topk): the row of ``permuted`` that holds slot (t, s), which
        :func:`moe_combine` reads back.
    """
    M, topk = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    permuted = x[order // topk]
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return permuted, counts.cumsum(0).to(I32), inv.view(M, topk).to(I32)


def moe_combine(y: torch.Tensor, topk_weights: torch.Tensor, inv_permuted_idx: torch.Tensor):
    """The weighted sum back in token order: out[t] = sum over s of topk_weights[t, s] *
    y[inv_permuted_idx[t, s]], for y (R, K) (R >= every index) and the (M, topk) weights and
    indices of :func:`moe_dispatch`. The kernels sum in fp32, s = 0, 1, ... in order (no atomics),
    and round once to y's dtype. Returns (M, K)."""
    rows = y[inv_permuted_idx.long()]                         # (M, topk, K)
    return (rows * topk_weights.to(y.dtype).unsqueeze(-1)).sum(1)


def moe_dispatch_backward(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                          dpermuted: torch.Tensor):
    """The gradient in x of :func:`moe_dispatch`'s permuted rows: dx[t] = sum over s of
    dpermuted[inv_permuted_idx[t, s]]. Returns (M, K) in dpermuted's dtype."""
    _, _, inv = moe_dispatch(x, topk_ids, num_experts)
    return dpermuted[inv.long()].sum(1)


def moe_combine_backward(y: torch.Tensor, topk_weights: torch.Tensor, inv_permuted_idx: torch.Tensor,
                         dout: torch.Tensor):
    """The gradients of :func:`moe_combine` for an ``inv_permuted_idx`` that names each row at
    most once: dy[inv[t, s]] = topk_weights[t, s] * dout[t] (rows named by no slot: 0) and
    d topk_weights[t, s] = dout[t] . y[inv[t, s]]. Returns (dy (R, K), d topk_weights (M, topk))."""
    rows = inv_permuted_idx.long()
    dy = torch.zeros_like(y)
    dy[rows.reshape(-1)] = (topk_weights.to(y.dtype).unsqueeze(-1) * dout.unsqueeze(1)).reshape(-1, y.shape[1])
    return dy, (dout.unsqueeze(1) * y[rows]).sum(-1).to(topk_weights.dtype)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype | None = None):
    """``torch.nn.functional.grouped_mm`` for a 2-D ``a`` (M_total, K) and a 3-D ``b`` (E, K, N):
    rows offs[e-1]:offs[e] of a (offs[-1] = 0) times b[e]; ``offs`` int32 (E,) non-decreasing
    cumulative ends, offs[E-1] = M_total; groups of 0 rows give nothing. Returns (M_total, N) in
    ``out_dtype`` (default a's dtype)."""
    out = a.new_zeros((a.shape[0], b.shape[2]))
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[e]
        start = end
    return out if out_dtype is None else out.to(out_dtype)



def grouped_mm_backward(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, dout: torch.Tensor,
                        out_dtype: torch.dtype | None = None):
    """The gradients (d a (M_total, K), d b (E, K, N)) of :func:`grouped_mm` for the output's
    gradient ``dout`` (M_total, N), by autograd: d a = dout @ b[e]^T on each group's rows (0 past
    offs[E-1]), d b[e] = a[rows of e]^T @ dout[rows of e] (0 for a group of no rows)."""
    a, b = (t.detach().requires_grad_() for t in (a, b))
    out = grouped_mm(a, b, offs)
    return torch.autograd.grad(out, (a, b), dout.to(out.dtype))


def fused_moe_backward(dout: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
                       w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       activation: str = "silu", apply_router_weight_on_input: bool = False,
                       expert_map: torch.Tensor | None = None):
    """The gradients (d hidden_states, d w1, d w2, d topk_weights) of :func:`fused_moe` for the
    output's gradient ``dout`` (M, K), by autograd (an expert mapped to -1 gets zeros)."""
    leaves = [t.detach().requires_grad_() for t in (hidden_states, w1, w2, topk_weights)]
    out = fused_moe(*leaves, topk_ids, activation, apply_router_weight_on_input, expert_map)
    return torch.autograd.grad(out, leaves, dout.to(out.dtype), allow_unused=True, materialize_grads=True)


ACTIVATIONS = ("silu", "gelu")


def _activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """vLLM's ``silu_and_mul`` / ``gelu_and_mul`` (the exact, erf GELU): act(gate) * up."""
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate) * up


def fused_moe(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
              apply_router_weight_on_input: bool = False, expert_map: torch.Tensor | None = None,
              *, use_fp8_w8a8: bool = False, use_int8_w8a16: bool = False,
              per_channel_quant: bool = False, block_shape=None, w1_scale=None, w2_scale=None,
              a1_scale=None, a2_scale=None, intermediate_dtype=None):
    """vLLM's ``fused_experts``; unquantized weights unless ``use_fp8_w8a8`` or
    ``use_int8_w8a16`` (then :func:`fused_moe_quantized`, which these keywords are passed to).

    For each token t (of hidden_states (M, K)) and slot s: e = topk_ids[t, s] (mapped through
    ``expert_map`` when given; an expert mapped to -1 contributes nothing);
    h = w1[e] @ x (w1 (E, 2N, K): the gate rows, then the up rows); a = act(gate) * up (N,);
    out[t] += topk_weights[t, s] * (w2[e] @ a) (w2 (E, K, N)). With
    ``apply_router_weight_on_input`` the weight scales x instead of the expert's output
    (vLLM allows it with topk = 1). Returns (M, K) in hidden_states' dtype."""
    if use_fp8_w8a8 or use_int8_w8a16:
        return fused_moe_quantized(
            hidden_states, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input,
            expert_map, use_fp8_w8a8=use_fp8_w8a8, per_channel_quant=per_channel_quant,
            block_shape=block_shape, w1_scale=w1_scale, w2_scale=w2_scale, a1_scale=a1_scale,
            a2_scale=a2_scale, intermediate_dtype=intermediate_dtype)
    M, K = hidden_states.shape
    N = w2.shape[2]
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    weights = topk_weights.to(hidden_states.dtype)
    out = hidden_states.new_zeros((M, K))
    for e in range(w1.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        w = weights[token, slot].unsqueeze(-1)
        x = hidden_states[token]
        if apply_router_weight_on_input:
            x = x * w
        h = x @ w1[e].t()
        y = _activation(h[:, :N], h[:, N:], activation) @ w2[e].t()
        out.index_add_(0, token, y if apply_router_weight_on_input else y * w)
    return out


def _expand(scale: torch.Tensor, block, rows: int, cols: int) -> torch.Tensor:
    """Block scales (..., ceil(rows / b0), ceil(cols / b1)) repeated over their blocks and cut to
    (..., rows, cols)."""
    return scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :rows, :cols]


def _dequantized_weight(w, scale, per_channel_quant, block_shape):
    """codes * scale (in the compute dtype) of an expert weight (E, rows, cols): per tensor scale
    (E,) (or (1,)), per output channel (E, rows, 1), per block (E, ceil(rows / b0), ceil(cols / b1))."""
    w = w.to(scale.dtype)
    if block_shape is not None:
        return w * _expand(scale, block_shape, w.shape[1], w.shape[2])
    if per_channel_quant:
        return w * scale.reshape(w.shape[0], w.shape[1], 1)
    return w * scale.reshape(-1, 1, 1)


def _quantized_activation(a, per_channel_quant, block_shape, static_scale, dtype):
    """a (R, C) quantized to e4m3 on the fly and dequantized (codes * scale, in ``dtype``): per
    1 x block_shape[1] group of C with block scales, per row (token) with per-channel weights,
    else per tensor (dynamic, or the ``static_scale`` given)."""
    R, C = a.shape
    if block_shape is not None:
        codes, scale = quantize_groups(a, block_shape[1])
        return codes.to(dtype) * _expand(scale.to(dtype), (1, block_shape[1]), R, C)
    if per_channel_quant:
        codes, scale = quantize_groups(a, max(C, 1))
        return codes.to(dtype) * scale.to(dtype)
    codes, scale = quantize_groups(a, None, scale=static_scale)
    return codes.to(dtype) * scale.to(dtype)


def fused_moe_quantized(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
                        apply_router_weight_on_input=False, expert_map=None, *, use_fp8_w8a8=False,
                        per_channel_quant=False, block_shape=None, w1_scale=None, w2_scale=None,
                        a1_scale=None, a2_scale=None, intermediate_dtype=None):
    """vLLM's ``fused_experts`` with quantized expert weights (``use_fp8_w8a8`` or else
    ``use_int8_w8a16``), step by step where the kernels round:

    1. The weights are codes times scales: fp8 e4m3 w1 (E, 2N, K) and w2 (E, K, N) with scales
       per tensor (E,), per output channel (``per_channel_quant``: (E, 2N, 1), (E, K, 1)) or per
       128 x 128 block (``block_shape`` [128, 128]: (E, ceil(2N/128), ceil(K/128)),
       (E, ceil(K/128), ceil(N/128))); int8 W8A16: int8 codes with per-channel scales.
    2. fp8 only: x is quantized on the fly (vLLM's ``per_token_group_quant_fp8`` /
       ``scaled_fp8_quant``; :func:`lanekit.reference.numerics.quantize_groups`): per 1 x 128
       group of K with block scales, per token with per-channel weights, per tensor otherwise
       (``a1_scale`` (1,): static; None: amax / 448 of the whole x). scale = amax / 448 in fp32,
       not a power of two; codes round half to even and saturate at +-448. W8A16 keeps x.
    3. h = x_dequantized @ w1_dequantized^T, exactly (the compute dtype: float64 in the checks);
       times the router weight here with ``apply_router_weight_on_input``; a = act(gate) * up,
       rounded to ``intermediate_dtype`` (the activation dtype, where the kernels round it;
       None: not rounded).
    4. fp8 only: a, over every routed slot of this rank's experts (remote slots count zero),
       quantized the same way as x (``a2_scale`` the static per-tensor scale).
    5. out[t] = sum over slots of topk_weights[t, s] * (a_dequantized @ w2_dequantized^T).
    Returns (M, K) in the compute dtype (hidden_states')."""
    M, K = hidden_states.shape
    N = w2.shape[2]
    topk = topk_ids.shape[1]
    dt = hidden_states.dtype
    scales = [s.to(dt) for s in (w1_scale, w2_scale)]
    per_channel = per_channel_quant or not use_fp8_w8a8       # W8A16: per output channel
    w1d = _dequantized_weight(w1, scales[0], per_channel, block_shape)
    w2d = _dequantized_weight(w2, scales[1], per_channel, block_shape)
    x = hidden_states
    if use_fp8_w8a8:
        x = _quantized_activation(x, per_channel_quant, block_shape, a1_scale, dt)
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    weights = topk_weights.to(dt)
    a = hidden_states.new_zeros((M, topk, N))          # each slot's intermediate; remote: 0
    for e in range(w1.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        h = x[token] @ w1d[e].t()
        if apply_router_weight_on_input:
            h = h * weights[token, slot].unsqueeze(-1)
        a[token, slot] = _activation(h[:, :N], h[:, N:], activation)
    if intermediate_dtype is not None:
        a = a.to(intermediate_dtype).to(dt)
    a = a.reshape(M * topk, N)
    if use_fp8_w8a8:
        local = ((ids >= 0) & (ids < w1.shape[0])).reshape(-1)
        a_local = _quantized_activation(a[local], per_channel_quant, block_shape, a2_scale, dt)
        a = a.new_zeros(a.shape).index_put_((local.nonzero().reshape(-1),), a_local)
    a = a.reshape(M, topk, N)
    out = hidden_states.new_zeros((M, K))
    for e in range(w1.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        y = a[token, slot] @ w2d[e].t()
        out.index_add_(0, token, y if apply_router_weight_on_input else y * weights[token, slot].unsqueeze(-1))
    return out


# -- MXFP4 experts (gpt-oss's; vLLM's mxfp4_w4a16 scheme) --

def mxfp4_experts(w: torch.Tensor, scale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """Expert weights (E, R, C) of OCP MXFP4 blocks: w (E, R, C/2) uint8, two e2m1 codes a byte
    along C, element 2i in the low nibble; scale (E, R, C/32) e8m0 bytes, 2^(e - 127), 0xFF NaN
    (``lanekit.reference.gemm.mxfp4_weight`` per expert)."""
    from lanekit.reference.gemm import mxfp4_weight

    E, R = w.shape[:2]
    return mxfp4_weight(w.reshape(E * R, -1), scale.reshape(E * R, -1), dtype).reshape(E, R, -1)


def fused_moe_mxfp4(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
                    apply_router_weight_on_input=False, expert_map=None, *, w1_scale, w2_scale,
                    intermediate_dtype=None):
    """vLLM's ``fused_experts`` with MXFP4 experts and unquantized activations
    (``mxfp4_w4a16_moe_quant_config``): w1 (E, 2N, K/2) and w2 (E, K, N/2) e2m1 codes with e8m0
    scales w1_scale (E, 2N, K/32), w2_scale (E, K, N/32), dequantized exactly
    (:func:`mxfp4_experts`), then :func:`fused_moe_quantized`'s steps without activation
    quantization (unit per-channel scales): the intermediate rounded to ``intermediate_dtype``
    where the kernels round it. Returns (M, K) in hidden_states' dtype."""
    dt = hidden_states.dtype
    w1d, w2d = mxfp4_experts(w1, w1_scale, dt), mxfp4_experts(w2, w2_scale, dt)
    E, two_n, K = w1d.shape
    return fused_moe_quantized(hidden_states, w1d, w2d, topk_weights, topk_ids, activation,
                               apply_router_weight_on_input, expert_map,
                               w1_scale=w1d.new_ones((E, two_n, 1)), w2_scale=w2d.new_ones((E, K, 1)),
                               intermediate_dtype=intermediate_dtype)
