"""The shallow draft every model-based drafter runs: the model's own layers minus a skip set.

One loop for early exit, static layer skip, SWIFT, CLaSp, ConfLayers and expert-subset; they differ
only in the skip set they choose (expert-subset: also fewer routed experts) and when they stop.
Per draft token: layers before the skip set's boundary run in full and write KV the verify reuses
(their outputs at the boundary are the `exit_hidden` the verify continues from); the remaining
layers run minus the skipped sublayers and write draft-time KV that the verify overwrites in
place; then the model's own norm and head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from selfspec.heads.draft_head import PrunedHead
from selfspec.core.draft import Draft, DraftContext
from selfspec.model.adapter import ExpertBudget
from selfspec.model.moe import moe_layers
from selfspec.core.sampling import logits_to_probs, sample
from selfspec.model.skips import SkipSet


def draft_shallow(
    ctx: DraftContext,
    skip: SkipSet,
    pending: torch.Tensor,
    start: int,
    gamma: int,
    threshold: float = 0.0,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    head: PrunedHead | None = None,
    experts: int | None = None,
) -> Draft:
    """Draft up to γ tokens after `pending` (at position `start`). With threshold > 0, stop after
    the first token whose draft top-1 probability is below it (confidence-aware drafting).
    transform: applied to the last layer's hidden state before the head (an exit adapter); the
    `exit_hidden` the verify continues from stay the raw states. head: a pruned draft head to use
    instead of the model's own (see selfspec.heads.draft_head); the draft then never proposes a token
    outside its subset, and q is zero there. experts: route every MoE layer the draft runs to this
    many experts (expert-subset); the draft then differs from the full model from the first MoE
    layer on, so the boundary moves there and the verify recomputes those layers' KV."""
    adapter = ctx.adapter
    if gamma <= 0:
        return Draft(tokens=pending.new_empty(0))
    boundary = skip.boundary(adapter.n_layers)
    hooks = None
    if experts is not None:
        boundary = min([boundary, *moe_layers(adapter.layers)])
        hooks = ExpertBudget(experts)
    before = range(boundary)
    # Layers skipped whole are left out of the list, not visited per token (early exit: none left).
    after = [i for i in range(boundary, adapter.n_layers) if i not in skip.skipped_layers()]
    token = pending
    tokens, hidden, probs = [], [], []
    for i in range(gamma):
        h = adapter.run_layers(adapter.embed(token), before, start + i, ctx.cache)  # [1, 1, hidden]
        hidden.append(h)
        h = adapter.run_layers(h, after, start + i, ctx.cache, skip=skip, hooks=hooks)
        token, q, logits = draft_token(ctx, h, ctx.generator, transform, head)
        if q is not None:
            probs.append(q)
        tokens.append(token)
        if i + 1 < gamma and not confident(threshold, q, logits):
            break
    return Draft(
        tokens=torch.cat(tokens),
        draft_probs=torch.cat(probs) if probs else None,
        exit_layer=boundary,
        exit_hidden=torch.cat(hidden, dim=1),
    )


def head_logits(ctx: DraftContext, h: torch.Tensor, transform=None, head: PrunedHead | None = None) -> torch.Tensor:
    """The draft head's logits of h [1, 1, hidden] (after `transform`): the model's head [1, vocab]
    or the pruned one's subset [1, N]."""
    h = h if transform is None else transform(h)
    return ctx.adapter.head(h) if head is None else head.subset_logits(h)


def draft_token(
    ctx: DraftContext,
    h: torch.Tensor,
    generator: torch.Generator | None,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    head: PrunedHead | None = None,
    logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The draft's next token from its last hidden state h [1, 1, hidden] (see draft_shallow for
    transform and head): the argmax when greedy, else a sample from q drawn with `generator`.
    logits: the head's logits of h when already computed (the fused feature step), else None.
    Returns (token [1], q [1, vocab] or None when greedy, the head's logits)."""
    if logits is None:
        logits = head_logits(ctx, h, transform, head)
    if ctx.sampling.greedy:
        return (logits.argmax(-1) if head is None else head.ids[logits.argmax(-1)]), None, logits
    if head is None:
        q = logits_to_probs(logits, ctx.sampling)
        return sample(q, generator).view(1), q, logits
    # The same distribution as over the full vocabulary with -inf outside the subset, computed and
    # drawn over the N subset tokens, then spread into q [1, vocab] (zero outside) for the verify.
    subset = logits_to_probs(logits, ctx.sampling)  # [1, N]
    token = head.ids[sample(subset, generator)].view(1)
    return token, subset.new_zeros(subset.shape[0], head.vocab_size).index_copy_(1, head.ids, subset), logits


def confident(threshold: float, q: torch.Tensor | None, logits: torch.Tensor) -> bool:
    """Whether a draft goes on after this token: its top-1 probability (from q when sampling, else
    from the logits, over a pruned head's subset too: its softmax is that of the full-vocabulary
    logits, -inf elsewhere) reaches `threshold`; always with threshold 0."""
    return threshold <= 0 or top1(q, logits) >= threshold


def top1(q: torch.Tensor | None, logits: torch.Tensor) -> float:
    """A draft token's top-1 probability: from q when sampling, else from the logits (over a pruned
    head's subset too, see `confident`)."""
    return top1_probability(logits) if q is None else float(q.max())


def top1_probability(logits: torch.Tensor) -> float:
    """max softmax(logits) of one row, without materialising the softmax: 1 / Σ exp(l - max)."""
    logits = logits.view(-1)
    return float(1.0 / torch.exp(logits - logits.max()).sum())
