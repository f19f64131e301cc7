"""The `selfspec` command: one entry point, subcommands `generate` and `bench`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from selfspec.drafters import METHODS
from selfspec.loading import BUNDLED, DEFAULT_MODEL

MODEL_HELP = (
    f"bundled model name ({', '.join(BUNDLED)}; default {DEFAULT_MODEL}), a local Hugging Face checkpoint "
    "directory, or a .gguf file (converted once to safetensors in the cache)"
)


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, help=MODEL_HELP)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights and activations dtype (default float32); lossless is relative to AR in the same dtype")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    p.add_argument("--cache-dir", default=None,
                   help="where converted checkpoints live (default $SELFSPEC_CACHE, else $XDG_CACHE_HOME/selfspec, "
                        "else ~/.cache/selfspec)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="selfspec",
        description="Lossless self-speculative decoding: the model drafts with its first k layers and "
                    "verifies with one full forward on a shared KV cache. Output equals the full model's.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion, streaming it, then print statistics",
                       description="Generate a completion. The text streams to stdout; one line of statistics "
                                   "(tokens, tokens/s, α, accepted tokens per step, k, γ, c) follows on stderr.")
    g.add_argument("prompt", nargs="?", default=None, help="prompt text; '-' or nothing reads standard input")
    _model_options(g)
    g.add_argument("--method", default="early-exit", choices=list(METHODS),
                   help="early-exit: draft with layers < k (default); ar: plain autoregressive decoding, "
                        "the same engine without a draft, for comparison")
    g.add_argument("--exit-layer", "-k", type=int, default=None,
                   help="exit layer k: the draft runs layers 0..k-1 (default: 3/4 of the model's depth)")
    g.add_argument("--draft-len", "-g", type=int, default=4, help="draft length γ, tokens per round (default 4)")
    g.add_argument("--max-new-tokens", "-n", type=int, default=128, help="most tokens to generate (default 128)")
    g.add_argument("--temperature", "-t", type=float, default=0.0, help="0 is greedy (default); > 0 samples")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens when sampling (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass when sampling, in (0, 1] (1: off)")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling, for repeatable output")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not included in the output")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the model's chat template (default: when the model has one)")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, statistics) instead")

    b = sub.add_parser("bench", help="benchmark AR, early-exit and transformers generate() on Spec-Bench prompts",
                       description="Run our AR, early-exit for each (k, γ) and transformers' own greedy generate() "
                                   "on the same prompts in one process; print tokens/s, α, mean accepted length and "
                                   "speedups per method and per category, and check every output against our AR.")
    _model_options(b)
    b.add_argument("--prompts", default=None,
                   help="Spec-Bench style JSONL (question_id, category, turns); default: the bundled subset "
                        "(first 5 per category group)")
    b.add_argument("--per-category", type=int, default=1, help="first N prompts of each category (default 1)")
    b.add_argument("--max-new-tokens", "-n", type=int, default=64, help="tokens per prompt (default 64)")
    b.add_argument("--exit-layer", "-k", type=int, action="append", default=None,
                   help="exit layer(s) to run, repeatable (default: 3/4 of depth)")
    b.add_argument("--draft-len", "-g", type=int, action="append", default=None,
                   help="draft length(s) to run, repeatable (default 4)")
    b.add_argument("--no-hf", action="store_true", help="skip the transformers generate() reference")
    b.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON to this file")
    b.add_argument("--markdown", default=None, help="also write the results table as markdown to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.cache_dir:
        os.environ["SELFSPEC_CACHE"] = args.cache_dir
    try:
        if args.command == "generate":
            return _generate(args)
        from selfspec.bench import run_bench

        return run_bench(args)
    except (ValueError, ModuleNotFoundError, FileNotFoundError) as err:
        print(f"selfspec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _generate(args) -> int:
    import selfspec

    prompt = args.prompt
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise ValueError("the prompt is empty: give some text (or '-' to read standard input)")
    options = dict(
        method=args.method, exit_layer=args.exit_layer, draft_len=args.draft_len,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, stop=args.stop, chat=args.chat,
    )
    _check_options(options)
    model = selfspec.load(args.model, dtype=args.dtype, device=args.device, progress=not args.json)
    stream = model.stream(prompt, **options)
    for chunk in stream:
        if not args.json:
            print(chunk.text, end="", flush=True)
    result = stream.result
    if args.json:
        print(json.dumps({"model": model.name, "dtype": args.dtype, "text": result.text,
                          "tokens": result.tokens, "stats": result.stats.to_dict()}))
    else:
        print(flush=True)
        print(result.stats.summary(), file=sys.stderr)
    return 0


def _check_options(options: dict) -> None:
    """Cheap argument checks before the (slow) model load."""
    from selfspec.sampling import SamplingParams

    SamplingParams(temperature=options["temperature"], top_k=options["top_k"], top_p=options["top_p"])
    if options["draft_len"] < 1:
        raise ValueError(f"--draft-len must be >= 1, got {options['draft_len']}")
    if options["max_new_tokens"] < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {options['max_new_tokens']}")
    if options["exit_layer"] is not None and options["exit_layer"] < 1:
        raise ValueError(f"--exit-layer must be >= 1, got {options['exit_layer']}")


if __name__ == "__main__":
    sys.exit(main())
