"""`selfspec search`: the Bayesian optimisation of the layer-skip set, and its profile."""

import json
import subprocess
import sys

import pytest

from lossless import PROMPT
from selfspec.model.profiles import load_profile
from selfspec.tools.search import from_params, search_skip_set, starting_points, to_params
from selfspec.model.skips import SkipSet


def test_params_round_trip():
    skip = SkipSet.parse("attn:0,4 mlp:2-3")
    params = to_params(skip, 6)
    assert len(params) == 12 and sum(params.values()) == 4
    assert from_params(params) == skip
    assert from_params({"attn003": 0.7, "mlp003": 0.2, "mlp005": 0.51}) == SkipSet.parse("attn:3 mlp:5")
    assert all(len(s) and s.boundary(6) < 6 for s in starting_points(6))


def test_search_measures_sets_and_returns_the_fastest(tiny):
    model = tiny("llama")
    result = search_skip_set(model, [PROMPT, PROMPT[:5]], iterations=8, random_points=2, max_new_tokens=12,
                             draft_len=4, progress=False)
    assert len(result.trials) == 8
    assert len({t.skip for t in result.trials}) >= 4  # starting points, random points, BO proposals
    fastest = max(result.trials, key=lambda t: t.tokens_per_s)
    assert result.best.skip == fastest.skip  # the winner, re-measured
    assert result.best.tokens_per_s > 0 and result.ar_tokens_per_s > 0
    assert all(len(t.skip) > 0 for t in result.trials)
    # the found set decodes losslessly
    out = model.generate(PROMPT, method="layer-skip", skip=result.best.skip, max_new_tokens=20)
    assert out.tokens == model.generate(PROMPT, method="ar", max_new_tokens=20).tokens


def test_search_refuses_nonsense(tiny):
    with pytest.raises(ValueError, match="iterations"):
        search_skip_set(tiny("llama"), [PROMPT], iterations=0, progress=False)


@pytest.mark.real
def test_search_cli_writes_a_profile_generate_uses(tmp_path):
    profile = tmp_path / "profile.json"
    run = lambda *args: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "selfspec.cli", *args], capture_output=True, text=True, timeout=600)
    out = run("search", "--iterations", "2", "-n", "4", "--num-prompts", "1", "--output", str(profile), "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    saved = json.loads(profile.read_text())
    assert saved["layer-skip"]["skip"] == result["skip"] and saved["layer-skip"]["trials"] == 2
    assert saved["identity"]["name"] == "SmolLM2-135M-Instruct"
    gen = run("generate", "Name a fruit.", "--method", "layer-skip", "--profile", str(profile), "-n", "8", "--json")
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout)["stats"]["method"] == "layer-skip"


def test_search_cli_rejects_bad_prompts_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nothing": 1}\n')
    out = subprocess.run([sys.executable, "-m", "selfspec.cli", "search", "--prompts", str(bad)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "not a prompt row" in out.stderr


def test_profile_for_another_model_is_refused(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("SELFSPEC_PROFILES", str(tmp_path))
    from selfspec.model.profiles import save_section

    path = save_section(tiny("llama").identity, "layer-skip", {"skip": {"attn": [1], "mlp": []}})
    with pytest.raises(ValueError, match="belongs to"):
        tiny("qwen3").generate(PROMPT, method="layer-skip", profile=str(path))
    assert load_profile(tiny("llama").identity)["layer-skip"]["skip"]["attn"] == [1]
