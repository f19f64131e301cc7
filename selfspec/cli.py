"""The `selfspec` command: one entry point, subcommands `generate`, `tune`, `search`, `calibrate`, `bench`
and `calc`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

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


METHOD_HELP = (
    "how the draft is made: auto (default: what `selfspec tune` chose for this model, else early-exit), "
    "early-exit (layers < k), layer-skip (a skip set found by "
    "`selfspec search`, Draft & Verify), swift (layer set searched during decoding), clasp (layer set by "
    "dynamic programming per context), conflayers (confidence-adaptive skipping), lookup (copy from the "
    "prompt/output, no model), hybrid (lookup when it matches, else early exit), ar (no draft; the baseline)"
)


def _drafter_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threshold", type=float, default=None,
                   help="confidence stop: end a draft after a token whose draft top-1 probability is below this "
                        "(layer-skip: the starting value of its adaptive threshold; default per method, 0.8)")
    p.add_argument("--skip", default=None,
                   help="layer-skip's sublayers to skip, e.g. 'attn:3,5 mlp:10-14' or '10-19' (whole layers); "
                        "default: the model's profile from `selfspec search`")
    p.add_argument("--skip-ratio", type=float, default=None,
                   help="share of layers/sublayers swift, clasp and conflayers skip (default per method)")
    p.add_argument("--every", type=int, default=None,
                   help="rounds between clasp/conflayers re-optimisations; swift: iterations between "
                        "Bayesian proposals (default per method)")
    p.add_argument("--ngram", type=int, default=None, help="lookup/hybrid: longest n-gram to match (default 3)")
    p.add_argument("--profile", default=None,
                   help="a profile JSON file to use instead of this model's saved one (must match the model)")
    p.add_argument("--exit-adapter", default=None, metavar="FILE|none",
                   help="early exit's trained exit adapter (a .safetensors file from `selfspec calibrate`), or "
                        "'none' for plain early exit; default: the profile's adapter when its k is the one asked "
                        "(without -k, its k becomes the default)")


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
    g.add_argument("--method", default="auto", choices=["auto", *METHODS], help=METHOD_HELP)
    g.add_argument("--exit-layer", "-k", type=int, default=None,
                   help="exit layer k: the draft runs layers 0..k-1 (default: 3/4 of the model's depth)")
    g.add_argument("--draft-len", "-g", type=int, default=None,
                   help="draft length γ, tokens per round; the cap for adaptive methods (default: early-exit 4, "
                        "layer-skip 8, swift 25, others per method)")
    _drafter_options(g)
    g.add_argument("--max-new-tokens", "-n", type=int, default=128, help="most tokens to generate (default 128)")
    g.add_argument("--temperature", "-t", type=float, default=0.0, help="0 is greedy (default); > 0 samples")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens when sampling (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass when sampling, in (0, 1] (1: off)")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling, for repeatable output")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not included in the output")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the model's chat template (default: when the model has one)")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, statistics) instead")

    s = sub.add_parser("search", help="find the layer-skip set for this model (Bayesian optimisation)",
                       description="Search, offline, which attention and MLP sublayers the layer-skip draft should "
                                   "skip: Bayesian optimisation of measured tokens/s on calibration prompts (Draft & "
                                   "Verify). Saves the best set to the model's profile, which `generate --method "
                                   "layer-skip` and `bench` then use.")
    _model_options(s)
    s.add_argument("--prompts", default=None,
                   help="calibration prompts: JSONL (turns or prompt per row) or text (one per line); default: the "
                        "bundled calibration set (Spec-Bench questions not in the benchmark subset)")
    s.add_argument("--num-prompts", type=int, default=2, help="calibration prompts to use (default 2)")
    s.add_argument("--max-new-tokens", "-n", type=int, default=32, help="tokens per prompt per trial (default 32)")
    s.add_argument("--iterations", type=int, default=40, help="skip sets to measure (default 40; ~10 s each here)")
    s.add_argument("--draft-len", "-g", type=int, default=8, help="the most draft tokens per round (default 8)")
    s.add_argument("--threshold", type=float, default=0.8, help="initial adaptive stop threshold (default 0.8)")
    s.add_argument("--seed", type=int, default=0, help="seed of the optimiser (default 0)")
    s.add_argument("--output", default=None, help="profile file to write (default: the model's profile in the cache)")
    s.add_argument("--json", action="store_true", help="print the result as JSON")

    b = sub.add_parser("bench", help="benchmark AR, the drafters and transformers generate() on Spec-Bench prompts",
                       description="Run our AR, the chosen drafters and transformers' own greedy generate() (AR, "
                                   "its early exit at the first k and its prompt lookup, both at the first γ) on the "
                                   "same prompts in one process; print tokens/s, α, mean accepted length, c, speedups, "
                                   "peak memory and KV cache size per method and per category, and check every "
                                   "output against our AR.")
    _model_options(b)
    b.add_argument("--method", action="append", default=None,
                   help="drafter(s) to run, repeatable or comma-separated, or 'all' (default early-exit, with k "
                        "and γ from `selfspec tune` when it chose early exit); auto: the tuned choice; "
                        f"from: {', '.join(m for m in METHODS if m != 'ar')}")
    b.add_argument("--prompts", default=None,
                   help="Spec-Bench style JSONL (question_id, category, turns); default: the bundled subset "
                        "(first 5 per category group)")
    b.add_argument("--per-category", type=int, default=1, help="first N prompts of each category (default 1)")
    b.add_argument("--max-new-tokens", "-n", type=int, default=64, help="tokens per prompt (default 64)")
    b.add_argument("--exit-layer", "-k", type=int, action="append", default=None,
                   help="exit layer(s) to run, repeatable (default: 3/4 of depth)")
    b.add_argument("--draft-len", "-g", type=int, action="append", default=None,
                   help="draft length(s) to run, repeatable (default 4)")
    b.add_argument("--no-hf", action="store_true",
                   help="skip the transformers generate() references (AR, early exit, prompt lookup)")
    b.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON to this file")
    b.add_argument("--markdown", default=None, help="also write the results table as markdown to this file")
    c = sub.add_parser("calc", help="the analytic model: tokens per step, speedup, ceiling, best γ",
                       description="Expected tokens per step (1 - α^(γ+1)) / (1 - α), speedup = that / (γ·c + v) "
                                   "and the ceiling 1 / (1 - α), for every combination of the given values, and the "
                                   "best γ for each α, c, v. Values: a number, a comma list, or start:stop:step.")
    c.add_argument("--alpha", "-a", default="0.5:0.9:0.1", help="acceptance rate(s) α in [0, 1] (default 0.5:0.9:0.1)")
    c.add_argument("--draft-len", "-g", default="1,2,4,8", help="draft length(s) γ (default 1,2,4,8)")
    c.add_argument("--cost", "-c", default="0.25", help="draft cost(s) c, one draft token over one full forward "
                                                         "(default 0.25)")
    c.add_argument("--verify", "-v", default="1", help="verify cost(s) v, a verify over γ+1 positions over one "
                                                        "full one-token forward (default 1, the standard model)")
    cal = sub.add_parser(
        "calibrate", help="train a tiny exit adapter per exit layer so early exit drafts better (model frozen)",
        description="Generate the model's own greedy continuations of calibration prompts, teacher-force them "
                    "(plus any --text), and train for each exit layer k a small residual MLP that maps the "
                    "layer-k hidden state to the model's final one, by distillation (KL to the full model's "
                    "next-token distribution). The base model is frozen; the verify is unchanged, so output "
                    "stays the full model's. Reports α (agreement with the full model's next token, = first "
                    "draft token acceptance) on held-out prompts before and after, saves one .safetensors per k "
                    "and points the model's profile at the best, which generate, bench and the server then use.")
    _model_options(cal)
    cal.add_argument("--prompts", default=None,
                     help="JSONL (Spec-Bench style: turns or prompt per row) or text (one prompt per line); default: "
                          "the bundled training set (Spec-Bench questions outside the benchmark and tune sets)")
    cal.add_argument("--num-prompts", type=int, default=120, help="first N prompts of the file (default 120)")
    cal.add_argument("--text", action="append", default=[], metavar="FILE",
                     help="plain text to train on as well, in windows of 256 tokens (repeatable; training only)")
    cal.add_argument("--max-new-tokens", "-n", type=int, default=128,
                     help="tokens generated per prompt (default 128)")
    cal.add_argument("--exit-layer", "-k", type=int, action="append", default=None,
                     help="exit layer(s) to train, repeatable (default: 1/3 and 1/2 of the depth)")
    cal.add_argument("--steps", type=int, default=500,
                     help="optimiser steps per exit layer (default 500; about 0.35 s each for SmolLM2 on 2 idle "
                          "CPU cores)")
    cal.add_argument("--batch-size", type=int, default=256, help="positions per step (default 256)")
    cal.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate (default 3e-3)")
    cal.add_argument("--width", type=int, default=None,
                     help="adapter hidden width (default: the model's hidden size; parameters ≈ 2·hidden·width)")
    cal.add_argument("--holdout", type=float, default=0.1,
                     help="share of prompts held out for α, in (0, 1) (default 0.1)")
    cal.add_argument("--seed", type=int, default=0, help="seed of the split, initialisation and batches (default 0)")
    cal.add_argument("--output", default=None,
                     help="directory for the adapter files (default: beside the model's profile)")
    cal.add_argument("--json", action="store_true", help="print the result as JSON")

    t = sub.add_parser("tune", help="find the fastest k and γ for this model on this machine; --method auto uses it",
                       description="Decode the prompts with plain AR, read off exactly what each exit layer would draft "
                                   "(α by k and draft position), time c(k) and the verify cost v(k, n) here, predict the "
                                   "speedup of early exit at every (k, γ) and of prompt lookup at every γ, then time the "
                                   "best predictions against AR. The fastest measured configuration (or AR, if nothing "
                                   "beats it) is saved in the model's profile for `--method auto`; plots go to --plots.")
    _model_options(t)
    t.add_argument("--prompts", default=None,
                   help="JSONL (Spec-Bench style) or text file, one prompt per line; default: the bundled calibration "
                        "set (Spec-Bench questions that are not in the benchmark subset)")
    t.add_argument("--per-category", type=int, default=1, help="first N prompts of each category (default 1)")
    t.add_argument("--max-new-tokens", "-n", type=int, default=64, help="tokens per prompt (default 64)")
    t.add_argument("--exit-layer", "-k", action="append", default=None,
                   help="exit layers to predict, repeatable or comma-separated (default: 8 from 1/4 of depth to L-1)")
    t.add_argument("--max-draft-len", "-g", type=int, default=8, help="predict γ = 1 .. this (default 8)")
    t.add_argument("--check", type=int, default=3, help="best predictions to time against AR, plus the best of each family (default 3)")
    t.add_argument("--repeats", type=int, default=3, help="timings of each c and v, median kept (default 3)")
    t.add_argument("--no-lookup", action="store_true", help="leave prompt lookup out of the candidates")
    t.add_argument("--ngram", type=int, default=3, help="prompt lookup's longest n-gram (default 3)")
    t.add_argument("--plots", default="selfspec-tune", help="directory for the PNG plots (default ./selfspec-tune)")
    t.add_argument("--no-plots", action="store_true", help="do not draw plots")
    t.add_argument("--output", default=None, help="profile file to write (default: the model's profile in the cache)")
    t.add_argument("--json", dest="json_out", default=None, help="also write everything measured as JSON to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    warnings.formatwarning = lambda message, *_, **__: f"selfspec: note: {message}\n"
    if getattr(args, "cache_dir", None):
        os.environ["SELFSPEC_CACHE"] = args.cache_dir
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "search":
            return _search(args)
        if args.command == "calc":
            return _calc(args)
        if args.command == "tune":
            return _tune(args)
        if args.command == "calibrate":
            return _calibrate(args)
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
        top_p=args.top_p, seed=args.seed, stop=args.stop, chat=args.chat, threshold=args.threshold,
        skip=args.skip, skip_ratio=args.skip_ratio, every=args.every, ngram=args.ngram, profile=args.profile,
        exit_adapter=args.exit_adapter,
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
    if options["skip"] is not None:
        from selfspec.skips import SkipSet

        options["skip"] = SkipSet.parse(options["skip"])
    for name in ("every", "ngram"):
        if options[name] is not None and options[name] < 1:
            raise ValueError(f"--{name} must be >= 1, got {options[name]}")
    if options["skip_ratio"] is not None and not 0 < options["skip_ratio"] < 1:
        raise ValueError(f"--skip-ratio must be in (0, 1), got {options['skip_ratio']}")
    if options["draft_len"] is not None and options["draft_len"] < 1:
        raise ValueError(f"--draft-len must be >= 1, got {options['draft_len']}")
    if options["max_new_tokens"] < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {options['max_new_tokens']}")
    if options["exit_layer"] is not None and options["exit_layer"] < 1:
        raise ValueError(f"--exit-layer must be >= 1, got {options['exit_layer']}")


def _calc(args) -> int:
    from selfspec.calc import best_gamma, ceiling, expected_tokens, parse_values, speedup

    alphas, gammas = parse_values(args.alpha), parse_values(args.draft_len, int)
    costs, verifies = parse_values(args.cost), parse_values(args.verify)
    for a in alphas:
        ceiling(a)  # validates α before printing anything
    print("| α | γ | c | v | tokens/step | speedup | ceiling |")
    print("|---|---|---|---|---|---|---|")
    for a in alphas:
        for c in costs:
            for v in verifies:
                for g in gammas:
                    print(f"| {a:g} | {g} | {c:g} | {v:g} | {expected_tokens(a, g):.2f} | {speedup(a, g, c, v):.2f} | "
                          f"{ceiling(a):.2f} |")
    print()
    for a in alphas:
        for c in costs:
            for v in verifies:
                g = best_gamma(a, c, v)
                print(f"α {a:g}, c {c:g}, v {v:g}: best γ {g} ({speedup(a, g, c, v):.2f}×)"
                      + ("; drafting never pays" if g == 0 else ""))
    return 0


def _search(args) -> int:
    import selfspec
    from selfspec.bench import load_prompts
    from selfspec.drafters.layer_skip import SECTION
    from selfspec.profiles import save_section
    from selfspec.search import search_skip_set

    if args.iterations < 1 or args.num_prompts < 1 or args.max_new_tokens < 1 or args.draft_len < 1:
        raise ValueError("--iterations, --num-prompts, --max-new-tokens and --draft-len must be >= 1")
    prompts = [p.text for p in load_prompts(args.prompts, 10**9, default="calibration.jsonl")][: args.num_prompts]
    model = selfspec.load(args.model, dtype=args.dtype, device=args.device, progress=not args.json)
    result = search_skip_set(model, prompts, iterations=args.iterations, max_new_tokens=args.max_new_tokens,
                             draft_len=args.draft_len, threshold=args.threshold, seed=args.seed,
                             progress=not args.json)
    section = result.profile_section(draft_len=args.draft_len, threshold=args.threshold, prompts=len(prompts),
                                     max_new_tokens=args.max_new_tokens, dtype=args.dtype)
    path = save_section(model.identity, SECTION, section, args.output)
    if args.json:
        print(json.dumps({"model": model.name, "profile": str(path), **section}))
    else:
        b = result.best
        print(f"best skip set: {b.skip.describe()} ({len(b.skip)} of {2 * model.n_layers} sublayers)")
        print(f"  {b.tokens_per_s:.1f} tok/s vs AR {result.ar_tokens_per_s:.1f} tok/s ({result.speedup:.2f}×), "
              f"α {b.alpha if b.alpha is None else round(b.alpha, 2)}, c {b.cost if b.cost is None else round(b.cost, 2)}, "
              f"{len(result.trials)} sets measured on {len(prompts)} prompts × {args.max_new_tokens} tokens")
        print(f"saved to {path}")
    return 0


def _calibrate(args) -> int:
    import selfspec
    from selfspec.bench import load_prompts
    from selfspec.calibrate import calibrate, save

    for name in ("num_prompts", "max_new_tokens", "steps", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.width is not None and args.width < 1:
        raise ValueError(f"--width must be >= 1, got {args.width}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if not 0 < args.holdout < 1:
        raise ValueError(f"--holdout must be in (0, 1), got {args.holdout}")
    prompts = [p.text for p in load_prompts(args.prompts, 10**9, default="calibration_train.jsonl")][: args.num_prompts]
    texts = []
    for path in args.text:
        try:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        except OSError as err:
            raise FileNotFoundError(f"cannot read --text {path}: {err.strerror}") from None
    model = selfspec.load(args.model, dtype=args.dtype, device=args.device, progress=not args.json)
    result = calibrate(model, prompts, texts=texts, exit_layers=args.exit_layer, max_new_tokens=args.max_new_tokens,
                       steps=args.steps, batch_size=args.batch_size, lr=args.lr, width=args.width,
                       holdout=args.holdout, seed=args.seed, progress=not args.json)
    setup = dict(model=model.name, dtype=args.dtype, prompts=len(prompts),
                 prompt_source=args.prompts or "bundled calibration_train.jsonl", texts=len(texts),
                 max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    save(result, model.identity, args.output, setup)
    if args.json:
        print(json.dumps({"model": model.name, **setup, **result.to_json()}))
        return 0
    print(f"{model.name}, {args.dtype}; {len(prompts)} prompts × ≤{args.max_new_tokens} tokens"
          + (f" + {len(texts)} text file(s)" if texts else "")
          + f"; {result.train_positions} training positions ({result.train_outputs} in outputs, the rest in "
            f"prompts{' and text' if texts else ''}), {result.held_out_positions} held-out output positions; "
            f"data {result.data_seconds:.0f} s; {args.steps} steps × {args.batch_size} positions per k")
    print()
    print(result.table())
    print()
    for k, path in sorted(result.paths.items()):
        print(f"adapter k={k}: {path}")
    print(f"profile: {result.profile} (exit-adapter: k={result.best}, used by early exit at that k)")
    return 0


def _tune(args) -> int:
    import selfspec
    from selfspec.bench import load_prompts, machine
    from selfspec.profiles import save_section
    from selfspec.tuner import SECTION, tune
    from selfspec.tuner.plots import write_plots

    exit_layers = [int(k) for entry in (args.exit_layer or []) for k in entry.split(",") if k.strip()] or None
    for name in ("per_category", "max_draft_len", "repeats", "ngram"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_new_tokens < 2 or args.check < 0:
        raise ValueError("--max-new-tokens must be >= 2 and --check >= 0")
    prompts = load_prompts(args.prompts, args.per_category, default="calibration.jsonl")
    model = selfspec.load(args.model, dtype=args.dtype, device=args.device)
    result = tune(model, [p.text for p in prompts], max_new_tokens=args.max_new_tokens, exit_layers=exit_layers,
                  max_draft_len=args.max_draft_len, lookup=not args.no_lookup, ngram=args.ngram, check=args.check,
                  repeats=args.repeats)
    setup = dict(dtype=args.dtype, device=str(model.adapter.device.type), machine=machine(), prompts=len(prompts),
                 prompt_source=args.prompts or "bundled calibration set", max_new_tokens=args.max_new_tokens,
                 ngram=args.ngram)
    section = result.profile_section(**setup)
    path = save_section(model.identity, SECTION, section, args.output)
    print(f"{model.name}, {args.dtype} on {setup['device']}; {len(prompts)} prompts × {args.max_new_tokens} tokens; "
          f"{setup['machine']}; AR {result.ar_tokens_per_s:.1f} tok/s; one step {result.costs.step_s * 1e3:.1f} ms")
    print()
    print(result.table())
    print()
    best = result.best
    if best is None:
        print("nothing beat plain decoding in the timed check: --method auto will run AR")
    else:
        print(f"chosen: {best.label}, measured {best.measured:.2f}× AR (predicted {best.predicted:.2f}×), "
              f"output identical to AR on {best.identical} prompts")
    print(f"profile: {path}")
    if not args.no_plots:
        for png in write_plots(result, args.plots, f"{model.name}, {args.dtype}, {setup['device']}"):
            print(f"plot: {png}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"model": model.name, "profile": str(path), **section}, f, indent=2, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
