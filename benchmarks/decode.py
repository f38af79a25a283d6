"""Decode over a KV cache: lanekit.flash_attn_with_kvcache beside torch SDPA (flash and cuDNN).

B=32 sequences, one query each, 32 query heads and 8 KV heads of 128, bf16, Sk 4k and 32k cached
tokens; the cache contiguous (B, S, Hkv, D) or paged with pages of 16 and 256 tokens, handed out in
a shuffled order, and pages of 16 also in order (a sequence's pages adjacent, as a fresh pool hands
them out: laid out as the contiguous cache, but read through the table), which tells what the
kernel's page walk costs apart from where the pages lie. The unit is GB/s of K and V read (the
traffic decode cannot avoid), comparable with the device-to-device copy bandwidth the runner
measures in the same run. SDPA reads the contiguous cache (it has no paged form) through (B, Hkv,
S, D) views with ``enable_gqa``. Beside them is a bound rather than a peer, "read-only": a kernel
that reads the same K and V where they lie and does no attention (_read_only). Every call is timed
replaying a CUDA graph (as serving engines run decode); lanekit is told the longest sequence
(max_seqlen_k, as an engine capturing a graph per length bucket would), and its split count is the
one its heuristic picks for that length.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

import lanekit
from lanekit.attention.api_kvcache import kvcache_num_splits
from lanekit.attention.registry import ATTENTION_FWD
from lanekit.reference import attention as ref
from lanekit.testing import compare, upcast

UNIT = "GB/s"
CUDA_GRAPHS = True
B, HQ, HKV, D = 32, 32, 8, 128
BF16 = torch.bfloat16


def cases(quick: bool = False):
    for sk in ((4096,) if quick else (4096, 32768)):
        for layout in ("contiguous", "paged 16", "paged 16 in order", "paged 256"):
            yield dict(sk=sk, layout=layout)


def name(c) -> str:
    return f"decode Sk={c['sk'] // 1024}k {c['layout']}"


def case_named(text: str) -> dict:
    """The case a name stands for, the bench's own or another of their form: "decode Sk=32k paged 4",
    and pages placed otherwise than shuffled over the pool (what the placement costs, see
    _placement): "... paged 16 in order", "... round robin", "... shuffled in 2 MiB". Raises
    ValueError for any other text."""
    m = re.fullmatch(r"decode Sk=(\d+)k (contiguous|paged \d+(?: in order| round robin| shuffled in \d+ MiB)?)", text)
    if m is None:
        raise ValueError("case: expected 'decode Sk=<N>k contiguous|paged <P>[ in order| round robin| "
                         f"shuffled in <M> MiB]', got {text!r}")
    return dict(sk=int(m.group(1)) * 1024, layout=m.group(2))


def _placement(layout: str, pages: int, page: int, g, device) -> torch.Tensor:
    """The pool page of each (sequence, page), in that order: shuffled over the pool (the bench's
    paged cases); "in order" (a sequence's pages adjacent, as a fresh pool hands out whole
    prompts); "round robin" (page p of sequence b at p * B + b, as a pool handing out its lowest
    free page does while the sequences grow in lockstep); "shuffled in <M> MiB" (shuffled within
    aligned runs of M MiB of K, the runs in order: how far a sequence's pages spread)."""
    n = B * pages
    if layout.endswith("in order"):
        return torch.arange(n, device=device)
    if layout.endswith("round robin"):
        return torch.arange(n, device=device).reshape(pages, B).t().reshape(-1)
    spread = re.search(r"shuffled in (\d+) MiB$", layout)
    if spread:
        run = max(int(spread.group(1)) * 2**20 // (page * HKV * D * 2), 1)
        return torch.cat([s + torch.randperm(min(run, n - s), generator=g, device=device) for s in range(0, n, run)])
    return torch.randperm(n, generator=g, device=device)


def bytes_moved(c) -> float:
    return 2 * B * c["sk"] * HKV * D * 2


def make_inputs(c, device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    sk = c["sk"]
    q = torch.randn(B, 1, HQ, D, generator=g, device=device, dtype=BF16)
    k = torch.randn(B, sk, HKV, D, generator=g, device=device, dtype=BF16)
    v = torch.randn(B, sk, HKV, D, generator=g, device=device, dtype=BF16)
    seqlens = torch.full((B,), sk, dtype=torch.int32, device=device)
    table = None
    if c["layout"] == "contiguous":
        kc, vc = k, v
    else:
        page = int(c["layout"].split()[1])
        pages = sk // page
        order = _placement(c["layout"], pages, page, g, device)
        table = order.reshape(B, pages).to(torch.int32)
        kc = torch.empty(B * pages, page, HKV, D, device=device, dtype=BF16)
        vc = torch.empty_like(kc)
        kc[order] = k.reshape(B * pages, page, HKV, D)
        vc[order] = v.reshape(B * pages, page, HKV, D)
    return [q, k, v, kc, vc, seqlens, table]


def _splits(c, q, kc, vc, table) -> int:
    return kvcache_num_splits(q, kc, vc, table, max_seqlen_k=c["sk"])


def expected(q, k, v):
    """(the sequences checked, the float64 oracle's output for them): the first two and the last two."""
    seqs = sorted({0, 1, q.shape[0] - 2, q.shape[0] - 1} & set(range(q.shape[0])))
    out, _ = ref.flash_attn(upcast(q[seqs]), upcast(k[seqs]), upcast(v[seqs]), softmax_scale=D ** -0.5)
    return seqs, out


def _lanekit(c, q, kc, vc, seqlens, table, num_splits=None):
    """lanekit's decode call on these inputs, with ``num_splits`` splits (None: the heuristic's,
    which the call picks itself from max_seqlen_k, inside a graph capture too)."""
    return lambda: lanekit.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                                   num_splits=num_splits or 0, max_seqlen_k=c["sk"])


def check(c, q, k, v, kc, vc, seqlens, table, num_splits=None, oracle=None) -> str | None:
    """The first two and the last two sequences against the float64 oracle (``num_splits``: that
    split count, else the heuristic's; ``oracle``: :func:`expected`'s result, when already known)."""
    out = _lanekit(c, q, kc, vc, seqlens, table, num_splits)()
    seqs, want = oracle if oracle is not None else expected(q, k, v)
    result = compare(out[seqs], want, ATTENTION_FWD)
    return None if result.ok else result.detail


@triton.jit
def _read_kv_kernel(K, V, BT, Out, stride_kp, stride_kn, stride_kh, stride_btb, Sk,
                    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Out[b, h] = the sum of K + V over the Sk keys of sequence b (pool pages BT[b], PAGE keys a
    page) at KV head h: every byte decode reads, in decode's order (a program per (KV head,
    sequence), BLOCK_N keys a step), and no attention."""
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    c = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    row = BT + b * stride_btb
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    for start in range(0, Sk, BLOCK_N):
        if PAGE < BLOCK_N:  # a block of whole pages: a table entry a page
            NP: tl.constexpr = BLOCK_N // PAGE
            pages = tl.load(row + start // PAGE + tl.arange(0, NP)).to(tl.int64)
            page = tl.reshape(tl.broadcast_to(pages[:, None], (NP, PAGE)), (BLOCK_N,))
            slot = c % PAGE
        else:  # a block within one page
            page = tl.load(row + start // PAGE).to(tl.int64)
            slot = start % PAGE + c
        off = (page * stride_kp + slot * stride_kn + h * stride_kh)[:, None] + d[None, :]
        acc += tl.load(K + off).to(tl.float32) + tl.load(V + off).to(tl.float32)
    tl.store(Out + (b * tl.num_programs(0) + h) * D + d, tl.sum(acc, 0))


def _read_only(c, k, v, kc, vc, table):
    """A kernel that reads the K and V decode reads, where they lie and in decode's order, and does
    nothing else: what reading this cache costs without attention, about the most a decode kernel
    can reach on it. 64 keys, 4 warps, 3 stages, the fastest read-only tile tried on the H200 (64/4/4
    alike, 128/8/3 1-2% slower); the bench's lengths are multiples of 64 and its pages powers of
    two. Its sums are checked on the first call against those of the dense k and v the cache was
    filled from."""
    if table is None:  # the contiguous cache: a page of Sk keys a sequence
        table = torch.arange(B, dtype=torch.int32, device=kc.device)[:, None]
    out = torch.empty(B, HKV, D, device=kc.device, dtype=torch.float32)
    checked = []

    def run():
        _read_kv_kernel[(HKV, B)](kc, vc, table, out, kc.stride(0), kc.stride(1), kc.stride(2), table.stride(0),
                                  c["sk"], PAGE=kc.shape[1], BLOCK_N=64, D=D, num_warps=4, num_stages=3)
        if not checked:
            want = k.sum(1, dtype=torch.float32) + v.sum(1, dtype=torch.float32)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=0.05)
            checked.append(True)
        return out

    return run


def runners(c, q, k, v, kc, vc, seqlens, table, num_splits=None):
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        return run

    return {
        "lanekit": _lanekit(c, q, kc, vc, seqlens, table, num_splits),
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "read-only": _read_only(c, k, v, kc, vc, table),
    }
