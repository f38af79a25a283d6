"""Expert parallelism: a mixture-of-experts layer whose experts are sharded over a process group,
the tokens moved to their experts' ranks and back by all-to-alls of ``torch.distributed``.

Rank r of a group of W ranks holds the experts [r * E / W, (r + 1) * E / W) (contiguous shards; E
divisible by W). :func:`ep_dispatch` sends each routed slot (token t, slot s) to the rank of its
expert and returns the rows this rank's experts receive, expert-major; the local experts run on
them (``fused_moe`` with the handle's ``expert_ids`` and ``expert_map``, or ``grouped_mm`` on the
per-expert counts); :func:`ep_combine` sends the results back and sums each token's slots with its
router weights as :func:`lanekit.moe.moe_combine` does. :class:`EPMoE` is the whole block.

The transport is ``torch.distributed.all_to_all_single`` (gloo on CPU tensors, NCCL on CUDA ones),
its split sizes exchanged first by an all-to-all of the per-expert counts; this is the dispatch /
combine all-to-all pair of DeepSpeed-MoE, Megatron-LM's expert-parallel token dispatcher and
vLLM's all-to-all MoE backends (names and semantics taken from them; no code). The counts are read
on the host (all_to_all_single takes host split sizes): one device sync per dispatch.

Not registered as ops of the check registry: they are compositions of torch.distributed and the
family's checked ops; their oracle is the unsharded ``fused_moe`` (tests/test_moe_distributed.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lanekit.moe.api import fused_moe, moe_combine, moe_dispatch, topk_softmax
from lanekit.runtime import alloc
from lanekit.runtime.lanes import select_lane
from lanekit.runtime.validate import ArgumentError, ArgumentTypeError
from lanekit.runtime.validate import flag as _flag
from lanekit.runtime.validate import int_at_least as _int_at_least
from lanekit.runtime.validate import shape as _shape
from lanekit.runtime.validate import tensor as _tensor

__all__ = ["EPHandle", "EPMoE", "ep_combine", "ep_dispatch"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LAYER_DTYPES = (torch.bfloat16, torch.float16)      # fused_moe's; float64 on the reference lane
_MAX_EXPERTS = 1024   # moe_dispatch's bound


# ---- the transport: all_to_all_single with its backward ----

def _all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    # through alloc.empty: poisoned in checked runs, so a row no rank sent stays NaN
    out = alloc.empty((sum(recv_splits), x.shape[1]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


class AllToAllFunction(torch.autograd.Function):
    """Rows of x (send_splits[r] of them to rank r, in rank order) -> the rows every rank sent
    here (recv_splits[r] from rank r). Its backward is the same all-to-all with the splits swapped:
    the backward of the dispatch is a combine-shaped all-to-all and back. Every rank must run the
    backward (as any collective): the layer keeps its graph connected on every rank."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _all_to_all(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, dout):
        send_splits, recv_splits = ctx.splits
        return _all_to_all(dout, recv_splits, send_splits, ctx.group), None, None, None


# ---- dispatch and combine ----

@dataclasses.dataclass(frozen=True)
class EPHandle:
    """What :func:`ep_combine` needs to bring the experts' rows back (from :func:`ep_dispatch`).

    Fields a caller uses: ``expert_ids`` (R, 1) int32, the global expert of each received row, and
    ``expert_map`` (E,) int32, global -> local expert id (-1 for an expert on another rank): the
    ``topk_ids`` and ``expert_map`` of ``fused_moe`` on the local experts (with topk_weights 1);
    ``rank``, ``world_size``, ``num_experts``, ``num_local_experts``. The rest is the bookkeeping of
    the two all-to-alls."""

    group: object
    rank: int
    world_size: int
    num_experts: int
    num_local_experts: int
    expert_ids: torch.Tensor        # (R, 1) int32, global ids of the received rows
    expert_map: torch.Tensor        # (E,) int32, global -> local, -1 elsewhere
    hidden_size: int                # K
    dtype: torch.dtype              # x's dtype, the same on every rank
    topk_weights: torch.Tensor      # (M, topk), the sender's router weights
    inv_permuted_idx: torch.Tensor  # (M, topk) int32, moe_dispatch's
    to_expert_major: torch.Tensor   # (R,) int64: received row j is the source-major row [j]
    to_source_major: torch.Tensor   # (R,) int64: its inverse
    send_splits: list
    recv_splits: list
    lane: str | None


def _group(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise ArgumentError("group: expected an initialised torch.distributed process group "
                            "(torch.distributed.init_process_group first), got none initialised")
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise ArgumentTypeError(f"group: expected a torch.distributed.ProcessGroup or None (the default "
                                f"group), got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ArgumentError("group: expected a process group this process belongs to, got one it is not a "
                            "member of")
    return group, rank, dist.get_world_size(group)


def _num_experts(num_experts, world_size: int) -> int:
    num_experts = _int_at_least("num_experts", num_experts, 1)
    if num_experts > _MAX_EXPERTS:
        raise ArgumentError(f"num_experts: expected an int in [1, {_MAX_EXPERTS}], got {num_experts}")
    if num_experts % world_size:
        raise ArgumentError(f"num_experts: expected a multiple of the group's size {world_size} (each rank "
                            f"holds num_experts / world_size experts), got {num_experts}")
    return num_experts


def _source_to_expert_major(counts: torch.Tensor) -> torch.Tensor:
    """counts (W, El): rows arrive source-major (source 0's rows of local expert 0, 1, ..., then
    source 1's); the index that reads them expert-major (expert 0's rows from source 0, 1, ...)."""
    W, El = counts.shape
    flat = counts.reshape(-1)
    start = (flat.cumsum(0) - flat).view(W, El).t().reshape(-1)      # (El * W,) expert-major segments
    length = counts.t().reshape(-1)
    seg = torch.repeat_interleave(torch.arange(W * El), length)
    within = torch.arange(int(length.sum())) - torch.repeat_interleave(length.cumsum(0) - length, length)
    return start[seg] + within


def ep_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, group=None,
                num_experts: int | None = None, *, lane: str | None = None):
    """Send each token's routed slots to the ranks of their experts: the rows this rank's experts
    receive, expert-major, their per-expert counts, and the handle of :func:`ep_combine`.

    The slots (t, s) of this rank's M tokens are sorted by expert (``moe_dispatch``'s order: by
    expert, ascending flat index t * topk + s) and sent by ``all_to_all_single``, the split sizes
    exchanged first by an all-to-all of the per-expert counts. Rank r holds experts
    [r * El, (r + 1) * El), El = num_experts / world_size. The received rows are ordered by local
    expert, then by source rank, then by the source's order.

    Arguments:
        x: (M, K) fp16, bf16 or fp32 (fp64 with the reference lane), any strides; M may be 0. K and
            the dtype must be the same on every rank.
        topk_ids: (M, topk) int32 on x's device: global expert ids in [0, num_experts).
        topk_weights: (M, topk) float on x's device: the router weights, applied by ep_combine
            (kept in the handle, so that the router's gradient flows through it).
        group: a torch.distributed ProcessGroup, or None for the default group.
        num_experts: E, the global number of experts, a multiple of the group's size, at most 1024.
        lane: "triton" or "reference" for the local permute (``moe_dispatch``); default by device.

    Returns:
        received: (R, K) in x's dtype, exact copies of the senders' rows; differentiable in x (its
            backward is the combine-shaped all-to-all back, then the permute's backward).
        counts: (El,) int32 on x's device: the rows of each local expert (``grouped_mm``'s offs is
            their cumulative sum).
        handle: an :class:`EPHandle`; ``handle.expert_ids`` (R, 1) and ``handle.expert_map`` (E,)
            run ``fused_moe`` on the local experts' weights (El, 2N, K) and (El, K, N).
        One device sync (the counts are host split sizes); two collectives.

    Raises (on this rank, before any communication; the other ranks then wait in their collective,
    so give every rank valid arguments):
        TypeError: a non-tensor; x not a float dtype; topk_ids not int32; topk_weights not float;
            group not a ProcessGroup; num_experts not an int.
        ValueError: x not 2-d; topk_ids not (M, topk) or on another device; topk outside
            [1, num_experts]; topk_weights not topk_ids' shape; num_experts not given, outside
            [1, 1024] or not a multiple of the world size; an id outside [0, num_experts); no
            process group initialised, or one this process is not a member of; an unknown lane.
        ValueError (on every rank, after the count exchange, before the rows move): K or the dtype
            differs between ranks.

    Source: the dispatch all-to-all of DeepSpeed-MoE, Megatron-LM's ``MoEAlltoAllTokenDispatcher``
    and vLLM's all-to-all expert parallelism; contiguous expert shards as vLLM's ``expert_map``.
    """
    _tensor("x", x, dtypes=_FLOATS, ndim=2)
    _tensor("topk_ids", topk_ids, dtypes=(torch.int32,), ndim=2, like=x, like_name="x")
    M, K = x.shape
    if topk_ids.shape[0] != M:
        raise ArgumentError(f"topk_ids: expected ({M}, topk) (x's M), got shape {tuple(topk_ids.shape)}")
    _tensor("topk_weights", topk_weights, dtypes=_FLOATS, ndim=2, like=x, like_name="x")
    _shape("topk_weights", topk_weights, tuple(topk_ids.shape), "topk_ids' shape (M, topk)")
    if num_experts is None:
        raise ArgumentError("num_experts: expected the global number of experts (an int), got None")
    group, rank, W = _group(group)
    E = _num_experts(num_experts, W)
    topk = topk_ids.shape[1]
    if not 1 <= topk <= E:
        raise ArgumentError(f"topk_ids: expected (M, topk) with 1 <= topk <= num_experts = {E}, got shape "
                            f"{tuple(topk_ids.shape)}")
    ids = topk_ids.reshape(-1).long().cpu()          # the one sync: split sizes live on the host
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= E):
        bad = ids[(ids < 0) | (ids >= E)][0]
        raise ArgumentError(f"topk_ids: expected expert ids in [0, {E}), got {int(bad)}")
    El = E // W
    permuted, _, inv = moe_dispatch(x, topk_ids, E, lane=lane)     # (M * topk, K), sorted by expert
    send_counts = torch.bincount(ids, minlength=E).view(W, El)
    meta = torch.cat([send_counts, torch.tensor([[K, _FLOATS.index(x.dtype)]]).expand(W, 2)], dim=1)
    recv_meta = _all_to_all(meta.to(x.device), [1] * W, [1] * W, group).cpu()   # row s: from rank s
    ks, dts = recv_meta[:, El].tolist(), recv_meta[:, El + 1].tolist()
    if len(set(ks)) > 1 or len(set(dts)) > 1:
        raise ArgumentError(f"x: expected the same K and dtype on every rank of the group, got K {ks} and "
                            f"dtypes {[str(_FLOATS[d]) for d in dts]} (by rank)")
    recv_counts = recv_meta[:, :El]
    send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    received = AllToAllFunction.apply(permuted, send_splits, recv_splits, group)
    to_expert = _source_to_expert_major(recv_counts)
    to_source = torch.empty_like(to_expert)
    to_source[to_expert] = torch.arange(to_expert.numel())
    local_counts = recv_counts.sum(0)
    expert_ids = torch.repeat_interleave(torch.arange(rank * El, (rank + 1) * El), local_counts)
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[rank * El:(rank + 1) * El] = torch.arange(El, dtype=torch.int32)
    device = x.device
    handle = EPHandle(group=group, rank=rank, world_size=W, num_experts=E, num_local_experts=El,
                      expert_ids=expert_ids.to(device=device, dtype=torch.int32).view(-1, 1),
                      expert_map=expert_map.to(device), hidden_size=K, dtype=x.dtype,
                      topk_weights=topk_weights, inv_permuted_idx=inv,
                      to_expert_major=to_expert.to(device), to_source_major=to_source.to(device),
                      send_splits=send_splits, recv_splits=recv_splits, lane=lane)
    received = received.index_select(0, handle.to_expert_major)
    return received, local_counts.to(device=device, dtype=torch.int32), handle


def ep_combine(y: torch.Tensor, handle: EPHandle) -> torch.Tensor:
    """Send the local experts' rows back to the ranks of their tokens and sum each token's slots:
    ``out[t] = sum over s of topk_weights[t, s] * y_s``, y_s the row its expert computed for slot
    (t, s), as :func:`lanekit.moe.moe_combine` sums (fp32, in slot order, rounded once to y's
    dtype: the same bits on every run).

    Arguments:
        y: (R, K) in the dispatched x's dtype, on its device: the experts' outputs in the order of
            :func:`ep_dispatch`'s ``received`` (R its rows, K its width), any strides.
        handle: the :class:`EPHandle` of that dispatch.

    Returns:
        (M, K) in y's dtype on the rank that sent the tokens. Differentiable in y (the backward is
        the dispatch-shaped all-to-all) and in the handle's topk_weights.

    Raises (before any communication):
        TypeError: handle not an EPHandle; y not a tensor or not the dispatched x's dtype.
        ValueError: y not (R, K) or on another device.

    Source: the combine all-to-all of DeepSpeed-MoE, Megatron-LM's token dispatcher and vLLM's
    all-to-all expert parallelism; the weighted sum is vLLM's ``moe_unpermute``/``moe_sum``.
    """
    if not isinstance(handle, EPHandle):
        raise ArgumentTypeError(f"handle: expected the EPHandle that ep_dispatch returned, got "
                                f"{type(handle).__name__}")
    _tensor("y", y, dtypes=(handle.dtype,), ndim=2, like=handle.topk_weights, like_name="the dispatched x")
    _shape("y", y, (handle.to_expert_major.numel(), handle.hidden_size),
           "(R, K): the rows ep_dispatch received, the dispatched x's K")
    back = AllToAllFunction.apply(y.index_select(0, handle.to_source_major), handle.recv_splits,
                                  handle.send_splits, handle.group)
    return moe_combine(back, handle.topk_weights, handle.inv_permuted_idx, lane=handle.lane)


# ---- the layer ----

class EPMoE(torch.nn.Module):
    """A mixture-of-experts block (Mixtral's / Qwen-MoE's: a router, then SwiGLU experts) whose
    experts are sharded over a process group: each rank holds only its El = E / W experts.

    forward(x): router logits ``x @ router^T`` in fp32 (x and the router weight upcast, so that a
    token's experts do not depend on how the tokens are split over the ranks), ``topk_softmax``
    (renormalized or not), :func:`ep_dispatch`, ``fused_moe`` on the local experts (each received
    row is one slot: topk 1, weight 1, the handle's expert_ids and expert_map), :func:`ep_combine`.
    The result equals the unsharded ``fused_moe`` up to one more rounding: the experts' rows travel
    back in x's dtype, as DeepSpeed-MoE and vLLM send them.

    Parameters: ``router`` (E, K); ``w1`` (El, 2N, K) the local experts' gate rows then up rows;
    ``w2`` (El, K, N); all in ``dtype`` (bf16 or fp16; fp64 with lane="reference"). Every rank
    must run forward and backward together (collectives); a rank whose experts receive no row gets
    zero (not None) gradients for them, so that every rank's graph takes part in the backward.

    x: (..., K) in the parameters' dtype; returns x's shape and dtype. Errors: those of
    :func:`ep_dispatch`, ``topk_softmax`` and ``fused_moe``; at construction, a TypeError for a
    dtype fused_moe does not take and a ValueError for an unknown lane (not at the first forward);
    in forward, a ValueError for x not (..., K) before anything runs.

    Source: DeepSpeed-MoE / Megatron-LM expert parallelism (all-to-all dispatch and combine);
    vLLM's ``FusedMoE`` (router, ``fused_experts``, ``expert_map``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, topk: int, group=None,
                 *, renormalize: bool = True, dtype: torch.dtype = torch.bfloat16, device=None,
                 lane: str | None = None):
        super().__init__()
        K = _int_at_least("hidden_size", hidden_size, 1)
        N = _int_at_least("intermediate_size", intermediate_size, 1)
        group, rank, W = _group(group)
        E = _num_experts(num_experts, W)
        self.topk = _int_at_least("topk", topk, 1)
        if self.topk > E:
            raise ArgumentError(f"topk: expected an int in [1, num_experts = {E}], got {topk}")
        self.renormalize = _flag("renormalize", renormalize)
        if dtype not in _LAYER_DTYPES + (torch.float64,):
            raise ArgumentTypeError(f"dtype: expected one of {[str(d) for d in _LAYER_DTYPES]} (torch.float64 with "
                                    f"lane='reference'), got {dtype!r}")
        self.group, self.rank, self.world_size, self.num_experts, self.lane = group, rank, W, E, lane
        El = E // W
        self.router = torch.nn.Parameter(torch.empty(E, K, dtype=dtype, device=device))
        self.w1 = torch.nn.Parameter(torch.empty(El, 2 * N, K, dtype=dtype, device=device))
        self.w2 = torch.nn.Parameter(torch.empty(El, K, N, dtype=dtype, device=device))
        if select_lane(self.router.device, lane) != "reference" and dtype == torch.float64:
            raise ArgumentTypeError("dtype: expected torch.bfloat16 or torch.float16 on the triton lane, got "
                                    "torch.float64 (float64 runs on the reference lane only: lane='reference')")
        for w, fan_in in ((self.router, K), (self.w1, K), (self.w2, N)):
            torch.nn.init.normal_(w, std=fan_in ** -0.5)

    @classmethod
    def from_full(cls, router: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk: int, group=None, *,
                  renormalize: bool = True, lane: str | None = None) -> "EPMoE":
        """This rank's shard of a block given whole: router (E, K), w1 (E, 2N, K), w2 (E, K, N), one
        dtype and device; copies experts [rank * El, (rank + 1) * El) of w1 and w2 (and the router).
        Raises TypeError / ValueError naming the argument for other shapes or dtypes."""
        _tensor("router", router, dtypes=_LAYER_DTYPES + (torch.float64,), ndim=2)
        _tensor("w1", w1, ndim=3, like=router, like_name="router", like_dtype=True)
        _tensor("w2", w2, ndim=3, like=router, like_name="router", like_dtype=True)
        E, K = router.shape
        if w1.shape[0] != E or w1.shape[2] != K or w1.shape[1] % 2:
            raise ArgumentError(f"w1: expected (E, 2N, K) with E = {E}, K = {K} (router's) and an even 2N, got "
                                f"shape {tuple(w1.shape)}")
        N = w1.shape[1] // 2
        _shape("w2", w2, (E, K, N), "(E, K, N): E and K of router, N of w1")
        layer = cls(K, N, E, topk, group, renormalize=renormalize, dtype=router.dtype, device=router.device,
                    lane=lane)
        lo, hi = layer.rank * (E // layer.world_size), (layer.rank + 1) * (E // layer.world_size)
        with torch.no_grad():
            layer.router.copy_(router)
            layer.w1.copy_(w1[lo:hi])
            layer.w2.copy_(w2[lo:hi])
        return layer

    def _experts(self, received: torch.Tensor, handle: EPHandle) -> torch.Tensor:
        if received.shape[0] == 0:      # keep the graph (weights, received) connected: zero gradients
            return received * 0 + (self.w1.sum() + self.w2.sum()) * 0
        ones = torch.ones(received.shape[0], 1, dtype=torch.float32, device=received.device)
        return fused_moe(received, self.w1, self.w2, ones, handle.expert_ids, expert_map=handle.expert_map,
                         lane=self.lane)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _tensor("x", x, like=self.router, like_name="the layer's parameters", like_dtype=True)
        _tensor("x", x, dtypes=_LAYER_DTYPES + (torch.float64,))   # the layer cast after construction
        if x.dim() < 1 or x.shape[-1] != self.router.shape[1]:
            raise ArgumentError(f"x: expected (..., K) with K = {self.router.shape[1]} (the layer's hidden_size), "
                                f"got shape {tuple(x.shape)}")
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = F.linear(x.float(), self.router.float())
        weights, ids = topk_softmax(logits, self.topk, self.renormalize, lane=self.lane)
        received, _, handle = ep_dispatch(x, ids, weights, self.group, self.num_experts, lane=self.lane)
        return ep_combine(self._experts(received, handle), handle).reshape(shape)
