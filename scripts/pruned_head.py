"""Measure the pruned draft head on a bundled model: α at the first draft position and the draft
cost c, for each exit layer k and subset size N (see selfspec.heads.draft_head).

    python scripts/pruned_head.py --out results/pruned_head/smollm2.json

Ranking: the tokens of the model's greedy outputs on the calibration_train prompts plus those
prompts, counted as `selfspec calibrate` counts them (its own self_distillation generate), or
the file a `selfspec calibrate` run on those prompts saved (--ranking).
α: on the benchmark prompts (spec_bench_subset, none of them among the training prompts), each
AR output is teacher-forced once and at every position fed an output token the draft's argmax is
compared with the full model's next token: the logit lens of tuner.trace, which on greedy output
is the acceptance rate of the first draft token. The full-head row is trace() itself.
c: tuner.costs.measure_costs with the draft's head swapped in, one draft token (layers < k, the
head, its argmax) over one full one-token forward, warm medians; each N is timed in its own
round-robin, against its own full step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import selfspec
from selfspec.tools.bench import load_prompts, machine
from selfspec.tools.calibrate.data import self_distillation
from selfspec.heads.draft_head import PrunedHead, count_tokens, coverage, load_ranking, rank_tokens
from selfspec.tools.tune.costs import measure_costs
from selfspec.tools.tune.trace import exit_states, trace

FULL = 0  # the N that stands for the model's own, full head


def ranking_from_training_prompts(model, n_prompts: int, max_new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """Token counts [vocab] over the training prompts and the model's greedy outputs on them, and
    the prompts' question ids (to check that the benchmark never overlaps them)."""
    prompts = load_prompts(None, 10**9, default="calibration_train.jsonl")[:n_prompts]
    encoded = [model.encode(p.text) for p in prompts]
    outputs: dict[int, list[int]] = {}
    self_distillation(model, encoded, [], max_new_tokens, outputs=outputs)
    counts = count_tokens([*encoded, *outputs.values()], model.adapter.lm_head.out_features)
    return counts, [p.question_id for p in prompts]


@torch.inference_mode()
def first_position_hits(model, prompts: list[torch.Tensor], max_new_tokens: int, exit_layers: list[int],
                        heads: dict[int, PrunedHead]) -> tuple[dict, dict]:
    """hits[(k, N)]: per output position fed an output token, whether the exit-k draft with head N
    (FULL: the model's own, from trace()) proposes the full model's next token; and per N the
    share of those target tokens inside the subset."""
    adapter = model.adapter
    hits: dict[tuple[int, int], list[np.ndarray]] = {}
    inside: dict[int, list[np.ndarray]] = {n: [] for n in heads}
    for i, ids in enumerate(prompts):
        tokens = model.generate(ids, method="ar", max_new_tokens=max_new_tokens).tokens
        prompt = ids.tolist()
        t = trace(adapter, prompt, tokens, max_new_tokens, exit_layers)
        if len(t.output) < 2:
            continue
        for k in exit_layers:
            hits.setdefault((k, FULL), []).append(t.hits[k][1:])
        # trace() fed prompt + output[:-1]; position len(prompt) - 1 + j predicts output[j].
        fed = torch.tensor(prompt + t.output[:-1], dtype=torch.long, device=adapter.device)
        states, _ = exit_states(adapter, fed, exit_layers)
        target = torch.tensor(t.output[1:], device=adapter.device)
        for n, head in heads.items():
            inside[n].append(torch.isin(target, head.ids).cpu().numpy())
            for k in exit_layers:
                predicted = head.greedy(states[k][:, len(prompt):])  # the positions fed output[0 ..]
                hits.setdefault((k, n), []).append((predicted == target).cpu().numpy())
        print(f"  prompt {i + 1}/{len(prompts)}: {len(t.output)} tokens", file=sys.stderr)
    alpha = {key: float(np.concatenate(v).mean()) for key, v in hits.items()}
    share = {n: float(np.concatenate(v).mean()) for n, v in inside.items()}
    return alpha, share


def draft_costs(model, ranking: torch.Tensor, sizes: list[int], exit_layers: list[int], context: int,
                repeats: int) -> dict[int, tuple[dict[int, float], float]]:
    """Per N: (c(k) by k, the step seconds it is relative to), with the greedy draft's head."""
    adapter = model.adapter
    out = {}
    for n in sizes:
        head = (lambda h: adapter.head(h).argmax(-1)) if n == FULL else PrunedHead(adapter, ranking[:n]).greedy
        costs = measure_costs(adapter, context=context, exit_layers=[], max_draft_len=0, draft_layers=exit_layers,
                              repeats=repeats, progress=False, head=head)
        out[n] = (costs.draft, costs.step_s)
        print(f"  timed N={n or 'full'}: step {costs.step_s * 1e3:.1f} ms", file=sys.stderr)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="bundled model name or checkpoint (default smollm2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--exit-layer", "-k", type=int, nargs="+", default=[15, 22, 28], help="exit layers (default 15 22 28)")
    p.add_argument("--vocab", default="full,32768,16384,8192,4096,2048,1024",
                   help="subset sizes N, comma-separated; 'full' is the model's own head (default: full,32768,...,1024)")
    p.add_argument("--save", action="store_true",
                   help="also save the counted ranking as this model's draft-head file in its profile directory "
                        "($SELFSPEC_PROFILES), as `selfspec calibrate` does, so `--draft-vocab N` can use it")
    p.add_argument("--ranking", default=None, metavar="FILE",
                   help="a draft-head ranking `selfspec calibrate` saved (on its default training prompts) instead "
                        "of counting here")
    p.add_argument("--train-prompts", type=int, default=120, help="calibration_train prompts ranked (default 120)")
    p.add_argument("--train-tokens", type=int, default=128, help="tokens generated per training prompt (default 128)")
    p.add_argument("--per-category", type=int, default=5,
                   help="benchmark prompts per category of spec_bench_subset (default 5: all 30)")
    p.add_argument("--max-new-tokens", "-n", type=int, default=128, help="AR tokens per benchmark prompt (default 128)")
    p.add_argument("--repeats", type=int, default=5, help="timings per c, median kept (default 5)")
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args(argv)
    sizes = [FULL if v.strip() == "full" else int(v) for v in args.vocab.split(",") if v.strip()]
    t0 = time.perf_counter()

    model = selfspec.load(args.model, dtype=args.dtype)
    vocab = model.adapter.lm_head.out_features
    sizes = [n for n in sizes if n == FULL or n < vocab]
    if args.ranking:
        ranking, counts = load_ranking(args.ranking, model.identity), None
        train_ids = [p.question_id for p in load_prompts(None, 10**9, default="calibration_train.jsonl")]
    else:
        print("ranking: the model's greedy outputs on the training prompts", file=sys.stderr)
        counts, train_ids = ranking_from_training_prompts(model, args.train_prompts, args.train_tokens)
        ranking = rank_tokens(counts)
        if args.save:
            from selfspec.heads import draft_head
            from selfspec.model.profiles import save_section

            source = dict(prompts="calibration_train.jsonl", num_prompts=len(train_ids), tokens=args.train_tokens)
            path = draft_head.save_ranking(counts, draft_head.default_path(model.identity), model.identity, source)
            save_section(model.identity, draft_head.SECTION, {"path": str(path), **source})
            print(f"ranking saved: {path}", file=sys.stderr)
    bench = load_prompts(None, args.per_category)
    overlap = set(train_ids) & {b.question_id for b in bench}
    if overlap:
        raise SystemExit(f"benchmark prompts {sorted(overlap)} are among the training prompts")
    heads = {n: PrunedHead(model.adapter, ranking[:n]) for n in sizes if n != FULL}
    encoded = [model.encode(b.text) for b in bench]
    print("α: AR outputs on the benchmark prompts, teacher-forced", file=sys.stderr)
    alpha, share = first_position_hits(model, encoded, args.max_new_tokens, args.exit_layer, heads)
    context = int(np.median([ids.numel() for ids in encoded])) + args.max_new_tokens // 2  # as `selfspec tune`
    print(f"c: timed at context {context}", file=sys.stderr)
    costs = draft_costs(model, ranking, sizes, args.exit_layer, context, args.repeats)

    head_mb = {n: (vocab if n == FULL else n) * model.adapter.lm_head.in_features
               * model.adapter.lm_head.weight.element_size() / 1e6 for n in sizes}
    rows = []
    for k in args.exit_layer:
        for n in sizes:
            rows.append(dict(exit_layer=k, draft_vocab=n or vocab, full=n == FULL, head_mb=round(head_mb[n], 1),
                             held_out_coverage=round(share.get(n, 1.0), 4), alpha=round(alpha[k, n], 4),
                             cost=round(costs[n][0][k], 4), cost_saved=round(costs[FULL][0][k] - costs[n][0][k], 4)))
    table = ["| k | N | head MB | output tokens in subset | α (first position) | c | c saved vs full |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['exit_layer']} | {'full' if r['full'] else r['draft_vocab']} | {r['head_mb']:.1f} | "
                     f"{r['held_out_coverage']:.1%} | {r['alpha']:.3f} | {r['cost']:.3f} | {r['cost_saved']:+.3f} |")
    setup = dict(model=model.name, dtype=args.dtype, machine=machine(), vocab_size=vocab, ranking_file=args.ranking,
                 train_prompts=None if args.ranking else len(train_ids),
                 train_tokens=None if args.ranking else args.train_tokens,
                 counted_tokens=None if counts is None else int(counts.sum()),
                 benchmark_prompts=len(bench), max_new_tokens=args.max_new_tokens, context=context,
                 repeats=args.repeats, step_ms={str(n or "full"): round(costs[n][1] * 1e3, 2) for n in sizes},
                 step_ms_median=round(statistics.median(c[1] for c in costs.values()) * 1e3, 2),
                 train_coverage=None if counts is None else
                 {str(n): round(c, 4) for n, c in coverage(counts, [n for n in sizes if n]).items()},
                 seconds=round(time.perf_counter() - t0, 1))
    source = args.ranking or f"{len(train_ids)} training prompts ({setup['counted_tokens']} tokens)"
    print(f"{model.name}, {args.dtype}; {machine()}; ranking from {source}; α on {len(bench)} benchmark prompts × ≤{args.max_new_tokens} tokens; "
          f"c at context {context}, median of {args.repeats}")
    print()
    print("\n".join(table))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"setup": setup, "rows": rows, "markdown": "\n".join(table)}, indent=2,
                              ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
