"""Feature-head drafting (selfspec.heads.feature_head): no layers of the model run in the draft.

Per round the head's KV cache takes in the committed positions (their final states, which the
verify wrote into the model's cache, and their tokens); then each draft token is one step of the
head from the previous final state (the model's for the first, the head's own prediction after
that) and the previous token, through the model's norm and head (or the pruned draft head). The
draft stops early after a token whose top-1 probability is below `threshold`. The verify runs the
full model over the pending token and the draft, as for prompt lookup.

siblings = m > 1: a one-token draft of the head's m likeliest tokens as alternatives (Draft.siblings),
verified in one forward of m + 1 rows (each alternative beside the pending token, attending to the
context and itself), of which the round keeps the one the model chose, if any. Where rows cost
little more than one (AMX), that buys the head's top-m agreement for about a 1-token verify.
"""

from __future__ import annotations

import torch

from selfspec.heads.draft_head import PrunedHead
from selfspec.core.draft import Draft, DraftContext
from selfspec.core.verify_clock import PerModel, clock_for
from selfspec.drafters.draft_length import DraftLength
from selfspec.drafters.layers.shallow import draft_token, head_logits, top1
from selfspec.heads.feature_head import FeatureHead, FeatureState
from selfspec.native.fused_feature import FusedFeature, unsupported_reason
from selfspec.native.fused_layer import ROWS

DEFAULT_THRESHOLD = 0.3  # stop a draft after a token the head gives less than this
# What the verify accepted per unit of the head's top-1 probability, by draft position, per model:
# each token's Draft.confidence (a batch weighs which draft tokens to verify by it).
calibration_for = PerModel(lambda adapter: DraftLength(clock_for(adapter)))


class FeatureDraft:
    name = "feature"
    exit_layer = None

    def __init__(self, head: FeatureHead, draft_len: int = 3, draft_ids: torch.Tensor | None = None,
                 threshold: float | None = None, siblings: int = 1):
        """head: a trained feature head for this model; draft_len: γ, the most tokens per round;
        draft_ids: the token ids of the pruned draft head (the ones the head was trained with;
        None: the model's full head); threshold: stop after a token whose draft top-1 probability
        is below it (default DEFAULT_THRESHOLD; 0 never stops early); siblings: m > 1 drafts the
        m likeliest first tokens as alternatives instead of a chain, where the engine runs them
        (DraftContext.siblings and ModelAdapter.runs_siblings), else the chain."""
        if draft_len < 1:
            raise ValueError(f"draft length must be >= 1, got {draft_len}")
        if draft_ids is not None and not draft_ids.numel():
            raise ValueError("a pruned draft head needs at least one token id")
        threshold = DEFAULT_THRESHOLD if threshold is None else threshold
        if not 0 <= threshold <= 1:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if not 1 <= siblings < ROWS:
            raise ValueError(f"siblings must be 1 (a chain) .. {ROWS - 1}, got {siblings}")
        self.siblings = siblings
        self.feature_head, self.draft_len, self.threshold = head, draft_len, threshold
        self.draft_ids = draft_ids
        self.head: PrunedHead | None = None  # built at the first begin, for that model's weights

    def begin(self, ctx: DraftContext) -> None:
        adapter = ctx.adapter
        hidden = adapter.embed_tokens.embedding_dim
        if (self.feature_head.hidden_size, self.feature_head.n_layers) != (hidden, adapter.n_layers):
            raise ValueError(f"the feature head was made for hidden size {self.feature_head.hidden_size} and "
                             f"{self.feature_head.n_layers} layers, this model has {hidden} and {adapter.n_layers}")
        self.feature_head.to(device=adapter.device, dtype=adapter.dtype)
        ctx.cache.keep_exit_states(adapter.n_layers, hidden)  # before the prefill, which writes them
        if self.draft_ids is not None and (self.head is None or not self.head.built_for(adapter)):
            self.head = PrunedHead.shared(adapter, self.draft_ids)
        self.ctx = ctx
        self.calibration = calibration_for(adapter)
        self._top: list[float] = []  # the last chain draft's top-1 probabilities (where shared), token by token
        fused = None
        if unsupported_reason(self.feature_head, adapter, self.head) is None:
            fused = FusedFeature(self.feature_head, adapter, self.head)
        self.state = FeatureState(self.feature_head, ctx.cache, adapter.embed, fused)

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        gamma, self._top = min(self.draft_len, max_len), []
        if gamma <= 0:
            return Draft(tokens=pending.new_empty(0))
        predicted = self.state.first(start, self.ctx.committed)
        m = self.siblings  # the engine trims them to the cache (Decoding._fit_siblings)
        if m > 1 and self.ctx.siblings and self.ctx.adapter.runs_siblings(m + 1):
            # The fused step's logits, else the head's; no draw (siblings need no q).
            logits = self.state.logits if self.state.logits is not None else head_logits(self.ctx, predicted, head=self.head)
            top = logits.reshape(-1, logits.shape[-1])[-1].topk(min(m, logits.shape[-1])).indices
            return Draft(tokens=top if self.head is None else self.head.ids[top], siblings=True)
        token, tokens, probs = pending, [], []
        for i in range(gamma):
            if i:
                predicted = self.state.step(predicted, token)
            token, q, logits = draft_token(self.ctx, predicted, self.ctx.generator, head=self.head,
                                           logits=self.state.logits)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            more = i + 1 < gamma and self.threshold > 0  # a draft goes on while the token is likely
            if more or self.ctx.shared:  # (a shared verify weighs every token by it)
                top = top1(q, logits)
                if self.ctx.shared:
                    self._top.append(top)
                if more and top < self.threshold:
                    break
        return Draft(tokens=torch.cat(tokens), draft_probs=torch.cat(probs) if probs else None,
                     confidence=self.calibration.chances(self._top) if self.ctx.shared else None)

    def cut(self, m: int) -> None:
        """A batch verifies only the last draft's first m tokens: learn from those."""
        self._top = self._top[:m]

    def observe(self, n_accepted: int) -> None:
        """Calibrate the head's top-1 probabilities by what the verify accepted (Draft.confidence)."""
        if self._top:
            self.calibration.learn(self._top, n_accepted)
        self._top = []
