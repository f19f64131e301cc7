"""The verifier: greedy prefix matching, and a statistical test that speculative sampling is exact.

The statistical tests run the batched `rejection_sample` (the rule `verify_sampling` wraps) over
many independent trials at once, so each case costs milliseconds rather than a Python loop.
"""

import functools

import pytest
import torch
from scipy import stats

from selfspec.core import verifier
from selfspec.core.sampling import SamplingParams, logits_to_probs, make_generator, sample
from selfspec.core.verifier import (
    Verdict,
    acceptance_probability,
    rejection_sample,
    verify_greedy,
    verify_sampling,
)

N_TRIALS = 50_000


# --- verify_greedy ----------------------------------------------------------------------------


def logits_with_argmax(tokens, vocab=10):
    logits = torch.randn(len(tokens), vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    return logits


def test_greedy_all_accepted_gives_bonus():
    verdict = verify_greedy(torch.tensor([3, 1, 4]), logits_with_argmax([3, 1, 4, 7]))
    assert verdict == Verdict(tokens=[3, 1, 4, 7])
    assert verdict.n_accepted == 3 and verdict.accepted == [3, 1, 4] and verdict.next_token == 7


@pytest.mark.parametrize("i", [0, 1, 2])
def test_greedy_mismatch_at_i(i):
    draft = [3, 1, 4]
    target = [3, 1, 4, 7]
    target[i] = 9
    verdict = verify_greedy(torch.tensor(draft), logits_with_argmax(target))
    assert verdict.n_accepted == i
    assert verdict.tokens == draft[:i] + [9]


def test_greedy_only_the_first_mismatch_counts():
    # Position 2 matches again after a mismatch at 1; it must not be accepted.
    verdict = verify_greedy(torch.tensor([3, 1, 4]), logits_with_argmax([3, 5, 4, 7]))
    assert verdict.tokens == [3, 5]


def test_greedy_gamma_zero_is_argmax():
    verdict = verify_greedy(torch.empty(0, dtype=torch.long), logits_with_argmax([6]))
    assert verdict.tokens == [6] and verdict.n_accepted == 0


def test_greedy_accepts_other_dtypes():
    logits = logits_with_argmax([2, 8, 5]).to(torch.bfloat16)
    assert verify_greedy(torch.tensor([2, 8], dtype=torch.int32), logits).tokens == [2, 8, 5]


def test_shape_errors():
    with pytest.raises(ValueError, match="target_logits"):
        verify_greedy(torch.tensor([1, 2]), torch.zeros(2, 10))
    with pytest.raises(ValueError, match="target_probs"):
        verify_sampling(torch.tensor([1]), torch.full((1, 4), 0.25), torch.full((1, 4), 0.25), None)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_sampling(torch.tensor([1]), torch.full((2, 4), 0.25), torch.full((2, 4), 0.25), None)


# --- synthetic p and q ------------------------------------------------------------------------


def dirichlet(rows, vocab, seed, support=None):
    """Random distributions over `vocab`, zero outside `support` (a slice of token ids) if given."""
    g = torch.Generator().manual_seed(seed)
    w = -torch.rand(rows, vocab, generator=g).log()  # Exp(1) weights: a flat Dirichlet draw
    if support is not None:
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[support] = True
        w = w * mask
    return w / w.sum(-1, keepdim=True)


def filtered_case(gamma, vocab, params, seed):
    """p and q from the same filter applied to related target and draft logits."""
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(gamma + 1, vocab, generator=g) * 2
    draft_logits = target_logits[:gamma] + torch.randn(gamma, vocab, generator=g) * 1.5
    return logits_to_probs(target_logits, params), logits_to_probs(draft_logits, params)


def case(name):
    """-> (target_probs p [γ+1, V], draft_probs q [γ, V])."""
    if name == "overlap":
        return dirichlet(4, 12, seed=1), dirichlet(3, 12, seed=2)
    if name == "q_mass_where_p_has_none":
        return dirichlet(3, 10, seed=3, support=slice(0, 6)), dirichlet(2, 10, seed=4)
    if name == "pruned_draft_head":  # q is zero outside a subset of the vocabulary
        return dirichlet(4, 16, seed=5), dirichlet(3, 16, seed=6, support=slice(2, 9))
    if name == "top_k_filtered":
        return filtered_case(3, 20, SamplingParams(temperature=0.8, top_k=6), seed=7)
    if name == "top_p_filtered":
        return filtered_case(2, 20, SamplingParams(temperature=1.2, top_p=0.8), seed=8)
    if name == "top_k_top_p_filtered":
        return filtered_case(3, 20, SamplingParams(temperature=1.0, top_k=10, top_p=0.9), seed=9)
    if name == "p_equals_q":
        p = dirichlet(3, 8, seed=10)
        return p, p[:2].clone()
    if name == "disjoint_supports":
        p = dirichlet(2, 8, seed=11, support=slice(0, 4))
        return p, dirichlet(1, 8, seed=12, support=slice(4, 8))
    if name == "gamma_zero":
        return dirichlet(1, 9, seed=13), torch.empty(0, 9)
    raise KeyError(name)


CASES = [
    "overlap",
    "q_mass_where_p_has_none",
    "pruned_draft_head",
    "top_k_filtered",
    "top_p_filtered",
    "top_k_top_p_filtered",
    "p_equals_q",
    "disjoint_supports",
    "gamma_zero",
]


def run_trials(p, q, n_trials=N_TRIALS, seed=0):
    """Draft d_i ~ q_i and verify, n_trials times at once -> (n_accepted [N], emitted [N, γ+1]).

    emitted[:, j] is the j-th token the round emits; it is meaningful where n_accepted >= j.
    p_i does not depend on the earlier tokens here, so each emitted token should follow p_j.
    """
    g = torch.Generator().manual_seed(seed)
    gamma, vocab = q.shape
    draft_probs = q.expand(n_trials, gamma, vocab)
    draft = sample(draft_probs, g) if gamma else torch.empty(n_trials, 0, dtype=torch.long)
    n, next_token = rejection_sample(draft, draft_probs, p.expand(n_trials, gamma + 1, vocab), g)
    position = torch.arange(gamma + 1)
    padded = torch.cat([draft, next_token[:, None]], dim=1)
    emitted = torch.where(position < n[:, None], padded, next_token[:, None])
    return n, emitted


@functools.cache
def trials(name):
    """One batch of trials per case, shared by the tests that read it."""
    p, q = case(name)
    return (p, q, *run_trials(p, q))


def chi_square_pvalue(tokens, probs):
    """Goodness of fit of `tokens` to `probs`; 0 if a token with probability 0 ever appears."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() / probs.double().sum() * tokens.numel()
    if counts[expected == 0].sum() > 0:
        return 0.0
    # Pool the bins with few expected counts so the chi-square approximation holds.
    small = expected < 5
    observed = torch.cat([counts[~small & (expected > 0)], counts[small].sum().view(1)])
    expect = torch.cat([expected[~small & (expected > 0)], expected[small].sum().view(1)])
    keep = expect > 0
    return stats.chisquare(observed[keep].numpy(), expect[keep].numpy()).pvalue


# --- exactness --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_emitted_tokens_follow_target(name):
    p, q, n, emitted = trials(name)
    gamma = q.shape[0]
    checked = 0
    for j in range(gamma + 1):
        # The j-th emitted token, given the first j draft tokens were accepted, must follow p_j:
        # j = 0 is the first token of every round, j = γ the bonus token.
        reached = n >= j
        if reached.sum() < 1000:
            continue  # e.g. disjoint supports: nothing is ever accepted
        pvalue = chi_square_pvalue(emitted[reached, j], p[j])
        assert pvalue > 1e-3, f"position {j}: tokens do not follow p_{j} (p-value {pvalue:.2e})"
        checked += 1
    assert checked >= (1 if name == "disjoint_supports" else min(gamma + 1, 3))


@pytest.mark.parametrize("name", CASES)
def test_acceptance_rate_matches_theory(name):
    p, q, n, _ = trials(name)
    for i in range(q.shape[0]):
        reached = n >= i
        count = int(reached.sum())
        if count < 1000:
            continue
        rate = (n[reached] > i).double().mean().item()
        alpha = acceptance_probability(p[i], q[i]).item()
        stderr = (alpha * (1 - alpha) / count) ** 0.5
        message = f"position {i}: acceptance rate {rate:.4f} vs α {alpha:.4f}"
        assert abs(rate - alpha) <= 5 * stderr + 1e-6, message


def test_acceptance_probability():
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([0.2, 0.3, 0.5])
    assert acceptance_probability(p, q).item() == pytest.approx(0.5)
    assert acceptance_probability(p, p).item() == pytest.approx(1.0)


@pytest.mark.parametrize("bug", ["resample_from_p", "abs_p_minus_q"])
def test_statistical_check_catches_a_wrong_verifier(monkeypatch, bug):
    """The same check must reject a plausible bug, which shows it has the power to see one."""
    wrong = {"resample_from_p": lambda p, q: p, "abs_p_minus_q": lambda p, q: (p - q).abs()}[bug]
    monkeypatch.setattr(verifier, "_residual", wrong)
    p, q = case("overlap")
    _, emitted = run_trials(p, q)
    assert chi_square_pvalue(emitted[:, 0], p[0]) < 1e-6


def test_degenerate_residual_falls_back_to_p():
    # p == q but the draft token has q(d) == 0: it is rejected, max(0, p - q) is all zero,
    # and the recovered token must still follow p.
    p = torch.tensor([[0.0, 0.5, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]])
    q = p[:1].clone()
    count = 40_000
    g = torch.Generator().manual_seed(0)
    n, next_token = rejection_sample(
        torch.zeros(count, 1, dtype=torch.long), q.expand(count, 1, 4), p.expand(count, 2, 4), g
    )
    assert (n == 0).all()
    assert chi_square_pvalue(next_token, p[0]) > 1e-3


# --- verify_sampling, the one-sequence wrapper ------------------------------------------------


def test_verify_sampling_verdict_structure():
    p, q = case("overlap")
    g = make_generator(0, "cpu")
    for _ in range(200):
        draft = sample(q, g)
        verdict = verify_sampling(draft, q, p, g)
        assert 0 <= verdict.n_accepted <= 3
        assert verdict.accepted == draft.tolist()[: verdict.n_accepted]
        assert p[verdict.n_accepted, verdict.next_token] > 0


def test_verify_sampling_first_token_follows_target():
    # A smaller version of the batched test, through the wrapper itself.
    p, q = case("pruned_draft_head")
    g = make_generator(1, "cpu")
    first = []
    for _ in range(3000):
        first.append(verify_sampling(sample(q, g), q, p, g).tokens[0])
    assert chi_square_pvalue(torch.tensor(first), p[0]) > 1e-3


def test_verify_sampling_gamma_zero_is_plain_sampling():
    p = dirichlet(1, 6, seed=3)
    verdict = verify_sampling(torch.empty(0, dtype=torch.long), torch.empty(0, 6), p, None)
    assert verdict.n_accepted == 0 and len(verdict.tokens) == 1


def test_same_seed_same_verdicts():
    p, q = case("top_k_top_p_filtered")

    def rounds(seed):
        g = make_generator(seed, "cpu")
        return [verify_sampling(sample(q, g), q, p, g) for _ in range(50)]

    assert rounds(5) == rounds(5)
    assert rounds(5) != rounds(6)
