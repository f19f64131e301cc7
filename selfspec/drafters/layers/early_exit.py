"""LayerSkip-style early exit: draft with layers 0 .. k-1 and the model's own final norm and head.

The draft writes the KV of layers < k for every token it feeds; those entries are exactly what
the full model computes for the same token, so the verify reuses them together with the exit
hidden states and only runs layers >= k over the draft (plus layers < k for the last draft
token, which the draft never fed). It is the shallow draft with the skip set "layers k .. L-1".

With an exit adapter (see selfspec.heads.exit_adapter) the draft's logits are head(adapter(h_k)); the
verify still continues from the raw h_k. With a context head (selfspec.heads.context_head) in its place,
head(C(h_k)) with C attending to the exit states of the whole context: the cache keeps them (see
KVCache.keep_exit_states) and the head's own KV cache follows the committed positions; the draft
then also stops at the first token whose top-1 probability is below `threshold` (double early
exit). With draft_vocab N the draft's head covers only the N most frequent tokens of a ranking
(see selfspec.heads.draft_head); the verify's head stays the full one.
"""

from __future__ import annotations

import torch

from selfspec.heads.context_head import DEFAULT_THRESHOLD, ContextHead, ContextState
from selfspec.heads.draft_head import PrunedHead
from selfspec.core.draft import Draft, DraftContext
from selfspec.drafters.layers.shallow import draft_shallow
from selfspec.heads.exit_adapter import ExitAdapter
from selfspec.model.skips import SkipSet


class EarlyExit:
    name = "early-exit"

    def __init__(self, exit_layer: int, draft_len: int, exit_adapter: ExitAdapter | ContextHead | None = None,
                 draft_vocab: int | None = None, ranking: torch.Tensor | None = None,
                 threshold: float | None = None):
        """exit_adapter: an exit adapter or a context head trained for this k; draft_vocab: N, the
        size of the pruned draft head (None: the model's full head); ranking: every token id, most
        frequent first (selfspec.heads.draft_head), whose first N it keeps; threshold: stop a draft after
        a token whose top-1 probability is below it (default: DEFAULT_THRESHOLD with a context
        head, else 0, never)."""
        if exit_layer is None or exit_layer < 1:
            raise ValueError(f"exit layer k must be >= 1, got {exit_layer}")
        if draft_len < 1:
            raise ValueError(f"draft length must be >= 1, got {draft_len}")
        if exit_adapter is not None and exit_adapter.exit_layer != exit_layer:
            raise ValueError(f"the exit adapter was trained for k={exit_adapter.exit_layer}, not k={exit_layer}")
        if draft_vocab is not None and (draft_vocab < 1 or ranking is None):
            raise ValueError(f"draft_vocab must be >= 1 and come with a token ranking, got {draft_vocab}")
        if threshold is not None and not 0 <= threshold <= 1:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        self.exit_layer = exit_layer
        self.draft_len = draft_len
        self.exit_adapter = exit_adapter
        if threshold is None:
            threshold = DEFAULT_THRESHOLD if isinstance(exit_adapter, ContextHead) else 0.0
        self.threshold = threshold
        self.context: ContextState | None = None  # the context head's state in this generation
        self.draft_vocab = draft_vocab
        self.ranking = ranking
        self.head: PrunedHead | None = None  # built at the first begin, for that model's weights

    def begin(self, ctx: DraftContext) -> None:
        n = ctx.adapter.n_layers
        if not 1 <= self.exit_layer <= n:
            raise ValueError(f"exit layer must be in 1..{n} for this {n}-layer model, got {self.exit_layer}")
        if self.exit_adapter is not None:
            hidden = ctx.adapter.embed_tokens.embedding_dim
            if self.exit_adapter.hidden_size != hidden:
                raise ValueError(f"the exit adapter maps hidden size {self.exit_adapter.hidden_size}, "
                                 f"this model's is {hidden}")
            self.exit_adapter.to(device=ctx.adapter.device, dtype=ctx.adapter.dtype)
            if isinstance(self.exit_adapter, ContextHead):
                ctx.cache.keep_exit_states(self.exit_layer, hidden)  # before the prefill, which writes them
                self.context = ContextState(self.exit_adapter, ctx.cache)
        if self.draft_vocab is not None and self.draft_vocab < ctx.adapter.lm_head.out_features:
            if self.ranking.numel() != ctx.adapter.lm_head.out_features:
                raise ValueError(f"the token ranking covers {self.ranking.numel()} tokens, this model's head "
                                 f"{ctx.adapter.lm_head.out_features}")
            if self.head is None or not self.head.built_for(ctx.adapter):
                self.head = PrunedHead(ctx.adapter, self.ranking[: self.draft_vocab])
        self.ctx = ctx
        self.skip = SkipSet.early_exit(self.exit_layer, n)

    def propose(self, pending: torch.Tensor, start: int, max_len: int) -> Draft:
        transform = self.exit_adapter if self.context is None else self.context.at(start)
        return draft_shallow(self.ctx, self.skip, pending, start, min(self.draft_len, max_len),
                             threshold=self.threshold, transform=transform, head=self.head)

    def observe(self, n_accepted: int) -> None:
        pass
