"""Per-call host cost of lanekit's public ops on a machine without a GPU: a proxy, not a speed.

    python -m benchmarks.host_profile [--profile OP] [--calls N]

Runs each op's Triton lane with CPU tensors under Triton's interpreter, with the kernel launch
itself replaced by a no-op: what is timed is lanekit's Python path (validation, lane choice,
dispatch, allocation, launch metadata) up to the launch. Not timed: Triton's own launcher (on a
GPU, binding the arguments and the CUDA launch, some 10-20 us a kernel), the CUDA caching
allocator (CPU allocations stand in), and the GPU. So the figures rank host paths and show what a
change removed; the eager timings of ``python -m benchmarks.run eager`` on the GPU are the
measurement. ``--profile OP`` prints cProfile's top functions for one op.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

os.environ.setdefault("TRITON_INTERPRET", "1")   # before lanekit's kernels are imported

import torch  # noqa: E402


def _stub_launches() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    InterpretedFunction.run = lambda self, *args, grid, warmup, **kwargs: None


def cases():
    """name -> a zero-argument callable making one eager call, small inputs (the GPU time of these
    is negligible: host cost is all there is)."""
    import lanekit
    from lanekit import layers

    bf16 = dict(dtype=torch.bfloat16)
    x = torch.randn(4, 512, **bf16)
    w = torch.ones(512, **bf16)
    q = torch.randn(1, 16, 8, 64, **bf16)
    k = torch.randn(1, 16, 2, 64, **bf16)
    cos = torch.randn(64, 32, **bf16)
    sin = torch.randn(64, 32, **bf16)
    g = torch.randn(4, 1024, **bf16)
    kc = torch.randn(64, 16, 2, 64, **bf16)
    vc = torch.randn(64, 16, 2, 64, **bf16)
    qd = torch.randn(8, 1, 8, 64, **bf16)
    kd = torch.randn(8, 1, 2, 64, **bf16)
    table = torch.arange(64, dtype=torch.int32).reshape(8, 8)
    seqlens = torch.full((8,), 40, dtype=torch.int32)
    out = {
        "layers.rms_norm": lambda: layers.rms_norm(x, w, lane="triton"),
        "layers.layer_norm": lambda: layers.layer_norm(x, w, w, lane="triton"),
        "layers.apply_rotary": lambda: layers.apply_rotary(q, cos, sin, lane="triton"),
        "layers.swiglu": lambda: layers.swiglu(g, lane="triton"),
        "flash_attn_func": lambda: lanekit.flash_attn_func(q, k, k, causal=True, lane="triton"),
        "flash_attn_with_kvcache paged": lambda: lanekit.flash_attn_with_kvcache(
            qd, kc, vc, kd, kd, cache_seqlens=seqlens, block_table=table, causal=True, lane="triton"),
    }
    if hasattr(layers, "apply_rotary_qk"):
        out["layers.apply_rotary_qk"] = lambda: layers.apply_rotary_qk(q, k, cos, sin, lane="triton")
    return out


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()   # this process's CPU time: a shared, loaded machine's other work is left out
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - t0) / calls)
    return best * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="cProfile one op (a name printed by the table)")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    _stub_launches()
    table = cases()
    if args.profile:
        fn = table[args.profile]
        fn()
        prof = cProfile.Profile(time.process_time)
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    print("CPU proxy: process CPU time per call, best of 5 (kernel launch stubbed; Triton's launcher, the CUDA "
          "allocator and the GPU not included)")
    print(f"{'op':32s} {'host us/call':>12s}")
    for name, fn in table.items():
        print(f"{name:32s} {per_call_us(fn, args.calls):12.1f}")


if __name__ == "__main__":
    main()
