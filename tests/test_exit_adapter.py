"""The exit adapter: its file is tied to the model; untrained it is plain early exit; trained or
not, output stays the full model's; calibration on a tiny model learns something."""

import json
import subprocess
import sys

import pytest
import torch

from lossless import PROMPT, assert_greedy_lossless, assert_sampling_matches_target
from selfspec.tools.calibrate import calibrate, save
from selfspec.tools.calibrate.data import Sequence, self_distillation, teacher_force
from selfspec.tools.calibrate.exit_adapter import train_exit_adapter
from selfspec.tools.calibrate.loss import distill_loss
from selfspec.core.speculation import Resolved, Speculation
from selfspec.drafters import EarlyExit, make_drafter
from selfspec.heads.exit_adapter import (SECTION, ExitAdapter, default_path, load_exit_adapter, read_header,
                                   save_exit_adapter)
from selfspec.model.profiles import ModelIdentity, ProfileMismatchError, load_profile, save_section
from tiny_models import VOCAB

HIDDEN = 64  # the tiny models' hidden size


def perturbed(k: int, seed: int = 0, scale: float = 0.5) -> ExitAdapter:
    """An adapter that is far from the identity (random output layer), as if badly trained."""
    torch.manual_seed(seed)
    adapter = ExitAdapter(HIDDEN, k)
    with torch.no_grad():
        adapter.down.weight.normal_(0.0, scale)
    return adapter.eval().requires_grad_(False)


class Recording(EarlyExit):
    """Early exit that keeps every draft it proposed."""

    def propose(self, *args):
        draft = super().propose(*args)
        self.drafts = getattr(self, "drafts", []) + [draft.tokens.tolist()]
        return draft


def test_save_load_round_trip_and_identity_check(tiny, tmp_path):
    model = tiny("llama")
    adapter = perturbed(3)
    path = save_exit_adapter(adapter, tmp_path / "a.safetensors", model.identity, {"alpha_after": 0.5})
    loaded = load_exit_adapter(path, model.identity)
    assert (loaded.exit_layer, loaded.width) == (3, HIDDEN)
    for name, tensor in adapter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)
    header = read_header(path)
    assert header["identity"]["config_hash"] == model.identity.config_hash
    assert header["training"] == {"alpha_after": 0.5}

    with pytest.raises(ProfileMismatchError, match="belongs to 'tiny-llama'"):
        load_exit_adapter(path, ModelIdentity("tiny-llama", "0" * 16))
    with pytest.raises(ProfileMismatchError):
        load_exit_adapter(path, tiny("qwen3").identity)
    not_adapter = tmp_path / "b.safetensors"
    not_adapter.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_exit_adapter(not_adapter, model.identity)


def test_params_are_a_small_share():
    assert ExitAdapter(576, 10).n_params == 2 * 576 * 576 + 576  # SmolLM2-135M: 0.66M, ~0.5 % of it
    assert ExitAdapter(576, 10, width=64).n_params == 2 * 576 * 64 + 576


def test_untrained_adapter_is_plain_early_exit(tiny):
    model = tiny("llama")
    h = torch.randn(1, 5, HIDDEN)
    assert torch.equal(ExitAdapter(HIDDEN, 3)(h), h)
    plain, adapted = Recording(3, 3), Recording(3, 3, exit_adapter=ExitAdapter(HIDDEN, 3))
    assert model.generate(PROMPT, max_new_tokens=30, drafter=adapted).tokens == \
        model.generate(PROMPT, max_new_tokens=30, drafter=plain).tokens
    assert adapted.drafts == plain.drafts


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_output_with_an_adapter_equals_ar(tiny, arch):
    model = tiny(arch)
    plain, adapted = Recording(3, 3), Recording(3, 3, exit_adapter=perturbed(3))
    assert_greedy_lossless(model, drafter=plain)
    assert assert_greedy_lossless(model, drafter=adapted).stats.drafted > 0
    # The adapter did change the drafts (so the verify saw other tokens and still matched AR).
    assert adapted.drafts != plain.drafts


def test_sampling_with_an_adapter_matches_the_target(tiny):
    model = tiny("llama")
    accepted = assert_sampling_matches_target(model, trials=400, drafter=EarlyExit(4, 3, exit_adapter=perturbed(4, scale=0.1)))
    assert accepted > 0


def test_the_profile_points_generate_at_the_adapter(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_PROFILES", str(tmp_path))
    model = tiny("llama")
    path = save_exit_adapter(perturbed(2), default_path(model.identity, 2), model.identity)
    assert path.parent == tmp_path
    save_section(model.identity, SECTION, {"path": str(path), "exit_layer": 2, "alpha_before": 0.1,
                                           "alpha_after": 0.2, "params": 0})
    profile = load_profile(model.identity)

    def drafter(**options):
        return make_drafter(Resolved(Speculation("early-exit", **options), model.identity, profile=profile))

    assert drafter().exit_layer == 2 and drafter().exit_adapter is not None  # k None: the adapter's k
    assert drafter(exit_layer=2).exit_adapter is not None
    assert drafter(exit_layer=3).exit_adapter is None  # another k: plain early exit
    assert drafter(exit_layer=2, exit_adapter="none").exit_adapter is None
    with pytest.raises(ValueError, match="trained for k=2"):
        drafter(exit_layer=3, exit_adapter=str(path))
    with pytest.raises(ValueError, match="identity"):
        make_drafter(Resolved(Speculation("early-exit", exit_layer=2, exit_adapter=str(path))))

    out = assert_greedy_lossless(model, method="early-exit")  # k from the adapter, found via the profile
    assert out.stats.exit_layer == 2
    assert assert_greedy_lossless(model, method="early-exit", exit_adapter="none").stats.exit_layer == 4


def coarsened_kl(student, teacher, top: int):
    """KL(p || q) of the distributions reduced to the teacher's top tokens plus one "rest", by autograd."""
    logp, logq = teacher.log_softmax(-1), student.log_softmax(-1)
    ids = logp.topk(top).indices
    rest = torch.ones_like(logp, dtype=torch.bool).scatter(-1, ids, False)
    def coarse(x):
        return torch.cat([x.gather(-1, ids), x.masked_fill(~rest, -torch.inf).logsumexp(-1, keepdim=True)], -1)
    p, q = coarse(logp), coarse(logq)
    return (p.exp() * (p - q)).sum(-1)


def test_distill_loss_is_the_coarsened_kl_with_its_gradient():
    torch.manual_seed(0)
    teacher, student = torch.randn(3, VOCAB) * 3, (torch.randn(3, VOCAB) * 3).requires_grad_()
    top = teacher.log_softmax(-1).topk(10)
    loss = distill_loss(student, top.indices, top.values)
    expected = coarsened_kl(student, teacher, 10)
    assert torch.allclose(loss, expected, atol=1e-5)
    grad, = torch.autograd.grad(loss.sum(), student)
    expected_grad, = torch.autograd.grad(expected.sum(), student)
    assert torch.allclose(grad, expected_grad, atol=1e-6)
    assert (loss > 0).all()
    assert torch.allclose(distill_loss(teacher, top.indices, top.values), torch.zeros(3), atol=1e-5)
    full = (teacher.softmax(-1) * (teacher.log_softmax(-1) - student.log_softmax(-1))).sum(-1)
    assert (loss <= full + 1e-5).all()  # never above the full KL


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_examples_read_off_generation_equal_teacher_forcing(tiny, arch):
    model = tiny(arch)
    prompts = [torch.tensor(PROMPT[:n]) for n in (3, 9, 6)]  # batches [3, 6] (left-padded) and [9]
    positions = self_distillation(model, prompts, [2, 4], max_new_tokens=12, batch_size=2, progress=False)
    # Outputs: the positions of output tokens 0 .. 10 (token 11 is never fed); prompts: all but the first.
    assert positions.prompt.tolist() == [0] * (2 + 11) + [1] * (8 + 11) + [2] * (5 + 11)
    assert positions.output.tolist() == [False] * 2 + [True] * 11 + [False] * 8 + [True] * 11 + [False] * 5 + [True] * 11
    sequences = []
    for p in prompts:
        out = model.generate(p.tolist(), method="ar", max_new_tokens=12).tokens
        sequences.append(Sequence(p.tolist() + out[:-1], 1))
    forced = teacher_force(model.adapter, sequences, [2, 4], progress=False)
    assert torch.equal(positions.teacher_ids[:, 0], forced.teacher_ids[:, 0])
    assert torch.allclose(positions.teacher_logp[:, :8], forced.teacher_logp[:, :8], atol=1e-4)
    for k in (2, 4):
        assert torch.allclose(positions.hidden[k], forced.hidden[k], atol=1e-4)

def test_training_lowers_the_loss_and_raises_agreement(tiny):
    model = tiny("llama")
    sequences = [Sequence(torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(s)).tolist(), 1)
                 for s in range(8)]
    positions = teacher_force(model.adapter, sequences, [2], progress=False)
    rows = positions.rows(torch.arange(len(positions)), 2)
    torch.manual_seed(0)
    trained = train_exit_adapter(model.adapter, ExitAdapter(HIDDEN, 2), rows, rows, steps=150, batch_size=64,
                                 lr=3e-3, eval_every=50, progress=False)
    assert trained.kl_after < 0.7 * trained.kl_before
    assert trained.alpha_after > trained.alpha_before + 0.1


def test_calibrate_end_to_end_saves_and_reports(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_PROFILES", str(tmp_path))
    model = tiny("llama")
    prompts = [torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(10)]
    result = calibrate(model, prompts, exit_layers=[2, 3], max_new_tokens=24, steps=120, batch_size=64, lr=3e-3,
                       holdout=0.2, progress=False)
    assert result.held_out_positions == 2 * 23  # their outputs; prompts held out are not trained on either
    assert result.train_positions == 8 * (7 + 23)
    # Held-out prompts of a random model share too little with the training ones to generalise to:
    # learning itself is checked on the training positions (above and here).
    assert all(t.train_alpha_after > 0.5 for t in result.trained.values())
    save(result, model.identity)
    section = load_profile(model.identity)[SECTION]
    assert section["exit_layer"] == result.best
    assert load_exit_adapter(section["path"], model.identity).exit_layer == result.best
    assert set(result.paths) == {2, 3} and all(p.is_file() for p in result.paths.values())
    assert json.loads(json.dumps(result.to_json()))["best_exit_layer"] == result.best
    assert "| 2 |" in result.table()


def test_cli_calibrate_help_and_bad_input():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "selfspec.cli", "calibrate", *args], capture_output=True,
                              text=True, timeout=120)

    out = run("--help")
    assert out.returncode == 0
    for flag in ("--prompts", "--num-prompts", "--text", "--max-new-tokens", "--exit-layer", "--steps",
                 "--batch-size", "--lr", "--width", "--holdout", "--seed", "--output", "--json"):
        assert flag in out.stdout
    bad = run("--holdout", "1.5")
    assert bad.returncode == 2 and "--holdout" in bad.stderr and "Traceback" not in bad.stderr
