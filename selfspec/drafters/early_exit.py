"""LayerSkip-style early exit: draft with layers 0 .. k-1 and the model's own final norm and head.

The draft writes the KV of layers < k for every token it feeds; those entries are exactly what
the full model computes for the same token, so the verify reuses them together with the exit
hidden states and only runs layers >= k over the draft (plus layers < k for the last draft
token, which the draft never fed). It is the shallow draft with the skip set "layers k .. L-1".
"""

from __future__ import annotations

import torch

from selfspec.drafters.base import Draft, DraftContext
from selfspec.drafters.shallow import draft_shallow
from selfspec.skips import SkipSet


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
        self.skip = SkipSet.early_exit(self.exit_layer, n)

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        return draft_shallow(self.ctx, self.skip, pending, start, min(self.draft_len, max_len))

    def observe(self, n_accepted: int) -> None:
        pass
