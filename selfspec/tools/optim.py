"""The optimiser every trainer in selfspec.tools uses: AdamW, a linear warm-up, cosine decay."""

from __future__ import annotations

import math

import torch


def descend(optimizer, schedule, loss: torch.Tensor, loss_avg: float | None) -> float:
    """One optimiser and schedule step on `loss`; returns the running loss average shown on the bar."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    schedule.step()
    value = float(loss.detach())
    return value if loss_avg is None else 0.95 * loss_avg + 0.05 * value


def adamw_cosine(params, steps: int, lr: float, weight_decay: float):
    """AdamW with a linear warm-up (a tenth of the steps, at most 100) then cosine decay to 0."""
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    warmup = max(1, min(100, steps // 10))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    return optimizer, schedule
