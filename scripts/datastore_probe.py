"""Would a datastore of the model's own outputs (REST-style n-gram retrieval) draft better than the
shipped feature head? Measured offline, on held-out prompts' greedy outputs, position by position.

1. Greedy outputs of the calibration prompts (scripts/calibration_prompts.py: Spec-Bench minus
   the benchmark and tune questions) and of the held-out ones (the benchmark subset and tune's
   calibration prompts), batched through transformers' generate() in float32
   (`selfspec.train.self_generated`); cached as JSON.
2. A datastore from the training outputs: every n-gram (n = 1..4) of output tokens -> counts of
   the token that followed.
3. At every held-out output position: the draft of prompt lookup (suffix match of 2..3 tokens in
   the context, as the shipped hybrid), the datastore's (longest match, its share of the counts as
   confidence, a chain of up to 3) and the shipped feature head's first token (teacher-forced on
   the model's own final states, exactly what its first draft sees), each against the model's token.

    python scripts/calibration_prompts.py ../shared/bench/spec_bench_questions.jsonl -o train.jsonl
    python scripts/datastore_probe.py train.jsonl --cache probe/ > datastore_probe.out
"""

from __future__ import annotations

import argparse
import collections
import json
from importlib import resources
from pathlib import Path

import numpy as np
import torch

import selfspec
from selfspec.drafters.lookup import find_draft
from selfspec.feature_calibrate import Student, _teacher_forced
from selfspec.feature_head import load_feature_head, shipped_path
from selfspec.profiles import ModelIdentity
from selfspec.train import self_generated

HELD_OUT = ("spec_bench_subset.jsonl", "calibration.jsonl")
N = 4  # the datastore's longest n-gram
CHAIN = 3  # draft length scored for chains


def cached_outputs(model, texts: list[str], n_new: int, path: Path) -> list[dict]:
    if path.is_file():
        return json.loads(path.read_text())
    out = [{"prompt": d.ids[:d.first], "output": d.ids[d.first:]} for d in self_generated(model, texts, n_new)]
    path.write_text(json.dumps(out))
    return out


def datastore(sequences: list[dict]) -> list[dict]:
    store = [collections.defaultdict(collections.Counter) for _ in range(N + 1)]
    for r in sequences:
        s = r["prompt"][-N:] + r["output"]  # output tokens, with the prompt's last ones as context
        for i in range(len(s) - 1):
            for n in range(1, min(N, i + 1) + 1):
                store[n][tuple(s[i - n + 1:i + 1])][s[i + 1]] += 1
    return store


def store_draft(store, context: list[int], length: int, min_n: int = 2) -> tuple[list[int], float, int]:
    """A chain of up to `length` tokens, longest match first at each step; the first token's
    confidence (its share of the counts) and match length."""
    context, draft, first = list(context), [], (0.0, 0)
    for _ in range(length):
        for n in range(N, min_n - 1, -1):
            counts = store[n].get(tuple(context[-n:]))
            if counts:
                token, count = counts.most_common(1)[0]
                if not draft:
                    first = (count / sum(counts.values()), n)
                draft.append(token)
                context.append(token)
                break
        else:
            break
    return draft, *first


def accepted(draft: list[int], truth: list[int]) -> int:
    n = 0
    for x, y in zip(draft, truth):
        if x != y:
            break
        n += 1
    return n


@torch.inference_mode()
def positions(model, store, sequences: list[dict]) -> list[dict]:
    a = model.adapter
    identity = ModelIdentity.of(model.hf_model, model.name)
    head, draft_ids = load_feature_head(shipped_path(identity), identity)
    head = head.float().eval()
    student = Student(a, draft_ids)
    rows = []
    for r in sequences:
        seq = torch.tensor(r["prompt"] + r["output"])
        p = len(r["prompt"])
        embedded = a.embed(seq[None]).float()
        final = _teacher_forced(a, seq, p, 0).final.float()
        previous = torch.cat([final.new_zeros(1, final.shape[1]), final[:-1]])
        probs = student.logits(head(previous[None], embedded)[0])[:, :-1].softmax(-1)
        conf, index = probs.max(-1)
        head_token, conf = draft_ids[index].tolist(), conf.tolist()
        s = seq.tolist()
        for t in range(p + 1, len(s)):  # the token at t, drafted after the pending token s[t - 1]
            truth = s[t:t + CHAIN]
            lookup = find_draft(s[:t], 3, 2, CHAIN)
            chain, store_conf, store_n = store_draft(store, s[:t], CHAIN)
            rows.append({"head": head_token[t - 1] == s[t], "head_conf": conf[t - 1],
                             "lookup": bool(lookup), "lookup_ok": accepted(lookup[:1], truth) > 0,
                             "store": bool(chain), "store_ok": accepted(chain[:1], truth) > 0,
                             "store_chain": accepted(chain, truth), "store_conf": store_conf, "store_n": store_n})
    return rows


def report(rows: list[dict]) -> None:
    mean = lambda xs: float(np.mean(xs)) if len(xs) else float("nan")
    n = len(rows)
    print(f"held-out output positions: {n}")
    print(f"feature head, first token: alpha {mean([x['head'] for x in rows]):.3f}")
    matched = [x for x in rows if x["lookup"]]
    rest = [x for x in rows if not x["lookup"]]
    print(f"prompt lookup (2..3-token suffix match): covers {len(matched) / n:.3f}, right {mean([x['lookup_ok'] for x in matched]):.3f}"
          f"; the head is right at {mean([x['head'] for x in matched]):.3f} of those")
    print(f"no lookup match ({len(rest)} positions): the head is right at {mean([x['head'] for x in rest]):.3f}")
    print("datastore where lookup has no match, by its shortest match n and confidence:")
    print("| n >= | confidence >= | covers | datastore right | chain of 3: tokens accepted | head right there |")
    print("|---|---|---|---|---|---|")
    for min_n in (2, 3, 4):
        for threshold in (0.0, 0.5, 0.7, 0.9):
            sel = [x for x in rest if x["store"] and x["store_n"] >= min_n and x["store_conf"] >= threshold]
            if sel:
                print(f"| {min_n} | {threshold} | {len(sel) / len(rest):.3f} | {mean([x['store_ok'] for x in sel]):.3f} | "
                      f"{mean([x['store_chain'] for x in sel]):.2f} | {mean([x['head'] for x in sel]):.3f} |")
    print("the head by its own confidence (no lookup match):")
    for threshold in (0.3, 0.5, 0.7):
        sel = [x for x in rest if x["head_conf"] >= threshold]
        print(f"  confidence >= {threshold}: covers {len(sel) / len(rest):.3f}, right {mean([x['head'] for x in sel]):.3f}")
    hybrid = [x["lookup_ok"] if x["lookup"] else x["head"] for x in rows]
    print(f"one-token drafts, alpha: the shipped hybrid's rule (lookup, else head) {mean(hybrid):.3f}; "
          f"an oracle picking the right one of the two {mean([x['head'] or (x['lookup'] and x['lookup_ok']) for x in rows]):.3f}")
    for min_n, threshold in ((2, 0.5), (3, 0.5), (4, 0.7)):
        picked = [x["lookup_ok"] if x["lookup"] else
                  x["store_ok"] if x["store"] and x["store_n"] >= min_n and x["store_conf"] >= max(threshold, x["head_conf"])
                  else x["head"] for x in rows]
        print(f"  lookup, else datastore (n >= {min_n}, confidence >= {threshold} and above the head's), else head: {mean(picked):.3f}")
    for threshold in (0.5, 0.7, 0.9):
        picked = [x["head"] if x["head_conf"] >= threshold or not x["lookup"] else x["lookup_ok"] for x in rows]
        print(f"  the head over lookup where its confidence >= {threshold}: {mean(picked):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("train", help="training prompts, JSONL with 'turns' (scripts/calibration_prompts.py)")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=128)
    parser.add_argument("--cache", type=Path, default=Path("datastore_probe"), help="folder for the generated outputs")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.cache.mkdir(parents=True, exist_ok=True)
    model = selfspec.load(dtype="float32", progress=False)
    read = lambda lines: [json.loads(line)["turns"][0] for line in lines if line.strip()]
    train = read(Path(args.train).read_text().splitlines())
    held = [t for name in HELD_OUT for t in read(resources.files("selfspec").joinpath(f"data/{name}").read_text().splitlines())]
    train_out = cached_outputs(model, train, args.max_new_tokens, args.cache / "train_outputs.json")
    held_out = cached_outputs(model, held, args.max_new_tokens, args.cache / "held_outputs.json")
    store = datastore(train_out)
    print(f"{len(train)} training prompts, {sum(len(r['output']) for r in train_out)} output tokens; "
          f"datastore n-grams n = 1..{N}: {[len(d) for d in store[1:]]}; {len(held)} held-out prompts")
    report(positions(model, store, held_out))


if __name__ == "__main__":
    main()
