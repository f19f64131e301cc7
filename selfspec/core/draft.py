"""The one drafter interface.

A drafter proposes γ tokens after the pending token (committed, not yet fed to the model).
Lifecycle, the same for every drafter: `begin` once per generation, then per round `propose`
and `observe(n_accepted)`. Adaptive drafters learn in `observe`; static ones ignore it. A drafter
that reads `stats.step_s` while it drafts (the hybrid's payoff gates) sets `needs_step_time`; for
the others the engine measures that step only when c is first read, after the last token. A
drafter that delegates to others (the hybrid) names the one that drafted each round in `drafted_by`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from selfspec.model.adapter import ModelAdapter
from selfspec.model.cache import KVCache
from selfspec.core.sampling import SamplingParams
from selfspec.core.stats import GenerationStats


@dataclass
class DraftContext:
    adapter: ModelAdapter
    cache: KVCache
    sampling: SamplingParams
    generator: torch.Generator | None
    prompt_ids: torch.Tensor  # [prompt_len]
    # Every token fed or to be fed, by position: the prompt, then each committed token; the last
    # entry is the pending token. The engine appends; drafters only read (lookup, matchness).
    committed: list[int]
    # This generation's statistics: drafters that spend time choosing layers add it to
    # stats.search_s (and count stats.searches), so it is not mistaken for draft time.
    stats: GenerationStats
    # Whether a draft may be siblings (Draft.siblings): a lone sequence's verify in the fused layer
    # (the batched verify, verify_rows, takes chains only).
    siblings: bool = False

    @property
    def shared(self) -> bool:
        """Whether this sequence's verifies may be shared with others' (the batch scheduler, which
        takes chains only): its drafts then carry Draft.confidence, for the batch to weigh."""
        return not self.siblings


@dataclass
class Draft:
    tokens: torch.Tensor  # [γ] long; γ may be 0 (plain autoregressive step)
    draft_probs: torch.Tensor | None = None  # q [γ, vocab]; None when greedy
    # KV reuse (LayerSkip): layers < exit_layer already ran, and wrote their KV, for the pending
    # token and the first γ-1 draft tokens; exit_hidden [1, γ, hidden] are their layer-k states.
    # [1, γ+1, hidden]: they ran for the last draft token too (Saguaro), and the verify skips them.
    exit_layer: int | None = None
    exit_hidden: torch.Tensor | None = None
    # Siblings: tokens are alternatives for the one position after the pending token, not a chain;
    # the verify runs each beside the pending token (ModelAdapter.run_layers' siblings) and the
    # round commits at most one of them (verifier.verify_siblings). Only where the engine says
    # DraftContext.siblings.
    siblings: bool = False
    # The drafter's proposal was not verified (a batch ran this round as a plain step, or never
    # asked it): the round teaches the drafter nothing (no observe).
    dropped: bool = False
    # Each token's chance of being accepted given the ones before it were, as the drafter estimates
    # it (suffix decoding: its match's agreement, calibrated by what was accepted); None: no
    # estimate. The batch scheduler weighs which drafted tokens to verify by it (given where
    # DraftContext.shared: a lone sequence's drafts spend nothing on it).
    confidence: list[float] | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]


class Drafter(Protocol):
    name: str
    exit_layer: int | None
    draft_len: int

    def begin(self, ctx: DraftContext) -> None: ...

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        """Draft up to min(γ, max_len) tokens after `pending` (a [1] tensor at position `start`)."""
        ...

    def observe(self, n_accepted: int) -> None:
        """After each verify: how many of the last draft's tokens were accepted."""
        ...

    # Optional: `cut(m)`, called before the verify when a batch verifies only the first m tokens of
    # the last draft (Decoding.cut); `observe` then counts from those m. A drafter without it is not
    # told of a cut round (no observe, as for a dropped draft).
