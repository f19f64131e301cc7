"""The pruned draft head: the ranking is counted right and its file is tied to the model; drafts with
it stay lossless, greedy and sampled, where q is zero outside the subset and the recovered token
carries the target's mass there."""

import pytest
import torch
from scipy.stats import chisquare

from lossless import PROMPT, assert_greedy_lossless, assert_sampling_matches_target, exact_second_token_marginal
from selfspec import cli
from selfspec.tools.calibrate import calibrate, save
from selfspec.heads.draft_head import (SECTION, PrunedHead, count_tokens, coverage, load_ranking, rank_tokens,
                                 read_header, save_ranking)
from selfspec.drafters import EarlyExit, make_drafter
from selfspec import Speculation
from selfspec.model.profiles import ModelIdentity, ProfileMismatchError, load_profile
from selfspec.core.sampling import SamplingParams
from selfspec.core.verifier import rejection_sample
from tiny_models import VOCAB

HIDDEN = 64  # the tiny models' hidden size
VARIED = [7, 8, 9, 10, 11, 12]  # a prompt on which tiny llama and qwen2 emit a dozen distinct tokens


class Recording(EarlyExit):
    """Early exit that keeps every draft it proposed."""

    def propose(self, *args):
        draft = super().propose(*args)
        self.drafts = getattr(self, "drafts", []) + [draft]
        return draft


def test_ranking_is_by_frequency_then_id():
    counts = count_tokens([[5, 5, 3], torch.tensor([3, 5, 7]), []], 10)
    assert counts.tolist() == [0, 0, 0, 2, 0, 3, 0, 1, 0, 0]
    assert rank_tokens(counts).tolist() == [5, 3, 7, 0, 1, 2, 4, 6, 8, 9]  # unseen tokens last, by id
    assert coverage(counts, [1, 2, 3, 10]) == {1: 0.5, 2: 5 / 6, 3: 1.0}  # N = vocab is no pruning
    with pytest.raises(ValueError, match="0..9"):
        count_tokens([[10]], 10)


def test_save_load_round_trip_and_identity_check(tiny, tmp_path):
    model = tiny("llama")
    counts = count_tokens([PROMPT, PROMPT[:4]], VOCAB)
    path = save_ranking(counts, tmp_path / "r.safetensors", model.identity, {"prompts": 2})
    assert torch.equal(load_ranking(path, model.identity), rank_tokens(counts))
    header = read_header(path)
    assert (header["vocab_size"], header["tokens"], header["source"]) == (VOCAB, len(PROMPT) + 4, {"prompts": 2})
    assert header["identity"]["config_hash"] == model.identity.config_hash

    with pytest.raises(ProfileMismatchError, match="belongs to 'tiny-llama'"):
        load_ranking(path, ModelIdentity("tiny-llama", "0" * 16))
    with pytest.raises(ProfileMismatchError):
        load_ranking(path, tiny("qwen3").identity)
    not_ranking = tmp_path / "b.safetensors"
    not_ranking.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_ranking(not_ranking, model.identity)
    with pytest.raises(FileNotFoundError, match="selfspec calibrate"):
        load_ranking(tmp_path / "missing.safetensors", model.identity)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])  # Gemma 3: tied head, final soft-cap
def test_pruned_head_is_the_full_head_on_its_subset(tiny, arch):
    adapter = tiny(arch).adapter
    torch.manual_seed(0)
    ids = torch.randperm(VOCAB)[:20]
    head = PrunedHead(adapter, ids)
    h = torch.randn(1, 5, HIDDEN)
    full = adapter.head(h)  # [5, vocab]
    assert torch.allclose(head.subset_logits(h), full[:, ids], atol=1e-5)
    expanded = head(h)
    outside = torch.ones(VOCAB, dtype=torch.bool).scatter(0, ids, False)
    assert torch.equal(expanded[:, ids], head.subset_logits(h))
    assert (expanded[:, outside] == float("-inf")).all()
    assert torch.equal(head.greedy(h), ids[full[:, ids].argmax(-1)])
    assert torch.equal(PrunedHead(adapter, torch.randperm(VOCAB)).greedy(h), full.argmax(-1))
    assert head.nbytes == 20 * HIDDEN * 4 + 20 * 8 and head.built_for(adapter)
    with pytest.raises(ValueError, match="distinct"):
        PrunedHead(adapter, torch.tensor([3, 3]))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tiny models whose output on VARIED varies
def test_greedy_output_with_a_pruned_head_equals_ar(tiny, arch):
    model = tiny(arch)
    ar = model.generate(VARIED, method="ar", max_new_tokens=40).tokens
    ranking = rank_tokens(count_tokens([ar], VOCAB))  # the model's own output, as calibrate counts it
    n = len(set(ar)) // 2  # the output's more frequent half
    drafter = Recording(3, 3, draft_vocab=n, ranking=ranking)
    out = assert_greedy_lossless(model, VARIED, drafter=drafter)
    drafted = torch.cat([d.tokens for d in drafter.drafts])
    assert torch.isin(drafted, ranking[:n]).all()  # the draft never leaves its subset ...
    assert not torch.isin(torch.tensor(out.tokens), ranking[:n]).all()  # ... the output does, through the verify
    assert out.stats.accepted > 0
    # N at least the vocabulary: no pruning, the plain early-exit draft.
    assert Recording(3, 3, draft_vocab=VOCAB, ranking=ranking).head is None


def test_rejection_sampling_is_exact_when_q_is_zero_where_p_is_not():
    """The verifier alone: q covers tokens 0, 1 only (a pruned head); the first emitted token
    must still follow p, tokens 2 and 3 coming only from the recovered draw."""
    trials = 20000
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q = torch.tensor([0.5, 0.5, 0.0, 0.0])
    draft = torch.multinomial(q, trials, replacement=True, generator=generator).view(trials, 1)
    n_accepted, recovered = rejection_sample(draft, q.expand(trials, 1, 4), p.expand(trials, 2, 4), generator)
    first = torch.where(n_accepted > 0, draft[:, 0], recovered)
    counts = torch.bincount(first, minlength=4)
    assert counts[2:].sum() == (recovered[n_accepted == 0] >= 2).sum()  # outside q: only recovered
    assert chisquare(counts.numpy(), (p * trials).numpy()).pvalue > 1e-3


def test_sampling_with_a_pruned_head_matches_the_target(tiny):
    model = tiny("llama")
    exact = exact_second_token_marginal(model, PROMPT, SamplingParams(temperature=1.5, top_k=6))
    excluded = exact.topk(2).indices  # the target's likeliest second tokens: the draft can never propose them
    kept = torch.ones(VOCAB, dtype=torch.bool).scatter(0, excluded, False).nonzero().flatten()
    drafter = Recording(4, 3, draft_vocab=VOCAB - 2, ranking=torch.cat([kept, excluded]))
    # The chi-square covers the excluded tokens too: their mass (checked real here) can only come
    # from the recovered draw, normalise(max(0, p - q)).
    assert exact[excluded].sum() > 0.2
    assert assert_sampling_matches_target(model, trials=300, drafter=drafter) > 0
    q = torch.cat([d.draft_probs for d in drafter.drafts if len(d)])  # [drafted, vocab]
    assert (q[:, excluded] == 0).all() and torch.allclose(q.sum(-1), torch.ones(len(q)))
    assert not torch.isin(torch.cat([d.tokens for d in drafter.drafts]), excluded).any()


def test_calibrate_ranks_prompts_and_outputs_and_generate_finds_it(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_PROFILES", str(tmp_path))
    model = tiny("llama")
    with pytest.raises(ValueError, match="run `selfspec calibrate`"):
        model.generate(PROMPT, method="early-exit", exit_layer=3, draft_vocab=16)
    prompts = [torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    result = calibrate(model, prompts, exit_layers=[2], max_new_tokens=12, steps=1, batch_size=16, holdout=0.25,
                       progress=False)
    outputs = [model.generate(p, method="ar", max_new_tokens=12).tokens for p in prompts]
    assert torch.equal(result.token_counts, count_tokens(prompts + outputs, VOCAB))
    save(result, model.identity)
    profile = load_profile(model.identity)
    assert load_ranking(profile[SECTION]["path"], model.identity).tolist() == rank_tokens(result.token_counts).tolist()
    drafter = make_drafter(model.resolve(Speculation("early-exit", exit_layer=3, draft_vocab=16)))
    assert drafter.draft_vocab == 16 and torch.equal(drafter.ranking, rank_tokens(result.token_counts))
    with pytest.raises(ValueError, match=">= 1"):
        Speculation("early-exit", exit_layer=3, draft_vocab=0)
    assert_greedy_lossless(model, method="early-exit", exit_layer=3, draft_vocab=16)  # found via the profile


def test_cli_draft_vocab_flag():
    parser = cli.build_parser()
    assert parser.parse_args(["generate", "--draft-vocab", "8", "hi"]).draft_vocab == 8
    assert parser.parse_args(["bench", "--draft-vocab", "8"]).draft_vocab == 8
    assert parser.parse_args(["generate", "hi"]).draft_vocab is None
    assert cli.main(["generate", "--draft-vocab", "0", "hi"]) == 2  # refused before loading a model
