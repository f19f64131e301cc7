"""What every drafter shares: one cache per generation, never cloned; the lossless contract; the
registry, the API and the CLI know each of them by name."""

import pytest
import torch

import selfspec.model.cache
from lossless import REPETITIVE, assert_greedy_lossless
from selfspec.drafters import METHODS

OPTIONS = {
    "ar": {},
    "early-exit": dict(exit_layer=3, draft_len=3),
    "layer-skip": dict(skip="attn:2 mlp:3-4", draft_len=4),
    "swift": dict(draft_len=6),
    "clasp": dict(every=2, draft_len=4),
    "conflayers": dict(every=2, draft_len=4),
    "lookup": dict(draft_len=4),
    "suffix": dict(draft_len=8),
    "hybrid": dict(exit_layer=3, draft_len=4),
    "expert-subset": dict(draft_len=4),
    "saguaro": dict(exit_layer=3, draft_len=3),
    "feature": dict(draft_len=3),
}
# Methods that need a particular kind of model (expert-subset: mixture of experts); the rest use llama.
ARCH = {"expert-subset": "mixtral"}


def test_every_method_has_options_here():
    assert set(OPTIONS) == set(METHODS)


@pytest.fixture
def feature_head(tiny, tmp_path):
    """A feature head for the tiny llama, named by its profile for the test's duration."""
    from selfspec.heads.feature_head import SECTION, FeatureHead, save_feature_head
    from selfspec.model.profiles import save_section

    model = tiny("llama")
    head = FeatureHead(64, model.n_layers, heads=2, head_dim=16)
    save_section(model.identity, SECTION, {"path": str(save_feature_head(head, tmp_path / "f.safetensors",
                                                                          model.identity, torch.arange(90)))})
    yield
    save_section(model.identity, SECTION, {})


@pytest.mark.parametrize("method", METHODS)
def test_one_cache_per_generation_never_cloned(method, tiny, monkeypatch, request):
    if method == "feature":
        request.getfixturevalue("feature_head")
    model = tiny(ARCH.get(method, "llama"))
    caches = []
    clones = []
    init = selfspec.model.cache.KVCache.__init__
    clone = torch.Tensor.clone

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        caches.append(self)

    def recording_clone(self, *args, **kwargs):
        clones.append(tuple(self.shape))
        return clone(self, *args, **kwargs)

    monkeypatch.setattr(selfspec.model.cache.KVCache, "__init__", counting_init)
    monkeypatch.setattr(torch.Tensor, "clone", recording_clone)
    out = assert_greedy_lossless(model, prompt=REPETITIVE, n=30, method=method, **OPTIONS[method])
    # AR's generation and the drafter's: one each (and the feature head's own few-KB cache)
    assert len(caches) == (3 if method == "feature" else 2)
    assert not [shape for shape in clones if shape == tuple(caches[1].keys.shape) or len(shape) == 5]
    assert out.stats.method == method
