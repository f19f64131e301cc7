"""The LayerSkip recipe's settings (`Recipe`) and schedules: the layer dropout rate of each layer,
each exit's loss weight, and the curriculum that picks the exits active at a step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CURRICULA = ("rotational", "gradual", "none")
GRADUAL_SHARE = 0.5  # the gradual curriculum has every exit on after this share of the steps


@dataclass(frozen=True)
class Recipe:
    steps: int = 300  # optimiser steps
    lr: float = 1e-4  # AdamW peak learning rate: linear warm-up over ~10% of steps, then cosine decay to 0
    batch_size: int = 8  # windows per step
    seq_len: int = 256  # tokens per window: longer documents are cut into windows
    p_max: float = 0.1  # the last layer's dropout rate; lower layers get less (dropout_rates)
    e_scale: float = 1.0  # the early exits' weight against the last layer's in the loss (exit_scales)
    curriculum: str = "rotational"  # which exits carry a loss at a step (active_exits)
    rotation: int = 8  # R of the rotational curriculum: every R-th exit is active at a step
    weight_decay: float = 0.01  # AdamW's, on matrices only (norm weights and biases keep theirs)
    clip: float = 1.0  # gradient norm clip
    seed: int = 0  # batches, layer dropout draws and the held-out split

    def check(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 2 or self.rotation < 1:
            raise ValueError("steps, batch size and rotation must be >= 1 and the sequence length >= 2")
        if not self.lr > 0 or not self.clip > 0 or self.weight_decay < 0:
            raise ValueError("the learning rate and gradient clip must be > 0 and weight decay >= 0")
        if not 0 <= self.p_max < 1:
            raise ValueError(f"the layer dropout rate p_max must be in [0, 1), got {self.p_max}")
        if self.e_scale < 0:
            raise ValueError(f"e_scale must be >= 0, got {self.e_scale}")
        if self.curriculum not in CURRICULA:
            raise ValueError(f"unknown curriculum {self.curriculum!r}; choose one of: {', '.join(CURRICULA)}")


def dropout_rates(n_layers: int, p_max: float) -> torch.Tensor:
    """Layer dropout rate of each layer [L]: p_max·(e^(l·ln2/(L-1)) - 1), rising from 0 at the
    first layer to exactly p_max at the last (LayerSkip's exponential depth scale)."""
    depth = torch.arange(n_layers, dtype=torch.float64) / max(1, n_layers - 1)
    return (p_max * torch.expm1(depth * math.log(2))).float()


def exit_scales(n_layers: int, e_scale: float) -> torch.Tensor:
    """e(k) for exits k = 1..L (index k-1), before normalisation: with l = k-1 the paper's
    e_scale·Σ_{i=0..l} i for the early exits, and L-1 + e_scale·Σ_{i=0..L-2} i for the last
    layer. Deeper exits weigh more (they are the ones that can match the full model); exit 1
    weighs 0, as in the paper; e_scale = 0 leaves plain next-token training."""
    layer = torch.arange(n_layers, dtype=torch.float64)
    scales = e_scale * layer * (layer + 1) / 2
    scales[-1] = (n_layers - 1) + e_scale * (n_layers - 2) * (n_layers - 1) / 2
    return scales.float()


def active_exits(step: int, steps: int, n_layers: int, curriculum: str, rotation: int) -> list[int]:
    """The exits k (1..L) whose loss counts at `step` of `steps`; the last layer always does."""
    early = range(1, n_layers)
    if curriculum == "rotational":  # exits k ≡ step + 1 (mod R): every exit once per R steps
        chosen = [k for k in early if (k - 1) % rotation == step % rotation]
    elif curriculum == "gradual":  # exit k from step GRADUAL_SHARE·steps·(L-k)/(L-1): top down
        chosen = [k for k in early if step >= GRADUAL_SHARE * steps * (n_layers - k) / max(1, n_layers - 1)]
    elif curriculum == "none":
        chosen = list(early)
    else:
        raise ValueError(f"unknown curriculum {curriculum!r}; choose one of: {', '.join(CURRICULA)}")
    return [*chosen, n_layers]


def exit_weights(exits: list[int], scales: torch.Tensor) -> dict[int, float]:
    """The loss weight of each active exit: e(k) normalised to sum to 1 over `exits`."""
    e = {k: float(scales[k - 1]) for k in exits}
    total = sum(e.values())
    return {k: v / total if total > 0 else 1 / len(e) for k, v in e.items()}
