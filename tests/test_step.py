"""The lean step (selfspec.model.step): same logits as transformers, greedy identity with AR eager,
compiled and in exact mode, no recompiles across layers, skip sets and context lengths, int8."""

import pytest
import selfspec
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from lossless import PROMPT, REPETITIVE, assert_adapter_matches_transformers, assert_greedy_lossless
from selfspec.api import EXACT_ROWS, SelfSpecModel
from selfspec.core.draft import Draft
from selfspec.core.engine import verify_forward
from selfspec.heads.draft_head import PrunedHead
from selfspec.model.quantize import Int4Linear, Int4Slice, Int8Linear, quantize_int4, quantize_int8, weight_bytes
from selfspec.model.step import BUCKETS, bucket
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


def test_exact_mode_refuses_drafts_longer_than_its_exact_verify(monkeypatch):
    """Where every forward is padded to the EXACT_ROWS bucket, a longer draft is refused; where the
    fused layer runs there is no limit (a 20-token draft's verify runs in calls of 16 rows)."""
    model = SelfSpecModel(tiny_model("llama"), exact=True)
    if model.exact_limit() is None:
        assert model.exact_rows() == 16
        out = model.generate(PROMPT, method="early-exit", exit_layer=2, draft_len=20, threshold=0.0, max_new_tokens=8)
        assert out.stats.draft_len == 20
        monkeypatch.setattr(SelfSpecModel, "exact_rows", lambda self: EXACT_ROWS)  # as where it does not run
    assert model.exact_limit() == EXACT_ROWS
    with pytest.raises(ValueError, match=f"draft length must be at most {EXACT_ROWS - 1}"):
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


@pytest.mark.parametrize("layout", ["int4pack", "blocks"])
@pytest.mark.parametrize("arch", ARCHS)
def test_int4_weights(arch, layout, monkeypatch):
    monkeypatch.setenv("SELFSPEC_INT4_LAYOUT", layout)  # PyTorch's kernel (the default) and selfspec's
    hf = tiny_model(arch, dtype=torch.bfloat16)
    before = weight_bytes(hf)["layers"]
    originals = [m.weight.detach().float().clone() for m in (hf.model.layers[0].self_attn.o_proj,
                                                             hf.model.layers[0].mlp.down_proj)]
    reference = SelfSpecModel(tiny_model(arch, dtype=torch.bfloat16), lean=False)
    per_layer = 4 if arch == "phi3" else 7  # Phi-3's q/k/v and gate/up are already one module each
    assert quantize_int4(hf) == per_layer * hf.config.num_hidden_layers
    layer = hf.model.layers[0]
    assert isinstance(layer.mlp.down_proj, Int4Linear) and isinstance(hf.lm_head, Int8Linear)
    if arch != "phi3":
        assert isinstance(layer.self_attn.k_proj, Int4Slice) and layer.self_attn.k_proj.fused is layer.self_attn.q_proj.fused
    # 4-bit weights plus a scale and zero per 32 (the blocks layout's codes and steps per 16 blocks,
    # a tiny model's rows of 2-4 blocks padding their group's codes to 16)
    assert weight_bytes(hf)["layers"] < (0.4 if layout == "int4pack" else 0.55) * before
    # Each dequantized weight is within half a group step (plus bfloat16 rounding) of the original.
    for module, w in zip((layer.self_attn.o_proj, layer.mlp.down_proj), originals):
        groups = w.view(w.shape[0], -1, 32)
        step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, dim=1)
        assert ((module.weight.float() - w).abs() <= 0.5 * step + 0.02 * w.abs() + 1e-3).all()
    model = SelfSpecModel(hf)
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        a, r = model.adapter, reference.adapter
        lean = a.head(a.run_layers(a.embed(ids), range(6), 0, a.new_cache(12)))
        general = a.head(a.run_layers(a.embed(ids), range(6), 0, a.new_cache(12), write=False))
        full = r.head(r.run_layers(r.embed(ids), range(6), 0, r.new_cache(12)))
    # The lean step and the general path (the HF modules, now int4 slices) agree; the int4 model
    # stays near the bfloat16 one (random tiny weights are the worst case for 4 bits).
    if layout == "int4pack":
        torch.testing.assert_close(lean, general, atol=0.05, rtol=0.02)
    else:  # x as int8 in blocks of 32 (kernels/quant4.h): a bfloat16 difference upstream can move a step
        assert (lean - general).abs().max() < 0.05 * general.abs().max()
    assert F.cosine_similarity(lean, full, dim=-1).min() > 0.8
    for options in DRAFTERS:
        assert_greedy_lossless(model, **options)
    # A pruned draft head over the int8 head gives the int8 head's own logits for its rows.
    with torch.inference_mode():
        h = a.run_layers(a.embed(ids), range(3), 0, a.new_cache(12))
        subset = PrunedHead(a, torch.arange(0, a.lm_head.out_features, 2)).subset_logits(h)
        torch.testing.assert_close(subset, a.head(h)[:, ::2], atol=0.05, rtol=0.02)


def test_int4_codes_a_gguf_q4_1_grid_to_within_its_steps():
    """A weight on GGUF Q4_1's grid (per 32 inputs: minimum + step · q, q in 0..15; minimums of
    either sign) gets each block's step and minimum as the nearest codes of its group's steps, and
    each weight comes back within half a coded step of the grid's own value plus what the coding
    moved its grid point."""
    from selfspec.model.quantize import block_scales

    g = torch.Generator().manual_seed(0)
    step, low = torch.rand(32, 4, 1, generator=g) * 0.02 + 0.001, torch.randn(32, 4, 1, generator=g) * 0.1
    q = torch.randint(0, 16, (32, 4, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # every block spans its whole grid, as Q4_1's quantizer makes it
    assert (low > 0).any() and (low + 15 * step < 0).any()  # all-positive and all-negative blocks
    w = (low + step * q).view(32, 128)
    linear = Int4Linear.quantize(w, torch.bfloat16)
    scale, minimum = block_scales(linear.scales_zeros, 4)
    steps = linear.scales_zeros[..., 32:].contiguous().view(torch.bfloat16).float()  # one group: [32, 1, 3]
    assert ((scale - step[..., 0]).abs() <= steps[..., 0] / 2 * 1.001).all()
    assert ((minimum + low[..., 0]).abs() <= steps[..., 1] / 2 * 1.001).all()
    back = linear.weight.float().view(32, 4, 32)
    moved = 15 * (scale - step[..., 0]).abs() + (minimum + low[..., 0]).abs()
    bound = 0.5 * scale + moved
    assert ((back - w.view(32, 4, 32)).abs() <= bound[..., None] + w.view(32, 4, 32).abs() / 256).all()


def test_int4_refuses_shapes_its_kernel_cannot_run():
    with pytest.raises(ValueError, match="divisible by 16.*--dtype int8"):
        Int4Linear.quantize(torch.randn(24, 64), torch.bfloat16)
    with pytest.raises(ValueError, match="on CUDA use --dtype int8"):
        selfspec.load("no-such-model", dtype="int4", device="cuda")


def test_exact_mode_gives_every_method_the_same_cache():
    """Attention spans the whole cache in exact mode, and CPU attention kernels round by the
    span's length: AR and every drafter must get the same capacity for the same request."""
    model = SelfSpecModel(tiny_model("llama"), exact=True)
    sizes = {model.generate(PROMPT, max_new_tokens=20, **options).stats.kv_cache_bytes
             for options in (dict(method="ar"), *DRAFTERS[:1], dict(method="lookup", draft_len=1))}
    assert len(sizes) == 1
