"""Tests for selfspec.model.quantized_cache and the converted cache's formats: a quantized model read
back from disk equals the freshly quantized one bit for bit; keys and formats invalidate cleanly."""

import json

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

import selfspec
from selfspec.model import loading, quantized_cache
from selfspec.model.loading import CACHE_FORMAT, CACHE_MARKER, load_hf, resolve_checkpoint, stored_dtype
from selfspec.model.quantize import Int4Linear, Int4Slice, Int8Linear
from selfspec.model.quantized_cache import file_name, home, load_quantized

PROMPT = [5, 17, 42, 8, 63, 21]


def _checkpoint(directory, arch="llama", dtype=torch.float32):
    tiny_model(arch, dtype=dtype).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def _no_quantizing(monkeypatch):
    def refuse(model, **options):
        raise AssertionError("quantized again")

    monkeypatch.setattr(quantized_cache, "QUANTIZERS", {"int8": refuse, "int4": refuse})


def _assert_same(fresh, cached):
    """Every module's type, and every parameter and buffer (shared ones under each name), equal."""
    assert [(n, type(m)) for n, m in fresh.named_modules(remove_duplicate=False)] == \
        [(n, type(m)) for n, m in cached.named_modules(remove_duplicate=False)]
    for named in ("named_parameters", "named_buffers"):
        a = dict(getattr(fresh, named)(remove_duplicate=False))
        b = dict(getattr(cached, named)(remove_duplicate=False))
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype and a[name].device == b[name].device, name
            assert torch.equal(a[name], b[name]), name
            assert a[name].requires_grad == b[name].requires_grad, name
    pairs = zip(fresh.named_modules(remove_duplicate=False), cached.named_modules(remove_duplicate=False))
    for (name, a), (_, b) in pairs:  # plain attributes too (sizes, slice bounds, training)
        plain = [k for k, v in vars(a).items() if not k.startswith("_") and not isinstance(v, torch.Tensor)
                 and not callable(v)]
        assert {k: getattr(a, k) for k in plain} == {k: getattr(b, k, None) for k in plain}, name
    assert fresh.config.to_dict() == cached.config.to_dict()
    assert fresh.generation_config.to_dict() == cached.generation_config.to_dict()


@pytest.mark.parametrize("arch, mode", [("llama", "int4"), ("qwen2", "int4"), ("llama", "int8"), ("qwen2", "int8"),
                                        ("gemma3_text", "int4"), ("phi3", "int4")])
def test_read_back_equals_freshly_quantized(tmp_path, monkeypatch, arch, mode):
    ckpt = _checkpoint(tmp_path / f"tiny-{arch}", arch)
    cache = tmp_path / "cache"
    fresh = load_quantized(str(ckpt), mode, cache=cache, progress=False)
    path = home(ckpt, cache) / file_name(mode)
    assert path.is_file() and path.parent.parent == cache / "quantized"
    _no_quantizing(monkeypatch)
    cached = load_quantized(str(ckpt), mode, cache=cache, progress=False)
    _assert_same(fresh.model, cached.model)
    assert not cached.model.training and cached.model.config._attn_implementation == "sdpa"
    if mode == "int4" and arch != "phi3":  # phi3's q/k/v are one projection already
        attn = cached.model.model.layers[0].self_attn
        assert isinstance(attn.q_proj, Int4Slice) and attn.q_proj.fused is attn.k_proj.fused is attn.v_proj.fused
        assert isinstance(attn.o_proj, Int4Linear)
    assert isinstance(cached.model.lm_head, Int8Linear)
    assert cached.model.lm_head.screen.bounds.shape == (4, cached.model.lm_head.out_features)  # read back too
    ids = torch.tensor([PROMPT])
    assert torch.equal(fresh.model(ids).logits, cached.model(ids).logits)
    # SelfSpecModel's lean step takes the modules' weights over: last.
    a = selfspec.SelfSpecModel(fresh.model, fresh.tokenizer, "fresh", dtype_name=mode)
    b = selfspec.SelfSpecModel(cached.model, cached.tokenizer, "cached", dtype_name=mode)
    assert a.generate(PROMPT, method="ar", max_new_tokens=20).tokens == \
        b.generate(PROMPT, method="ar", max_new_tokens=20).tokens


def test_api_load_reads_the_saved_model(tmp_path, monkeypatch):
    ckpt = _checkpoint(tmp_path / "tiny-qwen2", "qwen2")
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    fresh = selfspec.load(str(ckpt), dtype="int4", progress=False)
    _no_quantizing(monkeypatch)
    cached = selfspec.load(str(ckpt), dtype="int4", progress=False)
    _assert_same(fresh.hf_model, cached.hf_model)
    assert fresh.generate(PROMPT, method="ar", max_new_tokens=12).tokens == \
        cached.generate(PROMPT, method="ar", max_new_tokens=12).tokens


def test_another_key_or_changed_checkpoint_quantizes_again(tmp_path, monkeypatch):
    ckpt = _checkpoint(tmp_path / "tiny", "llama")
    cache = tmp_path / "cache"
    load_quantized(str(ckpt), "int8", cache=cache, progress=False)
    path = home(ckpt, cache) / file_name("int8")
    real_key = quantized_cache.key
    monkeypatch.setattr(quantized_cache, "key", lambda *a: {**real_key(*a), "quantizer": "changed"})
    calls = []
    real = quantized_cache.QUANTIZERS["int8"]
    monkeypatch.setitem(quantized_cache.QUANTIZERS, "int8", lambda m: calls.append(1) or real(m))
    load_quantized(str(ckpt), "int8", cache=cache, progress=False)
    assert calls == [1]
    load_quantized(str(ckpt), "int8", cache=cache, progress=False)  # the rewritten file now matches
    assert calls == [1]
    monkeypatch.setattr(quantized_cache, "key", real_key)
    _checkpoint(ckpt, "llama")  # saved again: new file times, another home
    assert home(ckpt, cache) != path.parent
    load_quantized(str(ckpt), "int8", cache=cache, progress=False)
    assert calls == [1, 1]


def test_an_unwritable_cache_still_loads(tmp_path, monkeypatch):
    ckpt = _checkpoint(tmp_path / "tiny", "llama")

    def refuse(*args, **kwargs):
        raise PermissionError("read-only")

    monkeypatch.setattr(quantized_cache, "write", refuse)
    loaded = load_quantized(str(ckpt), "int4", cache=tmp_path / "cache", progress=False)
    assert isinstance(loaded.model.lm_head, Int8Linear)


def _fake_gguf_conversion(tmp_path, monkeypatch, arch="llama"):
    """A .gguf path whose conversion writes a tiny checkpoint (in the weights' dtype asked) and
    the marker, as convert_gguf does; returns (gguf path, list of the dtypes converted to)."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"x")
    calls = []

    def convert(gguf, target, *, label=None, progress=True, stop_tokens=(), weights=torch.bfloat16):
        calls.append(weights)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = tmp_path / "partial"
        _checkpoint(partial, arch, dtype=weights)
        (partial / CACHE_MARKER).write_text(json.dumps({"format": CACHE_FORMAT}))
        if loading.is_converted(target):
            loading._move_weights(partial, target)
        else:
            loading._replace_dir(partial, target)
        return target

    monkeypatch.setattr(loading, "convert_gguf", convert)
    return gguf, calls


def test_quantized_load_of_a_gguf_keeps_no_dense_weights(tmp_path, monkeypatch):
    gguf, calls = _fake_gguf_conversion(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    fresh = load_quantized(str(gguf), "int4", cache=cache, progress=False)
    target = loading.conversion_target(str(gguf), cache)
    assert fresh.path == target and calls == [torch.bfloat16]
    assert stored_dtype(target) is None and (target / file_name("int4")).is_file()
    assert (target / "config.json").is_file() and (target / "tokenizer.json").is_file()
    _no_quantizing(monkeypatch)
    cached = load_quantized(str(gguf), "int4", cache=cache, progress=False)
    assert calls == [torch.bfloat16]  # nothing converted
    _assert_same(fresh.model, cached.model)
    # A dense load afterwards adds the weights, and keeps the quantized file.
    loading.load_hf(str(gguf), dtype=torch.bfloat16, cache=cache, progress=False)
    assert calls == [torch.bfloat16, torch.bfloat16] and stored_dtype(target) == torch.bfloat16
    assert (target / file_name("int4")).is_file()


def test_dense_weights_stay_when_a_dense_load_wrote_them(tmp_path, monkeypatch):
    gguf, calls = _fake_gguf_conversion(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    loading.load_hf(str(gguf), dtype=torch.bfloat16, cache=cache, progress=False)
    load_quantized(str(gguf), "int8", cache=cache, progress=False)
    target = loading.conversion_target(str(gguf), cache)
    assert calls == [torch.bfloat16] and stored_dtype(target) == torch.bfloat16


def test_stored_weights_serve_the_dtypes_they_load_exactly_in(tmp_path, monkeypatch):
    """bfloat16 weights serve bfloat16 loads only; float32 and float16 loads convert to float32,
    which then serves every dtype."""
    gguf, calls = _fake_gguf_conversion(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    target = resolve_checkpoint(str(gguf), cache=cache, dtype=torch.bfloat16)
    assert stored_dtype(target) == torch.bfloat16 and calls == [torch.bfloat16]
    resolve_checkpoint(str(gguf), cache=cache, dtype=torch.bfloat16)
    assert calls == [torch.bfloat16]
    resolve_checkpoint(str(gguf), cache=cache, dtype=torch.float16)
    assert stored_dtype(target) == torch.float32 and calls == [torch.bfloat16, torch.float32]
    for dtype in (torch.bfloat16, torch.float32, torch.float16, None):
        resolve_checkpoint(str(gguf), cache=cache, dtype=dtype)
    assert len(calls) == 2
    assert sorted(p.name for p in cache.iterdir()) == [target.name]  # no partial or old directory left


def test_an_older_cache_format_converts_again(tmp_path, monkeypatch):
    gguf, calls = _fake_gguf_conversion(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    target = loading.conversion_target(str(gguf), cache)
    _checkpoint(target, "llama")  # what the float32 converter wrote: no marker
    (target / "stale").write_text("")
    path = resolve_checkpoint(str(gguf), cache=cache, dtype=torch.bfloat16)
    assert path == target and calls == [torch.bfloat16] and loading.is_converted(target)
    assert stored_dtype(target) == torch.bfloat16 and not (target / "stale").exists()
    assert sorted(p.name for p in cache.iterdir()) == [target.name]


@pytest.mark.real
def test_smollm2_int4_cache_equals_quantizing_its_bfloat16_weights(tmp_path):
    """The bundled model end to end (two conversions, ~1 min on 2 cores): an int4 load keeps the
    int4 file and no dense weights; a later one equals int4 of a bfloat16 load, bit for bit."""
    from selfspec.model.quantize import quantize_int4

    load_quantized("smollm2", "int4", cache=tmp_path, progress=False)
    target = tmp_path / "SmolLM2-135M-Instruct"
    assert stored_dtype(target) is None and (target / file_name("int4")).is_file()
    cached = load_quantized("smollm2", "int4", cache=tmp_path, progress=False)
    dense = loading.load_hf("smollm2", dtype=torch.bfloat16, cache=tmp_path, progress=False)
    assert stored_dtype(target) == torch.bfloat16
    quantize_int4(dense.model)
    _assert_same(dense.model, cached.model)


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("arch", ["gemma3_text", "llama"])  # a tied embedding and an untied one
def test_the_embedding_is_stored_as_int8_rows_and_read_back_exactly(tmp_path, monkeypatch, mode, arch):
    from safetensors import safe_open

    from selfspec.model.quantize import EMBEDDING_INT8, dequantize_rows

    ckpt = _checkpoint(tmp_path / f"tiny-{arch}", arch)
    cache = tmp_path / "cache"
    dense = load_hf(str(ckpt), dtype=torch.bfloat16, progress=False).model.get_input_embeddings().weight.float()
    fresh = load_quantized(str(ckpt), mode, cache=cache, progress=False).model
    table = fresh.get_input_embeddings().weight
    tied = arch == "gemma3_text"
    with safe_open(str(home(ckpt, cache) / file_name(mode)), "pt") as f:
        stored = set(f.keys())
        prefix = "lm_head" if tied else "selfspec_embedding"  # a tied table is the head's, stored once
        q, scale = f.get_tensor(f"{prefix}.weight"), f.get_tensor(f"{prefix}.scale")
    assert "model.embed_tokens.weight" not in stored and "lm_head.weight" in stored
    assert ("selfspec_embedding.weight" in stored) == (not tied)
    assert q.dtype == torch.int8 and torch.equal(table, dequantize_rows(q, scale, torch.bfloat16))
    # each value within an int8 step of its row (half a step, and the bfloat16 scale's rounding
    # times up to 127) plus the bfloat16 rounding of the result
    assert ((table.float() - dense).abs() <= scale.float()[:, None] + dense.abs() * 2**-7).all()
    # the rows stay in memory only as the head's own (an untied model's are dropped once saved)
    assert hasattr(fresh, EMBEDDING_INT8) == tied
    assert not tied or getattr(fresh, EMBEDDING_INT8)[0] is fresh.lm_head.weight
    _no_quantizing(monkeypatch)
    cached = load_quantized(str(ckpt), mode, cache=cache, progress=False).model
    assert torch.equal(cached.get_input_embeddings().weight, table) and hasattr(cached, EMBEDDING_INT8) == tied


@pytest.mark.parametrize("arch", ["gemma3_text", "llama"])  # a tied embedding and an untied one
def test_a_4bit_head_is_stored_with_the_embeddings_own_int8_rows(tmp_path, monkeypatch, arch):
    from safetensors import safe_open

    from selfspec.model.quantize import EMBEDDING_INT8, block_scales, dequantize_blocks, dequantize_rows, int8_rows

    ckpt = _checkpoint(tmp_path / f"tiny-{arch}", arch)
    cache = tmp_path / "cache"
    dense = load_hf(str(ckpt), dtype=torch.bfloat16, progress=False).model
    table, head_weight = dense.get_input_embeddings().weight, dense.lm_head.weight
    fresh = load_quantized(str(ckpt), "int4", cache=cache, progress=False, head="int4").model
    assert isinstance(fresh.lm_head, Int4Linear) and not hasattr(fresh, EMBEDDING_INT8)
    # the head: the bfloat16 head's 4-bit groups, each weight within one step of its group
    w = dequantize_blocks(fresh.lm_head.packed, fresh.lm_head.scales_zeros)
    step = block_scales(fresh.lm_head.scales_zeros, w.shape[1] // 32)[0].repeat_interleave(32, dim=1)
    assert ((w - head_weight.float()).abs() <= step * 0.51 + head_weight.float().abs() * 2**-7).all()
    # the embedding: its own int8 rows, as the int8 head's model has them (a tied table's too)
    q, scale = int8_rows(table, table.dtype)
    assert torch.equal(fresh.get_input_embeddings().weight, dequantize_rows(q, scale, torch.bfloat16))
    path = home(ckpt, cache) / "selfspec-int4-blocks-head4.safetensors"
    assert path == home(ckpt, cache) / file_name("int4", "int4")
    assert not (home(ckpt, cache) / file_name("int4")).exists()
    with safe_open(str(path), "pt") as f:
        assert {"selfspec_embedding.weight", "lm_head.packed"} <= set(f.keys())
    _no_quantizing(monkeypatch)
    cached = load_quantized(str(ckpt), "int4", cache=cache, progress=False, head="int4")
    _assert_same(fresh, cached.model)
    with pytest.raises(AssertionError, match="quantized again"):  # the int8 head's file is another
        load_quantized(str(ckpt), "int4", cache=cache, progress=False)
    with pytest.raises(ValueError, match="head"):
        load_quantized(str(ckpt), "int8", cache=cache, progress=False, head="int4")


def test_a_4bit_head_decodes_losslessly_and_its_draft_rows_are_its_own(tmp_path, monkeypatch):
    from selfspec.heads.draft_head import PrunedHead
    from selfspec.model.quantize import dequantize_blocks

    ckpt = _checkpoint(tmp_path / "tiny-qwen2", "qwen2")
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    model = selfspec.load(str(ckpt), dtype="int4", head="int4", progress=False)
    head = model.adapter.lm_head
    assert isinstance(head, Int4Linear)
    ids = torch.tensor([3, 40, 7])
    pruned = PrunedHead(model.adapter, ids)
    want = dequantize_blocks(head.packed, head.scales_zeros)[ids].bfloat16()
    assert torch.equal(pruned.weight, want) and pruned.built_for(model.adapter)
    prompt = PROMPT * 3
    ar = model.generate(prompt, method="ar", max_new_tokens=24).tokens
    for method in ("lookup", "suffix", "early-exit"):
        assert model.generate(prompt, method=method, max_new_tokens=24).tokens == ar, method
    with pytest.raises(ValueError, match="--dtype int4"):
        selfspec.load(str(ckpt), dtype="int8", head="int4", progress=False)
