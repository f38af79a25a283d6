"""Sweep the grouped GEMM's tiles on the GPU and write lanekit/moe/configs/:
`python -m benchmarks.tune_moe [--shapes mixtral,qwen3,deepseek] [--tokens 1,16,256,4096] [--bwd]
[--budget SECONDS] [--dry-run]`.

For each model shape (E, K, N, topk: the MoE issue's Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3) and
each token count M, the M * topk rows are routed uniformly at random (topk distinct experts a
token), the weights stored (E, N, K) as models store them and passed transposed, and every
candidate tile of the forward (``--bwd``: also of the weights' gradient) is checked against
torch.nn.functional.grouped_mm, then timed from a CUDA graph; the fastest goes into the file of
its (kernel, arch, dtype, E, K, N) under its M_total, which lanekit.moe.tuning reads. Prints each
candidate's TFLOP/s beside torch's grouped_mm (CUTLASS on sm90) from the same run. ``--budget``
(default 420 s) stops sweeping and writes what was found, so the whole run fits the GPU step's
8 minutes; the files name the date in "tuned".
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch
import triton

from lanekit.moe import tuning
from lanekit.moe.tuning import GemmConfig
from lanekit.runtime.tuning import arch_id

SHAPES = {  # name: (E, K, N, topk): the first expert GEMM (K hidden -> N intermediate)
    "mixtral": (8, 4096, 14336, 2),
    "qwen3": (128, 2048, 768, 8),
    "deepseek": (256, 7168, 2048, 8),
}
TOKENS = (1, 16, 256, 4096)


def _candidates(average_rows: int, kernel: str) -> list[GemmConfig]:
    """Tiles worth timing for groups of about ``average_rows`` rows (fewer for decode)."""
    if kernel == "grouped_mm_bwd":
        return [GemmConfig(bm, bn, bk, 1, w, s) for bm, bn, bk, w, s in (
            (128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
            (64, 64, 32, 4, 4), (128, 256, 32, 8, 3))]
    if average_rows < 32:
        return [GemmConfig(bm, bn, bk, 1, w, s) for bm, bn, bk, w, s in (
            (64, 64, 64, 4, 4), (64, 64, 128, 4, 3), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3),
            (64, 256, 64, 4, 3), (64, 32, 128, 4, 4))]
    return [GemmConfig(bm, bn, bk, g, w, s) for bm, bn, bk, g, w, s in (
        (128, 128, 64, 8, 8, 4), (128, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 3), (128, 128, 128, 8, 8, 3),
        (64, 128, 64, 8, 4, 4), (128, 64, 64, 8, 4, 4), (256, 128, 64, 8, 8, 3), (64, 256, 64, 8, 8, 4))]


def _routing(M: int, E: int, topk: int, g: torch.Generator) -> torch.Tensor:
    """offs (E,) int32 of M tokens each routed to topk distinct experts, uniformly."""
    ids = torch.rand(M, E, generator=g).argsort(-1)[:, :topk]
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    return counts.cumsum(0).to(torch.int32).cuda()


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """got within 2% of torch's result (of the largest |value|), compared a slab at a time (d b of
    DeepSeek-V3's shape is 7.5 GB in bf16)."""
    scale = max(1.0, want.abs().max().item())
    return all(torch.allclose(g.float(), w.float(), rtol=2e-2, atol=2e-2 * scale)
               for g, w in zip(got.split(max(1, got.shape[0] // 16)), want.split(max(1, got.shape[0] // 16))))


def _time(fn) -> float:
    for _ in range(2):
        fn()
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def tune_shape(name: str, tokens, kernels, deadline: float, dry_run: bool) -> None:
    from lanekit.moe.kernels import gemm

    E, K, N, topk = SHAPES[name]
    dtype, arch = torch.bfloat16, arch_id(torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(E, N, K, dtype=dtype, device="cuda") * K ** -0.5    # (E, N, K) as models store it
    b = w.transpose(1, 2)
    found: dict[str, dict[str, dict]] = {k: {} for k in kernels}
    for M in tokens:
        rows = M * topk
        offs = _routing(M, E, topk, g)
        a = torch.randn(rows, K, dtype=dtype, device="cuda")
        flops = 2 * rows * K * N
        for kernel in kernels:
            if kernel == "grouped_mm":   # out = a @ b[e] by groups; the peer: torch's grouped_mm
                out = torch.empty(rows, N, dtype=dtype, device="cuda")
                def run(cfg):
                    return gemm.grouped_mm_fwd(a=a, b=b, offs=offs, out=out, config=cfg)
                def peer():
                    return torch.nn.functional.grouped_mm(a, b, offs=offs)
            else:                        # d b = a^T @ dout by groups; torch's 2-D x 2-D form
                dout = torch.randn(rows, N, dtype=dtype, device="cuda")
                db = torch.empty(E, K, N, dtype=dtype, device="cuda")
                def run(cfg):
                    return gemm.grouped_mm_bwd(a=a, grad=dout, offs=offs, db=db, config=cfg)
                def peer():
                    return torch.nn.functional.grouped_mm(a.t(), dout, offs=offs)
            want = peer()
            peer_ms = _time(peer)
            print(f"{name} E{E} K{K} N{N} M{M} (rows {rows}) {kernel}: torch grouped_mm "
                  f"{flops / peer_ms / 1e9:.1f} TFLOP/s")
            best = None
            for cfg in _candidates(rows // E, kernel):
                if time.monotonic() > deadline:
                    print("  budget spent: writing what was found")
                    break
                try:
                    got = run(cfg)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 (a tile that does not fit this GPU)
                    print(f"  {kernel} {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
                    continue
                if not _close(got, want):
                    print(f"  {kernel} {cfg}: WRONG result, not timed")
                    continue
                ms = _time(lambda: run(cfg))
                print(f"  {kernel} {cfg}: {flops / ms / 1e9:.1f} TFLOP/s ({peer_ms / ms:.2f}x torch)")
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            if best is not None:
                row = {k: v for k, v in best[1].__dict__.items() if k != "waves_per_eu" or v}
                found[kernel][str(rows)] = row
        del a
    for kernel, configs in found.items():
        if not configs:
            continue
        path = tuning.CONFIG_DIR / tuning.config_file_name(kernel, arch, dtype, E, K, N)
        if path.is_file():   # keep rows of other token counts from an earlier run
            configs = {**json.loads(path.read_text())["configs"], **configs}
        body = {"tuned": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                "triton": triton.__version__, "configs": dict(sorted(configs.items(), key=lambda kv: int(kv[0])))}
        print(f"{'would write' if dry_run else 'writing'} {path}")
        if not dry_run:
            path.write_text(json.dumps(body, indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tune_moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated of " + ", ".join(SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts M (rows: M * topk)")
    parser.add_argument("--bwd", action="store_true", help="also the weights' gradient kernel")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds of sweeping before writing")
    parser.add_argument("--dry-run", action="store_true", help="print, write no file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_moe: needs a GPU", file=sys.stderr)
        return 1
    deadline = time.monotonic() + args.budget
    kernels = ["grouped_mm"] + (["grouped_mm_bwd"] if args.bwd else [])
    for name in args.shapes.split(","):
        if name not in SHAPES:
            parser.error(f"--shapes: expected names among {sorted(SHAPES)}, got {name!r}")
        tune_shape(name, [int(t) for t in args.tokens.split(",")], kernels, deadline, args.dry_run)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
