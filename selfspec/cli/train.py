"""`selfspec train`: fine-tune the model with the LayerSkip recipe (selfspec.tools.train) and save
a new checkpoint that every other subcommand takes as --model."""

from __future__ import annotations

import json

from selfspec.cli.options import comma_ints, load, model_options


def add_parser(sub) -> None:
    tr = sub.add_parser(
        "train", help="fine-tune the model with the LayerSkip recipe (layer dropout + early-exit loss) so early "
                      "exits draft better; saves a new checkpoint",
        description="LayerSkip (Elhoushi et al. 2024): fine-tune every weight with layer dropout (rate rising with "
                    "depth to --p-max at the last layer) and an early-exit loss (the model's own final norm and LM "
                    "head at the exits chosen by --curriculum, weighted up with depth). Trains on --data, or by "
                    "default on the model's own greedy answers to the bundled training prompts; holds out a share "
                    "and reports before and after on it: cross-entropy at the --exit-layers and of the full model "
                    "(which training changes too), and α (the exit's greedy agreement with the full model on its "
                    "own outputs). Saves a Hugging Face checkpoint to --out that `generate --model OUT` serves.")
    tr.add_argument("--data", default=None, metavar="FILE",
                    help="training text: a .txt file, or a .jsonl file whose rows have 'text' (plain text) or "
                         "'turns'/'prompt' (prompts the model answers itself, greedily); default: the model's answers "
                         "to the bundled training prompts (calibration_train.jsonl, never the benchmark set)")
    tr.add_argument("--out", required=True, metavar="DIR",
                    help="directory for the trained checkpoint (model, tokenizer, selfspec_train.json); must be new "
                         "or empty")
    tr.add_argument("--steps", type=int, default=300, help="optimiser steps (default 300)")
    tr.add_argument("--lr", type=float, default=1e-4,
                    help="AdamW peak learning rate; linear warm-up over ~10%% of the steps, then cosine decay to 0 "
                         "(default 1e-4)")
    tr.add_argument("--batch-size", type=int, default=8, help="windows per step (default 8)")
    tr.add_argument("--seq-len", type=int, default=256,
                    help="tokens per window; longer documents are cut into windows (default 256)")
    tr.add_argument("--p-max", type=float, default=0.1,
                    help="layer dropout rate of the last layer, in [0, 1); layer l of L gets "
                         "p_max·(2^(l/(L-1)) - 1), 0 at the first; 0 turns layer dropout off (default 0.1)")
    tr.add_argument("--curriculum", default="rotational", choices=["rotational", "gradual", "none"],
                    help="which exits carry a loss at a step (the last layer always does): rotational, every "
                         "--rotation-th exit, the set moving by one each step; gradual, exits switched on from the "
                         "last layer down over the first half of training; none, every exit every step. Each "
                         "active exit costs one LM-head forward and backward (default rotational)")
    tr.add_argument("--rotation", type=int, default=8,
                    help="R of the rotational curriculum: about L/R exits active per step (default 8)")
    tr.add_argument("--e-scale", type=float, default=1.0,
                    help="weight of the early exits against the last layer in the loss; exit k's weight grows "
                         "as k(k-1)/2; 0 is plain fine-tuning (default 1)")
    tr.add_argument("--exit-layers", "-k", action="append", default=None, metavar="K[,K...]",
                    help="exit layers to report loss and α for, repeatable or comma-separated (default: 1/4, 1/2 "
                         "and 3/4 of the depth); training covers every exit either way")
    tr.add_argument("--num-prompts", type=int, default=120,
                    help="prompts to answer for the training data (the first N of the file; default 120)")
    tr.add_argument("--max-new-tokens", "-n", type=int, default=128,
                    help="tokens the model generates per prompt, for the data and for α (default 128)")
    tr.add_argument("--holdout", type=float, default=0.1,
                    help="share of the documents held out for the report, in (0, 1) (default 0.1)")
    tr.add_argument("--eval-every", type=int, default=None,
                    help="steps between held-out loss checks (default: a fifth of --steps)")
    tr.add_argument("--seed", type=int, default=0,
                    help="seed of the split, the batches and the layer dropout draws (default 0)")
    tr.add_argument("--json", dest="json_out", default=None, metavar="FILE",
                    help="also write the report as JSON to this file")
    model_options(tr, dtype="weights dtype to train in: float32 or bfloat16 (default auto: float32, which the "
                             "optimiser state and small updates want; int8 and int4 are refused)")


def run(args) -> int:
    from pathlib import Path

    from selfspec.tools.train import Recipe, default_exit_layers, prepare, save, train

    recipe = Recipe(steps=args.steps, lr=args.lr, batch_size=args.batch_size, seq_len=args.seq_len,
                    p_max=args.p_max, e_scale=args.e_scale, curriculum=args.curriculum, rotation=args.rotation,
                    seed=args.seed)
    recipe.check()
    for name in ("num_prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.eval_every is not None and args.eval_every < 1:
        raise ValueError(f"--eval-every must be >= 1, got {args.eval_every}")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty directory; choose a new one")
    if args.data is not None and not Path(args.data).is_file():
        raise FileNotFoundError(f"--data {args.data} is not a file")
    if args.dtype in ("int8", "int4"):
        raise ValueError(f"train fine-tunes float weights: use --dtype float32 or bfloat16, not {args.dtype}")
    if args.dtype == "auto":  # optimiser state and small updates want float32, whatever decodes fastest
        args.dtype = "float32"
    exit_layers = comma_ints(args.exit_layers)
    model = load(args, lean=False)
    exit_layers = exit_layers or default_exit_layers(model.n_layers)
    data = prepare(model, args.data, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                   seq_len=args.seq_len, holdout=args.holdout, seed=args.seed)
    print(f"{model.name}, {args.dtype} on {model.adapter.device.type}; data: {data.source}; "
          f"{len(data.train)} training windows, {len(data.held_out)} held-out windows, {len(data.prompts)} "
          f"held-out prompts for α; {args.steps} steps × {args.batch_size} windows of ≤{args.seq_len} tokens; "
          f"p_max {args.p_max}, curriculum {args.curriculum}" + (f" (R={args.rotation})" if args.curriculum ==
                                                                 "rotational" else ""), flush=True)
    result = train(model, data, recipe, exit_layers, eval_every=args.eval_every, alpha_tokens=args.max_new_tokens)
    setup = dict(model=model.name, dtype=args.dtype, data=data.source)
    save(model, out, result, setup)
    print()
    print(result.table())
    print()
    print(f"trained {result.seconds:.0f} s ({result.train_tokens} target tokens); checkpoint: {out} "
          f"(serve it with: selfspec generate --model {out})")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({**setup, **result.to_json()}, f, indent=2, ensure_ascii=False)
    return 0

