"""`selfspec calibrate --head context`: train a context head (selfspec.heads.context_head) per exit layer k.

The data and the loss are the exit adapter's (selfspec.tools.calibrate.data, .loss: the model's own greedy
continuations of the prompts, teacher top-64, the coarsened KL), kept as sequences: each prompt's
exit states in position order from position 0, since every position is context for the later
ones. Plain text windows are sequences of their own, training only. The split is by prompt, the
one the exit adapter's calibration draws with the same seed, so their held-out α compare.

A step draws `sequences` training sequences, runs the head's keys and values over all their
positions (cheap: 2·d·heads·head_dim per position) and its output, the LM head and the loss only
at `positions` positions drawn among them: the LM head (d × vocab per position) is most of the
cost, so a step costs about what an exit adapter's step of as many positions does. With
`train_vocab` N the student's LM head is the pruned draft head over the N most frequent tokens
(Gemma 3's 262k-token head), the teacher's tokens outside it merged into "everything else".

α by draft position, on held-out prompts. On greedy data a draft that is still being accepted has
fed exactly the model's own tokens, so the head sees the states the data holds: a round starting
at output position t accepts at least j tokens iff the head's argmax equals the teacher's at t ..
t+j-1. α_j = P(agree at t+j-1 | agree at t .. t+j-2) over every output position t as a round's
start: the engine's per-position acceptance without a γ cap (which only ends rounds earlier) and
without the double early exit's stops.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from selfspec.heads import draft_head
from selfspec.tools.calibrate.data import Positions, held_out_prompts, self_distillation, teacher_force, text_windows
from selfspec.tools.calibrate.loss import distill_loss
from selfspec.tools.calibrate.result import Calibration, Trained
from selfspec.tools.optim import adamw_cosine, descend
from selfspec.heads.context_head import ContextHead
from selfspec.heads.draft_head import PrunedHead

DEPTH = 6  # draft positions α is reported for
MISSING = -1e4  # log-probability of a teacher token outside a pruned student head: p = 0, and finite


@dataclass
class ContextTrained(Trained):
    """One exit layer's context head and how it did; alpha_* are α at the first draft position."""

    alpha_by_position_before: list[float] = field(default_factory=list)  # α_1 .. α_DEPTH, held out
    alpha_by_position_after: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        return {**super().summary(),
                "alpha_by_position_before": [round(a, 4) for a in self.alpha_by_position_before],
                "alpha_by_position_after": [round(a, 4) for a in self.alpha_by_position_after]}


@dataclass
class ContextCalibration(Calibration):
    train_vocab: int | None = None  # the pruned student head's size, None: the full head

    def table(self) -> str:
        rows = [("| k | α before | α after | α train | α by draft position before | after | KL before | KL after "
                 "| params | share | train s |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
        for k, t in sorted(self.trained.items()):
            n = t.adapter.n_params
            before, after = (" ".join(f"{a:.2f}" for a in alphas)
                             for alphas in (t.alpha_by_position_before, t.alpha_by_position_after))
            rows.append(f"| {k} | {t.alpha_before:.3f} | {t.alpha_after:.3f} | {t.train_alpha_after:.3f} | "
                        f"{before} | {after} | {t.kl_before:.3f} | {t.kl_after:.3f} | {n / 1e6:.2f}M | "
                        f"{n / self.model_params:.2%} | {t.seconds:.0f} |")
        return "\n".join(rows)


class Sequences:
    """Positions (ordered by sequence, then position from 0) cut into sequences."""

    def __init__(self, positions: Positions):
        self.positions = positions
        ids, counts = positions.prompt.unique_consecutive(return_counts=True)
        self.prompt = ids  # [S]: each sequence's prompt index (< 0: plain text)
        self.length = counts  # [S]
        self.begin = counts.cumsum(0) - counts  # [S]: its first row

    def __len__(self) -> int:
        return self.prompt.numel()

    def hidden(self, k: int, chosen: torch.Tensor) -> torch.Tensor:
        """The exit states of sequences `chosen`, zero-padded after each one's end: [B, T, d]."""
        h = self.positions.hidden[k]
        out = h.new_zeros(len(chosen), int(self.length[chosen].max()), h.shape[1])
        for row, s in enumerate(chosen.tolist()):
            out[row, : self.length[s]] = h[self.begin[s]: self.begin[s] + self.length[s]]
        return out


class Student:
    """The draft's LM head on the context head's output: the model's own, or a pruned one (then
    the teacher is mapped onto the subset, its other tokens' mass left in "everything else")."""

    def __init__(self, adapter, pruned: PrunedHead | None = None):
        self.adapter, self.pruned = adapter, pruned
        if pruned is not None:
            self.index = torch.full((pruned.vocab_size,), len(pruned), dtype=torch.long, device=adapter.device)
            self.index[pruned.ids] = torch.arange(len(pruned), device=adapter.device)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, d] -> [m, vocab], or [m, N + 1] over the subset plus a column for the teacher's
        tokens outside it (a logit of MISSING: q = 0 there)."""
        x = x.to(self.adapter.dtype).unsqueeze(0)
        if self.pruned is None:
            return self.adapter.head(x)
        logits = self.pruned.subset_logits(x)
        return torch.cat([logits, logits.new_full((logits.shape[0], 1), MISSING)], dim=1)

    def teacher(self, ids: torch.Tensor, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pruned is None:
            return ids, logp
        ids = self.index[ids]
        return ids, logp.masked_fill(ids == len(self.pruned), MISSING)

    def agree(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Whether the draft's greedy token is the teacher's: [m] bool."""
        top = logits.argmax(-1) if self.pruned is None else self.pruned.ids[logits[:, :-1].argmax(-1)]
        return top == ids[:, 0]


# -- α by draft position ----------------------------------------------------------------------


def run_lengths(agree: torch.Tensor) -> torch.Tensor:
    """agree [n] bool -> [n]: how many consecutive agreements start at each position."""
    n = agree.numel()
    stops = torch.cat([(~agree).nonzero().flatten(), torch.tensor([n])])
    return stops[torch.searchsorted(stops, torch.arange(n))] - torch.arange(n)


def alpha_by_position(runs: list[torch.Tensor], depth: int = DEPTH) -> list[float]:
    """α_j = P(run >= j | run >= j-1) over every round start, j = 1 .. depth (0 where no round got that far)."""
    r = torch.cat(runs) if runs else torch.zeros(0, dtype=torch.long)
    reached = [int((r >= j).sum()) for j in range(depth + 1)]
    return [reached[j] / reached[j - 1] if reached[j - 1] else 0.0 for j in range(1, depth + 1)]


@torch.no_grad()
def evaluate(head: ContextHead, student: Student, data: Sequences, k: int, chosen: torch.Tensor,
             chunk: int = 512) -> tuple[float, float, list[float]]:
    """(mean KL, α at the first draft position, α by draft position) over the output positions of
    sequences `chosen`, each run whole through the head as the draft sees it."""
    was_training = head.training
    head.eval()
    kl, agree_total, n, runs = 0.0, 0, 0, []
    p = data.positions
    for s in chosen.tolist():
        x = head(data.hidden(k, torch.tensor([s])).to(student.adapter.device))[0]  # [T, d]
        rows = torch.arange(data.begin[s], data.begin[s] + data.length[s])
        out = p.output[rows].to(x.device)
        if not out.any():
            continue
        x, rows = x[out], rows[out.cpu()]
        agree = []
        for i in range(0, x.shape[0], chunk):
            ids, logp = (t[rows[i:i + chunk]].to(x.device) for t in (p.teacher_ids, p.teacher_logp))
            logits = student.logits(x[i:i + chunk])
            kl += float(distill_loss(logits, *student.teacher(ids, logp)).sum())
            agree.append(student.agree(logits, ids))
        agree = torch.cat(agree).cpu()
        agree_total, n = agree_total + int(agree.sum()), n + agree.numel()
        runs.append(run_lengths(agree))
    head.train(was_training)
    return kl / max(1, n), agree_total / max(1, n), alpha_by_position(runs)


# -- training ----------------------------------------------------------------------------------


def train_context_head(student: Student, head: ContextHead, data: Sequences, train: torch.Tensor,
                       held_out: torch.Tensor, *, steps: int, sequences: int = 8, positions: int = 256,
                       lr: float = 3e-3, weight_decay: float = 0.01, seed: int = 0, eval_every: int = 100,
                       seen: torch.Tensor | None = None, progress: bool = True) -> ContextTrained:
    """Fit `head` (in place) on sequences `train` (indices into data), measuring on `held_out`
    (and on `seen`, default a few training sequences, for the overfitting check)."""
    t0 = time.perf_counter()
    k, device = head.exit_layer, student.adapter.device
    kl_before, alpha_before, by_position_before = evaluate(head, student, data, k, held_out)
    generator = torch.Generator().manual_seed(seed)
    optimizer, schedule = adamw_cosine(head.parameters(), steps, lr, weight_decay)
    head.train().requires_grad_(True)
    p = data.positions
    # Positions >= 1 carry examples; drafts never run at position 0 (the first prompt token).
    usable = train[data.length[train] > 1]
    if not len(usable):
        raise ValueError("no training sequence is longer than one position")
    per_sequence = max(1, positions // sequences)
    loss_avg, alpha = None, alpha_before
    bar = tqdm(range(steps), desc=f"train k={k} (context)", unit="step", file=sys.stderr, disable=not progress)
    for step in bar:
        chosen = usable[torch.randint(len(usable), (min(sequences, len(usable)),), generator=generator)]
        lengths = data.length[chosen]
        where = 1 + (torch.rand(len(chosen), per_sequence, generator=generator) * (lengths[:, None] - 1)).long()
        rows = (data.begin[chosen][:, None] + where).flatten()
        x = head(data.hidden(k, chosen).to(device), where.to(device)).flatten(0, 1)  # [B·m, d]
        ids, logp = student.teacher(p.teacher_ids[rows].to(device), p.teacher_logp[rows].to(device))
        loss_avg = descend(optimizer, schedule, distill_loss(student.logits(x), ids, logp).mean(), loss_avg)
        if (step + 1) % eval_every == 0 and step + 1 < steps:
            alpha = evaluate(head, student, data, k, held_out)[1]
        bar.set_postfix(loss=f"{loss_avg:.3f}", held_out_alpha=f"{alpha:.3f}")
    bar.close()
    head.eval().requires_grad_(False)
    kl_after, alpha_after, by_position_after = evaluate(head, student, data, k, held_out)
    if seen is None:  # as many training prompts as are held out (plain text has no outputs to measure)
        prompted = train[data.prompt[train] >= 0]
        seen = prompted[torch.randperm(len(prompted), generator=generator)[: max(1, len(held_out))]]
    train_alpha = evaluate(head, student, data, k, seen)[1]
    return ContextTrained(head, alpha_before, alpha_after, kl_before, kl_after, train_alpha, steps,
                          time.perf_counter() - t0, by_position_before, by_position_after)


# -- the whole run ------------------------------------------------------------------------------


def calibrate_context(model, prompts: list, *, texts: list[str] = (), exit_layers: list[int] | None = None,
                      max_new_tokens: int = 128, steps: int = 500, sequences: int = 8, positions: int = 256,
                      lr: float = 3e-3, width: int | None = None, heads: int = 4, head_dim: int = 64,
                      holdout: float = 0.1, seed: int = 0, train_vocab: int | None = None,
                      generate_batch: int = 32, progress: bool = True) -> ContextCalibration:
    """Train one context head per k in `exit_layers` on the model's own greedy continuations of
    `prompts` plus `texts` (plain text, training only). Nothing is saved: see selfspec.tools.calibrate.save."""
    from selfspec.tools.calibrate import default_exit_layers

    adapter = model.adapter
    exit_layers = sorted(set(exit_layers or default_exit_layers(adapter.n_layers)))
    if not 1 <= exit_layers[0] <= exit_layers[-1] < adapter.n_layers:
        raise ValueError(f"exit layers must be in 1..{adapter.n_layers - 1} for {model.name}, got {exit_layers}")
    if min(steps, sequences, positions, max_new_tokens) < 1 or not lr > 0:
        raise ValueError("steps, sequences, positions and max new tokens must be >= 1 and the learning rate > 0")
    if not 0 < holdout < 1:
        raise ValueError(f"the held-out share must be in (0, 1), got {holdout}")
    if train_vocab is not None and train_vocab < 1:
        raise ValueError(f"train_vocab must be >= 1, got {train_vocab}")
    t0 = time.perf_counter()
    encoded = [model.encode(p) for p in prompts]
    outputs: dict[int, list[int]] = {}
    parts = [self_distillation(model, encoded, exit_layers, max_new_tokens, batch_size=generate_batch,
                               progress=progress, outputs=outputs, first_position=True)]
    counts = draft_head.count_tokens([*encoded, *outputs.values()], adapter.lm_head.out_features)
    windows = [w for text in texts for w in text_windows(model, text)]
    for j, window in enumerate(windows):  # each window a sequence of its own: prompt -1, -2, ...
        window.first = 0
        parts.append(teacher_force(adapter, [window], exit_layers, prompt=-1 - j, progress=False))
    data = Sequences(Positions.cat(parts))
    held_prompt = held_out_prompts(len(encoded), holdout, seed)
    held = (data.prompt >= 0) & held_prompt[data.prompt.clamp_min(0)]
    train, held_out = (~held).nonzero().flatten(), held.nonzero().flatten()
    train_rows = torch.cat([torch.arange(b, b + n) for b, n in zip(data.begin[train], data.length[train])])
    held_outputs = sum(int(data.positions.output[b:b + n].sum()) for b, n in zip(data.begin[held_out],
                                                                                 data.length[held_out]))
    if not held_outputs or not len(train):
        raise ValueError("no positions to train on or to hold out: the model ended its outputs at once; "
                         "give more prompts or a larger --holdout")
    data_seconds = time.perf_counter() - t0

    for p in model.hf_model.parameters():
        p.requires_grad_(False)
    pruned = None
    if train_vocab is not None and train_vocab < adapter.lm_head.out_features:
        pruned = PrunedHead(adapter, draft_head.rank_tokens(counts)[:train_vocab])
    student = Student(adapter, pruned)
    hidden = adapter.embed_tokens.embedding_dim
    trained = {}
    for k in exit_layers:
        torch.manual_seed(seed)
        head = ContextHead(hidden, k, heads, head_dim, width).to(adapter.device)
        trained[k] = train_context_head(student, head, data, train, held_out, steps=steps, sequences=sequences,
                                        positions=positions, lr=lr, seed=seed, progress=progress)
    model_params = sum(p.numel() for p in model.hf_model.parameters())
    # Sequences' position 0 is context, not an example: not counted.
    n_train = len(train_rows) - len(train)
    return ContextCalibration(trained, n_train, int(data.positions.output[train_rows].sum()), held_outputs,
                              len(encoded) + len(windows), model_params, data_seconds, token_counts=counts,
                              train_vocab=None if pruned is None else len(pruned))
