"""`selfspec tune`: measure α, c and v on the user's prompts, predict every (k, γ), time the best.

1. Decode every prompt greedily with plain AR and read, off one forward over each output, what
   every exit layer would draft (trace.py): exact drafted/accepted counts for early exit at any
   (k, γ) and for prompt lookup at any γ, without decoding once per configuration.
2. Time c(k), v(k, n) and the lookup search on this machine (costs.py).
3. Predict each candidate's speedup from its rounds and those costs (rounds.py).
4. Run the best few predictions (and the best of each family) for real, timed against AR on
   the same prompts in the same process, and check that their output is token-identical to AR's.
5. Keep the fastest measured configuration, or AR when nothing measured beats it, as the model's
   "tune" profile section, which `--method auto` uses.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from selfspec.core.engine import check_length
from selfspec.core.speculation import Speculation
from selfspec.tools.roofline import Roofline, roofline
from selfspec.tools.tune.costs import Costs, measure_costs
from selfspec.model.profiles import ENGINE, TUNE_SECTION
from selfspec.tools.tune.rounds import Rounds, predicted_speedup
from selfspec.tools.tune.trace import Trace, replay_early_exit, replay_feature, replay_lookup, trace

SECTION = TUNE_SECTION


@dataclass
class Candidate:
    speculation: Speculation  # early-exit (k, γ), lookup or hybrid (γ, n-gram) or feature (γ)
    rounds: Rounds  # replayed over every prompt
    cost: float  # c per draft token (early exit); 0 for lookup
    round_cost: float  # per-round draft cost (lookup's n-gram search); 0 for early exit
    predicted: float  # speedup over AR
    measured: float | None = None  # speedup over AR, timed (only for the checked candidates)
    measured_alpha: float | None = None
    same: int = 0  # timed prompts whose output was token-identical to AR's
    runs: int = 0  # timed prompts (0: not checked)

    @property
    def method(self) -> str:
        return self.speculation.method

    @property
    def exit_layer(self) -> int | None:
        return self.speculation.exit_layer

    @property
    def draft_len(self) -> int:
        return self.speculation.draft_len

    @property
    def identical(self) -> str | None:
        """"6/6"-style, or None when not checked."""
        return f"{self.same}/{self.runs}" if self.runs else None

    @property
    def label(self) -> str:
        if self.method in ("lookup", "feature"):
            return f"{self.method} γ={self.draft_len}"
        if self.method == "hybrid":
            return f"hybrid γ={self.draft_len} (lookup, else feature)"
        return f"early-exit k={self.exit_layer} γ={self.draft_len}"

    def to_json(self) -> dict:
        def r(x, n=3):
            return None if x is None else round(x, n)

        return {**self.speculation.to_dict(), "alpha": r(self.rounds.alpha),
                "alpha_by_position": [round(a, 3) for a in self.rounds.alpha_by_position()],
                "tokens_per_round": r(self.rounds.tokens_per_round), "cost": r(self.cost, 4),
                "round_cost": r(self.round_cost, 5), "predicted": r(self.predicted),
                "measured": r(self.measured), "measured_alpha": r(self.measured_alpha), "identical": self.identical}


@dataclass
class TuneResult:
    n_layers: int
    exit_layers: list[int]  # the k grid predicted and plotted
    max_draft_len: int
    lens_agreement: dict[int, float]  # k -> share of positions where the exit-k draft matches AR
    costs: Costs
    candidates: list[Candidate]
    ar_tokens_per_s: float
    checked: list[Candidate] = field(default_factory=list)
    roofline: Roofline | None = None  # weight bytes, bandwidth, memory floor against costs.step_s

    @property
    def best(self) -> Candidate | None:
        """The fastest timed candidate that beat AR with identical output; None: AR is fastest."""
        good = [c for c in self.checked if c.runs and c.measured > 1.0 and c.same == c.runs]
        return max(good, key=lambda c: c.measured, default=None)

    def choice(self) -> dict:
        """What `--method auto` runs (SelfSpecModel.tuned reads it back): the best's speculation, else AR."""
        best = self.best
        return {"exit_layer": None, "draft_len": None, **(best.speculation if best else Speculation("ar")).to_dict()}

    def profile_section(self, **setup) -> dict:
        best = self.best
        return {
            **self.choice(),
            "measured_speedup": round(best.measured, 3) if best else 1.0,
            "predicted_speedup": round(best.predicted, 3) if best else 1.0,
            "ar_tokens_per_s": round(self.ar_tokens_per_s, 2),
            **setup,
            "engine": ENGINE,
            "tuned": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "alpha_by_layer": {str(k): round(a, 3) for k, a in self.lens_agreement.items()},
            "costs": self.costs.to_json(),
            "roofline": self.roofline.to_json() if self.roofline else None,
            "checked": [c.to_json() for c in self.checked],
            "candidates": [c.to_json() for c in self.candidates],
        }

    def table(self, top: int = 10) -> str:
        """Markdown: the best predictions, with the timed ones' measured speedup."""
        rows = ["| config | α | tokens/round | c | v(γ+1) | predicted | measured | = AR |", "|---|---|---|---|---|---|---|---|"]
        shown = sorted(self.candidates, key=lambda c: -c.predicted)[:top]
        shown += [c for c in self.checked if c not in shown]
        for c in shown:
            v = self.costs.verify[c.exit_layer or 0].get(c.draft_len + 1)
            rows.append(f"| {c.label} | {_f(c.rounds.alpha)} | {_f(c.rounds.tokens_per_round)} | "
                        f"{_f(c.cost if c.method != 'lookup' else c.round_cost)} | {_f(v)} | {c.predicted:.2f}× | "
                        f"{'–' if c.measured is None else f'{c.measured:.2f}×'} | {c.identical or '–'} |")
        return "\n".join(rows)


def default_exit_grid(n_layers: int, size: int = 8) -> list[int]:
    """Exit layers to predict: `size` evenly spaced from a quarter of the depth to the last-but-one
    layer (shallower exits agree with the model too rarely to pay on any model we measured)."""
    lo, hi = max(1, n_layers // 4), max(1, n_layers - 1)
    return sorted({int(round(x)) for x in np.linspace(lo, hi, size)})


def tune(model, prompts: list[str], *, max_new_tokens: int = 64, exit_layers=None, max_draft_len: int = 8,
         lookup: bool = True, ngram: int = 3, check: int = 3, repeats: int = 3, progress: bool = True) -> TuneResult:
    if max_draft_len < 1 or max_new_tokens < 2 or check < 0:
        raise ValueError("need max_draft_len >= 1, max_new_tokens >= 2 and check >= 0")
    n_layers = model.n_layers
    grid = sorted(set(exit_layers or default_exit_grid(n_layers)))
    if not all(1 <= k < n_layers for k in grid):
        raise ValueError(f"exit layers must be in 1..{n_layers - 1} for {model.name}, got {grid}")
    encoded = [model.encode(p) for p in prompts]
    for ids in encoded:
        check_length(model.adapter, ids.numel(), max_new_tokens)

    # 1. AR outputs and what every exit layer would have drafted over them.
    model.generate(encoded[0], method="ar", max_new_tokens=4)  # warm-up
    traces: list[Trace] = []
    for ids in tqdm(encoded, desc="AR + logit lens", unit="prompt", disable=not progress, dynamic_ncols=True):
        out = model.generate(ids, method="ar", max_new_tokens=max_new_tokens)
        traces.append(trace(model.adapter, ids.tolist(), out.tokens, max_new_tokens, range(1, n_layers + 1)))
    lens = {k: float(np.mean(np.concatenate([t.hits[k][1:] for t in traces]))) for k in range(1, n_layers)}

    # 2. c, v and the lookup search, at a typical context length of these prompts.
    context = int(np.median([ids.numel() for ids in encoded])) + max_new_tokens // 2
    costs = measure_costs(model.adapter, context=context, exit_layers=grid, max_draft_len=max_draft_len,
                          repeats=repeats, progress=progress)

    # 3. Predictions.
    candidates = []
    for k in grid:
        for g in range(1, max_draft_len + 1):
            rounds = _merged(replay_early_exit(t, k, g) for t in traces)
            speed = predicted_speedup(rounds, cost=costs.draft[k], verify=costs.verify[k])
            candidates.append(Candidate(Speculation("early-exit", exit_layer=k, draft_len=g), rounds, costs.draft[k],
                                        0.0, speed))
    if lookup:
        for g in range(1, max_draft_len + 1):
            rounds = _merged(replay_lookup(t, g, ngram) for t in traces)
            speed = predicted_speedup(rounds, cost=0.0, round_cost=costs.lookup, verify=costs.verify[0])
            candidates.append(Candidate(Speculation("lookup", draft_len=g, ngram=ngram), rounds, 0.0, costs.lookup,
                                        speed))
    candidates += _feature_candidates(model, traces, costs, max_draft_len, ngram if lookup else None)

    # 4. Time the best predictions against AR, and the best of each family if not among them, so
    #    predicted-vs-measured covers both.
    ranked = sorted(candidates, key=lambda c: -c.predicted)
    checked = ranked[:check]
    for method in dict.fromkeys(c.method for c in ranked) if check else ():
        best_of = next(c for c in ranked if c.method == method)
        if best_of not in checked:
            checked.append(best_of)
    ar_tps = _timed_check(model, encoded, checked, max_new_tokens, progress)
    line = roofline(model.hf_model, costs.step_s)
    return TuneResult(n_layers, grid, max_draft_len, lens, costs, candidates, ar_tps, checked, line)


def _feature_candidates(model, traces: list[Trace], costs, max_draft_len: int, ngram: int | None) -> list[Candidate]:
    """Feature-head drafting at γ = 1 .. max_draft_len when the model has a head (its profile's or
    the shipped one), and (unless ngram is None: no lookup) the hybrid over it, lookup of up to γ
    tokens else the head's one: replayed with the drafters themselves over the traces; c is the
    replay's own proposal time per drafted token over the measured step."""
    from selfspec.drafters import make_drafter
    from selfspec.drafters.feature import FeatureDraft
    from selfspec.heads.feature_head import feature_head_for
    from selfspec.model.profiles import load_profile

    profile = load_profile(model.identity)
    try:
        head, draft_ids, _ = feature_head_for(profile, model.identity)
    except (ValueError, FileNotFoundError):
        return []
    drafters = [(Speculation("feature", draft_len=g), FeatureDraft(head, g, draft_ids=draft_ids))
                for g in range(1, max_draft_len + 1)]
    if ngram is not None:
        hybrids = [Speculation("hybrid", draft_len=g, ngram=ngram) for g in range(1, max_draft_len + 1)]
        drafters += [(spec, make_drafter(model.resolve(spec))) for spec in hybrids]
    out = []
    for spec, drafter in drafters:
        parts = [replay_feature(t, model.adapter, drafter) for t in traces if t.output]
        rounds = _merged(r for r, _ in parts)
        cost = sum(s for _, s in parts) / max(1, sum(rounds.drafted)) / costs.step_s
        speed = predicted_speedup(rounds, cost=cost, verify=costs.verify[0])
        out.append(Candidate(spec, rounds, cost, 0.0, speed))
    return out


def _merged(parts) -> Rounds:
    total = Rounds()
    for part in parts:
        total.extend(part)
    return total


def _timed_check(model, encoded, checked, max_new_tokens, progress) -> float:
    """Run AR and each checked candidate on every prompt, interleaved so machine noise spreads
    over all of them; fill in their measured speedup, α and identity with AR's output. Returns
    AR's tokens/s."""
    runs = [Speculation("ar")] + [c.speculation for c in checked]
    for spec in runs:  # warm every path up once
        model.generate(encoded[0], max_new_tokens=4, speculation=spec)
    tokens, seconds, same = [0] * len(runs), [0.0] * len(runs), [0] * len(runs)
    merged = [None] * len(runs)
    bar = tqdm(total=len(encoded) * len(runs), desc="timed check", unit="run", disable=not progress, dynamic_ncols=True)
    for ids in encoded:
        reference = None
        for i, spec in enumerate(runs):
            out = model.generate(ids, max_new_tokens=max_new_tokens, speculation=spec)
            reference = out.tokens if i == 0 else reference
            tokens[i] += out.stats.new_tokens
            seconds[i] += out.stats.wall_s
            same[i] += out.tokens == reference
            if merged[i] is None:
                merged[i] = out.stats
            else:
                merged[i].merge(out.stats)
            bar.update()
    bar.close()
    ar_tps = tokens[0] / seconds[0]
    for i, c in enumerate(checked, 1):
        c.measured = tokens[i] / seconds[i] / ar_tps
        c.measured_alpha = merged[i].alpha
        c.same, c.runs = same[i], len(encoded)
    return ar_tps


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"
