"""`selfspec calc`: the analytic model of speculative decoding (selfspec.tools.calc) as a table; no model loads."""

from __future__ import annotations


def add_parser(sub) -> None:
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


def run(args) -> int:
    from selfspec.tools.calc import best_gamma, ceiling, expected_tokens, parse_values, speedup

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
