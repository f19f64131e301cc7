"""c and v, timed on this machine: what a draft token and a verify cost relative to one full step.

  c(k)     one early-exit draft token: embed, layers 0 .. k-1, the model's norm and head
  v(k, n)  one verify over n positions that reuses the draft's KV below layer k (the engine's
           `verify_forward`); k = 0 is a verify with no reuse (prompt lookup, whose draft runs no
           layer). v(0, 1) is a plain autoregressive step.
  lookup   one n-gram search of prompt lookup, per round

All relative to `step_s`, one full-depth one-token forward at the same context length. Every
quantity is timed `repeats` times, round-robin so that drift on a noisy machine spreads over all
of them, and the median is kept. Each timing is of a second call right after a first of the same
shape: a first call after other shapes runs measurably slower on a CPU (a one-off check on SmolLM2
here: v(1) about 1.17 cold, 1.00 warm), and a decode repeats the same shapes round after round.

On a CPU v(n) grows with n: more rows through every weight matrix (SmolLM2 on 2 cores: v(2) = 1.54
in results/tune_smollm2/tune.json), and the verify's attention runs row by row to round as decoding does.
On a GPU it is close to 1 for small n.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from selfspec.core.draft import Draft
from selfspec.drafters.lookup import find_draft
from selfspec.core.engine import measure_step_time, verify_forward


@dataclass
class Costs:
    step_s: float  # one full one-token forward, seconds
    draft: dict[int, float]  # c(k)
    verify: dict[int, dict[int, float]]  # v(k, n); k = 0: no reuse
    lookup: float  # one n-gram search over one step
    context: int  # the context length they were timed at

    def to_json(self) -> dict:
        return {
            "step_s": round(self.step_s, 6),
            "context": self.context,
            "draft": {str(k): round(c, 4) for k, c in self.draft.items()},
            "verify": {str(k): {str(n): round(v, 4) for n, v in row.items()} for k, row in self.verify.items()},
            "lookup": round(self.lookup, 5),
        }


@torch.inference_mode()
def measure_costs(adapter, *, context: int, exit_layers, max_draft_len: int, draft_layers=None,
                  repeats: int = 3, progress: bool = True, head=None) -> Costs:
    """Time c(k) for every k in `draft_layers` (default: every layer), v(k, n) for k in
    `exit_layers` and 0, n = 1 .. max_draft_len + 1 (n >= 2 for k > 0), and the lookup search.
    head: what the draft applies to h_k (default the model's own head), e.g. a pruned draft head."""
    n_layers = adapter.n_layers
    draft_layers = sorted(set(draft_layers or range(1, n_layers + 1)))
    exit_layers = sorted(set(exit_layers))
    capacity = context + max_draft_len + 2
    cache = adapter.new_cache(capacity)
    device = adapter.device
    zeros = torch.zeros(context, dtype=torch.long, device=device)
    adapter.run_layers(adapter.embed(zeros), range(n_layers), 0, cache)  # any tokens: only timing
    cache.rewind(context)
    pending = torch.zeros(1, dtype=torch.long, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    hidden = adapter.embed(torch.zeros(max_draft_len, dtype=torch.long, device=device))
    history = np.random.default_rng(0).integers(0, 1000, size=context)

    head = adapter.head if head is None else head

    def draft_step(k):
        return lambda: head(adapter.run_layers(adapter.embed(pending), range(k), context, cache))

    def verify(k, n):
        tokens = torch.zeros(n - 1, dtype=torch.long, device=device)
        draft = Draft(tokens=tokens) if k == 0 else Draft(tokens, exit_layer=k, exit_hidden=hidden[:, : n - 1])
        return lambda: verify_forward(adapter, cache, pending, draft, context, top1=True)  # a greedy verify

    jobs = {("step",): lambda: None, ("lookup",): lambda: find_draft(history, 3, 1, max_draft_len)}
    jobs.update({("draft", k): draft_step(k) for k in draft_layers})
    jobs.update({("verify", 0, n): verify(0, n) for n in range(1, max_draft_len + 2)})
    jobs.update({("verify", k, n): verify(k, n) for k in exit_layers for n in range(2, max_draft_len + 2)})
    times: dict[tuple, list[float]] = {key: [] for key in jobs}
    bar = tqdm(total=repeats, desc="timing c and v", unit="pass", disable=not progress, dynamic_ncols=True)
    for _ in range(repeats):
        for key, job in jobs.items():
            if key == ("step",):
                seconds = measure_step_time(adapter, cache, position=context, repeats=1)
            else:
                job()
                sync()
                t = time.perf_counter()
                job()
                sync()
                seconds = time.perf_counter() - t
            times[key].append(seconds)
        bar.update()
    bar.close()
    median = {key: float(np.median(ts)) for key, ts in times.items()}
    step = median[("step",)]
    verify_costs: dict[int, dict[int, float]] = {}
    for key, seconds in median.items():
        if key[0] == "verify":
            verify_costs.setdefault(key[1], {})[key[2]] = seconds / step
    for k in exit_layers:  # a round that drafts nothing is a plain step, whatever k
        verify_costs[k][1] = verify_costs[0][1]
    return Costs(
        step_s=step,
        draft={k: median[("draft", k)] / step for k in draft_layers},
        verify=verify_costs,
        lookup=median[("lookup",)] / step,
        context=context,
    )
