"""Continuous batching: many sequences decoded together, their drafts verified in shared forwards.

Each step the scheduler (1) admits waiting requests up to `max_batch` rows and prefills them,
(2) lets every active row draft with its own drafter on its own cache, and keeps the draft tokens
expected to commit the most tokens per second: every token weighed by its chance of acceptance
(the drafter's own estimate, Draft.confidence, else the row's acceptance so far), each draft cut
after its last kept token, none kept making the row a plain step (`_worth_drafting`, `_choose`;
where drafts of a row's recent length would be dropped whole, it does not ask for them:
`_skip_drafting`), (3) verifies the rows' pending tokens + drafts in one forward where the fused
layer takes sequences of different lengths together unpadded (`engine.verify_rows`,
`ModelAdapter.run_ragged`), else in the fewest-seconds split into shared forwards padded to their
longest row (`partition`); a lone row takes the single-sequence verify with its KV reuse; in exact
mode only forwards that give each row its lone verify's bits, (4) runs the pure verifier per row
and commits. Rows accept different numbers of tokens (ragged acceptance): each row's cache keeps
its own length, and a row's padding positions lie past that length, so they are never committed.
Finished, stopped or cancelled rows leave between steps and waiting requests take their place.

The scheduler is not thread-safe except for `submit` and `Request.cancel`: one thread calls
`step` (or `run`), others submit.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from selfspec.model.adapter import ModelAdapter
from selfspec.core.draft import Drafter
from selfspec.core.engine import Decoding, verify_forward, verify_rows
from selfspec.core.sampling import SamplingParams
from selfspec.core.stats import GenerationStats, add_counts
from selfspec.core.verify_clock import clock_for, shared_clock_for
from selfspec.native import fused_layer
from selfspec.native.fused_layer import ROWS

log = logging.getLogger("selfspec.scheduler")
PROPOSED_WEIGHT = 0.25  # a new draft's weight in Request.proposed, the moving average of its draft lengths
PROBE_EVERY = 8  # steps: a batch that skips drafting (Scheduler._skip_drafting) drafts on every PROBE_EVERY-th


class QueueFull(RuntimeError):
    """More requests are waiting than the scheduler accepts; retry later."""


@dataclass(eq=False)  # compared by identity: field-wise == would compare prompt tensors
class Request:
    prompt_ids: torch.Tensor  # [prompt_len]
    drafter: Drafter  # this request's own instance: drafters keep per-sequence state
    sampling: SamplingParams
    max_new_tokens: int
    stats: GenerationStats
    # Called from the scheduler's thread with each round's committed tokens (an engine.Round: a
    # list that also says where they came from); returning False ends the generation there (a stop
    # string was found).
    on_tokens: Callable[[list[int]], bool]
    # Called once, from the scheduler's thread, when the generation ends: None, or the error.
    on_done: Callable[[BaseException | None], None]
    eos_ids: frozenset[int] = frozenset()
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_s: float = field(default_factory=time.perf_counter)
    # Wall time from submission after which the request ends as if it reached max_new_tokens (a
    # server's guard against a row held forever); None: no limit.
    time_limit_s: float | None = None
    timed_out: bool = False  # it ended at time_limit_s
    prefix: object | None = None  # the PrefixStore its prefill starts from and its entries go to
    proposed: float | None = None  # its drafter's recent draft lengths (a moving average), once it drafted in a batch

    def note_draft(self, tokens: int) -> None:
        """A draft of this many tokens was proposed in a batch: into `proposed`'s moving average."""
        self.proposed = tokens if self.proposed is None else \
            PROPOSED_WEIGHT * tokens + (1 - PROPOSED_WEIGHT) * self.proposed

    def cancel(self) -> None:
        """Free this request's row at the next step boundary (a client went away)."""
        self.cancelled.set()

    def overdue(self, now: float) -> bool:
        return self.time_limit_s is not None and now - self.submitted_s >= self.time_limit_s


@dataclass
class Totals:
    """Counters over every request the scheduler finished, for /metrics."""

    requests: int = 0
    failed: int = 0
    cancelled: int = 0
    timed_out: int = 0
    prompt_tokens: int = 0
    prefix_tokens: int = 0  # of them, read from a prefix store rather than prefilled
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # verify forwards (a scheduler step runs one or more)
    rows: int = 0  # sum over steps of the rows verified together
    drafts_dropped: int = 0  # drafts a batch verified as plain steps (Scheduler._worth_drafting)
    drafts_cut: int = 0  # drafts a batch verified in part, their likeliest tokens (Scheduler._choose)
    drafting_skipped: int = 0  # rows a batch stepped plain without drafting (Scheduler._skip_drafting)
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    # Each request's GenerationStats.by_source, by its method: {method: {source: {"rounds",
    # "drafted", "accepted"}}}. Replaced, never changed in place, as /metrics reads it from another thread.
    by_method: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)


def partition(lengths: list[int], cost: Callable[[list[int], int], float | None]) -> list[list[int]]:
    """The rows (by index; lengths: each row's verify rows, its draft plus one) in groups that each
    share one verify forward padded to its longest row, chosen to take the least estimated time:
    rows sorted by length, contiguous runs of them (so a group pads little), the best split by
    dynamic programming over cost(members, n) (seconds, inf where they may not share, None where
    unknown). Without estimates, rows of equal length share (no padding)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if not order:
        return []
    if cost(order[:1], lengths[order[0]]) is None:  # nothing timed yet: rows of equal length share
        equal: dict[int, list[int]] = {}
        for i in order:
            equal.setdefault(lengths[i], []).append(i)
        groups = []
        for group in equal.values():
            groups += [group] if cost(group, lengths[group[0]]) != math.inf else [[i] for i in group]
        return groups
    best = [0.0] + [math.inf] * len(order)  # best[k]: the least time for the first k sorted rows
    cut = [0] * (len(order) + 1)
    for k in range(1, len(order) + 1):
        for j in range(k):
            members = order[j:k]
            seconds = cost(members, lengths[order[k - 1]])
            total = best[j] + (math.inf if seconds is None else seconds)
            if total < best[k]:
                best[k], cut[k] = total, j
    groups, k = [], len(order)
    while k > 0:
        groups.append(order[cut[k]:k])
        k = cut[k]
    return groups[::-1]


def _seconds(lengths: list[int], groups: list[list[int]], cost: Callable[[list[int], int], float | None]) -> float | None:
    """The estimated seconds of verifying rows of these lengths in these groups (None: unknown)."""
    times = [cost(group, max(lengths[i] for i in group)) for group in groups]
    return None if None in times else sum(times)


def _estimates(adapter: ModelAdapter) -> Callable[[int], float | None]:
    """The estimated seconds of a shared verify over n rows in all: the model's shared clock
    (verify_clock.shared_clock_for), else, before it timed any, its lone one; each n asked once
    (one step's choice asks the same row counts many times)."""
    shared, lone, known = shared_clock_for(adapter), clock_for(adapter), {}

    def estimate(n: int) -> float | None:
        if n not in known:
            known[n] = shared.estimate(n) if shared.seconds else lone.estimate(n)
        return known[n]

    return estimate


def _verifies_alone(seq: Decoding) -> bool:
    """Drafters that keep working on the cache while the verify runs (saguaro) need a verify that
    touches only their own row's slots as a lone verify would: theirs run alone."""
    return getattr(seq.drafter, "verify_alone", False)


class Scheduler:
    def __init__(self, adapter: ModelAdapter, *, max_batch: int = 8, max_queue: int = 32, max_draft: int = 16):
        """max_batch: rows decoded together; max_queue: requests waiting for a row beyond that
        (`submit` raises QueueFull past it); max_draft: cap on any row's draft tokens per round."""
        if max_batch < 1 or max_queue < 0 or max_draft < 0:
            raise ValueError("max_batch must be >= 1, max_queue and max_draft >= 0")
        self.adapter, self.max_batch, self.max_queue, self.max_draft = adapter, max_batch, max_queue, max_draft
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: list[tuple[Request, Decoding]] = []
        self.totals = Totals()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._step_count = 0
        # time.monotonic() when the loop last completed a step or found nothing to do: /health's
        # evidence that decoding moves (selfspec.serve.server).
        self.last_beat = time.monotonic()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def oldest_active_s(self) -> float:
        """Seconds since the longest-running active request was submitted; 0 when none is active.
        Read from other threads (/metrics): at worst one step stale."""
        submitted = [r.submitted_s for r, _ in self.active]
        return time.perf_counter() - min(submitted) if submitted else 0.0

    def submit(self, request: Request) -> None:
        """Queue a request; it joins the batch at a step boundary when a row is free."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            if len(self.waiting) >= self.max_queue + max(0, self.max_batch - len(self.active)):
                raise QueueFull(f"{len(self.waiting)} requests are already waiting")
            self.waiting.append(request)
            self._wake.notify()

    @torch.inference_mode()
    def step(self) -> bool:
        """One scheduler step; False when there was nothing to do."""
        self._drop_ended()
        self._admit()
        if not self.active:
            return False
        rows = [(r, d) for r, d in self.active if not d.done]
        skip = self._skip_drafting([row for row in rows if not _verifies_alone(row[1])])
        drafted = []
        for request, seq in rows:
            if id(seq) in skip:
                draft = seq.no_draft()
                self.totals.drafting_skipped += 1
            else:
                draft = self._guard(request, seq, seq.draft)
                if draft is not None and len(rows) > 1:
                    request.note_draft(len(draft))
            if draft is not None:
                drafted.append((request, seq, draft))
        groups = [[row] for row in drafted if _verifies_alone(row[1])]
        shared = [row for row in drafted if not _verifies_alone(row[1])]
        shared, parts = self._worth_drafting(shared)
        groups += [[shared[i] for i in part] for part in parts]
        for group in groups:
            try:
                self._verify(group)
            except Exception as error:  # noqa: BLE001 - the forward shared by these rows failed: they end
                log.exception("a verify over %d rows failed", len(group))
                for request, seq, _ in group:
                    self._guard(request, seq, _raise, error)
        self._retire()
        return True

    def _verify(self, rows: list[tuple[Request, Decoding, object]]) -> None:
        """One verify forward over these rows (the single-sequence verify, with its KV reuse, for
        a lone row), then each row's pure verifier and commit."""
        t = time.perf_counter()
        if len(rows) == 1:
            _, seq, draft = rows[0]
            logits = [verify_forward(self.adapter, seq.cache, seq.pending, draft, seq.start, top1=seq.sampling.greedy)]
        else:
            logits = verify_rows(self.adapter, [s for _, s, _ in rows], [d for _, _, d in rows])
        rows[0][1].sync()
        verify_s = time.perf_counter() - t
        counts = [len(d) + 1 for *_, d in rows]
        ragged = self.adapter.ragged_rows(max(counts))  # unpadded (ModelAdapter.run_ragged), else padded
        total = sum(counts) if ragged else len(rows) * max(counts)
        if len(rows) > 1 and total <= (ragged or ROWS):  # one kernel call a layer
            shared_clock_for(self.adapter).add(total, verify_s)
        self.totals.verify_s += verify_s  # once per forward, however many rows shared it
        self.totals.steps += 1
        self.totals.rows += len(rows)
        for (request, seq, draft), target in zip(rows, logits):
            tokens = self._guard(request, seq, seq.finish_round, draft, target, verify_s, len(rows) == 1)
            if tokens is not None:
                self._emit(request, seq, tokens)

    def _skip_drafting(self, rows: list[tuple[Request, Decoding]]) -> set[int]:
        """Of the rows that share forwards, those (ids of their Decodings) that skip drafting this
        step: greedy rows whose drafts of their recent lengths (Request.proposed) `_choose` would drop
        whole, so drafting them is time spent for nothing. Every PROBE_EVERY-th step all draft, so a
        row whose drafts grew (a long match) is seen."""
        self._step_count += 1
        if self._step_count % PROBE_EVERY == 0 or len(rows) < 2:
            return set()
        if any(r.proposed is None or not r.sampling.greedy for r, _ in rows):
            return set()
        keep, _ = self._choose(rows, [max(1, round(r.proposed)) for r, _ in rows])
        return {id(s) for (_, s), m in zip(rows, keep) if not m}

    def _choose(self, rows: list, drafts: list[int],
                confidences: list[list[float] | None] | None = None) -> tuple[list[int], list[list[int]]]:
        """(how many of each row's draft tokens to verify, the split of all rows into shared
        forwards with them): the choice expected to commit the most tokens per second. Draft token j
        of a row is expected to commit the chance that its first j are accepted: the product of
        the draft's confidences (Draft.confidence) where its drafter gave them, else a^j, a being
        the row's acceptance so far (Laplace's estimate). Tokens join in the order of that
        expectation (a row's in draft order, as it only falls); every such prefix is timed by the
        model's verify clock (`_timer`), the best kept, ties to more tokens. Every draft whole where
        nothing was timed yet."""
        timer = self._timer(rows)
        lengths = [0] * len(rows)
        if timer(lengths) is None:
            return list(drafts), timer(list(drafts), parts=True)
        order = []
        for i, ((_, seq, *_), n) in enumerate(zip(rows, drafts)):
            given = confidences[i] if confidences else None
            a = (seq.stats.accepted + 1) / (seq.stats.drafted + 2)
            chance = 1.0
            for j in range(n):
                chance *= min(1.0, given[j]) if given is not None and j < len(given) else a
                order.append((chance, i, j))
        order.sort(key=lambda t: (-t[0], t[1], t[2]))
        tokens, best_k = float(len(rows)), 0
        best = tokens / timer(lengths)
        for k, (chance, i, _) in enumerate(order, 1):
            lengths[i] += 1
            tokens += chance
            rate = tokens / timer(lengths)
            if rate >= best:
                best, best_k = rate, k
        keep = [0] * len(rows)
        for _, i, _ in order[:best_k]:
            keep[i] += 1
        return keep, timer(keep, parts=True)

    def _worth_drafting(self, rows: list) -> tuple[list, list[list[int]]]:
        """The rows, and their split into shared verify forwards. Several greedy rows: each draft
        cut to the tokens `_choose` picks (none: a plain step of that row; the batch already fills
        the rows a draft would add). Drafts stay whole before any verify was timed, and where a row
        samples (a seeded row draws what it would alone)."""
        drafts = [len(d) for *_, d in rows]
        if len(rows) < 2 or max(drafts, default=0) == 0 or not all(r.sampling.greedy for r, *_ in rows):
            return rows, self._timer(rows)(drafts, parts=True)
        keep, parts = self._choose(rows, drafts, [d.confidence for *_, d in rows])
        self.totals.drafts_dropped += sum(1 for n, m in zip(drafts, keep) if n and not m)
        self.totals.drafts_cut += sum(1 for n, m in zip(drafts, keep) if 0 < m < n)
        return [(r, seq, seq.cut(d, m)) for (r, seq, d), m in zip(rows, keep)], parts

    def _timer(self, rows: list):
        """timer(lengths, parts=False): the estimated seconds of verifying the rows with drafts of
        these lengths (None before any verify was timed), or with parts=True their split into
        shared forwards. Where the fused layer takes sequences of different row counts together
        (ModelAdapter.run_ragged; in exact mode with a row-invariant head too) all rows share one
        forward, unpadded, in kernel calls of up to its limit of rows (fused_layer.calls), each timed
        as a lone verify of that many rows; elsewhere `partition` splits them into forwards padded
        to their longest row."""
        adapter, estimate, limits = self.adapter, _estimates(self.adapter), {}
        cost = self._cost(rows, estimate)

        def limit(n: int) -> int:
            if n not in limits:
                limits[n] = adapter.ragged_rows(n) if not adapter.exact or adapter.batches_exactly(n) else 0
            return limits[n]

        def timer(lengths: list[int], parts: bool = False):
            if not lengths:
                return [] if parts else 0.0
            counts = [n + 1 for n in lengths]
            most = limit(max(counts))
            if most:
                if parts:
                    return [list(range(len(counts)))]
                times = [estimate(sum(counts[b] for b in group)) for group in fused_layer.calls(counts, most)]
                return None if None in times else sum(times)
            split = partition(counts, cost)
            return split if parts else _seconds(counts, split, cost)

        return timer

    def _cost(self, rows: list, estimate: Callable[[int], float | None]) -> Callable[[list[int], int], float | None]:
        """cost(members, n): the estimated seconds of one verify forward over these rows (indices
        into `rows`) padded to n rows each, from the model's clock of lone verifies (kernel calls of
        up to ROWS rows, as run_rows makes them); inf where they may not share one (exact mode:
        a forward that would not give each row its lone verify's bits, or a cache short of the
        padding); None before any verify was timed. estimate: the clock's figures (`_estimates`)."""
        exact, batches = self.adapter.exact, {}

        def cost(members: list[int], n: int) -> float | None:
            if len(members) > 1 and exact:
                if n not in batches:
                    batches[n] = self.adapter.batches_exactly(n)
                if not batches[n] or any(rows[i][1].start + n >= rows[i][1].cache.capacity for i in members):
                    return math.inf
            per_call = max(1, ROWS // n)
            full, rest = divmod(len(members), per_call)
            seconds = [estimate(per_call * n)] * full + ([estimate(rest * n)] if rest else [])
            return None if None in seconds else sum(seconds)

        return cost

    def run(self, stop: threading.Event) -> None:
        """Step until `stop` is set, sleeping while there is nothing to do (a server's thread).
        A step that fails outside any one row's work fails the rows it was decoding, never the
        loop: the next step serves the queue."""
        while not stop.is_set():
            try:
                busy = self.step()
            except Exception as error:  # noqa: BLE001 - reported to each failed request's owner
                log.exception("a scheduler step failed; ending its %d active requests with the error", len(self.active))
                self._fail_active(error)
                busy = True
            self.last_beat = time.monotonic()
            if not busy:
                with self._lock:
                    if not self.waiting and not stop.is_set():
                        self._wake.wait(timeout=0.05)
                self.last_beat = time.monotonic()

    def _fail_active(self, error: BaseException) -> None:
        active, self.active = self.active, []
        for request, seq in active:
            seq.done = True
            seq.stop_clock()
            self._finish(request, error)

    def close(self) -> None:
        """Refuse new requests and cancel every waiting and active one; a client still listening
        is told why by the error its `on_done` receives."""
        with self._lock:
            self._closed = True
            waiting, self.waiting = list(self.waiting), collections.deque()
        active, self.active = self.active, []
        for _, seq in active:
            seq.done = True
            seq.stop_clock()
        for request in waiting + [r for r, _ in active]:
            request.cancel()
            self._finish(request, RuntimeError("the server is shutting down"), cancelled=True)

    # -- steps ----------------------------------------------------------------------------------

    def _admit(self) -> None:
        while len(self.active) < self.max_batch:
            with self._lock:
                if not self.waiting:
                    return
                request = self.waiting.popleft()
            if request.cancelled.is_set() or request.overdue(time.perf_counter()):
                self._finish_early(request)
                continue
            seq = self._guard(request, None, self._prefill, request)
            if seq is not None:
                self.active.append((request, seq))

    def _prefill(self, request: Request) -> Decoding:
        seq = Decoding(self.adapter, request.prompt_ids, request.drafter, sampling=request.sampling, siblings=False,
                       max_new_tokens=request.max_new_tokens, eos_ids=request.eos_ids, stats=request.stats,
                       max_draft=min(request.drafter.draft_len, self.max_draft), headroom=self.max_draft,
                       prefix=request.prefix)
        self._emit(request, seq, seq.prefill(measure_step=False))
        return seq

    def _emit(self, request: Request, seq: Decoding, tokens: list[int]) -> None:
        if tokens and request.on_tokens(tokens) is False:
            seq.done = True

    def _guard(self, request: Request, seq: Decoding | None, fn, *args):
        """Run one row's step; an error ends that request alone, never the batch."""
        try:
            return fn(*args)
        except Exception as error:  # noqa: BLE001 - reported to the request's owner
            if seq is not None:
                seq.done = True
                seq.stop_clock()
            self._finish(request, error)
            self.active = [(r, s) for r, s in self.active if r is not request]
            return None

    def _drop_ended(self) -> None:
        """End rows and waiting requests that were cancelled or ran past their time limit."""
        now = time.perf_counter()
        for request, seq in self.active:
            if request.cancelled.is_set():
                seq.done = True
            elif not seq.done and request.overdue(now):
                request.timed_out = seq.done = True
        self._retire()  # before admission, so a waiting request takes the freed row this step
        with self._lock:
            gone = [r for r in self.waiting if r.cancelled.is_set() or r.overdue(now)]
            if gone:
                self.waiting = collections.deque(r for r in self.waiting if all(r is not g for g in gone))
        for r in gone:
            self._finish_early(r)

    def _finish_early(self, request: Request) -> None:
        """A request that leaves before its first token: cancelled, or out of time while waiting."""
        cancelled = request.cancelled.is_set()
        request.timed_out = not cancelled
        self._finish(request, None, cancelled=cancelled)

    def _retire(self) -> None:
        keep = []
        for request, seq in self.active:
            if seq.done:
                seq.stop_clock()
                seq.remember()
                self._finish(request, None, cancelled=request.cancelled.is_set())
            else:
                keep.append((request, seq))
        self.active = keep

    def _finish(self, request: Request, error: BaseException | None, cancelled: bool = False) -> None:
        t, s = self.totals, request.stats
        t.requests += 1
        t.failed += error is not None and not cancelled  # a cancelled request's error only says why
        t.cancelled += cancelled
        t.timed_out += request.timed_out
        for name in ("prompt_tokens", "prefix_tokens", "new_tokens", "rounds", "drafted", "accepted", "draft_s",
                     "prefill_s"):
            setattr(t, name, getattr(t, name) + getattr(s, name))
        if s.by_source:
            t.by_method = add_counts(t.by_method, {s.method: s.by_source})
        try:
            request.on_done(error)
        except Exception:  # noqa: BLE001 - the owner's callback failing must not end the loop
            log.exception("a request's on_done callback failed")


def _raise(error: BaseException):
    raise error
