"""`selfspec calibrate`: train an exit adapter for each exit layer k by distillation from the model itself.

Terms (beyond those defined in selfspec.core.stats and selfspec.heads.exit_adapter):
  position  one token of a training sequence; its example is "what comes next".
  teacher   p: the full model's next-token distribution at a position.
  student   q = softmax(head(A(h_k))): the early-exit draft's distribution with exit adapter A.
  α         here: the share of held-out positions where argmax q = argmax p. On greedy output this
            is the acceptance rate of the first draft token (see tuner/trace.py), the figure the
            adapter exists to raise.

Data: the model's own greedy continuations of prompts (what the draft will see when decoding),
read off while they are generated: each forward of generate() holds h_k and the final hidden
state at the positions it computes, which is all that teacher forcing the output would
recompute. Besides the outputs' positions, the prompts' own positions (computed by the prefill
anyway) are examples too: three times the data for nothing on the bundled set, which keeps the
adapter from overfitting. Plain text given is teacher-forced, one full forward per window. The
base model is frozen throughout. The split is by prompt: held-out prompts are never trained on,
and α is measured on their outputs, where drafts run.

Loss: a [positions, vocab] teacher table would be 49k floats per position for SmolLM2, so the
teacher is kept as its top TOP token ids and log-probabilities, and the KL is taken between p and
q coarsened to those tokens plus one outcome "everything else":
    KL = Σ_top p_i·log(p_i / q_i) + p_rest·log(p_rest / q_rest).
It is exact where agreement is decided (the teacher's likely tokens), never exceeds the full
KL, and still charges q for mass it spreads outside the teacher's top tokens (q_rest). The
student's logits span the full vocabulary: the head's forward and backward are the main cost of
a step.

Also counted: how often each token occurs in the prompts and the model's outputs, ranked and saved
for the pruned draft head (selfspec.heads.draft_head, `--draft-vocab N`).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.heads import context_head, draft_head
from selfspec.heads.context_head import ContextHead
from selfspec.heads.exit_adapter import SECTION, ExitAdapter, default_path, save_exit_adapter
from selfspec.model.profiles import save_section
from selfspec.tools.tune.trace import exit_states

TOP = 64  # teacher tokens kept per position


@dataclass
class Positions:
    """Examples, one row per position: the draft's input, the teacher, and where it came from."""

    hidden: dict[int, torch.Tensor]  # k -> h_k [n, hidden], float32
    teacher_ids: torch.Tensor  # [n, top] long, most likely first
    teacher_logp: torch.Tensor  # [n, top] float32
    prompt: torch.Tensor  # [n] long: index of the prompt it came from; -1 for plain text
    output: torch.Tensor  # [n] bool: the position of an output token (where drafts run), not of the prompt

    def __len__(self) -> int:
        return self.teacher_ids.shape[0]

    @classmethod
    def cat(cls, parts: list[Positions]) -> Positions:
        return cls({k: torch.cat([p.hidden[k] for p in parts]) for k in parts[0].hidden},
                   *(torch.cat([getattr(p, name) for p in parts])
                     for name in ("teacher_ids", "teacher_logp", "prompt", "output")))

    def rows(self, index: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.hidden[k][index], self.teacher_ids[index], self.teacher_logp[index]


@dataclass
class Trained:
    """One exit layer's adapter and how it did."""

    adapter: ExitAdapter
    alpha_before: float  # held-out α of plain early exit (the untrained adapter)
    alpha_after: float  # held-out α with the trained adapter
    kl_before: float  # held-out KL (nats per position)
    kl_after: float
    train_alpha_after: float  # α on (a sample of) the training positions: the gap shows overfitting
    steps: int
    seconds: float

    def summary(self) -> dict:
        return dict(alpha_before=round(self.alpha_before, 4), alpha_after=round(self.alpha_after, 4),
                    kl_before=round(self.kl_before, 4), kl_after=round(self.kl_after, 4),
                    train_alpha_after=round(self.train_alpha_after, 4), steps=self.steps,
                    seconds=round(self.seconds, 1))


@dataclass
class Calibration:
    trained: dict[int, Trained]  # by k
    train_positions: int
    train_outputs: int  # of which positions of output tokens (the rest: prompts and plain text)
    held_out_positions: int
    sequences: int
    model_params: int
    data_seconds: float  # generating and teacher-forcing the data
    paths: dict[int, Path] = field(default_factory=dict)  # by k, once saved
    profile: Path | None = None
    token_counts: torch.Tensor | None = None  # [vocab]: the prompts' and outputs' tokens, for the draft head
    draft_head_path: Path | None = None  # once saved

    @property
    def best(self) -> int:
        return max(self.trained, key=lambda k: self.trained[k].alpha_after)

    def table(self) -> str:
        rows = ["| k | α before | α after | α train | KL before | KL after | params | share | train s |",
                "|---|---|---|---|---|---|---|---|---|"]
        for k, t in sorted(self.trained.items()):
            n = t.adapter.n_params
            rows.append(f"| {k} | {t.alpha_before:.3f} | {t.alpha_after:.3f} | {t.train_alpha_after:.3f} | "
                        f"{t.kl_before:.3f} | {t.kl_after:.3f} | {n / 1e6:.2f}M | {n / self.model_params:.2%} | "
                        f"{t.seconds:.0f} |")
        return "\n".join(rows)

    def to_json(self) -> dict:
        return dict(
            train_positions=self.train_positions, train_outputs=self.train_outputs,
            held_out_positions=self.held_out_positions,
            sequences=self.sequences, model_params=self.model_params, data_seconds=round(self.data_seconds, 1),
            best_exit_layer=self.best, profile=str(self.profile) if self.profile else None,
            draft_head=str(self.draft_head_path) if self.draft_head_path else None,
            exit_layers={str(k): {**t.summary(), "params": t.adapter.n_params, "path": str(self.paths.get(k, ""))}
                         for k, t in sorted(self.trained.items())},
        )


# -- data ---------------------------------------------------------------------------------------


@dataclass
class Sequence:
    """A teacher-forced training sequence (plain text)."""

    ids: list[int]
    first: int  # positions first .. len(ids)-1 are examples; earlier ones are context only


@torch.no_grad()
def self_distillation(model, prompts: list[torch.Tensor], exit_layers: list[int], max_new_tokens: int, *,
                      prompt_examples: bool = True, batch_size: int = 32, batch_tokens: int = 8192,
                      progress: bool = True, outputs: dict[int, list[int]] | None = None,
                      first_position: bool = False) -> Positions:
    """The model's greedy continuation of each prompt (ids [n]), and the examples read off it.

    Prompts run in batches through transformers' generate(), left-padded, similar lengths together,
    at most `batch_size` rows and `batch_tokens` padded prompt tokens: on a CPU several times
    faster than decoding one by one. Forward hooks keep h_k (the output of layer k-1) and the final
    hidden state at every position each forward computes. Examples: the positions of output tokens
    (the ones a draft is fed), and with prompt_examples those of the prompt after its first token
    (the prefill computed them anyway). In a batch a near-tie can break differently from batch 1:
    harmless for training data. `outputs`, if a dict, receives each prompt's output tokens by
    prompt index (up to and including its EOS). first_position: keep the prompt's first position
    too (with prompt_examples), so that each prompt's rows are its whole sequence (the context
    head's training data: every position is context)."""
    from transformers import GenerationConfig

    adapter = model.adapter
    eos = sorted(model.eos_ids)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                              pad_token_id=eos[0] if eos else 0)
    layers = [*exit_layers, adapter.n_layers]  # the last one's output is the final hidden state
    steps: dict[int, list[torch.Tensor]] = {}  # layer count -> its output [rows, positions, hidden] per forward

    def keep(k):
        def hook(module, args, output):
            steps.setdefault(k, []).append(output.float().cpu())
        return hook

    hooks = [adapter.layers[k - 1].register_forward_hook(keep(k)) for k in layers]
    parts = []
    bar = tqdm(total=len(prompts), desc="generate", unit="prompt", file=sys.stderr, disable=not progress)
    try:
        for batch in length_batches(prompts, batch_size, batch_tokens):
            steps.clear()
            ids, mask = left_padded([prompts[i] for i in batch], config.pad_token_id)
            out = model.hf_model.generate(ids.to(adapter.device), attention_mask=mask.to(adapter.device),
                                          generation_config=config)
            width = ids.shape[1]
            generated = out[:, width:].tolist()  # step t >= 1 was fed generated token t-1
            for row, i in enumerate(batch):
                tokens = generated[row]
                n = next((j for j, t in enumerate(tokens) if t in model.eos_ids), len(tokens))
                if outputs is not None:
                    outputs[i] = tokens[:n + 1]
                fed = range(1, min(n, len(tokens) - 1) + 1)  # steps fed an output token (not EOS or padding)
                first = width - prompts[i].numel() + (0 if first_position else 1)
                start = first if prompt_examples else width  # prefill columns kept
                states = {k: torch.cat([steps[k][0][row, start:], *(steps[k][t][row] for t in fed)]) for k in layers}
                n_prompt = width - start
                parts.append(_examples(adapter, states, i, n_prompt))
            bar.update(len(batch))
    finally:
        for hook in hooks:
            hook.remove()
        bar.close()
    order = torch.cat([p.prompt for p in parts]).argsort(stable=True)  # back to prompt order
    merged = Positions.cat(parts)
    return Positions({k: h[order] for k, h in merged.hidden.items()},
                     *(getattr(merged, name)[order] for name in ("teacher_ids", "teacher_logp", "prompt", "output")))


def _examples(adapter, states: dict[int, torch.Tensor], prompt: int, n_prompt: int, top: int = TOP,
              chunk: int = 512) -> Positions:
    """Positions from hidden states [n, hidden] by layer count (the last one, L, the final states):
    the teacher is the model's own head on the final states, its top tokens kept."""
    top = min(top, adapter.lm_head.out_features - 1)  # leave at least one token in "everything else"
    final = states[adapter.n_layers]
    ids, logp = [], []
    for i in range(0, final.shape[0], chunk):  # [chunk, vocab] at a time
        teacher = adapter.head(final[None, i:i + chunk].to(adapter.device, adapter.dtype)).log_softmax(-1).topk(top)
        ids.append(teacher.indices.cpu())
        logp.append(teacher.values.float().cpu())
    n = final.shape[0]
    return Positions(
        {k: h for k, h in states.items() if k != adapter.n_layers},
        torch.cat(ids) if ids else torch.zeros(0, top, dtype=torch.long),
        torch.cat(logp) if logp else torch.zeros(0, top),
        torch.full((n,), prompt, dtype=torch.long),
        torch.arange(n) >= n_prompt,
    )


def length_batches(prompts: list[torch.Tensor], batch_size: int, batch_tokens: int):
    """Prompt indices in batches of similar length: at most batch_size rows, and rows × longest
    prompt at most batch_tokens (one row always)."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i].numel())
    batch: list[int] = []
    for i in order:  # ascending: the prompt added is the batch's longest
        if batch and (len(batch) == batch_size or (len(batch) + 1) * prompts[i].numel() > batch_tokens):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def left_padded(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and attention mask [rows, longest], prompts right-aligned."""
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - p.numel():] = p
        mask[row, width - p.numel():] = 1
    return ids, mask


def text_windows(model, text: str, window: int = 256) -> list[Sequence]:
    """Plain text as training sequences: consecutive windows of `window` tokens, every position
    but the first an example."""
    if model.tokenizer is None:
        raise ValueError("training on plain text needs the model's tokenizer")
    ids = model.tokenizer(text)["input_ids"]
    return [Sequence(ids[i:i + window], 1) for i in range(0, len(ids) - 1, window) if len(ids[i:i + window]) > 1]


@torch.no_grad()
def teacher_force(adapter, sequences: list[Sequence], exit_layers: list[int], prompt: int = -1,
                  progress: bool = True) -> Positions:
    """One full forward per sequence: the examples at its positions first .. end (counted as
    prompt positions of `prompt`, -1 for plain text)."""
    parts = []
    for seq in tqdm(sequences, desc="teacher-force", unit="seq", file=sys.stderr, disable=not progress):
        ids = torch.tensor(seq.ids, dtype=torch.long, device=adapter.device)
        states, final = exit_states(adapter, ids, exit_layers)
        states = {k: h[0, seq.first:].float().cpu() for k, h in [*states.items(), (adapter.n_layers, final)]}
        parts.append(_examples(adapter, states, prompt, len(seq.ids) - seq.first))
    return Positions.cat(parts)


def held_out_prompts(n: int, holdout: float, seed: int) -> torch.Tensor:
    """A random `holdout` share (at least one, never all) of n prompts: a mask [n]."""
    if n < 2:
        raise ValueError(f"need at least 2 prompts to hold some out, got {n}")
    held = torch.zeros(n, dtype=torch.bool)
    held[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:min(n - 1, max(1, round(holdout * n)))]] = True
    return held


# -- training -----------------------------------------------------------------------------------


def student_logits(adapter, exit_adapter: ExitAdapter, h: torch.Tensor) -> torch.Tensor:
    """head(A(h)) for h [n, hidden]: logits [n, vocab] in float32."""
    return adapter.head(exit_adapter(h).to(adapter.dtype).unsqueeze(0))


def distill_loss(logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Per-row KL(p || q) on the teacher's top tokens plus "everything else" (see the module
    docstring); logits [n, vocab], teacher [n, top] -> [n]."""
    return _DistillKL.apply(logits, teacher_ids, teacher_logp)


class _DistillKL(torch.autograd.Function):
    """The coarsened KL with its closed-form gradient, built during the forward in one [n, vocab]
    buffer: d KL / d logit_j is q_j - p_j on the teacher's top tokens and q_j·(1 - p_rest/q_rest)
    elsewhere. Autograd's graph through logsumexp, scatter and gather takes about twice the time
    (several [n, vocab] temporaries per step), which the full-vocabulary head makes the bulk."""

    @staticmethod
    def forward(ctx, logits, teacher_ids, teacher_logp):
        logz = logits.logsumexp(-1, keepdim=True)  # [n, 1]
        logq_top = logits.gather(-1, teacher_ids) - logz  # [n, top]
        q = (logits - logz).exp_().scatter_(-1, teacher_ids, 0.0)  # q outside the top tokens
        q_rest = q.sum(-1).clamp_min(1e-30)  # summed, not 1 - Σ q_top: exact when it is tiny
        p_top = teacher_logp.exp()
        p_rest = (1 - p_top.sum(-1)).clamp_min(0)
        kl = (p_top * (teacher_logp - logq_top)).sum(-1) + torch.xlogy(p_rest, p_rest) - p_rest * q_rest.log()
        if ctx.needs_input_grad[0]:
            grad = q.mul_((1 - p_rest / q_rest)[:, None]).scatter_(-1, teacher_ids, logq_top.exp() - p_top)
            ctx.save_for_backward(grad)
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        (grad,) = ctx.saved_tensors
        return grad * grad_kl[:, None], None, None


def descend(optimizer, schedule, loss: torch.Tensor, loss_avg: float | None) -> float:
    """One optimiser and schedule step on `loss`; returns the running loss average shown on the bar."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    schedule.step()
    value = float(loss.detach())
    return value if loss_avg is None else 0.95 * loss_avg + 0.05 * value


def adamw_cosine(params, steps: int, lr: float, weight_decay: float):
    """AdamW with a linear warm-up (a tenth of the steps, at most 100) then cosine decay to 0."""
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    warmup = max(1, min(100, steps // 10))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    return optimizer, schedule


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


# -- the whole run ------------------------------------------------------------------------------


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


def save(result: Calibration, identity, directory: str | Path | None = None, setup: dict | None = None) -> None:
    """Write every k's adapter or context head (named by default_path, in `directory` or beside the
    profiles) and point the model's profile at the one with the best held-out α after training;
    likewise the token ranking for the pruned draft head."""
    for k, t in result.trained.items():
        summary = {**t.summary(), "train_positions": result.train_positions,
                   "held_out_positions": result.held_out_positions, **(setup or {})}
        if isinstance(t.adapter, ContextHead):
            path = context_head.default_path(identity, k, directory)
            result.paths[k] = context_head.save_context_head(t.adapter, path, identity, summary)
        else:
            result.paths[k] = save_exit_adapter(t.adapter, default_path(identity, k, directory), identity, summary)
    best = result.trained[result.best]
    section = context_head.SECTION if isinstance(best.adapter, ContextHead) else SECTION
    result.profile = save_section(identity, section, {
        "path": str(result.paths[result.best].resolve()), "exit_layer": result.best,
        "alpha_before": round(best.alpha_before, 4), "alpha_after": round(best.alpha_after, 4),
        "params": best.adapter.n_params,
    })
    if result.token_counts is not None:
        path = draft_head.default_path(identity, directory)
        source = {"sequences": result.sequences, **(setup or {})}
        result.draft_head_path = draft_head.save_ranking(result.token_counts, path, identity, source)
        result.profile = save_section(identity, draft_head.SECTION, {
            "path": str(result.draft_head_path.resolve()), "tokens": int(result.token_counts.sum()),
            "coverage": {str(n): round(c, 4) for n, c in draft_head.coverage(result.token_counts).items()},
        })


def _on(rows: tuple, device) -> tuple:
    return tuple(t.to(device) for t in rows)
