"""The context head: untrained it is plain early exit; its file is tied to the model; the exit
states it reads are the committed positions' h_k after rewinds, alone and batched; trained or
not, output stays the full model's; a few steps of training lower the held-out KL."""

import json

import pytest
import torch
from lossless import (
    PROMPT,
    REPETITIVE,
    assert_greedy_lossless,
    assert_sampling_matches_target,
)
from tiny_models import VOCAB, tiny_checkpoint_with_prompts, tiny_model

import selfspec
from selfspec.api import EXACT_ROWS
from selfspec.tools.calibrate import save
from selfspec.tools.calibrate.data import self_distillation
from selfspec.cli import main
from selfspec.tools.context_calibrate import (
    Sequences,
    Student,
    alpha_by_position,
    calibrate_context,
    run_lengths,
    train_context_head,
)
from selfspec.heads.context_head import (
    SECTION,
    ContextHead,
    default_path,
    load_context_head,
    read_header,
    save_context_head,
)
from selfspec.heads.draft_head import PrunedHead
from selfspec.core.speculation import Resolved, Speculation
from selfspec.drafters import EarlyExit, make_drafter
from selfspec.core.engine import Decoding, verify_rows
from selfspec.heads.exit_adapter import ExitAdapter, save_exit_adapter
from selfspec.model.profiles import (
    ModelIdentity,
    ProfileMismatchError,
    load_profile,
    save_section,
)
from selfspec.core.sampling import SamplingParams
from selfspec.core.stats import GenerationStats
from selfspec.tools.tune.trace import exit_states

HIDDEN = 64  # the tiny models' hidden size


def perturbed(k: int, seed: int = 0, scale: float = 0.3) -> ContextHead:
    """A head far from the identity (random output projections), as if badly trained."""
    torch.manual_seed(seed)
    head = ContextHead(HIDDEN, k, heads=2, head_dim=16)
    with torch.no_grad():
        head.o.weight.normal_(0.0, scale)
        head.down.weight.normal_(0.0, scale)
    return head.eval().requires_grad_(False)


class Recording(EarlyExit):
    """Early exit that keeps every draft it proposed."""

    def propose(self, *args):
        draft = super().propose(*args)
        self.drafts = getattr(self, "drafts", []) + [draft.tokens.tolist()]
        return draft


def test_untrained_head_is_plain_early_exit(tiny):
    model = tiny("llama")
    h = torch.randn(2, 5, HIDDEN)
    assert torch.equal(ContextHead(HIDDEN, 3)(h), h)
    plain, headed = Recording(3, 3), Recording(3, 3, exit_adapter=ContextHead(HIDDEN, 3), threshold=0)
    assert model.generate(PROMPT, max_new_tokens=30, drafter=headed).tokens == \
        model.generate(PROMPT, max_new_tokens=30, drafter=plain).tokens
    assert headed.drafts == plain.drafts


def test_teacher_forced_forward_equals_the_drafting_step():
    """Training runs the head over whole sequences (at chosen positions), drafting one position at
    a time against its own KV cache: the same function."""
    head = perturbed(2)
    h = torch.randn(1, 9, HIDDEN)
    whole = head(h)
    kv = head.new_kv(16, dtype=torch.float32, device="cpu")
    head.extend(h[:, :4], 0, kv)
    steps = torch.cat([head.step(h[:, t:t + 1], t, kv) for t in range(4, 9)], dim=1)
    torch.testing.assert_close(steps, whole[:, 4:], atol=1e-5, rtol=1e-5)
    picked = head(torch.cat([h, torch.randn(1, 3, HIDDEN)], dim=1), torch.tensor([[2, 7, 8]]))  # padding after
    torch.testing.assert_close(picked, whole[:, [2, 7, 8]], atol=1e-5, rtol=1e-5)
    kv.rewind(2)  # a rewind is a length: two positions at once match too
    torch.testing.assert_close(head.step(h[:, 2:4], 2, kv), whole[:, 2:4], atol=1e-5, rtol=1e-5)


def test_save_load_round_trip_and_identity_check(tiny, tmp_path):
    model = tiny("llama")
    head = perturbed(3)
    path = save_context_head(head, tmp_path / "c.safetensors", model.identity, {"alpha_after": 0.5})
    loaded = load_context_head(path, model.identity)
    assert (loaded.exit_layer, loaded.heads, loaded.head_dim, loaded.width) == (3, 2, 16, HIDDEN)
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)
    assert read_header(path)["training"] == {"alpha_after": 0.5}
    with pytest.raises(ProfileMismatchError, match="belongs to 'tiny-llama'"):
        load_context_head(path, ModelIdentity("tiny-llama", "0" * 16))
    with pytest.raises(ProfileMismatchError):
        load_context_head(path, tiny("qwen3").identity)
    mlp = save_exit_adapter(ExitAdapter(HIDDEN, 3), tmp_path / "a.safetensors", model.identity)
    with pytest.raises(ValueError, match="not a selfspec context head"):
        load_context_head(mlp, model.identity)


def _check_exit_states(adapter, drafter: EarlyExit, tokens: list[int], behind: int = 8):
    """The cache's exit states and the head's keys and values at every committed position equal
    those of an independent full forward over the committed tokens; the head's are filled up to
    the last round it drafted (at most `behind` positions back)."""
    cache, k = drafter.ctx.cache, drafter.exit_layer
    n = cache.length
    assert n > len(PROMPT) + 5
    with torch.inference_mode():
        reference = exit_states(adapter, torch.tensor(tokens[:n]), [k])[0][k]
        torch.testing.assert_close(cache.exit_states[:n], reference[0], atol=1e-4, rtol=1e-4)
        state = drafter.context
        valid = state.kv.length
        assert valid >= n - behind
        kv = drafter.exit_adapter.new_kv(cache.capacity, dtype=torch.float32, device="cpu")
        drafter.exit_adapter.extend(reference[:, :valid], 0, kv)
        torch.testing.assert_close(state.kv.keys[..., :valid, :], kv.keys[..., :valid, :], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state.kv.values[..., :valid, :], kv.values[..., :valid, :], atol=1e-4, rtol=1e-4)


STEPS = {"general": None, "lean": {}, "exact-compiled": dict(compile=True, backend="eager", exact_rows=EXACT_ROWS)}


@pytest.mark.parametrize("arch, step", [("llama", "lean"), ("llama", "general"), ("qwen2", "lean"),
                                        ("llama", "exact-compiled")])
def test_exit_states_are_the_committed_positions_after_rewinds(arch, step):
    """Every path that computes layer k-1 keeps h_k: the adapter's own layer loop, the lean step
    (eager, or compiled in exact mode: padding rows write to the scratch slot)."""
    model = selfspec.SelfSpecModel(tiny_model(arch), name=f"tiny-{arch}", lean=False)
    if STEPS[step] is not None:
        model.adapter.lean(**STEPS[step])
    drafter = EarlyExit(3, 3, exit_adapter=perturbed(3), threshold=0)
    out = model.generate(PROMPT, max_new_tokens=40, drafter=drafter)
    assert out.stats.accepted < out.stats.drafted  # rejections happened, so the cache rewound
    _check_exit_states(model.adapter, drafter, drafter.ctx.committed)


def test_exit_states_when_lookup_drafts_some_rounds(tiny):
    """Hybrid: rounds drafted by prompt lookup verify at full depth, which keeps h_k as well."""
    from selfspec.drafters.hybrid import Hybrid
    from selfspec.drafters.lookup import PromptLookup

    model = tiny("llama")
    fallback = EarlyExit(3, 3, exit_adapter=perturbed(3), threshold=0)
    out = assert_greedy_lossless(model, prompt=REPETITIVE, drafter=Hybrid(PromptLookup(draft_len=3), fallback))
    assert out.stats.drafted > 0
    _check_exit_states(model.adapter, fallback, fallback.ctx.committed, behind=len(fallback.ctx.committed))


def test_exit_states_after_batched_verifies(tiny):
    """The scheduler's shared verify (engine.verify_rows) recomputes layers < k: it keeps them too."""
    model = tiny("llama")
    seqs = [Decoding(model.adapter, torch.tensor(p), EarlyExit(3, g, exit_adapter=perturbed(3), threshold=0),
                     sampling=SamplingParams(), max_new_tokens=30, stats=GenerationStats("early-exit"), headroom=4)
            for p, g in ((PROMPT, 2), (PROMPT[:5], 4))]
    with torch.inference_mode():
        for seq in seqs:
            seq.prefill(measure_step=False)
        while not all(seq.done for seq in seqs):
            live = [seq for seq in seqs if not seq.done]
            drafts = [seq.draft() for seq in live]
            for seq, draft, logits in zip(live, drafts, verify_rows(model.adapter, live, drafts)):
                seq.finish_round(draft, logits)
    for seq in seqs:
        assert seq.stats.accepted < seq.stats.drafted
        _check_exit_states(model.adapter, seq.drafter, seq.ctx.committed)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_output_with_a_head_equals_ar(tiny, arch):
    model = tiny(arch)
    plain, headed = Recording(3, 3), Recording(3, 3, exit_adapter=perturbed(3), threshold=0)
    assert_greedy_lossless(model, drafter=plain)
    assert assert_greedy_lossless(model, drafter=headed).stats.drafted > 0
    assert headed.drafts != plain.drafts  # the head changed the drafts, and the verify still matched AR
    stopping = Recording(3, 4, exit_adapter=perturbed(3), threshold=1.0)  # stops after every first token
    assert_greedy_lossless(model, drafter=stopping)
    assert {len(d) for d in stopping.drafts} <= {0, 1}  # 0: the last round, with no room left


def test_sampling_with_a_head_matches_the_target(tiny):
    model = tiny("llama")
    head = perturbed(4, scale=0.1)
    accepted = assert_sampling_matches_target(model, trials=400, drafter=EarlyExit(4, 3, exit_adapter=head))
    assert accepted > 0


def test_alpha_by_draft_position_from_run_lengths():
    agree = torch.tensor([True, True, False, True, True, True, False])
    assert run_lengths(agree).tolist() == [2, 1, 0, 3, 2, 1, 0]
    # 7 starts; 5 agree at the first position, 3 of them at the second, 1 of those at the third.
    assert alpha_by_position([run_lengths(agree)], depth=4) == [5 / 7, 3 / 5, 1 / 3, 0.0]


def _data(model, n_prompts=8, n=16):
    prompts = [torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(s)) for s in range(n_prompts)]
    positions = self_distillation(model, prompts, [2], max_new_tokens=n, progress=False, first_position=True)
    return Sequences(positions)


def test_sequences_start_at_position_zero(tiny):
    """Each prompt's rows are its whole sequence in order, as an independent forward computes them
    (prompts of different lengths: generated left-padded in one batch)."""
    model = tiny("llama")
    prompts = [torch.tensor(PROMPT[:n]) for n in (4, 9, 6)]
    outputs = {}
    data = Sequences(self_distillation(model, prompts, [2], max_new_tokens=5, progress=False, outputs=outputs,
                                       first_position=True))
    assert data.length.tolist() == [n + 4 for n in (4, 9, 6)]  # the prompt from position 0, outputs 0 .. 3 fed
    for s, prompt in enumerate(prompts):
        rows = slice(int(data.begin[s]), int(data.begin[s] + data.length[s]))
        assert data.positions.output[rows].tolist() == [False] * prompt.numel() + [True] * 4
        with torch.inference_mode():
            reference = exit_states(model.adapter, torch.cat([prompt, torch.tensor(outputs[s][:4])]), [2])[0][2]
        torch.testing.assert_close(data.positions.hidden[2][rows], reference[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pruned", [False, True])
def test_training_lowers_the_held_out_kl(tiny, pruned):
    model = tiny("llama")
    data = _data(model, n_prompts=16, n=24)
    student = Student(model.adapter, PrunedHead(model.adapter, torch.arange(VOCAB // 2)) if pruned else None)
    torch.manual_seed(0)
    trained = train_context_head(student, ContextHead(HIDDEN, 2, heads=2, head_dim=16), data,
                                 torch.arange(12), torch.arange(12, 16), steps=60, sequences=3, positions=48,
                                 lr=3e-3, eval_every=20, progress=False)
    # Held-out prompts of a random model share little with the training ones (see test_exit_adapter):
    # the held-out KL falls a little, agreement on the training outputs clearly.
    assert trained.kl_after < 0.9 * trained.kl_before
    assert trained.train_alpha_after > trained.alpha_before + 0.05
    assert len(trained.alpha_by_position_after) == 6


def test_calibrate_saves_and_early_exit_finds_the_head(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_PROFILES", str(tmp_path))
    model = tiny("llama")
    prompts = [torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(6)]
    result = calibrate_context(model, prompts, exit_layers=[2], max_new_tokens=12, steps=6, sequences=2,
                               positions=16, heads=2, head_dim=16, holdout=0.2, progress=False)
    assert result.held_out_positions == 11  # one held-out prompt's outputs
    assert result.train_positions == 5 * (5 + 11)  # positions >= 1 of the rest
    save(result, model.identity)
    profile = load_profile(model.identity)
    assert profile[SECTION]["exit_layer"] == 2 and result.paths[2] == default_path(model.identity, 2)
    assert "| 2 |" in result.table() and json.loads(json.dumps(result.to_json()))["best_exit_layer"] == 2

    def drafter(method="early-exit", **options):
        return make_drafter(Resolved(Speculation(method, **options), model.identity, profile=profile))

    assert isinstance(drafter().exit_adapter, ContextHead) and drafter().exit_layer == 2
    assert drafter().threshold == 0.6 and drafter(threshold=0.3).threshold == 0.3
    assert drafter(exit_layer=3).exit_adapter is None
    assert drafter(exit_layer=2, exit_adapter="none").exit_adapter is None
    # Beside an exit adapter at the same k, the context head wins; saguaro passes over it.
    mlp = save_exit_adapter(ExitAdapter(HIDDEN, 2), tmp_path / "a.safetensors", model.identity)
    save_section(model.identity, "exit-adapter", {"path": str(mlp), "exit_layer": 2})
    profile = load_profile(model.identity)
    assert isinstance(drafter().exit_adapter, ContextHead)
    assert isinstance(drafter("saguaro").inner.exit_adapter, ExitAdapter)
    with pytest.raises(ValueError, match="context head"):
        drafter("saguaro", exit_adapter=str(result.paths[2]))
    assert_greedy_lossless(model, method="early-exit", exit_adapter=str(result.paths[2]))


def test_cli_calibrate_context_head_on_a_tiny_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SELFSPEC_PROFILES", str(tmp_path / "profiles"))
    ckpt, prompts = tiny_checkpoint_with_prompts(tmp_path)
    assert main(["calibrate", "--model", str(ckpt), "--prompts", str(prompts), "--num-prompts", "4", "-n", "6",
                 "-k", "2", "--steps", "2", "--batch-size", "8", "--sequences", "2", "--heads", "2",
                 "--head", "context", "--output", str(tmp_path / "cal"), "--holdout", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "context head k=2" in out and "context-head: k=2" in out
    assert (tmp_path / "cal").is_dir() and any(p.name.endswith(".context-k2.safetensors")
                                               for p in (tmp_path / "cal").iterdir())


def test_step_attention_backends_on_cuda_compute_the_same_attention():
    """A drafting step's attention on CUDA avoids cuDNN's (a new plan per key length: the head's
    c was 12-18 on an H200). The backends it allows exist in this torch and give the same
    attention as the default choice; run here on the CPU, where the step uses the default."""
    from selfspec.heads.context_head import _STEP_BACKENDS, _attend

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 4, 9, 16), torch.randn(1, 4, 9, 16)
    mask = torch.arange(9).view(1, -1) <= torch.arange(6, 9).view(-1, 1)
    with torch.nn.attention.sdpa_kernel(_STEP_BACKENDS):
        restricted = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(restricted, _attend(q, k, v, mask))
    assert "CUDNN_ATTENTION" not in {b.name for b in _STEP_BACKENDS} and "MATH" in {b.name for b in _STEP_BACKENDS}
