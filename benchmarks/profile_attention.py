"""Where the time of an attention training step goes, kernel by kernel, on this GPU:
`python -m benchmarks.profile_attention [--dims 64 128] [--seqlens 4096]`. Runs the benchmark's
forward + backward cases under torch.profiler and prints each kernel's share, for lanekit and,
for comparison, SDPA's flash backend."""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import attention, attention_train


def kernel_times(fn, reps: int = 10) -> list[tuple[str, float]]:
    """(kernel name, microseconds per call) of ``fn``'s GPU kernels, largest first."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / reps) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_attention")
    parser.add_argument("--dims", type=int, nargs="*", default=[128])
    parser.add_argument("--seqlens", type=int, nargs="*", default=[4096])
    args = parser.parse_args()
    for D in args.dims:
        for S in args.seqlens:
            for causal in (False, True):
                case = dict(D=D, S=S, causal=causal, B=attention.TOKENS // S, H=2048 // D)
                inputs = attention_train.make_inputs(case)
                runners = attention_train.runners(case, *inputs)
                for name in ("lanekit", "sdpa-flash"):
                    rows = kernel_times(runners[name])
                    total = sum(us for _, us in rows)
                    print(f"{attention_train.name(case)} [{name}]: {total:.0f} us, "
                          f"{attention_train.flops(case) / total / 1e6:.0f} TFLOP/s")
                    for kernel, us in rows[:6]:
                        print(f"   {us:8.0f} us  {100 * us / total:5.1f}%  {kernel[:90]}")
                del inputs
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
