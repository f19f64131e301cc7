"""ConfLayers (2026): confidence-adaptive layer skipping. The draft skips whole layers whose
confidence, read from the entropy of their sublayer outputs, is low for the current context.

Our form of the method, step by step:

1. Confidence. Every `every` verification rounds, one probe forward (`run_layers(write=False,
   hooks=Recorder())`: it writes nothing to the cache) runs the full model over the last W committed
   tokens and records each sublayer's output r, the residual it adds. For one token,
       p_j = r_j² / Σ_k r_k²          (the share of the update's energy in hidden dimension j)
       conf(r) = 1 - H(p) / log d      (d hidden dimensions; 0 = energy spread evenly, 1 = one dim)
   and a layer's confidence s_i is the mean of conf over its attention and MLP outputs and over
   the W tokens. Energy shares, unlike a softmax over magnitudes, need no temperature and do not
   change when r is scaled, so the score is about the update's shape, not its size.
   Why low confidence means skip: a sublayer that spreads its update evenly over every hidden
   dimension writes no particular feature; like isotropic noise it is nearly orthogonal to any
   direction later layers or the head read, so leaving it out moves the draft's logits least. A
   concentrated (low-entropy) update writes specific features the rest of the model relies on.
2. Local adaptive threshold. Layer i is skipped when s_i < m · median(s_{i-r} .. s_{i+r}), r = R
   but shrunk near the ends to keep the window centred: it is judged against its neighbours
   (confidence drifts with depth, so a global cut would skip one end of the model wholesale),
   scaled by a global multiplier m. Layers 0 and L-1 are never skipped. Before each selection m
   moves, by factors of 1.05, up (skip more) while the skipped fraction of the L layers is below
   the band skip_ratio ± band, and down while above it; when the band is narrower than one
   layer's share (few layers), it stops at whichever side is nearer skip_ratio. m starts at 1 each
   generation and carries over from one re-optimisation to the next.
3. Keep the best set by accepted length. A set's score is the mean accepted length (bonus
   included) over the drafting rounds of one period of `every` rounds it ran. At each period's end:
   - the set that ran becomes the best if it is the best set (its record is refreshed: context
     drifts, so the latest run counts) or scored at least the best's record; then re-optimise:
     probe, select, and adopt the candidate for the next period (its trial);
   - otherwise it was a candidate that did worse than the best: revert to the best set for the
     next period (no probe), which also re-measures the best; the period after that re-optimises.
4. Drafting: `draft_shallow` with the chosen set, at most γ = draft_len tokens, stopping after a
   token whose draft top-1 probability is below `threshold`.

Probe time and count go to stats.search_s and stats.searches, so they are not counted as draft time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from selfspec.core.draft import Draft, DraftContext
from selfspec.drafters.layers.shallow import draft_shallow
from selfspec.model.adapter import Recorder
from selfspec.model.skips import SkipSet


def sublayer_confidence(outputs: torch.Tensor) -> torch.Tensor:
    """outputs [..., tokens, hidden] -> confidence [...]: 1 - H(p)/log d per token, p the energy
    shares r²/Σr² over the hidden dimensions, averaged over tokens. An all-zero output adds
    nothing, so it scores 0 (as skippable as a perfectly diffuse one)."""
    energy = outputs.float().pow(2)  # [..., n, d]
    total = energy.sum(-1, keepdim=True)  # [..., n, 1]
    p = energy / total.clamp_min(torch.finfo(torch.float32).tiny)
    entropy = -torch.special.xlogy(p, p).sum(-1)  # [..., n]
    conf = 1 - entropy / math.log(outputs.shape[-1])
    conf = torch.where(total.squeeze(-1) > 0, conf, torch.zeros_like(conf))
    return conf.mean(-1)


def layer_confidence(record: dict, n_layers: int) -> torch.Tensor:
    """A probe's record {("attn"|"mlp", i): [1, n, hidden]} -> s [L], the mean of each layer's two
    sublayer confidences."""
    return torch.stack([
        (sublayer_confidence(record["attn", i]).mean() + sublayer_confidence(record["mlp", i]).mean()) / 2
        for i in range(n_layers)
    ])


def local_ratio(scores: torch.Tensor, radius: int = 2) -> torch.Tensor:
    """s [L] -> s_i / median(s_{i-r} .. s_{i+r}) [L]: each layer against its neighbours. The window
    stays centred (r = R, less near the ends), so a steady trend with depth gives ratios of 1."""
    n = scores.shape[0]
    medians = []
    for i in range(n):
        r = min(radius, i, n - 1 - i)
        medians.append(scores[i - r : i + r + 1].quantile(0.5))
    medians = torch.stack(medians)
    return scores / medians.clamp_min(1e-12)


def threshold_skip(ratios: torch.Tensor, multiplier: float) -> SkipSet:
    """Skip the layers under the local threshold, ratio_i < m; never the first or the last."""
    return SkipSet.layers(i for i in range(1, ratios.shape[0] - 1) if float(ratios[i]) < multiplier)


def adapt_multiplier(ratios: torch.Tensor, multiplier: float, target: float, band: float,
                     step: float = 1.05, max_steps: int = 200) -> float:
    """Move m by factors of `step` until the skipped fraction of the L layers lies in
    target ± band; if a single move jumps across the band, keep the side nearer the target."""
    n = ratios.shape[0]

    def fraction(m: float) -> float:
        return len(threshold_skip(ratios, m).skipped_layers()) / n

    lo, hi = target - band, target + band
    f = fraction(multiplier)
    if lo <= f <= hi:
        return multiplier
    up = f < lo  # too few skipped: raise the threshold
    for _ in range(max_steps):
        moved = multiplier * step if up else multiplier / step
        g = fraction(moved)
        if lo <= g <= hi:
            return moved
        if (up and g > hi) or (not up and g < lo):  # crossed the band: the nearer side wins
            return moved if abs(g - target) < abs(f - target) else multiplier
        multiplier, f = moved, g
    return multiplier


@dataclass
class KeepBest:
    """The best skip set seen, by mean accepted length per round (rule 3 of the module docstring)."""

    best: SkipSet | None = None
    best_score: float = -math.inf

    def close(self, skip: SkipSet, score: float) -> SkipSet | None:
        """The period that ran `skip` ended with mean accepted length `score`. Returns the set to
        revert to, or None: re-optimise."""
        if self.best is None or skip == self.best or score >= self.best_score:
            self.best, self.best_score = skip, score
            return None
        return self.best


class ConfLayers:
    name = "conflayers"
    exit_layer = None

    def __init__(self, draft_len: int = 8, threshold: float = 0.8, skip_ratio: float = 0.4, every: int = 8,
                 window: int = 16, band: float = 0.05, radius: int = 2):
        """draft_len: γ, the most tokens per round; threshold: stop drafting after a token whose
        draft top-1 probability is below it (0: always γ); skip_ratio: target fraction of layers
        skipped, kept within ± band; every: re-optimise every this many rounds; window: W, the
        committed tokens the probe scores; radius: R, neighbours on each side in the local median."""
        if draft_len < 1:
            raise ValueError(f"draft length must be >= 1, got {draft_len}")
        if not 0 <= skip_ratio < 1:
            raise ValueError(f"skip_ratio is a fraction of the layers in [0, 1), got {skip_ratio}")
        if every < 1 or window < 1 or radius < 1 or band < 0:
            raise ValueError(f"every, window and radius must be >= 1 and band >= 0, got {every}, {window}, "
                             f"{radius}, {band}")
        self.draft_len = draft_len
        self.threshold = threshold or 0.0
        self.skip_ratio = skip_ratio
        self.band = band
        self.every = every
        self.window = window
        self.radius = radius

    def begin(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        self.multiplier = 1.0  # m
        self.skip: SkipSet | None = None  # chosen at the first propose, once the prompt is cached
        self.keep = KeepBest()
        self._rounds = 0  # drafting rounds in this period
        self._length = 0  # their accepted lengths, summed
        self._drafted = 0

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        if self.skip is None or self._rounds >= self.every:
            self.skip = self._next_set()
        draft = draft_shallow(self.ctx, self.skip, pending, start, min(self.draft_len, max_len), self.threshold)
        self._drafted = len(draft)
        return draft

    def observe(self, n_accepted: int) -> None:
        if self._drafted:  # a round that drafted nothing (the last, at max_new_tokens) says nothing
            self._rounds += 1
            self._length += n_accepted + 1

    def _next_set(self) -> SkipSet:
        """Close the period (rule 3), then revert or re-optimise."""
        if self.skip is not None and self._rounds:
            revert = self.keep.close(self.skip, self._length / self._rounds)
            self._rounds = self._length = 0
            if revert is not None:
                return revert
        self._rounds = self._length = 0
        t = time.perf_counter()
        skip = self._search()
        if self.ctx.adapter.device.type == "cuda":
            torch.cuda.synchronize()
        self.ctx.stats.search_s += time.perf_counter() - t
        self.ctx.stats.searches += 1
        return skip

    def _search(self) -> SkipSet:
        """Probe the last W committed tokens (positions < cache.length; the cache is untouched),
        score the layers and pick the set under the adapted local threshold."""
        adapter, cache = self.ctx.adapter, self.ctx.cache
        end = cache.length
        first = max(0, end - self.window)
        ids = torch.tensor(self.ctx.committed[first:end], device=adapter.device)
        record = Recorder()
        adapter.run_layers(adapter.embed(ids), range(adapter.n_layers), first, cache, write=False, hooks=record)
        ratios = local_ratio(layer_confidence(record.outputs, adapter.n_layers), self.radius)  # [L]
        self.multiplier = adapt_multiplier(ratios, self.multiplier, self.skip_ratio, self.band)
        return threshold_skip(ratios, self.multiplier)
