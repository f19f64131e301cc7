"""The command line, run as a user would: a subprocess, its output and exit code."""

import json
import subprocess
import sys

import pytest


def selfspec(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "selfspec.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=600)


def test_help_explains_the_flags():
    out = selfspec("generate", "--help")
    assert out.returncode == 0
    for flag in ("--exit-layer", "--draft-len", "--max-new-tokens", "--temperature", "--top-k", "--top-p",
                 "--seed", "--chat", "--no-chat", "--method", "--json", "--dtype", "--model"):
        assert flag in out.stdout


@pytest.mark.parametrize("args, message", [
    (["generate", ""], "empty"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--draft-len", "0"], "draft-len"),
    (["generate", "hi", "--model", "no-such-model"], "unknown model"),
])
def test_bad_input_exits_2_with_a_message(args, message):
    out = selfspec(*args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def test_usage_errors_are_one_line():
    out = selfspec("generate", "hi", "--method", "bogus")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "invalid choice: 'bogus'" in out.stderr
    assert "see: selfspec generate --help" in out.stderr


@pytest.mark.real
def test_generate_streams_text_then_statistics():
    out = selfspec("generate", "What is the capital of France?", "-k", "20", "-g", "3", "-n", "16")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    stats = out.stderr.strip().splitlines()[-1]
    for field in ("tok/s", "α", "accepted/step", "k 20", "γ 3"):
        assert field in stats


@pytest.mark.real
def test_generate_json_matches_ar_and_reads_stdin():
    ee = json.loads(selfspec("generate", "-", "--json", "-n", "12", "-k", "12", stdin="Name a fruit.").stdout)
    ar = json.loads(selfspec("generate", "Name a fruit.", "--json", "-n", "12", "--method", "ar").stdout)
    assert ee["tokens"] == ar["tokens"] and ee["text"] == ar["text"]
    assert ee["stats"]["exit_layer"] == 12 and ee["stats"]["drafted"] > 0
    assert ar["stats"]["method"] == "ar" and ar["stats"]["drafted"] == 0


@pytest.mark.real
def test_bench_reports_every_method(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["What is 2+2?"]}) + "\n")
    report = tmp_path / "r.json"
    out = selfspec("bench", "--prompts", str(prompts), "-n", "8", "-k", "15", "-g", "2", "--json", str(report))
    assert out.returncode == 0, out.stderr
    data = json.loads(report.read_text())
    rows = {row["method"]: row for row in data["overall"]}
    assert list(rows) == ["ar (ours)", "early-exit k=15 γ=2", "transformers generate()",
                          "transformers early exit k=15 γ=2", "transformers prompt lookup γ=2"]
    assert all(row["identical_to_ar"] == "1/1" for row in rows.values())
    assert "| method |" in out.stdout and "| KV MiB |" in out.stdout and "qa" in data["per_category"]
    assert "command: selfspec bench --prompts" in data["setup"]
    assert all(row["peak_mib"] >= row["extra_mib"] >= 0 and row["kv_mib"] > 0 for row in rows.values())
    # One cache, γ + 1 positions longer than the text; transformers' early exit keeps a second one.
    assert rows["early-exit k=15 γ=2"]["kv_mib"] < rows["transformers early exit k=15 γ=2"]["kv_mib"]
    assert rows["transformers early exit k=15 γ=2"]["alpha"] is not None


@pytest.mark.real
def test_bench_runs_named_drafters(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "rag", "turns": ["Repeat: red, green, blue."]}) + "\n")
    report = tmp_path / "r.json"
    out = selfspec("bench", "--prompts", str(prompts), "-n", "8", "--method", "lookup,saguaro", "-k", "28",
                   "--no-hf", "--json", str(report))
    assert out.returncode == 0, out.stderr
    rows = json.loads(report.read_text())["overall"]
    assert [row["method"].split()[0] for row in rows] == ["ar", "lookup", "saguaro"]
    assert all(row["identical_to_ar"] == "1/1" for row in rows)
    bad = selfspec("bench", "--prompts", str(prompts), "--method", "magic")
    assert bad.returncode == 2 and "unknown method" in bad.stderr


def test_exit_layer_and_exact_draft_length_are_checked_before_the_model_loads(tmp_path):
    """The layer count comes from the checkpoint's config on disk; no model is loaded (this
    checkpoint has no tokenizer, so a load would fail with another message)."""
    from tiny_models import tiny_model

    tiny_model("llama").save_pretrained(tmp_path)
    out = selfspec("generate", "hi", "--model", str(tmp_path), "-k", "99")
    assert out.returncode == 2 and "exit layer must be in 1..6 for this model, got 99" in out.stderr
    out = selfspec("generate", "hi", "--model", str(tmp_path), "--dtype", "bfloat16", "-g", "40")
    from selfspec.api import exact_limit_here

    if exact_limit_here() is None:  # the fused layer's exact verify takes any draft length
        assert out.returncode != 0 and "draft length" not in out.stderr  # passes the check, then has no tokenizer
    else:
        assert out.returncode == 2 and "draft length must be at most" in out.stderr and "--no-exact" in out.stderr


def test_a_prompt_longer_than_the_context_is_refused_before_the_model_loads(tmp_path):
    """The config and tokenizer on disk are enough: this checkpoint has no weights, so a load
    would fail with another message."""
    from tiny_models import tiny_model, tiny_tokenizer

    tiny_model("llama").config.save_pretrained(tmp_path)  # max_position_embeddings 256
    tiny_tokenizer().save_pretrained(tmp_path)
    out = selfspec("generate", "w5 " * 300, "--model", str(tmp_path), "-n", "8")
    assert out.returncode == 2, out.stderr
    assert "the prompt (300 tokens before any chat template) + --max-new-tokens (8) exceeds the model's context of " \
           "256 tokens" in out.stderr
    short = selfspec("generate", "w5 " * 200, "--model", str(tmp_path), "-n", "8")
    assert short.returncode != 0 and "context" not in short.stderr  # passes the check, then has no weights to load
