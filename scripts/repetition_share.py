"""How much of a greedy answer repeats itself: for each bundled bench prompt (one per category),
SmolLM2's greedy answer to 256 tokens by the engine (method ar, bfloat16), and the share of its
positions 1-128 and 129-256 that end a 6-gram already seen earlier in the answer.

    python scripts/repetition_share.py > results/stop37/repetition_n256.out
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import selfspec  # noqa: E402
from selfspec.bench import load_prompts  # noqa: E402


def repeated_share(tokens: list[int], lo: int, hi: int, g: int = 6) -> float:
    """Share of positions lo..hi-1 whose g-gram ending there occurred earlier in `tokens`."""
    seen, repeated, total = set(), 0, 0
    for end in range(g, len(tokens) + 1):
        gram = tuple(tokens[end - g:end])
        if lo <= end - 1 < hi:
            total += 1
            repeated += gram in seen
        seen.add(gram)
    return repeated / max(1, total)


def main() -> None:
    model = selfspec.load("smollm2", dtype="bfloat16", progress=False)
    for prompt in load_prompts(None, 1):
        out = model.generate(prompt.text, method="ar", max_new_tokens=256)
        print(f"{prompt.category} {len(out.tokens)} tokens; share of positions ending a repeated 6-gram: "
              f"1-128 {repeated_share(out.tokens, 0, 128):.2f}, 129-256 {repeated_share(out.tokens, 128, 256):.2f}")
        print("   ", repr(out.text[-160:]))


if __name__ == "__main__":
    main()
