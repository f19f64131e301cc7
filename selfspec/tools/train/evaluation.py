"""How the exits and the full model do on held-out data: cross-entropy and teacher-forced
agreement with the full model (also checked during training), and α on the model's own greedy
output."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.tools.train.data import Data, make_batch
from selfspec.tools.train.exits import Exits, cross_entropy, exit_forward
from selfspec.tools.tune.trace import trace


@dataclass
class Evaluation:
    loss: dict[int, float]  # k -> held-out CE of exit k's prediction; k = L is the full model
    # k -> share of held-out target positions where exit k's argmax is the full model's, teacher-forced on the text
    agree: dict[int, float]
    # k -> α on the model's own greedy outputs of the held-out prompts; empty in the checks during training
    alpha: dict[int, float] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)  # those greedy outputs


@torch.no_grad()
def held_out_losses(model, data: Data, exit_layers: list[int], batch_size: int) -> Evaluation:
    """CE of each exit in `exit_layers` and of the full model on the held-out windows, and the
    exits' teacher-forced agreement with the full model."""
    adapter, n_layers = model.adapter, model.n_layers
    ks = sorted({*exit_layers, n_layers})
    loss_sum, agree_sum, count = dict.fromkeys(ks, 0.0), dict.fromkeys(ks, 0), 0
    pad = sorted(model.eos_ids)[0] if model.eos_ids else 0
    with Exits(adapter.layers) as exits:
        for i in range(0, len(data.held_out), batch_size):
            batch = make_batch(data.held_out[i:i + batch_size], pad, adapter.device)
            logits = exit_forward(adapter, exits, batch, ks)
            target = batch.labels != -100
            n = int(target.sum())
            full = logits[n_layers].argmax(-1)[target]
            for k, lg in logits.items():
                loss_sum[k] += float(cross_entropy(lg, batch.labels)) * n
                agree_sum[k] += int((lg.argmax(-1)[target] == full).sum())
            count += n
    count = max(1, count)
    return Evaluation({k: v / count for k, v in loss_sum.items()},
                      {k: v / count for k, v in agree_sum.items() if k != n_layers})


def greedy_alpha(model, prompts: list[list[int]], exit_layers: list[int],
                 max_new_tokens: int) -> tuple[dict[int, float], list[list[int]]]:
    """α of each exit on the model's own greedy (AR) output of each prompt, by the logit lens over
    that output (tuner/trace.py: exactly what an early-exit draft at k would propose), and the outputs."""
    hits = {k: [] for k in exit_layers}
    outputs = []
    for prompt in prompts:
        tokens = model.generate(prompt, method="ar", max_new_tokens=max_new_tokens).tokens
        outputs.append(tokens)
        t = trace(model.adapter, prompt, tokens, max_new_tokens, exit_layers)
        for k in exit_layers:
            hits[k] += t.hits[k][1:].tolist()  # hits[k][0] is the prefill's token, never drafted
    return {k: sum(h) / max(1, len(h)) for k, h in hits.items()}, outputs


def evaluate(model, data: Data, exit_layers: list[int], batch_size: int, alpha_tokens: int) -> Evaluation:
    result = held_out_losses(model, data, exit_layers, batch_size)
    result.alpha, result.outputs = greedy_alpha(model, data.prompts, exit_layers, alpha_tokens)
    return result
