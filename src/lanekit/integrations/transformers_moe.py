"""Hugging Face transformers MoE models on lanekit: ``experts_implementation="lanekit"``.

transformers (5.x) keeps the experts of its MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and
the models built like them) in one module per layer holding two 3-D parameters, ``gate_up_proj``
(E, 2N, K), the gate rows then the up rows, and ``down_proj`` (E, K, N), and runs that module's
forward through its ``ExpertsInterface`` (a registry of implementations, like the attention
interface). The sparse MoE block's router picks each token's experts and weights and hands them to
the experts module. After :func:`register`, ``"lanekit"`` is one of those implementations::

    import lanekit.integrations.transformers_moe as lanekit_moe
    from transformers import AutoModelForCausalLM

    lanekit_moe.register()
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="lanekit")
    lanekit_moe.patch_routers(model)     # optional: the routers' top-k softmax on lanekit too

or :func:`enable` on a model already built. The two pieces:

- the experts, :func:`experts_forward`: the whole expert MLP of a layer is one
  :func:`lanekit.moe.fused_moe` call on the model's own parameters (``gate_up_proj`` is already
  fused_moe's w1, ``down_proj`` its w2: views, nothing is copied or cached);
- the routers, :func:`patch_routers`: the softmax and top-k of the routers of Mixtral, Qwen2-MoE,
  Qwen3-MoE and OLMoE on :func:`lanekit.moe.topk_softmax`, renormalized as the model does (Mixtral
  always; Qwen2/3-MoE and OLMoE when ``config.norm_topk_prob``, which OLMoE's checkpoints leave
  False), the weights returned in the dtype the model's router returns (fp32 for Mixtral, the
  logits' dtype for the others).

Experts modules that fused_moe does not cover (biases, transposed or interleaved weights, a post
expert norm, no gate, an activation other than SiLU or exact GELU, expert parallelism, fp32
activations: fused_moe takes fp16 and bf16, and fp64 on the reference lane) run their model's own
eager forward: ``experts_implementation="lanekit"`` is safe to ask of any model.

The lane: as :mod:`lanekit.integrations.transformers`, by device unless :func:`register`'s
``lane`` or :data:`LANE` says otherwise. Checked with transformers 5.24.
"""

from __future__ import annotations

import types

import torch

from lanekit.runtime.lanes import LANES

NAME = "lanekit"

#: The lane every ``experts_implementation="lanekit"`` call (and every patched router) runs on:
#: ``"triton"``, ``"reference"``, or None to let lanekit pick by device. Set by :func:`register`.
LANE: str | None = None

#: The activation dtypes fused_moe takes (fp64 only on the reference lane, to check a model in
#: float64); experts of another dtype (an fp32 model) run their model's own eager forward.
DTYPES = (torch.float16, torch.bfloat16, torch.float64)

#: Router classes whose forward :func:`patch_routers` replaces, by class name: whether the chosen
#: weights are renormalized (a function of the router), and whether the router returns them in
#: fp32 (Mixtral) or in the logits' dtype (the others).
ROUTERS = {
    "MixtralTopKRouter": (lambda router: True, True),
    "Qwen2MoeTopKRouter": (lambda router: bool(router.norm_topk_prob), False),
    "Qwen3MoeTopKRouter": (lambda router: bool(router.norm_topk_prob), False),
    "OlmoeTopKRouter": (lambda router: bool(router.norm_topk_prob), False),
}


def activation_of(experts: torch.nn.Module) -> str | None:
    """fused_moe's name for the experts' activation ("silu" or "gelu", the exact erf GELU), or
    None when fused_moe has no such activation."""
    from transformers.activations import GELUActivation, SiLUActivation

    act = getattr(experts, "act_fn", None)
    if isinstance(act, (torch.nn.SiLU, SiLUActivation)):
        return "silu"
    if type(act) is GELUActivation:
        return "gelu"
    return None


def supported(experts: torch.nn.Module) -> bool:
    """Whether :func:`experts_forward` runs ``experts`` (a transformers experts module, decorated
    by ``use_experts_implementation``) on lanekit; otherwise it runs the module's own eager
    forward. Needed: gated experts with concatenated [gate; up] weights (E, 2N, K) and (E, K, N),
    not transposed, no biases, no post-expert norm, no expert parallelism, SiLU or exact GELU.
    The layout flags every version of the decorator sets are required; the two that later versions
    added (a post-expert norm, expert parallelism) count as absent where the module has no such
    attribute (transformers 5.17 has neither feature)."""
    return (getattr(experts, "has_gate", False) and getattr(experts, "is_concatenated", False)
            and not getattr(experts, "is_transposed", True) and not getattr(experts, "has_bias", True)
            and not getattr(experts, "has_post_expert_norm", False)
            and not getattr(experts, "_is_expert_parallel", False)
            and activation_of(experts) is not None)


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts-function contract, computed by :func:`lanekit.moe.fused_moe`.

    Arguments (as the model's sparse MoE block passes them):
        self: the experts module. Read: ``gate_up_proj`` (E, 2N, K), the gate rows then the up
            rows (fused_moe's w1, used as it is), ``down_proj`` (E, K, N) (w2), ``act_fn``, and
            the layout flags of ``use_experts_implementation`` (see :func:`supported`).
        hidden_states: (M, K) tokens, fp16 or bf16 (fp64 on the reference lane); of another dtype
            (fp32), the module's own eager forward runs instead.
        top_k_index: (M, topk) int64 (or int32) expert ids, as the router chose them.
        top_k_weights: (M, topk) router weights, fp32 (Mixtral) or the model's dtype (Qwen,
            OLMoE); converted to fp32 exactly.

    Returns:
        (M, K) in hidden_states' dtype: sum over the topk slots of weight * expert(x), each
        expert's MLP down(act(gate(x)) * up(x)).

    Raises:
        TypeError, ValueError: from :func:`lanekit.moe.fused_moe` (dtypes, shapes, the Triton
            lane on CPU tensors without Triton's interpreter). Expert ids out of range are not
            checked here (they live on the device): fused_moe masks them and records them for
            :func:`lanekit.check_errors`.

    Semantics: the model's eager experts loop (transformers' ``*Experts.forward``), except that
    each token's topk contributions are summed in fp32 and rounded once (eager adds them one by one
    in the model's dtype with ``index_add_``).
    """
    if not supported(self) or hidden_states.dtype not in DTYPES:
        return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
    from lanekit.moe import fused_moe

    return fused_moe(hidden_states, self.gate_up_proj, self.down_proj,
                     top_k_weights.to(torch.float32), top_k_index.to(torch.int32),
                     activation=activation_of(self), lane=LANE)


def _router_forward(self: torch.nn.Module, hidden_states: torch.Tensor):
    """A patched router's forward: the model's router (logits = x @ weight^T, softmax in fp32, the
    topk best, renormalized or not) with the softmax and top-k on :func:`lanekit.moe.topk_softmax`.
    Returns the model's triple (router_logits (M, E), weights (M, topk), ids (M, topk) int64)."""
    from lanekit.moe import topk_softmax

    renormalize, fp32 = ROUTERS[type(self).__name__]
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)        # (M, E)
    weights, ids = topk_softmax(router_logits, self.top_k, renormalize=renormalize(self), lane=LANE)
    return router_logits, weights if fp32 else weights.to(router_logits.dtype), ids.long()


def patch_routers(model: torch.nn.Module) -> int:
    """Route ``model``'s tokens with :func:`lanekit.moe.topk_softmax`: replaces the forward of
    every router of a class in :data:`ROUTERS` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) on this model
    instance (the classes are untouched). Idempotent; :func:`unpatch_routers` undoes it.

    Returns:
        how many routers were patched (0 when the model has none of those classes).
    """
    count = 0
    for module in model.modules():
        if type(module).__name__ in ROUTERS:
            module.forward = types.MethodType(_router_forward, module)
            count += 1
    return count


def unpatch_routers(model: torch.nn.Module) -> None:
    """Give the routers patched by :func:`patch_routers` their model's forward back."""
    for module in model.modules():
        if type(module).__name__ in ROUTERS and "forward" in vars(module):
            del module.forward


def register(lane: str | None = None) -> None:
    """Make ``experts_implementation="lanekit"`` available to transformers MoE models.

    Registers :func:`experts_forward` in ``transformers.integrations.moe.ExpertsInterface`` under
    the name ``"lanekit"`` (for ``from_pretrained(..., experts_implementation="lanekit")`` or
    ``model.set_experts_implementation("lanekit")``), then sets :data:`LANE`. Calling it again is
    harmless.

    Arguments:
        lane: ``"triton"``, ``"reference"`` or None (lanekit picks by device, or the
            ``LANEKIT_LANE`` environment variable). ``"triton"`` on CPU tensors needs
            ``TRITON_INTERPRET=1`` set before lanekit's kernels are imported.

    Raises:
        ValueError: ``lane`` is not one of ``"triton"``, ``"reference"`` or None.
        ImportError: transformers is not installed, or too old to have an ``ExpertsInterface``.
    """
    global LANE
    if lane is not None and lane not in LANES:
        raise ValueError(f"lane: expected one of {LANES} or None, got {lane!r}")
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, experts_forward)
    LANE = lane


def enable(model: torch.nn.Module, lane: str | None = None, routing: bool = True) -> torch.nn.Module:
    """Run a built transformers MoE model's experts (and, with ``routing``, its routers) on lanekit:
    :func:`register`, ``model.set_experts_implementation("lanekit")``, :func:`patch_routers`.

    Arguments:
        model: a transformers ``PreTrainedModel`` whose experts use transformers' experts interface.
        lane: as :func:`register`.
        routing: also patch the routers (:func:`patch_routers`).

    Returns:
        ``model``, changed in place.

    Raises:
        ValueError: bad ``lane``, or (from transformers) a model without an experts interface.
        ImportError: as :func:`register`.
    """
    register(lane)
    model.set_experts_implementation(NAME)
    if routing:
        patch_routers(model)
    return model


def tiny_moe(family: str = "mixtral", seed: int = 0, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu", experts_implementation: str = "eager",
             num_experts: int = 8, top_k: int = 2, norm_topk_prob: bool | None = None):
    """A random-weight MoE causal LM of ``family`` ("mixtral", "qwen3_moe", "qwen2_moe" or
    "olmoe"): vocab 128, hidden 64, 2 layers, 4 query and 2 KV heads of 16, ``num_experts`` experts
    of intermediate size 72 (not a multiple of 16), ``top_k`` per token; in eval mode. Weights drawn
    with std 0.3 (transformers' default 0.02 gives nearly flat logits, and greedy decoding then
    repeats one token). ``norm_topk_prob`` defaults to the family's checkpoints' (Qwen: True, OLMoE:
    False); Mixtral always renormalizes. Qwen2-MoE also has its shared expert."""
    import transformers

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3,
                  num_experts_per_tok=top_k, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                  attn_implementation="eager", experts_implementation=experts_implementation)
    if family == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=72, num_local_experts=num_experts)
        cls = transformers.MixtralForCausalLM
    elif family in ("qwen3_moe", "qwen2_moe", "olmoe"):
        norm = (family != "olmoe") if norm_topk_prob is None else norm_topk_prob
        extra = dict(moe_intermediate_size=72, num_experts=num_experts, norm_topk_prob=norm)
        if family == "qwen3_moe":
            config = transformers.Qwen3MoeConfig(**common, **extra, intermediate_size=128)
            cls = transformers.Qwen3MoeForCausalLM
        elif family == "qwen2_moe":
            config = transformers.Qwen2MoeConfig(**common, **extra, intermediate_size=128,
                                                 shared_expert_intermediate_size=96)
            cls = transformers.Qwen2MoeForCausalLM
        else:
            config = transformers.OlmoeConfig(**common, intermediate_size=72, num_experts=num_experts,
                                              norm_topk_prob=norm)
            cls = transformers.OlmoeForCausalLM
    else:
        raise ValueError(f"family: expected one of 'mixtral', 'qwen3_moe', 'qwen2_moe', 'olmoe', got {family!r}")
    torch.manual_seed(seed)
    return cls(config).to(device=device, dtype=dtype).eval()
