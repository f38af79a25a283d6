"""transformers MoE models with ``experts_implementation="lanekit"``, against transformers' eager experts.

Tiny random-weight models built locally (``lanekit.integrations.transformers_moe.tiny_moe``: 2
layers, hidden 64, 8 experts of intermediate size 72, top-2; Mixtral, Qwen3-MoE, Qwen2-MoE with its
shared expert, OLMoE). Whole-model bf16 logits are judged by FlashAttention's fallback rule (DESIGN.md):
lanekit's largest error against the same model run in float64 is at most twice the error of the
eager model in bf16, or one step of bf16 at the logits' magnitude. Why not closer: both runs round
every layer's activations to bf16, and where they round differs (fused_moe rounds the expert MLP's
intermediate once and sums a token's topk expert outputs in fp32, eager adds them one at a time in
bf16), so neither is the other's oracle; the float64 run is. In float64 the reference lane agrees
with eager to float64 rounding (a check of the semantics alone). fp32 models run their own experts
(fused_moe takes 16-bit activations). Greedy generation with ``model.generate`` gives the same
tokens: in float64 exactly; in bf16 up to the first near tie (see assert_same_greedy_tokens). The
models' weights have std 0.3, so that their logits are not flat.
"""

import pytest
import torch

pytest.importorskip("transformers")

import lanekit.integrations.transformers_moe as lanekit_moe  # noqa: E402
from lanekit.integrations.transformers_moe import tiny_moe  # noqa: E402
from lanekit.testing import ulp  # noqa: E402
from lanekit.runtime.lanes import triton_interpreted  # noqa: E402

LANES = ("reference", "triton")
FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")


@pytest.fixture(autouse=True)
def _registered():
    lanekit_moe.register()
    yield
    lanekit_moe.LANE = None


def prompt(n=9, batch=2, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (batch, n), generator=g).to(device)


def lanekit_model(family, lane, dtype=torch.float32, device="cpu", routing=True, **kw):
    skip_uninterpreted_triton_on_cpu(lane, device)
    model = tiny_moe(family, dtype=dtype, device=device, **kw)
    return lanekit_moe.enable(model, lane=lane, routing=routing)


def skip_uninterpreted_triton_on_cpu(lane, device="cpu"):
    """The Triton lane on CPU tensors runs under Triton's interpreter, which the test session turns
    on only where there is no GPU; on a GPU machine the *_on_the_gpu tests run it natively."""
    if lane == "triton" and torch.device(device).type == "cpu" and not triton_interpreted():
        pytest.skip("the Triton lane on CPU tensors needs Triton's interpreter (the GPU tests run it natively)")


def assert_within_eager_error(ours, eager, exact, dtype=torch.float32, factor=2):
    """lanekit's largest error against the float64 run is at most ``factor`` times eager's, or one
    step of ``dtype`` at max |exact| (the project's rule), whichever is larger."""
    ours, eager, exact = ours.double().cpu(), eager.double().cpu(), exact.double().cpu()
    assert torch.isfinite(ours).all()
    err = (ours - exact).abs().max().item()
    eager_err = (eager - exact).abs().max().item()
    allowed = max(factor * eager_err, ulp(dtype, exact.abs().max().item()))
    assert err <= allowed, f"lanekit error {err:.3g}, eager's {eager_err:.3g}, allowed {allowed:.3g}"


def logits(model, ids, routes=None):
    """The logits (B, S, vocab); with ``routes`` (a list), each layer's router outputs
    (router_logits (B*S, E), ids (B*S, topk)) appended to it in layer order."""
    hooks = [] if routes is None else [
        layer.mlp.gate.register_forward_hook(lambda m, args, out: routes.append((out[0], out[2])))
        for layer in model.model.layers]
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        for h in hooks:
            h.remove()


def same_routing(routes, exact_routes, shape, dtype):
    """(B, S) bool: the positions that come before the first token of their sequence that
    ``routes`` sent to other experts than the float64 run did, in any layer (past it, attention
    carries the difference on). Each such first difference must be a near tie of the float64
    router: its topk-th and topk+1-th logits within 4 steps of ``dtype`` at the router logits'
    magnitude (a bf16 run's activations differ from float64's by that much after a layer or two,
    and then either choice is rounding's, in eager as in lanekit)."""
    B, S = shape
    keep = torch.ones(B, S, dtype=torch.bool)
    for (_, ids), (exact_logits, exact_ids) in zip(routes, exact_routes, strict=True):
        topk = ids.shape[1]
        differs = (ids.sort(-1).values != exact_ids.sort(-1).values).any(-1).view(B, S).cpu()
        ranked = exact_logits.double().sort(-1, descending=True).values.view(B, S, -1).cpu()
        for b, t in differs.nonzero().tolist():
            if keep[b, t]:
                gap = (ranked[b, t, topk - 1] - ranked[b, t, topk]).item()
                step = ulp(dtype, exact_logits.abs().max().item())
                assert gap <= 4 * step, f"token {t} of sequence {b} routed apart from float64 at a gap of {gap:.3g}"
                keep[b, t:] = False
    return keep


class FusedMoeCalls:
    """Records the arguments of every fused_moe call the experts make (and still makes the call)."""

    def __init__(self, monkeypatch):
        import lanekit.moe

        self.calls, real = [], lanekit.moe.fused_moe

        def spy(*args, **kw):
            self.calls.append((args, kw))
            return real(*args, **kw)

        monkeypatch.setattr(lanekit.moe, "fused_moe", spy)


# ---------------------------------------------------------------------------------------------
# logits and generation


def assert_same_greedy_tokens(ours, eager, prompt_len, dtype, models=None):
    """ours and eager (``generate`` outputs with ``output_logits``) pick the same tokens, up to the
    first step where eager's two candidates are a near tie: their logits within 4 steps of ``dtype``
    at the logits' magnitude. In bf16 (a step of 0.0625 at these logits' magnitude of about 10) the
    best two logits of these models are often equal within 12 tokens, whatever the prompt, and
    which one wins is then rounding's choice, not a defect; after a divergence the sequences differ.
    With ``models`` (lanekit's, eager's), a divergence may also follow a router's near tie on the
    same prefix (lanekit.demo's rule)."""
    a, b = ours.sequences[0, prompt_len:], eager.sequences[0, prompt_len:]
    for step, (x, y) in enumerate(zip(a.tolist(), b.tolist())):
        if x != y:
            step_logits = eager.logits[step][0].double()
            gap = (step_logits[y] - step_logits[x]).abs().item()
            if gap > 4 * ulp(dtype, step_logits.abs().max().item()) and models is not None:
                from lanekit import demo

                prefix = eager.sequences[:, :prompt_len + step]
                assert demo._router_near_tie(*models, prefix, dtype), f"step {step}: {x} vs {y}, gap {gap:.3g}"
                return
            assert gap <= 4 * ulp(dtype, step_logits.abs().max().item()), f"step {step}: {x} vs {y}, gap {gap:.3g}"
            return
    assert torch.equal(ours.sequences, eager.sequences)


FP32_ROUTING_STEPS = 8      # measured up to 2.5 fp32 steps (Mixtral, routing weights in fp32)
GENERATE = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_moe_bf16_logits_match_eager(family, lane, monkeypatch):
    calls = FusedMoeCalls(monkeypatch)
    ids = prompt()
    routes, exact_routes = [], []
    ours = logits(lanekit_model(family, lane, torch.bfloat16), ids, routes)
    assert len(calls.calls) == 2                                          # one call per MoE layer
    eager = logits(tiny_moe(family, dtype=torch.bfloat16), ids)
    exact = logits(tiny_moe(family, dtype=torch.float64), ids, exact_routes)
    keep = same_routing(routes, exact_routes, ids.shape, torch.bfloat16)
    assert keep.sum() >= keep.numel() // 2
    assert ours.abs().max() > 1.0
    assert_within_eager_error(ours[keep], eager[keep], exact[keep], dtype=torch.bfloat16)


@pytest.mark.parametrize("family", FAMILIES)
def test_float64_model_on_the_reference_lane_matches_eager_to_float64_rounding(family, monkeypatch):
    # the reference lane in float64 computes what eager computes, in another order: a check of
    # the experts' semantics (weights' layout, gate before up, routing weights, the shared
    # expert) alone. With the routers on lanekit too, the routing weights are fp32 in both (the
    # models' routers and topk_softmax take the softmax in fp32) but rounded in other places:
    # a few fp32 steps at the logits' magnitude.
    calls = FusedMoeCalls(monkeypatch)
    ids = prompt()
    eager = logits(tiny_moe(family, dtype=torch.float64), ids)
    ours = logits(lanekit_model(family, "reference", torch.float64, routing=False), ids)
    assert len(calls.calls) == 2
    torch.testing.assert_close(ours, eager, rtol=0, atol=1e-10 * eager.abs().max().item())
    routed = logits(lanekit_model(family, "reference", torch.float64), ids)
    routing_tolerance = FP32_ROUTING_STEPS * ulp(torch.float32, eager.abs().max().item())
    torch.testing.assert_close(routed, eager, rtol=0, atol=routing_tolerance)


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renormalized", "not-renormalized"])
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_norm_topk_prob_is_followed(family, norm_topk_prob):
    ids = prompt()
    f64 = dict(dtype=torch.float64, norm_topk_prob=norm_topk_prob)
    ours = logits(lanekit_model(family, "reference", **f64), ids)
    eager = logits(tiny_moe(family, **f64), ids)
    other = logits(tiny_moe(family, dtype=torch.float64, norm_topk_prob=not norm_topk_prob), ids)
    routing_tolerance = FP32_ROUTING_STEPS * ulp(torch.float32, eager.abs().max().item())
    torch.testing.assert_close(ours, eager, rtol=0, atol=routing_tolerance)
    assert (ours - other).abs().max() > 0.1                               # the flag matters here


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_float64_greedy_generation_matches_eager(family):
    ids = prompt(n=5, batch=1, seed=8)        # its best two logits stay >= 0.12 apart
    kw = dict(GENERATE, max_new_tokens=12, min_new_tokens=12)
    with torch.no_grad():
        ours = lanekit_model(family, "reference", torch.float64).generate(ids, **kw)
        eager = tiny_moe(family, dtype=torch.float64).generate(ids, **kw)
    assert ours.shape == (1, 5 + 12)
    assert ours[0, 5:].unique().numel() > 1                               # not one token repeated
    assert torch.equal(ours, eager)


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_bf16_greedy_generation_matches_eager_up_to_a_near_tie(family, lane):
    ids = prompt(n=5, batch=1, seed=8)
    kw = dict(GENERATE, max_new_tokens=12, min_new_tokens=12, output_logits=True, return_dict_in_generate=True)
    models = (lanekit_model(family, lane, torch.bfloat16), tiny_moe(family, dtype=torch.bfloat16))
    with torch.no_grad():
        ours, eager = (m.generate(ids, **kw) for m in models)
    assert ours.sequences.shape == (1, 5 + 12)
    assert_same_greedy_tokens(ours, eager, 5, torch.bfloat16, models)


def test_fp32_model_runs_its_own_experts(monkeypatch):
    # fused_moe takes 16-bit activations (and fp64 on the reference lane): an fp32 model's
    # experts run transformers' eager loop, bit for bit
    calls = FusedMoeCalls(monkeypatch)
    ids = prompt()
    eager = logits(tiny_moe("mixtral"), ids)
    assert torch.equal(logits(lanekit_model("mixtral", "reference", routing=False), ids), eager)
    assert calls.calls == []


# ---------------------------------------------------------------------------------------------
# the pieces: weights as views, routing, what falls back


def test_experts_pass_the_models_own_weights_without_copies(monkeypatch):
    calls = FusedMoeCalls(monkeypatch)
    model = lanekit_model("mixtral", "reference", torch.bfloat16)
    logits(model, prompt())
    for (args, kw), layer in zip(calls.calls, model.model.layers):
        experts = layer.mlp.experts
        x, w1, w2, weights, topk_ids = args
        assert w1 is experts.gate_up_proj and w2 is experts.down_proj   # (E, 2N, K) and (E, K, N)
        assert weights.dtype == torch.float32 and topk_ids.dtype == torch.int32
        assert topk_ids.shape == (18, 2) and kw["activation"] == "silu"


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_router_reproduces_the_models_routing(family):
    model = tiny_moe(family)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    for layer in model.model.layers:
        router = layer.mlp.gate
        expected = router(x)
        assert lanekit_moe.patch_routers(layer) == 1
        got = router(x)
        lanekit_moe.unpatch_routers(layer)
        assert torch.equal(got[0], expected[0])                           # the logits, untouched
        assert torch.equal(got[2], expected[2]) and got[2].dtype == torch.int64
        assert got[1].dtype == expected[1].dtype
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=ulp(torch.float32, 1.0))
        assert torch.equal(router(x)[1], expected[1])                     # unpatched: the model's own again


def test_routing_patch_is_per_instance_and_idempotent():
    model, other = tiny_moe("olmoe"), tiny_moe("olmoe")
    assert lanekit_moe.patch_routers(model) == 2
    assert lanekit_moe.patch_routers(model) == 2
    assert all("forward" in vars(layer.mlp.gate) for layer in model.model.layers)
    assert not any("forward" in vars(layer.mlp.gate) for layer in other.model.layers)
    assert lanekit_moe.patch_routers(torch.nn.Linear(2, 2)) == 0


def test_unsupported_activation_runs_the_models_own_experts(monkeypatch):
    calls = FusedMoeCalls(monkeypatch)
    ids = prompt()
    model = tiny_moe("mixtral", dtype=torch.bfloat16)
    model.config.hidden_act = "gelu_pytorch_tanh"
    from transformers.activations import ACT2FN

    for layer in model.model.layers:
        layer.mlp.experts.act_fn = ACT2FN["gelu_pytorch_tanh"]
    eager = logits(model, ids)
    assert not lanekit_moe.supported(model.model.layers[0].mlp.experts)
    lanekit_moe.enable(model, lane="reference", routing=False)
    assert torch.equal(logits(model, ids), eager)
    assert calls.calls == []


def test_gelu_experts_run_on_lanekit(monkeypatch):
    calls = FusedMoeCalls(monkeypatch)
    ids = prompt()
    runs = {}
    for name, dtype, impl in (("ours", torch.bfloat16, "lanekit"), ("eager", torch.bfloat16, "eager"),
                              ("exact", torch.float64, "eager")):
        model = tiny_moe("mixtral", dtype=dtype)
        from transformers.activations import ACT2FN

        for layer in model.model.layers:
            layer.mlp.experts.act_fn = ACT2FN["gelu"]
        model.set_experts_implementation(impl)
        runs[name] = logits(model, ids)
    assert [kw["activation"] for _, kw in calls.calls] == ["gelu", "gelu"]
    assert_within_eager_error(runs["ours"], runs["eager"], runs["exact"], dtype=torch.bfloat16)


def test_register_checks_the_lane():
    with pytest.raises(ValueError, match="lane: expected one of"):
        lanekit_moe.register(lane="cuda")
    lanekit_moe.register(lane="reference")
    lanekit_moe.register(lane="reference")                                # again: harmless
    assert lanekit_moe.LANE == "reference"
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert ALL_EXPERTS_FUNCTIONS["lanekit"] is lanekit_moe.experts_forward


def test_tiny_moe_checks_the_family():
    with pytest.raises(ValueError, match="family: expected one of"):
        tiny_moe("deepseek")


# ---------------------------------------------------------------------------------------------
# the GPU: the Triton lane natively


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.gpu
@needs_gpu
def test_tiny_moe_logits_match_eager_on_the_gpu(family, dtype, monkeypatch):
    calls = FusedMoeCalls(monkeypatch)
    ids = prompt(device="cuda")
    routes, exact_routes = [], []
    ours = logits(lanekit_model(family, "triton", dtype, "cuda"), ids, routes)
    assert len(calls.calls) == 2                     # the experts ran on lanekit, not the model's own
    eager = logits(tiny_moe(family, dtype=dtype, device="cuda"), ids)
    exact = logits(tiny_moe(family, dtype=torch.float64, device="cuda"), ids, exact_routes)
    keep = same_routing(routes, exact_routes, ids.shape, dtype).to("cuda")
    assert keep.sum() >= keep.numel() // 2
    assert_within_eager_error(ours[keep], eager[keep], exact[keep], dtype=dtype)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.gpu
@needs_gpu
def test_fp16_greedy_generation_matches_eager_up_to_a_near_tie_on_the_gpu(family):
    # fp16 rather than bf16: 8 times finer, so that a near tie (of the logits, or of a router,
    # which the final logits' rule does not see) is rare within 24 tokens
    ids = prompt(n=5, batch=1, seed=8, device="cuda")
    kw = dict(GENERATE, max_new_tokens=24, min_new_tokens=24, output_logits=True, return_dict_in_generate=True)
    models = (lanekit_model(family, "triton", torch.float16, "cuda"),
              tiny_moe(family, dtype=torch.float16, device="cuda"))
    with torch.no_grad():
        ours, eager = (m.generate(ids, **kw) for m in models)
    assert_same_greedy_tokens(ours, eager, 5, torch.float16, models)


# ---------------------------------------------------------------------------------------------
# lanekit demo's MoE part


@pytest.mark.parametrize("lane", LANES)
def test_moe_demo_passes_and_prints_logits_and_tokens(lane, capsys):
    import io

    from rich.console import Console

    from lanekit import demo

    out = io.StringIO()
    skip_uninterpreted_triton_on_cpu(lane)
    result = demo.run_moe_demo(lane=lane, device="cpu", console=Console(file=out, width=200))
    assert result.ok and result.lane == lane and result.parted_at is None
    assert len(result.tokens) == demo.MOE_NEW_TOKENS and result.tokens == result.eager_tokens
    assert 0 < result.max_abs_diff and result.error <= 2 * result.eager_error
    text = out.getvalue()
    assert "PASS" in text and "largest |lanekit - eager|" in text and str(list(result.tokens)) in text
    assert lanekit_moe.LANE is None                                       # restored
    assert demo.main(["--only", "moe", "--lane", lane, "--device", "cpu"]) == 0
    assert "PASS: tokens match" in capsys.readouterr().out


class _Routed(torch.nn.Module):
    """A stand-in model for the demo's router check: one layer whose router returns the given
    (router_logits (S, E), ids (S, topk)) whatever the tokens."""

    def __init__(self, router_logits, ids):
        super().__init__()
        gate = torch.nn.Module()
        gate.forward = lambda x: (router_logits, None, ids)
        mlp = torch.nn.Module()
        mlp.gate = gate
        layer = torch.nn.Module()
        layer.mlp = mlp
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([layer])

    def forward(self, ids):
        return self.model.layers[0].mlp.gate(ids)


def test_moe_demo_tells_a_router_near_tie_from_a_routing_error():
    from lanekit import demo

    prefix = torch.zeros(1, 3, dtype=torch.long)
    logits = torch.tensor([[4.0, 3.0, 1.0, 0.0], [4.0, 2.0, 1.99, 0.0], [4.0, 3.0, 1.0, 0.0]])
    eager = _Routed(logits, torch.tensor([[0, 1], [0, 1], [0, 1]]))
    tie = _Routed(logits, torch.tensor([[0, 1], [0, 2], [0, 1]]))       # 2.0 vs 1.99: a tie in bf16
    wrong = _Routed(logits, torch.tensor([[0, 2], [0, 1], [0, 1]]))     # 3.0 vs 1.0: not a tie
    assert not demo._router_near_tie(eager, eager, prefix, torch.bfloat16)
    assert demo._router_near_tie(tie, eager, prefix, torch.bfloat16)
    assert not demo._router_near_tie(wrong, eager, prefix, torch.bfloat16)
    both = _Routed(logits, torch.tensor([[0, 2], [0, 2], [0, 1]]))      # the first one decides
    assert not demo._router_near_tie(both, eager, prefix, torch.bfloat16)
