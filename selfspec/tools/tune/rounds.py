"""Rounds of a speculative decode and the speed they predict: pure functions, no model.

A round drafts d tokens and the verify accepts a of them, committing a + 1 (the bonus or
recovered token included). With c the cost of one draft token and v(n) the cost of one verify
over n positions, both relative to one full one-token forward, a round costs d·c + v(d + 1) and
plain autoregressive decoding costs v(1) per token. Over many rounds the predicted speedup is

    Σ (a + 1) · v(1) / Σ (d·c + c0 + v(d + 1))

which is the textbook E[tokens/step] / (γ·c + v(γ + 1)) with E, γ and v averaged over the rounds
actually drafted (c0 is a per-round draft cost, such as prompt lookup's n-gram search). v(1) is
measured rather than assumed to be 1, so a bias common to every timing cancels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class Rounds:
    drafted: list[int] = field(default_factory=list)  # d per round
    accepted: list[int] = field(default_factory=list)  # a per round

    def add(self, drafted: int, accepted: int) -> None:
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} must be in 0..{drafted}")
        self.drafted.append(drafted)
        self.accepted.append(accepted)

    def extend(self, other: Rounds) -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted

    def __len__(self) -> int:
        return len(self.drafted)

    @property
    def tokens(self) -> int:
        """Tokens committed by these rounds (each commits its accepted tokens plus one)."""
        return sum(self.accepted) + len(self.accepted)

    @property
    def alpha(self) -> float | None:
        total = sum(self.drafted)
        return sum(self.accepted) / total if total else None

    @property
    def tokens_per_round(self) -> float | None:
        """E[tokens/step]: the mean accepted length, bonus token included."""
        return self.tokens / len(self) if len(self) else None

    def alpha_by_position(self) -> list[float]:
        """P(draft token i accepted | the tokens before it were), per draft position i."""
        longest = max(self.drafted, default=0)
        reached = [0] * longest
        passed = [0] * longest
        for d, a in zip(self.drafted, self.accepted):
            for i in range(d):
                if i > a:
                    break
                reached[i] += 1
                passed[i] += i < a
        return [p / r if r else 0.0 for p, r in zip(passed, reached)]


def predicted_speedup(rounds: Rounds, *, cost: float, verify: Mapping[int, float], round_cost: float = 0.0) -> float:
    """Speedup over autoregressive decoding predicted from measured rounds and costs (see module
    doc). verify[n]: v(n) for every n = d + 1 that occurs, and verify[1] for the AR step."""
    if not len(rounds):
        raise ValueError("no rounds to predict from")
    missing = sorted({d + 1 for d in rounds.drafted} - set(verify) | ({1} - set(verify)))
    if missing:
        raise ValueError(f"verify cost v(n) not measured for n = {missing}")
    spent = sum(d * cost + round_cost + verify[d + 1] for d in rounds.drafted)
    return rounds.tokens * verify[1] / spent
