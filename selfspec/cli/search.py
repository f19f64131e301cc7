"""`selfspec search`: the layer-skip set for this model, by Bayesian optimisation (selfspec.tools.search)."""

from __future__ import annotations

import json

from selfspec.cli.options import load, model_options


def add_parser(sub) -> None:
    s = sub.add_parser("search", help="find the layer-skip set for this model (Bayesian optimisation)",
                       description="Search, offline, which attention and MLP sublayers the layer-skip draft should "
                                   "skip: Bayesian optimisation of measured tokens/s on calibration prompts (Draft & "
                                   "Verify). Saves the best set to the model's profile, which `generate --method "
                                   "layer-skip` and `bench` then use.")
    s.add_argument("--prompts", default=None,
                   help="calibration prompts: JSONL (turns or prompt per row) or text (one per line); default: the "
                        "bundled calibration set (Spec-Bench questions not in the benchmark subset); 'code': the "
                        "bundled held-out code prompts")
    s.add_argument("--num-prompts", type=int, default=2, help="calibration prompts to use (default 2)")
    s.add_argument("--max-new-tokens", "-n", type=int, default=32, help="tokens per prompt per trial (default 32)")
    s.add_argument("--iterations", type=int, default=40, help="skip sets to measure (default 40; ~10 s each here)")
    s.add_argument("--draft-len", "-g", type=int, default=8, help="the most draft tokens per round (default 8)")
    s.add_argument("--threshold", type=float, default=0.8, help="initial adaptive stop threshold (default 0.8)")
    s.add_argument("--seed", type=int, default=0, help="seed of the optimiser (default 0)")
    s.add_argument("--output", default=None, help="profile file to write (default: the model's profile in the cache)")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    model_options(s, exact="time the trials in exact mode's fixed 4-row bucket (default: off, whatever the dtype)")


def run(args) -> int:
    from selfspec.drafters.layers.layer_skip import SECTION
    from selfspec.model.profiles import save_section
    from selfspec.tools.bench import load_prompts
    from selfspec.tools.search import search_skip_set

    if args.iterations < 1 or args.num_prompts < 1 or args.max_new_tokens < 1 or args.draft_len < 1:
        raise ValueError("--iterations, --num-prompts, --max-new-tokens and --draft-len must be >= 1")
    prompts = [p.text for p in load_prompts(args.prompts, 10**9, default="calibration.jsonl")][: args.num_prompts]
    model = load(args, exact=bool(args.exact), progress=not args.json)
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
