"""Prompt lookup's matching, and the lookup and hybrid drafters' losslessness."""

import pytest

from lossless import PROMPT, REPETITIVE, assert_greedy_lossless, assert_sampling_matches_target
from selfspec.drafters.layers.early_exit import EarlyExit
from selfspec.drafters.hybrid import Hybrid
from selfspec.drafters.lookup import PromptLookup, find_draft


def test_find_draft_prefers_the_longest_then_the_latest_match():
    # [2, 3] follows at 1..2 (-> 7 8); the 1-gram [3] is more recent (-> 6 2) but shorter.
    assert find_draft([5, 2, 3, 7, 8, 4, 3, 6, 2, 3], max_ngram=3, min_ngram=1, max_len=2) == [7, 8]
    # Two equal 2-gram matches: the most recent one's continuation.
    assert find_draft([1, 2, 10, 11, 1, 2, 20, 21, 1, 2], max_ngram=2, min_ngram=1, max_len=2) == [20, 21]
    # The longest n is capped by max_ngram: a 3-gram [9, 1, 2] match is ignored at max_ngram=2.
    tokens = [9, 1, 2, 30, 8, 1, 2, 40, 9, 1, 2]
    assert find_draft(tokens, max_ngram=3, min_ngram=1, max_len=1) == [30]
    assert find_draft(tokens, max_ngram=2, min_ngram=1, max_len=1) == [40]


def test_find_draft_no_match_and_limits():
    assert find_draft([1, 2, 3, 4], max_ngram=3, min_ngram=1, max_len=8) == []
    assert find_draft([], max_ngram=3, min_ngram=1, max_len=8) == []
    assert find_draft([7], max_ngram=3, min_ngram=1, max_len=8) == []
    assert find_draft([1, 2, 5, 1, 2], max_ngram=3, min_ngram=3, max_len=8) == []  # only a 2-gram
    tokens = list(range(20)) + [3]
    assert find_draft(tokens, max_ngram=3, min_ngram=1, max_len=5) == [4, 5, 6, 7, 8]
    assert find_draft(tokens, max_ngram=3, min_ngram=1, max_len=0) == []


def test_find_draft_repeats_a_loop_closer_than_the_draft_length():
    assert find_draft([1, 2, 3, 1, 2, 3, 1], max_ngram=3, min_ngram=1, max_len=7) == [2, 3, 1, 2, 3, 1, 2]
    assert find_draft([4, 4, 4], max_ngram=3, min_ngram=1, max_len=3) == [4, 4, 4]


def test_constructor_checks():
    with pytest.raises(ValueError, match="draft length"):
        PromptLookup(draft_len=0)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(ngram=2, min_ngram=3)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gemma3_text"])
def test_greedy_lookup_equals_ar(arch, tiny):
    model = tiny(arch)
    out = assert_greedy_lossless(model, REPETITIVE, method="lookup")
    assert out.stats.method == "lookup" and out.stats.exit_layer is None
    assert out.stats.accepted > 0
    assert_greedy_lossless(model, PROMPT, method="lookup", draft_len=3, ngram=2)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gemma3_text"])
def test_greedy_hybrid_equals_ar_and_uses_both_sources(arch, tiny):
    model = tiny(arch)
    for prompt in (REPETITIVE, PROMPT):
        out = assert_greedy_lossless(model, prompt, method="hybrid", exit_layer=3, draft_len=4)
        assert out.stats.method == "hybrid" and out.stats.exit_layer == 3
    # A drafter instance, to read which source drafted: lookup with 3-gram matches only, so the
    # repetitive prompt's start goes to lookup and novel stretches fall back to the model.
    hybrid = Hybrid(PromptLookup(draft_len=4, ngram=3, min_ngram=3), EarlyExit(3, 4), gate=False)
    out = assert_greedy_lossless(model, REPETITIVE, drafter=hybrid)
    assert hybrid.lookup_rounds > 0 and hybrid.model_rounds > 0
    assert hybrid.lookup_rounds + hybrid.model_rounds <= out.stats.rounds
    assert_greedy_lossless(model, PROMPT, drafter=hybrid)
    assert hybrid.lookup_rounds + hybrid.model_rounds > out.stats.rounds  # counts add up across runs


def test_hybrid_with_layer_skip_fallback(tiny):
    out = assert_greedy_lossless(tiny("llama"), REPETITIVE, method="hybrid", skip="2-4", draft_len=5)
    assert out.stats.exit_layer is None and out.stats.drafted > 0


# 600 trials each (not the default 2000) keep this file near a minute on a small shared CPU.
def test_sampled_lookup_follows_the_target_distribution(tiny):
    accepted = assert_sampling_matches_target(tiny("llama"), prompt=REPETITIVE, trials=600, method="lookup")
    assert accepted > 0


def test_sampled_hybrid_follows_the_target_distribution(tiny):
    hybrid = Hybrid(PromptLookup(draft_len=3), EarlyExit(3, 3), gate=False)
    accepted = assert_sampling_matches_target(tiny("llama"), prompt=REPETITIVE, trials=600, drafter=hybrid)
    assert accepted > 0 and hybrid.lookup_rounds > 0 and hybrid.model_rounds > 0


def test_payoff_gate_turns_a_slow_fallback_off_and_retries_it():
    from selfspec.drafters.hybrid import PayoffGate

    gate = PayoffGate(retry_every=4)
    assert gate.worth_it(0.1)  # nothing measured yet
    gate.update(tokens=1, seconds=0.3)  # 3.3 tokens/s against AR's 10
    decisions = [gate.worth_it(0.1) for _ in range(8)]
    assert decisions == [False, False, False, True, False, False, False, True]
    fast = PayoffGate()
    fast.update(tokens=4, seconds=0.2)  # 20 tokens/s
    assert all(fast.worth_it(0.1) for _ in range(5))


def test_hybrid_skips_a_fallback_slower_than_ar(tiny):
    import time

    class Slow(EarlyExit):
        def propose(self, *args):
            time.sleep(0.05)  # far slower than a tiny model's full step
            return super().propose(*args)

    model = tiny("llama")
    gated = Hybrid(PromptLookup(draft_len=4, min_ngram=3), Slow(3, 4))
    out = assert_greedy_lossless(model, PROMPT, n=40, drafter=gated)
    assert gated.model_rounds <= 1 + out.stats.rounds // 16 + 1
    ungated = Hybrid(PromptLookup(draft_len=4, min_ngram=3), Slow(3, 4), gate=False)
    out = assert_greedy_lossless(model, PROMPT, n=40, drafter=ungated)
    assert ungated.model_rounds > gated.model_rounds


def test_hybrid_skips_lookup_drafts_slower_than_ar(tiny):
    import time

    class SlowLookup(PromptLookup):
        def propose(self, *args):
            draft = super().propose(*args)
            if len(draft):
                time.sleep(0.05)
            return draft

    model = tiny("llama")
    gated = Hybrid(SlowLookup(draft_len=4), EarlyExit(3, 4))
    out = assert_greedy_lossless(model, REPETITIVE, n=40, drafter=gated)
    assert 1 <= gated.lookup_rounds <= 1 + out.stats.rounds // 16 + 1
