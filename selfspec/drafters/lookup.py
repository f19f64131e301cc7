"""Prompt lookup (Saxena 2023; n-gram drafting as in vLLM and llama.cpp): no model, no memory.

The draft copies what followed the last place the context's own tail appeared before. Outputs that
quote or rework their input (summaries, code edits, extraction, retrieval answers) repeat long
spans of it, and those spans are drafted for free; a round with no match drafts nothing and is a
plain autoregressive step.

Matching, in `find_draft`: the longest suffix n-gram first (n from max_ngram down to min_ngram);
among matches of that length the most recent, since nearby text predicts best and a loop the
model has fallen into is its latest repetition. The draft is the continuation copied at the
match's distance, so a match closer than γ tokens back repeats periodically into the draft itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from selfspec.core.draft import Draft, DraftContext


def find_draft(tokens: Sequence[int] | np.ndarray, max_ngram: int = 3, min_ngram: int = 1,
               max_len: int = 8) -> list[int]:
    """Up to max_len tokens predicted to follow `tokens`, or [] when no suffix n-gram with
    min_ngram <= n <= max_ngram occurs earlier in them.

    One vectorised pass, O(len · max_ngram): run[e] counts how many of the last tokens agree with
    the tokens ending at an earlier position e, capped at max_ngram; the longest run wins and the
    latest e breaks ties.
    """
    if max_len <= 0 or max_ngram < 1 or min_ngram > max_ngram:
        return []
    ids = np.asarray(tokens, dtype=np.int64)
    last = ids.shape[0] - 1  # e < last, so every candidate has at least one token after it
    if last < 1:
        return []
    run = np.zeros(last, dtype=np.int64)
    alive = ids[:last] == ids[last]  # [last] the suffix 1-gram ends at e
    for t in range(max_ngram):
        if t:
            if t >= last:
                break
            alive[t:] &= ids[: last - t] == ids[last - t]
            alive[:t] = False  # an n-gram ending at e < t would start before the context
        if not alive.any():
            break
        run += alive
    n = int(run.max())
    if n < min_ngram:
        return []
    end = int(np.flatnonzero(run == n)[-1])
    lag = last - end  # the continuation is the context shifted by this many tokens
    source = ids[end + 1 : end + 1 + max_len].tolist()
    draft = source[:lag]
    while len(draft) < max_len:  # ran into the tail: keep copying at the same lag, from the draft
        draft.append(draft[len(draft) - lag])
    return draft[:max_len]


class PromptLookup:
    name = "lookup"
    exit_layer = None

    def __init__(self, draft_len: int = 8, ngram: int = 3, min_ngram: int = 1):
        """draft_len: γ, the most tokens per round; ngram: the longest suffix n-gram matched;
        min_ngram: the shortest (1 accepts a single-token match)."""
        if draft_len < 1:
            raise ValueError(f"draft length must be >= 1, got {draft_len}")
        if not 1 <= min_ngram <= ngram:
            raise ValueError(f"need 1 <= min_ngram <= ngram, got min_ngram={min_ngram}, ngram={ngram}")
        self.draft_len = draft_len
        self.ngram = ngram
        self.min_ngram = min_ngram

    def begin(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        self._vocab = ctx.adapter.lm_head.out_features
        # ctx.committed only grows: mirror it in an array so each round converts only new tokens.
        self._ids = np.empty(max(256, 2 * len(ctx.committed)), dtype=np.int64)
        self._n = 0

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        device = self.ctx.adapter.device
        tokens = find_draft(self._context(), self.ngram, self.min_ngram, min(self.draft_len, max_len))
        draft = torch.tensor(tokens, dtype=torch.long, device=device)
        if self.ctx.sampling.greedy or not tokens:
            return Draft(tokens=draft)
        # A deterministic draft: q is one-hot on each drafted token, so rejection sampling accepts
        # d_i with probability p_i(d_i) and otherwise draws from p_i with d_i removed.
        q = torch.zeros(len(tokens), self._vocab, dtype=torch.float32, device=device)  # [γ, vocab]
        q[torch.arange(len(tokens), device=device), draft] = 1.0
        return Draft(tokens=draft, draft_probs=q)

    def observe(self, n_accepted: int) -> None:
        pass

    def _context(self) -> np.ndarray:
        """Every token by position, the pending one last, as an array view."""
        committed = self.ctx.committed
        if len(committed) > self._ids.shape[0]:
            self._ids = np.resize(self._ids, 2 * len(committed))
        self._ids[self._n : len(committed)] = committed[self._n :]
        self._n = len(committed)
        return self._ids[: self._n]
