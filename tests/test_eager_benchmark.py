"""The eager, training and generation benchmarks (benchmarks.eager, benchmarks.train,
benchmarks.generate) run on the GPU only in the lead's sessions: their plumbing runs here first, at
tiny shapes on the CPU with lanekit's reference lane: inputs, the check against the float64
oracle, each runner once, the work counts, the runner's registration and the report's rendering.
torch.compile is replaced by the function it compiles (no compiler here); Liger is left out (its
kernels take GPU tensors only), as the benchmarks leave it out where it is not installed. Nothing
is timed."""

import pytest
import torch

from benchmarks import eager, generate, layers, liger, report, run, train


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setenv("LANEKIT_LANE", "reference")
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(liger, "_functional", lambda: None)
    for module in (layers, train):
        for name, value in dict(TOKENS=24, HIDDEN=64, FFN=48, HQ=4, HKV=2, D=16).items():
            monkeypatch.setattr(module, name, value)
    for name, value in dict(ROWS=3, HIDDEN=64, FFN=48, S=5, HQ=4, HKV=2, D=16, DECODE_B=2, PAGE=4, PAGES=110).items():
        monkeypatch.setattr(eager, name, value)
    for name, value in dict(RNN_B=3, RNN_IN=16, RNN_H=8).items():
        monkeypatch.setattr(train, name, value)


def test_the_families_are_registered_and_grouped():
    for fam in ("eager", "layers_train", "layers_train_eager", "rnn_train", "rnn_train_eager", "generate"):
        assert fam in run.FAMILIES
    assert set(run.GROUPS["train"]) == set(train.FAMILIES)
    assert run.is_timed(eager) and run.is_rate(generate)
    assert not run.FAMILIES["layers_train_eager"].CUDA_GRAPHS and run.FAMILIES["layers_train"].CUDA_GRAPHS
    names = [eager.name(c) for c in eager.cases()]
    assert "flash_attn_with_kvcache paged eager" in names and "apply_rotary_qk eager" in names
    ops = {c["op"] for c in train.layer_cases()}
    assert {"rms_norm", "rms_norm+residual", "layer_norm", "adaln", "apply_rotary q", "apply_rotary_qk",
            "rms_norm_rope q,k", "swiglu", "geglu tanh"} <= ops


def _run_once(module, c, *inputs):
    error = module.check(c, *inputs)
    assert error is None, (module.name(c), error)
    fns = module.runners(c, *inputs)
    assert "lanekit" in fns
    for peer, fn in fns.items():
        fn()
    return sorted(fns)


def test_every_eager_case_checks_and_runs_on_the_cpu(tiny):
    for c in eager.cases():
        peers = _run_once(eager, c, *eager.make_inputs(c, device="cpu"))
        if c["op"] == "flash_attn_func":
            assert "sdpa" in peers
        if c["op"] == "rms_norm":
            assert "F.rms_norm" in peers


def test_every_training_case_checks_and_runs_on_the_cpu(tiny):
    for fam in ("layers_train", "rnn_train"):
        module = train.FAMILIES[fam]
        for c in module.cases(False):
            peers = _run_once(module, c, *module.make_inputs(c, device="cpu"))
            assert "torch.compile" in peers
            assert module.bytes_moved(c) > 0


def test_a_wrong_gradient_is_caught_by_the_training_check(tiny, monkeypatch):
    import lanekit.layers as L

    c = dict(op="rms_norm")
    inputs = train.layer_inputs(c, device="cpu")
    real = L.rms_norm
    monkeypatch.setattr(L, "rms_norm", lambda *a, **k: real(*a, **k) * 1.02)
    assert train.layer_check(c, *inputs) is not None


def test_generation_checks_and_runs_a_tiny_model_on_the_cpu(tiny, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(generate, "NEW", 3)
    c = next(generate.cases(quick=True))
    # fp32: a random tiny model's top logits nearly tie, and bf16 rounding flips some of them
    m, prompts = generate.make_inputs(c, "cpu", dtype=torch.float32, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, vocab_size=128)
    assert generate.check(c, m, prompts, new=2) is None
    outs = {peer: fn() for peer, fn in generate.runners(c, m, prompts).items()}
    assert sorted(outs) == ["hf lanekit", "hf sdpa", "lanekit"]
    assert all(len(o) == generate.B and all(len(t) == 3 for t in o) for o in outs.values())
    assert generate.tokens(c) == generate.B * 3


def test_tokens_per_second_rows_render_with_the_ratio_lanekit_over_peer():
    rows = [{"case": "gen", "error": None, "tok_s": {"lanekit": 300.0, "hf sdpa": 100.0}}]
    peers = report.peers_of(rows)
    assert report.header(peers, rows) == ["case", "lanekit tokens/s", "hf sdpa tokens/s", "vs hf sdpa"]
    assert report.row_cells(rows[0], peers) == ["gen", "300", "100", "3.00x"]
