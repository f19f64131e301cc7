"""`selfspec calibrate --head feature`: train the feature head (selfspec.heads.feature_head).

Data: the model's own greedy continuation of each prompt, decoded by the engine in the dtype the
model was loaded in (the outputs a draft must match), then one teacher-forced forward over prompt
and output that keeps the final state h_L and the model's top-64 next-token log-probabilities at
every position. Every position is both context and an example; α is reported on the output
positions of held-out prompts (split by prompt, seeded).

Loss, per example position t (its input: h_L(t-1) and x_t): KL from the model's distribution at t
(top 64 plus "everything else", selfspec.tools.calibrate.loss) to the draft's, through the pruned
draft head in float32, plus `regression` × smooth-L1 between the RMS-normalised predicted and true
h_L(t): it keeps the prediction usable as the next draft step's input.

α by draft position is measured the way the drafter runs: from each output position of a held-out
prompt, the head steps on its own predictions (not the true states) while its tokens agree with
the model's, up to DEPTH steps (`drafted_runs`).
"""

from __future__ import annotations

import copy
import hashlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from selfspec.heads import draft_head
from selfspec.tools.calibrate.data import TOP, held_out_prompts, text_windows
from selfspec.tools.calibrate.loss import distill_loss
from selfspec.tools.optim import adamw_cosine, descend
from selfspec.tools.context_calibrate import MISSING, alpha_by_position
from selfspec.heads.feature_head import FeatureHead
from selfspec.model.quantize import float_weight

DEPTH = 4  # draft positions α is reported for


@dataclass
class FeatureSequence:
    """One prompt and the model's output, teacher-forced."""

    ids: torch.Tensor  # [T] long: prompt then output
    n_prompt: int
    final: torch.Tensor  # [T, d] h_L, the model's dtype
    teacher_ids: torch.Tensor  # [T, TOP] long: the model's top tokens after each position
    teacher_logp: torch.Tensor  # [T, TOP] float32
    prompt: int = -1  # the prompt's index (the held-out split is by prompt); -1: its position in the data
    sampled: bool = False  # a sampled continuation (training only: α is measured on greedy ones)
    text: bool = False  # a window of plain text (--text): training only, never held out nor counted for the draft head
    train_only: bool = False  # an --extra-prompts prompt and its output: training only, never held out


@torch.inference_mode()
def feature_data(model, prompts: list[torch.Tensor], max_new_tokens: int, progress: bool = True,
                 samples: int = 0, temperature: float = 0.8, seed: int = 0) -> list[FeatureSequence]:
    """Decode each prompt greedily with the engine (`auto`: the fastest lossless method tuned or
    shipped for this model, so the same tokens as plain decoding), and `samples` more times at
    `temperature` (more training text: the teacher is still the model's own distribution at every
    position); then read final states and the teacher off one forward over prompt + output.

    One prompt at a time: on a 2-core CPU the fused one-row step decodes faster than continuous
    batching (`generate_batch`, PyTorch's batched path): 8 prompts × 64 tokens took 4.4 s one at a
    time against 5.2 s batched (SmolLM2, bfloat16, 2-core AMD EPYC)."""
    adapter = model.adapter
    out = []
    bar = tqdm(total=len(prompts) * (1 + samples), desc="generate", unit="output", file=sys.stderr,
               disable=not progress)
    for index, ids in enumerate(prompts):
        room = adapter.max_positions - ids.numel()
        for copy_ in range(1 + samples):
            bar.update()
            if room < 2:
                continue
            sampling = {} if copy_ == 0 else dict(temperature=temperature, seed=seed + copy_ * len(prompts) + index)
            tokens = model.generate(ids.tolist(), method="auto", max_new_tokens=min(max_new_tokens, room - 1),
                                    **sampling).tokens
            seq = torch.cat([ids, torch.tensor(tokens, dtype=torch.long)])
            out.append(_teacher_forced(adapter, seq, ids.numel(), index, sampled=copy_ > 0))
    bar.close()
    return out


def _teacher_forced(adapter, seq: torch.Tensor, n_prompt: int, index: int, sampled: bool = False,
                    text: bool = False) -> FeatureSequence:
    """One forward over `seq` keeping h_L and the model's top-TOP log-probabilities at every position."""
    n_layers, hidden = adapter.n_layers, adapter.embed_tokens.embedding_dim
    cache = adapter.new_cache(seq.numel())
    cache.keep_exit_states(n_layers, hidden)
    h = adapter.run_layers(adapter.embed(seq.to(adapter.device)), range(n_layers), 0, cache)
    teacher = adapter.head(h).log_softmax(-1).topk(min(TOP, adapter.lm_head.out_features - 1))
    return FeatureSequence(seq, n_prompt, cache.exit_states[:seq.numel()].cpu().clone(), teacher.indices.cpu(),
                           teacher.values.float().cpu(), index, sampled, text)


@torch.inference_mode()
def text_data(model, texts: list[str], window: int = 512, progress: bool = True) -> list[FeatureSequence]:
    """Plain text as training data: consecutive windows of `window` tokens, each teacher-forced once
    (no decoding, so about five times the positions a second of decoding gives here). The teacher
    is still the model's own distribution at every position; only the text is not its own."""
    windows = [w.ids for text in texts for w in text_windows(model, text, window)]
    return [_teacher_forced(model.adapter, torch.tensor(ids, dtype=torch.long), 0, -1, text=True)
            for ids in tqdm(windows, desc="teacher-force text", unit="window", file=sys.stderr, disable=not progress)]


class Student:
    """The draft's logits in float32: the model's final norm and the pruned (or full) head rows,
    dequantized where the head is int8 and copied to float32 so the head trains in float32 whatever the model's dtype. The teacher's
    tokens outside the subset are mapped to one extra column of logit MISSING (q = 0 there)."""

    def __init__(self, adapter, token_ids: torch.Tensor):
        device = adapter.lm_head.weight.device
        # dequantized where the head is int8 (int8 and int4 models): the rows the drafter will use
        self.weight = float_weight(adapter.lm_head, token_ids.to(device)).float()  # the model's: every tensor here lives beside its head
        self.ids = token_ids.to(device)
        self.norm = copy.deepcopy(adapter.norm).float().requires_grad_(False)
        self.softcap = adapter.final_softcap
        self.index = torch.full((adapter.lm_head.out_features,), len(token_ids), dtype=torch.long, device=device)
        self.index[self.ids] = torch.arange(len(token_ids), device=device)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, d] float32 -> [m, N + 1]."""
        logits = F.linear(self.norm(x), self.weight)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return torch.cat([logits, logits.new_full((logits.shape[0], 1), MISSING)], dim=1)

    def teacher(self, ids: torch.Tensor, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.index[ids]
        return ids, logp.masked_fill(ids == len(self.ids), MISSING)

    def loss(self, predicted: torch.Tensor, teacher_ids: torch.Tensor, teacher_logp: torch.Tensor,
             true: torch.Tensor, regression: float) -> torch.Tensor:
        """The head's training loss on predicted final states [m, d] (see the module docstring):
        the KL to the teacher's top tokens through this draft head, plus `regression` × smooth-L1
        between the RMS-normalised prediction and the true h_L [m, d]."""
        ids, logp = self.teacher(teacher_ids, teacher_logp)
        loss = distill_loss(self.logits(predicted), ids, logp).mean()
        return loss + regression * F.smooth_l1_loss(_rms(predicted), _rms(true))

    def token(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's greedy tokens (full-vocabulary ids) from [m, N + 1] logits."""
        return self.ids[logits[:, :-1].argmax(-1)]


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Batches:
    """Training batches: whole sequences, zero-padded, their inputs in float32."""

    def __init__(self, data: list[FeatureSequence], embed):
        self.data, self.embed = data, embed

    def inputs(self, chosen: list[int], starts: list[int] | None = None,
               window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """previous [B, T, d] (h_L one position back) and embedded [B, T, d] of sequences `chosen`,
        each from position starts[b] (default 0) for at most `window` positions (default all)."""
        starts = starts or [0] * len(chosen)
        spans = [min(self.data[s].ids.numel() - b, window or 10**9) for s, b in zip(chosen, starts)]
        d = self.data[chosen[0]].final.shape[1]
        previous = torch.zeros(len(chosen), max(spans), d)
        ids = torch.zeros(len(chosen), max(spans), dtype=torch.long)
        for row, (s, b, n) in enumerate(zip(chosen, starts, spans)):
            x = self.data[s]
            lo = max(b - 1, 0)
            previous[row, 1 + lo - b:n] = x.final[lo:b + n - 1].float()
            ids[row, :n] = x.ids[b:b + n]
        return previous, self.embed(ids)


@torch.no_grad()
def drafted_runs(head: FeatureHead, student: Student, batches: Batches, chosen: list[int],
                 depth: int = DEPTH) -> list[int]:
    """For every output position t of sequences `chosen` (a round's start, pending token x_t):
    how many draft tokens in a row the head gets right when it drafts on its own predictions,
    as FeatureDraft does, up to `depth`."""
    was_training = head.training
    head.eval()
    runs = []
    for s in chosen:
        x = batches.data[s]
        n = x.ids.numel()
        previous, embedded = batches.inputs([s])
        inputs = head.inputs(previous, embedded)  # [1, n, d], the committed positions' s
        kv = head.new_kv(n + depth + 1, dtype=torch.float32, device="cpu")
        head.block.extend(inputs, 0, kv)
        for t in range(x.n_prompt, n - 1):
            kv.rewind(t)
            s_t, run = inputs[:, t:t + 1], 0
            for j in range(min(depth, n - 1 - t)):
                f = head.block.step(s_t, t + j, kv)
                token = student.token(student.logits(f[0]))
                if int(token) != int(x.teacher_ids[t + j, 0]):
                    break
                run += 1
                s_t = head.inputs(f, batches.embed(token.view(1, 1)))
            runs.append(run)
    head.train(was_training)
    return runs


@dataclass
class FeatureTrained:
    head: FeatureHead
    alpha_before: list[float]  # α by draft position, held out, before training
    alpha_after: list[float]
    train_alpha_after: list[float]  # on as many training prompts: the overfitting check
    steps: int
    seconds: float
    train_positions: int
    held_out_positions: int
    data_seconds: float = 0.0
    draft_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def summary(self) -> dict:
        return {"alpha_before": [round(a, 4) for a in self.alpha_before],
                "alpha_after": [round(a, 4) for a in self.alpha_after],
                "train_alpha_after": [round(a, 4) for a in self.train_alpha_after],
                "steps": self.steps, "train_seconds": round(self.seconds, 1),
                "data_seconds": round(self.data_seconds, 1), "train_positions": self.train_positions,
                "held_out_positions": self.held_out_positions, "params": self.head.n_params,
                "draft_vocab": int(self.draft_ids.numel())}


def train_feature_head(adapter, data: list[FeatureSequence], *, steps: int = 2000, sequences: int = 8,
                       positions: int = 256, lr: float = 3e-3, weight_decay: float = 0.01, regression: float = 1.0,
                       width: int | None = None, heads: int = 4, head_dim: int = 64, draft_vocab: int = 8192,
                       holdout: float = 0.1, seed: int = 0, eval_every: int = 0, window: int = 512,
                       noise: float = 0.0, parts: int = 1, progress: bool = True) -> FeatureTrained:
    """Fit a new feature head on `data` (sequences of one model); see the module docstring. A
    step trains on `sequences` windows of at most `window` consecutive positions (the head's
    attention sees those), `positions` examples drawn among them. noise: Gaussian noise of this
    many RMS units added to the previous-state inputs (EAGLE's remedy for drafting on its own,
    imperfect predictions). parts: the data's `final` holds that many layers' states side by side,
    h_L last (FeatureHead's fused inputs; an experiment)."""
    if min(steps, sequences, positions, draft_vocab) < 1 or not lr > 0:
        raise ValueError("steps, sequences, positions and draft_vocab must be >= 1 and the learning rate > 0")
    data = [x for x in data if x.ids.numel() > 2]
    # each sequence's prompt, the unit of the held-out split; plain text and extra prompts have none, so they train
    prompts = [None if x.text or x.train_only else x.prompt if x.prompt >= 0 else i for i, x in enumerate(data)]
    names = sorted({p for p in prompts if p is not None})
    held = held_out_prompts(len(names), holdout, seed)
    held_names = {name for name, h in zip(names, held.tolist()) if h}
    train = [i for i, p in enumerate(prompts) if p not in held_names]
    held_out = [i for i, p in enumerate(prompts) if p in held_names and not data[i].sampled]
    generator = torch.Generator().manual_seed(seed)
    greedy = [i for i in train if not data[i].sampled and not data[i].text]
    seen = [greedy[i] for i in torch.randperm(len(greedy), generator=generator)[:len(held_out)].tolist()]
    # the draft head's tokens: the prompts' and the model's outputs', not the plain text's
    counts = draft_head.count_tokens([data[i].ids for i in train if not data[i].text], adapter.lm_head.out_features)
    draft_ids = draft_head.rank_tokens(counts)[:min(draft_vocab, adapter.lm_head.out_features)]
    student = Student(adapter, draft_ids)
    embedding = adapter.embed_tokens

    def embed(ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids.to(adapter.device)).float().cpu()

    batches = Batches(data, embed)
    hidden = data[0].final.shape[1] // parts
    torch.manual_seed(seed)
    head = FeatureHead(hidden, adapter.n_layers, heads, head_dim, width, parts=parts)
    t0 = time.perf_counter()
    before = alpha_by_position([torch.tensor(drafted_runs(head, student, batches, held_out))], DEPTH)
    optimizer, schedule = adamw_cosine(head.parameters(), steps, lr, weight_decay)
    head.train().requires_grad_(True)
    per_sequence = max(1, positions // sequences)
    loss_avg, alpha = None, before[0]
    bar = tqdm(range(steps), desc="train feature head", unit="step", file=sys.stderr, disable=not progress)
    for step in bar:
        chosen = [train[i] for i in torch.randint(len(train), (min(sequences, len(train)),), generator=generator)]
        lengths = torch.tensor([data[s].ids.numel() for s in chosen])
        starts = (torch.rand(len(chosen), generator=generator) * (lengths - window).clamp_min(0)).long()
        spans = (lengths - starts).clamp_max(window)
        # Examples at window offsets >= 1 (position 0 has no previous state) and short of the
        # sequence's last position (whose teacher follows the data's end).
        last = spans - 1 - (starts + spans == lengths).long()
        where = 1 + (torch.rand(len(chosen), per_sequence, generator=generator) * last[:, None].clamp_min(1)).long()
        previous, embedded = batches.inputs(chosen, starts.tolist(), window)
        if noise:
            scale = previous.pow(2).mean(-1, keepdim=True).sqrt()
            previous = previous + noise * scale * torch.randn(previous.shape, generator=generator)
        predicted = head(previous, embedded, where).flatten(0, 1)  # [B·m, d]
        rows = [(data[s], where[r] + starts[r]) for r, s in enumerate(chosen)]
        loss = student.loss(predicted, torch.cat([x.teacher_ids[w] for x, w in rows]),
                            torch.cat([x.teacher_logp[w] for x, w in rows]),
                            torch.cat([x.final[w, -hidden:].float() for x, w in rows]), regression)
        loss_avg = descend(optimizer, schedule, loss, loss_avg)
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            alpha = alpha_by_position([torch.tensor(drafted_runs(head, student, batches, held_out))], 1)[0]
        bar.set_postfix(loss=f"{loss_avg:.3f}", held_out_alpha=f"{alpha:.3f}")
    bar.close()
    head.eval().requires_grad_(False)
    after = alpha_by_position([torch.tensor(drafted_runs(head, student, batches, held_out))], DEPTH)
    train_after = alpha_by_position([torch.tensor(drafted_runs(head, student, batches, seen))], DEPTH)
    n_train = sum(data[i].ids.numel() - 2 for i in train)
    n_held = sum(data[i].ids.numel() - 1 - data[i].n_prompt for i in held_out)
    return FeatureTrained(head, before, after, train_after, steps, time.perf_counter() - t0, n_train, n_held,
                          draft_ids=draft_ids)


def calibrate_feature(model, prompts: list, *, max_new_tokens: int = 128, samples: int = 0,
                      temperature: float = 0.8, progress: bool = True, data_path=None, texts: list[str] = (),
                      extra_prompts: list = (), **training) -> FeatureTrained:
    """Make the data from `prompts` (text or token ids; `samples` sampled continuations each
    besides the greedy one), from `extra_prompts` (decoded alike, training only: the held-out
    split stays the one `prompts` alone give) and from plain `texts` (`text_data`: training only)
    and train a feature head on it (`train_feature_head`'s options).
    data_path: a file keeping the data (written after it is made; read instead of decoding again
    when it holds data made for this model from these prompts with these settings). Nothing else
    is saved: see `save`."""
    def encode(ps: list) -> list[torch.Tensor]:
        return [torch.as_tensor(model.encode(p) if isinstance(p, str) else p, dtype=torch.long) for p in ps]

    def digest(ids: list[torch.Tensor]) -> str:
        return hashlib.sha256(b"".join(x.numpy().tobytes() + b"|" for x in ids)).hexdigest()

    t0 = time.perf_counter()
    encoded, extra = encode(prompts), encode(extra_prompts)
    key = dict(identity=model.identity.slug(), dtype=str(model.adapter.dtype), max_new_tokens=max_new_tokens,
               samples=samples, temperature=temperature, seed=training.get("seed", 0),
               prompts=digest(encoded))
    if texts:  # (a key without texts or extra prompts stays as it was, so data kept before them still loads)
        key["texts"] = hashlib.sha256("\x00".join(texts).encode()).hexdigest()
    if extra:
        key["extra_prompts"] = digest(extra)
    data = load_data(data_path, key) if data_path else None
    if data is None:
        data = feature_data(model, encoded, max_new_tokens, progress=progress, samples=samples,
                            temperature=temperature, seed=training.get("seed", 0))
        for x in feature_data(model, extra, max_new_tokens, progress=progress, samples=samples,
                              temperature=temperature, seed=training.get("seed", 0) + 1):
            x.train_only = True
            data.append(x)
        data += text_data(model, list(texts), progress=progress)
        if data_path:
            save_data(data_path, key, data)
    if len(data) < 2:
        raise ValueError("need at least 2 prompts that fit the model's context, to hold some out")
    data_seconds = time.perf_counter() - t0
    trained = train_feature_head(model.adapter, data, progress=progress, **training)
    trained.data_seconds = data_seconds
    return trained


def save_data(path, key: dict, data: list[FeatureSequence]) -> None:
    """Keep the data in `path` (torch.save, written atomically) with the settings that made it."""
    path = Path(path)
    scratch = path.with_name(path.name + ".tmp")
    torch.save({"key": key, "data": [vars(x) for x in data]}, scratch)
    scratch.replace(path)


def load_data(path, key: dict) -> list[FeatureSequence] | None:
    """The data kept in `path` if it was made with settings `key`, else None (and why, on stderr)."""
    path = Path(path)
    if not path.is_file():
        return None
    kept = torch.load(path, weights_only=True)
    held = kept.get("key") or {}
    # data made with more (--extra-prompts, --text) serves a run without them: those sequences are dropped
    more = {name: flag for name, flag in (("extra_prompts", "train_only"), ("texts", "text")) if name in held}
    if {k: v for k, v in held.items() if k not in more or k in key} != key:
        print(f"selfspec: {path} holds data made with other settings or prompts; decoding again", file=sys.stderr)
        return None
    drop = [flag for name, flag in more.items() if name not in key]
    return [FeatureSequence(**x) for x in kept["data"] if not any(x.get(flag) for flag in drop)]


def save(trained: FeatureTrained, identity, directory=None, setup: dict | None = None, dtype=torch.float32):
    """Write the head (feature_head.default_path, in `directory` or beside the profiles; its weights
    in `dtype`) and point the model's profile at it; returns (head path, profile path)."""
    from selfspec.heads.feature_head import SECTION, default_path, save_feature_head
    from selfspec.model.profiles import save_section

    summary = {**trained.summary(), **(setup or {})}
    path = save_feature_head(trained.head, default_path(identity, directory), identity, trained.draft_ids, summary,
                             dtype=dtype)
    profile = save_section(identity, SECTION, {"path": str(path.resolve()), "alpha_after": summary["alpha_after"],
                                               "params": trained.head.n_params})
    return path, profile


def table(trained: FeatureTrained) -> str:
    """α by draft position, held out before/after and on training prompts, as a Markdown table."""
    rows = ["| α at draft position | " + " | ".join(str(j + 1) for j in range(len(trained.alpha_after))) + " |",
            "|---|" + "---|" * len(trained.alpha_after)]
    for name, alphas in (("held out, before", trained.alpha_before), ("held out, after", trained.alpha_after),
                         ("training prompts, after", trained.train_alpha_after)):
        rows.append(f"| {name} | " + " | ".join(f"{a:.3f}" for a in alphas) + " |")
    return "\n".join(rows)
