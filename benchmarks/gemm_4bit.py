"""4-bit weight-only linears (issue 33, part A): lanekit.gemm.w4a16_linear (AWQ, GPTQ, GPTQ with
act-order) and mxfp4_linear beside bf16 F.linear, the dequantize-then-bf16 pipeline in PyTorch,
and our own 8-bit w8a16_linear at the same shape; and the int4 GEMMs on the int8 dot (w4a8_linear,
int4_mm) beside bf16, the dequantize pipeline and our 8-bit kernels (family ``gemm4_int``).

Shapes: the linears of Llama-3-8B (qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672, down
14336 -> 4096) and Qwen3-32B (qkv 5120 -> 10240, o 8192 -> 5120, gate_up 5120 -> 51200, down
25600 -> 5120) at M in {1, 8, 16, 64, 1024}; group size 128. Bars (issue 33): W4A16 and MXFP4 at
M <= 16 >= 3.0x bf16 F.linear and >= 75% of HBM bandwidth on the packed weights and scales
(``gemm4_bandwidth``: GB/s of the bytes a call must read and write); W4A16 at M = 1024 >= 0.9x
bf16. Families: ``gemm4_graphs`` (TFLOP/s from CUDA graphs), ``gemm4_bandwidth`` (GB/s, M <= 16),
``gemm4_eager`` (host included); ``python -m benchmarks.run gemm_4bit`` runs all three.
``python -m benchmarks.gemm_4bit`` runs every case's inputs, check and peers once at tiny shapes
on the CPU.
"""

from __future__ import annotations

import sys
import zlib
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import lanekit.gemm as lk
from lanekit.gemm import registry as greg
from lanekit.reference import gemm as ref
from lanekit.reference.numerics import pack_int4
from lanekit.testing import compare

BF16 = torch.bfloat16
GROUP = 128
MS = (1, 8, 16, 64, 1024)
KNS = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096),          # Llama-3-8B
       (5120, 10240), (8192, 5120), (5120, 51200), (25600, 5120))         # Qwen3-32B
OPS = ("w4a16 awq", "w4a16 gptq", "w4a16 gptq act-order", "mxfp4")
QUICK_MS, QUICK_KNS = (1, 16, 1024), ((4096, 4096), (14336, 4096))
TINY_MS, TINY_KNS = (1, 17), ((256, 64),)


def cases(quick: bool = False, *, ms=None, kns=None):
    ms = ms or (QUICK_MS if quick else MS)
    kns = kns or (QUICK_KNS if quick else KNS)
    for op in OPS:
        for K, N in kns:
            for M in ms:
                yield dict(op=op, M=M, K=K, N=N)


def decode_cases(quick: bool = False):
    return (c for c in cases(quick) if c["M"] <= 16)


def name(c) -> str:
    return f"{c['op']} M={c['M']} K={c['K']} N={c['N']}"


def flops(c) -> float:
    return 2.0 * c["M"] * c["N"] * c["K"]


def bytes_moved(c) -> float:
    """What a call must read and write: the packed weight (K * N / 2), its scales (fp16 per
    group of 128 for W4A16, one byte per 32 for MXFP4) and zeros (AWQ/GPTQ: 4 bits per group and
    column), g_idx (4 bytes per row of K), x and y in bf16."""
    M, K, N = c["M"], c["K"], c["N"]
    weight = K * N / 2
    if c["op"] == "mxfp4":
        scales = K * N / 32
    else:
        scales = (K // GROUP) * N * (2 + 0.5) + (4 * K if "act-order" in c["op"] else 0)
    return weight + scales + 2.0 * M * (K + N)


def make_inputs(c, device="cuda"):
    """(x bf16 (M, K), lanekit's kwargs): random codes, zeros and scales of K^-1/2 / 8 so that
    outputs are O(1)."""
    g = torch.Generator(device).manual_seed(zlib.crc32(name(c).encode()))
    M, K, N = c["M"], c["K"], c["N"]
    x = torch.randn(M, K, generator=g, device=device).to(BF16)
    if c["op"] == "mxfp4":
        codes = torch.randint(0, 16, (N, K), generator=g, device=device)
        e = torch.randint(118, 122, (N, K // 32), generator=g, device=device, dtype=torch.uint8)
        return x, dict(x=x, w_fp4=pack_int4(codes, 1, dtype=torch.uint8), w_scale_e8m0=e)
    layout = "awq" if "awq" in c["op"] else "gptq"
    q = torch.randint(0, 16, (K, N), generator=g, device=device)
    z = torch.randint(0, 16, (K // GROUP, N), generator=g, device=device)
    s = (torch.rand(K // GROUP, N, generator=g, device=device) + 0.5) / (8 * K ** 0.5)
    dim, order = (1, "awq") if layout == "awq" else (0, "sequential")
    kw = dict(x=x, qweight=pack_int4(q, dim, order), scales=s.half(),
              zeros=pack_int4(z, 1, order), group_size=GROUP, layout=layout)
    if "act-order" in c["op"]:
        perm = torch.randperm(K, generator=g, device=device)
        kw["g_idx"] = (torch.arange(K, device=device) // GROUP)[perm].to(torch.int32)
    return x, kw


def _lanekit(c, kw):
    fn = lk.mxfp4_linear if c["op"] == "mxfp4" else lk.w4a16_linear
    return lambda: fn(**kw)


def _oracle(c, kw):
    up = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    if c["op"] == "mxfp4":
        return ref.mxfp4_linear(up["x"], up["w_fp4"], up["w_scale_e8m0"])
    return ref.w4a16_linear(**up)


def check(c, x, kw) -> str | None:
    """None when lanekit's output is within the gemm tolerance of the float64 oracle."""
    got = compare(_lanekit(c, kw)(), _oracle(c, kw), greg.GEMM)
    return None if got.ok else got.detail


def _dequantize(c, kw):
    """The PyTorch pipeline a user without a kernel runs: unpack, dequantize to bf16, F.linear."""
    if c["op"] == "mxfp4":
        return ref.mxfp4_weight(kw["w_fp4"], kw["w_scale_e8m0"], BF16)               # (N, K)
    return ref.w4_weight(kw["qweight"], kw["scales"].to(BF16), kw["zeros"], kw["group_size"], kw["layout"],
                         kw.get("g_idx")).t()


def runners(c, x, kw) -> dict:
    """lanekit and its peers for the case: name -> a no-argument callable."""
    N, K = c["N"], c["K"]
    w_bf16 = torch.randn(N, K, device=x.device).to(BF16)
    w8 = torch.randint(-128, 128, (N, K), dtype=torch.int8, device=x.device)
    s8 = torch.full((N,), 1.0 / (127 * K ** 0.5), device=x.device)
    return {
        "lanekit": _lanekit(c, kw),
        "bf16 F.linear": lambda: F.linear(x, w_bf16),
        "dequantize + bf16 F.linear": lambda: F.linear(x, _dequantize(c, kw)),
        "lanekit w8a16": lambda: lk.w8a16_linear(x, w8, s8),
    }


_COMMON = dict(name=name, flops=flops, bytes_moved=bytes_moved, make_inputs=make_inputs, check=check,
               runners=runners)
GRAPHS = SimpleNamespace(UNIT="TFLOP/s", CUDA_GRAPHS=True, cases=cases, **_COMMON)
BANDWIDTH = SimpleNamespace(UNIT="GB/s", CUDA_GRAPHS=True, cases=decode_cases,
                            **{**_COMMON, "name": lambda c: name(c) + " GB/s"})
EAGER = SimpleNamespace(UNIT="TFLOP/s", CUDA_GRAPHS=False, cases=cases,
                        **{**_COMMON, "name": lambda c: name(c) + " eager"})
FAMILIES = {"gemm4_graphs": GRAPHS, "gemm4_bandwidth": BANDWIDTH, "gemm4_eager": EAGER}



# ---- SVDQuant W4A4 (lanekit.gemm.svdquant_w4a4_linear): its own family, its own peers ----
# Bar (issue 33): >= 1.0x our fp8 scaled_mm (rowwise e4m3, the same M, K, N) at M >= 1024. Peers:
# bf16 F.linear, the PyTorch pipeline (the int4 weight dequantized to bf16, x unquantized, plus the
# low-rank branch) and lanekit.gemm.scaled_mm. The low-rank branch at rank 32 (nunchaku's default).
SVDQ_OPS = ("svdquant rank32",)
SVDQ_RANK = 32


def svdq_cases(quick: bool = False, *, ms=None, kns=None):
    ms = ms or (QUICK_MS if quick else MS)
    kns = kns or (QUICK_KNS if quick else KNS)
    for op in SVDQ_OPS:
        for K, N in kns:
            for M in ms:
                yield dict(op=op, M=M, K=K, N=N)


def svdq_flops(c) -> float:
    return 2.0 * c["M"] * c["N"] * c["K"] + 2.0 * c["M"] * (c["K"] + c["N"]) * SVDQ_RANK


def svdq_bytes_moved(c) -> float:
    """The packed weight and its bf16 scales per 64, lora_down and lora_up in bf16, x and y in bf16,
    and the activation pass's codes, scales and h written and read back."""
    M, K, N = c["M"], c["K"], c["N"]
    weight = K * N / 2 + (K // 64) * N * 2 + (K + N) * SVDQ_RANK * 2
    act = 2 * (M * K / 2 + (K // 64) * M * 2 + M * SVDQ_RANK * 4)
    return weight + act + 2.0 * M * (K + N)


def svdq_make_inputs(c, device="cuda"):
    """(x bf16 (M, K), lanekit's kwargs): W ~ N(0, 1/K) quantized by the oracle's rule, x ~ N(0, 1),
    smooth in [0.5, 2], lora factors ~ N(0, 1/K) and N(0, 1/R): outputs O(1)."""
    from lanekit.reference.quant import quantize_w4a4_wgt

    g = torch.Generator(device).manual_seed(zlib.crc32(name(c).encode()))
    M, K, N = c["M"], c["K"], c["N"]
    x = torch.randn(M, K, generator=g, device=device).to(BF16)
    qweight, wscales = quantize_w4a4_wgt((torch.randn(N, K, generator=g, device=device) / K ** 0.5).to(BF16))
    kw = dict(x=x, qweight=qweight, wscales=wscales,
              lora_down=(torch.randn(K, SVDQ_RANK, generator=g, device=device) / K ** 0.5).to(BF16),
              lora_up=(torch.randn(N, SVDQ_RANK, generator=g, device=device) / SVDQ_RANK ** 0.5).to(BF16),
              smooth=(torch.rand(K, generator=g, device=device) * 1.5 + 0.5).to(BF16))
    return x, kw


def svdq_check(c, x, kw) -> str | None:
    up = {k: (v.double() if v.is_floating_point() else v) for k, v in kw.items()}
    got = compare(lk.svdquant_w4a4_linear(**kw), ref.svdquant_w4a4_linear(**up, dtype=BF16), greg.GEMM)
    return None if got.ok else got.detail


def svdq_runners(c, x, kw) -> dict:
    from lanekit.reference.quant import dequantize_w4a4

    N, K = c["N"], c["K"]
    w_bf16 = torch.randn(N, K, device=x.device).to(BF16)
    a8 = torch.randn(c["M"], K, device=x.device).to(torch.float8_e4m3fn)
    b8 = torch.randn(N, K, device=x.device).to(torch.float8_e4m3fn).t()
    sa = torch.full((c["M"], 1), 1.0 / K ** 0.5, device=x.device)
    sb = torch.full((1, N), 1.0, device=x.device)
    down, up_ = kw["lora_down"], kw["lora_up"]

    def pytorch():
        w = dequantize_w4a4(kw["qweight"], kw["wscales"]).to(BF16)
        return F.linear(x, w) + (x @ down) @ up_.t()

    return {
        "lanekit": lambda: lk.svdquant_w4a4_linear(**kw),
        "bf16 F.linear": lambda: F.linear(x, w_bf16),
        "dequantize + bf16 F.linear + low rank": pytorch,
        "lanekit fp8 scaled_mm": lambda: lk.scaled_mm(a8, b8, sa, sb, out_dtype=BF16),
    }


SVDQUANT = SimpleNamespace(UNIT="TFLOP/s", CUDA_GRAPHS=True, cases=svdq_cases, name=name, flops=svdq_flops,
                           bytes_moved=svdq_bytes_moved, make_inputs=svdq_make_inputs, check=svdq_check,
                           runners=svdq_runners)
FAMILIES["gemm4_svdquant"] = SVDQUANT


def svdq_smoke(device="cpu") -> list[str]:
    """The SVDQuant family at tiny shapes: inputs, the check, and each peer once on ``device``."""
    lines = []
    for c in svdq_cases(ms=TINY_MS, kns=TINY_KNS):
        x, kw = svdq_make_inputs(c, device)
        error = svdq_check(c, x, kw)
        ran = []
        for peer, fn in svdq_runners(c, x, kw).items():
            fn()
            ran.append(peer)
        lines.append(f"{name(c)}: {'ok' if error is None else error}, peers {', '.join(ran)}")
    return lines

def smoke(device="cpu") -> list[str]:
    """Every op at tiny shapes: inputs, the check, and each peer once on ``device``."""
    lines = []
    for c in cases(ms=TINY_MS, kns=TINY_KNS):
        x, kw = make_inputs(c, device)
        error = check(c, x, kw)
        ran = []
        for peer, fn in runners(c, x, kw).items():
            fn()
            ran.append(peer)
        lines.append(f"{name(c)}: {'ok' if error is None else error}, peers {', '.join(ran)}")
    return lines


# ---- int4 on the int8 dot: w4a8_linear (int4 weights, int8 activations) and int4_mm ----
# Peers in the same run: w4a8 beside bf16 F.linear, dequantize-then-bf16 in PyTorch and our
# w8a8_linear; int4_mm beside our fp8 scaled_mm (rowwise e4m3) and int8_mm at the same shape, and
# bf16 F.linear. Bar (issue 33): int4_mm at M >= 1024 >= 1.0x our fp8 scaled_mm. Family
# ``gemm4_int`` (TFLOP/s from CUDA graphs); ``smoke_int`` runs it at tiny shapes on the CPU.

INT_OPS = ("w4a8", "int4_mm")


def int_cases(quick: bool = False, *, ms=None, kns=None):
    ms = ms or (QUICK_MS if quick else MS)
    kns = kns or (QUICK_KNS if quick else KNS)
    for op in INT_OPS:
        for K, N in kns:
            for M in ms:
                yield dict(op=op, M=M, K=K, N=N)


def int_bytes_moved(c) -> float:
    """w4a8: the packed weight, e4m3 group scales (one byte per 128 of K) and fp32 channel scales,
    x and y in bf16; int4_mm: both packed operands, fp32 scales, y in bf16."""
    M, K, N = c["M"], c["K"], c["N"]
    if c["op"] == "w4a8":
        return K * N / 2 + (K // GROUP) * N + 4 * N + 2.0 * M * (K + N)
    return (M + N) * K / 2 + 4 * (M + N) + 2.0 * M * N


def make_int_inputs(c, device="cuda"):
    """(x, lanekit's kwargs): w4a8 a weight of std K^-1/2 quantized by quantize_w4a8 (mode 1, e4m3
    scales); int4_mm every byte value at random, b the transpose of an (N, K/2) weight, rowwise
    scales of K^-1/2 / 8 so that outputs are O(1)."""
    from lanekit.quant import quantize_w4a8

    g = torch.Generator(device).manual_seed(zlib.crc32(name(c).encode()))
    M, K, N = c["M"], c["K"], c["N"]
    if c["op"] == "w4a8":
        x = torch.randn(M, K, generator=g, device=device).to(BF16)
        w = (torch.randn(N, K, generator=g, device=device) / K ** 0.5)
        qweight, scales, channel, _ = quantize_w4a8(w, 1, GROUP)
        return x, dict(x=x, qweight=qweight, scales=scales, channel_scale=channel, group_size=GROUP)
    a = torch.randint(0, 256, (M, K // 2), generator=g, device=device, dtype=torch.uint8)
    b = torch.randint(0, 256, (N, K // 2), generator=g, device=device, dtype=torch.uint8).t()
    sa = torch.full((M, 1), 1.0 / (8 * K ** 0.5), device=device)
    sb = torch.full((1, N), 1.0 / 8, device=device)
    return a, dict(a=a, b=b, scale_a=sa, scale_b=sb)


def _int_lanekit(c, kw):
    fn = lk.w4a8_linear if c["op"] == "w4a8" else lk.int4_mm
    return lambda: fn(**kw)


def check_int(c, x, kw) -> str | None:
    """None when lanekit's output is within the gemm tolerance of the float64 oracle."""
    up = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype.itemsize > 1
              else v) for k, v in kw.items()}
    want = ref.w4a8_linear(**up) if c["op"] == "w4a8" else ref.int4_mm(**up)
    got = compare(_int_lanekit(c, kw)(), want, greg.GEMM)
    return None if got.ok else got.detail


def _dequantize_w4a8(kw):
    """The PyTorch pipeline without a kernel: unpack the codes, dequantize to bf16 (N, K)."""
    from lanekit.reference.numerics import unpack_int4

    codes = unpack_int4(kw["qweight"], 1).to(BF16) - 8
    s = (kw["channel_scale"][:, None] * kw["scales"].float()).to(BF16)
    return codes * s.repeat_interleave(kw["group_size"], 1)


def int_runners(c, x, kw) -> dict:
    """lanekit and its peers for the case: name -> a no-argument callable."""
    M, N, K = c["M"], c["N"], c["K"]
    dev = x.device
    w_bf16 = torch.randn(N, K, device=dev).to(BF16)
    w8 = torch.randint(-128, 128, (N, K), dtype=torch.int8, device=dev)
    s8 = torch.full((N,), 1.0 / (127 * K ** 0.5), device=dev)
    if c["op"] == "w4a8":
        return {
            "lanekit": _int_lanekit(c, kw),
            "bf16 F.linear": lambda: F.linear(x, w_bf16),
            "dequantize + bf16 F.linear": lambda: F.linear(x, _dequantize_w4a8(kw)),
            "lanekit w8a8": lambda: lk.w8a8_linear(x, w8, s8),
        }
    a8 = torch.randint(-128, 128, (M, K), dtype=torch.int8, device=dev)
    a_fp8, w_fp8 = a8.to(torch.float8_e4m3fn), w8.to(torch.float8_e4m3fn)
    x16 = torch.randn(M, K, device=dev).to(BF16)
    return {
        "lanekit": _int_lanekit(c, kw),
        "lanekit fp8 scaled_mm": lambda: lk.scaled_mm(a_fp8, w_fp8.t(), kw["scale_a"], kw["scale_b"]),
        "lanekit int8_mm": lambda: lk.int8_mm(a8, w8.t(), kw["scale_a"], kw["scale_b"]),
        "bf16 F.linear": lambda: F.linear(x16, w_bf16),
    }


INT_GRAPHS = SimpleNamespace(UNIT="TFLOP/s", CUDA_GRAPHS=True, cases=int_cases, name=name, flops=flops,
                             bytes_moved=int_bytes_moved, make_inputs=make_int_inputs, check=check_int,
                             runners=int_runners)
FAMILIES["gemm4_int"] = INT_GRAPHS


def smoke_int(device="cpu") -> list[str]:
    """w4a8 and int4_mm at tiny shapes: inputs, the check, and each peer once on ``device``."""
    lines = []
    for c in int_cases(ms=TINY_MS, kns=TINY_KNS):
        x, kw = make_int_inputs(c, device)
        error = check_int(c, x, kw)
        ran = []
        for peer, fn in int_runners(c, x, kw).items():
            fn()
            ran.append(peer)
        lines.append(f"{name(c)}: {'ok' if error is None else error}, peers {', '.join(ran)}")
    return lines


if __name__ == "__main__":
    for line in smoke() + smoke_int() + svdq_smoke():
        print(line)
    sys.exit(0)
