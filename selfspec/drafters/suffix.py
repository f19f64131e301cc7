"""Suffix decoding (Oliaro et al. 2024, "SuffixDecoding"; Snowflake's Arctic Inference, vLLM's
`suffix` method): drafts from everything this process has seen, not only the current request.

One `SuffixStore` per served model holds recent token sequences of every request — prompt and
output, indexed as they grow, so requests in flight draft from each other — under one token budget,
the oldest evicted first, whoever sent it; a sequence belongs to a tenant (None: shared), and a
tenant's drafts come from its own sequences only (`Scoped`: the index's keys carry the tenant). Each round the drafter finds the places
where the context's longest suffix occurred before (in any sequence, its own included), then walks
their continuations token by token, taking the most frequent next token. As in Arctic Inference,
the draft's length adapts to the evidence: it stops where the token's confidence (the product,
over the draft so far, of the share of matches that agree) falls below `min_prob`, and at the
allowance `max_spec_factor · (match + seen_weight · (places agreeing - 1)) + max_spec_offset`
tokens, which grows with the match's length and with how often the continuation was seen; never
past γ, which the engine lowers to what it may verify. Long, frequent matches draft tens of
tokens, no match drafts nothing (a plain step). Deterministic, like prompt lookup: with sampling,
q is one-hot.

The store is a k-gram index (k = `key_len`) over every position that has a continuation, each
(tenant, k-gram) keeping its most recent `max_candidates` places; a candidate's match length is extended
backwards up to `max_match` tokens. Thread-safe: the scheduler's thread drafts while others add.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfspec.core.draft import Draft, DraftContext
from selfspec.drafters.draft_length import length_for

DEFAULT_MAX_TOKENS = 1_000_000  # store budget: ~1M tokens of past text (tens of MB with the index)
# The draft's allowance and confidence floor (the module's docstring): Arctic Inference's defaults.
# Replaying the agent sessions' plain-decoding answers through the store, longer allowances (factor
# 1.5, offset 2 or seen_weight 0.5) raised tokens per round by under 2% and lowered α more; a floor
# of 0.8 raised α 0.70 -> 0.77 at the same tokens per round, but through the server (SmolLM2, exact
# mode, 2 CPU cores) it was no faster: rounds with no draft left draft one head token instead.
DEFAULT_FACTOR = 1.0
DEFAULT_OFFSET = 0.0
DEFAULT_SEEN_WEIGHT = 0.0
DEFAULT_MIN_PROB = 0.1


class SuffixStore:
    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, key_len: int = 3, max_candidates: int = 32,
                 max_match: int = 64):
        """max_tokens: tokens kept, over all sequences of every tenant (the oldest sequence goes first
        past it);
        key_len: the shortest match used, and the index's key; max_candidates: places kept per
        key (the most recent); max_match: longest match measured."""
        if max_tokens < 1 or key_len < 1 or max_candidates < 1 or max_match < key_len:
            raise ValueError("need max_tokens, key_len, max_candidates >= 1 and max_match >= key_len")
        self.max_tokens, self.key_len, self.max_candidates, self.max_match = max_tokens, key_len, max_candidates, max_match
        self._seqs: collections.OrderedDict[int, Sequence[int]] = collections.OrderedDict()  # oldest first
        self._indexed: dict[int, int] = {}  # sequence id -> positions indexed (ends of k-grams < this)
        self._tenant: dict[int, object] = {}  # sequence id -> its tenant
        self._index: dict[tuple, collections.deque] = {}  # (tenant, *k-gram) -> deque of (sequence id, end)
        self._next_id = 0
        self._total = 0  # tokens indexed, over every sequence kept
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Tokens indexed now (for /metrics)."""
        return self._total

    @property
    def sequences(self) -> int:
        with self._lock:
            return len(self._seqs)

    def sequences_of(self, tenant) -> int:
        with self._lock:
            return sum(owner == tenant for owner in self._tenant.values())

    def add(self, tokens: Sequence[int], tenant=None) -> int:
        """Keep `tokens` (a list that may still grow: its new tokens are indexed as they come) as
        `tenant`'s; returns its id."""
        with self._lock:
            sid = self._next_id
            self._next_id += 1
            self._seqs[sid] = tokens
            self._indexed[sid] = 0
            self._tenant[sid] = tenant
            self._index_new(sid)
            self._evict()
            return sid

    def draft(self, context: Sequence[int], max_len: int, max_spec_factor: float = DEFAULT_FACTOR,
              max_spec_offset: float = DEFAULT_OFFSET, seen_weight: float = DEFAULT_SEEN_WEIGHT,
              min_prob: float = DEFAULT_MIN_PROB, sid: int | None = None,
              ratios: list[float] | None = None, tenant=None) -> tuple[list[int], int]:
        """Up to max_len tokens predicted to follow `context`, and the match length they came
        from ([] and 0 without a match of key_len tokens). The allowance (see the module's
        docstring) is max_spec_factor · (match + seen_weight · (places agreeing - 1)) +
        max_spec_offset tokens; min_prob: the least confidence of a drafted token. sid: the
        caller's own growing sequence, the only one whose new tokens need indexing now (each
        drafter indexes its own as it drafts); None: index every sequence's. ratios: a list that
        gains each drafted token's confidence given the tokens before it (the share of the places
        still agreeing that continue with it). tenant: whose sequences to draft from (no other's)."""
        k = self.key_len
        if max_len <= 0 or len(context) < k:
            return [], 0
        with self._lock:
            for grown in (self._seqs if sid is None else [sid] if sid in self._seqs else []):
                self._index_new(grown)
            self._evict()
            places = self._index.get((tenant, *context[-k:]))
            if not places:
                return [], 0
            scored = [(self._match(context, sid, end), sid, end) for sid, end in places if sid in self._seqs]
            if not scored:
                return [], 0
            best = max(s[0] for s in scored)
            alive = [(sid, end) for length, sid, end in scored if length == best]
            draft: list[int] = []
            confidence = 1.0
            while len(draft) < max_len and alive:
                counts = collections.Counter()
                for sid, end in alive:
                    seq = self._seqs[sid]
                    if end + len(draft) < len(seq):
                        counts[seq[end + len(draft)]] += 1
                if not counts:
                    break
                token, count = counts.most_common(1)[0]
                share = count / len(alive)
                confidence *= share  # places that ended here count against it, as in Arctic's tree
                allowance = max(1.0, max_spec_factor * (best + seen_weight * (count - 1)) + max_spec_offset)
                if confidence < min_prob or len(draft) + 1 > allowance:
                    break
                alive = [(sid, end) for sid, end in alive
                         if end + len(draft) < len(self._seqs[sid]) and self._seqs[sid][end + len(draft)] == token]
                draft.append(int(token))
                if ratios is not None:
                    ratios.append(share)
            return draft, best

    def _match(self, context: Sequence[int], sid: int, end: int) -> int:
        """How many tokens before `end` in sequence sid equal the context's last ones."""
        seq, n = self._seqs[sid], 0
        while n < self.max_match and n < end and n < len(context) and seq[end - 1 - n] == context[-1 - n]:
            n += 1
        return n

    def _index_new(self, sid: int) -> None:
        """Index the places of sequence sid that gained a continuation token since last time."""
        k, seq, tenant = self.key_len, self._seqs[sid], self._tenant[sid]
        done, upto = self._indexed[sid], len(seq) - 1  # a place needs a continuation token
        for end in range(max(done, k), upto + 1):
            places = self._index.get(key := (tenant, *seq[end - k : end]))
            if places is None:
                places = self._index[key] = collections.deque(maxlen=self.max_candidates)
            places.append((sid, end))
        if upto + 1 > done:
            self._indexed[sid] = upto + 1
            self._total += upto + 1 - done

    def _evict(self) -> None:
        """Drop the oldest sequences, and their places, while the store is past its budget."""
        k = self.key_len
        while self._total > self.max_tokens and len(self._seqs) > 1:
            sid, seq = self._seqs.popitem(last=False)
            indexed, tenant = self._indexed.pop(sid), self._tenant.pop(sid)
            self._total -= indexed
            for end in range(k, indexed):
                key = (tenant, *seq[end - k : end])
                places = self._index.get(key)
                if places is not None:
                    try:
                        places.remove((sid, end))
                    except ValueError:
                        pass  # already pushed out by newer places
                    if not places:
                        del self._index[key]


@dataclass(frozen=True)
class Scoped:
    """A SuffixStore as one tenant sees it (what a request's drafter is given): its sequences are
    the tenant's, its drafts come from the tenant's sequences alone."""

    store: SuffixStore
    tenant: object = None

    def add(self, tokens: Sequence[int]) -> int:
        return self.store.add(tokens, self.tenant)

    def draft(self, context: Sequence[int], max_len: int, **options) -> tuple[list[int], int]:
        return self.store.draft(context, max_len, tenant=self.tenant, **options)


class SuffixDraft:
    name = "suffix"
    exit_layer = None

    def __init__(self, store: SuffixStore, draft_len: int = 32, max_spec_factor: float = DEFAULT_FACTOR,
                 max_spec_offset: float = DEFAULT_OFFSET, seen_weight: float = DEFAULT_SEEN_WEIGHT,
                 min_prob: float = DEFAULT_MIN_PROB, payoff: bool = False):
        """store: where past sequences are kept (a SuffixStore, or a tenant's Scoped view); draft_len: γ, the most tokens a round
        (the engine lowers it further to what it may verify); max_spec_factor .. min_prob: the
        allowance and confidence floor of SuffixStore.draft; payoff: cut each draft to the length
        that commits the most tokens per second of verify on this machine
        (selfspec.drafters.draft_length), else keep what the allowance gives (the default: through
        the server on the agent sessions, the cut ran 1.57x AR against whole drafts' 1.81x on
        SmolLM2 and 1.10x against 1.09x on Qwen2.5-Coder 0.5B in int4, 2-core AMD EPYC)."""
        if draft_len < 1:
            raise ValueError(f"draft length must be >= 1, got {draft_len}")
        if max_spec_factor < 0 or seen_weight < 0 or not 0 <= min_prob <= 1:
            raise ValueError("need max_spec_factor, seen_weight >= 0 and min_prob in 0..1")
        self.store, self.draft_len, self.payoff = store, draft_len, payoff
        self.allowance = dict(max_spec_factor=max_spec_factor, max_spec_offset=max_spec_offset,
                              seen_weight=seen_weight, min_prob=min_prob)
        self.match_len = 0  # the last round's match length (0: no match)
        self._ratios: list[float] = []  # the last draft's confidences, token by token

    def begin(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        self._vocab = ctx.adapter.lm_head.out_features
        self.sid = self.store.add(ctx.committed)  # this request's prompt and output, for it and every later one
        # The model's calibration of the store's confidences (what was accepted per unit of them, by
        # draft position): with payoff, to cut drafts here; where the verifies may be shared, for
        # each draft's Draft.confidence. Learnt by the rounds of either; None for neither.
        self.length = length_for(ctx.adapter) if self.payoff or ctx.shared else None

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        device = self.ctx.adapter.device
        ratios: list[float] = []
        tokens, self.match_len = self.store.draft(self.ctx.committed, min(self.draft_len, max_len),
                                                  sid=self.sid, ratios=ratios, **self.allowance)
        if self.payoff and tokens:
            keep = self.length.choose(ratios)
            tokens, ratios = tokens[:keep], ratios[:keep]
        self._ratios = ratios
        draft = torch.tensor(tokens, dtype=torch.long, device=device)
        confidence = self.length.chances(ratios) if self.ctx.shared else None
        if self.ctx.sampling.greedy or not tokens:
            return Draft(tokens=draft, confidence=confidence)
        q = torch.zeros(len(tokens), self._vocab, dtype=torch.float32, device=device)  # [γ, vocab], one-hot
        q[torch.arange(len(tokens), device=device), draft] = 1.0
        return Draft(tokens=draft, draft_probs=q, confidence=confidence)

    def cut(self, m: int) -> None:
        """A batch verifies only the last draft's first m tokens: learn from those."""
        self._ratios = self._ratios[:m]

    def observe(self, n_accepted: int) -> None:
        if self.length is not None and self._ratios:
            self.length.learn(self._ratios, n_accepted)
        self._ratios = []
