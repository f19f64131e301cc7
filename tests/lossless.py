"""Shared lossless checks, used by the test of every drafter."""

import torch
from scipy.stats import chisquare

from selfspec.core.sampling import SamplingParams, logits_to_probs
from tiny_models import VOCAB

PROMPT = [5, 17, 33, 3, 60, 71, 8, 90, 41]
# A prompt that repeats itself, so model-free lookup drafts find matches.
REPETITIVE = [5, 17, 33, 3, 60, 71, 8, 5, 17, 33, 3, 60, 71, 8, 5, 17]


def assert_greedy_lossless(model, prompt=PROMPT, n=40, **options):
    """Greedy output with these drafter options equals plain AR's; returns the generation."""
    ar = model.generate(prompt, method="ar", max_new_tokens=n)
    out = model.generate(prompt, max_new_tokens=n, **options)
    assert out.tokens == ar.tokens, options
    return out


def assert_adapter_matches_transformers(model, adapter):
    """The adapter's logits equal the HF model's own forward: a 20-position prefill (longer than
    every tiny sliding window, so masks and windows are exercised), then single tokens."""
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = model(ids.view(1, -1)).logits[0]
        cache = adapter.new_cache(32)
        logits = [adapter.head(adapter.run_layers(adapter.embed(ids[:20]), range(adapter.n_layers), 0, cache))]
        for t in range(20, 30):
            logits.append(adapter.head(adapter.run_layers(adapter.embed(ids[t:t + 1]), range(adapter.n_layers), t, cache)))
    torch.testing.assert_close(torch.cat(logits), reference, atol=1e-4, rtol=1e-4)


def exact_second_token_marginal(model, prompt, params: SamplingParams) -> torch.Tensor:
    """P(second new token = t) when sampling the full model token by token, enumerated."""
    adapter = model.adapter
    with torch.inference_mode():
        def probs(ids):
            cache = adapter.new_cache(len(ids))
            h = adapter.run_layers(adapter.embed(torch.tensor(ids)), range(adapter.n_layers), 0, cache)
            return logits_to_probs(adapter.head(h[:, -1:]), params)[0]

        p1 = probs(prompt)
        exact = torch.zeros(VOCAB)
        for t1 in p1.nonzero().flatten().tolist():
            exact += p1[t1] * probs(prompt + [t1])
    return exact


def assert_sampling_matches_target(model, prompt=PROMPT, trials=2000, temperature=1.5, top_k=6, **options):
    """The second generated token's marginal under speculative sampling with these drafter
    options must match the exact marginal of the full model (chi-square). Returns total accepted
    draft tokens, so a caller can check that the accept path was exercised."""
    exact = exact_second_token_marginal(model, prompt, SamplingParams(temperature=temperature, top_k=top_k))
    counts = torch.zeros(VOCAB)
    accepted = 0
    for seed in range(trials):
        out = model.generate(prompt, max_new_tokens=4, seed=seed, temperature=temperature, top_k=top_k, **options)
        counts[out.tokens[1]] += 1
        accepted += out.stats.accepted
    support = exact > 0
    assert counts[~support].sum() == 0
    _, p_value = chisquare(counts[support].numpy(), exact[support].numpy() * trials)
    assert p_value > 1e-3, p_value
    return accepted
