"""`selfspec calibrate`: train a small draft head on the frozen model's own outputs: an exit adapter
or context head for early exit (selfspec.tools.calibrate, .context_calibrate), or the feature head
(selfspec.tools.feature_calibrate)."""

from __future__ import annotations

import json
import os

from selfspec.cli.options import load, model_options


def add_parser(sub) -> None:
    cal = sub.add_parser(
        "calibrate", help="train a small draft head on the frozen model's outputs: exit adapters (default) or "
                          "context heads for early exit, or the feature head",
        description="Generate the model's own greedy continuations of calibration prompts, teacher-force them "
                    "(plus any --text), and train for each exit layer k a small residual MLP that maps the "
                    "layer-k hidden state to the model's final one, by distillation (KL to the full model's "
                    "next-token distribution). The base model is frozen; the verify is unchanged, so output "
                    "stays the full model's. Reports α (agreement with the full model's next token, = first "
                    "draft token acceptance) on held-out prompts before and after, saves one .safetensors per k "
                    "and points the model's profile at the best, which generate, bench and the server then use. "
                    "Also ranks the tokens of the prompts and outputs by frequency, for --draft-vocab. "
                    "--head context and --head feature train the other heads instead.")
    cal.add_argument("--head", choices=("mlp", "context", "feature"), default="mlp",
                     help="what to train: 'mlp', the per-position exit adapter (default), or 'context', the "
                          "context head (Kangaroo-style: one small attention block over the context's exit states, "
                          "then the MLP; drafts stop early below --threshold 0.6 unless told otherwise); the "
                          "profile then points early exit at that k at it; or 'feature', the feature head "
                          "(EAGLE-style: drafts from the last verify's final states with no model layers; "
                          "--method feature; data from the engine's own greedy decoding, --train-vocab default 8192, "
                          "--steps default 2000)")
    cal.add_argument("--prompts", default=None,
                     help="JSONL (Spec-Bench style: turns or prompt per row) or text (one prompt per line); default: "
                          "the bundled training set (Spec-Bench questions outside the benchmark and tune sets); "
                          "'code': the bundled held-out code prompts")
    cal.add_argument("--num-prompts", type=int, default=120, help="first N prompts of the file (default 120)")
    cal.add_argument("--text", action="append", default=[], metavar="FILE",
                     help="plain text to train on as well, in windows of 256 tokens (--head feature: 512, teacher-forced "
                          "with no decoding) (repeatable; training only, never held out)")
    cal.add_argument("--max-new-tokens", "-n", type=int, default=128,
                     help="tokens generated per prompt (default 128)")
    cal.add_argument("--exit-layer", "-k", type=int, action="append", default=None,
                     help="exit layer(s) to train, repeatable (default: 1/3 and 1/2 of the depth)")
    cal.add_argument("--steps", type=int, default=None,
                     help="optimiser steps per exit layer (default 500, --head feature 2000; about 0.35 s each "
                          "for SmolLM2 on 2 idle CPU cores)")
    cal.add_argument("--batch-size", type=int, default=256,
                     help="positions per step (default 256); --head context: positions the loss is taken at, "
                          "drawn from --sequences whole sequences")
    cal.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate (default 3e-3)")
    cal.add_argument("--width", type=int, default=None,
                     help="adapter hidden width (default: the model's hidden size; parameters ≈ 2·hidden·width)")
    cal.add_argument("--holdout", type=float, default=0.1,
                     help="share of prompts held out for α, in (0, 1) (default 0.1)")
    cal.add_argument("--seed", type=int, default=0, help="seed of the split, initialisation and batches (default 0)")
    cal.add_argument("--output", default=None,
                     help="directory for the adapter files (default: beside the model's profile)")
    cal.add_argument("--generate-batch", type=int, default=32,
                     help="prompts generated together when making the data (default 32)")
    cal.add_argument("--json", action="store_true", help="print the result as JSON")
    model_options(cal)
    h = cal.add_argument_group("context and feature heads", "options of --head context and --head feature")
    h.add_argument("--heads", type=int, default=4,
                   help="--head context and feature: attention heads of 64 dimensions (default 4)")
    h.add_argument("--sequences", type=int, default=8,
                   help="--head context and feature: whole sequences per step, their every position context "
                        "(default 8)")
    h.add_argument("--train-vocab", type=int, default=None, metavar="N",
                   help="--head context and feature: train against a head pruned to the N most frequent tokens of "
                        "the data, as --draft-vocab N drafts (default: feature 8192; context the full head, or 32768 "
                        "when the vocabulary has more than 100k tokens, e.g. Gemma 3's 262k)")
    h.add_argument("--extra-prompts", default=None, metavar="FILE",
                   help="--head feature: more prompts (JSONL or text, like --prompts), decoded and trained on like "
                        "them but never held out, so α is measured on the same held-out split as without them "
                        "(e.g. scripts/synthetic_prompts.py's output)")
    h.add_argument("--samples", type=int, default=0,
                   help="--head feature: sampled continuations per prompt besides the greedy one, more training "
                        "text at the cost of more decoding (default 0)")
    h.add_argument("--noise", type=float, default=0.0,
                   help="--head feature: Gaussian noise (in RMS units) on the previous-state inputs in training "
                        "(default 0)")
    h.add_argument("--data", default=None, metavar="FILE",
                   help="--head feature: keep the decoded training data in FILE and reuse it on a later run with "
                        "the same model, prompts, -n, --samples and --seed (decoding is most of the time; "
                        "use it to try training settings); data made with --extra-prompts or --text also serves "
                        "the same run without them")


def run(args) -> int:
    from selfspec.tools.bench import load_prompts

    if args.steps is None:
        args.steps = 2000 if args.head == "feature" else 500
    for name in ("num_prompts", "max_new_tokens", "steps", "batch_size", "generate_batch", "heads", "sequences"):
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
    if args.train_vocab is not None and args.train_vocab < 1:
        raise ValueError(f"--train-vocab must be >= 1, got {args.train_vocab}")
    extra = []
    if args.extra_prompts is not None:
        if args.head != "feature":
            raise ValueError("--extra-prompts is for --head feature")
        if not os.path.isfile(args.extra_prompts):
            raise FileNotFoundError(f"cannot read --extra-prompts {args.extra_prompts}: no such file")
        extra = [p.text for p in load_prompts(args.extra_prompts, 10**9)]
    model = load(args, progress=not args.json)
    setup = dict(model=model.name, dtype=args.dtype, prompts=len(prompts),
                 prompt_source=args.prompts or "bundled calibration_train.jsonl", texts=len(texts),
                 max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    if args.head == "feature":
        setup["extra_prompts"] = len(extra)
        return run_feature(args, model, prompts, setup, texts, extra)
    return run_exit_head(args, model, prompts, setup, texts)


def run_exit_head(args, model, prompts: list[str], setup: dict, texts: list[str]) -> int:
    """--head mlp (exit adapters) or context (context heads): early exit's heads, one per k."""
    from selfspec.tools.calibrate import calibrate, save

    if args.head == "context":
        from selfspec.tools.context_calibrate import calibrate_context

        vocab = model.adapter.lm_head.out_features
        train_vocab = args.train_vocab if args.train_vocab is not None else (32768 if vocab > 100_000 else None)
        result = calibrate_context(model, prompts, texts=texts, exit_layers=args.exit_layer,
                                   max_new_tokens=args.max_new_tokens, steps=args.steps, sequences=args.sequences,
                                   positions=args.batch_size, lr=args.lr, width=args.width, heads=args.heads,
                                   holdout=args.holdout, seed=args.seed, train_vocab=train_vocab,
                                   generate_batch=args.generate_batch, progress=not args.json)
        setup.update(head="context", heads=args.heads, sequences=args.sequences, train_vocab=result.train_vocab)
    else:
        result = calibrate(model, prompts, texts=texts, exit_layers=args.exit_layer,
                           max_new_tokens=args.max_new_tokens, steps=args.steps, batch_size=args.batch_size,
                           lr=args.lr, width=args.width, holdout=args.holdout, seed=args.seed,
                           generate_batch=args.generate_batch, progress=not args.json)
    save(result, model.identity, args.output, setup)
    if args.json:
        print(json.dumps({"model": model.name, **setup, **result.to_json()}))
        return 0
    print(f"{model.name}, {model.dtype_name}; {len(prompts)} prompts × ≤{args.max_new_tokens} tokens"
          + (f" + {len(texts)} text file(s)" if texts else "")
          + f"; {result.train_positions} training positions ({result.train_outputs} in outputs, the rest in "
            f"prompts{' and text' if texts else ''}), {result.held_out_positions} held-out output positions; "
            f"data {result.data_seconds:.0f} s; {args.steps} steps × {args.batch_size} positions per k"
          + (f" (from {args.sequences} sequences)" if args.head == "context" else ""))
    print()
    print(result.table())
    print()
    kind = "context head" if args.head == "context" else "adapter"
    for k, path in sorted(result.paths.items()):
        print(f"{kind} k={k}: {path}")
    section = "context-head" if args.head == "context" else "exit-adapter"
    print(f"profile: {result.profile} ({section}: k={result.best}, used by early exit at that k)")
    if args.head == "context":
        print("α by draft position: held out, on the model's own greedy outputs, every output position a round's "
              "start, no γ cap or confidence stop")
    if result.draft_head_path is not None:
        from selfspec.heads.draft_head import coverage

        shares = ", ".join(f"{n}: {c:.1%}" for n, c in coverage(result.token_counts).items())
        print(f"draft-head ranking: {result.draft_head_path} (share of the counted tokens the top N cover: {shares}; "
              f"use with --draft-vocab N)")
    return 0


def run_feature(args, model, prompts: list[str], setup: dict, texts: list[str], extra: list[str]) -> int:
    """--head feature: the feature head, trained on the engine's own greedy decoding."""
    import torch

    from selfspec.tools import feature_calibrate

    train_vocab = 8192 if args.train_vocab is None else args.train_vocab
    if args.samples < 0 or args.noise < 0:
        raise ValueError("--samples and --noise must be >= 0")
    trained = feature_calibrate.calibrate_feature(
        model, prompts, max_new_tokens=args.max_new_tokens, samples=args.samples, noise=args.noise,
        texts=texts, extra_prompts=extra, steps=args.steps, sequences=args.sequences,
        positions=args.batch_size, lr=args.lr, width=args.width, heads=args.heads, draft_vocab=train_vocab,
        holdout=args.holdout, seed=args.seed, progress=not args.json, data_path=args.data)
    setup.update(head="feature", heads=args.heads, sequences=args.sequences, samples=args.samples, noise=args.noise,
                 train_vocab=int(trained.draft_ids.numel()))
    # stored in bfloat16 where the drafter runs it so (a bfloat16 or int4 model): half the file, same drafts
    stored = torch.bfloat16 if model.adapter.dtype == torch.bfloat16 else torch.float32
    path, profile = feature_calibrate.save(trained, model.identity, args.output, setup, dtype=stored)
    if args.json:
        print(json.dumps({"model": model.name, **setup, **trained.summary(), "path": str(path)}))
        return 0
    print(f"{model.name}, {model.dtype_name}; {len(prompts)} prompts × ≤{args.max_new_tokens} tokens"
          + (f" + {len(extra)} extra prompts (training only)" if extra else "")
          + (f" + {len(texts)} text file(s)" if texts else "") + f"; "
          f"{trained.train_positions} training positions, {trained.held_out_positions} held-out output positions; "
          f"data {trained.data_seconds:.0f} s, training {trained.seconds:.0f} s ({args.steps} steps); "
          f"{trained.head.n_params / 1e6:.2f}M parameters, draft head of {trained.draft_ids.numel()} tokens")
    print()
    print(feature_calibrate.table(trained))
    print()
    print("α by draft position: held out, on the model's own greedy outputs, every output position a round's start, "
          "the head drafting on its own predictions, no γ cap or confidence stop")
    print(f"feature head: {path}")
    print(f"profile: {profile} (feature-head: used by --method feature)")
    return 0
