"""The shallow draft every model-based drafter runs: the model's own layers minus a skip set.

One loop for early exit, static layer skip, SWIFT, CLaSp and ConfLayers; they differ only in the
skip set they choose and when they stop. Per draft token: layers before the skip set's boundary
run in full and write KV the verify reuses (their outputs at the boundary are the `exit_hidden`
the verify continues from); the remaining layers run minus the skipped sublayers and write
draft-time KV that the verify overwrites in place; then the model's own norm and head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from selfspec.drafters.base import Draft, DraftContext
from selfspec.sampling import logits_to_probs, sample
from selfspec.skips import SkipSet


def draft_shallow(
    ctx: DraftContext,
    skip: SkipSet,
    pending: torch.Tensor,
    start: int,
    gamma: int,
    threshold: float = 0.0,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Draft:
    """Draft up to γ tokens after `pending` (at position `start`). With threshold > 0, stop after
    the first token whose draft top-1 probability is below it (confidence-aware drafting).
    transform: applied to the last layer's hidden state before the head (an exit adapter); the
    `exit_hidden` the verify continues from stay the raw states."""
    adapter = ctx.adapter
    if gamma <= 0:
        return Draft(tokens=pending.new_empty(0))
    boundary = skip.boundary(adapter.n_layers)
    before = range(boundary)
    # Layers skipped whole are left out of the list, not visited per token (early exit: none left).
    after = [i for i in range(boundary, adapter.n_layers) if i not in skip.skipped_layers()]
    token = pending
    tokens, hidden, probs = [], [], []
    for i in range(gamma):
        h = adapter.run_layers(adapter.embed(token), before, start + i, ctx.cache)  # [1, 1, hidden]
        hidden.append(h)
        h = adapter.run_layers(h, after, start + i, ctx.cache, skip=skip)
        logits = adapter.head(h if transform is None else transform(h))  # [1, vocab]
        if ctx.sampling.greedy:
            token = logits.argmax(-1)
            confident = threshold <= 0 or top1_probability(logits) >= threshold
        else:
            q = logits_to_probs(logits, ctx.sampling)
            token = sample(q, ctx.generator).view(1)
            probs.append(q)
            confident = threshold <= 0 or float(q.max()) >= threshold
        tokens.append(token)
        if not confident:
            break
    return Draft(
        tokens=torch.cat(tokens),
        draft_probs=torch.cat(probs) if probs else None,
        exit_layer=boundary,
        exit_hidden=torch.cat(hidden, dim=1),
    )


def top1_probability(logits: torch.Tensor) -> float:
    """max softmax(logits) of one row, without materialising the softmax: 1 / Σ exp(l - max)."""
    logits = logits.view(-1)
    return float(1.0 / torch.exp(logits - logits.max()).sum())
