"""No draft at all: each round verifies only the pending token, i.e. plain autoregressive decoding
in the same engine, cache and sampler. The baseline every speedup is measured against."""

from __future__ import annotations

import torch

from selfspec.core.draft import Draft, DraftContext


class Autoregressive:
    name = "ar"
    exit_layer = None
    draft_len = 0

    def begin(self, ctx: DraftContext) -> None:
        self._empty = torch.empty(0, dtype=torch.long, device=ctx.adapter.device)

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        return Draft(tokens=self._empty)

    def observe(self, n_accepted: int) -> None:
        pass
