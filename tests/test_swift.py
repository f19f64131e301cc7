"""SWIFT: the model-free layer-set search, matchness, and the drafter on tiny models."""

import pytest
import torch

from lossless import PROMPT, assert_greedy_lossless, assert_sampling_matches_target
from selfspec.core.draft import DraftContext
from selfspec.drafters.layers.swift import SkipSearch, Swift, matchness
from selfspec.core.sampling import SamplingParams
from selfspec.model.skips import SkipSet
from selfspec.core.stats import GenerationStats
from tiny_models import ARCHS


def run(search: SkipSearch, score) -> SkipSearch:
    """Drive a search to its stop rule with a constructed scoring function."""
    while not search.done:
        skip = search.propose()
        search.tell(skip, score(skip))
    return search


# -- the search alone ------------------------------------------------------------------------


def test_search_finds_a_hidden_set_within_its_budget():
    search = SkipSearch(8, every=10, budget=300, max_score=1.0, patience=None, seed=1)
    target = SkipSet(attn=frozenset({1, 4, 6}), mlp=frozenset({2, 3, 5, 6}))
    assert len(target) == search.n_skip == 7  # round(0.45 · 16)

    def overlap(skip):
        return (len(skip.attn & target.attn) + len(skip.mlp & target.mlp)) / len(target)

    run(search, overlap)
    assert search.best == target and search.best_score == 1.0
    assert search.iterations < 300  # stopped by the score, not the budget
    assert {t.source for t in search.history} == {"initial", "random", "bayes"}


def test_candidates_keep_the_skip_count_and_spare_the_first_and_last_layer():
    search = run(SkipSearch(10, every=5, budget=40, patience=None), lambda skip: 0.1)
    for trial in search.history:
        assert len(trial.skip) == search.n_skip == 9
        assert not {0, 9} & (trial.skip.attn | trial.skip.mlp)
    assert search.initial.skipped_layers() == {2, 4, 6, 8}  # whole layers spread, plus one attention
    assert len(search.initial.attn) == 5


def test_stop_rule_score_budget_and_patience():
    assert run(SkipSearch(8, max_score=0.9), lambda skip: 0.95).iterations == 1
    assert run(SkipSearch(8, budget=15, patience=None), lambda skip: 0.5).iterations == 15
    assert run(SkipSearch(8, budget=100, patience=5), lambda skip: 0.5).iterations == 6  # initial + 5
    assert SkipSearch(8, budget=0).done


@pytest.mark.parametrize("bad", [dict(skip_ratio=1.0), dict(every=-1), dict(patience=0), dict(draft_len=0)])
def test_bad_options_are_refused_at_construction(bad):
    with pytest.raises(ValueError):
        Swift(**bad)


def test_bayesian_proposal_every_n_iterations():
    search = run(SkipSearch(8, every=4, budget=13, patience=None), lambda skip: len(skip.attn) / 7)
    sources = [t.source for t in search.history]
    assert sources[0] == "initial"
    assert [i for i, s in enumerate(sources) if s == "bayes"] == [4, 8, 12]
    assert set(sources[1:4] + sources[5:8]) == {"random"}
    assert [t.source for t in run(SkipSearch(8, every=0, budget=9), lambda s: 0.1).history[1:]] == ["random"] * 8


def test_search_is_repeatable():
    def score(skip):
        return (sum(skip.attn) + 2 * sum(skip.mlp)) / 100

    a = run(SkipSearch(12, every=3, budget=20, seed=7), score)
    b = run(SkipSearch(12, every=3, budget=20, seed=7), score)
    assert a.history == b.history


# -- matchness -------------------------------------------------------------------------------


def test_matchness_of_the_full_model_on_its_own_greedy_output_is_one(tiny):
    model = tiny("llama")
    ids = PROMPT + model.generate(PROMPT, method="ar", max_new_tokens=20).tokens
    adapter = model.adapter
    cache = adapter.new_cache(len(ids))
    with torch.inference_mode():
        adapter.run_layers(adapter.embed(torch.tensor(ids[:-1])), range(adapter.n_layers), 0, cache)
        cache.rewind(len(ids) - 1)  # the last token is pending
        ctx = DraftContext(adapter, cache, SamplingParams(), None, torch.tensor(PROMPT), list(ids),
                           GenerationStats("swift"))
        keys = cache.keys.clone()
        assert matchness(ctx, SkipSet(), window=16) == 1.0  # all 16 targets are greedy outputs
        assert matchness(ctx, SkipSet(), window=64) < 1.0  # the prompt is not what the model predicts
        assert 0.0 <= matchness(ctx, SkipSet.layers([2, 3, 4]), window=16) < 1.0
        torch.testing.assert_close(cache.keys, keys, rtol=0, atol=0, equal_nan=True)  # empty slots may hold NaN
        assert cache.length == len(ids) - 1


# -- the drafter -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_swift_equals_ar_while_searching(arch, tiny):
    drafter = Swift(draft_len=4, threshold=0, budget=12, every=3, window=16)
    out = assert_greedy_lossless(tiny(arch), method="swift", drafter=drafter)
    assert out.stats.method == "swift" and out.stats.drafted > 0
    assert out.stats.searches == drafter.search.iterations > 3 and out.stats.search_s > 0
    assert drafter.skip != drafter.search.initial  # the search moved at least once


def test_greedy_swift_from_the_factory_with_its_defaults(tiny):
    model = tiny("qwen3")
    out = assert_greedy_lossless(model, method="swift")  # γ 25, threshold 0.8
    assert out.stats.searches > 0
    out = assert_greedy_lossless(model, method="swift", draft_len=3, threshold=0.5, skip_ratio=0.3, every=2)
    assert out.stats.searches > 0 and out.stats.draft_len == 3


def test_sampled_swift_follows_the_target_distribution(tiny):
    drafter = Swift(draft_len=3, threshold=0, budget=300, window=16)  # searches, then only drafts
    accepted = assert_sampling_matches_target(tiny("llama"), method="swift", drafter=drafter, trials=800)
    assert accepted > 0
    assert drafter.search.done


def test_search_carries_over_between_prompts_of_a_session(tiny):
    model = tiny("llama")
    options = dict(method="swift", draft_len=4, threshold=0, every=3, max_new_tokens=30)
    first = model.generate(PROMPT, **options)
    (drafter,) = model._drafters.values()
    learned, spent = drafter.skip, drafter.search.iterations
    assert spent == first.stats.searches > 0

    seen = []
    begin = drafter.begin
    drafter.begin = lambda ctx: (begin(ctx), seen.append((drafter.skip, drafter.search.iterations)))
    second = model.generate(PROMPT[::-1], **options)
    assert list(model._drafters.values()) == [drafter]
    assert seen == [(learned, spent)]  # not reset by begin
    assert drafter.search.iterations == spent + second.stats.searches
    assert drafter.search.history[spent].source != "initial"


def test_spent_budget_means_acceleration_only(tiny):
    model = tiny("mistral")
    drafter = Swift(draft_len=4, threshold=0, budget=5)
    first = assert_greedy_lossless(model, n=30, method="swift", drafter=drafter)
    assert first.stats.searches == 5 and drafter.search.done
    best = drafter.skip
    second = assert_greedy_lossless(model, n=30, method="swift", drafter=drafter)
    assert second.stats.searches == 0 and second.stats.search_s == 0 and drafter.skip == best
