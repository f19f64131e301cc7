"""Hybrid: a free prompt-lookup draft when the context offers one, else the model's shallow draft,
each only while it pays for itself.

Lookup costs nothing but drafts only where the text repeats; the fallback (early exit or layer
skip) drafts everywhere at the price of its shallow forwards. Each round asks lookup first and the
fallback only when lookup found no match; feedback goes to whichever drafted that round.

The payoff gates, one per source: a source's rounds are timed (draft + verify, from the
generation's own statistics) and their committed tokens per second are compared with plain AR's,
one token per measured full step. While a source is slower (on a CPU a verify over γ + 1 rows
costs more than one step, so rarely-right drafts lose), its rounds become plain AR steps (an
empty draft), and it is tried again every `retry_every` rounds in case the context made it better. Any choice of draft keeps the output exact, so the gate only moves speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.core.draft import Draft, DraftContext, Drafter
from selfspec.drafters.lookup import PromptLookup


@dataclass
class PayoffGate:
    retry_every: int = 16  # rounds between retries of a fallback found not worth it
    momentum: float = 0.7  # of the fallback's tokens/s estimate
    rate: float | None = None  # committed tokens per second of fallback rounds (smoothed)
    waited: int = 0  # rounds the fallback sat out since it was last tried

    def update(self, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        rate = tokens / seconds
        self.rate = rate if self.rate is None else self.momentum * self.rate + (1 - self.momentum) * rate
        self.waited = 0

    def worth_it(self, step_s: float | None) -> bool:
        """Should this round use the fallback? Yes until measured slower than AR, then every
        retry_every-th round."""
        if self.rate is None or not step_s or self.rate >= 1.0 / step_s:
            return True
        self.waited += 1
        if self.waited < self.retry_every:
            return False
        self.waited = 0
        return True


class Hybrid:
    name = "hybrid"

    def __init__(self, lookup: PromptLookup, fallback: Drafter, gate: bool = True):
        """lookup: the model-free drafter tried first; fallback: an EarlyExit or LayerSkip drafter
        for rounds where lookup finds no match; gate: skip the fallback while it is slower than AR."""
        self.lookup = lookup
        self.fallback = fallback
        # Kept across generations, like the drafters themselves.
        self.gates = {lookup: PayoffGate(), fallback: PayoffGate()} if gate else None
        self.exit_layer = fallback.exit_layer  # k of the model draft (None for layer skip)
        self.draft_len = max(lookup.draft_len, fallback.draft_len)  # the engine sizes the cache by it
        # Rounds each source drafted, summed over every generation since construction.
        self.lookup_rounds = 0
        self.model_rounds = 0
        self._source: Drafter | None = None
        self._untaught = False  # the last draft was cut where its source cannot be told (`cut`)

    @property
    def needs_step_time(self) -> bool:
        """The engine measures a step before decoding for drafters that say so: the gates compare
        each source's rate with one token a step."""
        return self.gates is not None

    @property
    def drafted_by(self) -> str | None:
        """Which source drafted the last round, by name (the engine's Round says so); None for a
        plain step."""
        return None if self._source is None else self._source.name

    def begin(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        self.lookup.begin(ctx)
        self.fallback.begin(ctx)
        self._source = None

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        self._spent, self._untaught = self._elapsed(), False
        draft = self.lookup.propose(pending, start, max_len)
        if len(draft):
            if not self._worth_it(self.lookup):
                self._source = None
                return Draft(tokens=draft.tokens[:0])  # a plain AR step
            self._source = self.lookup
            self.lookup_rounds += 1
            return draft
        if not self._worth_it(self.fallback):
            self._source = None
            return draft  # empty: a plain AR step
        self._source = self.fallback
        draft = self.fallback.propose(pending, start, max_len)
        self.model_rounds += bool(len(draft))
        return draft

    def cut(self, m: int) -> None:
        """A batch verifies only the first m tokens of the last draft: its source is told where it
        can be (`cut`), else not taught by the round; the gates count the round as it ran."""
        tell = getattr(self._source, "cut", None)
        if tell is not None:
            tell(m)
        else:
            self._untaught = True

    def observe(self, n_accepted: int) -> None:
        if self._source is None:
            return
        if not self._untaught:
            self._source.observe(n_accepted)
        self._untaught = False
        if self.gates is not None:
            self.gates[self._source].update(n_accepted + 1, self._elapsed() - self._spent)

    def _worth_it(self, source: Drafter) -> bool:
        return self.gates is None or self.gates[source].worth_it(self.ctx.stats.step_s)

    def _elapsed(self) -> float:
        """Draft plus verify time of this generation so far (the engine adds a round's times
        before calling observe)."""
        return self.ctx.stats.draft_s + self.ctx.stats.verify_s
