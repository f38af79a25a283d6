"""Issue 35's first experiment: how far does Triton's own ``tl`` get on Hopper's attention forward?

    python -m benchmarks.explore_attention_sm90                  # on an sm90 GPU: TFLOP/s table
    python -m benchmarks.explore_attention_sm90 --compile-only   # any machine: compile for sm90

Before an sm90 fast path is built (a warp-specialized Gluon kernel, FlashAttention-3's design), the
issue asks what stock ``tl`` reaches. This times minimal bf16 forwards (no options: the unmasked
loop, plus the diagonal blocks when causal) in the design variants Triton 3.6 offers on sm90,
beside SDPA's cuDNN and FlashAttention-2 backends and lanekit's ``flash_attn_func``, all in one
run, from CUDA graphs. Each variant's output is compared with SDPA's before it is timed.

Variants: K/V read by pointers (cp.async, the portable kernel's way) or by tensor descriptors
(TMA); the key loop software-pipelined (num_stages) or warp-specialized
(``tl.range(..., warp_specialize=True)``); key blocks of 64 or 128. Beside them, the Gluon designs
of ``benchmarks.explore_attention_gluon`` (TMA ring, mbarriers, async wgmma, with and without a
producer warp), which no ``tl`` kernel can express.

What compiling for sm90 on a CPU showed (Triton 3.6.0, 2026-12-07, ``--compile-only``):
``warp_specialize`` takes effect only with tensor descriptors and 4 warps (the kernel then runs 12
warps, producer partitions included, with setmaxnreg); with pointer loads it fails to compile at 4
warps and is ignored at 8, and it fails too when only q is loaded by pointer. A causal kernel
compiles only as one loop over every key block with the mask applied to each (two loops, the
unmasked blocks and then the diagonal, fail in the warp-specialization pass): the variants here
do that, paying the mask on every block. So the portable kernel, which loads by pointers and
splits its loop, cannot simply turn it on. At 128 x 128 tiles, D=128 and 3 stages the
warp-specialized kernel asks for 246,176 bytes of shared memory, past the 232,448 an H100/H200
block may have: those rows are printed as such and not timed.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from lanekit.runtime import alloc

SMEM_LIMIT = 232_448   # bytes of shared memory one block may have on sm90


@triton.jit
def _step(q, K, V, k_desc, v_desc, base, start_n, offs_m, offs_n, offs_d, m_i, l_i, acc, sm_scale_log2,
          D: tl.constexpr, TMA: tl.constexpr, MASKED: tl.constexpr):
    """One key block from start_n: scores, the causal mask (MASKED), the online-softmax update."""
    if TMA:
        k = k_desc.load([start_n, 0])
        v = v_desc.load([start_n, 0])
    else:
        k = tl.load(K + base + (start_n + offs_n)[:, None] * D + offs_d[None, :])
        v = tl.load(V + base + (start_n + offs_n)[:, None] * D + offs_d[None, :])
    s = tl.dot(q, k.T) * sm_scale_log2
    if MASKED:
        s = tl.where(offs_m[:, None] >= (start_n + offs_n)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _fwd_kernel(Q, K, V, O, sm_scale_log2, S,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                CAUSAL: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr):
    """One program: BLOCK_M queries of one (batch, head); q, k, v, o (B, H, S, D) contiguous, S a
    multiple of BLOCK_M and BLOCK_N. CAUSAL: 0 none; 1 the unmasked blocks, then the diagonal ones
    masked in a second loop; 2 one loop, every block masked (what warp specialization compiles)."""
    start_m = tl.program_id(0) * BLOCK_M
    base = tl.program_id(1).to(tl.int64) * S * D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k_desc = None
    v_desc = None
    if TMA:
        k_desc = tl.make_tensor_descriptor(K + base, shape=[S, D], strides=[D, 1], block_shape=[BLOCK_N, D])
        v_desc = tl.make_tensor_descriptor(V + base, shape=[S, D], strides=[D, 1], block_shape=[BLOCK_N, D])
        q = tl.make_tensor_descriptor(Q + base, shape=[S, D], strides=[D, 1], block_shape=[BLOCK_M, D]).load([start_m, 0])
    else:
        q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL == 1:
        full_hi = start_m // BLOCK_N * BLOCK_N      # key blocks every query sees whole; the diagonal after
    elif CAUSAL == 2:
        full_hi = start_m + BLOCK_M                 # one loop, every block masked
    else:
        full_hi = S
    for start_n in tl.range(0, full_hi, BLOCK_N, warp_specialize=WS):
        m_i, l_i, acc = _step(q, K, V, k_desc, v_desc, base, start_n, offs_m, offs_n, offs_d, m_i, l_i, acc,
                              sm_scale_log2, D, TMA, CAUSAL == 2)
    if CAUSAL == 1:   # the diagonal blocks, masked
        for start_n in tl.range(full_hi, start_m + BLOCK_M, BLOCK_N, warp_specialize=WS):
            m_i, l_i, acc = _step(q, K, V, k_desc, v_desc, base, start_n, offs_m, offs_n, offs_d, m_i, l_i, acc,
                                  sm_scale_log2, D, TMA, True)
    tl.store(O + base + offs_m[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty))


# name -> (BLOCK_M, BLOCK_N, TMA, WS, num_warps, num_stages); warp specialization needs 4 warps
VARIANTS = {
    "ptr 128x64 w8 s3": (128, 64, False, False, 8, 3),
    "ptr 128x128 w8 s2": (128, 128, False, False, 8, 2),
    "tma 128x64 w8 s3": (128, 64, True, False, 8, 3),
    "tma 128x128 w8 s2": (128, 128, True, False, 8, 2),
    "tma+ws 128x64 w4 s3": (128, 64, True, True, 4, 3),
    "tma+ws 128x128 w4 s2": (128, 128, True, True, 4, 2),
    "tma+ws 128x128 w4 s3": (128, 128, True, True, 4, 3),
}


def causal_mode(causal: bool, variant) -> int:
    """The kernel's CAUSAL for a variant: warp-specialized ones take the one masked loop."""
    return 0 if not causal else 2 if variant[3] else 1


def compile_for_sm90(D: int, causal: bool, variant) -> dict:
    """Compile one variant for sm90 (no GPU needed); its shared memory and what the PTX holds."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bm, bn, tma, ws, warps, stages = variant
    signature = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "sm_scale_log2": "fp32", "S": "i32",
                 "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "D": "constexpr", "CAUSAL": "constexpr",
                 "TMA": "constexpr", "WS": "constexpr"}
    constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "D": D, "CAUSAL": causal_mode(causal, variant), "TMA": tma, "WS": ws}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    try:
        kernel = triton.compile(ASTSource(_fwd_kernel, signature, constexprs, attrs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    except Exception as e:   # the compiler's own error, first line
        return {"error": (str(e).strip().splitlines() or [type(e).__name__])[-1][:120]}
    return report(kernel)


def report(kernel) -> dict:
    """What a kernel compiled for sm90 holds: shared memory per block, warps, registers and spilled
    bytes per thread (cuobjdump, as lanekit targets reads them), and its PTX's setmaxnreg, TMA
    and wgmma instruction counts."""
    from lanekit.runtime.targets import _cubin_resources

    ptx = kernel.asm["ptx"]
    regs, spills = _cubin_resources(kernel.asm["cubin"])
    return {"smem": kernel.metadata.shared, "warps": kernel.metadata.num_warps, "regs": regs, "spills": spills,
            "setmaxnreg": ptx.count("setmaxnreg"), "tma": ptx.count("cp.async.bulk.tensor"),
            "wgmma": ptx.count("wgmma.mma_async")}


def designs() -> dict:
    """Every design: name -> (compile_for_sm90(D, causal), run(q, k, v, causal)); the Gluon ones
    (benchmarks.explore_attention_gluon) where this Triton has Gluon."""
    out = {name: (lambda D, causal, v=v: compile_for_sm90(D, causal, v),
                  lambda q, k, v_, causal, v=v: run(v, q, k, v_, causal)) for name, v in VARIANTS.items()}
    try:
        from benchmarks import explore_attention_gluon as glu
    except ImportError as e:
        print(f"(no Gluon designs: {e})")
        return out
    out.update({name: (lambda D, causal, d=d: glu.compile_for_sm90(D, causal, d),
                       lambda q, k, v_, causal, d=d: glu.run(d, q, k, v_, causal)) for name, d in glu.DESIGNS.items()})
    return out


def compile_only() -> None:
    print(f"Triton {triton.__version__}, compiled for sm90 (no GPU): shared memory per block, warps, registers "
          f"and spilled bytes per thread, and the PTX's setmaxnreg / TMA / wgmma instruction counts")
    for D in (64, 128):
        for causal in (False, True):
            for name, (compile_, _) in designs().items():
                r = compile_(D, causal)
                where = f"D={D} {'causal' if causal else 'full  '} {name:30}"
                if "error" in r:
                    print(f"{where} FAILS: {r['error']}")
                else:
                    over = "  (over the sm90 limit)" if r["smem"] > SMEM_LIMIT else ""
                    print(f"{where} smem {r['smem']:7d}{over} warps {r['warps']:2d} regs {r['regs']:3d} "
                          f"spills {r['spills']} setmaxnreg {r['setmaxnreg']} tma {r['tma']} wgmma {r['wgmma']}")


def run(variant, q, k, v, causal: bool):
    bm, bn, tma, ws, warps, stages = variant
    B, H, S, D = q.shape
    o = alloc.empty(q.shape, dtype=q.dtype, device=q.device)    # NaN inside poisoned_outputs (the test)
    _fwd_kernel[(S // bm, B * H)](q, k, v, o, q.shape[-1] ** -0.5 * 1.4426950408889634, S,
                                  BLOCK_M=bm, BLOCK_N=bn, D=D, CAUSAL=causal_mode(causal, variant), TMA=tma, WS=ws,
                                  num_warps=warps, num_stages=stages)
    return o


def on_gpu(seqlens, batch_tokens: int) -> None:
    import lanekit
    from torch.nn.attention import SDPBackend, sdpa_kernel

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}; "
          f"bf16 forward TFLOP/s from CUDA graphs (causal counts half the products)")
    every = designs()
    for D in (64, 128):
        for causal in (False, True):
            for S in seqlens:
                B, H = max(1, batch_tokens // S), 2048 // D
                q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * B * H * S * S * D / (2 if causal else 1)
                rows = {}
                with torch.no_grad():
                    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                            is_causal=causal)
                    for backend, name in ((SDPBackend.CUDNN_ATTENTION, "sdpa cudnn"),
                                          (SDPBackend.FLASH_ATTENTION, "sdpa flash2")):
                        with sdpa_kernel(backend):
                            fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            rows[name] = triton.testing.do_bench_cudagraph(fn, rep=100)
                    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                    rows["lanekit flash_attn_func"] = triton.testing.do_bench_cudagraph(
                        lambda: lanekit.flash_attn_func(qt, kt, vt, causal=causal), rep=100)
                    for name, (compile_, run_) in every.items():
                        r = compile_(D, causal)
                        if "error" in r or r["smem"] > SMEM_LIMIT:
                            rows[name] = r.get("error", f"smem {r.get('smem')} over the limit")
                            continue
                        try:
                            err = (run_(q, k, v, causal).float() - want).abs().max().item()
                        except Exception as e:   # a design that fails to launch is reported, not fatal
                            rows[name] = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
                            continue
                        if not err < 2e-2:
                            rows[name] = f"wrong: max error {err:.3g}"
                            continue
                        rows[name] = triton.testing.do_bench_cudagraph(lambda: run_(q, k, v, causal), rep=100)
                cudnn = rows["sdpa cudnn"]
                print(f"\nD={D} S={S} B={B} H={H} {'causal' if causal else 'full'}")
                for name, ms in rows.items():
                    if isinstance(ms, str):
                        print(f"  {name:26} {ms}")
                    else:
                        print(f"  {name:26} {flops / ms / 1e9:7.1f} TFLOP/s  {cudnn / ms:5.2f}x cuDNN")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="compile the variants for sm90; no GPU needed")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="B = this // S")
    args = parser.parse_args(argv)
    if args.compile_only:
        compile_only()
    else:
        on_gpu([int(s) for s in args.seqlens.split(",")], args.batch_tokens)


if __name__ == "__main__":
    main()
