"""`selfspec generate`: one completion, streamed to stdout, then one line of statistics on stderr."""

from __future__ import annotations

import argparse
import json
import sys

from selfspec.cli.options import (advanced_options, check_model_options, check_options, engine_options, load,
                                  model_group, sampling_options, speculation, speculation_options)


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate a completion, streaming it, then print statistics",
                       usage="%(prog)s [-h] [-m MODEL] [--method METHOD] [-n N] [-t T] [--json] [options] [prompt]",
                       description="Generate a completion. The text streams to stdout; one line of statistics "
                                   "(tokens, tokens/s, α, accepted tokens per step, k, γ, c) follows on stderr.")
    g.add_argument("prompt", nargs="?", default=None, help="prompt text; '-' or nothing reads standard input")
    g.add_argument("--max-new-tokens", "-n", type=int, default=128, metavar="N",
                   help="most tokens to generate (default 128)")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, statistics) instead")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not included in the output")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the model's chat template (default: when the model has one)")
    model_group(g)
    sampling_options(g)
    speculation_options(g)
    engine_options(g)
    advanced_options(g)


def run(args) -> int:
    prompt = args.prompt
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise ValueError("the prompt is empty: give some text (or '-' to read standard input)")
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop=args.stop, chat=args.chat)
    check_options(options)
    spec = speculation(args)
    check_model_options(args, spec)
    check_prompt_length(args, prompt)
    model = load(args, progress=not args.json)
    stream = model.stream(prompt, speculation=spec, **options)
    for chunk in stream:
        if not args.json:
            print(chunk.text, end="", flush=True)
    result = stream.result
    if args.json:
        print(json.dumps({"model": model.name, "dtype": model.dtype_name, "exact": model.exact, "text": result.text,
                          "tokens": result.tokens, "stats": result.stats.to_dict()}))
    else:
        print(flush=True)
        print(result.stats.summary(), file=sys.stderr)
    return 0


def check_prompt_length(args, prompt: str) -> None:
    """Refuse, before the model loads, a prompt whose tokens alone (no chat template yet, so a
    lower bound) plus --max-new-tokens cannot fit the model's context. Needs the tokenizer and
    config on disk (a converted bundled model or a checkpoint directory); else the engine checks
    after loading."""
    from selfspec.model.loading import checkpoint_on_disk, peek_config

    root = checkpoint_on_disk(args.model, args.cache_dir)
    limit = peek_config(args.model, args.cache_dir).get("max_position_embeddings")
    if root is None or not isinstance(limit, int) or len(prompt.encode()) + args.max_new_tokens <= limit:
        return  # no tokenizer on disk, or too few bytes to overflow even at a token per byte
    try:
        from transformers import AutoTokenizer

        tokens = len(AutoTokenizer.from_pretrained(root)(prompt, add_special_tokens=False)["input_ids"])
    except (OSError, ValueError):
        return
    if tokens + args.max_new_tokens > limit:
        raise ValueError(f"the prompt ({tokens} tokens before any chat template) + --max-new-tokens "
                         f"({args.max_new_tokens}) exceeds the model's context of {limit} tokens; shorten the "
                         "prompt or lower --max-new-tokens")
