"""Sibling drafts (Draft.siblings): m alternative tokens for the one position after the pending
token, verified in one forward where each alternative attends to the context and itself. Each
sibling row is exactly the one-row AR step of its token (fused layer, every kernel path); the
round keeps the model's own token from whichever slot holds it; greedy output equals AR and
sampled output follows the target distribution."""

import pytest
import torch
from lossless import PROMPT, assert_greedy_lossless, assert_sampling_matches_target

from selfspec.native import gemv
from selfspec.api import SelfSpecModel
from selfspec.core.draft import Draft
from selfspec.drafters.feature import FeatureDraft
from selfspec.model.quantize import quantize_int8
from selfspec.core.verifier import verify_siblings
from test_feature_head import random_head
from tiny_models import COMMON, VOCAB, build, tiny_model

pytestmark = pytest.mark.skipif(not gemv.available(), reason="no g++ or no AVX2/FMA: no fused layer, no siblings")


def _model(arch, dtype):
    if arch == "llama_hd64":
        from transformers import LlamaConfig
        hf = build(LlamaConfig(**{**COMMON, "head_dim": 64}), 0, torch.bfloat16 if dtype == "int8" else dtype)
    else:
        hf = tiny_model(arch, dtype=torch.bfloat16 if dtype == "int8" else dtype)
    if dtype == "int8":
        quantize_int8(hf)
    return SelfSpecModel(hf)


def _steps(adapter, ids, tokens):
    """Logits of a prefill of ids, then one-row steps of `tokens` in order."""
    cache = adapter.new_cache(len(ids) + len(tokens) + 2)
    adapter.run_layers(adapter.embed(ids), range(adapter.n_layers), 0, cache)
    out = [adapter.head(adapter.run_layers(adapter.embed(torch.tensor([t])), range(adapter.n_layers), len(ids) + i,
                                           cache)) for i, t in enumerate(tokens)]
    return torch.cat(out), cache


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3", "llama_hd64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"])
def test_each_sibling_row_is_the_one_row_step_of_its_token(arch, dtype, path):
    adapter = _model(arch, dtype).adapter
    assert adapter.runs_siblings(5)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (20,), generator=g)  # past every tiny sliding window
    pending, alternatives = 7, [11, 3, 50, 29]
    with torch.inference_mode():
        cache = adapter.new_cache(30)
        adapter.run_layers(adapter.embed(ids), range(adapter.n_layers), 0, cache)
        rows = adapter.head(adapter.run_layers(adapter.embed(torch.tensor([pending, *alternatives])),
                                               range(adapter.n_layers), 20, cache, siblings=True))
        for i, token in enumerate(alternatives):
            alone, reference = _steps(adapter, ids, [pending, token])
            assert torch.equal(rows[0], alone[0]) and torch.equal(rows[1 + i], alone[1])
            moved = _copy(cache)
            moved.move(21 + i, 21)  # what the engine does when it keeps alternative i
            assert torch.equal(moved.keys[:, :, :, :22], reference.keys[:, :, :, :22])
            assert torch.equal(moved.values[:, :, :, :22], reference.values[:, :, :, :22])


def _copy(cache):
    from copy import copy

    out = copy(cache)
    out.keys, out.values = cache.keys.clone(), cache.values.clone()
    return out


def test_the_verdict_is_the_models_token_then_the_bonus_from_its_alternatives_row():
    logits = torch.full((4, 10), -5.0)
    logits[0, 6] = 1.0  # the model's token after the pending one
    logits[1:, 2] = 1.0  # after each alternative
    logits[2, 8] = 2.0  # after alternative 1 (token 6): token 8
    verdict = verify_siblings(torch.tensor([4, 6, 1]), logits)
    assert verdict.tokens == [6, 8] and verdict.sibling == 1 and verdict.n_accepted == 1
    none = verify_siblings(torch.tensor([4, 5, 1]), logits)
    assert none.tokens == [6] and none.n_accepted == 0
    with pytest.raises(ValueError):
        verify_siblings(torch.tensor([4, 6]), logits)  # three alternatives need four rows


class Oracle:
    """Siblings that always hold the model's next token (greedy: from AR's own output; sampling:
    the target's whole top-k support, read with a probe), at a slot that moves every round."""

    name, exit_layer, draft_len = "oracle", None, 1

    def __init__(self, reference=None, m=3, top_k=None):
        self.reference, self.m, self.top_k, self.rounds = reference, m, top_k, 0

    def begin(self, ctx):
        self.ctx = ctx

    def propose(self, pending, start, max_len):
        self.rounds += 1
        if max_len < 1:
            return Draft(tokens=pending.new_empty(0))
        if self.reference is not None:
            right = self.reference[start + 1]
            others = [t for t in range(VOCAB) if t != right][self.rounds % 5:][:self.m - 1]
            tokens = others[:self.rounds % self.m] + [right] + others[self.rounds % self.m:]
        else:
            adapter = self.ctx.adapter
            h = adapter.run_layers(adapter.embed(pending), range(adapter.n_layers), start, self.ctx.cache, write=False)
            logits = adapter.head(h)
            tokens = logits.reshape(-1, logits.shape[-1])[-1].topk(self.top_k).indices.flip(0).tolist()
        return Draft(tokens=torch.tensor(tokens), siblings=True)

    def observe(self, n_accepted):
        pass


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_oracle_sibling_draft_equals_ar_wherever_the_right_token_sits(arch, dtype):
    model = _model(arch, dtype)
    ar = model.generate(PROMPT, method="ar", max_new_tokens=30)
    out = model.generate(PROMPT, drafter=Oracle(PROMPT + ar.tokens, m=3), max_new_tokens=30)
    assert out.tokens == ar.tokens
    # Every round but the last (one token short of the end: nothing to draft) kept its sibling.
    assert out.stats.accepted == out.stats.drafted == out.stats.rounds - 1 > 10


def test_sibling_sampling_follows_the_target_distribution():
    model = SelfSpecModel(tiny_model("llama"))
    # The oracle proposes the target's whole top-6 support, so every round keeps one and draws
    # the bonus from that sibling's row: the second token's marginal must still be the model's.
    accepted = assert_sampling_matches_target(model, drafter=Oracle(m=6, top_k=6), trials=1500)
    assert accepted > 0


def test_the_feature_head_drafts_siblings_and_stays_lossless():
    model = SelfSpecModel(tiny_model("llama", dtype=torch.bfloat16))
    head = random_head(model)
    chain = FeatureDraft(head, 1)
    siblings = FeatureDraft(head, 1, siblings=4)
    assert_greedy_lossless(model, drafter=chain)
    out = assert_greedy_lossless(model, drafter=siblings)
    assert out.stats.drafted == out.stats.rounds - 1  # one drafted position a round (none in the last)
    with pytest.raises(ValueError, match="siblings"):
        FeatureDraft(head, 1, siblings=0)


def test_the_engine_turns_siblings_it_cannot_verify_into_a_chain():
    """A batched decode (verify_rows takes chains only) and the cache's last slots get a
    one-token chain of the first alternative, or fewer alternatives; a lone sequence keeps them."""
    from selfspec.core.engine import Decoding
    from selfspec.core.sampling import SamplingParams
    from selfspec.core.stats import GenerationStats

    model = SelfSpecModel(tiny_model("llama"))
    ar = model.generate(PROMPT, method="ar", max_new_tokens=6).tokens

    def first_draft(**options):
        seq = Decoding(model.adapter, torch.tensor(PROMPT), Oracle(PROMPT + ar, m=3), sampling=SamplingParams(), max_new_tokens=6,
                       stats=GenerationStats("oracle"), **options)
        seq.prefill(measure_step=False)
        return seq, seq.draft()

    seq, alone = first_draft()
    assert alone.siblings and len(alone) == 3
    _, batched = first_draft(siblings=False)
    assert not batched.siblings and batched.tokens.tolist() == alone.tokens[:1].tolist()
    seq.cache.rewind(seq.cache.capacity - 4)  # two slots left before the scratch slot
    assert len(seq._fit_siblings(alone, room=1)) == 2


def test_sampling_turns_siblings_it_cannot_verify_into_a_plain_step():
    """A one-token chain would need the q its token was drawn from, which siblings lack: sampled
    siblings that cannot run become no draft, and decoding goes on."""
    from selfspec.core.engine import Decoding, verify_forward
    from selfspec.core.sampling import SamplingParams
    from selfspec.core.stats import GenerationStats

    model = SelfSpecModel(tiny_model("llama"))
    seq = Decoding(model.adapter, torch.tensor(PROMPT), Oracle(m=3, top_k=3), sampling=SamplingParams(temperature=1.0, seed=0),
                   max_new_tokens=6, stats=GenerationStats("oracle"), siblings=False)
    seq.prefill(measure_step=False)
    draft = seq.draft()
    assert not draft.siblings and len(draft) == 0
    tokens = seq.finish_round(draft, verify_forward(model.adapter, seq.cache, seq.pending, draft, seq.start))
    assert len(tokens) == 1
