"""What every drafter shares: one cache per generation, never cloned; the lossless contract; the
registry, the API and the CLI know each of them by name."""

import pytest
import torch

import selfspec.cache
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
    "hybrid": dict(exit_layer=3, draft_len=4),
    "expert-subset": dict(draft_len=4),
    "saguaro": dict(exit_layer=3, draft_len=3),
}
# Methods that need a particular kind of model (expert-subset: mixture of experts); the rest use llama.
ARCH = {"expert-subset": "mixtral"}


def test_every_method_has_options_here():
    assert set(OPTIONS) == set(METHODS)


@pytest.mark.parametrize("method", METHODS)
def test_one_cache_per_generation_never_cloned(method, tiny, monkeypatch):
    model = tiny(ARCH.get(method, "llama"))
    caches = []
    clones = []
    init = selfspec.cache.KVCache.__init__
    clone = torch.Tensor.clone

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        caches.append(self)

    def recording_clone(self, *args, **kwargs):
        clones.append(tuple(self.shape))
        return clone(self, *args, **kwargs)

    monkeypatch.setattr(selfspec.cache.KVCache, "__init__", counting_init)
    monkeypatch.setattr(torch.Tensor, "clone", recording_clone)
    out = assert_greedy_lossless(model, prompt=REPETITIVE, n=30, method=method, **OPTIONS[method])
    assert len(caches) == 2  # AR's generation and the drafter's: one each
    assert not [shape for shape in clones if shape == tuple(caches[1].keys.shape) or len(shape) == 5]
    assert out.stats.method == method
