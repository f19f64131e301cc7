"""Turning logits into a sampling distribution, and drawing from it.

The same `logits_to_probs` is applied to the draft's logits (giving q, `draft_probs`) and to the
target's logits (giving p, `target_probs`). Speculative sampling is then exact for the *filtered*
target distribution, i.e. it samples exactly what plain decoding with these params would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # logits are divided by it; 0 means greedy (argmax)
    top_k: int = 0  # keep only the k most likely tokens; 0 means off
    top_p: float = 1.0  # keep the smallest set with at least this mass (nucleus); 1 means off
    seed: int | None = None  # seeds the sampling generator; None draws from torch's global RNG

    def __post_init__(self) -> None:
        # `not (x >= 0)` also rejects NaN.
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """[..., V] logits of any float dtype -> [..., V] float32 probabilities.

    Temperature, then top-k, then top-p (the smallest prefix of the sorted distribution whose mass
    reaches top_p; the most likely token is always kept, as in Hugging Face), then renormalise.
    With temperature 0 this returns the one-hot argmax, the limit of the above; the engine takes the
    greedy path instead of calling it.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature

    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))

    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # A token is kept if the mass strictly before it has not yet reached top_p.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))

    return torch.softmax(logits, dim=-1)


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """[..., V] probabilities (need not be normalised) -> [...] token ids."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator on `device` seeded with `seed`; None (torch's global RNG) when seed is None."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
