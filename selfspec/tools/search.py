"""`selfspec search`: find the static layer-skip set offline (Draft & Verify's Bayesian optimisation).

Each of the 2·L sublayers (attention and MLP of every layer) gets one variable in [0, 1]; a
sublayer is skipped when its variable exceeds 0.5. A Gaussian-process Bayesian optimiser
(`bayes_opt`, as the paper's code uses) proposes a setting, we decode the calibration prompts
greedily with that skip set (layer-skip drafter, adaptive draft stop) and feed back the measured
tokens/s, the quantity we want to maximise. A few known shapes (early exit at 3/4 depth, the
untuned default, skipping a block of middle attention sublayers) are probed first so the optimiser
starts from sensible points; then random initial points, then guided proposals.

Tokens/s on a 2-core CPU is noisy (±10% run to run); the best set is re-measured at the end and
reported next to plain AR on the same prompts, both in the same process.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from selfspec.drafters.layers.layer_skip import default_skip
from selfspec.model.skips import SkipSet


@dataclass
class Trial:
    skip: SkipSet
    tokens_per_s: float
    alpha: float | None
    mean_accepted_length: float | None
    cost: float | None


@dataclass
class SearchResult:
    best: Trial
    ar_tokens_per_s: float
    trials: list[Trial] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.best.tokens_per_s / self.ar_tokens_per_s if self.ar_tokens_per_s else 0.0

    def profile_section(self, *, draft_len: int, threshold: float, prompts: int, max_new_tokens: int,
                        dtype: str) -> dict:
        return {
            "skip": self.best.skip.to_json(),
            "describe": self.best.skip.describe(),
            "draft_len": draft_len,
            "threshold": threshold,
            "tokens_per_s": round(self.best.tokens_per_s, 3),
            "ar_tokens_per_s": round(self.ar_tokens_per_s, 3),
            "speedup": round(self.speedup, 3),
            "alpha": self.best.alpha,
            "mean_accepted_length": self.best.mean_accepted_length,
            "cost": self.best.cost,
            "trials": len(self.trials),
            "calibration_prompts": prompts,
            "max_new_tokens": max_new_tokens,
            "dtype": dtype,
            "searched": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }


def _names(n_layers: int) -> list[str]:
    return [f"{kind}{i:03d}" for i in range(n_layers) for kind in ("attn", "mlp")]


def to_params(skip: SkipSet, n_layers: int) -> dict[str, float]:
    return {name: float(int(name[-3:]) in (skip.attn if name.startswith("attn") else skip.mlp))
            for name in _names(n_layers)}


def from_params(params: dict[str, float]) -> SkipSet:
    attn = frozenset(int(k[-3:]) for k, v in params.items() if k.startswith("attn") and v > 0.5)
    mlp = frozenset(int(k[-3:]) for k, v in params.items() if k.startswith("mlp") and v > 0.5)
    return SkipSet(attn, mlp)


def starting_points(n_layers: int) -> list[SkipSet]:
    """Known shapes to probe before the optimiser's own proposals."""
    lo, hi = n_layers // 3, (2 * n_layers) // 3
    return [
        SkipSet.early_exit(max(1, (3 * n_layers) // 4), n_layers),
        default_skip(n_layers),
        SkipSet(attn=frozenset(range(lo, hi))),
    ]


def measure(model, prompts: list[str], *, method: str, max_new_tokens: int, **options) -> Trial:
    """Greedy decode every prompt; tokens/s over all of them, merged statistics."""
    tokens, seconds = 0, 0.0
    merged = None
    for prompt in prompts:
        out = model.generate(prompt, method=method, max_new_tokens=max_new_tokens, **options)
        tokens += out.stats.new_tokens
        seconds += out.stats.wall_s
        if merged is None:
            merged = out.stats
        else:
            merged.merge(out.stats)
    return Trial(options.get("skip") or SkipSet(), tokens / seconds if seconds else 0.0, merged.alpha,
                 merged.mean_accepted_length, merged.cost)


def search_skip_set(
    model,
    prompts: list[str],
    *,
    iterations: int = 40,
    random_points: int = 6,
    max_new_tokens: int = 32,
    draft_len: int = 8,
    threshold: float = 0.8,
    seed: int = 0,
    progress: bool = True,
) -> SearchResult:
    """Maximise measured tokens/s of the layer-skip drafter over skip sets (see module doc).
    `iterations` counts every evaluated skip set, starting points and random points included."""
    from bayes_opt import BayesianOptimization

    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    n = model.n_layers
    names = _names(n)
    optimizer = BayesianOptimization(f=None, pbounds={name: (0.0, 1.0) for name in names},
                                     random_state=seed, verbose=0, allow_duplicate_points=True)
    run = dict(method="layer-skip", max_new_tokens=max_new_tokens, draft_len=draft_len, threshold=threshold)
    bar = tqdm(total=iterations + 1, desc="search", unit="set", disable=not progress, dynamic_ncols=True)
    bar.set_postfix_str("measuring AR")
    measure(model, prompts[:1], method="ar", max_new_tokens=8)  # warm-up: first calls are slow
    ar = measure(model, prompts, method="ar", max_new_tokens=max_new_tokens)
    bar.update()
    trials: list[Trial] = []
    seen: dict[SkipSet, Trial] = {}
    queue = starting_points(n)
    rng = np.random.default_rng(seed)  # random starting points
    for step in range(iterations):
        if queue:
            skip = queue.pop(0)
        elif step < len(starting_points(n)) + random_points:
            skip = from_params({name: float(rng.random() < 0.3) for name in names})
        else:
            skip = from_params(optimizer.suggest())
        if not len(skip):  # skipping nothing is a full-depth draft: never faster than AR
            skip = SkipSet(attn=frozenset({n // 2}))
        trial = seen.get(skip)
        if trial is None:  # a proposal already measured is not measured (or registered) again
            trial = seen[skip] = measure(model, prompts, skip=skip, **run)
            optimizer.register(to_params(skip, n), trial.tokens_per_s)
        trials.append(trial)
        best = max(trials, key=lambda t: t.tokens_per_s)
        bar.set_postfix_str(f"best {best.tokens_per_s:.1f} tok/s (AR {ar.tokens_per_s:.1f}), "
                            f"last α {_fmt(trial.alpha)}")
        bar.update()
    bar.close()
    best = max(trials, key=lambda t: t.tokens_per_s)
    # Re-measure the winner and AR back to back: the winner's first figure is biased upward by
    # being the maximum of noisy measurements.
    again = measure(model, prompts, skip=best.skip, **run)
    ar_again = measure(model, prompts, method="ar", max_new_tokens=max_new_tokens)
    return SearchResult(best=again, ar_tokens_per_s=ar_again.tokens_per_s, trials=trials)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"
