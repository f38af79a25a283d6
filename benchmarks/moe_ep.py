"""Expert parallelism at DeepSeek-V3's shape (issue 36): ep_dispatch + the local experts
(fused_moe) + ep_combine over NCCL, beside NCCL's own all_to_all_single moving the same bytes and
the single-GPU fused_moe, all in one run.

    python -m benchmarks.moe_ep --world 2                # 2 GPUs (one process each), NCCL
    python -m benchmarks.moe_ep --world 1                # one GPU: the same code path, a world of one
    python -m benchmarks.moe_ep --world 2 --smoke        # tiny shapes, checked, not timed (NCCL)
    python -m benchmarks.moe_ep --world 2 --smoke --cpu  # the same over gloo on the CPU

Shape: hidden K = 7168, expert intermediate N = 2048, 256 experts, top-8, 4096 tokens on each rank,
bf16; the routing is the model's (softmax of random logits, top-8, renormalized). Each rank holds
E / world experts.

Reported per rank, median of ``--iters`` calls (CUDA events; every call's host sync included, as a
user's eager layer pays it): the dispatch, the local experts and the combine in ms; the two
all-to-alls' bandwidth as NCCL's tests define ``algbw``: the bytes this rank sends (its rows times
K times 2 bytes, its own share included) over the time of the call; ``all_to_all_single`` alone
on a buffer of the dispatch's size with equal splits, the transport's ceiling; the whole layer;
and fused_moe on one GPU with all 256 experts, for this rank's tokens and for every rank's
tokens (what the EP layer spreads over the group).

``--smoke`` runs every rank's whole path at tiny shapes (uneven: rank r holds 13 + r tokens) and
compares each rank's output with the unsharded fused_moe's (the reference lane) within the
family's tolerance: over NCCL on GPUs, or with ``--cpu`` over gloo, where
tests/test_moe_distributed.py runs it, so a broken path shows before the GPU run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lanekit.testing import poisoned_outputs

DEEPSEEK_V3 = dict(K=7168, N=2048, E=256, topk=8, M=4096)
SMOKE = dict(K=64, N=32, E=8, topk=2, M=13)


def _weights(shape: dict, device, dtype):
    """The full layer's router logits' weights and experts, the same on every rank (seed 0)."""
    g = torch.Generator().manual_seed(0)
    K, N, E = shape["K"], shape["N"], shape["E"]
    w1 = (torch.randn(E, 2 * N, K, generator=g) * K ** -0.5).to(device=device, dtype=dtype)
    w2 = (torch.randn(E, K, N, generator=g) * N ** -0.5).to(device=device, dtype=dtype)
    return w1, w2


def _tokens(shape: dict, rank: int, device, dtype, smoke: bool):
    """This rank's tokens and routing (seed 1 + rank; smoke ranks hold M + rank tokens, uneven)."""
    import lanekit

    g = torch.Generator().manual_seed(1 + rank)
    M = shape["M"] + (rank if smoke else 0)
    x = torch.randn(M, shape["K"], generator=g).to(device=device, dtype=dtype)
    logits = torch.randn(M, shape["E"], generator=g).to(device)
    weights, ids = lanekit.moe.topk_softmax(logits, shape["topk"], renormalize=True)
    return x, weights, ids


def _timed(fn, iters: int, device) -> tuple[float, object]:
    """Median ms of ``iters`` calls (after two warm-ups) and the last result."""
    for _ in range(2):
        out = fn()
    if device.type != "cuda":
        return float("nan"), out
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), out


def _rank(rank: int, world: int, init: str, smoke: bool, cuda: bool, iters: int, queue) -> None:
    import lanekit
    from lanekit.moe import distributed as ep

    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world,
                            **({"device_id": device} if cuda else {}))
    # checked (smoke) runs poison what the kernels and all-to-alls allocate: a row never written is NaN
    try:
        with poisoned_outputs() if smoke else contextlib.nullcontext():
            shape = SMOKE if smoke else DEEPSEEK_V3
            dtype = torch.bfloat16
            lane = None if cuda else "reference"          # (the Triton lane interpreted would be slow)
            w1, w2 = _weights(shape, device, dtype)
            El = shape["E"] // world
            w1_local, w2_local = w1[rank * El:(rank + 1) * El].contiguous(), w2[rank * El:(rank + 1) * El].contiguous()
            if not smoke:
                del w1, w2                     # every expert on each GPU would leave no room for two copies
                torch.cuda.empty_cache()
            x, weights, ids = _tokens(shape, rank, device, dtype, smoke)
            K = shape["K"]

            def dispatch():
                return ep.ep_dispatch(x, ids, weights, None, shape["E"], lane=lane)

            t_dispatch, (received, counts, handle) = _timed(dispatch, iters, device)
            ones = torch.ones(received.shape[0], 1, device=device)

            def experts():
                return lanekit.moe.fused_moe(received, w1_local, w2_local, ones, handle.expert_ids,
                                             expert_map=handle.expert_map, lane=lane)

            t_experts, y = _timed(experts, iters, device)
            t_combine, out = _timed(lambda: ep.ep_combine(y, handle), iters, device)

            def layer():
                r, _, h = ep.ep_dispatch(x, ids, weights, None, shape["E"], lane=lane)
                o = torch.ones(r.shape[0], 1, device=device)
                return ep.ep_combine(lanekit.moe.fused_moe(r, w1_local, w2_local, o, h.expert_ids,
                                                           expert_map=h.expert_map, lane=lane), h)

            t_layer, _ = _timed(layer, iters, device)
            sent_bytes = sum(handle.send_splits) * K * x.element_size()
            back_bytes = sum(handle.recv_splits) * K * x.element_size()
            row = dict(rank=rank, M=x.shape[0], sent_rows=sum(handle.send_splits), received_rows=received.shape[0],
                       dispatch_ms=t_dispatch, experts_ms=t_experts, combine_ms=t_combine, layer_ms=t_layer,
                       dispatch_gbs=sent_bytes / t_dispatch / 1e6, combine_gbs=back_bytes / t_combine / 1e6)
            if smoke:  # the output against the unsharded layer on this rank's tokens
                from lanekit.moe.registry import FUSED_MOE
                from lanekit.testing import assert_close

                want = lanekit.moe.fused_moe(x, w1, w2, weights, ids, lane="reference")
                assert_close(out, want, FUSED_MOE)
                row["checked"] = True
            elif cuda:  # the transport's ceiling: all_to_all_single alone, equal splits, the dispatch's size
                rows = -(-sum(handle.send_splits) // world) * world
                src = torch.empty(rows, K, device=device, dtype=dtype)
                dst = torch.empty_like(src)
                t_nccl, _ = _timed(lambda: dist.all_to_all_single(dst, src), iters, device)
                row.update(nccl_ms=t_nccl, nccl_gbs=rows * K * x.element_size() / t_nccl / 1e6)
            rows_all = [None] * world
            dist.all_gather_object(rows_all, row)
            if rank == 0:
                queue.put(rows_all)
    finally:
        dist.destroy_process_group()


def _single_gpu(iters: int, world: int) -> dict:
    """fused_moe with every expert on one GPU, for one rank's tokens and for all ranks' tokens."""
    import lanekit

    device = torch.device("cuda:0")
    shape = DEEPSEEK_V3
    w1, w2 = _weights(shape, device, torch.bfloat16)
    out = {}
    for label, ranks in (("one rank's tokens", 1), ("every rank's tokens", world)):
        xs, ws, ids = zip(*(_tokens(shape, r, device, torch.bfloat16, False) for r in range(ranks)))
        x, w, i = torch.cat(xs), torch.cat(ws), torch.cat(ids)
        out[f"{label} (M={x.shape[0]})"] = _timed(lambda: lanekit.moe.fused_moe(x, w1, w2, w, i), iters, device)[0]
    return out


def run(world: int, smoke: bool, cuda: bool, iters: int) -> list[dict]:
    """Every rank's row (rank 0's view), one process a rank: on GPUs over NCCL (cuda), else over
    gloo on the CPU (smoke only)."""
    if cuda and torch.cuda.device_count() < world:
        raise SystemExit(f"--world {world} needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    if not cuda and not smoke:
        raise SystemExit("timings need GPUs: without them, run --smoke --cpu")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(world, f"file://{os.path.join(tmp, 'store')}", smoke, cuda, iters, queue),
                           nprocs=world, join=True, start_method="spawn")
    return queue.get()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks, one GPU each (default 2)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, each rank's output checked, not timed")
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU (with --smoke)")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    cuda = not args.cpu
    rows = run(args.world, args.smoke, cuda, args.iters)
    if args.smoke:
        print(f"moe_ep smoke: {len(rows)} ranks over {'NCCL' if cuda else 'gloo'}, every rank's output matches "
              f"the unsharded fused_moe ({', '.join(str(r['M']) + ' tokens' for r in rows)})")
        return
    print(f"{torch.cuda.get_device_name()} x {args.world}, torch {torch.__version__}, NCCL "
          f"{'.'.join(map(str, torch.cuda.nccl.version()))}; DeepSeek-V3 MoE layer (K 7168, N 2048, 256 experts, "
          f"top-8, 4096 tokens a rank, bf16); median of {args.iters} calls")
    print("rank  sent rows  recv rows  dispatch ms (GB/s)  experts ms  combine ms (GB/s)  layer ms  "
          "all_to_all_single ms (GB/s)")
    for r in rows:
        print(f"{r['rank']:4d}  {r['sent_rows']:9d}  {r['received_rows']:9d}  {r['dispatch_ms']:8.3f} "
              f"({r['dispatch_gbs']:6.1f})  {r['experts_ms']:10.3f}  {r['combine_ms']:7.3f} ({r['combine_gbs']:6.1f})"
              f"  {r['layer_ms']:8.3f}  {r['nccl_ms']:8.3f} ({r['nccl_gbs']:6.1f})")
    for label, ms in _single_gpu(args.iters, args.world).items():
        print(f"single GPU, all 256 experts, {label}: fused_moe {ms:.3f} ms")


if __name__ == "__main__":
    main()
