"""The examples calibration trains on, read off the model itself.

Terms (beyond those defined in selfspec.core.stats and selfspec.heads.exit_adapter):
  position  one token of a training sequence; its example is "what comes next".
  teacher   p: the full model's next-token distribution at a position, kept as its TOP most likely
            token ids and log-probabilities.

Data: the model's own greedy continuations of prompts (what the draft will see when decoding),
read off while they are generated: each forward of generate() holds h_k and the final hidden
state at the positions it computes, which is all that teacher forcing the output would
recompute. Besides the outputs' positions, the prompts' own positions (computed by the prefill
anyway) are examples too: three times the data for nothing on the bundled set, which keeps the
adapter from overfitting. Plain text given is teacher-forced, one full forward per window. The
base model is frozen throughout. The split is by prompt: held-out prompts are never trained on,
and α is measured on their outputs, where drafts run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

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
