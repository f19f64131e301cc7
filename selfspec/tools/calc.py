"""The analytic model of speculative decoding, on its own (`selfspec calc`).

With acceptance rate α (each draft token accepted independently with probability α), draft
length γ, draft cost c (one draft token over one full forward) and verify cost v (a verify over
γ + 1 positions over one full one-token forward; 1 in the standard model, more on a CPU):
    E[tokens per step] = (1 - α^(γ+1)) / (1 - α)          (γ + 1 when α = 1)
    speedup            = E[tokens per step] / (γ·c + v)
    ceiling            = 1 / (1 - α)                      (γ → ∞ with free drafts)
"""

from __future__ import annotations

import math


def expected_tokens(alpha: float, gamma: int) -> float:
    _check(alpha, gamma)
    if alpha == 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(alpha: float, gamma: int, cost: float, verify: float = 1.0) -> float:
    if cost < 0 or verify <= 0:
        raise ValueError(f"cost must be >= 0 and verify cost > 0, got {cost} and {verify}")
    return expected_tokens(alpha, gamma) / (gamma * cost + verify)


def ceiling(alpha: float) -> float:
    _check(alpha, 0)
    return math.inf if alpha == 1.0 else 1.0 / (1.0 - alpha)


def best_gamma(alpha: float, cost: float, verify: float = 1.0, max_gamma: int = 64) -> int:
    """The draft length with the highest speedup (0, no drafting, when none beats AR)."""
    return max(range(max_gamma + 1), key=lambda g: (round(speedup(alpha, g, cost, verify), 12), -g))


def parse_values(text: str, kind=float) -> list:
    """'0.7', '0.5,0.6,0.7' or a range 'start:stop:step' (stop included)."""
    values = []
    for part in text.split(","):
        part = part.strip()
        try:
            if ":" in part:
                start, stop, step = (kind(x) for x in part.split(":"))
                if step <= 0:
                    raise ValueError
                n = int(math.floor((stop - start) / step + 1e-9)) + 1
                values += [kind(round(start + i * step, 10)) for i in range(max(n, 0))]
            else:
                values.append(kind(part))
        except ValueError:
            raise ValueError(f"bad value list {text!r}: use a number, a comma list, or start:stop:step") from None
    if not values:
        raise ValueError(f"bad value list {text!r}: it names no values")
    return values


def _check(alpha: float, gamma: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"α must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"γ must be >= 0, got {gamma}")
