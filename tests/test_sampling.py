import math
import re

import pytest
import torch

from selfspec.core.sampling import SamplingParams, logits_to_probs, make_generator, sample


# --- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1.0), "temperature must be >= 0, got -1.0"),
        (dict(temperature=float("nan")), "temperature must be >= 0"),
        (dict(top_k=-1), "top_k must be an integer >= 0, got -1"),
        (dict(top_k=2.5), "top_k must be an integer >= 0"),
        (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        (dict(top_p=-0.5), "top_p must be in (0, 1]"),
        (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    ],
)
def test_params_validation(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        SamplingParams(**kwargs)


def test_params_defaults_and_greedy():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7).greedy
    SamplingParams(temperature=1.0, top_k=5, top_p=1.0, seed=3)  # valid edges do not raise


# --- logits_to_probs --------------------------------------------------------------------------


def random_logits(*shape, seed=0, scale=2.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """A row-by-row, loop-based reading of the spec, written independently of the vectorised one."""
    vocab = logits.shape[-1]
    rows = []
    for row in logits.double().reshape(-1, vocab).tolist():
        scaled = [x / params.temperature for x in row]
        order = sorted(range(vocab), key=lambda i: -scaled[i])
        if params.top_k:
            order = order[: params.top_k]
        weight = {i: math.exp(scaled[i] - scaled[order[0]]) for i in order}
        total = sum(weight.values())
        kept, mass = [], 0.0
        for i in order:
            kept.append(i)
            mass += weight[i] / total
            if mass >= params.top_p:
                break
        z = sum(weight[i] for i in kept)
        rows.append([weight[i] / z if i in kept else 0.0 for i in range(vocab)])
    return torch.tensor(rows).reshape(logits.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_rows_sum_to_one_float32(dtype):
    params = SamplingParams(temperature=0.8, top_k=7, top_p=0.9)
    probs = logits_to_probs(random_logits(3, 5, 50).to(dtype), params)
    assert probs.dtype == torch.float32 and probs.shape == (3, 5, 50)
    assert torch.allclose(probs.sum(-1), torch.ones(3, 5), atol=1e-5)
    assert (probs >= 0).all()


def test_plain_temperature_one_is_softmax():
    logits = random_logits(4, 30)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(probs, torch.softmax(logits, -1), atol=1e-6)


@pytest.mark.parametrize("k", [1, 3, 10, 29])
def test_top_k_keeps_exactly_k(k):
    logits = random_logits(6, 30, seed=k)  # continuous random values: no ties
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=k))
    assert ((probs > 0).sum(-1) == k).all()
    top = torch.topk(logits, k, dim=-1).indices
    assert (probs.gather(-1, top) > 0).all()


def test_top_k_at_least_vocab_is_off():
    logits = random_logits(2, 10)
    off = logits_to_probs(logits, SamplingParams(temperature=1.0))
    assert torch.equal(logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=10)), off)
    assert torch.equal(logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=50)), off)


@pytest.mark.parametrize("top_p", [0.01, 0.3, 0.5, 0.8, 0.95, 0.999])
def test_top_p_keeps_minimal_prefix(top_p):
    logits = random_logits(20, 25, seed=int(top_p * 1000))
    full = torch.softmax(logits, -1)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    for row_full, row in zip(full, probs):
        order = torch.argsort(row_full, descending=True)
        kept = row[order] > 0
        n = int(kept.sum())
        assert n >= 1 and kept[:n].all(), "the kept set is a prefix of the sorted distribution"
        mass = row_full[order[:n]].sum()
        assert mass >= top_p - 1e-6, "the kept mass reaches top_p"
        assert mass - row_full[order[n - 1]] < top_p, "the last kept token is needed"


def test_top_p_always_keeps_top_token():
    logits = torch.tensor([[5.0, 4.0, 0.0], [1.0, 1.5, 1.2]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))


def test_temperature_sharpens_and_flattens():
    logits = random_logits(8, 40)

    def entropy(t):
        p = logits_to_probs(logits, SamplingParams(temperature=t))
        return -(p * p.clamp_min(1e-30).log()).sum(-1)

    cold, warm, hot = entropy(0.5), entropy(1.0), entropy(2.0)
    assert (cold < warm).all() and (warm < hot).all()


def test_greedy_is_one_hot_argmax():
    logits = random_logits(3, 12)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0, top_k=5, top_p=0.5))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(3)) and ((probs == 0) | (probs == 1)).all()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=12, top_p=0.6),
        SamplingParams(temperature=2.0, top_k=3, top_p=0.99),
    ],
)
def test_matches_reference(params):
    logits = random_logits(2, 6, 40, seed=7)
    got = logits_to_probs(logits, params)
    want = reference_probs(logits, params).float()
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-6)


# --- sample and make_generator ----------------------------------------------------------------


def test_sample_shape_and_support():
    probs = logits_to_probs(random_logits(4, 3, 16), SamplingParams(temperature=1.0, top_k=4))
    tokens = sample(probs, make_generator(0, "cpu"))
    assert tokens.shape == (4, 3) and tokens.dtype == torch.long
    assert (probs.gather(-1, tokens.unsqueeze(-1)) > 0).all()
    assert sample(probs[0, 0], None).shape == ()


def test_sample_follows_probs():
    probs = torch.tensor([0.1, 0.6, 0.3])
    tokens = sample(probs.expand(60_000, 3), make_generator(1, "cpu"))
    freq = torch.bincount(tokens, minlength=3).float() / tokens.numel()
    assert torch.allclose(freq, probs, atol=0.01)


def test_make_generator_is_reproducible():
    assert make_generator(None, "cpu") is None
    probs = torch.softmax(random_logits(100, 50), -1)
    a = sample(probs, make_generator(123, "cpu"))
    b = sample(probs, make_generator(123, torch.device("cpu")))
    c = sample(probs, make_generator(124, "cpu"))
    assert torch.equal(a, b) and not torch.equal(a, c)
