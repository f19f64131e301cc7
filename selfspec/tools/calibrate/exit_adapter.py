"""The exit adapter's recipe: for each exit layer k, a small adapter A fitted so that the
early-exit draft head(A(h_k)) matches the full model, and `calibrate`, the whole run.

Terms (beyond those of selfspec.tools.calibrate.data and selfspec.heads.exit_adapter):
  student   q = softmax(head(A(h_k))): the early-exit draft's distribution with exit adapter A.
  α         here: the share of held-out positions where argmax q = argmax p. On greedy output this
            is the acceptance rate of the first draft token (see tuner/trace.py), the figure the
            adapter exists to raise.
"""

from __future__ import annotations

import sys
import time

import torch
from tqdm import tqdm

from selfspec.heads import draft_head
from selfspec.heads.exit_adapter import ExitAdapter
from selfspec.tools.calibrate.data import Positions, held_out_prompts, self_distillation, teacher_force, text_windows
from selfspec.tools.calibrate.loss import distill_loss
from selfspec.tools.calibrate.result import Calibration, Trained
from selfspec.tools.optim import adamw_cosine, descend


def student_logits(adapter, exit_adapter: ExitAdapter, h: torch.Tensor) -> torch.Tensor:
    """head(A(h)) for h [n, hidden]: logits [n, vocab] in float32."""
    return adapter.head(exit_adapter(h).to(adapter.dtype).unsqueeze(0))


@torch.no_grad()
def evaluate(adapter, exit_adapter: ExitAdapter, h, teacher_ids, teacher_logp, batch: int = 512) -> tuple[float, float]:
    """(mean KL, α) of the draft with `exit_adapter` on these positions."""
    kl, agree = 0.0, 0
    for i in range(0, h.shape[0], batch):
        logits = student_logits(adapter, exit_adapter, h[i:i + batch])
        kl += float(distill_loss(logits, teacher_ids[i:i + batch], teacher_logp[i:i + batch]).sum())
        agree += int((logits.argmax(-1) == teacher_ids[i:i + batch, 0]).sum())
    n = max(1, h.shape[0])
    return kl / n, agree / n


def train_exit_adapter(adapter, exit_adapter: ExitAdapter, train: tuple, held_out: tuple, *, steps: int,
                       seen: tuple | None = None,
                       batch_size: int = 256, lr: float = 3e-3, weight_decay: float = 0.01, seed: int = 0,
                       eval_every: int = 100, progress: bool = True) -> Trained:
    """Fit `exit_adapter` (in place) on `train` = (h_k [n, hidden], teacher ids, teacher log-probs)
    with AdamW, linear warm-up then cosine decay of the learning rate; `held_out` likewise, for α;
    `seen` (default: a sample of `train`) for α on training positions."""
    t0 = time.perf_counter()
    h, ids, logp = train
    kl_before, alpha_before = evaluate(adapter, exit_adapter, *held_out)
    generator = torch.Generator().manual_seed(seed)
    optimizer, schedule = adamw_cosine(exit_adapter.parameters(), steps, lr, weight_decay)
    exit_adapter.train().requires_grad_(True)
    order, cursor, loss_avg, alpha = torch.randperm(h.shape[0], generator=generator), 0, None, alpha_before
    bar = tqdm(range(steps), desc=f"train k={exit_adapter.exit_layer}", unit="step", file=sys.stderr,
               disable=not progress)
    for step in bar:
        if cursor + batch_size > h.shape[0]:  # a new epoch
            order, cursor = torch.randperm(h.shape[0], generator=generator), 0
        rows = order[cursor:cursor + batch_size]
        cursor += batch_size
        loss = distill_loss(student_logits(adapter, exit_adapter, h[rows]), ids[rows], logp[rows]).mean()
        loss_avg = descend(optimizer, schedule, loss, loss_avg)
        if (step + 1) % eval_every == 0 and step + 1 < steps:
            exit_adapter.eval()
            alpha = evaluate(adapter, exit_adapter, *held_out)[1]
            exit_adapter.train()
        bar.set_postfix(loss=f"{loss_avg:.3f}", held_out_alpha=f"{alpha:.3f}")
    bar.close()
    exit_adapter.eval().requires_grad_(False)
    kl_after, alpha_after = evaluate(adapter, exit_adapter, *held_out)
    if seen is None:
        sample = torch.randperm(h.shape[0], generator=generator)[:4096]
        seen = (h[sample], ids[sample], logp[sample])
    train_alpha = evaluate(adapter, exit_adapter, *seen)[1]
    return Trained(exit_adapter, alpha_before, alpha_after, kl_before, kl_after, train_alpha, steps,
                   time.perf_counter() - t0)


def default_exit_layers(n_layers: int) -> list[int]:
    """One third and one half of the depth: deeper exits agree more untrained, but a draft only
    pays when it is cheap (c is about k/L plus the head's share), so the adapter is most useful
    low."""
    return sorted({max(1, n_layers // 3), max(1, n_layers // 2)})


def calibrate(model, prompts: list, *, texts: list[str] = (), exit_layers: list[int] | None = None,
              max_new_tokens: int = 128, steps: int = 500, batch_size: int = 256, lr: float = 3e-3,
              width: int | None = None, holdout: float = 0.1, seed: int = 0, prompt_examples: bool = True,
              generate_batch: int = 32, progress: bool = True) -> Calibration:
    """Train one exit adapter per k in `exit_layers` on the model's own greedy continuations of
    `prompts` (text or token ids; chat template as `generate` applies it) plus `texts` (plain
    text, training only). Nothing is saved: see `save`."""
    adapter = model.adapter
    exit_layers = sorted(set(exit_layers or default_exit_layers(adapter.n_layers)))
    if not 1 <= exit_layers[0] <= exit_layers[-1] < adapter.n_layers:
        raise ValueError(f"exit layers must be in 1..{adapter.n_layers - 1} for {model.name}, got {exit_layers}")
    if steps < 1 or batch_size < 1 or max_new_tokens < 1 or not lr > 0:
        raise ValueError("steps, batch size and max new tokens must be >= 1 and the learning rate > 0")
    if not 0 < holdout < 1:
        raise ValueError(f"the held-out share must be in (0, 1), got {holdout}")
    t0 = time.perf_counter()
    encoded = [model.encode(p) for p in prompts]
    outputs: dict[int, list[int]] = {}
    positions = self_distillation(model, encoded, exit_layers, max_new_tokens, prompt_examples=prompt_examples,
                                  batch_size=generate_batch, progress=progress, outputs=outputs)
    counts = draft_head.count_tokens([*encoded, *outputs.values()], adapter.lm_head.out_features)
    windows = [w for text in texts for w in text_windows(model, text)]
    if windows:
        positions = Positions.cat([positions, teacher_force(adapter, windows, exit_layers, progress=progress)])
    # Held-out prompts are left out of training entirely; α is measured where drafts run, on their outputs.
    held_prompt = held_out_prompts(len(encoded), holdout, seed)
    held = (positions.prompt >= 0) & held_prompt[positions.prompt.clamp_min(0)]
    train_rows, held_rows = (~held).nonzero().flatten(), (held & positions.output).nonzero().flatten()
    seen_rows = (~held & positions.output).nonzero().flatten()  # training outputs: the overfitting check
    seen_rows = seen_rows[torch.randperm(len(seen_rows), generator=torch.Generator().manual_seed(seed))[:4096]]
    if not len(held_rows) or not len(train_rows):
        raise ValueError("no positions to train on or to hold out: the model ended its outputs at once; "
                         "give more prompts or a larger --holdout")
    data_seconds = time.perf_counter() - t0

    for p in model.hf_model.parameters():
        p.requires_grad_(False)
    hidden = model.adapter.embed_tokens.embedding_dim
    trained = {}
    for k in exit_layers:
        torch.manual_seed(seed)
        exit_adapter = ExitAdapter(hidden, k, width).to(adapter.device)
        trained[k] = train_exit_adapter(
            adapter, exit_adapter, _on(positions.rows(train_rows, k), adapter.device),
            _on(positions.rows(held_rows, k), adapter.device), seen=_on(positions.rows(seen_rows, k), adapter.device),
            steps=steps, batch_size=batch_size, lr=lr,
            seed=seed, progress=progress)
    model_params = sum(p.numel() for p in model.hf_model.parameters())
    return Calibration(trained, len(train_rows), int(positions.output[train_rows].sum()), len(held_rows),
                       len(encoded) + len(windows), model_params, data_seconds, token_counts=counts)


def _on(rows: tuple, device) -> tuple:
    return tuple(t.to(device) for t in rows)
