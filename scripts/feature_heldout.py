"""Held-out α of feature heads, measured the way `selfspec calibrate --head feature` reports it.

The held-out prompts are calibrate's: the same share and seed of the same prompt file, so α here
stands beside the README's table (0.318 / 0.252 / 0.208 / 0.195 for the head trained on the CPU).
Each held-out prompt is decoded greedily by the engine on this machine; from every output position
each head drafts on its own predictions while its tokens agree with the model's (up to 4).
α is printed for all held-out prompts, then by Spec-Bench category.

    python scripts/calibration_prompts.py ../shared/bench/spec_bench_questions.jsonl -o train.jsonl
    python scripts/feature_heldout.py train.jsonl shipped heads/all.feature.safetensors
    python scripts/feature_heldout.py code shipped --all --model qwen2.5-coder-1.5b --dtype int4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from selfspec.api import load  # noqa: E402
from selfspec.tools.bench import load_prompts  # noqa: E402
from selfspec.tools.calibrate.data import held_out_prompts  # noqa: E402
from selfspec.tools.context_calibrate import alpha_by_position  # noqa: E402
from selfspec.tools.feature_calibrate import DEPTH, Batches, Student, drafted_runs, feature_data  # noqa: E402
from selfspec.heads.feature_head import load_feature_head, shipped_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", help="the prompt file calibrate was given (calibration_prompts.py's)")
    parser.add_argument("heads", nargs="+", help="feature head files; 'shipped' for the package's")
    parser.add_argument("--num-prompts", type=int, default=438)
    parser.add_argument("--holdout", type=float, default=0.1)
    parser.add_argument("--all", action="store_true",
                        help="every prompt is held out: a file training never saw (e.g. 'code', the bundled code prompts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default="smollm2", help="a bundled model's name or a checkpoint (one with a chat template)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    model = load(args.model, dtype=args.dtype, progress=False)
    prompts = load_prompts(args.prompts, 10**9)[:args.num_prompts]
    held = [True] * len(prompts) if args.all else held_out_prompts(len(prompts), args.holdout, args.seed).tolist()
    categories = [p.category for p, h in zip(prompts, held) if h]
    chosen = [torch.as_tensor(model.encode(p.text)) for p, h in zip(prompts, held) if h]
    t0 = time.perf_counter()
    data = feature_data(model, chosen, args.max_new_tokens)
    positions = sum(x.ids.numel() - 1 - x.n_prompt for x in data)
    print(f"{len(data)} held-out prompts, {positions} output positions, decoded in {time.perf_counter() - t0:.0f} s")
    embedding = model.adapter.embed_tokens
    batches = Batches(data, lambda ids: embedding(ids).float())
    results = {}
    for name in args.heads:
        path = shipped_path(model.identity) if name == "shipped" else Path(name)
        head, draft_ids = load_feature_head(path, model.identity)
        student = Student(model.adapter, draft_ids)
        per_sequence = [drafted_runs(head, student, batches, [i]) for i in range(len(data))]
        alpha = alpha_by_position([torch.tensor([r for runs in per_sequence for r in runs])], DEPTH)
        by_category = {}
        for category in sorted(set(categories)):
            runs = [r for c, rs in zip(categories, per_sequence) if c == category for r in rs]
            by_category[category] = dict(prompts=categories.count(category), positions=len(runs),
                                         alpha=[round(a, 4) for a in alpha_by_position([torch.tensor(runs)], DEPTH)])
        results[name] = dict(alpha=[round(a, 4) for a in alpha], params=head.n_params, positions=positions,
                             by_category=by_category)
        print(f"{name}: α at draft position 1..{DEPTH} " + " / ".join(f"{a:.3f}" for a in alpha)
              + f" ({head.n_params} parameters)")
        for category, row in by_category.items():
            print(f"  {category:20s} {row['prompts']:3d} prompts {row['positions']:5d} positions  α "
                  + " / ".join(f"{a:.3f}" for a in row["alpha"]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
