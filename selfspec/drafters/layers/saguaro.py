"""Saguaro: speculative speculative decoding (Kumar, Dao, May) for the early-exit draft, on the one
device the draft and the verify share.

Plain speculation alternates: round i+1 is drafted only once verify i says how round i ended.
Saguaro drafts round i+1 *while* verify i runs, for the outcome it expects: all γ draft tokens
accepted, and the bonus token equal to the draft's own guess at position γ. The pre-draft waits in
a speculation cache keyed by that outcome (n_accepted, next token); when the verify ends that way
(a hit) the next round starts from it, any other outcome (a miss) drops it and drafts as early
exit does. The cache holds that one entry: a pre-draft for any other outcome would write its KV
where the current draft's lives.

One cache, no race. Every draft here also runs layers < k for its last token, so the verify
(given γ+1 exit states) runs only layers >= k. While it runs, the pre-draft writes layers < k at
positions > start+γ and reads layers < k at positions <= start+γ, written before it began: the two
touch disjoint slots, and on a miss the pre-draft's slots lie past the cache length.

Shared hardware. The pre-draft runs in a worker thread with one intra-op thread while the verify
keeps the others (torch ops release the GIL), and only while the verify runs: `observe` stops it
at the next layer boundary, and on a hit the main thread finishes it with all its threads. The
KV it writes is the same layers' one-thread result: bit-identical to AR's when torch runs one
thread, within float rounding of it with more (as the verify's batched rows already are).

Exact sampling. Pre-draft tokens are drawn from q computed in the context they are verified in
(on a hit, the real one), with the worker's own generator, seeded per round from the generation's
seed: outputs are reproducible however far the worker got.

Not for the batch scheduler's shared verify (engine.verify_rows): it rewrites layers < k and pads
rows into the slots the pre-draft fills (see `verify_alone`). Use it through `decode` (the API's
generate and stream, the CLI, the bench).
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from selfspec.core.draft import Draft, DraftContext
from selfspec.drafters.layers.early_exit import EarlyExit
from selfspec.drafters.layers.shallow import draft_token
from selfspec.core.sampling import SamplingParams

GREEDY = SamplingParams()
Pick = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]  # layer-k state -> (token, q)


@dataclass
class _Partial:
    """A draft being built: tokens [1] each, q rows [1, vocab] (sampling), layer-k states [1, 1, hidden]."""

    tokens: list[torch.Tensor] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)

    def draft(self, k: int, gamma: int) -> Draft:
        """The first γ >= 1 tokens, with the γ+1 exit states the verify continues from."""
        return Draft(
            tokens=torch.cat(self.tokens[:gamma]),
            draft_probs=torch.cat(self.probs[:gamma]) if self.probs else None,
            exit_layer=k,
            exit_hidden=torch.cat(self.hidden[: gamma + 1], dim=1),
        )


def _draft_steps(ctx: DraftContext, k: int, token: torch.Tensor, start: int, gamma: int, pick: Pick,
                 out: _Partial) -> Iterator[None]:
    """The early-exit draft of γ tokens after `token` (at `start`), then layers < k of the last
    draft token, into `out`; one layer per step, so that any thread may resume it. Holds no
    context manager: each thread that resumes it sets its own inference mode (and stream)."""
    for i in range(gamma + 1):
        h = ctx.adapter.embed(token)
        for layer in range(k):
            h = ctx.adapter.run_layers(h, (layer,), start + i, ctx.cache)  # [1, 1, hidden]
            yield
        out.hidden.append(h)
        if i < gamma:
            token, q = pick(h)
            out.tokens.append(token)
            if q is not None:
                out.probs.append(q)
            yield


class _PreDraft:
    """One speculation-cache entry: the next round's draft for the outcome "all n_accepted draft
    tokens accepted, then the draft's guess" (the guess is the first step's result)."""

    def __init__(self, ctx: DraftContext, k: int, last_hidden: torch.Tensor, n_accepted: int, start: int,
                 gamma: int, pick: Pick, argmax: Pick):
        """last_hidden: the layer-k state of the current draft's last token; argmax: its most likely
        successor is the guess (the likeliest bonus token under sampling too)."""
        self.n_accepted, self.start, self.gamma = n_accepted, start, gamma
        self.guess: int | None = None
        self.out = _Partial()
        self.steps = self._steps(ctx, k, last_hidden, pick, argmax)

    def _steps(self, ctx, k, last_hidden, pick, argmax) -> Iterator[None]:
        token, _ = argmax(last_hidden)
        self.guess = int(token)
        yield
        yield from _draft_steps(ctx, k, token.view(1), self.start, self.gamma, pick, self.out)

    def outcome(self) -> tuple[int, int]:
        """The key: (n_accepted, next token) it was drafted for (the guess is computed here if
        the worker did not get that far)."""
        while self.guess is None:
            next(self.steps)
        return self.n_accepted, self.guess

    def finish(self, k: int, gamma: int) -> Draft:
        for _ in self.steps:
            pass
        return self.out.draft(k, min(gamma, self.gamma))


class Saguaro:
    name = "saguaro"
    # Its rows must be verified alone (engine.verify_forward), never in a shared batched verify
    # (engine.verify_rows), which rewrites layers < k under the running pre-draft.
    verify_alone = True

    def __init__(self, inner: EarlyExit):
        """inner: the early-exit drafter whose k, γ, exit adapter and draft head the drafts use."""
        self.inner = inner
        self.exit_layer = inner.exit_layer
        self.draft_len = inner.draft_len
        # Rounds over every generation since construction: drafts taken from the speculation cache
        # (hits), and rounds after a pre-draft for another outcome (misses).
        self.hits = 0
        self.misses = 0
        self._pool: ThreadPoolExecutor | None = None
        self._running: tuple[Future, threading.Event] | None = None
        self._entry: _PreDraft | None = None

    def begin(self, ctx: DraftContext) -> None:
        self._halt()  # a generation that ended in an error may have left one running
        self.inner.begin(ctx)
        self.ctx = ctx
        self._entry = None
        self._n_accepted = -1
        self._threads = torch.get_num_threads()  # the main thread's, restored after every overlap
        self._cuda = ctx.adapter.device.type == "cuda"
        self._stream = torch.cuda.Stream(ctx.adapter.device) if self._cuda else None
        self._seed = ctx.sampling.seed if ctx.sampling.seed is not None else random.getrandbits(62)
        self._generator = None if ctx.sampling.greedy else torch.Generator(device=ctx.adapter.device)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="saguaro", initializer=_one_thread)

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        entry, self._entry = self._entry, None
        gamma = min(self.draft_len, max_len)
        if gamma <= 0:
            return Draft(tokens=pending.new_empty(0))
        if entry is not None and self._hit(entry, start):
            draft = entry.finish(self.exit_layer, gamma)
        else:
            out = _Partial()
            for _ in _draft_steps(self.ctx, self.exit_layer, pending, start, gamma, self._pick(self.ctx), out):
                pass
            draft = out.draft(self.exit_layer, gamma)
        self._speculate(draft, start, max_len)
        return draft

    def observe(self, n_accepted: int) -> None:
        self._n_accepted = n_accepted
        self._halt()

    # -- the worker ---------------------------------------------------------------------------

    def _speculate(self, draft: Draft, start: int, max_len: int) -> None:
        """Start pre-drafting the round after `draft`'s verify, for its likeliest outcome."""
        n = len(draft)
        # The next round's room if all n are accepted: max_len is the room left, capped at γ by the
        # engine, so below γ it is exact. The cache holds γ+1 positions past the last token's.
        room = self.draft_len if max_len >= self.draft_len else max_len - n - 1
        gamma = min(room, self.ctx.cache.capacity - (start + n + 1) - 1)
        if n == 0 or gamma <= 0:
            return
        ctx = self.ctx
        if self._generator is not None:  # per round: reproducible wherever the worker stopped
            self._generator.manual_seed(hash((self._seed, start)) & (2**63 - 1))
            ctx = replace(ctx, generator=self._generator)
        self._entry = _PreDraft(ctx, self.exit_layer, draft.exit_hidden[:, -1:], n, start + n + 1, gamma,
                                self._pick(ctx), self._pick(replace(ctx, sampling=GREEDY)))
        stop = threading.Event()
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream())  # the draft's KV, written on ours
        else:
            torch.set_num_threads(max(1, self._threads - 1))  # the worker has one; the verify the rest
        self._running = (self._pool.submit(_work, self._entry.steps, stop, self._stream), stop)

    def _halt(self) -> None:
        """Stop the worker at its next layer boundary and give the main thread its threads back."""
        if self._running is None:
            return
        future, stop = self._running
        self._running = None
        stop.set()
        try:
            future.result()
        finally:
            if self._cuda:
                torch.cuda.current_stream().wait_stream(self._stream)
            else:
                torch.set_num_threads(self._threads)

    def _pick(self, ctx: DraftContext) -> Pick:
        def pick(h):
            token, q, _ = draft_token(ctx, h, ctx.generator, self.inner.exit_adapter, self.inner.head)
            return token, q

        return pick

    def _hit(self, entry: _PreDraft, start: int) -> bool:
        """Did the last verify end as `entry` was drafted for? Counted as a hit or a miss."""
        # The outcome: n_accepted, then the recovered or bonus token (the engine's last committed
        # entry, now pending); the guess is only looked at when the count matches.
        hit = (entry.start == start and entry.n_accepted == self._n_accepted
               and entry.outcome() == (self._n_accepted, self.ctx.committed[-1]))
        if hit:
            self.hits += 1
            self.ctx.stats.speculation_hits += 1
        else:
            self.misses += 1
            self.ctx.stats.speculation_misses += 1
        return hit


def _one_thread() -> None:
    """The worker's setup: one intra-op thread. A first parallel op runs before, because torch sets
    a thread's count from the process-wide one at its first parallel op."""
    torch.zeros(2).add_(1)
    torch.set_num_threads(1)


def _work(steps: Iterator[None], stop: threading.Event, stream) -> None:
    with torch.inference_mode(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for _ in steps:
            if stop.is_set():
                return
