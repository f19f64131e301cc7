"""The `selfspec` command: one entry point, one module per subcommand, each owning its parser and
its run function (`add_parser(sub)`, `run(args) -> int`); `options` holds what they share."""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from selfspec.cli import bench, calc, calibrate, generate, search, serve, train, tune
from selfspec.cli.options import Parser, print_error

# In the order `selfspec --help` lists them: using a model first, then measuring, then making drafters.
COMMANDS = {module.__name__.rsplit(".", 1)[1]: module
            for module in (generate, serve, tune, bench, calc, search, calibrate, train)}

DESCRIPTION = (
    "Lossless self-speculative decoding: the model drafts a few tokens cheaply from itself, with no second model, "
    "and verifies them with one full forward on a shared KV cache. Output equals the full model's. By default "
    "(--method auto) a model runs what `selfspec tune` measured fastest on this machine, else the choice shipped "
    "for it, else plain decoding: for the bundled SmolLM2 on a CPU with AVX-512 or AMX that is hybrid, prompt "
    "lookup when the context offers a match, else one token from its trained feature head."
)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: the top-level parser with every subcommand's."""
    parser = Parser(prog="selfspec", description=DESCRIPTION,
                    epilog="`selfspec COMMAND --help` explains each command's options, their units and defaults.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.formatwarning = lambda message, *_, **__: f"selfspec: note: {message}\n"
    if getattr(args, "cache_dir", None):
        os.environ["SELFSPEC_CACHE"] = args.cache_dir
    try:
        if hasattr(args, "threads"):
            from selfspec.model.threads import apply_threads

            note = apply_threads(args.threads)
            if note:
                print(f"selfspec: {note}", file=sys.stderr)
        return COMMANDS[args.command].run(args)
    except (ValueError, ModuleNotFoundError, FileNotFoundError) as err:
        print_error(str(err))
        return 2
    except KeyboardInterrupt:
        return 130


__all__ = ["build_parser", "main"]
