"""Write a larger calibration prompt set: every Spec-Bench question outside the benchmark subset and
the tune set, interleaved category by category (so that `selfspec calibrate --num-prompts N` takes
a balanced share), first turn only.

The bundled training set (selfspec/data/calibration_train.jsonl, 120 questions) gives about 40k
positions at -n 128; the context head wants 100k or more. The other Spec-Bench questions add
long summarization and RAG prompts, whose positions are context the head learns to attend over.

    python scripts/calibration_prompts.py /work/shared/bench/spec_bench_questions.jsonl -o prompts.jsonl
    selfspec calibrate --head context --prompts prompts.jsonl --num-prompts 260 -n 160 -k 12
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from itertools import zip_longest

HELD_OUT = ("spec_bench_subset.jsonl", "calibration.jsonl")  # the benchmark and tune's α prompts: never trained on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("questions", help="Spec-Bench question.jsonl (question_id, category, turns)")
    parser.add_argument("-o", "--out", required=True, help="the JSONL file to write")
    args = parser.parse_args()
    held = {json.loads(line)["question_id"]
            for name in HELD_OUT
            for line in resources.files("selfspec").joinpath(f"data/{name}").read_text().splitlines() if line.strip()}
    groups: dict[str, list[dict]] = {}
    with open(args.questions, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if row["question_id"] not in held:
                groups.setdefault(row["category"], []).append(
                    {"question_id": row["question_id"], "category": row["category"], "turns": row["turns"][:1]})
    rows = [row for batch in zip_longest(*groups.values()) for row in batch if row is not None]
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"{len(rows)} prompts ({len(held)} benchmark and tune questions left out) -> {args.out}")


if __name__ == "__main__":
    main()
