"""Mixture-of-experts routing with an expert budget: the draft of `expert-subset`.

In a MoE decoder (Mixtral, Qwen2-MoE, Qwen3-MoE) some or all layers' `mlp` is a sparse block: a
router `gate` scores every expert and keeps each token's top-k, and `experts` (the fused expert
weights, run by whichever experts implementation transformers chose) sums those k experts'
outputs weighted by the router. The full model, and so the verify, calls the block itself.
A draft calls `routed(block, x, budget)`: the same router, the same expert weights (never a copy),
but each token goes only to its `budget` best-scored experts, so the draft computes budget/k of
the routed expert work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def is_moe_block(module: torch.nn.Module | None) -> bool:
    """A transformers sparse-MoE block: a top-k router `gate` and fused `experts`. (Dense MLPs
    call their projection `gate_proj`, so the two never collide.)"""
    return module is not None and hasattr(module, "experts") and hasattr(getattr(module, "gate", None), "top_k")


def moe_layers(layers) -> list[int]:
    """Indices of the decoder layers whose MLP is a MoE block (Qwen2/3-MoE may keep some dense)."""
    return [i for i, layer in enumerate(layers) if is_moe_block(getattr(layer, "mlp", None))]


def experts_per_token(layers) -> int | None:
    """k, the routed experts each token uses per MoE layer; None for a dense model."""
    moe = moe_layers(layers)
    return layers[moe[0]].mlp.gate.top_k if moe else None


def routed(block: torch.nn.Module, x: torch.Tensor, budget: int) -> torch.Tensor:
    """The MoE block's output on x [..., hidden] with each token routed to its `budget`
    best-scored experts instead of the model's top-k.

    The top `budget` weights are re-normalised exactly when the model's router re-normalises its
    top-k (Mixtral always, its router has no flag; Qwen-MoE when `norm_topk_prob`), otherwise
    they stay the router's softmax probabilities, as the model would weight them. A dense MLP, or
    a budget of k or more, runs the block itself: the full model's output, bit for bit.
    """
    if not is_moe_block(block) or budget >= block.gate.top_k:
        return block(x)
    flat = x.reshape(-1, x.shape[-1])  # [tokens, hidden]
    _, weights, index = block.gate(flat)  # [tokens, k] each, best first (torch.topk sorts)
    weights, index = weights[:, :budget], index[:, :budget]
    if getattr(block.gate, "norm_topk_prob", True):
        kept = weights.float()
        weights = (kept / kept.sum(dim=-1, keepdim=True)).to(weights.dtype)
    out = block.experts(flat, index, weights)
    if hasattr(block, "shared_expert"):  # Qwen2-MoE: a dense expert every token takes, behind a sigmoid gate
        out = out + F.sigmoid(block.shared_expert_gate(flat)) * block.shared_expert(flat)
    return out.reshape(x.shape)
