"""The documents `selfspec train` trains and evaluates on.

Data: a .txt file (plain text), a .jsonl file (rows with "text" are plain text; rows with "turns" or
"prompt" are prompts, answered by the model itself), or by default the model's own greedy answers
to the bundled training prompts (calibration_train.jsonl, never the benchmark set). Training on
its own outputs teaches the exits exactly the predictions they will be asked to match.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.tools.calibrate.data import held_out_prompts, left_padded, length_batches

MAX_HELD_OUT_WINDOWS = 128  # held-out losses use at most this many windows (keeps each check short)
MAX_ALPHA_PROMPTS = 16  # α is measured on at most this many held-out prompts


@dataclass
class Document:
    ids: list[int]
    first: int  # ids[first:] are targets, each predicted from the tokens before it; ids[:first] is context (a prompt)


@dataclass
class Batch:
    ids: torch.Tensor  # [b, n] long, right-padded
    mask: torch.Tensor | None  # [b, n] attention mask, None when no row is padded
    labels: torch.Tensor  # [b, n] the next token where it is a training target, else -100


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
