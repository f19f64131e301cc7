"""Static layer skip (Draft & Verify, Zhang et al. 2023): the draft skips a fixed set of attention
and MLP sublayers, found offline by `selfspec search` and stored in the model's profile.

Adaptive draft stop, as in the paper: drafting stops after a token whose draft top-1 probability
is below a threshold, and the threshold follows the acceptance rate: after each verification
    AR~ <- β1·AR~ + (1-β1)·(accepted / drafted)
    th~ <- th + ε  if AR~ <= target  else  th - ε
    th  <- β2·th + (1-β2)·th~
so low acceptance raises the bar (shorter, surer drafts) and high acceptance lowers it.
Defaults (th 0.8, β1 0.5, β2 0.9, ε 0.01, target 0.9) are the paper code's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from selfspec.core.draft import Draft, DraftContext
from selfspec.drafters.layers.shallow import draft_shallow
from selfspec.model.skips import SkipSet

SECTION = "layer-skip"  # the profile section `selfspec search` writes


@dataclass
class AdaptiveThreshold:
    value: float = 0.8  # th: stop drafting below this draft top-1 probability
    target: float = 0.9  # the acceptance rate the threshold steers towards
    step: float = 0.01  # ε
    beta1: float = 0.5  # momentum of the acceptance-rate estimate
    beta2: float = 0.9  # momentum of the threshold
    rate: float | None = None  # AR~, the smoothed acceptance rate

    def update(self, n_accepted: int, n_drafted: int) -> None:
        if n_drafted == 0:
            return
        ar = n_accepted / n_drafted
        self.rate = ar if self.rate is None else self.beta1 * self.rate + (1 - self.beta1) * ar
        moved = self.value + self.step if self.rate <= self.target else self.value - self.step
        self.value = min(0.999, max(0.0, self.beta2 * self.value + (1 - self.beta2) * moved))


def default_skip(n_layers: int) -> SkipSet:
    """The untuned fallback: every other layer of the upper half, last layer kept (about a quarter
    of the model). A starting point only; `selfspec search` finds a better set per model."""
    return SkipSet.layers(range(n_layers // 2 + 1, n_layers - 1, 2))


class LayerSkip:
    name = "layer-skip"
    exit_layer = None

    def __init__(self, skip: SkipSet | None = None, draft_len: int = 8, threshold: float | None = 0.8,
                 adaptive: bool = True, profile: dict | None = None):
        """skip: the sublayers to skip (None: the profile's, else `default_skip`); draft_len: the
        most tokens per round; threshold: initial stop threshold (None or 0: always draft_len)."""
        if draft_len < 1:
            raise ValueError(f"draft length must be >= 1, got {draft_len}")
        section = (profile or {}).get(SECTION)
        if skip is None and section:
            skip = SkipSet.from_json(section["skip"])
        self.from_profile = skip is not None and section is not None
        self.skip = skip
        self.draft_len = draft_len
        self.threshold = AdaptiveThreshold(threshold) if threshold else None
        self.adaptive = adaptive

    def begin(self, ctx: DraftContext) -> None:
        n = ctx.adapter.n_layers
        if self.skip is None:
            self.skip = default_skip(n)
            print(f"selfspec: no layer-skip profile for this model; skipping {self.skip.describe()} "
                  "(untuned: run `selfspec search` to find a faster set)", file=sys.stderr)
        self.skip.check(n)
        self.ctx = ctx
        self._drafted = 0

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        threshold = self.threshold.value if self.threshold else 0.0
        draft = draft_shallow(self.ctx, self.skip, pending, start, min(self.draft_len, max_len), threshold)
        self._drafted = len(draft)
        return draft

    def observe(self, n_accepted: int) -> None:
        if self.threshold and self.adaptive:
            self.threshold.update(n_accepted, self._drafted)
