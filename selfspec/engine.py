"""The decode loop: prefill, draft, verify, commit or rewind, feed back. One loop for every method.

State between rounds: the cache is valid at every layer for positions < cache.length, and one
committed token, `pending`, sits at position cache.length without having been fed to the model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import NamedTuple

import torch

from selfspec.adapter import ModelAdapter
from selfspec.cache import KVCache
from selfspec.drafters.base import Draft, DraftContext, Drafter
from selfspec.sampling import SamplingParams, logits_to_probs, make_generator, sample
from selfspec.stats import GenerationStats
from selfspec.verifier import Verdict, verify_greedy, verify_sampling


def check_length(adapter: ModelAdapter, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse, before any work, a generation the model's context cannot hold."""
    if prompt_len == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens > adapter.max_positions:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
            f"of {adapter.max_positions} tokens; shorten the prompt or lower max_new_tokens"
        )


@torch.inference_mode()
def decode(
    adapter: ModelAdapter,
    prompt_ids: torch.Tensor,
    drafter: Drafter,
    *,
    sampling: SamplingParams,
    max_new_tokens: int,
    eos_ids: frozenset[int] = frozenset(),
    stats: GenerationStats,
) -> Iterator[list[int]]:
    """Yield committed tokens, a list per round, until EOS (not yielded) or max_new_tokens."""
    prompt_ids = prompt_ids.to(adapter.device).view(-1)
    check_length(adapter, prompt_ids.numel(), max_new_tokens)
    cache = adapter.new_cache(prompt_ids.numel() + max_new_tokens + drafter.draft_len + 1)
    stats.kv_cache_bytes = cache.nbytes
    generator = make_generator(sampling.seed, adapter.device)
    ctx = DraftContext(adapter, cache, sampling, generator, prompt_ids, prompt_ids.tolist(), stats)
    drafter.begin(ctx)
    stats.prompt_tokens = prompt_ids.numel()
    sync = _syncer(adapter.device)
    t0 = time.perf_counter()

    # 1. Prefill: the prompt at full depth; the first new token comes from its last position.
    h = adapter.run_layers(adapter.embed(prompt_ids), range(adapter.n_layers), 0, cache)
    first = _pick(adapter.head(h[:, -1:]), sampling, generator)
    cache.rewind(prompt_ids.numel())
    sync()
    stats.prefill_s = time.perf_counter() - t0
    if drafter.draft_len:  # c's denominator, at this context length (attention grows with it)
        stats.step_s = measure_step_time(adapter, cache, position=cache.length)
        t0 = time.perf_counter() - stats.prefill_s  # the probe is not part of decoding time
    pending, committed, produced = first, [int(first)], 0
    ctx.committed.append(int(first))
    try:
        while True:
            # Emit what was just committed (first the prefill's token), cut at EOS or max_new_tokens.
            out = _commit(committed, eos_ids, max_new_tokens - produced)
            produced += len(out.tokens)
            stats.new_tokens = produced
            if out.tokens:
                yield out.tokens
            if out.stop:
                return
            start = cache.length  # position of the pending token
            # 2. Draft: at most what could still be committed after the pending token's successor.
            t, searched = time.perf_counter(), stats.search_s
            draft = drafter.propose(pending, start, max_new_tokens - produced - 1)
            sync()
            t_draft = time.perf_counter()
            # 3. Verify: one full-depth forward over pending + draft, then the pure verifier.
            target_logits = verify_forward(adapter, cache, pending, draft, start)  # [γ+1, vocab]
            verdict = _verify(draft, target_logits, sampling, generator)
            t_verify = time.perf_counter()
            stats.draft_s += t_draft - t - (stats.search_s - searched)
            stats.verify_s += t_verify - t_draft
            # 4. Commit or rewind: pending + accepted tokens are now valid at every layer; feed back.
            cache.rewind(start + 1 + verdict.n_accepted)
            pending = torch.tensor([verdict.tokens[-1]], device=adapter.device)
            committed = verdict.tokens
            ctx.committed += committed
            stats.record_round(len(draft), verdict.n_accepted)
            drafter.observe(verdict.n_accepted)
    finally:
        stats.wall_s = time.perf_counter() - t0


def verify_forward(
    adapter: ModelAdapter, cache: KVCache, pending: torch.Tensor, draft: Draft, start: int
) -> torch.Tensor:
    """Full-model logits [γ+1, vocab] for pending + draft tokens at positions start .. start+γ,
    each row computed exactly as a one-token autoregressive step would (see run_layers)."""
    gamma = len(draft)
    if draft.exit_hidden is None or gamma == 0:
        h = adapter.embed(torch.cat([pending, draft.tokens]))
        h = adapter.run_layers(h, range(adapter.n_layers), start, cache, rowwise=True)
        return adapter.head(h)
    k = draft.exit_layer
    # Layers < k ran in the draft for every position but the last draft token's: run only that one.
    last = adapter.run_layers(adapter.embed(draft.tokens[-1:]), range(k), start + gamma, cache)
    h = torch.cat([draft.exit_hidden, last], dim=1)  # [1, γ+1, hidden] at layer k
    h = adapter.run_layers(h, range(k, adapter.n_layers), start, cache, rowwise=True)
    return adapter.head(h)


def measure_step_time(adapter: ModelAdapter, cache: KVCache, position: int, repeats: int = 3) -> float:
    """Seconds of one full-depth one-token forward at `position` (slots there are free; later
    rounds overwrite them). The denominator of c."""
    sync = _syncer(adapter.device)
    token = torch.zeros(1, dtype=torch.long, device=adapter.device)
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        t = time.perf_counter()
        adapter.head(adapter.run_layers(adapter.embed(token), range(adapter.n_layers), position, cache))
        sync()
        times.append(time.perf_counter() - t)
    return sorted(times[1:])[len(times[1:]) // 2]


class _Commit(NamedTuple):
    tokens: list[int]  # what to emit
    stop: bool  # EOS seen or max_new_tokens reached


def _commit(tokens: list[int], eos_ids: frozenset[int], room: int) -> _Commit:
    """Cut a round's tokens at the first EOS (dropped) or when max_new_tokens is reached."""
    for i, token in enumerate(tokens[:room]):
        if token in eos_ids:
            return _Commit(tokens[:i], True)
    return _Commit(tokens[:room], len(tokens) >= room)


def _pick(logits: torch.Tensor, sampling: SamplingParams, generator) -> torch.Tensor:
    """The first new token, from the prefill's last logits [1, vocab]: a [1] tensor."""
    if sampling.greedy:
        return logits.argmax(-1)
    return sample(logits_to_probs(logits, sampling), generator).view(1)


def _verify(draft: Draft, target_logits: torch.Tensor, sampling: SamplingParams, generator) -> Verdict:
    if sampling.greedy:
        return verify_greedy(draft.tokens, target_logits)
    target_probs = logits_to_probs(target_logits, sampling)
    draft_probs = draft.draft_probs
    if draft_probs is None:  # γ = 0: nothing to compare against
        draft_probs = target_probs[:0]
    return verify_sampling(draft.tokens, draft_probs, target_probs, generator)


def _syncer(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None
