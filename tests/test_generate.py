"""Greedy generation of a real transformers model (tiny random-weight Llama with GQA) on lanekit:
prefill of packed prompts of different lengths through flash_attn_varlen_func, decode through
flash_attn_with_kvcache on a paged cache, the same tokens as transformers' eager generate."""

import pytest
import torch

pytest.importorskip("transformers")

from lanekit.integrations import generate
from lanekit.integrations.generate import eager_generate, greedy_generate, random_prompts, tiny_llama

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def model():
    # on the GPU when there is one: the Triton lane runs natively there (interpreted on a CPU)
    return tiny_llama(device="cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def expected(model):
    prompts = random_prompts((5, 11, 2))
    tokens = eager_generate(model, prompts, NEW_TOKENS)
    assert all(len(set(t)) > 16 for t in tokens), "the fixture's continuations should vary"
    return prompts, tokens


@pytest.mark.parametrize("lane", ["reference", "triton"])
def test_greedy_tokens_equal_eager_generate(model, expected, lane, monkeypatch):
    prompts, tokens = expected
    calls = {"varlen": 0, "kvcache": 0}
    for name, key in (("flash_attn_varlen_func", "varlen"), ("flash_attn_with_kvcache", "kvcache")):
        real = getattr(generate, name)

        def counted(*args, real=real, key=key, **kw):
            calls[key] += 1
            assert kw["lane"] == lane
            return real(*args, **kw)

        monkeypatch.setattr(generate, name, counted)
    ours = greedy_generate(model, prompts, NEW_TOKENS, page_size=4, lane=lane)
    assert ours == tokens
    layers = model.config.num_hidden_layers
    assert calls == {"varlen": layers, "kvcache": layers * (NEW_TOKENS - 1)}


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_greedy_tokens_do_not_depend_on_page_size(model, expected, page_size):
    prompts, tokens = expected
    assert greedy_generate(model, prompts, 8, page_size=page_size, lane="reference") == [t[:8] for t in tokens]


def test_one_new_token_is_prefill_only(model, expected):
    prompts, tokens = expected
    assert greedy_generate(model, prompts, 1, lane="reference") == [t[:1] for t in tokens]


@pytest.mark.parametrize("prompts, n, match", [([], 4, "prompts"), ([[1], []], 4, "prompts"),
                                               ([[1, 2]], 0, "max_new_tokens")])
def test_bad_arguments_are_rejected(model, prompts, n, match):
    with pytest.raises(ValueError, match=match):
        greedy_generate(model, prompts, n)


def test_demo_generation_part_matches_and_prints_the_verdict(capsys):
    from lanekit import demo

    result = demo.run_generation_demo(lane="reference", device="cpu")
    assert result.ok and result.matches == (True,) * len(demo.GENERATION_PROMPT_LENGTHS)
    assert result.tokens_per_s > 0 and result.eager_tokens_per_s > 0
    assert "tokens match: yes" in capsys.readouterr().out
