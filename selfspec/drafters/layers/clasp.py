"""CLaSp (Chen et al. 2025, "In-Context Layer Skip for Self-Speculative Decoding"): the draft skips
M whole layers, re-chosen from the current context by dynamic programming over the layers.

The DP, for one token whose full-model hidden states x*_i (after layer i) are the target:
    dp[i][j] = the state after layers 0 .. i with j of them skipped, the one closest (cosine) to x*_i
    dp[i][j] = argmax_cos{ layer_i(dp[i-1][j]),  dp[i-1][j-1] }        (run layer i, or skip it)
and the skip set is dp[L-1][M]'s, by backtracking. It is greedy layer by layer (a state kept at
layer i is the best there, not necessarily the best start for the rest), hence "approximate" DP.

Our form:
- When a DP is due, `propose` runs it on the pending token at position `start` (the cache is valid
  below it). All candidates of layer i are one batch, [≤M+1, 1, hidden], in one cache probe
  (`run_layers(..., write=False)`); row j = 0 only ever runs, so it *is* the full-model trajectory
  x*. The paper takes x* from the last verified token's hidden states in the verify pass; we
  recompute it as that row instead, at no extra probe calls, and for the pending token, the
  newest one (the verify produced it but never ran it).
- Choices stay on the device until one transfer for the backtrack: no host sync per layer.
- every = 4: the paper re-optimises after every verification (every = 1); re-planning every few
  rounds amortises the DP over several drafts. A DP is L probe calls of up to M+1 rows: weights
  read once, as in one forward, but M+1 times the compute (about two full forwards for SmolLM2 on
  CPU). Its cost goes to stats.search_s and stats.searches, not to draft time.
- skip_ratio = 0.4: M = round(0.4·L). M is a per-model hyperparameter in the paper: a larger M makes
  drafts cheaper and less often accepted. We stay below half because small models, such as the
  bundled 30-layer SmolLM2, have less depth to spare than the paper's LLaMA3s. Tune per model.
- The first and last layers are never skipped (M is capped at L-2): the first writes the residual
  stream every later layer reads, the last shapes it for the head; pinning them also shrinks the DP.
- threshold = 0.8: the confidence stop shared by the shallow drafters (stop after a draft token
  whose top-1 probability is below it; 0 or None: always draft_len); not taken from the paper.
- draft_len = 8: γ, the most tokens per round.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from selfspec.core.draft import Draft, DraftContext
from selfspec.drafters.layers.shallow import draft_shallow
from selfspec.model.skips import SkipSet


def plan_skips(
    run_layer: Callable[[int, torch.Tensor], torch.Tensor],
    h0: torch.Tensor,
    n_layers: int,
    m: int,
    skippable: Iterable[int] | None = None,
) -> SkipSet:
    """CLaSp's DP: the M whole layers to skip whose skipped forward of h0 stays closest, layer by
    layer, to the full one. run_layer(i, states [b, ...]) -> [b, ...] runs layer i on b states at
    once; it is called once per layer. h0 [1, ...]: the input of layer 0. skippable: the layers
    the DP may skip (all by default); M is capped at their number."""
    skippable = set(range(n_layers) if skippable is None else skippable)
    m = min(m, len(skippable))
    states = h0  # [rows, ...]: row j = dp[i][j]; rows exist for j <= what layers 0..i allow
    choices: list[torch.Tensor | None] = []  # per layer: [rows] True where row j skipped it
    for i in range(n_layers):
        run = run_layer(i, states)  # [r, ...]; run[0] is the full model's x*_i
        r = states.shape[0]
        if i not in skippable or m == 0:
            states = run
            choices.append(None)
            continue
        rows = min(r + 1, m + 1)
        run_c = run if rows == r else torch.cat([run, run[-1:]])  # padding row, never taken
        skip_c = torch.cat([states[:1], states[: rows - 1]])  # row j <- dp[i-1][j-1]; row 0 padding
        j = torch.arange(rows, device=run.device)
        target = run[:1]
        cos_run = torch.where(j < r, _cosine(run_c, target), -torch.inf)
        cos_skip = torch.where(j > 0, _cosine(skip_c, target), -torch.inf)
        skipped = cos_skip > cos_run  # ties run the layer
        states = torch.where(skipped.view(-1, *[1] * (run.dim() - 1)), skip_c, run_c)
        choices.append(skipped)
    return SkipSet.layers(_backtrack(choices, m))


def _cosine(states: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each row of states [b, ...] to target [1, ...], in float32: [b]."""
    return F.cosine_similarity(states.flatten(1).float(), target.flatten(1).float(), dim=-1)


def _backtrack(choices: list[torch.Tensor | None], m: int) -> list[int]:
    """The layers dp[L-1][m] skipped, walking its choices back (one device-to-host transfer)."""
    flags = [c for c in choices if c is not None]
    flat = torch.cat(flags).tolist() if flags else []
    per_layer, at = [], 0
    for c in choices:
        per_layer.append(None if c is None else flat[at : at + c.numel()])
        at += 0 if c is None else c.numel()
    skipped, j = [], m
    for i in reversed(range(len(choices))):
        if per_layer[i] is not None and per_layer[i][j]:
            skipped.append(i)
            j -= 1
    return skipped


class Clasp:
    name = "clasp"
    exit_layer = None

    def __init__(self, draft_len: int = 8, threshold: float | None = 0.8, skip_ratio: float = 0.4,
                 every: int = 4):
        """draft_len: γ, the most tokens per round; threshold: confidence stop (None or 0: off);
        skip_ratio: share of layers to skip, M = round(skip_ratio·L); every: rounds per DP."""
        if draft_len < 1:
            raise ValueError(f"draft length must be >= 1, got {draft_len}")
        if not 0.0 <= skip_ratio < 1.0:
            raise ValueError(f"skip ratio must be in [0, 1), got {skip_ratio}")
        if every < 1:
            raise ValueError(f"every must be >= 1 (rounds between DPs), got {every}")
        self.draft_len = draft_len
        self.threshold = threshold or 0.0
        self.skip_ratio = skip_ratio
        self.every = every

    def begin(self, ctx: DraftContext) -> None:
        n = ctx.adapter.n_layers
        self.ctx = ctx
        self.m = round(self.skip_ratio * n)
        self.skippable = range(1, n - 1)  # first and last layers pinned (module docstring)
        self.skip = SkipSet()
        self._rounds = 0  # drafting rounds so far; a DP runs on every `every`-th, starting with the first

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        gamma = min(self.draft_len, max_len)
        if gamma <= 0:
            return Draft(tokens=pending.new_empty(0))
        if self._rounds % self.every == 0:
            self.skip = self.plan(pending, start)
        self._rounds += 1
        return draft_shallow(self.ctx, self.skip, pending, start, gamma, self.threshold)

    def plan(self, pending: torch.Tensor, start: int) -> SkipSet:
        """Run the DP on the pending token at `start`, timing it as search, not draft."""
        adapter, cache, stats = self.ctx.adapter, self.ctx.cache, self.ctx.stats
        t = time.perf_counter()

        def run_layer(i: int, states: torch.Tensor) -> torch.Tensor:  # [b, 1, hidden] -> same
            return adapter.run_layers(states, [i], start, cache, write=False)

        skip = plan_skips(run_layer, adapter.embed(pending), adapter.n_layers, self.m, self.skippable)
        stats.search_s += time.perf_counter() - t  # the backtrack's .tolist() synchronised
        stats.searches += 1
        return skip

    def observe(self, n_accepted: int) -> None:
        pass
