"""The decode loop: prefill, draft, verify, commit or rewind, feed back. One loop for every method.

`Decoding` holds one sequence's state and names each step; `decode` drives one sequence through
them, and the batch scheduler (selfspec.core.batch) drives many, verifying their drafts in one forward.

State between rounds: the cache is valid at every layer for positions < cache.length, and one
committed token, `pending`, sits at position cache.length without having been fed to the model.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from typing import NamedTuple

import torch

from selfspec.model.adapter import ModelAdapter
from selfspec.model.cache import KVCache
from selfspec.model.prefix_cache import Scoped
from selfspec.core.draft import Draft, DraftContext, Drafter
from selfspec.core.sampling import SamplingParams, logits_to_probs, make_generator, sample
from selfspec.core.stats import GenerationStats
from selfspec.core.verifier import Verdict, verify_greedy, verify_sampling, verify_siblings
from selfspec.core.verify_clock import clock_for


class Round(list):
    """One round's emitted tokens: a list of ids like any other, which also says where they came
    from (for callers that show it, as the server's trace does). The first `accepted` were accepted
    from the draft; the one after them, if emitted, is the verify's own: the bonus when the whole
    draft was accepted, else the correction (the recovered token)."""

    def __init__(self, tokens: list[int], drafted: int = 0, accepted: int = 0, drafter: str | None = None):
        super().__init__(tokens)
        self.drafted = drafted  # draft tokens verified (0: the prefill's token or a plain step)
        self.accepted = accepted  # of them accepted (the emitted tokens may be fewer: cut at EOS)
        self.drafter = drafter  # the drafter's name (a hybrid's: the source it asked); None without a draft


def check_length(adapter: ModelAdapter, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse, before any work, a generation the model's context cannot hold."""
    if prompt_len == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens > adapter.max_positions:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
            f"of {adapter.max_positions} tokens; shorten the prompt or lower max_new_tokens"
        )


@torch.inference_mode()
def decode(
    adapter: ModelAdapter,
    prompt_ids: torch.Tensor,
    drafter: Drafter,
    *,
    sampling: SamplingParams,
    max_new_tokens: int,
    eos_ids: frozenset[int] = frozenset(),
    stats: GenerationStats,
    prefix: Scoped | None = None,
) -> Iterator[list[int]]:
    """Yield committed tokens, a list per round, until EOS (not yielded) or max_new_tokens.
    prefix: a store of earlier generations' cache entries to start from and add to."""
    seq = Decoding(adapter, prompt_ids, drafter, sampling=sampling, max_new_tokens=max_new_tokens,
                   eos_ids=eos_ids, stats=stats, prefix=prefix)
    try:
        tokens = seq.prefill(measure_step=bool(drafter.draft_len))
        while True:
            if tokens:
                yield tokens
            if seq.done:
                return
            draft = seq.draft()
            t = time.perf_counter()
            target_logits = verify_forward(adapter, seq.cache, seq.pending, draft, seq.start,  # [γ+1, vocab]
                                           top1=seq.sampling.greedy)
            seq.sync()
            tokens = seq.finish_round(draft, target_logits, verify_s=time.perf_counter() - t)
    finally:
        seq.stop_clock()
        seq.remember()


class Decoding:
    """One sequence being decoded: its cache, drafter, sampling state and statistics, and the
    steps of the loop. The caller runs the verify forward between `draft` and `finish_round`,
    alone (`verify_forward`) or batched with other sequences (`verify_rows`)."""

    def __init__(
        self,
        adapter: ModelAdapter,
        prompt_ids: torch.Tensor,
        drafter: Drafter,
        *,
        sampling: SamplingParams,
        max_new_tokens: int,
        eos_ids: frozenset[int] = frozenset(),
        stats: GenerationStats,
        max_draft: int | None = None,
        headroom: int = 0,
        siblings: bool = True,
        prefix: Scoped | None = None,
    ):
        """max_draft: cap on draft tokens per round (default the drafter's γ); headroom: cache
        positions to keep past the last committed one for a batched verify, which pads every row
        to the longest draft in the batch; siblings: whether drafts may be siblings (Draft.siblings:
        only where this sequence verifies alone, in the fused layer); prefix: a store of earlier
        generations' cache entries (selfspec.model.prefix_cache) the prefill starts from, and
        this one's are added to when it ends (`remember`)."""
        self.adapter, self.drafter, self.sampling, self.stats = adapter, drafter, sampling, stats
        self.prefix = prefix
        self.prompt_ids = prompt_ids.to(adapter.device).view(-1)
        check_length(adapter, self.prompt_ids.numel(), max_new_tokens)
        self.max_new_tokens, self.eos_ids = max_new_tokens, eos_ids
        self.max_draft = drafter.draft_len if max_draft is None else max_draft
        # Exact mode: the same capacity for every method (AR included), since attention spans the
        # whole cache there and the CPU attention kernel rounds by the span's length.
        reserve = adapter.step.exact_rows if adapter.exact else max(self.max_draft, headroom)
        self.cache = adapter.new_cache(self.prompt_ids.numel() + max_new_tokens + reserve + 1)
        stats.kv_cache_bytes = self.cache.nbytes
        stats.prompt_tokens = self.prompt_ids.numel()
        self.generator = make_generator(sampling.seed, adapter.device)
        self.ctx = DraftContext(adapter, self.cache, sampling, self.generator, self.prompt_ids,
                                self.prompt_ids.tolist(), stats, siblings=siblings)
        self.sync = _syncer(adapter.device)
        self.produced = 0
        self.done = False
        self.pending: torch.Tensor | None = None
        self._t0 = time.perf_counter()
        self._clock_stopped = False
        self._clock = clock_for(adapter)  # the model's verify clock (seconds by row count)

    @property
    def start(self) -> int:
        """Position of the pending token."""
        return self.cache.length

    def prefill(self, measure_step: bool = True) -> Round:
        """1. The prompt at full depth; the first new token comes from its last position.
        Returns the tokens to emit (the first token, or none if it is EOS)."""
        self.drafter.begin(self.ctx)
        self._t0 = time.perf_counter()
        adapter, n = self.adapter, self.prompt_ids.numel()
        reused = 0 if self.prefix is None else self.prefix.restore(self.prompt_ids, self.cache)
        self.stats.prefix_tokens = reused
        h = adapter.run_layers(adapter.embed(self.prompt_ids[reused:]), range(adapter.n_layers), reused, self.cache)
        first = _pick(adapter.head(h[:, -1:], top1=self.sampling.greedy), self.sampling, self.generator)
        self.cache.rewind(n)
        self.sync()
        self.stats.prefill_s = time.perf_counter() - self._t0
        if measure_step:  # c's denominator, at this context length (attention grows with it)
            if getattr(self.drafter, "needs_step_time", False):  # a payoff gate compares with it
                self.stats.step_s = step_time(adapter, self.cache, position=n)
                self._t0 = time.perf_counter() - self.stats.prefill_s  # the probe is not decoding time
            else:  # measured when c is first read, in a cache of its own, not before the first token
                capacity, model = self.cache.capacity, weakref.ref(adapter)  # results don't keep the model
                self.stats.step_probe = lambda: _probe_step(model(), capacity, n)
        return self._commit([int(first)])

    def draft(self) -> Draft:
        """2. Draft: at most what could still be committed after the pending token's successor."""
        t, searched = time.perf_counter(), self.stats.search_s
        room = min(self.max_new_tokens - self.produced - 1, self.max_draft)
        draft = self.drafter.propose(self.pending, self.start, room)
        if draft.siblings:
            draft = self._fit_siblings(draft, room)
        self.sync()
        self.stats.draft_s += time.perf_counter() - t - (self.stats.search_s - searched)
        return draft

    def no_draft(self) -> Draft:
        """2'. A plain round without asking the drafter (a batch expects a plain step to pay more)."""
        return Draft(tokens=self.pending.new_empty(0), dropped=True)

    def cut(self, draft: Draft, m: int) -> Draft:
        """2''. The draft's first m tokens (a batch verifies only those: the rest were expected to
        cost more than they add). The drafter is told (`cut`, where it has one); else the round
        teaches it nothing, as a dropped draft. KV reuse does not survive a cut (a batch recomputes
        it anyway)."""
        if m >= len(draft):
            return draft
        if m <= 0:
            return self.no_draft()
        tell = getattr(self.drafter, "cut", None)
        if tell is not None:
            tell(m)
        return Draft(tokens=draft.tokens[:m], dropped=draft.dropped or tell is None,
                     draft_probs=None if draft.draft_probs is None else draft.draft_probs[:m],
                     confidence=None if draft.confidence is None else draft.confidence[:m])

    def _fit_siblings(self, draft: Draft, room: int) -> Draft:
        """A sibling draft as this sequence can verify it: alternatives in the slots short of the
        cache's scratch slot, and only where siblings run; else, greedy, its first alternative as
        a one-token chain (which the chain verify checks as it checks any draft), and sampling, no
        draft (a chain token needs the q it was drawn from, which siblings do not carry)."""
        if room < 1:
            return Draft(tokens=draft.tokens[:0])
        fits = min(len(draft), self.cache.capacity - 2 - self.start)
        if not self.ctx.siblings or fits < 2 or not self.adapter.runs_siblings(fits + 1):
            return Draft(tokens=draft.tokens[:1 if self.sampling.greedy else 0])
        return Draft(tokens=draft.tokens[:fits], siblings=True)

    def finish_round(self, draft: Draft, target_logits: torch.Tensor, verify_s: float = 0.0,
                     lone: bool = True) -> Round:
        """3. The pure verifier on the verify forward's logits [γ+1, vocab]; 4. commit or rewind:
        pending + accepted tokens are now valid at every layer; feed back. Returns the tokens to
        emit. lone: the verify forward was this sequence's alone (its seconds go to the model's
        verify clock)."""
        if lone:
            self._clock.add(len(draft) + 1, verify_s)
        t = time.perf_counter()
        verdict = _verify(draft, target_logits, self.sampling, self.generator)
        self.stats.verify_s += verify_s + time.perf_counter() - t
        if verdict.sibling:  # the accepted alternative's KV and state sit in its own slot
            self.cache.move(self.start + 1 + verdict.sibling, self.start + 1)
        self.cache.rewind(self.start + 1 + verdict.n_accepted)
        drafted = 1 if draft.siblings else len(draft)
        drafter = getattr(self.drafter, "drafted_by", self.drafter.name) if drafted else None
        self.stats.record_round(drafted, verdict.n_accepted, drafter)
        if not draft.dropped:
            self.drafter.observe(verdict.n_accepted)
        return self._commit(verdict.tokens, drafted, verdict.n_accepted, drafter)

    def stop_clock(self) -> None:
        if not self._clock_stopped:
            self._clock_stopped = True
            self.stats.wall_s = time.perf_counter() - self._t0

    def remember(self) -> None:
        """Add this sequence's tokens whose cache entries are valid (prompt and answer, up to the
        pending token) to the prefix store, once. While a model keeps prefixes every forward runs
        through the fused layer, so those entries are the bits a prefill of the same tokens writes."""
        if self.prefix is not None and self.cache.length:
            self.prefix.add(self.ctx.committed[:self.cache.length], self.cache)
        self.prefix = None

    def _commit(self, tokens: list[int], drafted: int = 0, accepted: int = 0, drafter: str | None = None) -> Round:
        """Make `tokens` the committed tokens of this round: the last is the next pending token.
        Returns what to emit, cut at EOS or max_new_tokens (then the sequence is done), as a Round."""
        self.pending = torch.tensor([tokens[-1]], device=self.adapter.device)
        self.ctx.committed += tokens
        out = _cut(tokens, self.eos_ids, self.max_new_tokens - self.produced)
        self.produced += len(out.tokens)
        self.stats.new_tokens = self.produced
        self.done = out.stop
        return Round(out.tokens, drafted, accepted, drafter)


def verify_forward(
    adapter: ModelAdapter, cache: KVCache, pending: torch.Tensor, draft: Draft, start: int, top1: bool = False
) -> torch.Tensor:
    """Full-model logits [γ+1, vocab] for pending + draft tokens at positions start .. start+γ,
    each row computed exactly as a one-token autoregressive step would (see run_layers); for
    sibling drafts, the pending token and each alternative at start+1 (Draft.siblings). top1: a
    greedy verify, which reads only each row's argmax (ModelAdapter.head's top1)."""
    gamma = len(draft)
    if draft.exit_hidden is None or gamma == 0 or draft.siblings:
        h = adapter.embed(torch.cat([pending, draft.tokens]))
        h = adapter.run_layers(h, range(adapter.n_layers), start, cache, rowwise=True, siblings=draft.siblings)
        return adapter.head(h, top1=top1)
    k = draft.exit_layer
    if draft.exit_hidden.shape[1] == gamma + 1:  # the drafter also ran the last draft token's layers < k
        h = draft.exit_hidden
    else:
        # Layers < k ran in the draft for every position but the last draft token's: run only that one.
        last = adapter.run_layers(adapter.embed(draft.tokens[-1:]), range(k), start + gamma, cache)
        h = torch.cat([draft.exit_hidden, last], dim=1)  # [1, γ+1, hidden] at layer k
    h = adapter.run_layers(h, range(k, adapter.n_layers), start, cache, rowwise=True)
    return adapter.head(h, top1=top1)


def verify_rows(adapter: ModelAdapter, seqs: list[Decoding], drafts: list[Draft]) -> list[torch.Tensor]:
    """The verify of several sequences in one full-depth forward: sequence b's pending token and
    draft, its γ_b + 1 rows, unpadded where the fused layer runs (`ModelAdapter.run_ragged`; else
    padded to the longest draft, the padding written past the row's own positions and never
    committed). Returns each sequence's logits [γ_b+1, vocab], each computed as that sequence's own
    verify would. The draft's KV of layers < k is recomputed, not reused."""
    counts = [len(d) + 1 for d in drafts]
    ids = torch.cat([torch.cat([seq.pending, draft.tokens]) for seq, draft in zip(seqs, drafts)])
    h = adapter.embed(ids).view(ids.numel(), -1)  # [sum(counts), hidden]
    h = adapter.run_ragged(h, range(adapter.n_layers), [s.start for s in seqs], counts, [s.cache for s in seqs])
    logits = adapter.head_rows(h.unsqueeze(1), top1=all(s.sampling.greedy for s in seqs))[:, 0]  # [rows, vocab]
    return list(logits.split(counts))


_STEP_TIMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # adapter -> {context bucket: seconds}
STEP_BUCKET = 256  # positions per bucket of context length that share one measured step time


def step_time(adapter: ModelAdapter, cache: KVCache, position: int) -> float:
    """`measure_step_time`, measured once per model and per STEP_BUCKET positions of context: the
    probe is four full forwards, too much to repeat before every short generation."""
    times = _STEP_TIMES.setdefault(adapter, {})
    bucket = position // STEP_BUCKET
    if bucket not in times:
        times[bucket] = measure_step_time(adapter, cache, position)
    return times[bucket]


@torch.inference_mode()
def _probe_step(adapter: ModelAdapter | None, capacity: int, position: int) -> float | None:
    """`step_time` after the generation, in a scratch cache of the generation's capacity (the same
    attention span in exact mode), so the generation's own cache is neither kept nor touched.
    None once the model is gone."""
    return None if adapter is None else step_time(adapter, adapter.new_cache(capacity), position)


def measure_step_time(adapter: ModelAdapter, cache: KVCache, position: int, repeats: int = 3) -> float:
    """Seconds of one full-depth one-token forward at `position` (slots there are free; later
    rounds overwrite them). The denominator of c."""
    sync = _syncer(adapter.device)
    token = torch.zeros(1, dtype=torch.long, device=adapter.device)
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        t = time.perf_counter()
        adapter.head(adapter.run_layers(adapter.embed(token), range(adapter.n_layers), position, cache), top1=True)
        sync()
        times.append(time.perf_counter() - t)
    return sorted(times[1:])[len(times[1:]) // 2]


class _Cut(NamedTuple):
    tokens: list[int]  # what to emit
    stop: bool  # EOS seen or max_new_tokens reached


def _cut(tokens: list[int], eos_ids: frozenset[int], room: int) -> _Cut:
    """Cut a round's tokens at the first EOS (dropped) or when max_new_tokens is reached."""
    for i, token in enumerate(tokens[:room]):
        if token in eos_ids:
            return _Cut(tokens[:i], True)
    return _Cut(tokens[:room], len(tokens) >= room)


def _pick(logits: torch.Tensor, sampling: SamplingParams, generator) -> torch.Tensor:
    """The first new token, from the prefill's last logits [1, vocab]: a [1] tensor."""
    if sampling.greedy:
        return logits.argmax(-1)
    return sample(logits_to_probs(logits, sampling), generator).view(1)


def _verify(draft: Draft, target_logits: torch.Tensor, sampling: SamplingParams, generator) -> Verdict:
    if draft.siblings:
        target = target_logits if sampling.greedy else logits_to_probs(target_logits, sampling)
        return verify_siblings(draft.tokens, target, generator, greedy=sampling.greedy)
    if sampling.greedy:
        return verify_greedy(draft.tokens, target_logits)
    target_probs = logits_to_probs(target_logits, sampling)
    draft_probs = draft.draft_probs
    if draft_probs is None:  # γ = 0: nothing to compare against
        draft_probs = target_probs[:0]
    return verify_sampling(draft.tokens, draft_probs, target_probs, generator)


def _syncer(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None
