"""Mixture-of-experts models: the adapter runs them as transformers does, and expert-subset drafts
(fewer routed experts per MoE layer) stay lossless, route with the budget asked, and leave no
draft-time KV behind."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, OlmoeConfig

import selfspec.model.cache
from lossless import PROMPT, assert_adapter_matches_transformers, assert_greedy_lossless, assert_sampling_matches_target
from selfspec import SelfSpecModel
from selfspec.model.adapter import ModelAdapter, UnsupportedModelError
from selfspec.tools.bench import _methods
from selfspec.drafters.layers.expert_subset import ExpertSubset
from selfspec.model.moe import experts_per_token, moe_layers, routed
from tiny_models import COMMON
from tiny_moe import MOE_ARCHS, TOP_K, tiny_moe_model

FIRST_MOE_LAYER = {"mixtral": 0, "qwen2_moe": 1, "qwen3_moe": 1}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_adapter_logits_match_transformers_forward(arch):
    model = tiny_moe_model(arch)
    adapter = ModelAdapter(model)
    assert moe_layers(adapter.layers)[0] == FIRST_MOE_LAYER[arch] and experts_per_token(adapter.layers) == TOP_K
    assert_adapter_matches_transformers(model, adapter)


def _reference_routed(block, x, budget):
    """The budgeted MoE output computed by hand from the fused expert tensors."""
    probs = F.softmax(F.linear(x, block.gate.weight).float(), dim=-1)
    top, index = probs.topk(budget, dim=-1)
    if getattr(block.gate, "norm_topk_prob", True):
        top = top / top.sum(-1, keepdim=True)
    experts = block.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(top[t], index[t]):
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += w * (experts.down_proj[e] @ (experts.act_fn(gate) * up))
    if hasattr(block, "shared_expert"):
        out += torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routed_uses_the_budget_and_the_models_weighting(arch):
    block = tiny_moe_model(arch).model.layers[FIRST_MOE_LAYER[arch]].mlp
    x = torch.randn(1, 5, COMMON["hidden_size"], generator=torch.Generator().manual_seed(2))  # [batch, seq, hidden]
    with torch.inference_mode():
        torch.testing.assert_close(routed(block, x, 1)[0], _reference_routed(block, x[0], 1), atol=1e-5, rtol=1e-5)
        assert torch.equal(routed(block, x, TOP_K), block(x))  # the full budget is the block itself
        assert not torch.allclose(routed(block, x, 1), block(x), atol=1e-3)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_expert_subset_equals_ar(arch, tiny):
    model = tiny(arch)
    out = assert_greedy_lossless(model, method="expert-subset", draft_len=4)
    assert 0 < out.stats.alpha < 1  # top-1 drafts are neither always right nor always wrong
    assert_greedy_lossless(model, n=20, method="expert-subset", experts=1, exit_layer=4, draft_len=3)
    # The full budget at full depth is the full model: every draft token is accepted.
    assert assert_greedy_lossless(model, n=20, method="expert-subset", experts=TOP_K).stats.alpha == 1.0


def test_sampling_matches_target():
    # Three layers (one dense, two MoE with a shared expert) keep 400 generations to seconds.
    model = SelfSpecModel(tiny_moe_model("qwen2_moe", layers=3), name="tiny-qwen2_moe-3")
    accepted = assert_sampling_matches_target(model, trials=400, method="expert-subset", draft_len=3)
    assert accepted > 0


def test_draft_routes_with_the_budget_and_verify_with_top_k(tiny, monkeypatch):
    """Count the experts each token is sent to, per call of the experts, in the draft and outside it."""
    model = tiny("mixtral")
    widths = {"draft": set(), "full": set()}
    phase = ["full"]
    for i in moe_layers(model.adapter.layers):
        model.adapter.layers[i].mlp.experts.register_forward_hook(
            lambda module, args, out: widths[phase[0]].add(args[1].shape[-1]))  # args: (x, top_k_index, weights)
    propose = ExpertSubset.propose

    def drafting(self, *args):
        phase[0] = "draft"
        try:
            return propose(self, *args)
        finally:
            phase[0] = "full"

    monkeypatch.setattr(ExpertSubset, "propose", drafting)
    model.generate(PROMPT, method="expert-subset", experts=1, max_new_tokens=12)
    assert widths == {"draft": {1}, "full": {TOP_K}}


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_verify_overwrites_draft_time_kv(arch, tiny, monkeypatch):
    """Layers before the first MoE layer are reused (the draft's boundary); after the run, every
    committed position holds the full model's KV in every layer, as plain AR leaves it."""
    model = tiny(arch)
    caches, drafts = [], []
    init, propose = selfspec.model.cache.KVCache.__init__, ExpertSubset.propose

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        caches.append(self)

    def recording(self, *args):
        drafts.append(propose(self, *args))
        return drafts[-1]

    monkeypatch.setattr(selfspec.model.cache.KVCache, "__init__", keep)
    monkeypatch.setattr(ExpertSubset, "propose", recording)
    assert_greedy_lossless(model, n=24, method="expert-subset", draft_len=4)
    ar, spec = caches
    assert {draft.exit_layer for draft in drafts if len(draft)} == {FIRST_MOE_LAYER[arch]}
    n = min(ar.length, spec.length)
    assert n > len(PROMPT) + 10
    torch.testing.assert_close(spec.keys[..., :n, :], ar.keys[..., :n, :], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(spec.values[..., :n, :], ar.values[..., :n, :], atol=1e-4, rtol=1e-4)


def test_dense_model_rejects_expert_subset(tiny):
    with pytest.raises(UnsupportedModelError, match="dense model"):
        tiny("llama").generate(PROMPT, method="expert-subset", max_new_tokens=4)


def test_budget_above_top_k_is_refused(tiny):
    with pytest.raises(ValueError, match=f"1..{TOP_K}"):
        tiny("mixtral").generate(PROMPT, method="expert-subset", experts=TOP_K + 1, max_new_tokens=4)


def test_bench_all_includes_expert_subset_only_for_moe(tiny):
    args = SimpleNamespace(method=["all"], exit_layer=None, draft_len=None, draft_vocab=None, experts=None)
    assert "expert-subset" not in [m.method for m in _methods(args, tiny("llama"))]
    chosen = [m for m in _methods(args, tiny("qwen3_moe")) if m.method == "expert-subset"]
    assert [(m.speculation.experts, m.exit_layer) for m in chosen] == [(1, None)]
    with pytest.raises(ValueError, match="mixture-of-experts"):
        _methods(SimpleNamespace(**{**vars(args), "method": ["expert-subset"]}), tiny("llama"))


def test_olmoe_is_refused_with_the_reason():
    config = OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2)
    config.eos_token_id = config.pad_token_id = None
    with pytest.raises(UnsupportedModelError, match="whole projection"):
        ModelAdapter(AutoModelForCausalLM.from_config(config))
