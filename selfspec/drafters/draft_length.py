"""How long a suffix draft should be: the length that commits the most tokens per second of verify.

A draft t_1..t_n comes with each token's confidence r_i: the share of the store's matching places
that agree on t_i, given t_1..t_{i-1}. Cut to m tokens it commits, in expectation,

    E(m) = 1 + Σ_{i ≤ m} Π_{j ≤ i} min(1, a_j · r_j)

tokens, a_j being how often a token at draft position j was accepted per unit of confidence in this
process so far (it starts at 1, trusting the store, with `PRIOR` pseudo-rounds). A verify over
m + 1 rows takes T(m + 1) seconds on this machine (selfspec.core.verify_clock, measured from the
engine's own verifies). The draft is cut to the m that maximises E(m) / T(m + 1), m = 0 (a plain
step) included. Before any verify was timed the draft is left whole. Where a verify's extra rows
cost little (an AMX CPU, a GPU) long drafts stay long; where each row costs (a 2-core AVX-512 CPU
in int4: v(4) 1.5-1.8), a draft of doubtful tail is cut. Any cut keeps the output exact: only speed
moves.
"""

from __future__ import annotations

import threading

from selfspec.core.verify_clock import PerModel, VerifyClock, clock_for

PRIOR = 4.0  # pseudo-rounds at acceptance 1 per unit of confidence, at every draft position
POSITIONS = 64  # draft positions tracked (later ones share the last's figure)


class DraftLength:
    def __init__(self, clock: VerifyClock, prior: float = PRIOR):
        self.clock, self.prior = clock, prior
        self.hits = [0.0] * POSITIONS  # accepted tokens at each draft position
        self.tried = [0.0] * POSITIONS  # confidence summed over tokens verified at each position
        self._lock = threading.Lock()

    def acceptance(self, position: int) -> float:
        """a_j: accepted tokens per unit of confidence at draft position `position` (0-based)."""
        j = min(position, POSITIONS - 1)
        return (self.hits[j] + self.prior) / (self.tried[j] + self.prior)

    def chances(self, ratios: list[float]) -> list[float]:
        """Each drafted token's chance of acceptance given the ones before it: min(1, a_j · r_j)."""
        return [min(1.0, self.acceptance(j) * r) for j, r in enumerate(ratios)]

    def expected(self, ratios: list[float]) -> list[float]:
        """E(m) for m = 0 .. len(ratios): expected tokens committed by the draft cut to m."""
        out, alive = [1.0], 1.0
        for chance in self.chances(ratios):
            alive *= chance
            out.append(out[-1] + alive)
        return out

    def choose(self, ratios: list[float]) -> int:
        """The length to keep of a draft whose tokens have confidences `ratios` (each given the
        ones before it)."""
        if not ratios or self.clock.estimate(len(ratios) + 1) is None:
            return len(ratios)
        best_m, best = 0, -1.0
        for m, tokens in enumerate(self.expected(ratios)):
            rate = tokens / max(self.clock.estimate(m + 1), 1e-9)
            if rate > best:
                best_m, best = m, rate
        return best_m

    def learn(self, ratios: list[float], accepted: int) -> None:
        """A verified draft with these confidences: its first `accepted` tokens were accepted."""
        with self._lock:
            for j, r in enumerate(ratios[:accepted + 1]):  # tokens past the first rejection were not tried
                k = min(j, POSITIONS - 1)
                self.tried[k] += r
                self.hits[k] += 1.0 if j < accepted else 0.0


length_for = PerModel(lambda adapter: DraftLength(clock_for(adapter)))  # the model's, shared by its generations
