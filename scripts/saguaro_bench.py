"""Does Saguaro (speculative speculative decoding) pay on this machine? Tokens/s of saguaro against
the same early-exit draft run synchronously and against AR, on the bundled SmolLM2, greedy.

Every (prompt, method) generation runs interleaved with the others, prompt by prompt and in a
rotating order, so machine noise spreads over all of them; every output is compared with AR's
(a speedup only counts if the output is the same). tokens/s is total new tokens over total
generation wall time (prefill + rounds). The hit rate is the share of rounds, among those that
had a pre-draft, whose verify ended as the pre-draft assumed.

    python scripts/saguaro_bench.py --prompts 6 --max-new-tokens 64 -k 22 28 -g 1 3
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

import selfspec
from selfspec.bench import load_prompts, machine
from selfspec.stats import GenerationStats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=6, help="prompts from the bundled Spec-Bench subset (default 6)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per generation (default 64)")
    p.add_argument("-k", "--exit-layers", type=int, nargs="+", default=[22, 28], help="exit layers k (default 22 28)")
    p.add_argument("-g", "--draft-lens", type=int, nargs="+", default=[1, 3], help="draft lengths γ (default 1 3)")
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompts (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model = selfspec.load("smollm2", progress=False)
    prompts = [model.encode(q.text) for q in load_prompts(None, per_category=10**6)[: args.prompts]]
    configs = [("ar", None, None)] + [(m, k, g) for k in args.exit_layers for g in args.draft_lens
                                      for m in ("early-exit", "saguaro")]

    def run(config, ids, n):
        method, k, g = config
        out = model.generate(ids, method=method, exit_layer=k, draft_len=g, max_new_tokens=n, exit_adapter="none")
        return out.tokens, out.stats

    for config in configs:  # warm-up, untimed: allocator, kernels, the worker thread
        run(config, prompts[0], 8)
    totals = {c: GenerationStats(method=c[0], exit_layer=c[1], draft_len=c[2] or 0) for c in configs}
    identical = defaultdict(int)
    turn = 0
    for _ in range(args.repeats):
        for ids in prompts:
            order = configs[turn % len(configs):] + configs[: turn % len(configs)]
            turn += 1
            outputs = {c: run(c, ids, args.max_new_tokens) for c in order}
            reference = outputs[configs[0]][0]
            for c, (tokens, stats) in outputs.items():
                totals[c].merge(stats)
                identical[c] += tokens == reference

    runs = args.repeats * len(prompts)
    ar_rate = totals[configs[0]].tokens_per_s
    print(f"SmolLM2, greedy, {len(prompts)} prompts × {args.max_new_tokens} new tokens × {args.repeats}; {machine()}")
    print(f"{'method':<11} {'k':>3} {'γ':>2} {'tok/s':>7} {'vs AR':>6} {'α':>5} {'acc/step':>8} "
          f"{'hits':>9} {'hit rate':>8} {'same as AR':>10}")
    for c in configs:
        s = totals[c]
        tried = s.speculation_hits + s.speculation_misses
        rate = f"{s.speculation_hits / tried:.2f}" if tried else "-"
        alpha = f"{s.alpha:.2f}" if s.alpha is not None else "-"
        acc = f"{s.mean_accepted_length:.2f}" if s.mean_accepted_length is not None else "-"
        print(f"{c[0]:<11} {c[1] or '-':>3} {c[2] or '-':>2} {s.tokens_per_s:7.2f} {s.tokens_per_s / ar_rate:6.2f} "
              f"{alpha:>5} {acc:>8} {f'{s.speculation_hits}/{tried}':>9} {rate:>8} {identical[c]:>5}/{runs}")
    mismatched = [c for c in configs if identical[c] != runs]
    if mismatched:
        print(f"outputs differ from AR for: {mismatched}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
