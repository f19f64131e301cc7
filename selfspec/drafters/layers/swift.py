"""SWIFT (Xia et al., ICLR 2025): self-speculative decoding that finds its skip set on the fly.

No offline search, no profile: the drafter learns which sublayers to skip while it decodes.
  - Optimisation phase: each round, before drafting, one search iteration proposes a candidate
    skip set (random search around the best set; a Bayesian-optimisation proposal every `every`
    iterations) and scores it by *matchness*: one parallel draft-mode forward over the last
    `window` tokens whose KV is in the cache, = the share of them whose draft argmax is the token
    that actually came next (under greedy decoding, the full model's own prediction). The best
    set is kept. The phase ends at a matchness of `max_score`, after `budget` iterations, or after
    `patience` iterations without improvement.
  - Acceleration phase: no more search; every round drafts with the best set.
  - Confidence-aware drafting in both phases: stop after a draft token whose top-1 probability is
    below `threshold` (0.8), at most `draft_len` (25) tokens.
Defaults follow the paper and its reference scripts: skip ratio 0.45 of the 2·L sublayers
(attention and MLP chosen independently; the first and last layer are never skipped), window 32,
a Bayesian proposal every 25 iterations, at most 1000 iterations, 300 without improvement. The
stop score, 0.9, is ours.

The search lives on the drafter, not on a generation: `begin` keeps it, and the API reuses one
drafter per set of options, so later prompts of a session start from the learned set and the
spent budget. Its randomness is its own (seeded), never the sampling generator's.

Our choices and deviations:
  - Initial set: whole layers spread evenly over layers 1 .. L-2 (deterministic; the search's
    first iteration scores it).
  - Random step: swap a few skipped sublayers of the best set for kept ones (one swap half the
    time, two a quarter, ...), skipping sets already tried; the skip count never changes.
  - Bayesian step: one continuous variable per skippable sublayer, the top-n thresholded into a
    set; every scored set is registered as its 0/1 point. To keep a proposal near 0.1 s on a
    CPU, the GP is fitted to a bounded memory (the best and the latest distinct sets, 128 in
    all) and the acquisition (UCB) is maximised by random sampling only, without L-BFGS.
  - A candidate's score comes from the context of the round it was tried in, as in the paper,
    so scores of different rounds are compared as if on one context.
  - One draft chain per round (no top-k draft tree); no re-optimisation once accelerating.
"""

from __future__ import annotations

import math
import random
import time
from typing import NamedTuple

import torch

from selfspec.core.draft import Draft, DraftContext
from selfspec.drafters.layers.shallow import draft_shallow
from selfspec.model.skips import SkipSet

KINDS = ("attn", "mlp")


class Trial(NamedTuple):
    skip: SkipSet
    score: float
    source: str  # "initial", "random" or "bayes": which step proposed it ("given" if told unasked)


class SkipSearch:
    """The search alone, model-free: `propose()` a skip set, `tell(skip, score)` its score.

    Sublayers are numbered j = 2·(layer-1) + (0 attention, 1 MLP) over layers 1 .. L-2; every
    candidate skips exactly `n_skip` of them. Iteration t (0-based, = sets told so far) proposes:
    t = 0 the initial set, t a positive multiple of `every` a Bayesian proposal, else a random
    step around the best set.
    """

    def __init__(self, n_layers: int, skip_ratio: float = 0.45, every: int = 25, budget: int = 1000,
                 max_score: float = 0.9, patience: int | None = 300, seed: int = 0, memory: int = 128):
        """every: iterations between Bayesian proposals (0: none); budget: most iterations;
        max_score: stop once the best score reaches it; patience: stop after this many
        iterations without a better set (None: never); memory: most sets the GP is fitted to."""
        check_options(skip_ratio, every, budget, patience)
        self.n_layers = n_layers
        self.sublayers = [(kind, i) for i in range(1, n_layers - 1) for kind in KINDS]
        self.n_skip = min(len(self.sublayers), round(skip_ratio * 2 * n_layers))
        self.every, self.budget, self.max_score, self.patience = every, budget, max_score, patience
        self.memory = memory
        self.rng = random.Random(seed)
        self.initial = self._to_skip(_spread_layers(len(self.sublayers), self.n_skip))
        # best_at: iterations told when the best last improved (for patience)
        self.best, self.best_score, self.best_at = self.initial, -math.inf, 0
        self.history: list[Trial] = []
        self.tried: dict[frozenset[int], float] = {}  # sublayer set -> latest score, oldest first
        self._proposed: tuple[SkipSet, str] | None = None

    @property
    def iterations(self) -> int:
        return len(self.history)

    @property
    def done(self) -> bool:
        """The stop rule: score reached, budget spent, patience lost, or nothing to choose."""
        return (
            self.best_score >= self.max_score
            or self.iterations >= self.budget
            or (self.patience is not None and self.iterations - self.best_at >= self.patience)
            or self.n_skip in (0, len(self.sublayers))
        )

    def propose(self) -> SkipSet:
        t = self.iterations
        if t == 0:
            skip, source = self.initial, "initial"
        elif self.every and t % self.every == 0:
            skip, source = self._bayes(), "bayes"
        else:
            skip, source = self._random(), "random"
        self._proposed = (skip, source)
        return skip

    def tell(self, skip: SkipSet, score: float) -> None:
        source = self._proposed[1] if self._proposed and self._proposed[0] == skip else "given"
        self._proposed = None
        self.history.append(Trial(skip, score, source))
        key = self._to_indices(skip)
        self.tried.pop(key, None)  # re-insert: the dict's order is recency
        self.tried[key] = score
        if score > self.best_score:
            self.best, self.best_score, self.best_at = skip, score, self.iterations

    # -- proposals ----------------------------------------------------------------------------

    def _random(self) -> SkipSet:
        """Swap s skipped sublayers of the best set for kept ones, s geometric (1, 2, ... with
        probability 1/2, 1/4, ...); try again (a few times) if that set was tried already."""
        best = sorted(self._to_indices(self.best))
        kept = sorted(set(range(len(self.sublayers))) - set(best))
        limit = min(len(best), len(kept))
        if limit == 0:
            return self.best
        for _ in range(16):
            s = 1
            while s < limit and self.rng.random() < 0.5:
                s += 1
            out = set(self.rng.sample(best, s))
            candidate = (set(best) - out) | set(self.rng.sample(kept, s))
            if frozenset(candidate) not in self.tried:
                break
        return self._to_skip(candidate)

    def _bayes(self) -> SkipSet:
        """Fit a GP to the remembered sets' scores, take the point maximising UCB, skip its top
        n_skip coordinates."""
        # Imported here: bayes_opt pulls in scikit-learn (seconds), needed only every `every` rounds.
        import warnings

        from bayes_opt import BayesianOptimization
        from threadpoolctl import threadpool_limits

        names = [f"{kind}{i:03d}" for kind, i in self.sublayers]
        optimizer = BayesianOptimization(
            f=None, pbounds={name: (0.0, 1.0) for name in names},
            acquisition_function=_sampled_ucb(),
            random_state=self.rng.randrange(2**31), verbose=0,
        )
        for key, score in self._remembered():
            optimizer.space.register({name: float(j in key) for j, name in enumerate(names)}, score)
        # A GP over ~100 points is too small for threads; on a busy CPU they only contend.
        with threadpool_limits(limits=1), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sklearn's length-scale ConvergenceWarnings
            point = optimizer.suggest()  # {name: value in [0, 1]}
        values = [point[name] for name in names]
        top = sorted(range(len(names)), key=lambda j: -values[j])[: self.n_skip]
        return self._to_skip(top)

    def _remembered(self) -> list[tuple[frozenset[int], float]]:
        """The GP's data: the best memory/2 sets, then the latest, memory in all."""
        items = list(self.tried.items())
        if len(items) <= self.memory:
            return items
        best = sorted(items, key=lambda kv: -kv[1])[: self.memory // 2]
        chosen = {key for key, _ in best}
        latest = [kv for kv in reversed(items) if kv[0] not in chosen][: self.memory - len(best)]
        return best + latest

    # -- encoding -----------------------------------------------------------------------------

    def _to_skip(self, indices) -> SkipSet:
        chosen = [self.sublayers[j] for j in indices]
        return SkipSet(frozenset(i for kind, i in chosen if kind == "attn"),
                       frozenset(i for kind, i in chosen if kind == "mlp"))

    def _to_indices(self, skip: SkipSet) -> frozenset[int]:
        return frozenset(j for j, (kind, i) in enumerate(self.sublayers)
                         if i in (skip.attn if kind == "attn" else skip.mlp))


def check_options(skip_ratio: float, every: int, budget: int, patience: int | None) -> None:
    if not 0.0 < skip_ratio < 1.0:
        raise ValueError(f"skip ratio must be in (0, 1), got {skip_ratio}")
    if every < 0 or budget < 0:
        raise ValueError(f"every and budget must be >= 0, got {every} and {budget}")
    if patience is not None and patience < 1:
        raise ValueError(f"patience must be >= 1 or None, got {patience}")


def _spread_layers(n_sublayers: int, n_skip: int) -> list[int]:
    """n_skip sublayer indices: whole layers spread evenly (their attention and MLP, j and j+1),
    plus one attention sublayer when n_skip is odd."""
    n_layers = n_sublayers // 2
    whole = n_skip // 2
    layers = [int((k + 0.5) * n_layers / whole) for k in range(whole)] if whole else []
    chosen = [j for layer in layers for j in (2 * layer, 2 * layer + 1)]
    if n_skip % 2:
        free = [layer for layer in range(n_layers) if layer not in layers]
        chosen.append(2 * free[len(free) // 2])
    return chosen


def _sampled_ucb():
    """UCB maximised over random points only: L-BFGS with numerical gradients in ~50 dimensions
    costs seconds to minutes per proposal, and a set only keeps the point's top-n ranking."""
    from bayes_opt.acquisition import UpperConfidenceBound

    class SampledUCB(UpperConfidenceBound):
        def suggest(self, gp, target_space, *args, fit_gp=True, **kwargs):
            # (n_random, n_smart) positionally: the second's keyword name differs between versions
            return super().suggest(gp, target_space, 2000, 0, fit_gp, **kwargs)

    return SampledUCB()  # seeded by the optimiser's random_state at each suggest


def matchness(ctx: DraftContext, skip: SkipSet, window: int) -> float:
    """Share of the last `window` cached positions whose draft-mode argmax (skipping `skip`)
    is the token that came next. One probe forward: reads the cache, writes nothing."""
    adapter, end = ctx.adapter, ctx.cache.length  # positions < end are valid; committed[end] is pending
    begin = max(0, end - window)
    ids = torch.tensor(ctx.committed[begin:end], device=adapter.device)  # [n]
    nexts = torch.tensor(ctx.committed[begin + 1 : end + 1], device=adapter.device)  # [n]
    h = adapter.run_layers(adapter.embed(ids), range(adapter.n_layers), begin, ctx.cache, skip=skip, write=False)
    guesses = adapter.head(h).argmax(-1)  # [n]
    return float((guesses == nexts).float().mean())


class Swift:
    name = "swift"
    exit_layer = None

    def __init__(self, draft_len: int = 25, threshold: float = 0.8, skip_ratio: float = 0.45, every: int = 25,
                 budget: int = 1000, max_score: float = 0.9, patience: int | None = 300, window: int = 32,
                 steps: int = 1, seed: int = 0):
        """draft_len: most tokens per round; threshold: stop drafting after a token whose draft
        top-1 probability is below it (0: always draft_len); skip_ratio: share of the 2·L
        sublayers skipped; every: iterations between Bayesian proposals (0: random search only);
        budget, max_score, patience: the search's stop rule (see SkipSearch); window: tokens
        matchness is scored on; steps: search iterations per round while optimising."""
        if draft_len < 1:
            raise ValueError(f"draft length must be >= 1, got {draft_len}")
        if window < 1 or steps < 1:
            raise ValueError(f"window and steps must be >= 1, got {window} and {steps}")
        check_options(skip_ratio, every, budget, patience)  # now, before any model work
        self.draft_len = draft_len
        self.threshold = threshold or 0.0
        self.window, self.steps = window, steps
        self._search_options = dict(skip_ratio=skip_ratio, every=every, budget=budget, max_score=max_score,
                                    patience=patience, seed=seed)
        self.search: SkipSearch | None = None  # made in the first `begin`, kept after it

    @property
    def skip(self) -> SkipSet | None:
        """The set drafts use now: the best found so far."""
        return self.search.best if self.search else None

    def begin(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        if self.search is None or self.search.n_layers != ctx.adapter.n_layers:  # a new model: start over
            self.search = SkipSearch(ctx.adapter.n_layers, **self._search_options)

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        if not self.search.done:
            self._optimise()
        return draft_shallow(self.ctx, self.search.best, pending, start, min(self.draft_len, max_len), self.threshold)

    def observe(self, n_accepted: int) -> None:
        pass

    def _optimise(self) -> None:
        """`steps` search iterations on the current context, timed as search, not draft."""
        stats, t = self.ctx.stats, time.perf_counter()
        for _ in range(self.steps):
            if self.search.done:
                break
            skip = self.search.propose()
            self.search.tell(skip, matchness(self.ctx, skip, self.window))
            stats.searches += 1
        stats.search_s += time.perf_counter() - t
