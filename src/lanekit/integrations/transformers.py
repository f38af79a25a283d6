"""Hugging Face transformers backend: ``attn_implementation="lanekit"``.

After :func:`register`, any transformers model whose attention goes through transformers'
``AttentionInterface`` (Llama, Mistral, Qwen, Gemma, BERT, ...) can run its attention on
:func:`lanekit.flash_attn_func`::

    import lanekit.integrations.transformers as lanekit_hf
    from transformers import AutoModel

    lanekit_hf.register()
    model = AutoModel.from_pretrained(path, attn_implementation="lanekit")

Two functions are registered under the name ``"lanekit"``:

- the attention function, :func:`attention_forward`, in ``transformers.AttentionInterface``;
- the mask builder, transformers' own ``sdpa_mask``, in
  ``transformers.masking_utils.AttentionMaskInterface``. Without a mask builder registered under the
  model's ``attn_implementation``, transformers builds no mask at all and padded batches would
  attend to their padding. ``sdpa_mask`` gives a bool mask (B, 1, Sq, Sk), True = attend, that
  already holds causality, sliding windows, padding and packed sequences; it is ``None`` when
  nothing needs masking or when plain causality is enough (then the attention function applies the
  causal mask itself, as transformers' SDPA integration does).

The lane: by default lanekit picks it from the tensors' device (Triton on CUDA/ROCm, the float64
reference elsewhere; the ``LANEKIT_LANE`` environment variable overrides that). ``register(lane=...)``
or assigning :data:`LANE` forces one lane for every model using ``"lanekit"``.

Checked with transformers 5.17 and 5.24 (``AttentionInterface``, ``AttentionMaskInterface`` and
``sdpa_mask`` have the same signatures in both).
"""

from __future__ import annotations

import warnings

import torch

from lanekit.attention.api import flash_attn_func
from lanekit.runtime.lanes import LANES

NAME = "lanekit"

#: The lane every ``attn_implementation="lanekit"`` call runs on: ``"triton"``, ``"reference"``, or
#: None to let lanekit pick by device (see :func:`lanekit.runtime.lanes.select_lane`). Set by
#: :func:`register`; may also be assigned directly.
LANE: str | None = None


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract, computed by :func:`lanekit.flash_attn_func`.

    Arguments (as transformers' attention modules pass them):
        module: the calling attention module. Read: ``training`` (dropout only while training),
            ``is_causal`` (when the call does not pass ``is_causal``; default True, as in
            transformers' SDPA integration).
        query: (B, Hq, Sq, D), fp16, bf16 or fp32 (fp64 on the reference lane only, to check a
            model in float64). Passed to lanekit as the (B, Sq, Hq, D) view, without a copy.
        key: (B, Hkv, Sk, D), same dtype and device; Hq a multiple of Hkv (GQA/MQA run natively,
            keys and values are not repeated).
        value: (B, Hkv, Sk, Dv).
        attention_mask: what the registered mask builder (``sdpa_mask``) produced, or a 4-D mask
            the caller passed in: bool broadcastable to (B, Hq, Sq, Sk), True = attend, holding
            causality, window and padding; or a float mask broadcastable to (B, Hq, Sq, Sk), added
            to the scores; or None.
        dropout: attention dropout probability; applied only when ``module.training``.
        scaling: multiplies q k^T; default ``D ** -0.5``.
        sliding_window: used only when ``attention_mask`` is None (with a mask, the mask already
            holds the window): as transformers' FlashAttention integration, keys more than
            ``sliding_window - 1`` positions away are dropped, aligned bottom-right.
        softcap: if set and > 0, scores become ``softcap * tanh(score / softcap)`` (Gemma 2).
        is_causal: overrides ``module.is_causal``. Used only when ``attention_mask`` is None and
            Sq > 1, exactly as transformers' SDPA integration does: a bool mask from the builder
            already encodes causality, and the builder returns None for a causal layer only when
            the plain causal mask is the whole mask.
        position_bias: (T5-style models) additive bias broadcastable to (B, Hq, Sq, Sk), added to
            the scores on top of the mask.
        s_aux: attention sinks (gpt-oss); not supported.
        **kwargs: other transformers kwargs (``position_ids``, ``output_attentions``, ...), ignored.

    Returns:
        ``(out, None)``: out (B, Sq, Hq, Dv) in query's dtype; no attention weights.

    Raises:
        NotImplementedError: ``s_aux`` (attention sinks) is given.
        TypeError, ValueError: from :func:`lanekit.flash_attn_func` (unsupported dtype such as
            fp64 on the Triton lane, head dim over 256, Hq not a multiple of Hkv, a mask not broadcastable to
            (B, Hq, Sq, Sk), the Triton lane on CPU tensors without Triton's interpreter, ...).

    Semantics: those of transformers' eager and SDPA attention for every query that sees at least
    one key. A query row that sees no key at all (left padding in a causal model) gives 0, like
    SDPA; eager instead spreads such a row uniformly over all keys (its mask adds a finite minimum,
    not -inf). Such rows are padding, and no real token reads them.
    """
    if s_aux is not None:
        raise NotImplementedError("s_aux: attention sinks are not supported by lanekit's attention")
    if kwargs.get("output_attentions", False):
        warnings.warn("attn_implementation='lanekit' does not return attention weights "
                      "(output_attentions=True); use 'eager' for them", stacklevel=2)

    q_len, kv_len = query.shape[2], key.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = False
    window = (-1, -1)
    attn_mask = attn_bias = None
    if attention_mask is None:
        # As transformers' SDPA integration: causal only when there is no mask and more than one
        # query (a single query sees every key).
        causal = bool(is_causal) and q_len > 1
        if causal and kv_len > q_len:
            # The mask builder skips the mask with Sk > Sq only for a prefill into an empty static
            # cache, whose keys past Sq are empty slots: SDPA's top-left causal mask, i.e. drop them.
            key, value = key[:, :, :q_len], value[:, :, :q_len]
            if position_bias is not None:
                position_bias = position_bias[..., :q_len]
        if sliding_window is not None and sliding_window > 0:
            window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    elif attention_mask.dtype == torch.bool:
        attn_mask = attention_mask
    else:
        attn_bias = attention_mask
    if position_bias is not None:
        attn_bias = position_bias if attn_bias is None else attn_bias + position_bias

    dropout_p = float(dropout) if getattr(module, "training", False) else 0.0
    out = flash_attn_func(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        dropout_p=dropout_p,
        softmax_scale=scaling,
        causal=causal,
        window_size=window,
        softcap=float(softcap) if softcap else 0.0,
        attn_bias=attn_bias,
        attn_mask=attn_mask,
        lane=LANE,
    )
    return out, None


def register(lane: str | None = None) -> None:
    """Make ``attn_implementation="lanekit"`` available to transformers models.

    Registers :func:`attention_forward` in ``transformers.AttentionInterface`` and transformers'
    ``sdpa_mask`` (bool mask, True = attend) in ``transformers.masking_utils.AttentionMaskInterface``,
    both under the name ``"lanekit"``, then sets :data:`LANE`. Call it before loading or running
    the model. Calling it again is harmless: the registrations are replaced by the same functions,
    and :data:`LANE` is set to the new ``lane``.

    Arguments:
        lane: ``"triton"``, ``"reference"`` or None (lanekit picks by device: Triton on CUDA/ROCm
            tensors, the reference otherwise, or the ``LANEKIT_LANE`` environment variable).
            ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` set before lanekit's kernels
            are imported.

    Raises:
        ValueError: ``lane`` is not one of ``"triton"``, ``"reference"`` or None.
        ImportError: transformers is not installed, or too old to have ``AttentionMaskInterface``.
    """
    global LANE
    if lane is not None and lane not in LANES:
        raise ValueError(f"lane: expected one of {LANES} or None, got {lane!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    LANE = lane
