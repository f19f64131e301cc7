"""The verify clock (seconds by row count) and the payoff cut of suffix drafts."""

import pytest

from selfspec.core.verify_clock import VerifyClock, clock_for
from selfspec.drafters.draft_length import DraftLength
from selfspec.drafters.suffix import SuffixDraft, SuffixStore


def test_the_clock_interpolates_and_extrapolates_what_it_has_not_measured():
    clock = VerifyClock(momentum=0.5)
    assert clock.estimate(3) is None
    clock.add(1, 1.0)
    assert clock.estimate(5) == 1.0  # one point: flat
    clock.add(3, 2.0)
    assert clock.estimate(2) == pytest.approx(1.5)
    assert clock.estimate(5) == pytest.approx(3.0)  # along the last two
    clock.add(3, 4.0)  # smoothed: 0.5 · 2 + 0.5 · 4
    assert clock.estimate(3) == pytest.approx(3.0)
    clock.add(0, 5.0), clock.add(2, 0.0)  # no rows, no time: ignored
    assert sorted(clock.seconds) == [1, 3]


def test_a_draft_is_cut_where_its_doubtful_tail_costs_more_than_it_brings():
    steep, flat = VerifyClock(), VerifyClock()
    for rows in range(1, 9):
        steep.add(rows, 1.0 + 0.5 * (rows - 1))  # each row half a step: a 2-core CPU's int4 verify
        flat.add(rows, 1.0)  # rows are free: an AMX CPU or a GPU
    sure, doubtful = [1.0] * 6, [1.0, 0.5, 0.5, 0.5, 0.5, 0.5]
    assert DraftLength(steep).choose(sure) == 6 and DraftLength(flat).choose(doubtful) == 6
    assert 0 < DraftLength(steep).choose(doubtful) < 3
    assert DraftLength(VerifyClock()).choose(doubtful) == 6  # nothing timed yet: whole


def test_measured_rejections_lower_the_acceptance_and_so_the_length():
    clock = VerifyClock()
    for rows in range(1, 9):
        clock.add(rows, 1.0 + 0.3 * (rows - 1))
    length = DraftLength(clock)
    ratios = [1.0] * 6
    assert length.choose(ratios) == 6
    for _ in range(40):  # the store is sure, but only the first token is ever accepted
        length.learn(ratios, 1)
    assert length.acceptance(0) > 0.9 and length.acceptance(1) < 0.2 and length.acceptance(5) == 1.0  # never tried
    assert length.choose(ratios) == 1


def test_the_store_reports_each_tokens_share_of_agreeing_places():
    store = SuffixStore()
    for tail in ([5, 6, 7], [5, 6, 8], [5, 9, 9]):
        store.add([1, 2, 3, 4, *tail])
    ratios = []
    draft, match = store.draft([1, 2, 3, 4], max_len=8, min_prob=0.0, max_spec_factor=4.0, ratios=ratios)
    assert draft == [5, 6, 7] and match == 4
    assert ratios == pytest.approx([1.0, 2 / 3, 1 / 2])


def test_the_engine_times_lone_verifies_and_the_suffix_drafter_cuts_by_them(tiny):
    model = tiny("llama")
    store = SuffixStore()
    prompt = [3, 4, 5, 6, 7, 8, 9, 10] * 3
    ar = model.generate(prompt, method="ar", max_new_tokens=24)
    store.add(prompt + ar.tokens)
    out = model.generate(prompt, drafter=SuffixDraft(store, draft_len=8, payoff=True), max_new_tokens=24)
    assert out.tokens == ar.tokens
    clock = clock_for(model.adapter)
    assert clock.estimate(1) is not None and max(clock.seconds) > 1  # drafts were verified and timed
    whole = SuffixDraft(store, draft_len=8)  # the default: drafts whole
    proposed = []
    propose = whole.propose
    whole.propose = lambda *args: proposed.append(propose(*args)) or proposed[-1]
    assert model.generate(prompt, drafter=whole, max_new_tokens=24).tokens == ar.tokens
    assert max(len(d) for d in proposed) == 8  # not cut
    assert all(d.confidence is None for d in proposed)  # alone: no chances weighed (a batch's: test_batch)

