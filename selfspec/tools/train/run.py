"""The training loop of `selfspec train`, its report, and `save`: a Hugging Face checkpoint with the
recipe and report beside it."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.tools.optim import adamw_cosine
from selfspec.tools.train.data import Data, make_batch
from selfspec.tools.train.evaluation import Evaluation, evaluate, held_out_losses
from selfspec.tools.train.exits import Exits, cross_entropy, exit_forward
from selfspec.tools.train.recipe import Recipe, active_exits, dropout_rates, exit_scales, exit_weights


@dataclass
class Trained:
    recipe: Recipe
    exit_layers: list[int]  # the exits reported on
    n_layers: int
    before: Evaluation
    after: Evaluation
    history: list[dict] = field(default_factory=list)  # checks during training: step, train loss, held-out CE, agree
    seconds: float = 0.0  # training only (the evaluations before and after not included)
    train_windows: int = 0
    train_tokens: int = 0  # target tokens seen, over all steps

    def table(self) -> str:
        L, b, a = self.n_layers, self.before, self.after
        rows = ["| held-out | before | after |", "|---|---|---|"]
        for k in self.exit_layers:
            rows.append(f"| CE at exit k={k} | {b.loss[k]:.3f} | {a.loss[k]:.3f} |")
        rows.append(f"| CE of the full model (k={L}) | {b.loss[L]:.3f} | {a.loss[L]:.3f} |")
        for k in self.exit_layers:
            rows.append(f"| α at k={k} (greedy, own outputs) | {b.alpha[k]:.3f} | {a.alpha[k]:.3f} |")
        same = sum(x == y for x, y in zip(b.outputs, a.outputs))
        rows.append(f"| greedy outputs unchanged by training | | {same}/{len(b.outputs)} |")
        return "\n".join(rows)

    def to_json(self) -> dict:
        def ev(e: Evaluation) -> dict:
            return {"loss": {str(k): round(v, 4) for k, v in e.loss.items()},
                    "agree": {str(k): round(v, 4) for k, v in e.agree.items()},
                    "alpha": {str(k): round(v, 4) for k, v in e.alpha.items()}}
        return dict(recipe=asdict(self.recipe), exit_layers=self.exit_layers, n_layers=self.n_layers,
                    before=ev(self.before), after=ev(self.after), history=self.history,
                    seconds=round(self.seconds, 1), train_windows=self.train_windows, train_tokens=self.train_tokens)


def check_line(step: int, steps: int, train_loss: float | None, e: Evaluation, exit_layers: list[int],
               n_layers: int) -> str:
    """One line of progress: the held-out CE at each reported exit and of the full model, and agreement."""
    parts = [f"step {step:>{len(str(steps))}}/{steps}"]
    if train_loss is not None:
        parts.append(f"train loss {train_loss:.3f}")
    parts += [f"held-out CE k={k} {e.loss[k]:.3f}" for k in exit_layers]
    parts.append(f"full {e.loss[n_layers]:.3f}")
    parts += [f"agree k={k} {e.agree[k]:.3f}" for k in exit_layers]
    return "  ".join(parts)


def train(model, data: Data, recipe: Recipe, exit_layers: list[int], *, eval_every: int | None = None,
          alpha_tokens: int = 64, progress: bool = True, log: Callable[[str], None] = tqdm.write) -> Trained:
    """Fine-tune `model` (a SelfSpecModel; its HF weights change in place) with the LayerSkip recipe
    on `data.train`, and evaluate before and after on the held-out part; every `eval_every` steps
    (default: a fifth of the run) log the held-out losses."""
    recipe.check()
    adapter, hf = model.adapter, model.hf_model
    n_layers = adapter.n_layers
    exit_layers = sorted(set(exit_layers))
    if not exit_layers or not 1 <= exit_layers[0] <= exit_layers[-1] < n_layers:
        raise ValueError(f"exit layers to report must be in 1..{n_layers - 1} for {model.name}, got {exit_layers}")
    if not data.train or not data.held_out or not data.prompts:
        raise ValueError("nothing to train on or to hold out: give more text or prompts")
    eval_every = eval_every or max(1, recipe.steps // 5)
    pad = sorted(model.eos_ids)[0] if model.eos_ids else 0
    torch.manual_seed(recipe.seed)

    before = evaluate(model, data, exit_layers, recipe.batch_size, alpha_tokens)
    history = [dict(step=0, train_loss=None, loss=before.loss, agree=before.agree)]
    log(check_line(0, recipe.steps, None, before, exit_layers, n_layers))

    rates = dropout_rates(n_layers, recipe.p_max)
    scales = exit_scales(n_layers, recipe.e_scale)
    params = [p for p in hf.parameters()]
    optimizer, schedule = adamw_cosine([  # norm weights and biases keep theirs
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": recipe.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ], recipe.steps, recipe.lr, recipe.weight_decay)
    generator = torch.Generator().manual_seed(recipe.seed)
    order, cursor, loss_avg, tokens = torch.randperm(len(data.train), generator=generator), 0, None, 0

    t0 = time.perf_counter()
    hf.train().requires_grad_(True)
    bar = tqdm(range(recipe.steps), desc="train", unit="step", file=sys.stderr, disable=not progress)
    try:
        with Exits(adapter.layers) as exits:
            for step in bar:
                if cursor + recipe.batch_size > len(data.train):  # a new epoch
                    order, cursor = torch.randperm(len(data.train), generator=generator), 0
                docs = [data.train[int(i)] for i in order[cursor:cursor + recipe.batch_size]]
                cursor += recipe.batch_size
                batch = make_batch(docs, pad, adapter.device)
                active = active_exits(step, recipe.steps, n_layers, recipe.curriculum, recipe.rotation)
                weights = exit_weights(active, scales)
                draw = torch.rand(n_layers, len(docs), generator=generator) < rates[:, None]  # [L, b]
                exits.dropout(draw if recipe.p_max > 0 else None)
                logits = exit_forward(adapter, exits, batch, active)
                loss = sum(w * cross_entropy(logits[k], batch.labels) for k, w in weights.items())
                del logits
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, recipe.clip)
                optimizer.step()
                schedule.step()
                tokens += int((batch.labels != -100).sum())
                value = float(loss.detach())
                loss_avg = value if loss_avg is None else 0.9 * loss_avg + 0.1 * value
                bar.set_postfix(loss=f"{loss_avg:.3f}", exits=len(active))
                if (step + 1) % eval_every == 0 or step + 1 == recipe.steps:
                    exits.dropout(None)
                    hf.eval()
                    check = held_out_losses(model, data, exit_layers, recipe.batch_size)
                    hf.train()
                    history.append(dict(step=step + 1, train_loss=loss_avg, loss=check.loss, agree=check.agree))
                    log(check_line(step + 1, recipe.steps, loss_avg, check, exit_layers, n_layers))
    finally:
        bar.close()
        hf.eval().requires_grad_(False)
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - t0

    after = evaluate(model, data, exit_layers, recipe.batch_size, alpha_tokens)
    return Trained(recipe, exit_layers, n_layers, before, after, history, seconds, len(data.train), tokens)


def default_exit_layers(n_layers: int) -> list[int]:
    """A quarter, half and three quarters of the depth: where early-exit drafts are cheap enough to pay."""
    return sorted({max(1, n_layers // 4), max(1, n_layers // 2), max(1, (3 * n_layers) // 4)} - {n_layers})


def save(model, out: str | Path, result: Trained | None = None, setup: dict | None = None) -> Path:
    """A regular Hugging Face checkpoint (model, generation config, tokenizer) in `out`, which
    `selfspec.load(out)` and `selfspec generate --model out` serve; the recipe and report go
    beside it in selfspec_train.json."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # The lean step may store a weight as a transposed view of a fused tensor (selfspec.model.step);
    # safetensors writes contiguous tensors, so such views are saved as contiguous copies.
    state = {k: v if v.is_contiguous() else v.contiguous() for k, v in model.hf_model.state_dict().items()}
    model.hf_model.save_pretrained(out, state_dict=state)
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(out)
    if result is not None:
        (out / "selfspec_train.json").write_text(json.dumps({**(setup or {}), **result.to_json()}, indent=2))
    return out
