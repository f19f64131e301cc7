"""LayerSkip-style early exit: draft with layers 0 .. k-1 and the model's own final norm and head.

The draft writes the KV of layers < k for every token it feeds; those entries are exactly what
the full model computes for the same token, so the verify reuses them together with the exit
hidden states and only runs layers >= k over the draft (plus layers < k for the last draft
token, which the draft never fed). It is the shallow draft with the skip set "layers k .. L-1".

With an exit adapter (see selfspec.exit_adapter) the draft's logits are head(adapter(h_k)); the
verify still continues from the raw h_k.
"""

from __future__ import annotations

import torch

from selfspec.drafters.base import Draft, DraftContext
from selfspec.drafters.shallow import draft_shallow
from selfspec.exit_adapter import ExitAdapter
from selfspec.skips import SkipSet


class EarlyExit:
    name = "early-exit"

    def __init__(self, exit_layer: int, draft_len: int, exit_adapter: ExitAdapter | None = None):
        if exit_layer is None or exit_layer < 1:
            raise ValueError(f"exit layer k must be >= 1, got {exit_layer}")
        if draft_len < 1:
            raise ValueError(f"draft length must be >= 1, got {draft_len}")
        if exit_adapter is not None and exit_adapter.exit_layer != exit_layer:
            raise ValueError(f"the exit adapter was trained for k={exit_adapter.exit_layer}, not k={exit_layer}")
        self.exit_layer = exit_layer
        self.draft_len = draft_len
        self.exit_adapter = exit_adapter

    def begin(self, ctx: DraftContext) -> None:
        n = ctx.adapter.n_layers
        if not 1 <= self.exit_layer <= n:
            raise ValueError(f"exit layer must be in 1..{n} for this {n}-layer model, got {self.exit_layer}")
        if self.exit_adapter is not None:
            hidden = ctx.adapter.embed_tokens.embedding_dim
            if self.exit_adapter.hidden_size != hidden:
                raise ValueError(f"the exit adapter maps hidden size {self.exit_adapter.hidden_size}, "
                                 f"this model's is {hidden}")
            self.exit_adapter.to(device=ctx.adapter.device, dtype=ctx.adapter.dtype)
        self.ctx = ctx
        self.skip = SkipSet.early_exit(self.exit_layer, n)

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        return draft_shallow(self.ctx, self.skip, pending, start, min(self.draft_len, max_len),
                             transform=self.exit_adapter)

    def observe(self, n_accepted: int) -> None:
        pass
