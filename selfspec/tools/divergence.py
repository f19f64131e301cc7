"""Where a speculative output first leaves AR's, and whether that is a near tie.

Outside exact mode a verify's rows go through matrix products over several rows, which some CPUs
round differently from the one-row products AR runs. Greedy output then equals AR's unless AR's two
best logits at some position lie within that rounding of each other: a near tie. This module
finds the first differing position and AR's top-2 logit gap there, so that tests and the
benchmark can tell a near tie (rounding, allowed outside exact mode) from a real divergence (a bug).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The largest top-2 logit gap that rounding of multi-row products can flip, per activation dtype:
# float32 differences measured here are ~4e-5 on the logit scale; bfloat16 keeps 8 bits of
# mantissa in every hidden state, so its logits move by a few hundredths to tenths.
NEAR_TIE_GAP = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}


@dataclass(frozen=True)
class Divergence:
    index: int  # first new-token position where the outputs differ
    gap: float  # AR's top-1 minus top-2 logit there
    limit: float  # NEAR_TIE_GAP of the model's dtype

    @property
    def near_tie(self) -> bool:
        return self.gap <= self.limit

    def __str__(self) -> str:
        kind = "near tie" if self.near_tie else "NOT a near tie"
        return f"first difference at new token {self.index}: AR's top-2 logit gap {self.gap:.3g} ({kind}, limit {self.limit:g})"


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def divergence(adapter, prompt_ids: torch.Tensor, ar_tokens: list[int], other: list[int]) -> Divergence | None:
    """None when `other` equals AR's output; else the first difference and AR's logit gap there
    (one full-depth forward over the prompt and AR's tokens before it)."""
    i = first_difference(ar_tokens, other)
    if i is None:
        return None
    ids = torch.cat([prompt_ids.view(-1).to(adapter.device), torch.tensor(ar_tokens[:i], dtype=torch.long,
                                                                          device=adapter.device)])
    cache = adapter.new_cache(ids.numel() + 1)
    h = adapter.run_layers(adapter.embed(ids), range(adapter.n_layers), 0, cache)
    top = adapter.head(h[:, -1:])[0].topk(2).values
    return Divergence(i, float(top[0] - top[1]), NEAR_TIE_GAP.get(adapter.dtype, 0.25))
