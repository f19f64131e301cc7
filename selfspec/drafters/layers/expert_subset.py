"""Expert-subset drafting for mixture-of-experts models: the draft routes each token to fewer experts.

A MoE layer's cost is dominated by the k experts each token visits. The draft runs the model's own
layers (all of them, or 0 .. exit_layer-1 as in early exit) with each MoE layer sending a token
only to its `experts` best-scored experts (top-1 instead of top-k by default), using the model's
own router and expert weights (selfspec.model.moe.routed). The verify is the full model, unchanged.

KV: layers before the first MoE layer compute exactly what the full model does, so their draft KV
is reused; from the first MoE layer on the draft's hidden states differ, so its KV there is
draft-time KV the verify overwrites (the shallow draft's boundary moves to that layer).

An offloading engine could also prefer experts the draft already loaded; selfspec keeps every
expert in memory, so the budget only saves compute.
"""

from __future__ import annotations

import torch

from selfspec.model.adapter import UnsupportedModelError
from selfspec.core.draft import Draft, DraftContext
from selfspec.drafters.layers.shallow import draft_shallow
from selfspec.model.moe import experts_per_token
from selfspec.model.skips import SkipSet


class ExpertSubset:
    name = "expert-subset"

    def __init__(self, experts: int = 1, draft_len: int = 4, exit_layer: int | None = None):
        if experts < 1:
            raise ValueError(f"the expert budget must be >= 1, got {experts}")
        if draft_len < 1:
            raise ValueError(f"draft length must be >= 1, got {draft_len}")
        if exit_layer is not None and exit_layer < 1:
            raise ValueError(f"exit layer k must be >= 1, got {exit_layer}")
        self.experts = experts
        self.draft_len = draft_len
        self.exit_layer = exit_layer  # None: the draft runs every layer

    def begin(self, ctx: DraftContext) -> None:
        adapter = ctx.adapter
        top_k = experts_per_token(adapter.layers)
        if top_k is None:
            raise UnsupportedModelError(
                f"expert-subset drafts with fewer routed experts per mixture-of-experts layer, and "
                f"{adapter.config.model_type!r} is a dense model: use early-exit or layer-skip instead"
            )
        if self.experts > top_k:
            raise ValueError(f"this model routes each token to {top_k} experts per layer; "
                             f"the draft's budget must be 1..{top_k}, got {self.experts}")
        n = adapter.n_layers
        k = self.exit_layer or n
        if not 1 <= k <= n:
            raise ValueError(f"exit layer must be in 1..{n} for this {n}-layer model, got {k}")
        self.ctx = ctx
        self.skip = SkipSet.early_exit(k, n)  # empty at full depth

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        return draft_shallow(self.ctx, self.skip, pending, start, min(self.draft_len, max_len), experts=self.experts)

    def observe(self, n_accepted: int) -> None:
        pass
