"""What every generation reports about itself.

Terms, defined once for the whole package:
  k   exit layer: the draft runs decoder layers 0 .. k-1, then the model's own final norm and head.
  γ   draft length: tokens the drafter proposes per round (gamma in code).
  α   acceptance rate: accepted draft tokens / drafted tokens.
  c   draft cost: wall time of one draft token over wall time of one full one-token forward,
      both measured on this machine in this process (never assumed to be k/L).
  mean accepted length: tokens committed per verify round, the bonus/recovered token included,
      as is conventional (plain autoregressive decoding has exactly 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    method: str
    exit_layer: int | None = None  # k; None for methods without an exit layer
    draft_len: int = 0  # γ
    prompt_tokens: int = 0
    prefix_tokens: int = 0  # of them, read from a prefix store rather than prefilled
    new_tokens: int = 0
    rounds: int = 0  # verify forwards after the prefill
    drafted: int = 0
    accepted: int = 0
    # per draft position i: rounds that drafted it with every earlier draft token accepted
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)  # per draft position i: rounds that accepted it
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0  # prefill + all rounds, the figure tokens/s divides by
    step_s: float | None = None  # one full one-token forward, measured, for c (see measured_step_s)
    # Measures step_s when first asked for (`measured_step_s`), so that a generation whose c is
    # never read, or is read after its last token, does not wait for the probe's forwards.
    step_probe: Callable[[], float | None] | None = field(default=None, repr=False, compare=False)
    search_s: float = 0.0  # time adaptive drafters spent choosing layers (not in draft_s)
    searches: int = 0  # how many times they did
    kv_cache_bytes: int = 0  # the one KV cache this generation allocated (draft and verify share it)
    # Saguaro's speculation cache: rounds whose draft was ready when the verify before them ended
    # as predicted (hits), and rounds predicted otherwise, drafted as usual (misses).
    speculation_hits: int = 0
    speculation_misses: int = 0
    # The rounds, drafted and accepted tokens above by the source that drafted each round: the
    # drafter's name (a hybrid's: the one it asked that round, e.g. "suffix" or "feature"); "ar"
    # for rounds with no draft. {source: {"rounds", "drafted", "accepted"}}
    by_source: dict[str, dict[str, int]] = field(default_factory=dict)

    def record_round(self, n_drafted: int, n_accepted: int, source: str | None = None) -> None:
        """source: the drafter that drafted this round (None: this generation's method)."""
        self.rounds += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        key = (source or self.method) if n_drafted else "ar"
        counts = self.by_source.get(key)
        if counts is None:  # not setdefault: its default would be a new dict every round
            counts = self.by_source[key] = {"rounds": 0, "drafted": 0, "accepted": 0}
        counts["rounds"] += 1
        counts["drafted"] += n_drafted
        counts["accepted"] += n_accepted
        grow = n_drafted - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(min(n_drafted, n_accepted + 1)):  # positions the verify reached
            self.drafted_at[i] += 1
        for i in range(n_accepted):
            self.accepted_at[i] += 1

    def merge(self, other: GenerationStats) -> None:
        """Add another generation's counts and times, for totals over many prompts. step_s becomes
        the drafted-token-weighted mean, so `cost` stays total draft time over the full-forward
        time the same tokens would have taken."""
        if other.drafted:
            weight = self.drafted * (self.measured_step_s() or 0.0) + other.drafted * (other.measured_step_s() or 0.0)
            self.step_s = weight / (self.drafted + other.drafted)
        for name in ("prompt_tokens", "prefix_tokens", "new_tokens", "rounds", "drafted", "accepted",
                     "prefill_s", "draft_s", "verify_s", "wall_s", "search_s", "searches",
                     "speculation_hits", "speculation_misses"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.by_source = add_counts(self.by_source, other.by_source)
        for mine, theirs in ((self.drafted_at, other.drafted_at), (self.accepted_at, other.accepted_at)):
            mine += [0] * (len(theirs) - len(mine))
            for i, count in enumerate(theirs):
                mine[i] += count

    def measured_step_s(self) -> float | None:
        """step_s, running the pending probe first if there is one (once)."""
        if self.step_s is None and self.step_probe is not None:
            probe, self.step_probe = self.step_probe, None
            self.step_s = probe()
        return self.step_s

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(draft token i accepted | tokens before it accepted), per position."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def mean_accepted_length(self) -> float | None:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cost(self) -> float | None:
        """c: draft time per drafted token over one full forward's time."""
        if not self.drafted or not self.measured_step_s():
            return None
        return (self.draft_s / self.drafted) / self.step_s

    def to_dict(self) -> dict:
        self.measured_step_s()
        out = asdict(self)
        del out["step_probe"]
        out.update(
            alpha=self.alpha,
            acceptance_by_position=self.acceptance_by_position,
            mean_accepted_length=self.mean_accepted_length,
            tokens_per_s=self.tokens_per_s,
            cost=self.cost,
        )
        return out

    def summary(self) -> str:
        def fmt(x, spec):
            return "n/a" if x is None else format(x, spec)

        parts = [
            f"{self.new_tokens} tokens",
            f"{self.tokens_per_s:.1f} tok/s",
            f"α {fmt(self.alpha, '.2f')}",
            f"accepted/step {fmt(self.mean_accepted_length, '.2f')}",
            f"k {self.exit_layer if self.exit_layer is not None else '-'}",
            f"γ {self.draft_len}",
            f"c {fmt(self.cost, '.2f')}",
            f"method {self.method}",
        ]
        if self.prefix_tokens:
            parts.insert(-1, f"prompt tokens reused {self.prefix_tokens}/{self.prompt_tokens}")
        if self.searches:
            parts.insert(-1, f"layer search {self.searches}× {self.search_s:.2f} s")
        if self.speculation_hits or self.speculation_misses:
            tried = self.speculation_hits + self.speculation_misses
            parts.insert(-1, f"speculation hits {self.speculation_hits}/{tried}")
        return " | ".join(parts)


def add_counts(a: dict, b: dict) -> dict:
    """a + b, key by key, for nested dicts of numbers (by_source and its totals); a new dict, so a
    reader in another thread never sees one being changed."""
    out = dict(a)
    for key, value in b.items():
        out[key] = add_counts(out.get(key, {}), value) if isinstance(value, dict) else out.get(key, 0) + value
    return out
