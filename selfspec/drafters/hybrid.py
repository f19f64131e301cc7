"""Hybrid: a free prompt-lookup draft when the context offers one, else the model's shallow draft.

Lookup costs nothing but drafts only where the text repeats; the fallback (early exit or layer
skip) drafts everywhere at the price of its shallow forwards. Each round asks lookup first and the
fallback only when lookup found no match; feedback goes to whichever drafted that round.
"""

from __future__ import annotations

import torch

from selfspec.drafters.base import Draft, DraftContext, Drafter
from selfspec.drafters.lookup import PromptLookup


class Hybrid:
    name = "hybrid"

    def __init__(self, lookup: PromptLookup, fallback: Drafter):
        """lookup: the model-free drafter tried first; fallback: an EarlyExit or LayerSkip drafter
        for rounds where lookup finds no match."""
        self.lookup = lookup
        self.fallback = fallback
        self.exit_layer = fallback.exit_layer  # k of the model draft (None for layer skip)
        self.draft_len = max(lookup.draft_len, fallback.draft_len)  # the engine sizes the cache by it
        # Rounds each source drafted, summed over every generation since construction.
        self.lookup_rounds = 0
        self.model_rounds = 0
        self._source: Drafter | None = None

    def begin(self, ctx: DraftContext) -> None:
        self.lookup.begin(ctx)
        self.fallback.begin(ctx)
        self._source = None

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        draft = self.lookup.propose(pending, start, max_len)
        if len(draft):
            self._source = self.lookup
            self.lookup_rounds += 1
            return draft
        self._source = self.fallback
        draft = self.fallback.propose(pending, start, max_len)
        self.model_rounds += bool(len(draft))
        return draft

    def observe(self, n_accepted: int) -> None:
        self._source.observe(n_accepted)
