"""Greedy generation for a batch of prompts of different lengths on lanekit's attention.

:func:`greedy_generate` runs a transformers Llama-style causal LM (``LlamaForCausalLM`` and the
models built like it: Mistral, Qwen2) module by module: the embedding, then per decoder layer the
input norm, the q/k/v projections, RoPE with the model's own ``rotary_emb`` cos/sin, lanekit
attention, ``o_proj``, the post-attention norm and the MLP; then the final norm and ``lm_head``.
Only the attention and the KV cache are lanekit's:

- prefill: the prompts packed into one (N, ...) batch, no padding, attended with
  :func:`lanekit.flash_attn_varlen_func` (causal); each layer's rotated keys and values go into its
  :class:`lanekit.kv_cache.PagedKVCache` with :meth:`~lanekit.kv_cache.PagedKVCache.write`;
- decode: one token per sequence per step, attended with :func:`lanekit.flash_attn_with_kvcache`
  on the paged cache (``block_table``, ``cache_seqlens``), which appends the step's keys and
  values in place. The keys are already rotated by the model's RoPE, so no ``rotary_cos/sin``.

Greedy: the next token is the argmax of the last position's logits, as transformers'
``model.generate(..., do_sample=False)``. No stop token: every prompt gets ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lanekit.attention.api import flash_attn_varlen_func
from lanekit.attention.api_kvcache import flash_attn_with_kvcache
from lanekit.kv_cache import PagedKVCache


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' Llama RoPE (NeoX pairing) of q (..., Hq, D) and k (..., Hkv, D) with cos and
    sin (..., D) of the same leading shape."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=q.dim() - 2)


def _attention_block(layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend):
    """One decoder layer with lanekit attention. hidden (..., hidden_size); cos, sin (..., D).
    ``attend(q, k, v)`` takes the rotated q (..., Hq, D), k (..., Hkv, D), v (..., Hkv, D) and
    returns the attention output (..., Hq, D)."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    q, k = _rope(attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), cos, sin)
    v = attn.v_proj(x).view(shape)
    out = attn.o_proj(attend(q, k, v).flatten(-2))
    hidden = hidden + out
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


@torch.no_grad()
def greedy_generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                    page_size: int = 16, lane: str | None = None) -> list[list[int]]:
    """Greedy generation of ``max_new_tokens`` tokens after each prompt, prefill with
    :func:`lanekit.flash_attn_varlen_func` and decode with :func:`lanekit.flash_attn_with_kvcache`
    on a paged KV cache (see this module's docstring).

    Arguments:
        model: a transformers ``LlamaForCausalLM`` (or a model with its layout: ``model.model``
            with ``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``; ``model.lm_head``), in
            fp16, bf16 or fp32, on any device; put in eval mode by the caller.
        prompts: B lists of token ids, each of length >= 1, lengths free.
        max_new_tokens: >= 1.
        page_size: tokens per page of the paged cache, >= 1.
        lane: "triton", "reference" or None (lanekit's default for the device).

    Returns:
        B lists of ``max_new_tokens`` token ids, the new tokens only.

    Raises:
        ValueError: no prompts, an empty prompt, max_new_tokens < 1; and the errors of lanekit's
            attention and cache functions.

    Semantics: transformers' greedy ``model.generate(..., do_sample=False)`` on each prompt alone
    (:func:`eager_generate`, the oracle the tests and ``lanekit demo`` compare with).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError(f"prompts: expected at least one prompt, each of >= 1 token, got lengths "
                         f"{[len(p) for p in prompts]}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    body, config = model.model, model.config
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    ids = list(range(len(prompts)))
    lengths = [len(p) for p in prompts]
    pages_per_seq = -(-(max(lengths) + max_new_tokens) // page_size)
    caches = [PagedKVCache(len(prompts) * pages_per_seq, page_size, config.num_key_value_heads,
                           body.layers[0].self_attn.head_dim, dtype=dtype, device=device, lane=lane)
              for _ in body.layers]

    # Prefill: the prompts packed, one causal varlen attention per layer.
    tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)   # (N,)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])                     # (N,)
    cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)                   # (B + 1,)
    hidden = body.embed_tokens(tokens)                                                           # (N, hidden)
    cos, sin = (t[0] for t in body.rotary_emb(hidden[None], positions[None]))                    # (N, D)
    for layer, cache in zip(body.layers, caches):
        def prefill(q, k, v, cache=cache, attn=layer.self_attn):
            cache.write(k, v, cache.append(ids, lengths))
            return flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                          softmax_scale=attn.scaling, causal=True, lane=lane)
        hidden = _attention_block(layer, hidden, cos, sin, prefill)
    logits = model.lm_head(body.norm(hidden[cu[1:].long() - 1]))                                # (B, vocab)
    next_tokens = logits.argmax(-1)                                                              # (B,)
    generated = [next_tokens]

    # Decode: one token per sequence per step over the paged cache. Every page the steps will
    # write is reserved up front (the caches' bookkeeping on the host, once), so that the loop
    # copies nothing to the device and reads nothing back: the lengths advance on the device and
    # max_seqlen_k, the one bound the kernel needs from the host, is known here.
    steps = max_new_tokens - 1
    if steps:
        tables = []
        for cache in caches:
            cache.append(ids, [steps] * len(ids))
            tables.append(cache.block_table(ids))                                                # (B, max_pages)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)                        # (B,) before the step
    for step in range(steps):
        hidden = body.embed_tokens(next_tokens)[:, None]                                         # (B, 1, hidden)
        cos, sin = body.rotary_emb(hidden, seqlens.long()[:, None])                              # (B, 1, D)
        for layer, cache, table in zip(body.layers, caches, tables):
            def decode(q, k, v, cache=cache, table=table, attn=layer.self_attn):
                return flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, k, v,
                                               cache_seqlens=seqlens, block_table=table,
                                               softmax_scale=attn.scaling, causal=True,
                                               max_seqlen_k=max(lengths) + step + 1, lane=lane)
            hidden = _attention_block(layer, hidden, cos, sin, decode)
        seqlens += 1
        next_tokens = model.lm_head(body.norm(hidden[:, -1])).argmax(-1)
        generated.append(next_tokens)
    return torch.stack(generated, dim=1).tolist()


@torch.no_grad()
def eager_generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """The oracle of :func:`greedy_generate`: transformers' own ``model.generate(...,
    do_sample=False)`` on each prompt alone (no padding), with the model's attention
    implementation and cache, never stopping early. Returns B lists of the new tokens."""
    device = model.lm_head.weight.device
    return [model.generate(torch.tensor([list(p)], device=device), max_new_tokens=max_new_tokens,
                           min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist()
            for p in prompts]


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """A random-weight ``LlamaForCausalLM`` with eager attention: vocab 128, hidden 64, 2 layers,
    4 query heads and 2 KV heads (GQA) of dim 16. Weights drawn with std 0.3 (transformers'
    default 0.02 gives nearly flat logits, and greedy decoding then repeats one token): its greedy
    continuations vary, and the gap between the two best logits stays far above fp32 rounding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=256, initializer_range=0.3,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0,
                         attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def random_prompts(lengths: Sequence[int] = (5, 11, 2), vocab: int = 128, seed: int = 1) -> list[list[int]]:
    """Prompts of the given lengths, token ids uniform in [0, vocab)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
