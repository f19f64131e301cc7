"""Feature-head draft policies on tune's held-out calibration prompts (never the benchmark's, never
trained on): draft length γ and the confidence threshold that stops a draft after a token the head
is unsure of. Interleaves AR and each policy per prompt, so drift in this machine's speed hits all
alike; prints tokens/s, × AR, α, tokens per round and rounds, and checks every output equals AR's.
Policies "hybrid:γ:n[:N[:m]]" are prompt lookup from a suffix match of n..N tokens (N default 3), else
the feature head's one token (its m likeliest as siblings, one verify: m default 1, a chain), with
no payoff gates; "hybridc:γ:n:f:θ" is the same lookup, else a feature chain of up to f tokens that
stops after a token of draft probability below θ; "sib:m" is the feature head's m likeliest first
tokens as siblings alone.

    .venv/bin/python scripts/feature_policy_sweep.py [-n 64] [--repeats 2]
"""

from __future__ import annotations

import argparse

import torch

import selfspec
from selfspec import gemv
from selfspec.bench import load_prompts


def hybrid(model, draft_len: int, min_ngram: int, ngram: int = 3, siblings: int = 1,
           feature_len: int = 1, threshold: float | None = None):
    from selfspec.drafters import DRAFTERS
    from selfspec.drafters.hybrid import Hybrid
    from selfspec.drafters.lookup import PromptLookup

    feature = DRAFTERS["feature"](profile={}, identity=model.identity, draft_len=feature_len, siblings=siblings,
                                  threshold=threshold)
    lookup = PromptLookup(draft_len=draft_len, ngram=max(ngram, min_ngram), min_ngram=min_ngram)
    return Hybrid(lookup, feature, gate=False)


def label(p: tuple) -> str:
    if p[0] == "ar":
        return "ar"
    if p[0] == "feature":
        return f"feature γ≤{p[1]} threshold {p[2]}"
    if p[0] == "sib":
        return f"feature, {p[1]} siblings"
    if p[0] == "hybridc":
        return f"lookup γ≤{p[1]} (suffix {p[2]}..{max(p[2], 3)}), else feature γ≤{p[3]} threshold {p[4]}"
    longest = p[3] if len(p) > 3 else 3
    first = f"feature's {p[4]} siblings" if len(p) > 4 and p[4] > 1 else "feature γ=1"
    return f"lookup γ≤{p[1]} (suffix {p[2]}..{max(p[2], longest)}), else {first}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--policies", default="1:0.3,2:0.3,2:0.6,2:0.8,3:0.6,3:0.8,3:0.9",
                        help="γ:threshold pairs of the feature draft, or hybrid:γ:n (prompt lookup of up to γ "
                             "tokens where a suffix of at least n tokens matches, else the feature draft γ = 1, "
                             "no payoff gates), comma-separated")
    parser.add_argument("--bench", action="store_true",
                        help="the benchmark's 6 prompts (one per category, as `selfspec bench`), not tune's 12")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "int8"])
    parser.add_argument("--no-exact", action="store_true",
                        help="the default lean step, not exact mode's 4-row bucket (which allows γ <= 3 only)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = selfspec.load("smollm2", dtype=args.dtype, exact=not args.no_exact)
    prompts = [p.text for p in (load_prompts(None, 1) if args.bench else load_prompts(None, 2, default="calibration.jsonl"))]
    policies = [("ar", None, None)]
    for p in args.policies.split(","):
        parts = p.split(":")
        if parts[0] == "hybrid":  # hybrid:γ:min n-gram[:longest n-gram[:siblings]]
            policies.append(("hybrid", int(parts[1]), int(parts[2]), *(int(x) for x in parts[3:])))
        elif parts[0] == "hybridc":  # hybridc:γ:min n-gram:feature γ:threshold
            policies.append(("hybridc", int(parts[1]), int(parts[2]), int(parts[3]), float(parts[4])))
        elif parts[0] == "sib":
            policies.append(("sib", int(parts[1]), None))
        else:
            policies.append(("feature", int(parts[0]), float(parts[1])))
    from selfspec.drafters import DRAFTERS

    drafters = {p: hybrid(model, *p[1:]) for p in policies if p[0] == "hybrid"}
    drafters.update({p: hybrid(model, p[1], p[2], feature_len=p[3], threshold=p[4]) for p in policies if p[0] == "hybridc"})
    drafters.update({p: DRAFTERS["feature"](profile={}, identity=model.identity, draft_len=1, siblings=p[1])
                     for p in policies if p[0] == "sib"})
    totals = {p: [0.0, 0, 0, 0, 0, 0] for p in policies}  # seconds, tokens, drafted, accepted, rounds, identical
    for _ in range(args.repeats):
        for prompt in prompts:
            reference = None
            for p in policies:
                method, g, t = p[:3]
                options = {"method": method, "max_new_tokens": args.n}
                if method in ("hybrid", "hybridc", "sib"):
                    options = {"drafter": drafters[p], "max_new_tokens": args.n}
                elif method != "ar":
                    options.update(draft_len=g, threshold=t)
                out = model.generate(prompt, **options)
                s = out.stats
                if reference is None:
                    reference = out.tokens
                row = totals[p]
                row[0] += s.wall_s - s.prefill_s
                row[1] += s.new_tokens
                row[2] += s.drafted
                row[3] += s.accepted
                row[4] += s.rounds
                row[5] += out.tokens == reference
    ar_rate = totals[policies[0]][1] / totals[policies[0]][0]
    mode = "eager, not exact" if args.no_exact else "exact"
    print(f"SmolLM2 {args.dtype} ({mode}), kernel path {gemv.kernel_path()}, {len(prompts)} {'benchmark' if args.bench else 'calibration'} prompts × {args.n} tokens × {args.repeats}, "
          f"decode tok/s (prefill excluded), 2 threads")
    print("| policy | tok/s | × AR | α | tokens/round | identical |")
    print("|---|---|---|---|---|---|")
    for p, (sec, tok, drafted, acc, rounds, same) in totals.items():
        name = label(p)
        alpha = f"{acc / drafted:.3f}" if drafted else "–"
        print(f"| {name} | {tok / sec:.2f} | {tok / sec / ar_rate:.3f} | {alpha} | {tok / max(rounds, 1):.3f} | "
              f"{same}/{len(prompts) * args.repeats} |")


if __name__ == "__main__":
    main()
