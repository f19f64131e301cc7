"""`selfspec tune`: measure which speculation is fastest for this model on this machine and save it
for `--method auto` (selfspec.tools.tune)."""

from __future__ import annotations

import json

from selfspec.cli.options import comma_ints, load, model_options


def add_parser(sub) -> None:
    t = sub.add_parser(
        "tune", help="find the fastest method, k and γ for this model on this machine; --method auto uses it",
        description="Decode the prompts with plain AR, read off exactly what each exit layer would draft (α by k and "
                    "draft position), time c(k) and the verify cost v(k, n) here, predict the speedup of early exit "
                    "at every (k, γ), of prompt lookup at every γ and, when the model has a feature head, of feature "
                    "and hybrid at every γ, then time the best predictions against AR. The fastest measured "
                    "configuration (or AR, if nothing beats it) is saved in the model's profile for `--method auto`; "
                    "plots go to --plots.")
    t.add_argument("--prompts", default=None,
                   help="JSONL (Spec-Bench style) or text file, one prompt per line; default: the bundled calibration "
                        "set (Spec-Bench questions that are not in the benchmark subset); 'code': the bundled "
                        "held-out code prompts (none of them in `bench --prompts code`)")
    t.add_argument("--per-category", type=int, default=1, help="first N prompts of each category (default 1)")
    t.add_argument("--max-new-tokens", "-n", type=int, default=64, help="tokens per prompt (default 64)")
    t.add_argument("--exit-layer", "-k", action="append", default=None,
                   help="exit layers to predict, repeatable or comma-separated (default: 8 from 1/4 of depth to L-1)")
    t.add_argument("--max-draft-len", "-g", type=int, default=8,
                   help="predict γ = 1 .. this (default 8; 3 in exact mode, the most its 4-row bucket holds)")
    t.add_argument("--check", type=int, default=3,
                   help="best predictions to time against AR, plus the best of each family (default 3)")
    t.add_argument("--repeats", type=int, default=3, help="timings of each c and v, median kept (default 3)")
    t.add_argument("--no-lookup", action="store_true", help="leave prompt lookup (and hybrid) out of the candidates")
    t.add_argument("--ngram", type=int, default=3, help="prompt lookup's longest n-gram (default 3)")
    t.add_argument("--plots", default="selfspec-tune", help="directory for the PNG plots (default ./selfspec-tune)")
    t.add_argument("--no-plots", action="store_true", help="do not draw plots")
    t.add_argument("--output", default=None, help="profile file to write (default: the model's profile in the cache)")
    t.add_argument("--json", dest="json_out", default=None, help="also write everything measured as JSON to this file")
    model_options(t)


def run(args) -> int:
    from selfspec.api import EXACT_ROWS
    from selfspec.model.profiles import save_section
    from selfspec.tools.bench import load_prompts, machine
    from selfspec.tools.tune import SECTION, tune
    from selfspec.tools.tune.plots import write_plots

    exit_layers = comma_ints(args.exit_layer) or None
    for name in ("per_category", "max_draft_len", "repeats", "ngram"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_new_tokens < 2 or args.check < 0:
        raise ValueError("--max-new-tokens must be >= 2 and --check >= 0")
    prompts = load_prompts(args.prompts, args.per_category, default="calibration.jsonl")
    model = load(args)
    if model.exact:  # tuned choices stay within the padded bucket every path verifies exactly (3 drafts)
        args.max_draft_len = min(args.max_draft_len, EXACT_ROWS - 1)
    result = tune(model, [p.text for p in prompts], max_new_tokens=args.max_new_tokens, exit_layers=exit_layers,
                  max_draft_len=args.max_draft_len, lookup=not args.no_lookup, ngram=args.ngram, check=args.check,
                  repeats=args.repeats)
    setup = dict(dtype=model.dtype_name, device=str(model.adapter.device.type), compile=model.compile, exact=model.exact,
                 machine=machine(), prompts=len(prompts),
                 prompt_source=args.prompts or "bundled calibration set", max_new_tokens=args.max_new_tokens,
                 ngram=args.ngram)
    section = result.profile_section(**setup)
    path = save_section(model.identity, SECTION, section, args.output)
    print(f"{model.name}, {model.dtype_name} on {setup['device']}; {len(prompts)} prompts × {args.max_new_tokens} tokens; "
          f"{setup['machine']}; AR {result.ar_tokens_per_s:.1f} tok/s; one step {result.costs.step_s * 1e3:.1f} ms")
    print()
    print(result.table())
    print()
    print(f"step: {result.roofline.summary()}")
    v = result.costs.verify[0]
    print("v(n), a verify over n positions in one-token steps: "
          + ", ".join(f"v({n}) {v[n]:.2f}" for n in sorted(v)))
    best = result.best
    if best is None:
        print("nothing beat plain decoding in the timed check: --method auto will run AR")
    else:
        print(f"chosen: {best.label}, measured {best.measured:.2f}× AR (predicted {best.predicted:.2f}×), "
              f"output identical to AR on {best.identical} prompts")
    print(f"profile: {path}")
    if not args.no_plots:
        for png in write_plots(result, args.plots, f"{model.name}, {model.dtype_name}, {setup['device']}"):
            print(f"plot: {png}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"model": model.name, "profile": str(path), **section}, f, indent=2, ensure_ascii=False)
    return 0
