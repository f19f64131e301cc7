"""The benchmark's parts, on tiny random models: memory measurement, KV cache sizes, and the
transformers reference methods. The end-to-end runs on the real model are in test_cli.py."""

import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from selfspec import Speculation
from selfspec.tools import bench
from selfspec.model.cache import KVCache
from selfspec.tools.memory import MIB, MemoryUse, peak_memory
from tiny_models import COMMON

PROMPT = [5, 17, 33, 8, 61, 5, 17, 33, 12]
FLOAT32 = 4
# Bytes of keys and values of one position over all layers of a tiny model.
PER_POSITION = 2 * COMMON["num_hidden_layers"] * COMMON["num_key_value_heads"] * (
    COMMON["hidden_size"] // COMMON["num_attention_heads"]) * FLOAT32


def test_peak_memory_sees_a_held_and_a_freed_allocation():
    with peak_memory("cpu") as held:
        x = torch.ones(50_000_000)  # 200 MB, still alive when the block ends
    assert held.before > 0 and held.peak >= held.before
    assert held.extra >= 150 * MIB
    del x
    with peak_memory("cpu") as freed:  # gone before the block ends: only the polling thread sees it
        y = torch.ones(50_000_000)
        time.sleep(0.05)
        del y
    assert freed.extra >= 150 * MIB


def test_kv_cache_bytes_is_the_one_preallocated_cache(tiny):
    cache = KVCache(3, 2, 4, 10, dtype=torch.float32, device="cpu")
    assert cache.nbytes == cache.keys.nbytes + cache.values.nbytes
    model, n = tiny("llama"), 6
    for spec, gamma in ((Speculation("ar"), 0), (Speculation("early-exit", exit_layer=2, draft_len=3), 3)):
        stats = model.generate(PROMPT, speculation=spec, max_new_tokens=n).stats
        scratch = model.adapter.step is not None  # the lean step's slot for padding rows
        assert stats.kv_cache_bytes == (len(PROMPT) + n + gamma + 1 + scratch) * PER_POSITION


def args(k=None, g=None):
    return Namespace(exit_layer=k, draft_len=g)


class Model:
    def default_exit_layer(self):
        return 20


def test_hf_methods_build_the_generate_arguments_of_each_reference():
    ar, early, lookup = bench.hf_methods(args([20, 10], [3, 5]), Model())
    assert (ar.label, ar.hf_kwargs) == ("transformers generate()", {})
    assert early.label == "transformers early exit k=20 γ=3"
    assert early.hf_kwargs == {"assistant_early_exit": 20, "num_assistant_tokens": 3,
                               "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
    assert (lookup.label, lookup.hf_kwargs) == ("transformers prompt lookup γ=3", {"prompt_lookup_num_tokens": 3})
    # Without -k or -g: the model's default k, transformers' own γ for early exit, 10 for lookup.
    _, early, lookup = bench.hf_methods(args(), Model())
    assert early.hf_kwargs == {"assistant_early_exit": 20} and "default γ" in early.label
    assert lookup.hf_kwargs == {"prompt_lookup_num_tokens": 10}


def test_hf_references_match_our_ar_and_report_rounds_and_caches(tiny):
    model, n = tiny("llama"), 12
    ours = bench._run(model, bench.Method("ar", "ar"), torch.tensor(PROMPT), n)
    ar, early, lookup = (bench._run(model, m, torch.tensor(PROMPT), n)
                         for m in bench.hf_methods(args([2], [3]), model))
    assert ar.tokens == early.tokens == lookup.tokens == ours.tokens
    assert ar.stats is None  # no draft rounds to count
    assert ar.kv_bytes == (len(PROMPT) + n - 1) * PER_POSITION  # grown to the text; the last token is not fed
    assert early.stats.draft_len == 3 and early.stats.rounds > 0 and 0 < early.stats.drafted <= 3 * early.stats.rounds
    assert early.kv_bytes > ar.kv_bytes  # its draft keeps a second cache for layers < k
    assert lookup.stats.draft_len == 3 and lookup.kv_bytes == ar.kv_bytes
    # The model is left as it was: no settings or hooks stay behind.
    assert "_get_candidate_generator" not in vars(model.hf_model)
    assert model.hf_model.generation_config.num_assistant_tokens is None


def test_a_transformers_method_that_fails_is_dropped_with_a_note(tiny, capsys):
    model = tiny("llama")
    good = bench.Method("transformers generate()", "hf")
    bad = bench.Method("impossible", "hf", hf_kwargs={"prompt_lookup_num_tokens": -1})
    assert bench.warm_up(model, [good, bad], torch.tensor(PROMPT), 4) == [good]
    assert "dropping impossible" in capsys.readouterr().err
    with pytest.raises(ValueError):  # ours never fail quietly
        ours = bench.Method("ours", "early-exit", Speculation("early-exit", exit_layer=99))
        bench.warm_up(model, [ours], torch.tensor(PROMPT), 4)


def test_tally_keeps_the_most_memory_over_prompts():
    tally = bench.Tally()
    for peak, before, kv in ((300 * MIB, 100 * MIB, MIB), (250 * MIB, 50 * MIB, 2 * MIB)):
        run = bench.Run([1, 2], 0.5, None, kv)
        tally.add(run, True, MemoryUse(before=before, peak=peak))
    summary = tally.summary()
    assert (summary["peak_mib"], summary["extra_mib"], summary["kv_mib"]) == (300.0, 200.0, 2.0)
    assert summary["identical_to_ar"] == "2/2" and summary["tokens_per_s"] == 4.0


def test_decode_rate_leaves_out_each_prefill_and_its_token():
    """tok/s counts the prefill; the decode rate is the tokens after each run's first over the
    time after its prefill, the part a draft can speed up."""
    from selfspec.core.stats import GenerationStats

    tally = bench.Tally()
    assert tally.decode_tokens_per_s is None  # transformers' rows carry no engine stats
    for prefill, wall in ((1.0, 2.0), (3.0, 3.5)):
        stats = GenerationStats("ar", None, 0)
        stats.prefill_s, stats.wall_s = prefill, wall
        tally.add(bench.Run(list(range(11)), wall, stats, 0), True, MemoryUse(before=0, peak=0))
    assert tally.tokens_per_s == 22 / 5.5 and tally.decode_tokens_per_s == 20 / 1.5
    assert tally.summary()["decode_tokens_per_s"] == round(20 / 1.5, 3)


def test_bench_runs_what_tune_chose(tiny, tmp_path, monkeypatch):
    from selfspec.model.profiles import save_section

    monkeypatch.setenv("SELFSPEC_PROFILES", str(tmp_path))  # this test's profiles only
    model = tiny("llama")
    methods = lambda names, k=None, g=None: bench._methods(Namespace(method=names, exit_layer=k, draft_len=g), model)  # noqa: E731
    # No tune: auto is what generate runs then, the shipped choice or else AR (never an unmeasured draft).
    (auto,) = methods(["auto"])
    assert (auto.label, auto.method) == ("auto (no profile: ar)", "ar")
    shipped = {"method": "lookup", "exit_layer": None, "draft_len": 3, "measured": "1.4x"}
    monkeypatch.setattr("selfspec.api.shipped_choice", lambda identity, dtype, device="cpu": shipped)
    (auto,) = methods(["auto"])
    assert (auto.label, auto.method, auto.speculation.draft_len) == ("auto (shipped: lookup γ=3)", "lookup", 3)
    assert [m.label for m in methods(["all"])][0] == "early-exit k=4 γ=4"  # no tune: no auto row
    save_section(model.identity, "tune", {"method": "early-exit", "exit_layer": 2, "draft_len": 3})
    auto, early = methods(["auto,early-exit"])
    assert (auto.label, auto.method, auto.exit_layer, auto.speculation.draft_len) == ("auto (tuned: early-exit k=2 γ=3)",
                                                                          "early-exit", 2, 3)
    assert (early.label, early.exit_layer, early.speculation.draft_len) == ("early-exit k=2 γ=3 (tuned)", 2, 3)
    assert [(m.exit_layer, m.speculation.draft_len) for m in methods(["early-exit"], [5], [1])] == [(5, 1)]  # asked wins
    save_section(model.identity, "tune", {"method": "lookup", "exit_layer": None, "draft_len": 6})
    assert methods(["all"])[0].label == "auto (tuned: lookup γ=6)"


def test_llamacpp_reference_finds_the_gguf_and_says_how_to_install(monkeypatch):
    import builtins

    import tempfile

    from selfspec.tools.llamacpp_reference import LlamaCpp, gguf_file

    scratch = set(Path(tempfile.gettempdir()).glob("selfspec-gguf-*"))
    with gguf_file("smollm2") as path:
        assert path.suffix == ".gguf" and path.is_file()
    assert path.is_file()  # the packaged file itself, not a copy
    assert set(Path(tempfile.gettempdir()).glob("selfspec-gguf-*")) == scratch  # nothing left behind
    with pytest.raises(ValueError, match="needs a GGUF model"), gguf_file("/some/hf-checkpoint-dir"):
        pass
    real_import = builtins.__import__

    def no_llama_cpp(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ImportError("no llama_cpp here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama_cpp)
    with pytest.raises(ModuleNotFoundError, match="pip install llama-cpp-python"):
        LlamaCpp(path, threads=1)


def test_named_code_set_keeps_bench_and_held_out_apart():
    from selfspec.tools.bench import load_prompts

    bench = load_prompts("code", 4)
    held_out = load_prompts("code", 10**9, default="calibration.jsonl")
    assert len(bench) == 8 and {p.category for p in bench} == {"code_complete", "code_write"}
    assert len(held_out) == 4 and not {p.text for p in bench} & {p.text for p in held_out}
    assert [p.text for p in load_prompts("chat", 1)] == [p.text for p in load_prompts(None, 1)]


def test_sampled_bench_reports_alpha_and_marks_outputs_sampled(tiny, monkeypatch, capsys):
    """--temperature: every method samples with the prompt's seed; no transformers references,
    α and speedup reported, and '= AR' reads 'sampled' (samples, not AR's tokens)."""
    import selfspec

    model = tiny()
    fixed = torch.tensor([1, 5, 9, 2, 7, 3, 5, 9])
    monkeypatch.setattr(model, "encode", lambda text, *a, **kw: text if torch.is_tensor(text) else fixed)
    monkeypatch.setattr(selfspec, "load", lambda *a, **kw: model)
    args = Namespace(prompts="code", per_category=1, model=None, dtype=None, device="cpu", compile=None, exact=None,
                     method=["early-exit", "lookup"], exit_layer=[1], draft_len=[2], no_hf=False, max_new_tokens=12,
                     temperature=0.8, seed=3, json_out=None, markdown=None)
    assert bench.run_bench(args) == 0
    out = capsys.readouterr().out
    assert "sampled at temperature 0.8" in out and "HF" not in out.split("| method")[1].split("\n", 2)[2]
    rows = [line for line in out.splitlines() if line.startswith("| early-exit") or line.startswith("| lookup")]
    assert rows and all("| sampled |" in line for line in rows)


def test_repeats_run_every_prompt_again_and_sum(tiny, monkeypatch, capsys):
    """--repeats R: R rounds over the prompts, every method on each prompt in turn, the tallies
    summed ("= AR" counts R runs a prompt) and said in the setup line; R < 1 is refused before any
    model work."""
    import selfspec

    model = tiny()
    fixed = torch.tensor([1, 5, 9, 2, 7, 3, 5, 9])
    monkeypatch.setattr(model, "encode", lambda text, *a, **kw: text if torch.is_tensor(text) else fixed)
    monkeypatch.setattr(selfspec, "load", lambda *a, **kw: model)
    args = dict(prompts="code", per_category=1, model=None, dtype=None, device="cpu", compile=None, exact=None,
                method=["lookup"], exit_layer=None, draft_len=[2], no_hf=True, max_new_tokens=6, json_out=None,
                markdown=None)
    assert bench.run_bench(Namespace(**args, repeats=1)) == 0
    once = capsys.readouterr().out
    assert bench.run_bench(Namespace(**args, repeats=2)) == 0
    twice = capsys.readouterr().out
    count = lambda out: next(line for line in out.splitlines() if line.startswith("| lookup")).split("|")[-3].strip()  # noqa: E731
    n = int(count(once).split("/")[1])
    assert n >= 1 and count(once) == f"{n}/{n}" and count(twice) == f"{2 * n}/{2 * n}"
    assert "2 rounds over the prompts" in twice and "rounds over the prompts" not in once
    monkeypatch.setattr(selfspec, "load", lambda *a, **kw: pytest.fail("loaded a model for a bad --repeats"))
    with pytest.raises(ValueError, match="--repeats must be at least 1"):
        bench.run_bench(Namespace(**args, repeats=0))
