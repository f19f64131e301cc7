"""`selfspec train`: the LayerSkip recipe (Elhoushi et al. 2024), fine-tuning the model itself so
that its early exits draft better.

Calibration (selfspec/tools/calibrate.py) leaves the model frozen and fits a small exit adapter; this
changes every weight, for users who can fine-tune. Two things are added to plain next-token training:

  layer dropout   in training, layer l (0-based, of L) is skipped whole for a row of the batch with
                  probability p_l = p_max·(e^(l·ln2/(L-1)) - 1): 0 at the first layer, p_max at the
                  last. Later layers learn to be optional, so the residual stream at a shallow
                  depth already carries what the deep layers would add.
  early-exit loss the model's own final norm and LM head read the hidden state after layer k
                  (exit k, the state an early-exit draft at k uses) and the cross-entropy there is
                  added, scaled by e(k) (rising with depth, see `exit_scales`) and normalised over the
                  exits active at that step. A curriculum picks the active exits (`active_exits`):
                  rotational (every R-th exit, the set rotating each step), gradual (exits switched
                  on from the last layer downward over the first half of training) or none (all).

The result is a regular Hugging Face checkpoint; decoding with it stays lossless relative to it,
but it is a different model from the one trained: the report gives the full model's held-out loss
before and after as well as the exits' loss and α.

Terms: k (exit layer: the draft runs layers 0..k-1; k = L is the full model), α (here: the share
of positions of the model's own greedy output where the exit-k argmax equals the full model's, the
first draft token's acceptance rate; measured as tuner/trace.py does), CE (cross-entropy, nats per
token).

Data: a .txt file (plain text), a .jsonl file (rows with "text" are plain text; rows with "turns" or
"prompt" are prompts, answered by the model itself), or by default the model's own greedy answers
to the bundled training prompts (calibration_train.jsonl, never the benchmark set). Training on
its own outputs teaches the exits exactly the predictions they will be asked to match.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from selfspec.tools.calibrate import length_batches, left_padded, held_out_prompts
from selfspec.tools.tune.trace import trace

CURRICULA = ("rotational", "gradual", "none")
GRADUAL_SHARE = 0.5  # the gradual curriculum has every exit on after this share of the steps
MAX_HELD_OUT_WINDOWS = 128  # held-out losses use at most this many windows (keeps each check short)
MAX_ALPHA_PROMPTS = 16  # α is measured on at most this many held-out prompts


@dataclass(frozen=True)
class Recipe:
    steps: int = 300  # optimiser steps
    lr: float = 1e-4  # AdamW peak learning rate: linear warm-up over ~10% of steps, then cosine decay to 0
    batch_size: int = 8  # windows per step
    seq_len: int = 256  # tokens per window: longer documents are cut into windows
    p_max: float = 0.1  # the last layer's dropout rate; lower layers get less (dropout_rates)
    e_scale: float = 1.0  # the early exits' weight against the last layer's in the loss (exit_scales)
    curriculum: str = "rotational"  # which exits carry a loss at a step (active_exits)
    rotation: int = 8  # R of the rotational curriculum: every R-th exit is active at a step
    weight_decay: float = 0.01  # AdamW's, on matrices only (norm weights and biases keep theirs)
    clip: float = 1.0  # gradient norm clip
    seed: int = 0  # batches, layer dropout draws and the held-out split

    def check(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 2 or self.rotation < 1:
            raise ValueError("steps, batch size and rotation must be >= 1 and the sequence length >= 2")
        if not self.lr > 0 or not self.clip > 0 or self.weight_decay < 0:
            raise ValueError("the learning rate and gradient clip must be > 0 and weight decay >= 0")
        if not 0 <= self.p_max < 1:
            raise ValueError(f"the layer dropout rate p_max must be in [0, 1), got {self.p_max}")
        if self.e_scale < 0:
            raise ValueError(f"e_scale must be >= 0, got {self.e_scale}")
        if self.curriculum not in CURRICULA:
            raise ValueError(f"unknown curriculum {self.curriculum!r}; choose one of: {', '.join(CURRICULA)}")


# -- the recipe's schedules -----------------------------------------------------------------------


def dropout_rates(n_layers: int, p_max: float) -> torch.Tensor:
    """Layer dropout rate of each layer [L]: p_max·(e^(l·ln2/(L-1)) - 1), rising from 0 at the
    first layer to exactly p_max at the last (LayerSkip's exponential depth scale)."""
    depth = torch.arange(n_layers, dtype=torch.float64) / max(1, n_layers - 1)
    return (p_max * torch.expm1(depth * math.log(2))).float()


def exit_scales(n_layers: int, e_scale: float) -> torch.Tensor:
    """e(k) for exits k = 1..L (index k-1), before normalisation: with l = k-1 the paper's
    e_scale·Σ_{i=0..l} i for the early exits, and L-1 + e_scale·Σ_{i=0..L-2} i for the last
    layer. Deeper exits weigh more (they are the ones that can match the full model); exit 1
    weighs 0, as in the paper; e_scale = 0 leaves plain next-token training."""
    layer = torch.arange(n_layers, dtype=torch.float64)
    scales = e_scale * layer * (layer + 1) / 2
    scales[-1] = (n_layers - 1) + e_scale * (n_layers - 2) * (n_layers - 1) / 2
    return scales.float()


def active_exits(step: int, steps: int, n_layers: int, curriculum: str, rotation: int) -> list[int]:
    """The exits k (1..L) whose loss counts at `step` of `steps`; the last layer always does."""
    early = range(1, n_layers)
    if curriculum == "rotational":  # exits k ≡ step + 1 (mod R): every exit once per R steps
        chosen = [k for k in early if (k - 1) % rotation == step % rotation]
    elif curriculum == "gradual":  # exit k from step GRADUAL_SHARE·steps·(L-k)/(L-1): top down
        chosen = [k for k in early if step >= GRADUAL_SHARE * steps * (n_layers - k) / max(1, n_layers - 1)]
    elif curriculum == "none":
        chosen = list(early)
    else:
        raise ValueError(f"unknown curriculum {curriculum!r}; choose one of: {', '.join(CURRICULA)}")
    return [*chosen, n_layers]


def exit_weights(exits: list[int], scales: torch.Tensor) -> dict[int, float]:
    """The loss weight of each active exit: e(k) normalised to sum to 1 over `exits`."""
    e = {k: float(scales[k - 1]) for k in exits}
    total = sum(e.values())
    return {k: v / total if total > 0 else 1 / len(e) for k, v in e.items()}


# -- the forward: the model's own layers, with hooks ----------------------------------------------


class Exits:
    """Forward hooks on every decoder layer of the HF model: layer dropout, and keeping the hidden
    states that exits read. The forward itself is the model's own (transformers' body module), so
    training runs wherever the model does; outside `with`, the model is untouched.

    keep: the exits k whose input (the output of layer k-1) is kept in `states`."""

    def __init__(self, layers: torch.nn.ModuleList):
        self.layers = layers
        self.device = next(layers.parameters()).device
        self.drop: torch.Tensor | None = None  # [L, batch] bool on the model's device; see `dropout`
        self.skips: list[bool] | None = None  # per layer: is it dropped for any row (known without a device sync)
        self.keep: set[int] = set()
        self.states: dict[int, torch.Tensor] = {}  # k -> [batch, seq, hidden]
        self._handles = []

    def dropout(self, draw: torch.Tensor | None) -> None:
        """This step's layer dropout: draw [L, batch] bool on the CPU, True = that layer returns its
        input for that row (skipped whole: its output is computed and discarded, which costs the mean
        rate, about 0.44·p_max, of the layers' time and keeps the batch in one kernel call); None: off."""
        self.skips = None if draw is None else draw.any(1).tolist()
        self.drop = None if draw is None else draw.to(self.device)

    def __enter__(self) -> Exits:
        self._handles = [layer.register_forward_hook(self._hook(i), with_kwargs=True)
                         for i, layer in enumerate(self.layers)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self.states = [], {}

    def _hook(self, i: int):
        def hook(module, args, kwargs, output):
            out = output[0] if isinstance(output, tuple) else output
            changed = self.skips is not None and self.skips[i]
            if changed:
                h_in = args[0] if args else kwargs["hidden_states"]
                out = torch.where(self.drop[i].view(-1, 1, 1), h_in, out)
            if i + 1 in self.keep:
                self.states[i + 1] = out
            if changed:
                return (out, *output[1:]) if isinstance(output, tuple) else out
            return None
        return hook


@dataclass
class Batch:
    ids: torch.Tensor  # [b, n] long, right-padded
    mask: torch.Tensor | None  # [b, n] attention mask, None when no row is padded
    labels: torch.Tensor  # [b, n] the next token where it is a training target, else -100


@dataclass
class Document:
    ids: list[int]
    first: int  # ids[first:] are targets, each predicted from the tokens before it; ids[:first] is context (a prompt)


def make_batch(docs: list[Document], pad: int, device) -> Batch:
    """Right-padded, so that every row's positions start at 0 as in decoding; padding is masked and never a target."""
    width = max(len(d.ids) for d in docs)
    ids = torch.full((len(docs), width), pad, dtype=torch.long)
    labels = torch.full((len(docs), width), -100, dtype=torch.long)
    for row, d in enumerate(docs):
        ids[row, :len(d.ids)] = torch.tensor(d.ids)
        first = max(1, d.first)
        labels[row, first - 1:len(d.ids) - 1] = ids[row, first:len(d.ids)]
    padded = any(len(d.ids) < width for d in docs)
    mask = (torch.arange(width) < torch.tensor([len(d.ids) for d in docs])[:, None]).long() if padded else None
    return Batch(ids.to(device), None if mask is None else mask.to(device), labels.to(device))


def exit_logits(adapter, h: torch.Tensor) -> torch.Tensor:
    """The model's shared final norm and LM head on hidden states [b, n, hidden]: [b, n, vocab] float32."""
    logits = adapter.lm_head(adapter.norm(h)).float()
    if adapter.final_softcap is not None:
        logits = torch.tanh(logits / adapter.final_softcap) * adapter.final_softcap
    return logits


def exit_forward(adapter, exits: Exits, batch: Batch, ks) -> dict[int, torch.Tensor]:
    """One forward of the model's body; each exit k in `ks` -> its logits [b, n, vocab]."""
    exits.keep, exits.states = set(ks), {}
    adapter.hf_model.model(input_ids=batch.ids, attention_mask=batch.mask, use_cache=False)
    return {k: exit_logits(adapter, exits.states[k]) for k in ks}


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


# -- data -----------------------------------------------------------------------------------------


@dataclass
class Data:
    train: list[Document]  # windows of at most seq_len tokens
    held_out: list[Document]  # windows of the held-out documents, for the losses
    prompts: list[list[int]]  # held-out prompts, for α on the model's own greedy output
    source: str  # what it is, for the report


def read_data(path: str | Path) -> tuple[list[str], list[str]]:
    """(plain texts, prompts) from a .txt file (one text) or a .jsonl file (rows with "text" are
    texts; rows with "turns" (the first turn is used) or "prompt" are prompts)."""
    path = Path(path)
    try:
        content = path.read_text(encoding="utf-8")
    except OSError as err:
        raise FileNotFoundError(f"cannot read --data {path}: {err.strerror}") from None
    if path.suffix != ".jsonl":
        if not content.strip():
            raise ValueError(f"{path} is empty")
        return [content], []
    texts, prompts = [], []
    for line_no, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if isinstance(row.get("text"), str):
                texts.append(row["text"])
                continue
            prompt = row["turns"][0] if "turns" in row else row["prompt"]
            if not isinstance(prompt, str):
                raise TypeError("not text")
            prompts.append(prompt)
        except (json.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError) as err:
            raise ValueError(f"{path}:{line_no}: needs 'text' (plain text), or 'turns' or 'prompt' (a prompt "
                             f"the model answers): {err}") from None
    if not texts and not prompts:
        raise ValueError(f"no rows in {path}")
    return texts, prompts


@torch.no_grad()
def self_generated(model, prompts: list[str], max_new_tokens: int, *, batch_size: int = 32,
                   progress: bool = True) -> list[Document]:
    """Each prompt (chat template as `generate` applies it) followed by the model's greedy answer,
    EOS included when it stopped: a Document whose targets are the answer. Batched through
    transformers' generate() as calibrate does (a near-tie may break differently than at batch 1:
    harmless for training data)."""
    from transformers import GenerationConfig

    encoded = [model.encode(p) for p in prompts]
    eos = sorted(model.eos_ids)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                              pad_token_id=eos[0] if eos else 0)
    docs: dict[int, Document] = {}
    device = model.adapter.device
    bar = tqdm(total=len(encoded), desc="generate", unit="prompt", file=sys.stderr, disable=not progress)
    for batch in length_batches(encoded, batch_size, 8192):
        ids, mask = left_padded([encoded[i] for i in batch], config.pad_token_id)
        out = model.hf_model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=config)
        for row, i in enumerate(batch):
            answer = out[row, ids.shape[1]:].tolist()
            end = next((j + 1 for j, t in enumerate(answer) if t in model.eos_ids), len(answer))
            docs[i] = Document(encoded[i].tolist() + answer[:end], encoded[i].numel())
        bar.update(len(batch))
    bar.close()
    return [docs[i] for i in range(len(encoded))]


def text_documents(model, texts: list[str], seq_len: int) -> list[Document]:
    """Plain texts tokenised and cut into documents of seq_len tokens, every token but the first a target."""
    if model.tokenizer is None:
        raise ValueError("training on text needs the model's tokenizer")
    docs = []
    for text in texts:
        ids = model.tokenizer(text)["input_ids"]
        docs += [Document(ids[i:i + seq_len], 1) for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) > 1]
    return docs


def windows(docs: list[Document], seq_len: int) -> list[Document]:
    """Documents cut into windows of at most seq_len tokens (a window's first token is context only);
    windows without a target are dropped."""
    out = []
    for d in docs:
        for start in range(0, len(d.ids), seq_len):
            piece = d.ids[start:start + seq_len]
            first = max(1, d.first - start)
            if first < len(piece):
                out.append(Document(piece, first))
    return out


def split(docs: list[Document], seq_len: int, holdout: float, seed: int, source: str) -> Data:
    """Hold out a random `holdout` share of the documents (never trained on); α prompts are their
    prompts, or the first half of a plain-text document."""
    held = held_out_prompts(len(docs), holdout, seed)
    train = [d for d, h in zip(docs, held) if not h]
    held_docs = [d for d, h in zip(docs, held) if h]
    prompts = [d.ids[:d.first] if d.first > 1 else d.ids[:max(1, len(d.ids) // 2)] for d in held_docs]
    return Data(windows(train, seq_len), windows(held_docs, seq_len)[:MAX_HELD_OUT_WINDOWS],
                prompts[:MAX_ALPHA_PROMPTS], source)


# -- evaluation -----------------------------------------------------------------------------------


@dataclass
class Evaluation:
    loss: dict[int, float]  # k -> held-out CE of exit k's prediction; k = L is the full model
    # k -> share of held-out target positions where exit k's argmax is the full model's, teacher-forced on the text
    agree: dict[int, float]
    # k -> α on the model's own greedy outputs of the held-out prompts; empty in the checks during training
    alpha: dict[int, float] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)  # those greedy outputs


@torch.no_grad()
def held_out_losses(model, data: Data, exit_layers: list[int], batch_size: int) -> Evaluation:
    """CE of each exit in `exit_layers` and of the full model on the held-out windows, and the
    exits' teacher-forced agreement with the full model."""
    adapter, n_layers = model.adapter, model.n_layers
    ks = sorted({*exit_layers, n_layers})
    loss_sum, agree_sum, count = dict.fromkeys(ks, 0.0), dict.fromkeys(ks, 0), 0
    pad = sorted(model.eos_ids)[0] if model.eos_ids else 0
    with Exits(adapter.layers) as exits:
        for i in range(0, len(data.held_out), batch_size):
            batch = make_batch(data.held_out[i:i + batch_size], pad, adapter.device)
            logits = exit_forward(adapter, exits, batch, ks)
            target = batch.labels != -100
            n = int(target.sum())
            full = logits[n_layers].argmax(-1)[target]
            for k, lg in logits.items():
                loss_sum[k] += float(cross_entropy(lg, batch.labels)) * n
                agree_sum[k] += int((lg.argmax(-1)[target] == full).sum())
            count += n
    count = max(1, count)
    return Evaluation({k: v / count for k, v in loss_sum.items()},
                      {k: v / count for k, v in agree_sum.items() if k != n_layers})


def greedy_alpha(model, prompts: list[list[int]], exit_layers: list[int],
                 max_new_tokens: int) -> tuple[dict[int, float], list[list[int]]]:
    """α of each exit on the model's own greedy (AR) output of each prompt, by the logit lens over
    that output (tuner/trace.py: exactly what an early-exit draft at k would propose), and the outputs."""
    hits = {k: [] for k in exit_layers}
    outputs = []
    for prompt in prompts:
        tokens = model.generate(prompt, method="ar", max_new_tokens=max_new_tokens).tokens
        outputs.append(tokens)
        t = trace(model.adapter, prompt, tokens, max_new_tokens, exit_layers)
        for k in exit_layers:
            hits[k] += t.hits[k][1:].tolist()  # hits[k][0] is the prefill's token, never drafted
    return {k: sum(h) / max(1, len(h)) for k, h in hits.items()}, outputs


def evaluate(model, data: Data, exit_layers: list[int], batch_size: int, alpha_tokens: int) -> Evaluation:
    result = held_out_losses(model, data, exit_layers, batch_size)
    result.alpha, result.outputs = greedy_alpha(model, data.prompts, exit_layers, alpha_tokens)
    return result


# -- training -------------------------------------------------------------------------------------


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
    optimizer = torch.optim.AdamW([
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": recipe.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ], lr=recipe.lr)
    warmup = max(1, min(100, recipe.steps // 10))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / recipe.steps)))))
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


def prepare(model, path: str | Path | None = None, *, num_prompts: int = 120, max_new_tokens: int = 128,
            seq_len: int = 256, holdout: float = 0.1, seed: int = 0, progress: bool = True) -> Data:
    """The training and held-out data: `path`'s texts and the model's own answers to its prompts
    (read_data), or with no path its answers to the first `num_prompts` bundled training prompts."""
    from selfspec.tools.bench import load_prompts

    if not 0 < holdout < 1:
        raise ValueError(f"the held-out share must be in (0, 1), got {holdout}")
    if path is None:
        texts, prompts = [], [p.text for p in load_prompts(None, 10**9, default="calibration_train.jsonl")]
        source = "the model's greedy answers to bundled calibration_train.jsonl prompts"
    else:
        texts, prompts = read_data(path)
        source = str(path)
    prompts = prompts[:num_prompts]
    docs = text_documents(model, texts, seq_len) if texts else []
    if prompts:
        docs += self_generated(model, prompts, max_new_tokens, progress=progress)
    return split(docs, seq_len, holdout, seed, f"{source}: {len(texts)} text(s), {len(prompts)} prompt(s)")
