"""The lean step (selfspec.step): same logits as transformers, greedy identity with AR eager,
compiled and in exact mode, no recompiles across layers, skip sets and context lengths, int8."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from lossless import PROMPT, REPETITIVE, assert_adapter_matches_transformers, assert_greedy_lossless
from selfspec.api import EXACT_ROWS, SelfSpecModel
from selfspec.drafters.base import Draft
from selfspec.engine import verify_forward
from selfspec.quantize import Int8Linear, quantize_int8, weight_bytes
from selfspec.step import BUCKETS, bucket
from tiny_models import ARCHS, tiny_model

DRAFTERS = [
    dict(method="early-exit", exit_layer=2, draft_len=3),
    dict(method="early-exit", exit_layer=4, draft_len=2),
    dict(method="layer-skip", skip="attn:1,3 mlp:2,4", draft_len=3),
]


def _model(arch, dtype=torch.float32, **lean):
    model = SelfSpecModel(tiny_model(arch, dtype=dtype), lean=False)
    model.adapter.lean(**lean)
    return model


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
    assert BUCKETS[-1] == 16


def test_fused_weights_are_the_modules_own_storage():
    model = SelfSpecModel(tiny_model("llama"))
    layer, weights = model.adapter.layers[0], model.adapter.step.weights[0]
    q = layer.self_attn.q_proj.weight
    assert q.data_ptr() == weights.wqkv.data_ptr()  # a view, not a copy
    up = layer.mlp.up_proj.weight
    assert up.untyped_storage().data_ptr() == weights.wgu.untyped_storage().data_ptr()
    assert weights.wgu.untyped_storage().nbytes() == 2 * up.numel() * up.element_size()
    with torch.no_grad():
        weights.wqkv[0, 0] = 123.0
    assert q[0, 0] == 123.0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["eager", "compiled", "exact", "exact-compiled"])
def test_lean_step_matches_transformers_and_is_lossless(arch, mode):
    # "compiled" uses dynamo with the eager backend here: the same graphs, guards and padding,
    # without inductor's compile time (inductor itself: the llama test below and real models).
    lean = {"eager": {}, "compiled": dict(compile=True, backend="eager"), "exact": dict(exact_rows=EXACT_ROWS),
            "exact-compiled": dict(compile=True, backend="eager", exact_rows=EXACT_ROWS)}[mode]
    model = _model(arch, **lean)
    assert_adapter_matches_transformers(model.hf_model, model.adapter)
    for options in DRAFTERS:
        out = assert_greedy_lossless(model, **options)
        assert out.stats.drafted > 0
    assert_greedy_lossless(model, prompt=REPETITIVE, method="lookup", draft_len=3)


def test_inductor_compiled_step_is_lossless():
    model = _model("llama", compile=True)
    assert_adapter_matches_transformers(model.hf_model, model.adapter)
    assert_greedy_lossless(model, method="early-exit", exit_layer=3, draft_len=3)


def test_no_recompiles_across_layers_skip_sets_and_context_lengths():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    model = _model("llama", compile=True, backend=counter)
    runs = [
        dict(method="ar"),
        dict(method="early-exit", exit_layer=2, draft_len=3),
        dict(method="early-exit", exit_layer=5, draft_len=3),
        dict(method="layer-skip", skip="attn:1,3", draft_len=3),
        dict(method="layer-skip", skip="attn:2,4", draft_len=3),  # another skip set, same buckets
    ]
    for prompt in (PROMPT, PROMPT[:4], PROMPT * 5):  # 9, 4 and 45 positions of context
        for options in runs:
            model.generate(prompt, max_new_tokens=70, **options)  # contexts well past one span
    seen = model.adapter.step._seen  # (row bucket, attention on, MLP on) keys the step compiled for
    assert counter.frame_count == len(seen), (counter.frame_count, sorted(seen))
    # Row buckets 1 (AR, drafts), 4 (verifies of 3 drafts, and the 4-token prompt), 16 (the
    # 9-token prompt), 2 (a verify cut short by the end); attention-only keys for layer-skip.
    assert {1, 4, 16} <= {rows for rows, _, _ in seen} <= set(BUCKETS)
    assert (1, False, True) in seen


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen2"])
def test_exact_mode_verify_rows_are_bitwise_the_ar_steps(arch):
    """Exact mode in bfloat16, where multi-row products round differently from one-row ones on
    some CPUs: every verify row's logits equal, bit for bit, the logits AR computes for that
    position. (Without exact mode this holds only up to rounding.)"""
    model = _model(arch, dtype=torch.bfloat16, exact_rows=EXACT_ROWS)
    adapter = model.adapter
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        cache = adapter.new_cache(40)
        adapter.run_layers(adapter.embed(ids), range(adapter.n_layers), 0, cache)
        tokens = torch.tensor([7, 50, 21, 3, 88])
        ar = [adapter.head(adapter.run_layers(adapter.embed(tokens[j : j + 1]), range(adapter.n_layers),
                                              len(PROMPT) + j, cache)) for j in range(len(tokens))]
        draft = Draft(tokens=tokens[1:])
        verify = verify_forward(adapter, cache, tokens[:1], draft, len(PROMPT))
    for j in range(len(tokens)):
        assert torch.equal(verify[j], ar[j][0]), j


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_exact_mode_bfloat16_is_lossless(arch):
    model = _model(arch, dtype=torch.bfloat16, exact_rows=EXACT_ROWS)
    for options in DRAFTERS:
        assert_greedy_lossless(model, **options)


def test_exact_mode_refuses_long_drafts():
    model = SelfSpecModel(tiny_model("llama"), exact=True)
    with pytest.raises(ValueError, match="draft length must be at most 3"):
        model.generate(PROMPT, method="early-exit", exit_layer=2, draft_len=EXACT_ROWS)


def test_lean_step_refuses_a_write_past_the_cache():
    model = SelfSpecModel(tiny_model("llama"))
    adapter = model.adapter
    cache = adapter.new_cache(10)
    with torch.inference_mode(), pytest.raises(IndexError, match="does not fit"):
        adapter.run_layers(adapter.embed(torch.arange(4)), range(adapter.n_layers), cache.capacity - 2, cache)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_int8_weights(arch):
    hf = tiny_model(arch, dtype=torch.bfloat16)
    before = weight_bytes(hf)["layers"]
    reference = SelfSpecModel(tiny_model(arch, dtype=torch.bfloat16), lean=False)
    assert quantize_int8(hf) == 7 * hf.config.num_hidden_layers
    assert isinstance(hf.model.layers[0].mlp.down_proj, Int8Linear)
    assert weight_bytes(hf)["layers"] < 0.6 * before  # int8 plus per-channel scales and norms
    model = SelfSpecModel(hf)
    # The lean step and the general path (the HF modules, now Int8Linear) agree, and the int8
    # model stays close to the bfloat16 one it was quantized from.
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        lean = model.adapter.head(model.adapter.run_layers(model.adapter.embed(ids), range(6), 0,
                                                           model.adapter.new_cache(12)))
        general = model.adapter.head(model.adapter.run_layers(model.adapter.embed(ids), range(6), 0,
                                                              model.adapter.new_cache(12), write=False))
        full = reference.adapter.head(reference.adapter.run_layers(reference.adapter.embed(ids), range(6), 0,
                                                                   reference.adapter.new_cache(12)))
    torch.testing.assert_close(lean, general, atol=0.1, rtol=0.05)
    assert (lean.argmax(-1) == full.argmax(-1)).float().mean() >= 0.75
    for options in DRAFTERS:
        assert_greedy_lossless(model, **options)


def test_exact_mode_gives_every_method_the_same_cache():
    """Attention spans the whole cache in exact mode, and CPU attention kernels round by the
    span's length: AR and every drafter must get the same capacity for the same request."""
    model = SelfSpecModel(tiny_model("llama"), exact=True)
    sizes = {model.generate(PROMPT, max_new_tokens=20, **options).stats.kv_cache_bytes
             for options in (dict(method="ar"), *DRAFTERS[:1], dict(method="lookup", draft_len=1))}
    assert len(sizes) == 1
