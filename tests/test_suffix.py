"""Suffix decoding: the store's matching, its bound, tenant isolation, and lossless drafting."""

import pytest

from lossless import REPETITIVE, assert_sampling_matches_target
from selfspec.drafters.suffix import SuffixDraft, SuffixStore, store_for


def test_it_drafts_the_continuation_of_the_longest_match_across_sequences():
    store = SuffixStore()
    store.add([1, 2, 3, 4, 5, 6, 7, 8])
    store.add([9, 3, 4, 10, 11])
    draft, match = store.draft([0, 2, 3, 4], max_len=8)
    assert (draft, match) == ([5, 6, 7], 3)  # 2 3 4 matches the first sequence; one token per matched one
    draft, match = store.draft([0, 2, 3, 4], max_len=2)
    assert draft == [5, 6]
    assert store.draft([7, 7, 7], max_len=8) == ([], 0)


def test_the_most_frequent_continuation_wins_and_disagreement_stops_the_draft():
    store = SuffixStore()
    for tail in ([5, 6, 7], [5, 6, 8], [5, 9, 9]):
        store.add([1, 2, 3, 4] + tail)
    assert store.draft([1, 2, 3, 4], max_len=8, min_share=0.9)[0] == [5]  # then 6 has 2 of 3
    assert store.draft([1, 2, 3, 4], max_len=8, min_share=0.6)[0] == [5, 6]  # then 7 has 1 of 2
    assert store.draft([1, 2, 3, 4], max_len=8, min_share=0.5)[0] == [5, 6, 7]  # then no continuation


def test_a_growing_sequence_is_indexed_as_it_grows():
    store, live = SuffixStore(), [1, 2, 3]
    store.add(live)
    assert store.draft([1, 2, 3], 4) == ([], 0)
    live += [4, 5, 1, 2, 3]
    draft, match = store.draft(live, 4)
    assert draft == [4, 5, 1] and match == 3


def test_memory_is_bounded_and_the_oldest_goes_first():
    store = SuffixStore(max_tokens=20)
    store.add(list(range(100, 112)))
    store.add(list(range(200, 212)))
    store.draft([0, 0, 0], 4)  # refreshes: 24 tokens indexed > 20, the first sequence goes
    assert store.sequences == 1 and store.tokens <= 20
    assert store.draft([101, 102, 103], 4) == ([], 0)
    assert store.draft([201, 202, 203], 4)[0] == [204, 205, 206]
    assert all(sid != 0 for places in store._index.values() for sid, _ in places)


def test_tenants_never_see_each_others_text():
    a, b = store_for("m", "key-a"), store_for("m", "key-b")
    assert a is store_for("m", "key-a") and a is not b and a is not store_for("m")
    a.add([1, 2, 3, 4, 5, 6])
    assert a.draft([1, 2, 3], 4)[0] == [4, 5, 6]
    assert b.draft([1, 2, 3], 4) == ([], 0)


@pytest.mark.parametrize("gamma", [1, 3, 8, 16])
def test_greedy_suffix_decoding_equals_plain_decoding(tiny, gamma):
    model, store = tiny("llama"), SuffixStore()
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8]
    plain = model.generate(prompt, method="ar", max_new_tokens=40)
    first = model.generate(prompt, drafter=SuffixDraft(store, draft_len=gamma), max_new_tokens=40)
    again = model.generate(prompt, drafter=SuffixDraft(store, draft_len=gamma), max_new_tokens=40)
    assert first.tokens == plain.tokens and again.tokens == plain.tokens
    assert again.stats.accepted > first.stats.accepted  # the second answer drafts from the first
    if gamma >= 8:
        assert again.stats.accepted >= 30  # most of the repeated answer came from the store


def test_sampled_suffix_decoding_follows_the_target_distribution(tiny):
    store = SuffixStore()
    store.add(list(REPETITIVE) * 2)
    accepted = assert_sampling_matches_target(tiny("llama"), prompt=REPETITIVE, trials=600,
                                              drafter=SuffixDraft(store, draft_len=4))
    assert accepted > 0
