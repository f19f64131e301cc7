"""The verify's measured seconds by row count, per model: what a draft of n tokens costs here.

A verify over n + 1 rows costs v(n + 1) plain steps, and v differs by model, dtype and CPU, and
on one machine with its memory's speed of the day (on a 2-core AMD EPYC in int4, Qwen2.5-Coder 1.5B
and 0.5B: v(4) 1.5-1.8; on an AMX Xeon nearly 1).
Every lone verify the engine runs adds its seconds here (a smoothed figure per row count), so a
drafter that can choose its length (suffix decoding) weighs the tokens a longer draft may add
against what the longer verify costs on this machine, without a separate measurement. A verify
that several sequences shared goes to the model's shared clock under its total rows; the
scheduler weighs its batches by that clock, by the lone one where the shared has no figure yet.
"""

from __future__ import annotations

import threading
import weakref

MOMENTUM = 0.8  # of the smoothed seconds per row count


class VerifyClock:
    def __init__(self, momentum: float = MOMENTUM):
        self.momentum = momentum
        self.seconds: dict[int, float] = {}  # rows -> smoothed seconds of a verify over that many rows
        self._lock = threading.Lock()

    def add(self, rows: int, seconds: float) -> None:
        if rows < 1 or not seconds > 0:
            return
        with self._lock:
            old = self.seconds.get(rows)
            self.seconds[rows] = seconds if old is None else self.momentum * old + (1 - self.momentum) * seconds

    def estimate(self, rows: int) -> float | None:
        """Seconds of a verify over `rows` rows: measured, else interpolated between the nearest
        measured row counts, else extrapolated along the last two (never below the largest
        measured), else the nearest measured; None before any verify was measured."""
        with self._lock:
            known = sorted(self.seconds.items())
        if not known:
            return None
        below = [(r, s) for r, s in known if r <= rows]
        above = [(r, s) for r, s in known if r > rows]
        if below and below[-1][0] == rows:
            return below[-1][1]
        if below and above:
            (r0, s0), (r1, s1) = below[-1], above[0]
            return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        if above:
            return above[0][1]
        if len(below) >= 2:
            (r0, s0), (r1, s1) = below[-2], below[-1]
            return s1 + max(0.0, (s1 - s0) / (r1 - r0)) * (rows - r1)
        return below[-1][1]


class PerModel:
    """One object per loaded model, made by `make(adapter)` on first use and dropped with the model."""

    def __init__(self, make):
        self._make = make
        self._items: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __call__(self, adapter):
        with self._lock:
            item = self._items.get(adapter)
            if item is None:
                item = self._items[adapter] = self._make(adapter)
            return item


clock_for = PerModel(lambda adapter: VerifyClock())  # the model's clock, shared by every generation on it
# Verifies several sequences shared (the batch scheduler's), by their total rows: apart from lone
# ones, as each sequence adds its own attention and cache reads (SmolLM2 through the server, 2-core
# AMD EPYC: 8 rows of 4 sequences 46 ms, 8 rows of one about 25 ms).
shared_clock_for = PerModel(lambda adapter: VerifyClock())
