"""The feature head: its file is tied to the model and carries its draft tokens; the state it
drafts from is the committed positions' final states after rewinds; trained or not, output stays
the full model's (greedy and sampled); a short training on a tiny model raises α; `--method
feature` without a head says what to run."""

import pytest
import torch
from lossless import PROMPT, assert_greedy_lossless, assert_sampling_matches_target

from selfspec.tools.calibrate.data import held_out_prompts
from selfspec import Speculation
from selfspec.drafters import make_drafter
from selfspec.drafters.feature import FeatureDraft
from selfspec.tools.feature_calibrate import _teacher_forced, drafted_runs, feature_data, train_feature_head
from selfspec.heads.feature_head import (
    SECTION,
    FeatureHead,
    feature_head_for,
    load_feature_head,
    read_header,
    save_feature_head,
)
from selfspec.model.profiles import ModelIdentity, ProfileMismatchError, load_profile, save_section
from selfspec.tools.tune import tune
from selfspec.tools.tune.trace import exit_states, replay_feature, trace

HIDDEN = 64  # the tiny models' hidden size


def random_head(model, seed: int = 0, scale: float = 0.3) -> FeatureHead:
    """An untrained head with non-zero output projections: it drafts, mostly wrongly."""
    torch.manual_seed(seed)
    head = FeatureHead(HIDDEN, model.adapter.n_layers, heads=2, head_dim=16)
    with torch.no_grad():
        head.block.o.weight.normal_(0.0, scale)
        head.block.down.weight.normal_(0.0, scale)
    return head.eval().requires_grad_(False)


class Recording(FeatureDraft):
    def propose(self, *args):
        draft = super().propose(*args)
        self.drafts = getattr(self, "drafts", []) + [draft.tokens.tolist()]
        return draft


def test_save_load_round_trip_and_identity_check(tiny, tmp_path):
    model = tiny("llama")
    head = random_head(model)
    ids = torch.tensor([7, 3, 11])
    path = save_feature_head(head, tmp_path / "f.safetensors", model.identity, ids, {"alpha_after": [0.5]})
    loaded, loaded_ids = load_feature_head(path, model.identity)
    assert torch.equal(loaded_ids, ids)
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)
    header = read_header(path)
    assert header["training"] == {"alpha_after": [0.5]} and header["draft_vocab"] == 3
    with pytest.raises(ProfileMismatchError, match="belongs to 'tiny-llama'"):
        load_feature_head(path, ModelIdentity("tiny-llama", "0" * 16))

def test_a_head_stored_in_bfloat16_loads_as_float32_rounded_once(tiny, tmp_path):
    model = tiny("llama")
    head = random_head(model)
    path = save_feature_head(head, tmp_path / "f.safetensors", model.identity, torch.arange(5), dtype=torch.bfloat16)
    full = save_feature_head(head, tmp_path / "g.safetensors", model.identity, torch.arange(5))
    assert read_header(path)["dtype"] == "bfloat16" and read_header(full)["dtype"] == "float32"
    assert path.stat().st_size < 0.6 * full.stat().st_size
    loaded, _ = load_feature_head(path, model.identity)
    for name, tensor in head.state_dict().items():
        assert loaded.state_dict()[name].dtype == torch.float32
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        save_feature_head(head, tmp_path / "h.safetensors", model.identity, torch.arange(5), dtype=torch.float16)



def test_method_feature_finds_the_profiles_head_or_says_what_to_run(tiny, tmp_path):
    model = tiny("llama")
    with pytest.raises(ValueError, match="calibrate --head feature"):
        model.generate(PROMPT, method="feature", max_new_tokens=4)
    path = save_feature_head(random_head(model), tmp_path / "f.safetensors", model.identity, torch.arange(40))
    save_section(model.identity, SECTION, {"path": str(path)})
    try:
        profile = load_profile(model.identity)
        head, ids, found = feature_head_for(profile, model.identity)
        assert found == path and ids.numel() == 40
        drafter = make_drafter(model.resolve(Speculation("feature", draft_len=2, draft_vocab=10)))
        assert drafter.draft_len == 2 and drafter.draft_ids.numel() == 10
        with pytest.raises(ValueError, match="draft_vocab must be in 1..40"):
            make_drafter(model.resolve(Speculation("feature", draft_vocab=41)))
        out = assert_greedy_lossless(model, method="feature", draft_len=3)
        assert out.stats.drafted > 0
    finally:
        save_section(model.identity, SECTION, {})


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_greedy_output_equals_ar(tiny, arch):
    model = tiny(arch)
    drafter = Recording(random_head(model), draft_len=4, threshold=0)
    out = assert_greedy_lossless(model, drafter=drafter)
    assert out.stats.drafted > 0 and out.stats.accepted < out.stats.drafted  # rejections: the caches rewound
    assert max(len(d) for d in drafter.drafts) == 4
    pruned = Recording(random_head(model, seed=1), draft_len=3, draft_ids=torch.arange(0, 60, 2), threshold=0)
    assert_greedy_lossless(model, drafter=pruned)
    assert all(t % 2 == 0 for d in pruned.drafts for t in d)  # drafts only from the pruned head's tokens
    stopping = Recording(random_head(model), draft_len=4, threshold=1.0)  # stops after every first token
    assert_greedy_lossless(model, drafter=stopping)
    assert {len(d) for d in stopping.drafts} <= {0, 1}


def test_head_state_is_the_committed_final_states_after_rewinds(tiny):
    """The model cache keeps h_L of every committed position (the verify writes them), and the
    head's keys and values equal those computed from an independent forward's final states."""
    model = tiny("llama")
    drafter = FeatureDraft(random_head(model), draft_len=3, threshold=0)
    out = model.generate(PROMPT, max_new_tokens=40, drafter=drafter)
    assert out.stats.accepted < out.stats.drafted
    check_state(model, drafter)


def check_state(model, drafter):
    cache, tokens = drafter.ctx.cache, drafter.ctx.committed
    n = cache.length
    with torch.inference_mode():
        final = exit_states(model.adapter, torch.tensor(tokens[:n]), [])[1][0]  # [n, d]
        torch.testing.assert_close(cache.exit_states[:n], final, atol=1e-4, rtol=1e-4)
        head, state = drafter.feature_head, drafter.state
        valid = state.filled
        assert valid >= n - 4
        previous = torch.cat([final.new_zeros(1, HIDDEN), final[:valid - 1]])[None]
        s = head.inputs(previous, model.adapter.embed(torch.tensor(tokens[:valid])))
        kv = head.new_kv(cache.capacity, dtype=torch.float32, device="cpu")
        head.block.extend(s, 0, kv)
        torch.testing.assert_close(state.kv.keys[..., :valid, :], kv.keys[..., :valid, :], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state.kv.values[..., :valid, :], kv.values[..., :valid, :], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_step_equals_the_modules(arch, dtype):
    """The head's step as one kernel call (selfspec.native.fused_feature): the same predictions, draft-head
    logits and head KV as the PyTorch modules, within the dtype's rounding, over a round's first
    call (several committed rows) and draft steps on its own predictions."""
    import selfspec
    from tiny_models import tiny_model

    from selfspec.heads.draft_head import PrunedHead
    from selfspec.heads.feature_head import FeatureState
    from selfspec.native.fused_feature import FusedFeature, unsupported_reason

    model = selfspec.SelfSpecModel(tiny_model(arch, 0, dtype), name=f"tiny-{arch}")
    adapter = model.adapter
    head = random_head(model).to(dtype)
    pruned = PrunedHead(adapter, torch.arange(3, 90, 3))
    assert unsupported_reason(head, adapter, pruned) is None
    tokens = PROMPT + [5, 9, 14, 2, 7]
    cache = adapter.new_cache(64)
    cache.keep_exit_states(adapter.n_layers, HIDDEN)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    with torch.inference_mode():
        adapter.run_layers(adapter.embed(torch.tensor(tokens)), range(adapter.n_layers), 0, cache)
        runs = []
        for fused in (None, FusedFeature(head, adapter, pruned)):
            state, out = FeatureState(head, cache, adapter.embed, fused), []
            for start in (len(PROMPT) - 1, len(PROMPT) + 2):  # the prompt (<= 16 rows), then 3 committed
                predicted = state.first(start, tokens)
                for token in tokens[start + 1:start + 3]:
                    logits = state.logits if fused else pruned.subset_logits(predicted)
                    out += [predicted.float(), logits.float().clone()]
                    predicted = state.step(predicted, torch.tensor([token]))
            runs.append((out, state.kv.keys[..., :state.position, :].float(), state.kv.values[..., :state.position, :].float()))
    (modules, keys, values), (kernel, fused_keys, fused_values) = runs
    assert len(kernel) == 8 and all(x is not None for x in kernel)
    for a, b in zip(kernel, modules):
        torch.testing.assert_close(a, b, **tolerance)
    torch.testing.assert_close(fused_keys, keys, **tolerance)
    torch.testing.assert_close(fused_values, values, **tolerance)


def test_drafter_runs_the_fused_step_unless_turned_off(tiny, monkeypatch):
    model = tiny("llama")
    drafter = FeatureDraft(random_head(model), draft_len=3, draft_ids=torch.arange(50), threshold=0)
    out = assert_greedy_lossless(model, drafter=drafter)
    assert drafter.state.fused is not None and out.stats.drafted > 0
    monkeypatch.setenv("SELFSPEC_FUSED", "0")
    drafter = FeatureDraft(random_head(model), draft_len=3, draft_ids=torch.arange(50), threshold=0)
    assert_greedy_lossless(model, drafter=drafter)
    assert drafter.state.fused is None


def test_sampling_matches_the_target(tiny):
    model = tiny("llama")
    drafter = FeatureDraft(random_head(model, scale=0.1), draft_len=3, draft_ids=torch.arange(50))
    assert assert_sampling_matches_target(model, trials=400, drafter=drafter) > 0


def test_training_raises_alpha_on_the_models_own_outputs(tiny):
    """On a tiny model's own greedy outputs a few hundred steps teach the head to draft them;
    the drafted-run measure agrees with what the drafter does in the engine."""
    model = tiny("llama")
    prompts = [torch.tensor([(7 * i + 3 * j) % 90 + 5 for j in range(6 + i % 5)]) for i in range(24)]
    data = feature_data(model, prompts, 24, progress=False)
    assert len(data) == 24 and all(x.final.shape == (x.ids.numel(), HIDDEN) for x in data)
    trained = train_feature_head(model.adapter, data, steps=300, sequences=4, positions=64, heads=2, head_dim=16,
                                 draft_vocab=64, holdout=0.25, progress=False)
    # Tiny random models' outputs have little to generalise from: the head learns the training
    # prompts' outputs (held out, it still does no worse than before).
    assert trained.train_alpha_after[0] > trained.alpha_before[0] + 0.4
    assert trained.alpha_after[0] >= trained.alpha_before[0]
    assert trained.draft_ids.numel() == 64 and len(trained.alpha_after) == 4
    # The measure replays the drafter: with the same head, a greedy generation accepts as often.
    runs = drafted_runs(trained.head, _student(model, trained.draft_ids), _batches(model, data), [0], depth=1)
    assert len(runs) == data[0].ids.numel() - 1 - data[0].n_prompt
    # Drafting with it on a training prompt: tokens are accepted, output is AR's, and the head's
    # state follows the committed positions through partial acceptances.
    drafter = FeatureDraft(trained.head, draft_len=3, draft_ids=trained.draft_ids, threshold=0)
    seen = data[int((~held_out_prompts(len(data), 0.25, 0)).nonzero()[0])]  # a training prompt
    out = assert_greedy_lossless(model, prompt=seen.ids[:seen.n_prompt].tolist(), n=24, drafter=drafter)
    assert 0 < out.stats.accepted < out.stats.drafted
    check_state(model, drafter)
    # The tuner's replay (the drafter proposing from a trace's final states) predicts exactly these rounds.
    t = trace(model.adapter, seen.ids[:seen.n_prompt].tolist(), out.tokens, 24, [])
    rounds, seconds = replay_feature(t, model.adapter, FeatureDraft(trained.head, 3, draft_ids=trained.draft_ids,
                                                                    threshold=0))
    assert (sum(rounds.drafted), sum(rounds.accepted), len(rounds)) == (out.stats.drafted, out.stats.accepted,
                                                                         out.stats.rounds)
    assert seconds > 0


def test_tune_predicts_and_times_feature_drafting(tiny, tmp_path):
    model = tiny("llama")
    path = save_feature_head(random_head(model, scale=0.05), tmp_path / "f.safetensors", model.identity,
                             torch.arange(80))
    save_section(model.identity, SECTION, {"path": str(path)})
    try:
        result = tune(model, [PROMPT, PROMPT[:5]], max_new_tokens=16, exit_layers=[2], max_draft_len=2, check=1,
                      repeats=1, progress=False)
    finally:
        save_section(model.identity, SECTION, {})
    feature = [c for c in result.candidates if c.method == "feature"]
    assert [c.draft_len for c in feature] == [1, 2] and all(c.cost > 0 for c in feature)
    checked = [c for c in result.checked if c.method == "feature"]
    assert len(checked) == 1 and checked[0].identical == "2/2"
    assert checked[0].measured_alpha == pytest.approx(checked[0].rounds.alpha)  # the replay is exact
    assert "feature γ=" in result.table()
    hybrid = [c for c in result.candidates if c.method == "hybrid"]  # lookup, else the head: replayed too
    assert [c.draft_len for c in hybrid] == [1, 2] and "hybrid γ=1 (lookup, else feature)" in result.table()
    checked = [c for c in result.checked if c.method == "hybrid"]
    assert len(checked) == 1 and checked[0].identical == "2/2"
    assert checked[0].measured_alpha == pytest.approx(checked[0].rounds.alpha)


def test_hybrid_falls_back_to_the_feature_head_ungated_unless_a_k_is_asked(tiny, tmp_path):
    from lossless import REPETITIVE

    from selfspec.drafters import FEATURE_MIN_NGRAM
    from selfspec.drafters.layers.early_exit import EarlyExit

    model = tiny("llama")
    path = save_feature_head(random_head(model), tmp_path / "f.safetensors", model.identity, torch.arange(80))
    save_section(model.identity, SECTION, {"path": str(path)})
    try:
        profile = load_profile(model.identity)
        hybrid = make_drafter(model.resolve(Speculation("hybrid", draft_len=3)))
        assert isinstance(hybrid.fallback, FeatureDraft) and hybrid.fallback.draft_len == 1
        assert hybrid.gates is None and hybrid.lookup.min_ngram == FEATURE_MIN_NGRAM and hybrid.draft_len == 3
        for prompt in (REPETITIVE, PROMPT):
            out = assert_greedy_lossless(model, prompt, drafter=hybrid)
            assert out.stats.method == "hybrid" and out.stats.exit_layer is None
        assert hybrid.lookup_rounds > 0 and hybrid.model_rounds > 0  # both sources drafted
        out = assert_greedy_lossless(model, REPETITIVE, method="hybrid", draft_len=3)  # by name, as auto runs it
        assert out.stats.drafted > 0
        asked = make_drafter(model.resolve(Speculation("hybrid", draft_len=3, exit_layer=2)))
        assert isinstance(asked.fallback, EarlyExit) and asked.gates is not None
    finally:
        save_section(model.identity, SECTION, {})
    assert isinstance(make_drafter(model.resolve(Speculation("hybrid", draft_len=3, exit_layer=2))).fallback,
                      EarlyExit)  # no head: early exit, as before


def _student(model, ids):
    from selfspec.tools.feature_calibrate import Student

    return Student(model.adapter, ids)


def _batches(model, data):
    from selfspec.tools.feature_calibrate import Batches

    return Batches(data, lambda ids: model.adapter.embed_tokens(ids).float())


def test_plain_text_trains_but_is_never_held_out_nor_counted_for_the_draft_head(tiny):
    """--text windows add training positions only: the held-out prompts, their α before training
    and the draft head's tokens (ranked on prompts and outputs) are what they are without them."""
    model = tiny("llama")
    prompts = [torch.tensor([(7 * i + 3 * j) % 90 + 5 for j in range(6 + i % 5)]) for i in range(12)]
    data = feature_data(model, prompts, 12, progress=False)
    text = [_teacher_forced(model.adapter, torch.tensor([1 + (j % 4) for j in range(40)]), 0, -1, text=True)
            for _ in range(3)]  # the most frequent tokens of all, were text counted
    options = dict(steps=2, sequences=2, positions=16, heads=2, head_dim=16, draft_vocab=16, holdout=0.25,
                   progress=False)
    alone = train_feature_head(model.adapter, data, **options)
    mixed = train_feature_head(model.adapter, data + text, **options)
    assert mixed.train_positions == alone.train_positions + 3 * 38
    assert mixed.held_out_positions == alone.held_out_positions
    assert mixed.alpha_before == alone.alpha_before
    assert torch.equal(mixed.draft_ids, alone.draft_ids) and not set(range(1, 5)) & set(mixed.draft_ids.tolist())


def test_extra_prompts_train_but_leave_the_held_out_split_as_it_was(tiny):
    """--extra-prompts add training sequences only: the held-out prompts and their α before training
    are those of the prompts alone, and the extra outputs' tokens count for the draft head."""
    model = tiny("llama")
    prompts = [torch.tensor([(7 * i + 3 * j) % 90 + 5 for j in range(6 + i % 5)]) for i in range(12)]
    data = feature_data(model, prompts, 12, progress=False)
    extra = feature_data(model, [torch.tensor([90 + j % 3 for j in range(30)]) for _ in range(4)], 8,
                         progress=False)
    for x in extra:
        x.train_only = True
    options = dict(steps=2, sequences=2, positions=16, heads=2, head_dim=16, draft_vocab=16, holdout=0.25,
                   progress=False)
    alone = train_feature_head(model.adapter, data, **options)
    mixed = train_feature_head(model.adapter, data + extra, **options)
    assert mixed.train_positions == alone.train_positions + sum(x.ids.numel() - 2 for x in extra)
    assert mixed.held_out_positions == alone.held_out_positions
    assert mixed.alpha_before == alone.alpha_before
    assert {90, 91, 92} <= set(mixed.draft_ids.tolist())  # the extra prompts' most frequent tokens
    assert not {90, 91, 92} & set(alone.draft_ids.tolist())


def test_cli_calibrate_feature_head_then_generate_with_it(tmp_path, monkeypatch, capsys):
    import json

    from tiny_models import tiny_checkpoint_with_prompts

    from selfspec.cli import main

    monkeypatch.setenv("SELFSPEC_PROFILES", str(tmp_path / "profiles"))
    ckpt, prompts = tiny_checkpoint_with_prompts(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 40}" for i in range(300)))
    extra = tmp_path / "extra.txt"
    extra.write_text("w3 w4 w5\nw7 w1 w2 w8\n")
    assert main(["calibrate", "--model", str(ckpt), "--prompts", str(prompts), "--num-prompts", "4", "-n", "6",
                 "--steps", "3", "--batch-size", "8", "--sequences", "2", "--heads", "2", "--samples", "1",
                 "--noise", "0.1", "--train-vocab", "50", "--head", "feature", "--output", str(tmp_path / "cal"),
                 "--holdout", "0.25", "--text", str(text), "--extra-prompts", str(extra)]) == 0
    out = capsys.readouterr().out
    assert "held out, after" in out and "feature-head: used by --method feature" in out and "+ 1 text file(s)" in out
    assert "+ 2 extra prompts (training only)" in out
    head = next(p for p in (tmp_path / "cal").iterdir() if p.name.endswith(".feature.safetensors"))
    assert read_header(head)["draft_vocab"] == 50 and read_header(head)["training"]["samples"] == 1
    assert read_header(head)["training"]["extra_prompts"] == 2 and read_header(head)["dtype"] in ("float32", "bfloat16")
    assert main(["generate", "--model", str(ckpt), "--method", "feature", "-n", "8", "--json", "w5 w9 w12"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]["method"] == "feature"


def test_kept_data_made_with_extra_prompts_serves_a_run_without_them(tmp_path):
    """--data: a file made with --extra-prompts (or --text) loads for the same run without them,
    less their sequences; any other difference in settings decodes again."""
    from selfspec.tools.feature_calibrate import FeatureSequence, load_data, save_data

    def seq(**flags):
        return FeatureSequence(torch.arange(4), 2, torch.zeros(4, 3), torch.zeros(4, 2, dtype=torch.long),
                               torch.zeros(4, 2), **flags)

    key = dict(identity="m", prompts="abc", max_new_tokens=8)
    path = tmp_path / "data.pt"
    save_data(path, {**key, "extra_prompts": "x", "texts": "t"},
              [seq(prompt=0), seq(prompt=1, train_only=True), seq(text=True)])
    assert [x.prompt for x in load_data(path, key)] == [0]
    assert [(x.train_only, x.text) for x in load_data(path, {**key, "extra_prompts": "x"})] == [(False, False),
                                                                                             (True, False)]
    assert len(load_data(path, {**key, "extra_prompts": "x", "texts": "t"})) == 3
    assert load_data(path, {**key, "extra_prompts": "y"}) is None
    assert load_data(path, {**key, "max_new_tokens": 9}) is None


def test_fused_multilayer_inputs_train_and_start_as_the_plain_head(tiny):
    """parts = 2 (EAGLE-3's fused features, an experiment): the head starts as "take h_L", so its α
    before training is the plain head's; it trains; and it is refused by save (no drafter runs it)."""
    from selfspec.heads.feature_head import FeatureHead, save_feature_head

    model = tiny("llama")
    prompts = [torch.tensor([(7 * i + 3 * j) % 90 + 5 for j in range(6 + i % 5)]) for i in range(12)]
    data = feature_data(model, prompts, 12, progress=False)
    options = dict(steps=2, sequences=2, positions=16, heads=2, head_dim=16, draft_vocab=16, holdout=0.25,
                   progress=False)
    plain = train_feature_head(model.adapter, data, **options)
    for x in data:
        x.final = torch.cat([torch.randn_like(x.final), x.final], dim=-1)
    fused = train_feature_head(model.adapter, data, parts=2, **options)
    assert fused.alpha_before == plain.alpha_before and fused.held_out_positions == plain.held_out_positions
    d = plain.head.hidden_size
    assert fused.head.n_params == plain.head.n_params + 2 * d * d + 2 * d
    with pytest.raises(ValueError, match="experiment"):
        save_feature_head(fused.head, "unused.safetensors", model.identity, fused.draft_ids)
    head = FeatureHead(32, 2, 2, 16, parts=2)
    previous, embedded = torch.randn(1, 3, 64), torch.randn(1, 3, 32)
    assert torch.allclose(head.inputs(previous, embedded), head.inputs(previous[..., 32:], embedded), atol=1e-5)


def test_feature_at_scale_windows_line_up_with_calibrate():
    """scripts/feature_at_scale.py (the shipped head's recipe, run on a GPU) builds each training
    window from sequences laid end to end: a position's previous state is h_L one position back in
    its own sequence (zeros at a sequence's start), its token embedding is its own, and examples
    skip the window's first offset and the sequence's last position, as calibrate's do."""
    script = _feature_at_scale()
    data = object.__new__(script.Data)
    lengths = [5, 3, 7]
    data.lengths = torch.tensor(lengths)
    data.offsets = torch.cumsum(data.lengths, 0) - data.lengths
    data.ids = torch.arange(100, 100 + sum(lengths))
    data.final = torch.arange(sum(lengths), dtype=torch.float32)[:, None].repeat(1, 2)  # position p's state: p
    data.embed = lambda ids: ids.float()[..., None].expand(*ids.shape, 2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        chosen = torch.tensor([2, 0, 1])
        previous, embedded, flat, examples = data.window(chosen, 4, generator)
        for row, s in enumerate(chosen.tolist()):
            start, n = int(data.offsets[s]), lengths[s]
            for j in range(4):
                at = int(flat[row, j])
                if at - start < n and (j == 0 or at > int(flat[row, j - 1])):  # a real position of the window
                    assert embedded[row, j, 0] == 100 + at
                    assert previous[row, j, 0] == (at - 1 if at > start else 0)
                    assert bool(examples[row, j]) == (j >= 1 and at - start < n - 1)
                else:
                    assert not examples[row, j] and embedded[row, j].abs().sum() == 0


def test_feature_at_scale_reuses_an_earlier_runs_sequences(tmp_path):
    """`feature_at_scale.py --reuse DIR` reads back what a run wrote (tokens-*.npy in order,
    sequences.json) as the same prompts, answers and sources, and refuses files that disagree."""
    import json

    import numpy as np
    import pytest

    script = _feature_at_scale()
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 49152, size=n).tolist() for n in (7, 3, 12, 5)]
    prompt_lengths, sources = [2, 1, 9, 5], ["held", "spec", "self", "self-held"]
    flat = np.array([t for s in sequences for t in s], dtype=np.uint16)
    for i, lo in enumerate(range(0, len(flat), 10)):  # several files, read back in numeric order
        np.save(tmp_path / f"tokens-{i}.npy", flat[lo:lo + 10])
    (tmp_path / "sequences.json").write_text(json.dumps(dict(lengths=[len(s) for s in sequences],
                                                             prompt_lengths=prompt_lengths, sources=sources)))
    prompts, answers, kinds = script.reused(tmp_path)
    assert prompts == [s[:p] for s, p in zip(sequences, prompt_lengths)]
    assert answers == [s[p:] for s, p in zip(sequences, prompt_lengths)]
    assert kinds == sources
    (tmp_path / "tokens-2.npy").unlink()
    with pytest.raises(SystemExit, match="tokens"):
        script.reused(tmp_path)


def _feature_at_scale():
    """scripts/feature_at_scale.py as a module (it is a script, not part of the package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "feature_at_scale.py"
    spec = importlib.util.spec_from_file_location("feature_at_scale", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_feature_at_scale_answers_only_windows_end_at_the_sequence_end():
    """With answers_only, each window is its sequence's last positions and its examples are the
    answer's positions (from the one whose next token is the answer's first), short of the end."""
    script = _feature_at_scale()
    data = object.__new__(script.Data)
    data.answers_only = True
    lengths, n_prompt = [9, 4], [6, 1]
    data.lengths, data.n_prompt = torch.tensor(lengths), torch.tensor(n_prompt)
    data.offsets = torch.cumsum(data.lengths, 0) - data.lengths
    data.ids = torch.arange(sum(lengths))
    data.final = torch.zeros(sum(lengths), 2)
    data.embed = lambda ids: ids.float()[..., None].expand(*ids.shape, 2)
    _, _, flat, examples = data.window(torch.tensor([0, 1]), 5, torch.Generator().manual_seed(0))
    assert flat[0].tolist() == [4, 5, 6, 7, 8]  # sequence 0's last 5 positions
    assert examples[0].tolist() == [False, True, True, True, False]  # positions 5, 6, 7 (n_prompt - 1 = 5)
    assert examples[1].tolist() == [False, True, True, False, False]  # sequence 1: positions 1, 2 of 0..3


def test_every_shipped_head_belongs_to_a_bundled_model_and_loads():
    """The package's heads (selfspec/data/heads): each file's header names the identity its file
    name carries, a bundled model's, and the head loads with as many draft ids as the header says."""
    from importlib import resources

    from selfspec.model.loading import BUNDLED

    shipped = sorted(resources.files("selfspec").joinpath("data/heads").iterdir(), key=lambda p: p.name)
    heads = [p for p in shipped if p.name.endswith(".feature.safetensors")]
    assert heads, "no feature head shipped"
    names = {b.name for b in BUNDLED.values()}
    for path in heads:
        header = read_header(path)
        identity = ModelIdentity(**header["identity"])
        assert path.name == f"{identity.slug()}.feature.safetensors" and identity.name in names, path.name
        head, draft_ids = load_feature_head(path, identity)
        assert draft_ids.numel() == header["draft_vocab"] and draft_ids.unique().numel() == draft_ids.numel()
        assert head.hidden_size == header["hidden_size"] and all(p.dtype == torch.float32 for p in head.parameters())
        assert path.stat().st_size <= 21 * 2**20, f"{path.name}: a shipped head is at most ~20 MB"
