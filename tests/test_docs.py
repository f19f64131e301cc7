"""The user docs stay true: what README.md and docs/ name exists in the code, and the generated pages
are what their commands write now.

- every `--flag` the docs show exists in the parser (of the subcommand a `selfspec ...` line runs);
- every method they name is in the drafter registry, and the defaults serving.md tabulates are the
  parser's;
- docs/cli.md is what scripts/cli_doc.py writes, docs/performance.md and README's hardware table
  what scripts/performance.py writes from the committed results files;
- README.md is at most 300 lines, and neither it nor docs/ reads like a lab notebook.
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))  # docs/research/ is a dated report, checked for flags only
USER_DOCS = [README, *DOCS]
ALL_DOCS = [*USER_DOCS, *sorted((ROOT / "docs" / "research").glob("*.md"))]

# Flags of commands that are not selfspec's own, shown in the docs (setup script, helper scripts,
# Ray, pip, curl). A flag here that selfspec's parser also has is checked against the parser anyway.
OTHER_FLAGS = {
    "--with-qwen", "--with-qwen05", "--with-qwen15",  # scripts/setup.sh
    "--check",  # scripts/cli_doc.py, scripts/performance.py
    "--clients", "--requests", "--max-tokens",  # scripts/load_bench.py, scripts/soak.py
    "--head", "--port", "--address",  # ray start
    "--reuse", "--reuse-positions", "--reuse-long", "--heads", "--shipped-vocab", "--answers-only",  # feature_at_scale.py
    "--all",  # feature_heldout.py
    "--method",  # scripts/gpu_check.py profile
    "--mode", "--repeats",  # scripts/step_costs.py
}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_docs_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"_docs_{name}"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


cli_doc = _load("cli_doc")
performance = _load("performance")


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    return {name: p for name, _, p in cli_doc.subcommands(cli_doc.build_parser())}


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")}


def _code(text: str) -> tuple[list[str], list[str]]:
    """(lines of fenced code blocks, inline code spans) of a markdown text."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    lines = [line for b in blocks for line in b.splitlines()]
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return lines, re.findall(r"`([^`\n]+)`", prose)


def _prose(text: str) -> str:
    text = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]+`", "", text)


def _selfspec_commands(snippets: list[str]) -> list[tuple[str, list[str]]]:
    """(subcommand, flags) of every `selfspec SUB ...` invocation in code."""
    out = []
    for s in snippets:
        for m in re.finditer(r"(?:^|[\s/$;&(])selfspec ([a-z]+)((?: [^;|&#`\n]*)?)", s):
            out.append((m.group(1), re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2))))
    return out


@pytest.mark.parametrize("doc", ALL_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_flags_exist(doc, parsers):
    lines, spans = _code(doc.read_text())
    every = set().union(*(_flags(p) for p in parsers.values()))
    missing = []
    for sub, flags in _selfspec_commands(lines + spans):
        if sub not in parsers:
            missing.append(f"selfspec {sub} (no such subcommand)")
            continue
        missing += [f"selfspec {sub} {f}" for f in flags if f not in _flags(parsers[sub])]
    for span in spans:
        if re.search(r"(?:^|\s)selfspec [a-z]", span):
            continue  # checked per subcommand above
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", span):
            if flag not in every and flag not in OTHER_FLAGS:
                missing.append(flag)
    assert not missing, f"{doc.relative_to(ROOT)} names flags the parser does not have: {sorted(set(missing))}"


def test_documented_methods_exist():
    from selfspec.drafters import METHODS

    known = {"auto", "all", *METHODS}
    named = set()
    for doc in ALL_DOCS:
        text = doc.read_text()
        for m in re.finditer(r"--method[ =]([a-z][a-z0-9,-]*)", text):
            named.update(x for x in m.group(1).split(",") if x)
        # the first column of a method table ("| `--method` | ...")
        for table in re.findall(r"^\| `--method` \|.*?\n((?:\|.*\n)+)", text, flags=re.M):
            named.update(re.findall(r"^\| `([a-z-]+)` \|", table, flags=re.M))
    assert named, "no method found in the docs: the pattern is stale"
    assert named <= known, f"docs name methods the registry lacks: {sorted(named - known)}"
    tabled = set()
    for doc in (README, ROOT / "docs" / "methods.md"):
        for table in re.findall(r"^\| `--method` \|.*?\n((?:\|.*\n)+)", doc.read_text(), flags=re.M):
            tabled.update(re.findall(r"^\| `([a-z-]+)` \|", table, flags=re.M))
    assert set(METHODS) <= tabled, f"methods missing from the method tables: {sorted(set(METHODS) - tabled)}"


def test_serving_defaults_match_the_parser(parsers):
    text = (ROOT / "docs" / "serving.md").read_text()
    rows = re.findall(r"^\| `(--[a-z-]+)[^`]*` \| ([^|]+) \|", text, flags=re.M)
    assert len(rows) >= 5, "serving.md's limits table was not found"
    defaults = {s: a.default for a in parsers["serve"]._actions for s in a.option_strings}
    for flag, documented in rows:
        assert flag in defaults, f"serving.md documents {flag}, which `selfspec serve` lacks"
        assert float(documented) == float(defaults[flag]), \
            f"serving.md says {flag} defaults to {documented}; the parser says {defaults[flag]}"


def test_cli_md_is_current():
    expected = cli_doc.cli_md()
    actual = cli_doc.DOC.read_text() if cli_doc.DOC.exists() else ""
    assert actual == expected, f"docs/cli.md is stale: run {cli_doc.COMMAND}"


def test_performance_tables_are_current():
    sources = [src.path for s in performance.SECTIONS for src in s.sources] + [s.path for s in performance.SERVING]
    missing = [p for p in sources if not (ROOT / p).exists()]
    assert not missing, f"results files the performance tables read are missing: {missing}"
    if any(performance._git(p)[0] == "uncommitted" for p in sources):
        pytest.skip("no git history for the results files here (a shallow or exported checkout)")
    command = ".venv/bin/python scripts/performance.py"
    assert (ROOT / "docs" / "performance.md").read_text() == performance.performance_md(), \
        f"docs/performance.md is stale: run {command}"
    assert README.read_text() == performance.readme_with_table(README.read_text()), \
        f"README.md's hardware table is stale: run {command}"


def test_cited_files_exist():
    missing = []
    for doc in USER_DOCS:  # the dated research report may cite files kept only in git history
        for path in re.findall(r"(?<![\w/.])((?:results|scripts|selfspec|docs|tests)/[A-Za-z0-9_./*-]*[A-Za-z0-9_*])",
                               doc.read_text()):
            if not any(ROOT.glob(path)) and not any(doc.parent.glob(path)):
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, f"docs cite files that do not exist: {missing}"


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= 300, f"README.md has {lines} lines; at most 300 (move detail to docs/)"


NOTEBOOK = [
    (re.compile(r"\b(this|that|the next|next|previous|earlier|later|last|first|second) stop\b", re.I), "a development 'stop'"),
    (re.compile(r"\bstops? of 20\d\d|\bstop ?\d+\b", re.I), "a development 'stop'"),
    (re.compile(r"\bissues? #?\d+", re.I), "an issue number"),
    (re.compile(r"\bleases?\b", re.I), "a device lease"),
]


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_reads_as_a_user_guide(doc):
    text = doc.read_text()
    found = [f"{why}: {m.group(0)!r}" for pattern, why in NOTEBOOK for m in pattern.finditer(text)]
    found += [f"first person: {m.group(0)!r}" for m in re.finditer(r"(?<![\w'-])I(?= |'|’)", _prose(text))]
    assert not found, f"{doc.relative_to(ROOT)} reads like a lab notebook: {found}"
