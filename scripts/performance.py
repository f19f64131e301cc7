#!/usr/bin/env python3
"""Write docs/performance.md and README.md's "Will it help me?" table from the results files.

    .venv/bin/python scripts/performance.py           # rewrite both
    .venv/bin/python scripts/performance.py --check   # exit 1 if either differs from what it would write

Every figure comes from a `selfspec bench --markdown` (or `scripts/load_bench.py --markdown`) file
under results/. Each file's first line names the model, dtype, mode, prompts, token count, machine
and command; the table beside it gives k, γ, α and c per method. The commit and date are those of
the last git commit that added or changed the file (a move does not count) (the run is the code just before it). To update a figure,
re-run the command a table names with `--markdown` into the same path, commit it, and run this.
The machine classes and which file stands for each are listed in SECTIONS below.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
README_START = "<!-- performance:start (written by scripts/performance.py; do not edit) -->"
README_END = "<!-- performance:end -->"

# The columns shown, by the bench's own header names; a missing column reads "–".
COLUMNS = ["method", "k", "γ", "tok/s", "× our AR", "× AR, decode", "× HF", "α", "acc/step", "c", "= AR"]
LOAD_COLUMNS = ["speculation", "requests", "failed", "req/s", "tok/s", "TTFT p50 s", "latency p50 s",
                "latency p99 s", "α", "≠ 1 process", "requests per replica"]


@dataclass
class Source:
    path: str  # relative to the repository root
    caption: str  # what the table shows
    load: bool = False  # a scripts/load_bench.py table, not a bench one


@dataclass
class Section:
    title: str
    how_to_tell: str
    auto: str  # what `--method auto` runs there for SmolLM2 in bfloat16
    sources: list[Source] = field(default_factory=list)
    readme: str | None = None  # the source whose "auto" (or first speculative) row the README quotes
    llamacpp: str | None = None  # the source with a llama.cpp row, for "plain decoding × llama.cpp"
    readme_class: str | None = None  # short class name for the README table


SECTIONS = [
    Section(
        title="x86 CPU with AMX (Intel Xeon 4th generation and later)",
        readme_class="x86 CPU with AMX",
        how_to_tell="`lscpu` lists `amx_tile`",
        auto="`hybrid` γ ≤ 3: prompt lookup, else the feature head's two likeliest tokens as siblings",
        sources=[Source("results/intel/bench_llamacpp_bf16.md",
                        "SmolLM2, `auto` against plain decoding and llama.cpp on the same GGUF")],
        readme="results/intel/bench_llamacpp_bf16.md",
        llamacpp="results/intel/bench_llamacpp_bf16.md",
    ),
    Section(
        title="x86 CPU with AVX512-BF16 and no AMX (AMD EPYC Zen 4 and later, some Intel Xeon VMs)",
        readme_class="x86 CPU with AVX512-BF16, no AMX",
        how_to_tell="`lscpu` lists `avx512_bf16` but not `amx_tile`",
        auto="`hybrid` γ ≤ 3: prompt lookup, else one token from the feature head",
        sources=[
            Source("results/feature_head/bench_auto.md", "SmolLM2, `auto` and the feature head alone, 64 tokens"),
            Source("results/feature_head/bench_auto_n256.md",
                   "SmolLM2, 256 tokens (longer answers repeat themselves, so drafts are accepted more often)"),
            Source("results/fused/bench_llamacpp_bfloat16_exact.md",
                   "SmolLM2, plain decoding against llama.cpp on the same GGUF"),
            Source("results/bench_smollm2_fused/bench.md",
                   "SmolLM2, every method against transformers (the early-exit family untrained, at its defaults)"),
            Source("results/gpu_h200/scale/bench_auto_t0.7.md", "SmolLM2, `auto` under sampling, temperature 0.7"),
            Source("results/gpu_h200/scale/bench_auto_t1.0.md", "SmolLM2, `auto` under sampling, temperature 1.0"),
            Source("results/fused/bench_gemma3.md", "Gemma 3 270M (its `auto` is lookup γ ≤ 3)"),
            Source("results/qwen_groups/bench_code_q05b.md",
                   "Qwen2.5-Coder 0.5B in int4 (its default here: selfspec's 4-bit kernel) with its shipped feature head, "
                   "against llama.cpp, code prompts, γ ≤ 2 (its `auto`)"),
            Source("results/qwen_groups/bench_chat_q05b.md",
                   "Qwen2.5-Coder 0.5B in int4 against llama.cpp, chat prompts, γ ≤ 2 (its head was trained on code)"),
            Source("results/fused/bench_qwen05_code.md", "Qwen2.5-Coder 0.5B in bfloat16, code prompts (lookup γ ≤ 3)"),
            Source("results/qwen_coder_05b/bench_chat.md", "Qwen2.5-Coder 0.5B, chat prompts, every method"),
            Source("results/qwen_groups/bench_code_q15b.md",
                   "Qwen2.5-Coder 1.5B in int4 (its default here: selfspec's 4-bit kernel) with its shipped feature head, "
                   "against llama.cpp, code prompts, γ = 1 (its `auto`: a 2-row verify costs about one step here)"),
            Source("results/qwen_groups/bench_chat_q15b.md",
                   "Qwen2.5-Coder 1.5B in int4 against llama.cpp, chat prompts, γ = 1 (long prompts: the prefill is most of the time)"),
            Source("results/qwen_groups/bench_code_q15b_head4.md",
                   "Qwen2.5-Coder 1.5B in int4 with a 4-bit head (`--head-dtype int4`; greedy text can differ from the "
                   "int8 head's) against llama.cpp, code prompts"),
            Source("results/qwen_groups/bench_chat_q15b_head4.md",
                   "Qwen2.5-Coder 1.5B in int4 with a 4-bit head (`--head-dtype int4`) against llama.cpp, chat prompts"),
            Source("results/qwen_groups/bench_code_q05b_head4.md",
                   "Qwen2.5-Coder 0.5B in int4 with a 4-bit head (`--head-dtype int4`) against llama.cpp, code prompts"),
            Source("results/qwen_int4/bench_qwen15_int4pack.md",
                   "Qwen2.5-Coder 1.5B in int4 through PyTorch's int4 kernel (`SELFSPEC_INT4_LAYOUT=int4pack`) against llama.cpp"),
            Source("results/fused/bench_qwen15_code.md", "Qwen2.5-Coder 1.5B in bfloat16, code prompts (lookup γ ≤ 3)"),
            Source("results/qwen_coder_15b/bench_chat.md", "Qwen2.5-Coder 1.5B, chat prompts, every method"),
            Source("results/fused/bench_llamacpp_int8_noexact.md", "SmolLM2 in int8 against llama.cpp"),
            Source("results/qwen_int4/bench_smollm2_int4_blocks.md",
                   "SmolLM2 in int4 (the GGUF's own 4-bit grid, selfspec's 4-bit kernel) against llama.cpp"),
        ],
        readme="results/feature_head/bench_auto.md",
        llamacpp="results/fused/bench_llamacpp_bfloat16_exact.md",
    ),
    Section(
        title="x86 CPU with AVX-512 and no AVX512-BF16 (Intel Xeon Skylake-SP to Ice Lake)",
        readme_class="x86 CPU with AVX-512, no AVX512-BF16",
        how_to_tell="`lscpu` lists `avx512f` but not `avx512_bf16`",
        auto="`hybrid` γ ≤ 3: prompt lookup, else one token from the feature head",
        sources=[Source("results/intel_avx512/bench_repeats3.md", "SmolLM2, `auto` and its two parts, 3 rounds")],
        readme="results/intel_avx512/bench_repeats3.md",
    ),
    Section(
        title="x86 CPU with AVX2 only (AMD EPYC Zen 2 and 3, most laptops and desktops)",
        readme_class="x86 CPU with AVX2 only",
        how_to_tell="`lscpu` lists `avx2` but not `avx512f`",
        auto="plain decoding for SmolLM2 in bfloat16 (no draft beat it beyond noise); lookup γ ≤ 3 for Gemma 3",
        sources=[Source("results/amd_avx2/bench_bf16_evenodd.md",
                        "SmolLM2, the drafts `auto` would choose from, γ = 1: none pays reliably, so `auto` runs plain decoding"),
                 Source("results/amd_avx2/bench_gemma3_auto.md", "Gemma 3 270M, `auto` (lookup γ ≤ 3)")],
        readme=None,
    ),
    Section(
        title="NVIDIA GPU (measured on an H200)",
        readme_class="NVIDIA GPU (`--device cuda`)",
        how_to_tell="`nvidia-smi` lists it; pass `--device cuda`",
        auto="prompt lookup γ ≤ 3 (CUDA graphs and torch.compile on)",
        sources=[Source("results/gpu_h200/compiled_r2.md",
                        "SmolLM2, CUDA's defaults (exact mode, CUDA graphs, torch.compile), against transformers")],
        readme="results/gpu_h200/compiled_r2.md",
    ),
]

SERVING = [
    Source("results/serve/load_smollm2.md", "4 clients × 3 streamed chat requests, one process, speculation off and on "
           "(the clients' steps share forwards; drafts a batch does not pay for are dropped)", load=True),
    Source("results/serve/load_smollm2_1client.md", "1 client × 3 streamed chat requests", load=True),
    Source("results/serve/load_smollm2_replicas.md", "the same load on one process and on 1 and 2 Ray Serve replicas", load=True),
]

STEP_COSTS = [
    Source("results/qwen_int4/step_costs_qwen15.md", "Qwen2.5-Coder 1.5B, int4: `.venv/bin/python scripts/step_costs.py "
           "--model qwen2.5-coder-1.5b --dtype int4 --mode exact --repeats 31`", load=True),
    Source("results/qwen_int4/step_costs_qwen05.md", "Qwen2.5-Coder 0.5B, int4: `.venv/bin/python scripts/step_costs.py "
           "--model qwen2.5-coder-0.5b --dtype int4 --mode exact --repeats 31`", load=True),
]
HEADS = [  # (model, prompts, the feature_heldout.py results file)
    ("Qwen2.5-Coder 0.5B", "code (the 8 bundled code prompts)", "results/qwen_heads/heldout_code_q05b.json"),
    ("Qwen2.5-Coder 0.5B", "chat (the 30 bundled Spec-Bench prompts)", "results/qwen_heads/heldout_chat_q05b.json"),
    ("Qwen2.5-Coder 1.5B", "code (the 8 bundled code prompts)", "results/qwen_heads/heldout_code_q15b.json"),
]
AGENT = [Source("results/agent_bench/prefix_q05_int4_1client.md", "Qwen2.5-Coder 0.5B in int4, one client, with and "
                "without prefix reuse (`+prefix`: `selfspec serve --prefix-cache`, on by default for int4)", load=True),
         Source("results/agent_bench/prefix_q05_int4.md", "The same with four concurrent clients (the server batches "
                "their forwards, drafts cut to their likeliest tokens)", load=True),
         Source("results/agent_bench/prefix_smollm2_bf16_1client.md", "SmolLM2 in bfloat16, one client", load=True),
         Source("results/agent_bench/prefix_smollm2_bf16.md", "SmolLM2 in bfloat16, four concurrent clients", load=True)]


@dataclass
class Table:
    path: str
    setup: str
    header: list[str]
    rows: list[list[str]]
    commit: str
    date: str

    def column(self, row: list[str], name: str) -> str:
        return row[self.header.index(name)] if name in self.header else "–"

    def field(self, pattern: str, default: str = "?") -> str:
        m = re.search(pattern, self.setup)
        return m.group(1).strip() if m else default


def _git(path: str) -> tuple[str, str]:
    # --follow --diff-filter=AM: the commit that added or last changed the file, not one that only moved it
    out = subprocess.run(["git", "log", "--follow", "--diff-filter=AM", "-1", "--format=%H %ad", "--date=short", "--", path],
                         cwd=ROOT, capture_output=True, text=True).stdout.split()
    return (out[0][:7], out[1]) if len(out) == 2 else ("uncommitted", "uncommitted")


def read_table(path: str) -> Table:
    lines = (ROOT / path).read_text().splitlines()
    setup = lines[0].removeprefix("Setup: ")
    start = next(i for i, line in enumerate(lines) if line.startswith("| "))
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]
    header = cells(lines[start])
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(cells(line))
    return Table(path, setup, header, rows, *_git(path))


def describe(t: Table) -> str:
    """One line: model, dtype and mode, prompts, tokens, rounds, machine, date, commit, command."""
    model = t.field(r"model ([^,;]+?)(?: \(\d+ layers\))?[,;]")
    dtype = t.field(r"layers\), ([a-z0-9]+),")
    mode = "exact" if ", exact," in t.setup else ("compiled" if "compiled" in t.setup else "not exact")
    prompts = t.field(r"(\d+ Spec-Bench prompts \(\d+ per category)") + ")"
    prompt_set = t.field(r"per category: [^;]*; ([a-z ]+)\)")
    prompts = prompts.replace("Spec-Bench prompts", "code prompts" if prompt_set == "code" else "Spec-Bench prompts")
    tokens = t.field(r"max (\d+) new tokens")
    rounds = t.field(r"; (\d+) rounds over the prompts", "1")
    sampling = t.field(r"(temperature [0-9.]+)", "greedy")
    machine = t.field(r"machine: ([^;]+?)(?:; command|$)")
    device = t.field(r"device (cpu|cuda)", "cpu")
    command = t.field(r"command: (.+)$")
    command = re.sub(r" --(json|markdown) \S+", "", command)
    return (f"{model}, {dtype}, {mode}, device {device}; {prompts} × {tokens} tokens, {sampling}, "
            f"{rounds} round{'s' if rounds != '1' else ''}; machine: {machine}; "
            f"committed {t.date} in `{t.commit}`; `{command}`; file: [`{t.path}`](../{t.path})")


def describe_load(t: Table) -> str:
    return f"{t.setup}; committed {t.date} in `{t.commit}`; file: [`{t.path}`](../{t.path})"


def markdown_table(t: Table, columns: list[str]) -> list[str]:
    cols = [c for c in columns if c in t.header and (c in ("method", "k", "γ")
                                                     or any(t.column(r, c) not in ("–", "") for r in t.rows))]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(t.column(r, c) for c in cols) + " |" for r in t.rows]
    return out


def _row(t: Table, prefix: str) -> list[str] | None:
    return next((r for r in t.rows if r[0].startswith(prefix)), None)


def readme_table() -> list[str]:
    out = ["| your hardware | how to tell | `auto` runs (SmolLM2) | `auto` × plain decoding | "
           "plain decoding × llama.cpp | measured (source) |",
           "|---|---|---|---|---|---|"]
    for s in SECTIONS:
        speed, alpha, src = "1.00 (no draft paid)", "", []
        if s.readme:
            t = read_table(s.readme)
            auto = _row(t, "auto") or t.rows[1]
            speed = f"**{float(t.column(auto, '× our AR')):.2f}×** (α {t.column(auto, 'α')})"
            src.append(f"[{t.date}](docs/performance.md), `{t.path}`")
        elif s.sources:
            t = read_table(s.sources[0].path)
            src.append(f"[{t.date}](docs/performance.md), `{t.path}`")
        llama = "not measured"
        if s.llamacpp:
            t = read_table(s.llamacpp)
            ar, lc = _row(t, "ar (ours)"), _row(t, "llama.cpp")
            llama = f"{float(t.column(ar, 'tok/s')) / float(t.column(lc, 'tok/s')):.2f}×"
            if s.llamacpp != s.readme:
                src.append(f"`{t.path}`")
        out.append(f"| {s.readme_class} | {s.how_to_tell} | {s.auto} | {speed} | {llama} | {'; '.join(src)} |")
    out.append("| anything else (ARM, no g++) | – | plain decoding in float32 (PyTorch's kernels) | not measured | "
               "not measured | – |")
    return out


INTRO = """\
# Performance

Every table on this page is written by `.venv/bin/python scripts/performance.py` from the results
files it names; nothing here is typed by hand. Each table's line above it gives the model, dtype
and mode, the prompts, the token count, the machine, the date and commit of the results file, and
the command that wrote it. "× our AR" is tokens per second over selfspec's own plain decoding in
the same run (prefill included); "× AR, decode" leaves out each prompt's prefill and first token;
"× HF" is over transformers' `generate()` on the same model object; "= AR" counts outputs
token-identical to plain decoding; α is the acceptance rate, c the draft's cost over one full
forward, "acc/step" the tokens committed per verify (bonus included). k is the exit layer (– when
no model layers draft) and γ the longest draft.

All CPU figures are from 2-core cloud VMs (KVM) with 2 threads and nothing else running unless the
line says otherwise; their memory bandwidth moves minute to minute, so treat differences of ±10%
between runs as noise. Runs with several rounds interleave the methods per prompt.

**Reproduce a table**: run the command on its line (add `--json FILE --markdown FILE` to write
the results), commit the file, and run `.venv/bin/python scripts/performance.py`. To measure your
own machine and prompts, `selfspec tune` picks and saves the fastest configuration and
`selfspec bench --method auto,lookup,feature` compares them against plain decoding.

**llama.cpp** rows run the same GGUF file SmolLM2 is converted from (its Q4_1 weights, so its
output differs from ours: "= AR" reads 0/6), through `selfspec bench --llamacpp`. **transformers**
rows run the same model object in the same dtype; its own kernels round differently, so its greedy
text departs from ours at near ties (the "near-tie divergences" in the files).
"""


def _tables(sources: list[Source], columns: list[str] | None = None) -> list[str]:
    """Each source's caption, its setup line and its table (`columns`, else all of the file's)."""
    out = []
    for src in sources:
        t = read_table(src.path)
        out += [f"**{src.caption}.** {describe_load(t)}", ""] + markdown_table(t, columns or t.header) + [""]
    return out


def heads_table() -> list[str]:
    """α by draft position of the shipped heads on prompts no training saw (scripts/feature_heldout.py)."""
    out = ["| model | prompts | output positions | α at draft position 1 | 2 | 3 | 4 | file |", "|---|---|---|---|---|---|---|---|"]
    for model, prompts, path in HEADS:
        if not (ROOT / path).exists():
            continue
        result = json.loads((ROOT / path).read_text())["shipped"]
        commit, date = _git(path)
        alphas = " | ".join(f"{a:.3f}" for a in result["alpha"])
        out.append(f"| {model} | {prompts} | {result['positions']} | {alphas} | [`{path}`](../{path}), {date} `{commit}` |")
    return out


def performance_md() -> str:
    out = [INTRO]
    for s in SECTIONS:
        out += [f"## {s.title}", "", f"How to tell: {s.how_to_tell}. `--method auto` runs: {s.auto}.", ""]
        for src in s.sources:
            t = read_table(src.path)
            out += [f"**{src.caption}.** {describe(t)}", ""] + markdown_table(t, COLUMNS) + [""]
    out += ["## What a step and a verify cost", "",
            "`scripts/step_costs.py` on an x86 CPU with AVX512-BF16 and no AMX: the weights one step reads, the memory "
            "floor (those bytes ÷ the measured read bandwidth), one decode step, h (the head's share of it), v(n) (an "
            "n-row forward ÷ one step) and c(k) (a draft through k layers ÷ one step; the linear model's estimate in "
            "brackets), context 128.", ""]
    out += _tables(STEP_COSTS)
    out += ["## The shipped feature heads", "",
            "Held-out α by draft position of the heads shipped for the Qwen2.5-Coder models (trained by "
            "`bash scripts/code_heads.sh MODEL` on standard-library code requests and source; none of these prompts "
            "was trained on): each prompt decoded greedily in int4 by the engine, then from every output position the "
            "head drafts on its own predictions while it agrees with the model; α at position j is the share of "
            "rounds whose j-th draft token is accepted given the ones before it were. Command: `.venv/bin/python "
            "scripts/feature_heldout.py code|chat shipped --all --model MODEL --dtype int4 --json FILE`; machine: "
            "AMD EPYC, 2 cores.", ""]
    out += heads_table() + [""]
    out += ["## Serving under load", "",
            "`scripts/load_bench.py` (see [serving](serving.md)): the server in-process on a loopback port, "
            "N concurrent streaming chat clients, greedy.", ""]
    out += _tables(SERVING, LOAD_COLUMNS)
    out += ["## Agent and code-assistant traffic", "",
            "`scripts/agent_bench.py`: multi-turn sessions that repeat system prompts and tool schemas, rewrite "
            "files they were shown, quote shared documents and retry, through the server; `suffix` drafts from "
            "every earlier request. One client is speculation's regime; with several, the server shares each step's "
            "forward among them (exact mode too), which already uses the rows a draft would add, and verifies only "
            "the draft tokens likely enough to pay for their rows: on these 2 cores plain decoding gains the most "
            "from batching.", ""]
    out += _tables(AGENT)
    return "\n".join(out).rstrip() + "\n"


def readme_with_table(text: str) -> str:
    start, end = text.index(README_START), text.index(README_END)
    return text[:start] + README_START + "\n" + "\n".join(readme_table()) + "\n" + text[end:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a file differs from what would be written")
    args = ap.parse_args()
    wanted = {DOC: performance_md(), README: readme_with_table(README.read_text())}
    stale = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} is stale: run .venv/bin/python scripts/performance.py", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(wanted[p])
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
