"""sm90 8-bit GEMM designs beside cuBLASLt in one run (issue 32): TFLOP/s and error in output steps per
tile row, imprecise_acc = block_k (wgmma) against 0 (mma.sync). `python -m benchmarks.explore_gemm_sm90` on the GPU."""
import dataclasses, sys, torch, triton
import lanekit.gemm as lk
from lanekit.gemm import tuning
from lanekit.gemm.tuning import GemmConfig
from lanekit.reference import gemm as ref
from lanekit.gemm import registry as greg
from lanekit.testing import compare

E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16
orig = tuning.gemm_config
CFGS = {
    "default": None,
    "128x128x128 w8 s3 imp128": GemmConfig(128, 128, 128, 8, 8, 3, imprecise_acc=128),
    "128x128x128 w8 s4 imp128": GemmConfig(128, 128, 128, 8, 8, 4, imprecise_acc=128),
    "128x256x128 w8 s3 imp128": GemmConfig(128, 256, 128, 8, 8, 3, imprecise_acc=128),
    "256x128x128 w8 s3 imp128": GemmConfig(256, 128, 128, 8, 8, 3, imprecise_acc=128),
    "128x256x64 w8 s4 imp64": GemmConfig(128, 256, 64, 8, 8, 4, imprecise_acc=64),
    "128x128x64 w4 s4 imp64": GemmConfig(128, 128, 64, 8, 4, 4, imprecise_acc=64),
}
def use(cfg):
    tuning.gemm_config = (lambda d, M, mx=False: dataclasses.replace(cfg, block_k=32, imprecise_acc=min(cfg.imprecise_acc, 32)) if mx else cfg) if cfg else orig

def inputs(op, M, K, N):
    a = torch.randn(M, K, device="cuda").to(E4M3); w = torch.randn(N, K, device="cuda").to(E4M3)
    s = K ** -0.5
    if op == "tensor":
        return dict(a=a, b=w.t(), scale_a=torch.ones((), device="cuda"), scale_b=torch.full((), s, device="cuda"))
    if op == "row":
        return dict(a=a, b=w.t(), scale_a=torch.rand(M, 1, device="cuda") + .5, scale_b=torch.full((1, N), s, device="cuda"))
    if op == "block":
        return dict(a=a, b=w.t(), scale_a=torch.rand(M, -(-K // 128), device="cuda") + .5,
                    scale_b=torch.full((-(-K // 128), -(-N // 128)), s, device="cuda"))
    ai = torch.randint(-128, 128, (M, K), dtype=torch.int8, device="cuda"); wi = torch.randint(-128, 128, (N, K), dtype=torch.int8, device="cuda")
    return dict(a=ai, b=wi.t(), scale_a=torch.ones(M, 1, device="cuda"), scale_b=torch.full((1, N), 1e-4, device="cuda"))

def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=50)

shapes = [(8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096), (1024, 4096, 14336), (1024, 7168, 2048), (16, 4096, 4096)]
for op in ("tensor", "row", "block", "int8"):
    for M, K, N in shapes:
        kw = inputs(op, M, K, N)
        tf = lambda ms: 2 * M * N * K / ms / 1e9
        fn_l = (lambda: lk.int8_mm(**kw)) if op == "int8" else (lambda: lk.scaled_mm(**kw))
        if op in ("tensor", "row"):
            peer = bench(lambda: torch._scaled_mm(kw["a"], kw["b"], kw["scale_a"], kw["scale_b"], out_dtype=BF16))
            pname = "_scaled_mm"
        elif op == "int8":
            peer = bench(lambda: torch._int_mm(kw["a"], kw["b"])); pname = "_int_mm"
        else:
            peer = None; pname = "-"
        if M * K * N <= 2 ** 39:
            up = {k: (v.double() if v.is_floating_point() else v) for k, v in kw.items()}
            oracle = (ref.int8_mm if op == "int8" else ref.scaled_mm)(**up)
        else:
            oracle = None
        for name, cfg in CFGS.items():
            use(cfg)
            try:
                t = bench(fn_l)
                err = compare(fn_l(), oracle, greg.GEMM).detail if oracle is not None else ""
                ratio = f"{peer / t:.3f}x {pname}" if peer else ""
                print(f"{op:6s} {M}x{K}x{N} {name:28s} {tf(t):7.1f} TF/s {ratio} {err}", flush=True)
            except Exception as e:
                print(f"{op:6s} {M}x{K}x{N} {name:28s} FAIL {type(e).__name__}: {str(e)[:120]}", flush=True)
        if peer: print(f"{op:6s} {M}x{K}x{N} {'PEER '+pname:28s} {tf(peer):7.1f} TF/s", flush=True)
        use(None)
