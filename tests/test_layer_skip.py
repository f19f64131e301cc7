"""Skip sets in the adapter, cache-free probes, and the static layer-skip drafter."""

import pytest
import torch

from lossless import PROMPT, assert_greedy_lossless, assert_sampling_matches_target
from selfspec.drafters.layers.layer_skip import AdaptiveThreshold, LayerSkip
from selfspec.model.profiles import ModelIdentity, ProfileMismatchError, load_profile, save_section
from selfspec.model.skips import SkipSet
from tiny_models import ARCHS, VOCAB, tiny_model


def test_skip_set_parse_describe_and_json():
    s = SkipSet.parse("attn:1,3 mlp:2-4 6-7")
    assert s.attn == {1, 3, 6, 7} and s.mlp == {2, 3, 4, 6, 7}
    assert s.boundary(10) == 1 and len(s) == 9 and s.skipped_layers() == {3, 6, 7}
    assert SkipSet.from_json(s.to_json()) == s
    assert s.describe() == "layers 3,6-7; attn 1; mlp 2,4"
    assert SkipSet().boundary(8) == 8 and SkipSet.early_exit(5, 8).boundary(8) == 5
    with pytest.raises(ValueError, match="outside 0..5"):
        SkipSet.parse("4-6").check(6)
    with pytest.raises(ValueError, match="bad layer list"):
        SkipSet.parse("attn:x")


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_skipped_sublayers_are_left_out(arch):
    """Skipping layer i's MLP equals running the layer's attention alone; skipping both equals
    not running the layer at all."""
    from selfspec.model.adapter import ModelAdapter

    adapter = ModelAdapter(tiny_model(arch))
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        full = adapter.run_layers(adapter.embed(ids), [0, 1, 2, 3], 0, adapter.new_cache(16))
        whole = adapter.run_layers(adapter.embed(ids), [0, 1, 2, 3], 0, adapter.new_cache(16), skip=SkipSet.layers([2]))
        without = adapter.run_layers(adapter.embed(ids), [0, 1, 3], 0, adapter.new_cache(16))
        attn_only = adapter.run_layers(adapter.embed(ids), [0, 1, 2, 3], 0, adapter.new_cache(16),
                                       skip=SkipSet(mlp=frozenset({2})))
    torch.testing.assert_close(whole, without)
    assert not torch.allclose(attn_only, full) and not torch.allclose(attn_only, whole)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3_text"])
def test_probe_matches_a_written_forward_and_leaves_the_cache_alone(arch):
    from selfspec.model.adapter import ModelAdapter

    adapter = ModelAdapter(tiny_model(arch))
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(3))
    layers = range(adapter.n_layers)
    with torch.inference_mode():
        cache = adapter.new_cache(24)
        adapter.run_layers(adapter.embed(ids[:12]), layers, 0, cache)
        keys_before = cache.keys.clone()
        probe = adapter.run_layers(adapter.embed(ids[12:]), layers, 12, cache, write=False)
        torch.testing.assert_close(cache.keys, keys_before, rtol=0, atol=0, equal_nan=True)  # empty slots may hold NaN
        written = adapter.run_layers(adapter.embed(ids[12:]), layers, 12, cache)
        torch.testing.assert_close(probe, written, atol=1e-5, rtol=1e-5)
        # A batch of candidate states at one position: each row as if probed alone.
        h = adapter.run_layers(adapter.embed(ids[12:15]), [0], 12, cache)  # three different states
        batch = adapter.run_layers(h[0, :, None], [1, 2], 12, cache, write=False)  # [3, 1, hidden]
        for j in range(3):
            alone = adapter.run_layers(h[:, j : j + 1], [1, 2], 12, cache, write=False)
            torch.testing.assert_close(batch[j : j + 1], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_layer_skip_equals_ar(arch, tiny):
    model = tiny(arch)
    for skip in ("2-4", "attn:1,3 mlp:4", "mlp:0-5", "attn:5", "0"):
        out = assert_greedy_lossless(model, method="layer-skip", skip=skip, draft_len=5, threshold=0)
        assert out.stats.drafted > 0
    out = assert_greedy_lossless(model, method="layer-skip", skip="3", draft_len=6, threshold=0.9)
    assert out.stats.method == "layer-skip"


def test_sampled_layer_skip_follows_the_target_distribution(tiny):
    accepted = assert_sampling_matches_target(tiny("llama"), method="layer-skip", skip="attn:1 mlp:2-4",
                                              draft_len=3, threshold=0)
    assert accepted > 0


def test_confidence_stop_shortens_drafts(tiny):
    model = tiny("llama")
    always = model.generate(PROMPT, method="layer-skip", skip="2-4", draft_len=6, threshold=0, max_new_tokens=30)
    picky = model.generate(PROMPT, method="layer-skip", skip="2-4", draft_len=6, threshold=0.999,
                           max_new_tokens=30)
    assert always.tokens == picky.tokens
    assert picky.stats.drafted / picky.stats.rounds < always.stats.drafted / always.stats.rounds


def test_adaptive_threshold_moves_the_right_way():
    low = AdaptiveThreshold(0.5)
    for _ in range(20):
        low.update(0, 4)  # everything rejected: demand surer drafts
    assert low.value > 0.5
    high = AdaptiveThreshold(0.5)
    for _ in range(20):
        high.update(4, 4)  # everything accepted: draft more
    assert high.value < 0.5
    stay = AdaptiveThreshold(0.5)
    stay.update(0, 0)  # nothing drafted: nothing learned
    assert stay.value == 0.5 and stay.rate is None


def test_profile_round_trip_and_identity_check(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("SELFSPEC_PROFILES")  # set for the whole session by conftest
    model = tiny("llama")
    other = tiny("qwen3")
    assert load_profile(model.identity) == {}
    skip = SkipSet.parse("attn:2 mlp:3-4")
    path = save_section(model.identity, "layer-skip", {"skip": skip.to_json()})
    assert path.parent == tmp_path / "profiles"
    profile = load_profile(model.identity)
    assert SkipSet.from_json(profile["layer-skip"]["skip"]) == skip
    assert LayerSkip(profile=profile).skip == skip
    # generate picks the profile up by model
    out = model.generate(PROMPT, method="layer-skip", max_new_tokens=12)
    assert out.tokens == model.generate(PROMPT, method="ar", max_new_tokens=12).tokens
    assert other.identity.config_hash != model.identity.config_hash
    with pytest.raises(ProfileMismatchError, match="not to"):
        load_profile(other.identity, path)
    renamed = ModelIdentity(name="someone-else", config_hash=model.identity.config_hash)
    with pytest.raises(ProfileMismatchError):
        load_profile(renamed, path)
