"""Code requests and plain code from the Python standard library on this machine, for training a
code model's feature head: `selfspec calibrate --head feature --prompts PROMPTS --text TEXT`.

- PROMPTS (JSONL, Spec-Bench shape): requests about functions of the standard library, in five
  kinds that rotate: complete a function from its signature and docstring, write a function a
  docstring describes, explain a function, write tests for it, add type hints and a docstring.
  The model's greedy answers to these are the training data the drafter must match; the
  calibrate run holds a share of them out (by prompt) for α.
- TEXT: the library's own source files, whole, each under a `# file:` line, teacher-forced in
  windows (the model's distribution over real code; no decoding needed).

The corpus is the CPython standard library (Python Software Foundation License 2.0, the
`LICENSE.txt` beside it), without its tests, IDLE, turtledemo, lib2to3's fixers' data and
site-packages. Nothing is downloaded; files are read in sorted order and the prompts shuffled with
a fixed seed, so the same Python gives the same files. None of the bundled code benchmark prompts
(`selfspec/data/code_bench.jsonl`, written for selfspec) comes from here.

    .venv/bin/python scripts/code_corpus.py --prompts /tmp/code_prompts.jsonl --text /tmp/stdlib.txt
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
import textwrap
from pathlib import Path

SKIP = {"test", "tests", "idlelib", "turtledemo", "site-packages", "lib2to3", "ensurepip", "__pycache__",
        "encodings", "pydoc_data", "unittest/test", "tkinter/test", "ctypes/test", "distutils/tests"}
KINDS = ("complete", "write", "explain", "test", "annotate")


def library() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def sources(root: Path) -> list[Path]:
    """The library's .py files in sorted order, less SKIP's directories."""
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in SKIP for p in parts[:-1]) or "/".join(parts[:2]) in SKIP or parts[-1].startswith("test_"):
            continue
        files.append(path)
    return files


def functions(path: Path, root: Path):
    """(module name, function source, its signature and docstring, the docstring, the source without
    its docstring) of public top-level and method functions of 4-40 lines with a docstring."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        length = node.end_lineno - node.lineno + 1
        if not doc or not 4 <= length <= 40 or len(doc) > 600 or node.decorator_list:
            continue
        source = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        body = node.body[1:]
        if not body:
            continue
        head = textwrap.dedent("\n".join(lines[node.lineno - 1:node.body[1].lineno - 1])).rstrip()
        if not head.endswith('"""') and not head.endswith("'''"):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        doc_node = node.body[0]
        bare = textwrap.dedent("\n".join(lines[node.lineno - 1:doc_node.lineno - 1] + lines[doc_node.end_lineno:node.end_lineno]))
        yield module, source, head, doc, bare


def request(kind: str, module: str, source: str, head: str, doc: str, bare: str) -> str:
    summary = doc.strip().split("\n\n")[0].replace("\n", " ")
    name = source.split("def ", 1)[1].split("(", 1)[0]
    code = f"```python\n{source}\n```"
    if kind == "complete":
        return f"Complete this Python function. Reply with the code only.\n\n```python\n{head}\n```"
    if kind == "write":
        return f"Write a Python function `{name}` ({module}): {summary} Add a short docstring."
    if kind == "explain":
        return f"Explain what this Python function from the {module} module does, step by step.\n\n{code}"
    if kind == "test":
        return f"Write pytest unit tests for this function.\n\n{code}"
    return ("Add type hints and a one-line docstring to this Python function. Reply with the code only."
            f"\n\n```python\n{bare}\n```")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", help="the JSONL of code requests to write")
    parser.add_argument("--text", help="the text file of library source to write")
    parser.add_argument("-n", "--num-prompts", type=int, default=1000, help="requests to write (default 1000)")
    parser.add_argument("--max-chars", type=int, default=2_000_000,
                        help="characters of source to write (default 2,000,000; whole files, in an order "
                             "shuffled by --seed so that a smaller cap still spans the library)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not args.prompts and not args.text:
        parser.error("give --prompts, --text or both")
    root = library()
    files = sources(root)
    rng = random.Random(args.seed)
    if args.prompts:
        found = [f for path in files for f in functions(path, root)]
        rng.shuffle(found)
        with open(args.prompts, "w", encoding="utf-8") as out:
            for i, (module, source, head, doc, bare) in enumerate(found[:args.num_prompts]):
                kind = KINDS[i % len(KINDS)]
                row = dict(question_id=f"stdlib-{i}", category=f"code_{kind}",
                           turns=[request(kind, module, source, head, doc, bare)], source=module)
                out.write(json.dumps(row) + "\n")
        print(f"{args.prompts}: {min(len(found), args.num_prompts)} requests from {len(found)} functions "
              f"of {len(files)} files under {root}")
    if args.text:
        order = list(files)
        random.Random(args.seed + 1).shuffle(order)
        total, kept = 0, 0
        with open(args.text, "w", encoding="utf-8") as out:
            for path in order:
                try:
                    text = path.read_text(encoding="utf-8").strip()
                except UnicodeDecodeError:
                    continue
                piece = f"# file: {path.relative_to(root)}\n{text}\n\n"
                if not text or total + len(piece) > args.max_chars:
                    continue
                out.write(piece)
                total, kept = total + len(piece), kept + 1
        print(f"{args.text}: {kept} files, {total:,} characters")


if __name__ == "__main__":
    main()
