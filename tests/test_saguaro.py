"""Saguaro (speculative speculative decoding): lossless on both of its paths, a hit (the round's
draft was pre-drafted during the previous verify) and a miss (drafted as plain early exit).

A full-depth draft (k = n_layers) accepts everything and guesses every bonus token, so every round
after the first is a hit; a shallow draft on a random model is mostly rejected, so rounds miss.
"""

import pytest
import torch
from scipy.stats import kstest

import selfspec.drafters.layers.saguaro as saguaro
from lossless import PROMPT, assert_greedy_lossless
from selfspec import Speculation
from selfspec.drafters import make_drafter
from selfspec.core.sampling import SamplingParams, logits_to_probs
from selfspec.core.stats import GenerationStats


@pytest.mark.parametrize("arch,k,gamma", [("llama", 6, 3), ("llama", 6, 1), ("gemma3_text", 6, 2)])
def test_greedy_full_depth_hits_every_round(tiny, arch, k, gamma):
    out = assert_greedy_lossless(tiny(arch), method="saguaro", exit_layer=k, draft_len=gamma)
    assert out.stats.method == "saguaro"
    assert out.stats.speculation_hits >= out.stats.rounds - 2  # all but the first (and a last AR step)
    assert out.stats.speculation_misses == 0


@pytest.mark.parametrize("arch,k,gamma", [("llama", 2, 3), ("qwen2", 4, 4), ("mistral", 5, 3)])
def test_greedy_shallow_misses(tiny, arch, k, gamma):
    out = assert_greedy_lossless(tiny(arch), method="saguaro", exit_layer=k, draft_len=gamma)
    assert out.stats.speculation_misses > 0
    assert out.stats.speculation_hits + out.stats.speculation_misses <= out.stats.rounds - 1


@pytest.mark.parametrize("k,gamma", [(6, 2), (5, 3)])
def test_greedy_when_the_worker_drafts_everything(tiny, monkeypatch, k, gamma):
    """Let the worker finish every pre-draft while the verify runs (it is normally stopped when the
    verify ends, and the main thread finishes it): its KV and tokens alone must still be exact."""
    monkeypatch.setattr(saguaro, "_work", _work_to_the_end)
    out = assert_greedy_lossless(tiny(), method="saguaro", exit_layer=k, draft_len=gamma)
    assert out.stats.speculation_hits > 0


def test_sampling_is_reproducible_however_far_the_worker_got(tiny, monkeypatch):
    """With a seed, the output may not depend on where the worker was stopped: each pre-draft
    draws from its own generator, seeded per round."""
    model = tiny()
    options = dict(method="saguaro", exit_layer=6, draft_len=3, max_new_tokens=20, seed=7, temperature=1.0)
    stopped = model.generate(PROMPT, **options)
    monkeypatch.setattr(saguaro, "_work", _work_to_the_end)
    finished = model.generate(PROMPT, **options)
    assert stopped.tokens == finished.tokens
    assert finished.stats.speculation_hits > 0


def _work_to_the_end(steps, stop, stream):
    """saguaro._work, deaf to `stop`: the worker drafts the whole round."""
    with torch.inference_mode():
        for _ in steps:
            pass


def test_main_thread_keeps_its_threads(tiny):
    """The verify gives the worker one of the main thread's intra-op threads, and gets it back."""
    torch.set_num_threads(2)  # the fixture restores its own setting afterwards
    assert_greedy_lossless(tiny(), n=12, method="saguaro", exit_layer=6, draft_len=2)
    assert torch.get_num_threads() == 2


def test_counts_over_generations_and_in_stats(tiny):
    model = tiny()
    drafter = make_drafter(model.resolve(Speculation("saguaro", exit_layer=6, draft_len=2)))
    a = model.generate(PROMPT, max_new_tokens=10, drafter=drafter)
    b = model.generate(PROMPT, max_new_tokens=10, drafter=drafter)
    assert drafter.hits == a.stats.speculation_hits + b.stats.speculation_hits > 0
    total = GenerationStats(method="saguaro")
    total.merge(a.stats)
    total.merge(b.stats)
    assert total.speculation_hits == drafter.hits
    assert "speculation hits" in a.stats.summary()


def test_sampling_follows_the_target_on_hits_and_misses(tiny):
    """Every sampled token must be a draw from the full model's distribution p given the tokens
    before it. Then its randomised probability integral transform u = P(x < t) + v·p(t), v uniform,
    is uniform on (0, 1), independently from token to token; a KS test pools every token of every
    run, those from pre-drafts (hits) and the rest. And no token may lie outside p's support: a
    pre-draft taken for the wrong outcome puts some there. (The shared marginal test looks at the
    second token only, which no pre-draft ever proposes.)"""
    model, params = tiny(), SamplingParams(temperature=1.5, top_k=4)
    v = torch.Generator().manual_seed(0)
    u, hits, misses = [], 0, 0
    for seed in range(80):
        out = model.generate(PROMPT, method="saguaro", exit_layer=5, draft_len=2, max_new_tokens=16, seed=seed,
                             temperature=params.temperature, top_k=params.top_k)
        hits += out.stats.speculation_hits
        misses += out.stats.speculation_misses
        p = _target_probs(model, PROMPT, out.tokens, params)  # [new tokens, vocab]
        t = torch.tensor(out.tokens).view(-1, 1)
        p_t = p.gather(-1, t).view(-1)
        assert (p_t > 0).all()
        below = p.cumsum(-1).gather(-1, t).view(-1) - p_t
        u.append(below + torch.rand(len(out.tokens), generator=v) * p_t)
    assert hits > 0 and misses > 0
    p_value = kstest(torch.cat(u).numpy(), "uniform").pvalue
    assert p_value > 1e-3, p_value


@torch.inference_mode()
def _target_probs(model, prompt, tokens, params):
    """p of each new token given everything before it: one full forward over prompt + tokens."""
    adapter = model.adapter
    ids = list(prompt) + tokens
    cache = adapter.new_cache(len(ids))
    h = adapter.run_layers(adapter.embed(torch.tensor(ids)), range(adapter.n_layers), 0, cache)
    return logits_to_probs(adapter.head(h[:, len(prompt) - 1 : -1]), params)
