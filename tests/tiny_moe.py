"""Tiny random-initialised mixture-of-experts decoders of every supported MoE architecture.

Each one exercises a different part of the routing or the layout: Mixtral renormalises its top-k
and has a sliding window on every layer; Qwen2-MoE keeps raw router probabilities, adds a shared
expert behind a sigmoid gate, has a dense first layer and sliding windows on some layers; Qwen3-MoE
renormalises, normalises q/k per head and alternates dense and MoE layers (first MoE layer 1).
"""

import torch
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from tiny_models import COMMON, build

EXPERTS = 4  # routed experts per MoE layer
TOP_K = 2  # experts each token uses in the full model


def _configs(layers: int = COMMON["num_hidden_layers"]):
    moe = dict(num_experts_per_tok=TOP_K)
    common = {**COMMON, "num_hidden_layers": layers}
    return {
        "mixtral": MixtralConfig(**common, **moe, num_local_experts=EXPERTS, sliding_window=7),
        "qwen2_moe": Qwen2MoeConfig(
            **common, **moe, num_experts=EXPERTS, moe_intermediate_size=64, shared_expert_intermediate_size=96,
            norm_topk_prob=False, mlp_only_layers=[0], use_sliding_window=True, sliding_window=5, max_window_layers=4,
        ),
        "qwen3_moe": Qwen3MoeConfig(
            **common, **moe, num_experts=EXPERTS, moe_intermediate_size=64, head_dim=16, norm_topk_prob=True,
            decoder_sparse_step=2,
        ),
    }


MOE_ARCHS = list(_configs())


def tiny_moe_model(arch: str, seed: int = 0, dtype=torch.float32, layers: int = COMMON["num_hidden_layers"]):
    """A random MoE model, initialised as tiny_models.tiny_model (peaked logits, no greedy near-ties);
    fewer `layers` for tests that generate thousands of times."""
    return build(_configs(layers)[arch], seed, dtype)
