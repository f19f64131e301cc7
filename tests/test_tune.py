"""The tuner: exact acceptance read off an AR decode, the prediction from rounds and costs, the
timed check, the profile `--method auto` uses, and the plots."""

import json
import warnings

import pytest

from lossless import PROMPT, REPETITIVE
from selfspec.tools.calc import speedup
from selfspec.model.profiles import load_profile, save_section
from selfspec.tools.tune.run import ENGINE
from selfspec.tools.tune import SECTION, default_exit_grid, tune
from selfspec.tools.tune.costs import measure_costs
from selfspec.tools.tune.plots import write_plots
from selfspec.tools.tune.rounds import Rounds, predicted_speedup
from selfspec.tools.tune.trace import replay_early_exit, replay_lookup, trace


def _counts(rounds: Rounds):
    return sum(rounds.drafted), sum(rounds.accepted), len(rounds)


def _stats_counts(stats):
    return stats.drafted, stats.accepted, stats.rounds


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_replayed_rounds_equal_the_engine_rounds(tiny, arch):
    """The trace predicts, without decoding, exactly what early exit and lookup do: same drafted,
    accepted and round counts, and the same acceptance per draft position, for every (k, γ)."""
    model = tiny(arch)
    n = 24
    for prompt in (PROMPT, REPETITIVE):
        ar = model.generate(prompt, method="ar", max_new_tokens=n)
        t = trace(model.adapter, list(prompt), ar.tokens, n, range(1, model.n_layers + 1))
        assert t.hits[model.n_layers][1:].all()  # the full depth agrees with AR everywhere
        for k in (2, 5):
            for g in (1, 4):
                stats = model.generate(prompt, method="early-exit", exit_layer=k, draft_len=g, max_new_tokens=n).stats
                rounds = replay_early_exit(t, k, g)
                assert _counts(rounds) == _stats_counts(stats), (k, g)
                assert rounds.alpha_by_position() == pytest.approx(stats.acceptance_by_position)
        for g in (3,):
            stats = model.generate(prompt, method="lookup", draft_len=g, max_new_tokens=n).stats
            assert _counts(replay_lookup(t, g)) == _stats_counts(stats), g


def test_replay_stops_at_eos_like_the_engine(tiny):
    model = tiny("llama")
    ar = model.generate(PROMPT, method="ar", max_new_tokens=30)
    # make a token the model first emits some way in the end of the sequence
    eos = next(t for i, t in enumerate(ar.tokens) if i >= 5 and t not in ar.tokens[:i])
    model.hf_model.generation_config.eos_token_id = eos
    stopped = model.generate(PROMPT, method="ar", max_new_tokens=30)
    assert 5 <= len(stopped.tokens) < 30 and eos not in stopped.tokens
    t = trace(model.adapter, list(PROMPT), stopped.tokens, 30, [2, 4])
    assert t.output[-1] == eos
    for k, g in ((2, 3), (4, 5)):
        stats = model.generate(PROMPT, method="early-exit", exit_layer=k, draft_len=g, max_new_tokens=30).stats
        assert _counts(replay_early_exit(t, k, g)) == _stats_counts(stats)


def test_rounds_statistics():
    r = Rounds()
    for d, a in ((4, 4), (4, 1), (4, 0), (2, 2)):
        r.add(d, a)
    assert r.tokens == 11 and r.tokens_per_round == 11 / 4 and r.alpha == 7 / 14
    # position 0 reached 4 times, passed 3; position 1 reached 3, passed 2; 2: 2/2; 3: 1/1
    assert r.alpha_by_position() == [3 / 4, 2 / 3, 1.0, 1.0]
    with pytest.raises(ValueError):
        r.add(2, 3)


def test_predicted_speedup_is_the_formula_on_full_rounds():
    """With every round drafting γ, the prediction is E[tokens/step] / (γ·c + v(γ+1)): the
    calc formula, whose E is the i.i.d. expectation when α is the same at every position."""
    r = Rounds()
    for a in (0, 1, 2, 3, 3, 3, 1, 0):
        r.add(3, a)
    c, v = 0.3, {1: 1.0, 4: 1.4}
    assert predicted_speedup(r, cost=c, verify=v) == pytest.approx(r.tokens_per_round / (3 * c + 1.4))
    # a common factor in every timing cancels (v(1) is AR's own step)
    scaled = predicted_speedup(r, cost=2 * c, verify={n: 2 * x for n, x in v.items()})
    assert scaled == pytest.approx(predicted_speedup(r, cost=c, verify=v))
    # the i.i.d. case agrees with calc
    iid = Rounds(drafted=[4] * 5, accepted=[4] * 5)  # α = 1
    assert predicted_speedup(iid, cost=0.25, verify={1: 1.0, 5: 1.0}) == pytest.approx(speedup(1.0, 4, 0.25))
    # a per-round draft cost (lookup) counts once per round, and missing v(n) is an error
    assert predicted_speedup(r, cost=0, round_cost=0.1, verify=v) == pytest.approx(r.tokens_per_round / 1.5)
    with pytest.raises(ValueError, match="not measured"):
        predicted_speedup(r, cost=c, verify={1: 1.0})


def test_costs_are_measured_for_every_k_and_n(tiny):
    model = tiny("llama")
    costs = measure_costs(model.adapter, context=12, exit_layers=[2, 4], max_draft_len=3, repeats=1, progress=False)
    assert set(costs.draft) == set(range(1, 7)) and all(c > 0 for c in costs.draft.values())
    assert set(costs.verify) == {0, 2, 4}
    assert all(set(row) == {1, 2, 3, 4} for row in costs.verify.values())
    assert costs.step_s > 0 and costs.lookup > 0
    json.dumps(costs.to_json())


def test_default_exit_grid():
    assert default_exit_grid(30) == [7, 10, 13, 16, 20, 23, 26, 29]
    assert default_exit_grid(6) == [1, 2, 3, 4, 5]
    assert all(1 <= k < 18 for k in default_exit_grid(18))


def test_tune_checks_the_best_predictions_and_auto_uses_the_profile(tiny, tmp_path):
    model = tiny("llama")
    result = tune(model, [PROMPT, REPETITIVE], max_new_tokens=20, exit_layers=[2, 4], max_draft_len=3, check=2,
                  repeats=1, progress=False)
    assert len(result.candidates) == 2 * 3 + 3  # (k, γ) grid and lookup γ = 1..3
    ranked = sorted(result.candidates, key=lambda c: -c.predicted)
    assert result.checked[:2] == ranked[:2]
    families = {c.method for c in result.candidates}
    assert {c.method for c in result.checked} == families  # the best of each family is timed too
    assert all(next(c for c in ranked if c.method == f) in result.checked for f in families)
    for c in result.checked:
        assert c.measured > 0 and c.identical == "2/2"
        assert c.measured_alpha == pytest.approx(c.rounds.alpha)  # the replay is exact
    assert result.ar_tokens_per_s > 0
    assert set(result.lens_agreement) == set(range(1, model.n_layers))

    path = tmp_path / "profile.json"
    section = result.profile_section(dtype="float32", device="cpu")
    save_section(model.identity, SECTION, section, path)
    assert load_profile(model.identity, path)[SECTION]["method"] == result.choice()["method"]
    json.dumps(section)

    # auto runs what the profile says; k and γ given explicitly take precedence
    save_section(model.identity, SECTION, {"method": "early-exit", "exit_layer": 2, "draft_len": 3}, path)
    out = model.generate(PROMPT, method="auto", profile=str(path), max_new_tokens=12)
    assert (out.stats.method, out.stats.exit_layer, out.stats.draft_len) == ("early-exit", 2, 3)
    assert model.tuned(str(path), draft_len=5) == ("early-exit", 2, 5)
    save_section(model.identity, SECTION, {"method": "ar", "exit_layer": None, "draft_len": None}, path)
    assert model.generate(PROMPT, method="auto", profile=str(path), max_new_tokens=12).stats.method == "ar"


def test_plots_are_written(tiny, tmp_path):
    model = tiny("llama")
    result = tune(model, [PROMPT], max_new_tokens=12, exit_layers=[3], max_draft_len=2, check=1, repeats=1,
                  progress=False)
    paths = write_plots(result, tmp_path / "plots", "tiny llama")
    assert [p.name for p in paths] == ["alpha_by_layer.png", "speedup_heatmap.png", "predicted_vs_measured.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_auto_without_a_profile_never_runs_an_unmeasured_draft(tiny):
    """No tune profile: `auto` is plain decoding (nothing measured faster here), says so once per
    model, and an explicit exit layer still asks for early exit."""
    model = tiny("llama")
    model.name = "untuned-tiny-llama"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = model.generate(PROMPT, max_new_tokens=8)
        second = model.generate(PROMPT, max_new_tokens=8)
    assert first.stats.method == second.stats.method == "ar"
    assert sum("no tuned profile" in str(w.message) for w in caught) == 1
    assert model.generate(PROMPT, max_new_tokens=8, exit_layer=2).stats.method == "early-exit"


def test_auto_uses_the_shipped_choice_only_for_its_dtype(tiny, monkeypatch):
    """A shipped choice (selfspec/data/shipped_profiles.json) is what `auto` runs before any tune,
    for the dtype it was measured in; other dtypes run plain decoding."""
    import selfspec.api

    model = tiny("llama")
    model.name = "shipped-tiny-llama"
    choice = {"method": "lookup", "exit_layer": None, "draft_len": 2, "measured": "a test"}
    monkeypatch.setattr(selfspec.api, "shipped_choice", lambda identity, dtype, device="cpu": choice if dtype == "float32" else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(REPETITIVE, max_new_tokens=8)
    assert (out.stats.method, out.stats.draft_len) == ("lookup", 2)
    assert any("shipped choice for float32" in str(w.message) for w in caught)
    model.dtype_name = "bfloat16"
    assert model.generate(REPETITIVE, max_new_tokens=8).stats.method == "ar"


def test_a_shipped_choice_for_other_kernel_paths_runs_plain_decoding(tiny, monkeypatch):
    """A shipped entry that names kernel_paths applies only where the product kernel runs one of
    them: on another path (an AVX2-only CPU) `auto` runs plain decoding and says why."""
    import selfspec.api
    from selfspec.native import gemv
    from selfspec.model import profiles

    model = tiny("llama")
    model.name = "shipped-tiny-llama-paths"
    choice = {"method": "lookup", "exit_layer": None, "draft_len": 2, "measured": "a test",
              "kernel_paths": ["pairs", "amx"]}
    monkeypatch.setattr(selfspec.api, "shipped_choice", lambda identity, dtype, device="cpu": choice)
    monkeypatch.setattr(gemv, "available", lambda: True)
    monkeypatch.setattr(gemv, "kernel_path", lambda: "avx2")
    assert not profiles.runs_here(choice)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(REPETITIVE, max_new_tokens=8)
    assert out.stats.method == "ar"
    assert any("measured faster only on CPUs with AVX512-BF16 or AMX; this one's products run on AVX2" in str(w.message) for w in caught)
    monkeypatch.setattr(gemv, "kernel_path", lambda: "amx")
    assert profiles.runs_here(choice)
    model.name = "shipped-tiny-llama-paths-amx"  # a new name: its note is said again, once
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert model.generate(REPETITIVE, max_new_tokens=8).stats.method == "lookup"
    (note,) = [str(w.message) for w in caught if "no tuned profile" in str(w.message)]
    # One short line naming what runs and where it was measured, not the shipped file's whole record.
    assert "lookup γ=2 (measured faster than plain decoding on CPUs with AVX512-BF16, AMX;" in note
    assert "a test" not in note and len(note) < 400
    assert profiles.runs_here({k: v for k, v in choice.items() if k != "kernel_paths"})


def test_the_shipped_file_names_the_bundled_model():
    from selfspec.model.profiles import ModelIdentity, shipped_choice

    from selfspec.api import has_feature_head

    smollm2 = ModelIdentity("SmolLM2-135M-Instruct", "d3cc61f5878dc9e5")
    assert shipped_choice(smollm2, "bfloat16")["method"] == "hybrid"
    assert shipped_choice(smollm2, "float32") is None
    # A shipped hybrid drafts from the model's shipped feature head: without one it would be early exit.
    assert has_feature_head({}, smollm2)
    assert not has_feature_head({}, ModelIdentity("gemma-3-270m", "c23b6289364859d9"))


def test_auto_ignores_a_profile_tuned_on_an_older_engine_in_another_dtype_or_on_another_device(tiny, tmp_path):
    model = tiny("llama")
    path = tmp_path / "profile.json"
    measured = {"method": "early-exit", "exit_layer": 2, "draft_len": 3, "dtype": "float32",
                "tuned": "2026-11-30T00:00:00+00:00"}
    save_section(model.identity, SECTION, {**measured, "engine": ENGINE, "device": "cpu"}, path)
    assert model.tuned(str(path)) == ("early-exit", 2, 3)
    for stale in (measured, {**measured, "engine": ENGINE - 1}, {**measured, "engine": ENGINE, "dtype": "int8"},
                  {**measured, "engine": ENGINE, "device": "cuda"}):
        save_section(model.identity, SECTION, stale, path)
        assert model.tuned(str(path)) == ("ar", None, None), stale  # a tiny model has no shipped choice
    result = tune(model, [PROMPT], max_new_tokens=6, exit_layers=[3], max_draft_len=1, check=1, repeats=1,
                  progress=False)
    assert result.profile_section(dtype="float32")["engine"] == ENGINE  # what tune writes is current


def test_shipped_choices_are_per_device_type():
    """Entries keyed by the dtype alone were measured on CPUs; "dtype@cuda" on a GPU: a CPU
    choice never runs on CUDA (SmolLM2's CPU hybrid ran 0.36x AR on an H200) nor a GPU one on a CPU."""
    from selfspec.model.profiles import shipped_choice

    class SmolLM2:
        @staticmethod
        def slug():
            return "SmolLM2-135M-Instruct-d3cc61f5878dc9e5"

    assert shipped_choice(SmolLM2, "bfloat16")["method"] == "hybrid"
    assert shipped_choice(SmolLM2, "bfloat16", "cuda")["method"] == "lookup"
    assert shipped_choice(SmolLM2, "int8", "cuda") is None  # not measured on a GPU: plain decoding
