"""CUDA graphs for exact mode's forwards (selfspec.model.cuda_graphs), their keying and static buffers,
tested on the CPU with a stand-in that "captures" by keeping the function and "replays" by
calling it again: as a real graph, it sees only what it held at capture and what the static
input buffers hold at replay, so a forward that read anything else would go wrong here too."""

import dataclasses
import gc

import pytest
import torch

from lossless import PROMPT, REPETITIVE, assert_greedy_lossless
from selfspec.model import cuda_graphs
from selfspec.api import EXACT_ROWS, SelfSpecModel
from tiny_models import ARCHS, tiny_model

DRAFTERS = [
    dict(method="early-exit", exit_layer=2, draft_len=3),
    dict(method="layer-skip", skip="attn:1,3 mlp:2,4", draft_len=3),
    dict(method="lookup", draft_len=3),
]


class StandIn:
    """A CPU stand-in for cuda_graphs.CudaGraph: warm up twice, keep the function, replay by calling it."""

    def __init__(self, body):
        body()
        body()
        self.body = body
        self.out = body()

    def replay(self):
        self.out = self.body()
        return self.out


def _graphed(arch, dtype=torch.float32, factory=StandIn, **lean):
    """A model whose exact-mode forwards go through PyTorch ops (not the CPU's fused kernel), as on CUDA."""
    model = SelfSpecModel(tiny_model(arch, dtype=dtype), lean=False)
    step = model.adapter.lean(exact_rows=EXACT_ROWS, graph_factory=factory, **lean)
    step.fused = None
    step.shape = dataclasses.replace(step.shape, gemv=False)
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_graphed_forwards_equal_eager_ones_and_stay_lossless(arch):
    graphed, eager = _graphed(arch), _graphed(arch, factory=None)
    assert eager.adapter.step.graphs is None
    for options in [dict(method="ar"), *DRAFTERS]:
        out = graphed.generate(REPETITIVE, max_new_tokens=24, **options)
        assert out.tokens == eager.generate(REPETITIVE, max_new_tokens=24, **options).tokens, options
        assert_greedy_lossless(graphed, REPETITIVE, n=24, **options)
    graphs = graphed.adapter.step.graphs
    assert graphs.captures >= 3  # AR's whole model; early exit's layers < k and >= k; the skip set
    assert graphs.replays > 10 * graphs.captures


def test_bfloat16_graphed_verify_is_lossless():
    model = _graphed("llama", dtype=torch.bfloat16)
    for options in DRAFTERS:
        assert_greedy_lossless(model, PROMPT, n=30, **options)


def test_later_generations_reuse_cache_storage_and_its_graphs():
    """The drafter keeps its last generation's context (and cache) until its next begin, so two
    storages alternate: from the third generation on, nothing is captured again."""
    model = _graphed("llama")
    graphs = model.adapter.step.graphs
    options = dict(method="early-exit", exit_layer=2, draft_len=3, max_new_tokens=20)
    first = model.generate(PROMPT, **options)
    gc.collect()
    assert model.generate(PROMPT, **options).tokens == first.tokens
    captured = graphs.captures
    for _ in range(3):
        gc.collect()  # a cache no drafter holds is unreachable: its storage is back in the pool
        assert model.generate(PROMPT, **options).tokens == first.tokens
    assert graphs.captures == captured  # replayed, none captured again
    assert len(model.adapter._cache_pool) == 1


def test_a_reused_cache_starts_zeroed_and_a_wrong_shape_is_refused():
    from selfspec.model.cache import KVCache

    used = KVCache(2, 1, 4, 8, dtype=torch.float32, device="cpu")
    used.keys.fill_(3.0)
    used.values.fill_(-1.0)
    reused = KVCache(2, 1, 4, 8, dtype=torch.float32, device="cpu", storage=(used.keys, used.values))
    assert reused.keys.data_ptr() == used.keys.data_ptr() and not reused.keys.any() and not reused.values.any()
    with pytest.raises(ValueError, match="does not fit"):
        KVCache(2, 1, 4, 16, dtype=torch.float32, device="cpu", storage=(used.keys, used.values))


def test_graphs_are_kept_per_plan_and_the_oldest_dropped_past_the_limit():
    model = _graphed("llama")
    graphs = model.adapter.step.graphs
    graphs.limit = 2
    for k in (1, 2, 3):
        model.generate(PROMPT, method="early-exit", exit_layer=k, draft_len=2, max_new_tokens=8)
    assert len(graphs.graphs) == 2
    assert all(len(key[0]) for key in graphs.graphs)  # keyed by non-empty layer plans


def test_graphs_only_in_exact_mode_and_only_on_cuda_unless_asked(monkeypatch):
    model = SelfSpecModel(tiny_model("llama"), lean=False)
    assert model.adapter.lean(exact_rows=EXACT_ROWS).graphs is None  # a CPU model, no stand-in
    assert model.adapter.lean(graph_factory=StandIn).graphs is None  # not exact: shapes vary
    assert cuda_graphs.enabled(torch.device("cuda"))
    assert not cuda_graphs.enabled(torch.device("cpu"))
    monkeypatch.setenv("SELFSPEC_CUDA_GRAPHS", "0")
    assert not cuda_graphs.enabled(torch.device("cuda"))


class FailingCapture:
    """A capture that fails as CUDA's does when an op syncs with the host mid-capture."""

    def __init__(self, body):
        body()
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore lines")


def test_a_failed_capture_warns_once_and_decodes_eagerly_with_the_same_output():
    model, eager = _graphed("llama", factory=FailingCapture), _graphed("llama", factory=None)
    with pytest.warns(UserWarning, match="could not be captured as a CUDA graph .*not permitted when stream"):
        out = model.generate(PROMPT, method="early-exit", exit_layer=2, draft_len=3, max_new_tokens=20)
    assert model.adapter.step.graphs is None
    assert out.tokens == eager.generate(PROMPT, method="early-exit", exit_layer=2, draft_len=3,
                                        max_new_tokens=20).tokens
    assert_greedy_lossless(model, PROMPT, n=20, method="early-exit", exit_layer=2, draft_len=3)
