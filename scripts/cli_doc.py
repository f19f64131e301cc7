#!/usr/bin/env python3
"""Write docs/cli.md from selfspec's argparse parser, so the reference cannot drift from the code.

    .venv/bin/python scripts/cli_doc.py           # rewrite docs/cli.md
    .venv/bin/python scripts/cli_doc.py --check   # exit 1 if docs/cli.md is stale

The page is built from the parser's actions (flags, defaults, choices, help), not from
`format_help()`, whose layout changes between Python versions.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "cli.md"
COMMAND = ".venv/bin/python scripts/cli_doc.py"


def build_parser() -> argparse.ArgumentParser:
    sys.path.insert(0, str(ROOT))
    try:
        from selfspec.cli import build_parser as build
    except ImportError:  # before the CLI became a package
        from selfspec.cli import _build_parser as build
    return build()


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) for every subcommand, in the order the parser lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return [(name, helps.get(name, ""), p) for name, p in action.choices.items()]
    return []


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    names = action.option_strings
    if isinstance(action, argparse.BooleanOptionalAction):
        names = [n for n in names if not n.startswith("--no-")]
        names = [f"{n}/--no-{n[2:]}" for n in names]
    metavar = ""
    if action.nargs != 0 and not isinstance(action, argparse.BooleanOptionalAction):
        if action.choices is not None and action.metavar is None:
            metavar = " {" + ",".join(str(c) for c in action.choices) + "}"
        else:
            metavar = " " + str(action.metavar or action.dest.upper())
    return ", ".join(f"`{n}{metavar}`" for n in names)


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:
        params = dict(vars(action), prog=prog)
        if action.choices is not None:
            params["choices"] = ", ".join(str(c) for c in action.choices)
        try:
            text = text % params
        except (KeyError, TypeError, ValueError):
            pass
    return text


def _default(action: argparse.Action) -> str:
    d = action.default
    if d is None or d is argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
        return ""
    if isinstance(d, list):
        return "" if not d else " ".join(map(str, d))
    if (isinstance(action, argparse._StoreTrueAction) and d is False
            or isinstance(action, argparse._StoreFalseAction) and d is True):  # a bare switch: off, or on
        return ""
    return f"`{d}`"


def options_table(parser: argparse.ArgumentParser) -> list[str]:
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        title = group.title if group.title not in ("positional arguments", "options", "optional arguments") else None
        if title:
            out += [f"*{title}*" + (f": {_cell(group.description)}" if group.description else ""), ""]
        out += ["| option | default | description |", "|---|---|---|"]
        out += [f"| {_flags(a)} | {_default(a)} | {_cell(_help(a, parser.prog))} |" for a in actions]
        out.append("")
    return out


def cli_md() -> str:
    parser = build_parser()
    out = ["# Command-line reference", "",
           f"Generated from the parser by `{COMMAND}`; do not edit by hand. "
           "`selfspec SUBCOMMAND --help` prints the same.", "",
           _cell(parser.description or ""), ""]
    subs = subcommands(parser)
    out += ["| subcommand | what it does |", "|---|---|"]
    out += [f"| [`{name}`](#selfspec-{name}) | {_cell(help_)} |" for name, help_, _ in subs]
    out.append("")
    for name, _, sub in subs:
        out += [f"## selfspec {name}", "", _cell(sub.description or ""), ""]
        out += options_table(sub)
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md differs from what would be written")
    args = ap.parse_args()
    text = cli_md()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"docs/cli.md is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print("wrote docs/cli.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
