"""Replay prompt lookup's draft-length policies on AR's own greedy outputs (SmolLM2, bfloat16):
tokens per unit of verify cost, from the measured v(n), for fixed γ and for a per-round γ.

    .venv/bin/python scripts/lookup_replay.py [--v 1.0 1.03 1.2 1.3]

For each of the 6 bench prompts (one per Spec-Bench category) and the first 6 calibration prompts,
AR generates 64 tokens; each policy then drafts with `find_draft` on the true context, counts the
accepted prefix, and pays v(drafted + 1) step costs per round. The figure is a prediction of the
speedup over AR that ignores the search's own cost (c ≈ 0.01-0.03 here) and machine noise.
Policies: fixed γ = 1, 2, 3; fixed γ = 3 on matches of at least 2 tokens; and "rise and fall"
(γ starts at 1, +1 after a fully accepted draft, -1 after a rejection, within 1..3).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import selfspec
from selfspec.bench import load_prompts
from selfspec.drafters.lookup import find_draft


def replay(traces, v, policy) -> float:
    tokens = cost = 0.0
    for prompt, out in traces:
        context = np.asarray(prompt + out, dtype=np.int64)
        state = {"g": policy["start"]}
        j = 0
        while j + 1 < len(out):
            g = min(state["g"], len(out) - j - 2)
            draft = find_draft(context[: len(prompt) + j + 1], 3, policy["min_ngram"], g) if g > 0 else []
            accepted = 0
            while accepted < len(draft) and draft[accepted] == out[j + 1 + accepted]:
                accepted += 1
            cost += v[len(draft)]
            tokens += accepted + 1
            if policy["adaptive"] and draft:
                state["g"] = min(3, state["g"] + 1) if accepted == len(draft) else max(1, state["g"] - 1)
            j += accepted + 1
    return tokens / cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--v", type=float, nargs=4, default=[1.0, 1.03, 1.2, 1.3],
                    help="verify cost over 1..4 positions, in one-token steps (default: the fused step's)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = selfspec.load("smollm2", dtype="bfloat16", progress=False)
    sets = {"bench": load_prompts(None, 1), "calibration": load_prompts(None, 10**9, default="calibration.jsonl")[:6]}
    traces = {}
    for name, prompts in sets.items():
        traces[name] = []
        for p in prompts:
            ids = model.encode(p.text).tolist()
            traces[name].append((ids, model.generate(ids, method="ar", max_new_tokens=64).tokens))
    policies = {
        "fixed γ=1": dict(start=1, min_ngram=1, adaptive=False),
        "fixed γ=2": dict(start=2, min_ngram=1, adaptive=False),
        "fixed γ=3": dict(start=3, min_ngram=1, adaptive=False),
        "fixed γ=3, matches of ≥ 2 tokens": dict(start=3, min_ngram=2, adaptive=False),
        "rise and fall, γ in 1..3": dict(start=1, min_ngram=1, adaptive=True),
    }
    print(f"v(1..4) = {args.v}; predicted tokens per step-cost (≈ speedup over AR), 6 prompts × 64 tokens each")
    for name, policy in policies.items():
        print(f"{name}: " + ", ".join(f"{s} {replay(t, args.v, policy):.3f}" for s, t in traces.items()))


if __name__ == "__main__":
    main()
