"""CLaSp: the layer DP against constructed optima, and the drafter's losslessness."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from lossless import assert_greedy_lossless, assert_sampling_matches_target
from selfspec.drafters.layers.clasp import Clasp, plan_skips
from selfspec.model.skips import SkipSet
from tiny_models import ARCHS


def counted(layer):
    """Wrap a run_layer(i, states) and count its calls, to check one call per layer."""
    def run(i, states):
        run.calls += 1
        return layer(i, states)

    run.calls = 0
    return run


def test_dp_skips_the_layers_that_do_nothing():
    """Residual layers h + tanh(W_i h), W_i = 0 for three of them: skipping exactly those keeps the
    full trajectory (cosine 1); any other 3-subset leaves it."""
    n, hidden, identity = 8, 16, {2, 3, 6}
    g = torch.Generator().manual_seed(0)
    weights = [torch.zeros(hidden, hidden) if i in identity else torch.randn(hidden, hidden, generator=g) * 0.5
               for i in range(n)]
    run = counted(lambda i, states: states + torch.tanh(states @ weights[i]))
    skip = plan_skips(run, torch.randn(1, 1, hidden, generator=g), n, len(identity))
    assert skip == SkipSet.layers(identity)
    assert run.calls == n


@pytest.mark.parametrize("seed", range(5))
def test_dp_matches_brute_force_on_additive_layers(seed):
    """Layer i adds c_i·e_i (orthonormal e_i, h0 orthogonal to them): the skipped forward's final
    cosine is sqrt((|h0|² + Σ kept c²) / (|h0|² + Σ c²)), so the DP, which here is exact, must
    find the best of all C(L, M) subsets; with layer 0 and L-1 pinned it must avoid them."""
    n, m = 7, 3
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(n + 1, n + 1, generator=g))[0]  # orthonormal columns
    h0, directions = basis[:, :1].T * 0.5, basis[:, 1:].T  # [1, n+1], [n, n+1]
    scale = torch.rand(n, generator=g) * 2 + 0.1  # c_i, distinct with probability 1
    scale[0] = scale[-1] = 0.01  # the cheapest to skip, unless pinned

    def layer(i, states):  # [b, n+1]
        return states + scale[i] * directions[i]

    def final_cosine(skipped):
        h = h0
        for i in range(n):
            if i not in skipped:
                h = layer(i, h)
        full = h0 + (scale[:, None] * directions).sum(0)
        return float(F.cosine_similarity(h, full))

    for allowed in (range(n), range(1, n - 1)):
        best = max(itertools.combinations(allowed, m), key=final_cosine)
        run = counted(layer)
        assert plan_skips(run, h0, n, m, allowed) == SkipSet.layers(best)
        assert run.calls == n
    assert plan_skips(layer, h0, n, 0) == SkipSet()
    assert plan_skips(layer, h0, n, 9, range(2, 4)) == SkipSet.layers([2, 3])  # M capped


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_clasp_equals_ar(arch, tiny):
    model = tiny(arch)
    out = assert_greedy_lossless(model, method="clasp", draft_len=4, threshold=0, every=2)
    assert out.stats.searches >= 3 and out.stats.search_s > 0
    assert out.stats.drafted > 0 and out.stats.method == "clasp"
    out = assert_greedy_lossless(model, method="clasp", draft_len=6, skip_ratio=0.5, every=1)  # default threshold
    assert out.stats.searches == out.stats.drafted_at[0]  # one DP per drafting round (the last may draft none)


def test_sampled_clasp_follows_the_target_distribution(tiny):
    """A DP every round; 500 trials keep this file near a minute on a shared CPU."""
    accepted = assert_sampling_matches_target(tiny("llama"), trials=500, method="clasp", draft_len=3,
                                              threshold=0, every=1)
    assert accepted > 0


def test_constructor_checks_and_plan_size(tiny):
    for bad in (dict(draft_len=0), dict(skip_ratio=1.0), dict(every=0)):
        with pytest.raises(ValueError):
            Clasp(**bad)
    model = tiny("llama")
    drafter = Clasp(skip_ratio=0.5)
    model.generate([5, 17, 33], drafter=drafter, max_new_tokens=4)
    assert len(drafter.skip.skipped_layers()) == 3 and drafter.skip.boundary(6) >= 1  # 0.5·6, not layer 0
    assert 5 not in drafter.skip.skipped_layers()
