"""LayerSkip-style early exit: draft with layers 0 .. k-1 and the model's own final norm and head.

The draft writes the KV of layers < k for every token it feeds; those entries are exactly what
the full model computes for the same token, so the verify reuses them together with the exit
hidden states and only runs layers >= k over the draft (plus layers < k for the last draft
token, which the draft never fed).
"""

from __future__ import annotations

import torch

from selfspec.drafters.base import Draft, DraftContext
from selfspec.sampling import logits_to_probs, sample


class EarlyExit:
    name = "early-exit"

    def __init__(self, exit_layer: int, draft_len: int):
        if exit_layer is None or exit_layer < 1:
            raise ValueError(f"exit layer k must be >= 1, got {exit_layer}")
        if draft_len < 1:
            raise ValueError(f"draft length must be >= 1, got {draft_len}")
        self.exit_layer = exit_layer
        self.draft_len = draft_len

    def begin(self, ctx: DraftContext) -> None:
        n = ctx.adapter.n_layers
        if not 1 <= self.exit_layer <= n:
            raise ValueError(f"exit layer must be in 1..{n} for this {n}-layer model, got {self.exit_layer}")
        self.ctx = ctx
        self.layers = range(self.exit_layer)

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        ctx, adapter = self.ctx, self.ctx.adapter
        gamma = min(self.draft_len, max_len)
        token = pending
        tokens, hidden, probs = [], [], []
        for i in range(gamma):
            h = adapter.run_layers(adapter.embed(token), self.layers, start + i, ctx.cache)  # [1, 1, hidden]
            logits = adapter.head(h)  # [1, vocab]
            if ctx.sampling.greedy:
                token = logits.argmax(-1)
            else:
                q = logits_to_probs(logits, ctx.sampling)
                token = sample(q, ctx.generator).view(1)
                probs.append(q)
            tokens.append(token)
            hidden.append(h)
        if gamma == 0:
            return Draft(tokens=pending.new_empty(0))
        return Draft(
            tokens=torch.cat(tokens),
            draft_probs=torch.cat(probs) if probs else None,
            exit_layer=self.exit_layer,
            exit_hidden=torch.cat(hidden, dim=1),
        )

    def observe(self, n_accepted: int) -> None:
        pass
