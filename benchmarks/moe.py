"""Mixture-of-experts cases at three models' shapes: lanekit beside PyTorch's grouped_mm and the
ways transformers runs its experts.

Shapes (bf16): Mixtral-8x7B (E=8, top-2, K=4096, N=14336), Qwen3-30B-A3B (E=128, top-8, K=2048,
N=768), DeepSeek-V3 (E=256, top-8, K=7168, N=2048), at M = 1, 16, 256 and 4096 tokens. Weights are
drawn at scale K^-1/2 (N^-1/2 for w2) so the activations stay O(1); the routing is the model's
(softmax of random logits, top-k, renormalized), balanced-ish. Each fused_moe call takes the next
of ``ROUTING_SETS`` routings (and token batches) in turn, so that at small M consecutive calls read
different experts and the L2 cache (50 MB) does not serve a decode step's expert weights.

Six families (``python -m benchmarks.run moe`` runs all six):

- ``moe_graphs`` (this module, TFLOP/s, CUDA graphs: the GPU's time): ``grouped_mm`` (the MLP's
  first GEMM, (M*topk, K) rows sorted by expert times w1 as (E, K, 2N), the transposed view of the
  stored (E, 2N, K)) beside ``torch.nn.functional.grouped_mm`` (CUTLASS on sm90); ``fused_moe``
  beside the grouped_mm pipeline (dispatch by torch.sort and a gather, grouped_mm, SiLU-and-mul,
  grouped_mm, weighted combine in fp32: transformers' ``grouped_mm`` experts). FLOPs: 2 * M * topk
  * K * 2N for the GEMM, 6 * M * topk * K * N for the MLP.
- ``moe_eager`` (:data:`EAGER`, TFLOP/s, eager: what a Python caller sees, host time included):
  the same fused_moe and pipeline, the per-expert loop as transformers' eager experts write it,
  and that loop under torch.compile.
- ``moe_decode`` (:data:`DECODE`, GB/s, CUDA graphs): fused_moe at M = 1 and 16, the bytes being
  the expert weights actually read (the distinct experts routed, 3 * N * K * 2 bytes each) plus
  the tokens in and out; the runner's "of copy" column is the fraction of the HBM bound.
- ``moe_align`` (:data:`ALIGN`, microseconds per call): ``moe_align_block_size`` +
  ``moe_dispatch`` at M = 1, E = 256, top-8, K = 7168, beside the same transport done with torch
  (sort, gather, histc, cumsum); each eager (host time included) and replayed from a CUDA graph
  (the kernels' GPU time, as vLLM times its align kernel: the issue's bar of 15 us).
- ``moe_fp8`` (:data:`FP8`, TFLOP/s of the bf16 MLP's FLOPs, CUDA graphs): fused_moe with fp8 e4m3
  experts in 128 x 128 blocks (activations quantized on the fly, both passes timed) beside
  lanekit's bf16 fused_moe on the same routing, at Qwen3-30B-A3B and DeepSeek-V3 shapes, M = 256
  and 4096: the issue's bar is 1.6x at M = 4096.
- ``moe_mxfp4`` (:data:`MXFP4`, TFLOP/s, CUDA graphs): fused_moe with MXFP4 experts
  (``use_mxfp4_w4a16``, gpt-oss's) beside lanekit's bf16 fused_moe on the same weights dequantized,
  at gpt-oss-20b's and gpt-oss-120b's shapes (E 32 / 128, top-4, K = N = 2880), M = 1 to 4096.

``python -m benchmarks.moe`` (no GPU needed) runs every case's inputs, check and peers once at
tiny shapes on the CPU with lanekit's reference lane, to catch a broken path before the GPU run.
"""

from __future__ import annotations

import functools
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import lanekit.moe as lk
from lanekit.reference import moe as ref
from lanekit.testing import compare

UNIT = "TFLOP/s"
CUDA_GRAPHS = True
BF16 = torch.bfloat16
MODELS = {
    "Mixtral-8x7B": dict(E=8, topk=2, K=4096, N=14336),
    "Qwen3-30B-A3B": dict(E=128, topk=8, K=2048, N=768),
    "DeepSeek-V3": dict(E=256, topk=8, K=7168, N=2048),
}
#: What ``python -m benchmarks.moe`` runs on the CPU: K and N not multiples of 16, and E = 256.
TINY = {"tiny": dict(E=8, topk=2, K=200, N=72), "tiny-256": dict(E=256, topk=8, K=64, N=32)}
TOKENS = (1, 16, 256, 4096)
ROUTING_SETS = 4
CHECK_TOKENS = 64          # the check compares at most the first 64 tokens with the float64 oracle,
CHECK_EXPERTS = 8          # of at most 8 distinct experts (DeepSeek-V3's w1 in float64 is 60 GB)
ALIGN_BLOCK = 16           # vLLM's BLOCK_SIZE_M for small M


def _grouped_mm():
    """``torch.nn.functional.grouped_mm`` (torch >= 2.10), else ``torch._grouped_mm``."""
    return getattr(F, "grouped_mm", None) or torch._grouped_mm


# ---------------------------------------------------------------------------------------------
# cases and inputs


def _case(op, model, M, shapes=MODELS):
    return dict(op=op, model=model, M=M, **shapes[model])


def cases(quick: bool = False, shapes=MODELS):
    for model in shapes:
        for M in ((256,) if quick else TOKENS) if shapes is MODELS else (3, 40):
            for op in ("grouped_mm", "fused_moe"):
                yield _case(op, model, M, shapes)


def name(c) -> str:
    return f"{c['op']} {c['model']} M={c['M']}"


def flops(c) -> float:
    per_row = 2 * c["K"] * 2 * c["N"] if c["op"] == "grouped_mm" else 6 * c["K"] * c["N"]
    return per_row * c["M"] * c["topk"]


@functools.lru_cache(maxsize=64)
def _routing_cpu(E: int, topk: int, M: int, index: int):
    """Routing set ``index`` of M tokens: the model's top-k softmax of random logits, renormalized.
    Computed on the CPU from a fixed seed, so that :func:`bytes_moved` counts the experts that the
    timed calls read. Returns (topk_weights fp32 (M, topk), topk_ids int32 (M, topk))."""
    g = torch.Generator().manual_seed(1000 * index + M)
    logits = torch.randn(M, E, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), topk, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).contiguous(), ids.to(torch.int32).contiguous()


def distinct_experts(c) -> float:
    """The mean over the routing sets of the number of distinct experts routed."""
    return sum(_routing_cpu(c["E"], c["topk"], c["M"], i)[1].unique().numel()
               for i in range(ROUTING_SETS)) / ROUTING_SETS


def _dispatch_torch(x, topk_ids, E):
    """The transport of transformers' grouped_mm experts: the M * topk slots sorted by expert, the
    gathered rows, each expert's cumulative end (histc: no device sync, CUDA-graph safe) and the
    sort order. Returns (rows (M*topk, K), offs int32 (E,), order int64 (M*topk,))."""
    flat = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat)
    counts = torch.histc(sorted_ids.float() if x.device.type == "cpu" else sorted_ids,
                         bins=E, min=0, max=E - 1)
    return x[order // topk_ids.shape[1]], torch.cumsum(counts, 0, dtype=torch.int32), order


def make_inputs(c, device="cuda"):
    """[x_sets, w1 (E, 2N, K), w2 (E, K, N), routing_sets, grouped_sets]: per routing set the
    tokens (M, K), the (weights, ids) and, for grouped_mm, the rows sorted by expert and offs."""
    g = torch.Generator(device=device).manual_seed(0)
    E, K, N, M = c["E"], c["K"], c["N"], c["M"]
    w1 = torch.randn(E, 2 * N, K, generator=g, device=device, dtype=BF16).mul_(K ** -0.5)
    w2 = torch.randn(E, K, N, generator=g, device=device, dtype=BF16).mul_(N ** -0.5)
    xs = [torch.randn(M, K, generator=g, device=device, dtype=BF16) for _ in range(ROUTING_SETS)]
    routings = [tuple(t.to(device) for t in _routing_cpu(E, c["topk"], M, i)) for i in range(ROUTING_SETS)]
    grouped = [_dispatch_torch(x, ids, E)[:2] for x, (_, ids) in zip(xs, routings)]
    return [xs, w1, w2, routings, grouped]


def _cycle(fn, n=ROUTING_SETS):
    """A zero-argument callable that calls fn(0), fn(1), ..., fn(n - 1), fn(0), ... in turn."""
    state = [0]

    def call():
        i = state[0]
        state[0] = (i + 1) % n
        return fn(i)

    return call


# ---------------------------------------------------------------------------------------------
# the peers


def pipeline(x, w1, w2, topk_weights, topk_ids):
    """fused_moe by grouped_mm, as transformers' ``grouped_mm`` experts run it: dispatch by
    torch.sort and a gather, grouped_mm with w1 as (E, K, 2N), SiLU(gate) * up, grouped_mm with w2
    as (E, N, K), the routing weights applied in fp32, the slots put back in token order and summed
    in fp32, rounded once to x's dtype."""
    M, topk = topk_ids.shape
    mm = _grouped_mm()
    rows, offs, order = _dispatch_torch(x, topk_ids, w1.shape[0])
    h = mm(rows, w1.transpose(1, 2), offs=offs)                                # (M*topk, 2N)
    N = w2.shape[2]
    y = mm(F.silu(h[:, :N]) * h[:, N:], w2.transpose(1, 2), offs=offs)          # (M*topk, K)
    y = y * topk_weights.reshape(-1)[order, None]                               # fp32
    out = torch.empty_like(y)
    out[order] = y
    return out.view(M, topk, -1).sum(1).to(x.dtype)


def expert_loop(x, w1, w2, topk_weights, topk_ids):
    """transformers' eager experts (``MixtralExperts.forward``): per expert hit, its tokens
    gathered, linear with gate_up_proj, SiLU(gate) * up, linear with down_proj, times the routing
    weight, index_add_ into the output in x's dtype."""
    E = w1.shape[0]
    out = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(topk_ids.long(), num_classes=E + 1).permute(2, 1, 0)   # (E + 1, topk, M)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = e[0]
        if e == E:
            continue
        slot, token = torch.where(mask[e])
        gate, up = F.linear(x[token], w1[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


@functools.cache
def compiled_loop():
    """:func:`expert_loop` under torch.compile, compiled once with dynamic shapes for every case
    (each expert's token count is data-dependent: the loop breaks the graph at ``nonzero`` and at
    each expert; a static compile would recompile per count until dynamo's limit made it eager)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(expert_loop, dynamic=True)


# ---------------------------------------------------------------------------------------------
# checks: lanekit against the float64 oracle on the first CHECK_TOKENS tokens


def _tolerance(op: str):
    from lanekit.families import get_op

    return get_op(op).outputs[0][1]


def _compact(topk_ids, *weights):
    """The experts that topk_ids (M, topk) uses, as float64 copies of each weight (E', ...), and
    the ids renumbered into them: the oracle then never upcasts the experts nobody uses."""
    used, ids = torch.unique(topk_ids.long(), return_inverse=True)
    return ids.to(torch.int32), [w[used].double() for w in weights]


def _check_tokens(topk_ids) -> int:
    """The longest prefix of tokens, at most CHECK_TOKENS, routed to at most CHECK_EXPERTS distinct
    experts (at least the first token)."""
    n = 1
    while n < min(CHECK_TOKENS, topk_ids.shape[0]) and topk_ids[:n + 1].unique().numel() <= CHECK_EXPERTS:
        n += 1
    return n


def check(c, xs, w1, w2, routings, grouped) -> str | None:
    """lanekit against the float64 oracle on routing set 0: fused_moe on the first tokens (see
    _check_tokens), grouped_mm on every row of the first CHECK_EXPERTS experts whose rows start
    within the first CHECK_TOKENS rows. Returns an error or None."""
    x, (weights, ids) = xs[0], routings[0]
    t = slice(0, _check_tokens(ids))
    if c["op"] == "grouped_mm":
        a, offs = grouped[0]
        out = lk.grouped_mm(a, w1.transpose(1, 2), offs)
        ends = offs.long().tolist()
        starts = [0] + ends[:-1]
        # the experts whose rows start within the first CHECK_TOKENS rows, all their rows
        experts = [e for e in range(len(ends)) if starts[e] < CHECK_TOKENS and ends[e] > starts[e]]
        for e in experts[:CHECK_EXPERTS]:
            expected = a[starts[e]:ends[e]].double() @ w1[e].t().double()
            result = compare(out[starts[e]:ends[e]], expected, _tolerance("grouped_mm"))
            if not result.ok:
                return f"expert {e}: {result.detail}"
        return None
    out = lk.fused_moe(x, w1, w2, weights, ids)
    local, (w1_64, w2_64) = _compact(ids[t], w1, w2)
    expected = ref.fused_moe(x[t].double(), w1_64, w2_64, weights[t].double(), local)
    result = compare(out[t], expected, _tolerance("fused_moe"))
    return None if result.ok else result.detail


def runners(c, xs, w1, w2, routings, grouped):
    """name -> zero-argument callable, for lanekit and each peer (CUDA-graph safe)."""
    if c["op"] == "grouped_mm":
        b, mm = w1.transpose(1, 2), _grouped_mm()
        return {"lanekit": _cycle(lambda i: lk.grouped_mm(grouped[i][0], b, grouped[i][1])),
                "torch grouped_mm": _cycle(lambda i: mm(grouped[i][0], b, offs=grouped[i][1]))}
    return {"lanekit": _cycle(lambda i: lk.fused_moe(xs[i], w1, w2, *routings[i])),
            "grouped_mm pipeline": _cycle(lambda i: pipeline(xs[i], w1, w2, *routings[i]))}


# ---------------------------------------------------------------------------------------------
# the other three families


def _eager_cases(quick: bool = False, shapes=MODELS):
    return (c for c in cases(quick, shapes) if c["op"] == "fused_moe")


def _eager_runners(c, xs, w1, w2, routings, grouped):
    ours = runners(c, xs, w1, w2, routings, grouped)
    loop = compiled_loop()
    ours["transformers loop"] = _cycle(lambda i: expert_loop(xs[i], w1, w2, *routings[i]))
    ours["loop torch.compile"] = _cycle(lambda i: loop(xs[i], w1, w2, *routings[i]))
    return ours


EAGER = SimpleNamespace(
    __doc__="fused_moe eagerly (host time included) beside the pipeline, transformers' loop and "
            "that loop under torch.compile (see benchmarks.moe).",
    UNIT="TFLOP/s", CUDA_GRAPHS=False, cases=_eager_cases, name=lambda c: name(c) + " eager",
    flops=flops, make_inputs=make_inputs, check=check, runners=_eager_runners)


def _decode_cases(quick: bool = False, shapes=MODELS):
    for model in shapes:
        for M in ((1,) if quick else (1, 16)):
            yield _case("fused_moe", model, M, shapes)


def decode_bytes(c) -> float:
    """The least a decode step reads and writes: the routed experts' weights (3 * N * K each, bf16)
    and the tokens in and out."""
    return 2 * (distinct_experts(c) * 3 * c["N"] * c["K"] + 2 * c["M"] * c["K"])


DECODE = SimpleNamespace(
    __doc__="fused_moe at decode sizes, GB/s of the expert weights actually read (see benchmarks.moe).",
    UNIT="GB/s", CUDA_GRAPHS=True, cases=_decode_cases, name=lambda c: f"decode {c['model']} M={c['M']}",
    bytes_moved=decode_bytes, make_inputs=make_inputs, check=check, runners=runners)


def _align_cases(quick: bool = False, shapes=MODELS):
    big = "DeepSeek-V3" if shapes is MODELS else "tiny-256"
    for graph in (False, True) if shapes is MODELS else (False,):   # (the tiny smoke runs on the CPU)
        yield dict(op="align+dispatch", model=big, M=1, graph=graph, **shapes[big])


def _align_inputs(c, device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(c["M"], c["K"], generator=g, device=device, dtype=BF16)
    return [x, _routing_cpu(c["E"], c["topk"], c["M"], 0)[1].to(device)]


def _align_check(c, x, ids) -> str | None:
    """Exact: the align's three outputs and the dispatch's rows and offsets, as the oracle's."""
    got = lk.moe_align_block_size(ids, ALIGN_BLOCK, c["E"])
    expected = ref.moe_align_block_size(ids, ALIGN_BLOCK, c["E"])
    n = int(expected[2][0])
    for what, o, e in (("sorted_token_ids", got[0][:n], expected[0][:n]),
                       ("expert_ids", got[1][:n // ALIGN_BLOCK], expected[1][:n // ALIGN_BLOCK]),
                       ("num_tokens_post_padded", got[2], expected[2])):
        if not torch.equal(o.cpu().long(), e.cpu().long()):
            return f"moe_align_block_size: {what} differs from the oracle's"
    rows, offs = lk.moe_dispatch(x, ids, c["E"])[:2]
    ref_rows, ref_offs = ref.moe_dispatch(x, ids, c["E"])[:2]
    if not torch.equal(rows, ref_rows) or not torch.equal(offs.cpu().long(), ref_offs.cpu().long()):
        return "moe_dispatch: rows or offs differ from the oracle's"
    return None


def _replay(fn):
    """fn captured in a CUDA graph (after a warm-up call), returned as the graph's replay: timed as
    a call, its figure is the GPU's time of fn's kernels (a graph's launch costs the host a few us),
    as vLLM's align benchmark times its kernel."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _align_runners(c, x, ids):
    runners = {"lanekit": lambda: (lk.moe_align_block_size(ids, ALIGN_BLOCK, c["E"]), lk.moe_dispatch(x, ids, c["E"])),
               "torch sort": lambda: _dispatch_torch(x, ids, c["E"])}
    if c["graph"]:
        runners = {name: _replay(fn) for name, fn in runners.items()}
    return runners


ALIGN = SimpleNamespace(
    __doc__="moe_align_block_size + moe_dispatch at M = 1, E = 256, microseconds per call, eager (the "
            "host's time included) and replayed from a CUDA graph (see benchmarks.moe).",
    UNIT="us", CUDA_GRAPHS=False, cases=_align_cases,
    name=lambda c: f"{c['op']} {c['model']} M={c['M']}" + (", CUDA graph" if c["graph"] else ""),
    make_inputs=_align_inputs, check=_align_check, runners=_align_runners)

FP8_BLOCK = "fp8 128x128 blocks"


def _fp8_cases(quick: bool = False, shapes=MODELS):
    models = ("Qwen3-30B-A3B", "DeepSeek-V3") if shapes is MODELS else tuple(shapes)[:1]
    for model in models:
        for M in (((4096,) if quick else (256, 4096)) if shapes is MODELS else (40,)):
            yield _case("fused_moe fp8", model, M, shapes)


def _fp8_inputs(c, device="cuda"):
    """make_inputs' bf16 tensors, plus w1 and w2 as DeepSeek-V3's checkpoints store them: e4m3
    codes with a scale per 128 x 128 block (lanekit.moe.registry.quantize_weight)."""
    from lanekit.moe.registry import quantize_weight

    xs, w1, w2, routings, grouped = make_inputs(c, device)
    return [xs, w1, w2, routings, (*quantize_weight(w1, FP8_BLOCK), *quantize_weight(w2, FP8_BLOCK))]


def _fp8_call(x, quant, topk_weights, topk_ids):
    w1q, w1s, w2q, w2s = quant
    return lk.fused_moe(x, w1q, w2q, topk_weights, topk_ids, use_fp8_w8a8=True, block_shape=[128, 128],
                        w1_scale=w1s, w2_scale=w2s)


def _fp8_check(c, xs, w1, w2, routings, quant) -> str | None:
    """fp8 fused_moe against the quantized oracle (the codes and block scales, x quantized per
    1 x 128 group on the fly, the intermediate rounded to bf16 and quantized) on the first tokens."""
    x, (weights, ids) = xs[0], routings[0]
    t = slice(0, _check_tokens(ids))
    out = _fp8_call(x, quant, weights, ids)
    used, local = torch.unique(ids[t].long(), return_inverse=True)
    w1q, w1s, w2q, w2s = (q[used] for q in quant)
    expected = ref.fused_moe(x[t].double(), w1q, w2q, weights[t].double(), local.to(torch.int32),
                             use_fp8_w8a8=True, block_shape=[128, 128], w1_scale=w1s, w2_scale=w2s,
                             intermediate_dtype=x.dtype)
    result = compare(out[t], expected, _tolerance("fused_moe_quant"))
    return None if result.ok else result.detail


def _fp8_runners(c, xs, w1, w2, routings, quant):
    return {"lanekit": _cycle(lambda i: _fp8_call(xs[i], quant, *routings[i])),
            "lanekit bf16": _cycle(lambda i: lk.fused_moe(xs[i], w1, w2, *routings[i]))}


FP8 = SimpleNamespace(
    __doc__="fused_moe with fp8 e4m3 W8A8 experts in 128 x 128 blocks (DeepSeek-V3's layout; "
            "activations quantized per 1 x 128 group on the fly) beside lanekit's own bf16 "
            "fused_moe on the same routing; TFLOP/s of the bf16 MLP's FLOPs (see benchmarks.moe).",
    UNIT="TFLOP/s", CUDA_GRAPHS=True, cases=_fp8_cases, name=name, flops=flops,
    make_inputs=_fp8_inputs, check=_fp8_check, runners=_fp8_runners)

# -- MXFP4 experts (gpt-oss's) --

MX_MODELS = {
    "gpt-oss-20b": dict(E=32, topk=4, K=2880, N=2880),
    "gpt-oss-120b": dict(E=128, topk=4, K=2880, N=2880),
}
MX_TINY = {"tiny-mx": dict(E=8, topk=2, K=64, N=32)}     # K and N multiples of 32


def _mxfp4_cases(quick: bool = False, shapes=MODELS):
    models = MX_MODELS if shapes is MODELS else MX_TINY
    for model in models:
        for M in (((16, 4096) if quick else TOKENS) if shapes is MODELS else (3, 40)):
            yield _case("fused_moe mxfp4", model, M, models)


def _mxfp4_weight(E, R, C, g, device):
    """Random MXFP4 expert weights (E, R, C) as gpt-oss stores them (codes two a byte, e8m0 bytes
    per 32, O(1) rows: scale ~ 1 / (3.3 sqrt(C))) and the same weights dequantized to bf16, expert
    by expert (the bf16 peer computes the same MLP)."""
    codes = torch.randint(0, 16, (E, R, C // 2), generator=g, device=device, dtype=torch.uint8)
    packed = codes | (torch.randint(0, 16, (E, R, C // 2), generator=g, device=device, dtype=torch.uint8) << 4)
    base = 127 - round(torch.log2(torch.tensor(3.3 * C ** 0.5)).item())
    scale = torch.randint(base - 2, base + 1, (E, R, C // 32), generator=g, device=device, dtype=torch.uint8)
    dense = torch.empty(E, R, C, device=device, dtype=BF16)
    for e in range(E):
        dense[e] = ref.mxfp4_experts(packed[e:e + 1], scale[e:e + 1], BF16)[0]
    return packed, scale, dense


def _mxfp4_inputs(c, device="cuda"):
    """Tokens and routings as make_inputs', the experts MXFP4 (and their bf16 dequantization)."""
    g = torch.Generator(device=device).manual_seed(0)
    E, K, N, M = c["E"], c["K"], c["N"], c["M"]
    w1q, w1s, w1 = _mxfp4_weight(E, 2 * N, K, g, device)
    w2q, w2s, w2 = _mxfp4_weight(E, K, N, g, device)
    xs = [torch.randn(M, K, generator=g, device=device, dtype=BF16) for _ in range(ROUTING_SETS)]
    routings = [tuple(t.to(device) for t in _routing_cpu(E, c["topk"], M, i)) for i in range(ROUTING_SETS)]
    return [xs, w1, w2, routings, (w1q, w1s, w2q, w2s)]


def _mxfp4_call(x, quant, topk_weights, topk_ids):
    w1q, w1s, w2q, w2s = quant
    return lk.fused_moe(x, w1q, w2q, topk_weights, topk_ids, use_mxfp4_w4a16=True, w1_scale=w1s, w2_scale=w2s)


def _mxfp4_check(c, xs, w1, w2, routings, quant) -> str | None:
    """MXFP4 fused_moe against its oracle (codes and scales dequantized exactly, the intermediate
    rounded to bf16) on the first tokens."""
    x, (weights, ids) = xs[0], routings[0]
    t = slice(0, _check_tokens(ids))
    out = _mxfp4_call(x, quant, weights, ids)
    used, local = torch.unique(ids[t].long(), return_inverse=True)
    w1q, w1s, w2q, w2s = (q[used] for q in quant)
    expected = ref.fused_moe_mxfp4(x[t].double(), w1q, w2q, weights[t].double(), local.to(torch.int32),
                                   w1_scale=w1s, w2_scale=w2s, intermediate_dtype=x.dtype)
    result = compare(out[t], expected, _tolerance("fused_moe_mxfp4"))
    return None if result.ok else result.detail


def _mxfp4_runners(c, xs, w1, w2, routings, quant):
    return {"lanekit": _cycle(lambda i: _mxfp4_call(xs[i], quant, *routings[i])),
            "lanekit bf16": _cycle(lambda i: lk.fused_moe(xs[i], w1, w2, *routings[i]))}


MXFP4 = SimpleNamespace(
    __doc__="fused_moe with MXFP4 experts (gpt-oss's: e2m1 codes, an e8m0 scale per 32, bf16 "
            "activations; use_mxfp4_w4a16) beside lanekit's own bf16 fused_moe on the same "
            "(dequantized) weights and routing, at gpt-oss-20b's and -120b's shapes; TFLOP/s of "
            "the MLP's FLOPs, CUDA graphs (see benchmarks.moe).",
    UNIT="TFLOP/s", CUDA_GRAPHS=True, cases=_mxfp4_cases, name=name, flops=flops,
    make_inputs=_mxfp4_inputs, check=_mxfp4_check, runners=_mxfp4_runners)

FAMILIES = {"moe_graphs": sys.modules[__name__], "moe_eager": EAGER, "moe_decode": DECODE, "moe_align": ALIGN,
            "moe_fp8": FP8, "moe_mxfp4": MXFP4}


# ---------------------------------------------------------------------------------------------
# the CPU smoke run


def host_us(fn, batches: int = 20, calls: int = 50) -> float:
    """Median over ``batches`` of the wall-clock microseconds per call of ``calls`` back-to-back
    calls, synchronized at the end of each batch: the host's time and the GPU's, whichever bounds."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(10):
        fn()
    sync()
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(times)[len(times) // 2]


def smoke(device: str = "cpu", lane: str = "reference") -> list[str]:
    """Every family's every tiny case on ``device`` (inputs, check, each peer once, the figures'
    counts), lanekit on ``lane``. Returns one line per case; raises on a failed check or a peer
    that does not run. Nothing is timed but the align family's host timer, briefly."""
    import os

    previous = os.environ.get("LANEKIT_LANE")
    os.environ["LANEKIT_LANE"] = lane
    lines = []
    try:
        for fam, module in FAMILIES.items():
            for c in module.cases(False, shapes=TINY):
                inputs = module.make_inputs(c, device=device)
                error = module.check(c, *inputs)
                if error is not None:
                    raise AssertionError(f"{fam} {module.name(c)}: {error}")
                fns = module.runners(c, *inputs)
                outs = {peer: fn() for peer, fn in fns.items()}
                if c["op"] == "fused_moe":   # every peer computes the same MLP (routing set 0)
                    ours = outs["lanekit"].double()
                    for peer, out in outs.items():
                        diff = (out.double() - ours).abs().max().item()
                        if not diff <= 0.05 * ours.abs().max().item():
                            raise AssertionError(f"{fam} {module.name(c)}: {peer} differs by {diff:.3g}")
                if module.UNIT == "us":
                    figure = f"{host_us(fns['lanekit'], 2, 2):.0f} us"
                elif module.UNIT == "GB/s":
                    figure = f"{module.bytes_moved(c):.4g} bytes"
                else:
                    figure = f"{module.flops(c):.4g} flops"
                lines.append(f"{fam}: {module.name(c)}: ok, peers {sorted(outs)}, {figure}")
    finally:
        if previous is None:
            os.environ.pop("LANEKIT_LANE")
        else:
            os.environ["LANEKIT_LANE"] = previous
    return lines


if __name__ == "__main__":
    for line in smoke():
        print(line)
