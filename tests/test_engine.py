"""Losslessness on tiny random models of every supported architecture."""

import pytest
import torch

from selfspec.model.adapter import ModelAdapter, UnsupportedModelError
from lossless import assert_adapter_matches_transformers, assert_sampling_matches_target
from tiny_models import ARCHS, VOCAB, tiny_model

PROMPT = [5, 17, 33, 2 + 1, 60, 71, 8, 90, 41]


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_logits_match_transformers_forward(arch):
    model = tiny_model(arch)
    assert_adapter_matches_transformers(model, ModelAdapter(model))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_early_exit_equals_ar_equals_transformers(arch, tiny):
    model = tiny(arch)
    n = 40
    ar = model.generate(PROMPT, method="ar", max_new_tokens=n)
    assert ar.tokens == hf_greedy(model, PROMPT, n)
    assert ar.stats.drafted == 0 and ar.stats.mean_accepted_length == 1.0
    for k in (1, 3, 5):
        for gamma in (1, 3, 7):
            out = model.generate(PROMPT, method="early-exit", exit_layer=k, draft_len=gamma, max_new_tokens=n)
            assert out.tokens == ar.tokens, (k, gamma)
            assert out.stats.drafted > 0 and out.stats.exit_layer == k and out.stats.draft_len == gamma


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_full_depth_draft_accepts_everything(arch, tiny):
    model = tiny(arch)
    out = model.generate(PROMPT, exit_layer=model.n_layers, draft_len=4, max_new_tokens=31)
    assert out.stats.alpha == 1.0
    assert out.stats.acceptance_by_position == [1.0] * 4
    assert out.stats.mean_accepted_length == 5.0  # γ accepted + the bonus token, every round
    assert len(out.tokens) == 31


def test_shallow_draft_gets_rejected_and_stats_add_up(tiny):
    model = tiny("llama")
    out = model.generate(PROMPT, exit_layer=1, draft_len=4, max_new_tokens=40)
    s = out.stats
    assert s.alpha < 1.0  # rejections happened, so the rewind path ran
    assert 1 + s.accepted + s.rounds == s.new_tokens == 40  # prefill's token + per round accepted + 1
    assert s.rounds - 1 <= s.drafted_at[0] <= s.rounds  # the last round may have no room to draft
    assert s.wall_s >= s.draft_s + s.verify_s > 0
    assert s.cost is not None and s.cost > 0


def test_max_new_tokens_is_exact_for_every_draft_length(tiny):
    model = tiny("qwen3")
    for n in (1, 2, 5, 9):
        for gamma in (1, 4, 8):
            assert len(model.generate(PROMPT, exit_layer=2, draft_len=gamma, max_new_tokens=n).tokens) == n


def test_eos_stops_and_is_not_returned(tiny):
    model = tiny("llama")
    ar = model.generate(PROMPT, method="ar", max_new_tokens=30).tokens
    eos = ar[12]
    first = ar.index(eos)
    model.hf_model.generation_config.eos_token_id = eos
    try:
        for method, k, g in (("ar", None, None), ("early-exit", 2, 5), ("early-exit", 6, 5)):
            out = model.generate(PROMPT, method=method, exit_layer=k, draft_len=g, max_new_tokens=30)
            assert out.tokens == ar[:first]
    finally:
        model.hf_model.generation_config.eos_token_id = None


def test_stream_yields_the_same_tokens_as_generate(tiny):
    model = tiny("mistral")
    stream = model.stream(PROMPT, exit_layer=3, draft_len=3, max_new_tokens=25)
    chunks = [c.tokens for c in stream]
    assert len(chunks) > 1
    assert sum(chunks, []) == stream.result.tokens == model.generate(PROMPT, method="ar", max_new_tokens=25).tokens


def test_bfloat16_early_exit_equals_bfloat16_ar():
    import selfspec

    model = selfspec.SelfSpecModel(tiny_model("llama", dtype=torch.bfloat16))
    ar = model.generate(PROMPT, method="ar", max_new_tokens=30)
    for k in (2, 4):
        assert model.generate(PROMPT, exit_layer=k, draft_len=4, max_new_tokens=30).tokens == ar.tokens


def test_sampled_early_exit_follows_the_target_distribution(tiny):
    """The second generated token's marginal, under speculative sampling with a shallow draft,
    must match the exact marginal of sampling the full model token by token."""
    accepted = assert_sampling_matches_target(tiny("llama"), PROMPT, method="early-exit", exit_layer=1, draft_len=3)
    assert accepted > 0  # drafts were accepted sometimes, so the accept path shaped the sample


def test_unsupported_architecture_is_refused_by_name():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="gpt2.*supported: .*llama"):
        ModelAdapter(model)


def test_bad_token_ids_and_empty_prompt_are_refused(tiny):
    model = tiny("llama")
    with pytest.raises(ValueError, match="token ids must be in 0..95"):
        model.generate([1, 2, VOCAB])
    with pytest.raises(ValueError, match="empty"):
        model.generate([])
    with pytest.raises(ValueError, match="no tokenizer"):
        model.generate("text needs a tokenizer")


def test_merged_stats_aggregate_alpha_and_cost_over_generations():
    from selfspec.core.stats import GenerationStats

    a = GenerationStats("early-exit", 2, 3, new_tokens=10, rounds=4, drafted=12, accepted=6, draft_s=1.2, step_s=0.2)
    a.drafted_at, a.accepted_at = [4, 4, 4], [3, 2, 1]
    b = GenerationStats("early-exit", 2, 3, new_tokens=5, rounds=2, drafted=4, accepted=1, draft_s=0.8, step_s=0.4)
    b.drafted_at, b.accepted_at = [2, 2], [1, 0]
    total = GenerationStats("early-exit", 2, 3)
    total.merge(a)
    total.merge(b)
    assert total.alpha == 7 / 16
    assert total.mean_accepted_length == (7 + 6) / 6
    assert total.drafted_at == [6, 6, 4] and total.accepted_at == [4, 2, 1]
    # c = all draft time / what the same 16 tokens would cost at full depth (12·0.2 + 4·0.4)
    assert abs(total.cost - 2.0 / (12 * 0.2 + 4 * 0.4)) < 1e-12


def test_step_probe_waits_until_c_is_read_and_runs_once(tiny, monkeypatch):
    """The step c divides by is not measured before the first token: the probe runs when c is
    first read, in a scratch cache, once per context bucket; a gated hybrid still measures it first."""
    import json

    from selfspec.core import engine
    from selfspec.drafters.layers.early_exit import EarlyExit
    from selfspec.drafters.hybrid import Hybrid
    from selfspec.drafters.lookup import PromptLookup

    model = tiny("llama")
    calls = []
    real = engine.measure_step_time
    monkeypatch.setattr(engine, "measure_step_time", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    engine._STEP_TIMES.pop(model.adapter, None)
    out = model.generate(PROMPT, method="early-exit", exit_layer=2, draft_len=3, max_new_tokens=12)
    assert calls == [] and out.stats.step_s is None and out.stats.step_probe is not None
    assert out.stats.cost is not None and out.stats.cost > 0 and calls == [len(PROMPT)]
    assert out.stats.step_probe is None and out.stats.step_s > 0
    json.dumps(out.stats.to_dict())  # no probe left in what is reported
    again = model.generate(PROMPT, method="early-exit", exit_layer=2, draft_len=3, max_new_tokens=12)
    assert again.tokens == out.tokens and again.stats.cost is not None and calls == [len(PROMPT)]  # cached
    ar = model.generate(PROMPT, method="ar", max_new_tokens=12)
    assert ar.stats.step_probe is None and ar.tokens == out.tokens  # AR drafts nothing: no probe at all

    engine._STEP_TIMES.pop(model.adapter, None)
    gated = Hybrid(PromptLookup(draft_len=3), EarlyExit(2, 3), gate=True)
    out = model.generate(PROMPT, drafter=gated, max_new_tokens=12)
    assert out.stats.step_s is not None and out.stats.step_probe is None  # measured before decoding
    assert out.tokens == ar.tokens and calls == [len(PROMPT), len(PROMPT)]


def test_merged_stats_run_pending_step_probes():
    from selfspec.core.stats import GenerationStats

    a = GenerationStats("early-exit", 2, 3, drafted=4, draft_s=0.4, step_probe=lambda: 0.5)
    total = GenerationStats("early-exit", 2, 3)
    total.merge(a)
    assert a.step_s == 0.5 and a.step_probe is None and total.cost == 0.4 / 4 / 0.5
