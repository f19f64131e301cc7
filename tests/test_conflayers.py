"""ConfLayers: entropy confidence, the local adaptive threshold, keep-best, and losslessness."""

from types import SimpleNamespace

import pytest
import torch

from lossless import assert_greedy_lossless, assert_sampling_matches_target
from selfspec.drafters.layers import conflayers
from selfspec.core.draft import Draft
from selfspec.drafters.layers.conflayers import (
    ConfLayers,
    KeepBest,
    adapt_multiplier,
    layer_confidence,
    local_ratio,
    sublayer_confidence,
    threshold_skip,
)
from selfspec.model.skips import SkipSet
from selfspec.core.stats import GenerationStats
from tiny_models import ARCHS

D = 64


def test_concentrated_outputs_are_confident_and_diffuse_ones_are_not():
    g = torch.Generator().manual_seed(0)
    spike = torch.zeros(1, 3, D)
    spike[..., 5] = 4.0  # all energy in one dimension: entropy 0
    flat = torch.randint(0, 2, (1, 3, D), generator=g).float() * 2 - 1  # ±1: energy spread evenly
    few = torch.randn(1, 3, D, generator=g) * 0.01
    few[..., :4] += 3.0  # most energy in four dimensions
    gauss = torch.randn(1, 3, D, generator=g)
    conf = {name: float(sublayer_confidence(x)) for name, x in
            (("spike", spike), ("few", few), ("gauss", gauss), ("flat", flat))}
    assert conf["spike"] == pytest.approx(1.0) and conf["flat"] == pytest.approx(0.0, abs=1e-6)
    assert conf["spike"] > conf["few"] > conf["gauss"] > conf["flat"]
    # The shape of the update counts, not its size; an update of zero adds nothing.
    assert float(sublayer_confidence(1000 * gauss)) == pytest.approx(conf["gauss"], rel=1e-5)
    assert float(sublayer_confidence(torch.zeros(1, 2, D))) == 0.0
    # A layer scores the mean of its two sublayers.
    record = {("attn", 0): spike, ("mlp", 0): spike, ("attn", 1): flat, ("mlp", 1): spike,
              ("attn", 2): flat, ("mlp", 2): flat}
    s = layer_confidence(record, 3)
    assert s[0] > s[1] > s[2] and float(s[1]) == pytest.approx(0.5, abs=1e-5)


def test_the_threshold_is_local_and_spares_the_ends():
    # Confidence rises with depth; layer 5 dips against its neighbours though it beats layers 0-3.
    scores = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.45, 0.7, 0.8, 0.9, 1.0])
    ratios = local_ratio(scores, radius=2)
    assert threshold_skip(ratios, 0.95).skipped_layers() == {5}
    assert torch.allclose(local_ratio(torch.linspace(0.1, 1.0, 10)), torch.ones(10))  # a trend alone skips nothing
    # The first and last layers are never skipped, however low they score.
    ends = torch.tensor([0.01, 1.0, 1.0, 1.0, 1.0, 0.01])
    assert threshold_skip(ends, 0.5) == SkipSet() and threshold_skip(ends, 100.0).skipped_layers() == {1, 2, 3, 4}


def test_the_multiplier_moves_the_skipped_fraction_into_the_band():
    n = 20
    ratios = torch.linspace(0.5, 1.5, n)[torch.randperm(n, generator=torch.Generator().manual_seed(1))]

    def fraction(m):
        return len(threshold_skip(ratios, m).skipped_layers()) / n

    assert fraction(0.4) == 0  # too few skipped: m must rise
    up = adapt_multiplier(ratios, 0.4, target=0.4, band=0.05)
    assert up > 0.4 and 0.35 <= fraction(up) <= 0.45
    assert fraction(3.0) == 0.9  # too many: m must fall
    down = adapt_multiplier(ratios, 3.0, target=0.4, band=0.05)
    assert down < 3.0 and 0.35 <= fraction(down) <= 0.45
    assert adapt_multiplier(ratios, up, target=0.4, band=0.05) == up  # in the band: it stays
    # Six layers: no count lands in 0.4 ± 0.05, so it settles on the nearer side (2 of 6).
    six = torch.tensor([1.0, 0.7, 0.8, 0.9, 1.1, 1.0])
    m = adapt_multiplier(local_ratio(six), 0.5, target=0.4, band=0.05)
    assert len(threshold_skip(local_ratio(six), m).skipped_layers()) == 2


def test_keep_best_reverts_after_a_worse_candidate(monkeypatch):
    a, b, c = SkipSet.layers([1, 2]), SkipSet.layers([3, 4]), SkipSet.layers([2])
    candidates = iter([a, b, c])
    drafter = ConfLayers(draft_len=4, every=2)
    monkeypatch.setattr(drafter, "_search", lambda: next(candidates))
    monkeypatch.setattr(conflayers, "draft_shallow", lambda ctx, skip, pending, start, gamma, threshold:
                        Draft(tokens=torch.zeros(gamma, dtype=torch.long)))
    stats = GenerationStats(method="conflayers")
    drafter.begin(SimpleNamespace(stats=stats, adapter=SimpleNamespace(device=torch.device("cpu"))))
    pending = torch.zeros(1, dtype=torch.long)

    def period(*accepted):
        used = []
        for n in accepted:
            drafter.propose(pending, 0, 8)
            used.append(drafter.skip)
            drafter.observe(n)
        assert len(set(used)) == 1
        return used[0]

    assert period(3, 3) == a  # first search; mean accepted length 4
    assert period(0, 1) == b  # A was the best so far: re-optimise, B on trial (1.5, worse)
    assert period(2, 2) == a and stats.searches == 2  # revert to A without a probe; A re-measured (3)
    assert period(3, 3) == c and stats.searches == 3  # the best refreshed: re-optimise again
    assert drafter.keep.best == a and drafter.keep.best_score == 3
    keep = KeepBest()
    assert keep.close(b, 2.0) is None and keep.close(a, 2.0) is None and keep.best == a  # ties adopt


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_conflayers_equals_ar(arch, tiny):
    out = assert_greedy_lossless(tiny(arch), n=30, method="conflayers", every=2)
    assert out.stats.searches > 0 and out.stats.drafted > 0 and out.stats.method == "conflayers"


def test_greedy_conflayers_options_equal_ar(tiny):
    model = tiny("llama")
    for options in (dict(method="conflayers", threshold=0, skip_ratio=0.6, every=1),
                    dict(method="conflayers", draft_len=3, skip_ratio=0),
                    dict(drafter=ConfLayers(every=3, window=3, radius=1, band=0.2))):
        out = assert_greedy_lossless(model, n=25, **options)
        assert out.stats.searches > 0
    with pytest.raises(ValueError, match="skip_ratio"):
        ConfLayers(skip_ratio=1.0)


def test_sampled_conflayers_follows_the_target_distribution(tiny):
    accepted = assert_sampling_matches_target(tiny("llama"), trials=1000, method="conflayers", draft_len=3,
                                              threshold=0, skip_ratio=0.2, every=2)
    assert accepted > 0
