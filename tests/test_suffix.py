"""Suffix decoding: the store's matching, its bound, tenant isolation, and lossless drafting."""

import pytest

from lossless import REPETITIVE, assert_sampling_matches_target
from selfspec.drafters.suffix import Scoped, SuffixDraft, SuffixStore


ARCTIC = dict(max_spec_factor=1.0, max_spec_offset=0.0, seen_weight=0.0)  # one draft token per matched token


def test_it_drafts_the_continuation_of_the_longest_match_across_sequences():
    store = SuffixStore()
    store.add([1, 2, 3, 4, 5, 6, 7, 8])
    store.add([9, 3, 4, 10, 11])
    draft, match = store.draft([0, 2, 3, 4], max_len=8, **ARCTIC)
    assert (draft, match) == ([5, 6, 7], 3)  # 2 3 4 matches the first sequence; one token per matched one
    draft, match = store.draft([0, 2, 3, 4], max_len=2)
    assert draft == [5, 6]
    assert store.draft([7, 7, 7], max_len=8) == ([], 0)


def test_the_most_frequent_continuation_wins_and_low_confidence_stops_the_draft():
    store = SuffixStore()
    for tail in ([5, 6, 7], [5, 6, 8], [5, 9, 9]):
        store.add([1, 2, 3, 4] + tail)
    assert store.draft([1, 2, 3, 4], max_len=8, min_prob=0.9)[0] == [5]  # then 6: 2 of 3, confidence 0.67
    assert store.draft([1, 2, 3, 4], max_len=8, min_prob=0.6)[0] == [5, 6]  # then 7: 1 of 2, 0.67 · 0.5
    assert store.draft([1, 2, 3, 4], max_len=8, min_prob=0.3)[0] == [5, 6, 7]  # then no continuation


def test_the_allowance_grows_with_the_match_and_how_often_the_continuation_was_seen():
    store = SuffixStore()
    store.add(list(range(1, 13)))
    assert store.draft([0, 2, 3, 4], 16, **ARCTIC)[0] == [5, 6, 7]  # a match of 3
    assert store.draft([1, 2, 3, 4], 16, **ARCTIC)[0] == [5, 6, 7, 8]  # a match of 4
    assert store.draft([0, 2, 3, 4], 16, **{**ARCTIC, "max_spec_factor": 2.0})[0] == list(range(5, 11))
    assert store.draft([0, 2, 3, 4], 16, **{**ARCTIC, "max_spec_offset": 2.0})[0] == list(range(5, 10))
    store.add([0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13])  # the same continuation after another 2 3 4
    assert store.draft([9, 2, 3, 4], 16, **ARCTIC)[0] == [5, 6, 7]
    assert store.draft([9, 2, 3, 4], 16, **{**ARCTIC, "seen_weight": 2.0})[0] == [5, 6, 7, 8, 9]  # seen twice: 3 + 2
    assert len(store.draft([9, 2, 3, 4], 4, max_spec_factor=8.0, seen_weight=8.0)[0]) == 4  # never past max_len


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
    store = SuffixStore()
    a, b, shared = Scoped(store, "key-a"), Scoped(store, "key-b"), Scoped(store)
    a.add([1, 2, 3, 4, 5, 6])
    assert a.draft([1, 2, 3], 4)[0] == [4, 5, 6]
    assert b.draft([1, 2, 3], 4) == ([], 0) and shared.draft([1, 2, 3], 4) == ([], 0)
    assert store.draft([1, 2, 3], 4) == ([], 0)  # the store's own calls are the shared tenant's
    b.add([1, 2, 3, 7, 8, 9])
    assert a.draft([1, 2, 3], 4)[0] == [4, 5, 6] and b.draft([1, 2, 3], 4)[0] == [7, 8, 9]
    assert store.sequences_of("key-a") == store.sequences_of("key-b") == 1


def test_one_budget_over_every_tenant_evicts_the_oldest_text_whoever_sent_it():
    store = SuffixStore(max_tokens=30)
    for i, tenant in enumerate(["a", "b", "c", "d"]):  # 12 tokens each: 11 places indexed
        Scoped(store, tenant).add(list(range(100 * (i + 1), 100 * (i + 1) + 12)))
    assert store.tokens <= 30 and store.sequences == 2
    assert store.sequences_of("a") == store.sequences_of("b") == 0
    assert Scoped(store, "a").draft([100, 101, 102], 4) == ([], 0)
    assert Scoped(store, "d").draft([400, 401, 402], 4)[0] == [403, 404, 405]  # as long as the match
    assert not any(key[0] in ("a", "b") for key in store._index)  # their places went with them


@pytest.mark.parametrize("gamma", [1, 3, 8, 16])
def test_greedy_suffix_decoding_equals_plain_decoding(tiny, gamma):
    model, store = tiny("llama"), SuffixStore()
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8]
    plain = model.generate(prompt, method="ar", max_new_tokens=40)
    first = model.generate(prompt, drafter=SuffixDraft(store, draft_len=gamma), max_new_tokens=40)
    again = model.generate(prompt, drafter=SuffixDraft(store, draft_len=gamma), max_new_tokens=40)
    assert first.tokens == plain.tokens and again.tokens == plain.tokens
    eager = SuffixDraft(store, draft_len=gamma, max_spec_factor=4.0, max_spec_offset=8.0, seen_weight=4.0, min_prob=0.0)
    long = model.generate(prompt, drafter=eager, max_new_tokens=40)
    assert long.tokens == plain.tokens and len(long.stats.drafted_at) <= gamma  # the allowance never passes γ
    assert again.stats.accepted > first.stats.accepted  # the second answer drafts from the first
    if gamma >= 8:
        assert again.stats.accepted >= 30  # most of the repeated answer came from the store


def test_sampled_suffix_decoding_follows_the_target_distribution(tiny):
    store = SuffixStore()
    store.add(list(REPETITIVE) * 2)
    accepted = assert_sampling_matches_target(tiny("llama"), prompt=REPETITIVE, trials=600,
                                              drafter=SuffixDraft(store, draft_len=4))
    assert accepted > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_exact_mode_is_exact_at_any_draft_length_where_the_fused_layer_runs(arch):
    """Exact mode verifies γ + 1 rows unpadded where each row's arithmetic is its own (the fused
    layer; more than 16 rows in calls of 16), so greedy output equals plain decoding in the same mode
    for every γ from 1 to 16, and beyond (24, 40); early exit's verify (layers k.. over the draft,
    its KV reused) too."""
    import torch
    from tiny_models import tiny_model

    import selfspec

    model = selfspec.SelfSpecModel(tiny_model(arch, 0, dtype=torch.bfloat16), exact=True)
    if model.exact_rows() < 16:
        pytest.skip("the fused layer does not run here: exact mode keeps its padded 4-row bucket")
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8, 9]
    plain = model.generate(prompt, method="ar", max_new_tokens=48)
    longest = 0
    for gamma in (*range(1, 17), 24, 40):
        for method in ("lookup", "suffix"):
            out = model.generate(prompt, method=method, draft_len=gamma, max_new_tokens=48)
            assert out.tokens == plain.tokens, (method, gamma)
            longest = max(longest, len(out.stats.drafted_at))
    assert out.stats.accepted > 0 and longest > 16  # verifies of more than one call's rows ran
    for gamma in (7, 20):
        out = model.generate(prompt, method="early-exit", exit_layer=1, draft_len=gamma, threshold=0.0,
                             max_new_tokens=48)
        assert out.tokens == plain.tokens, gamma


def test_the_server_drafts_from_earlier_requests_and_keeps_users_apart():
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    from serving import Running, tiny_served

    from selfspec.core.speculation import Speculation

    for scope in ("shared", "user"):
        model = tiny_served()
        running = Running(model, speculation=Speculation("suffix", draft_len=8), suffix_scope=scope)
        try:
            body = {"model": running.name, "prompt": "w5 w6 w7 w8 w9", "max_tokens": 40, "temperature": 0}
            first = httpx.post(running.url + "/v1/completions", json={**body, "user": "a"}, timeout=60).json()
            second = httpx.post(running.url + "/v1/completions", json={**body, "user": "b"}, timeout=60).json()
            alone = model.generate("w5 w6 w7 w8 w9", method="ar", max_new_tokens=40, chat=False).text
            assert first["choices"][0]["text"] == second["choices"][0]["text"] == alone
            drafted_from_a = second["usage"]["selfspec"]["accepted"] > first["usage"]["selfspec"]["accepted"]
            stores = model.suffix_stores()
            assert len(stores) == 1 and stores[0].sequences == 2  # one store, one budget
            if scope == "shared":
                assert drafted_from_a
            else:  # b drafted from its own text alone: as a did, with nothing before it
                assert not drafted_from_a
                assert stores[0].sequences_of(("user", "a")) == stores[0].sequences_of(("user", "b")) == 1
            metrics = httpx.get(running.url + "/metrics").text
            assert "selfspec_suffix_store_tokens" in metrics and "selfspec_suffix_store_tokens 0.0" not in metrics
        finally:
            running.close()


@pytest.mark.real
def test_suffix_with_the_feature_head_equals_plain_decoding_on_smollm2(smollm2):
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox"
    plain = smollm2.generate(prompt, method="ar", max_new_tokens=32)
    smollm2.reset_suffix_stores()
    first = smollm2.generate(prompt, method="suffix", max_new_tokens=32)
    again = smollm2.generate(prompt, method="suffix", max_new_tokens=32)
    assert first.tokens == plain.tokens and again.tokens == plain.tokens
    assert again.stats.method == "suffix" and again.stats.accepted > first.stats.accepted
