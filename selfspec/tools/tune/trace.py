"""What each exit layer would have drafted, read off one autoregressive decode: exact α for free.

In greedy decoding every accepted prefix is the autoregressive output itself, and the layers
below k see only tokens (never the layers above), so the early-exit draft at layer k for the token
after position t is the logit lens at layer k over the AR sequence: head(norm(h_k[t])). One full
forward over prompt + output, with the head applied after every layer, therefore tells for every
k and every position whether a draft would match; replaying the engine's rounds over those
matches gives the exact drafted/accepted counts of early exit at any (k, γ), and replaying the
n-gram search gives prompt lookup's, without decoding once per configuration.

Up to rounding: the trace's forward batches the positions while the draft runs one token at a
time, so a near-tie can break differently. The tuner's timed check runs the real thing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from selfspec.drafters.lookup import find_draft
from selfspec.tools.tune.rounds import Rounds


@dataclass
class Trace:
    prompt: list[int]
    output: list[int]  # the greedy AR output, ending with the EOS token if it stopped at one
    limit: int  # the max_new_tokens it ran with
    # hits[k][j]: the exit-k draft fed output[j-1] proposes output[j] (j >= 1; hits[k][0] unused)
    hits: dict[int, np.ndarray]
    # The final states (before the final norm) at every position fed, [positions, hidden]: what
    # the verify writes into the cache, which a feature-head draft reads (replay_feature).
    final: torch.Tensor | None = None


@torch.inference_mode()
def trace(adapter, prompt: list[int], tokens: list[int], limit: int, exit_layers) -> Trace:
    """Logit-lens matches of every exit layer in `exit_layers` over prompt + the AR output
    `tokens` (EOS excluded, as generate returns them) of a run with max_new_tokens = limit."""
    exit_layers = sorted(set(exit_layers))
    if exit_layers and not 1 <= exit_layers[0] <= exit_layers[-1] <= adapter.n_layers:
        raise ValueError(f"exit layers must be in 1..{adapter.n_layers}")
    if not tokens:
        return Trace(prompt, [], limit, {k: np.zeros(0, dtype=bool) for k in exit_layers})
    stopped = len(tokens) < limit  # at an EOS: feed every token, the last position predicts it
    ids = torch.tensor(prompt + (tokens if stopped else tokens[:-1]), dtype=torch.long, device=adapter.device)
    first = len(prompt) - 1  # the position whose logits predict the first output token
    states, h = exit_states(adapter, ids, exit_layers)
    predicted = {k: adapter.head(s[:, first:]).argmax(-1).cpu().numpy() for k, s in states.items()}  # k -> [n]
    output = list(tokens)
    if stopped:
        output.append(int(adapter.head(h[:, -1:]).argmax(-1)))
    target = np.asarray(output)
    hits = {}
    for k, p in predicted.items():
        hits[k] = p == target
        hits[k][0] = False  # the first token comes from the prefill, never from a draft
    return Trace(prompt, output, limit, hits, h[0].clone())


def exit_states(adapter, ids: torch.Tensor, exit_layers) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """One full forward over ids [n] (positions 0 .. n-1, a cache of its own): the hidden states
    [1, n, hidden] after layers 0 .. k-1 (what the exit-k draft sees) for each k in
    `exit_layers`, and the final states before the final norm."""
    cache = adapter.new_cache(ids.numel())
    h = adapter.embed(ids)
    states = {}
    for i in range(adapter.n_layers):
        h = adapter.run_layers(h, [i], 0, cache)
        if i + 1 in exit_layers:
            states[i + 1] = h
    return states, h


def replay_early_exit(t: Trace, exit_layer: int, draft_len: int) -> Rounds:
    """The rounds the engine runs for early exit at (k, γ) on this prompt, greedy."""
    hits, n = t.hits[exit_layer], len(t.output)

    def draft(j: int, room: int) -> tuple[int, int]:
        accepted = 0
        while accepted < room and j + 1 + accepted < n and hits[j + 1 + accepted]:
            accepted += 1
        return room, accepted

    return _replay(t, draft_len, draft)


def replay_lookup(t: Trace, draft_len: int, ngram: int = 3) -> Rounds:
    """The rounds the engine runs for prompt lookup with (γ, n-gram) on this prompt, greedy."""
    context = np.asarray(t.prompt + t.output, dtype=np.int64)
    start, n = len(t.prompt), len(t.output)

    def draft(j: int, room: int) -> tuple[int, int]:
        proposal = find_draft(context[: start + j + 1], ngram, 1, room)
        accepted = 0
        while (accepted < len(proposal) and j + 1 + accepted < n
               and proposal[accepted] == t.output[j + 1 + accepted]):
            accepted += 1
        return len(proposal), accepted

    return _replay(t, draft_len, draft)


def replay_feature(t: Trace, adapter, drafter) -> tuple[Rounds, float]:
    """The rounds the engine runs for a feature-head drafter (selfspec.drafters.feature, or the
    hybrid over it: lookup, else the head; greedy) on this prompt, the drafter itself proposing from the trace's final states; and the seconds
    its proposals took (c's numerator). A sibling draft (Draft.siblings) counts as one drafted
    position, accepted when the model's token is among its alternatives, as the engine counts it;
    the prediction then charges it a 2-row verify, not its m + 1 rows (on AMX, ~2% optimistic at
    m = 2: tune's timed check measures the real thing)."""
    from selfspec.core.draft import DraftContext  # (drafters import the tuner's neighbours)
    from selfspec.core.sampling import SamplingParams
    from selfspec.core.stats import GenerationStats

    positions = len(t.prompt) + len(t.output)
    cache = adapter.new_cache(positions + drafter.draft_len + 1)
    ctx = DraftContext(adapter, cache, SamplingParams(), None, torch.tensor(t.prompt), list(t.prompt),
                       GenerationStats(drafter.name), siblings=True)
    drafter.begin(ctx)
    cache.exit_states[:t.final.shape[0]] = t.final
    spent = 0.0

    def draft(j: int, room: int) -> tuple[int, int]:
        nonlocal spent
        ctx.committed = t.prompt + t.output[:j + 1]
        begun = time.perf_counter()
        drafted = drafter.propose(torch.tensor(t.output[j:j + 1]), len(t.prompt) + j, room)
        proposal = drafted.tokens.tolist()
        spent += time.perf_counter() - begun
        if drafted.siblings:  # (a round only starts where output[j + 1] exists)
            return 1, int(t.output[j + 1] in proposal)
        accepted = 0
        while (accepted < len(proposal) and j + 1 + accepted < len(t.output)
               and proposal[accepted] == t.output[j + 1 + accepted]):
            accepted += 1
        return len(proposal), accepted

    with torch.inference_mode():
        return _replay(t, drafter.draft_len, draft), spent


def _replay(t: Trace, draft_len: int, draft) -> Rounds:
    """Mirror the engine's loop: output[j] is pending (j + 1 tokens committed); a round drafts at
    most what could still be committed after its bonus token and commits the accepted tokens plus
    one; decoding ends at the last output token (the limit, or EOS). Draft tokens past an EOS
    count as rejected (the engine stops there either way)."""
    rounds = Rounds()
    j = 0
    while j + 1 < len(t.output):
        drafted, accepted = draft(j, min(draft_len, t.limit - j - 2))
        rounds.add(drafted, accepted)
        j += accepted + 1
    return rounds
