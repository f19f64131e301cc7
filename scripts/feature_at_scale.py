"""The feature head trained at a GPU's data scale: does more of the model's own text lift α?

On 2 CPU cores `selfspec calibrate --head feature` makes 160k-320k positions (438 Spec-Bench
questions, greedy outputs, 27-53 min), and held-out α at the first draft token stayed at ~0.31
whatever else changed (README, "The feature head"). EAGLE trains on tens of thousands of
conversations. This script makes data at that scale on a GPU, in one command, and trains heads on it:

1. **Prompts the model writes itself** (Magpie's idea, Xu et al. 2024): the chat template up to the
   user's turn, sampled at T = 1, gives a new user request each time (SmolLM2-135M-Instruct writes
   requests like "Can you help me plan a fundraising challenge?"). Kept when they end and are new.
2. **The model's greedy answers** to those, to the Spec-Bench training questions (the 438 of
   `scripts/calibration_prompts.py`, less the 44 calibrate holds out, same split and seed) and to
   `--extra-prompts` (the synthetic prompts), batched with transformers' `generate` on the GPU.
3. **The teacher**, one batched forward over every sequence: h_L (the input of the model's final
   norm) and the top-64 next-token log-probabilities at every position, as calibrate keeps them.
4. **Training**, the loss of `selfspec.tools.feature_calibrate` (KL through the pruned draft head plus the
   smooth-L1 pull to h_L), on windows of ≤ 512 positions, every position an example; several heads
   at once, each on its own data: `all` (everything), `spec` (the Spec-Bench training questions
   only: the CPU recipe's data, the control) and `wide` (everything, 8 heads × 64, MLP 1536). The
   learning rate follows a cosine over the time budget, not a step count.

Held-out α at the first draft token (teacher-forced, which is exactly the drafter's first step) is
printed for the 44 held-out Spec-Bench questions and for 1% of the self-written prompts while
training; `scripts/feature_heldout.py` then measures α at positions 1-4 on the CPU the way the
drafter runs, and `selfspec bench` the speed.

Written to --out: each head (`<name>.feature.safetensors`, the drafter's format, tied to the model),
the generated token sequences (`tokens-<i>.npy`, uint16, with `sequences.json`: lengths, prompt
lengths, sources), and `summary.json`.

    python scripts/feature_at_scale.py --prompts train.jsonl --extra-prompts synthetic.jsonl \\
        --device cuda --out heads/            # ~9 min on an H200 (see --seconds)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from selfspec.heads import draft_head  # noqa: E402
from selfspec.api import load  # noqa: E402
from selfspec.tools.bench import load_prompts  # noqa: E402
from selfspec.tools.calibrate.data import TOP, held_out_prompts  # noqa: E402
from selfspec.tools.feature_calibrate import Student  # noqa: E402
from selfspec.heads.feature_head import FeatureHead, load_feature_head, save_feature_head, shipped_path  # noqa: E402

T0 = time.perf_counter()
HEADS = {"all": dict(heads=4, width=None), "spec": dict(heads=4, width=None), "wide": dict(heads=8, width=1536),
         "warm": dict(heads=4, width=None)}  # warm: all data, starting from the shipped head's weights
OPENINGS = 2  # words of a training prompt that begin a seeded self-written request
DOCUMENT_TASKS = (  # requests over an earlier answer: long contexts the output copies from (Spec-Bench's
    "Summarize the following text in a few sentences.\n\n{text}",  # summarization and RAG prompts)
    "{text}\n\nWhat are the main points of the text above?",
    "Rewrite the following text in simpler words.\n\n{text}",
    "Read the text below and list the key facts it states.\n\n{text}",
    "{text}\n\nBased on the text above, write three questions a reader might ask, with their answers.",
)
TOKENS_PER_FILE = 8_000_000  # uint16: 16 MB a file (the device tool returns files of at most 16 MiB)


def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {message}", flush=True)


def left_padded(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row):] = torch.tensor(row)
        mask[r, width - len(row):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def generate(hf, prompts: list[list[int]], *, pad: int, eos: list[int], rows: int, row_tokens: int,
             new_tokens: int, deadline: float, sample: bool = False) -> list[list[int] | None]:
    """Each prompt's continuation (up to and including its end token), batched by length with at
    most `rows` rows and `row_tokens` prompt + output tokens in a batch; None for prompts not
    reached before `deadline` (perf_counter seconds)."""
    device = next(hf.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int] | None] = [None] * len(prompts)
    at = 0
    while at < len(order) and time.perf_counter() < deadline:
        width = len(prompts[order[min(at + rows, len(order)) - 1]]) + new_tokens
        chunk = order[at:at + max(1, min(rows, row_tokens // width))]
        at += len(chunk)
        ids, mask = left_padded([prompts[i] for i in chunk], pad, device)
        options = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
        made = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=eos,
                           pad_token_id=pad, **options)[:, ids.shape[1]:].tolist()
        for i, tokens in zip(chunk, made):
            end = next((j for j, t in enumerate(tokens) if t in eos), None)
            out[i] = tokens if end is None else tokens[:end + 1]
    return out


def self_prompts(model, count: int, *, rows: int, deadline: float, seed: int, seen: set[str],
                 openings: list[str] = ()) -> list[str]:
    """User requests the model writes itself: its chat template up to the user's text, sampled
    at T = 1 until the end of the turn. Kept when the turn ended and the text is new (not in
    `seen`, which gains it). With `openings`, each request begins with one of them, in turn
    (the first words of a training prompt: requests shaped like the benchmark's categories)."""
    tokenizer = model.tokenizer
    prefix = tokenizer(chat_frame(tokenizer)[0], add_special_tokens=False)["input_ids"]
    eos = sorted(model.eos_ids)
    torch.manual_seed(seed)
    texts: list[str] = []
    turn = 0
    while len(texts) < count and time.perf_counter() < deadline:
        n = min(rows, 2 * (count - len(texts)))
        starts = [openings[(turn + i) % len(openings)] for i in range(n)] if openings else [""] * n
        turn += n
        begun = [prefix + (tokenizer(start, add_special_tokens=False)["input_ids"] if start else []) for start in starts]
        made = generate(model.hf_model, begun, pad=eos[0], eos=eos,
                        rows=rows, row_tokens=10**9, new_tokens=96, deadline=deadline, sample=True)
        for start, tokens in zip(starts, made):
            if tokens is None or not tokens or tokens[-1] not in eos:
                continue
            text = (start + tokenizer.decode(tokens[:-1])).strip()
            if len(text) >= 20 and text.lower() not in seen:
                seen.add(text.lower())
                texts.append(text)
    return texts[:count]


@torch.inference_mode()
def teacher(model, sequences: list[list[int]], *, row_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h_L [P, d] (the model's dtype), the teacher's top ids [P, TOP] (int32) and log-probabilities
    [P, TOP] (float32) at every position of the sequences laid end to end, on the model's device."""
    hf, adapter = model.hf_model, model.adapter
    device = adapter.device
    captured = {}
    hook = adapter.norm.register_forward_pre_hook(lambda module, args: captured.__setitem__("h", args[0]))
    lengths = [len(s) for s in sequences]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    total = int(offsets[-1])
    final = torch.empty(total, adapter.embed_tokens.embedding_dim, dtype=adapter.dtype, device=device)
    top_ids = torch.empty(total, TOP, dtype=torch.int32, device=device)
    top_logp = torch.empty(total, TOP, dtype=torch.float32, device=device)
    order = sorted(range(len(sequences)), key=lambda i: lengths[i])
    at = 0
    try:
        while at < len(order):
            chunk = order[at:at + max(1, row_tokens // lengths[order[min(at + 64, len(order)) - 1]])][:64]
            at += len(chunk)
            width = max(lengths[i] for i in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, i in enumerate(chunk):
                ids[r, :lengths[i]] = torch.tensor(sequences[i])
                mask[r, :lengths[i]] = 1
            hf.model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
            h = captured.pop("h")
            for r, i in enumerate(chunk):
                rows = h[r, :lengths[i]]
                final[offsets[i]:offsets[i + 1]] = rows
                for lo in range(0, rows.shape[0], 4096):
                    part = rows[lo:lo + 4096]
                    logp = adapter.head_rows(part[None])[0].log_softmax(-1).topk(TOP)
                    top_ids[offsets[i] + lo:offsets[i] + lo + part.shape[0]] = logp.indices.int()
                    top_logp[offsets[i] + lo:offsets[i] + lo + part.shape[0]] = logp.values
    finally:
        hook.remove()
    return final, top_ids, top_logp


def chat_frame(tokenizer) -> tuple[str, str]:
    """The chat template's text before and after a user's message (generation prompt included)."""
    marker = "\x00MARK\x00"
    template = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                             tokenize=False)
    before, after = template.split(marker)
    return before, after


def request_text(tokenizer, frame: tuple[str, str], prompt: list[int]) -> str:
    """The user's text of a chat-templated prompt, `frame` being chat_frame's (the whole decoded
    prompt where the template does not frame it so)."""
    before, after = frame
    text = tokenizer.decode(prompt)
    if text.startswith(before) and text.endswith(after):
        return text[len(before):len(text) - len(after)].strip()
    return text


def reuse_subset(prompt_lengths: list[int], lengths: list[int], sources: list[str], positions: int, long: int,
                 seed: int) -> list[int]:
    """Indices, in order, of the reused sequences to keep: every held-out one; then training ones
    with prompts of at least `long` tokens (when `long`), then others drawn at random, while their
    positions add up to at most `positions`."""
    held = [i for i, s in enumerate(sources) if s.endswith("held")]
    train = [i for i, s in enumerate(sources) if not s.endswith("held")]
    first = [i for i in train if long and prompt_lengths[i] >= long]
    rest = [train[j] for j in np.random.default_rng(seed).permutation(len(train)) if not (long and prompt_lengths[train[j]] >= long)]
    kept, total = [], 0
    for i in first + rest:
        if total + lengths[i] <= positions:
            kept.append(i)
            total += lengths[i]
    return sorted(held + kept)


def reused(directory: Path) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """An earlier run's sequences, split into prompts and answers, and their sources."""
    meta = json.loads((directory / "sequences.json").read_text())
    flat = np.concatenate([np.load(f) for f in sorted(directory.glob("tokens-*.npy"),
                                                      key=lambda f: int(f.stem.split("-")[1]))]).astype(np.int64)
    if len(flat) != sum(meta["lengths"]):
        raise SystemExit(f"{directory}: tokens-*.npy hold {len(flat)} tokens, sequences.json {sum(meta['lengths'])}")
    ends = np.cumsum(meta["lengths"])
    sequences = [flat[e - n:e].tolist() for e, n in zip(ends, meta["lengths"])]
    return ([s[:p] for s, p in zip(sequences, meta["prompt_lengths"])],
            [s[p:] for s, p in zip(sequences, meta["prompt_lengths"])], list(meta["sources"]))


class Data:
    """Every sequence laid end to end on the device, with its teacher."""

    answers_only = False

    def __init__(self, model, sequences: list[list[int]], prompt_lengths: list[int], row_tokens: int,
                 answers_only: bool = False, cache: Path | None = None):
        device = model.adapter.device
        self.answers_only = answers_only
        self.lengths = torch.tensor([len(s) for s in sequences], device=device)
        self.offsets = torch.cumsum(self.lengths, 0) - self.lengths
        self.n_prompt = torch.tensor(prompt_lengths, device=device)
        self.ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
        if cache is not None and cache.is_file():  # the teacher of the same sequences, kept by an earlier run
            kept = torch.load(cache, map_location=device)
            if not torch.equal(kept["ids"], self.ids):
                raise SystemExit(f"--teacher-cache {cache}: made for other sequences; delete it or name another")
            self.final, self.top_ids, self.top_logp = kept["final"], kept["top_ids"], kept["top_logp"]
        else:
            self.final, self.top_ids, self.top_logp = teacher(model, sequences, row_tokens=row_tokens)
            if cache is not None:
                torch.save(dict(ids=self.ids, final=self.final, top_ids=self.top_ids, top_logp=self.top_logp), cache)
        embedding = model.adapter.embed_tokens
        self.embed = lambda ids: embedding(ids).float()

    def window(self, chosen: torch.Tensor, window: int, generator: torch.Generator):
        """Inputs of one training batch: `chosen` sequences, each a random window of at most
        `window` positions: previous [B, W, d], embedded [B, W, d], the flat index [B, W] of each
        position and the example mask [B, W] (offsets ≥ 1 within the window, short of the
        sequence's last position, whose teacher follows the data's end). With `answers_only`, each
        window ends at its sequence's end and only answer positions are examples."""
        device = self.ids.device
        lengths = self.lengths[chosen]
        starts = (torch.rand(len(chosen), generator=generator).to(device) * (lengths - window).clamp_min(0)).long()
        if self.answers_only:
            starts = (lengths - window).clamp_min(0)
        spans = (lengths - starts).clamp_max(window)
        j = torch.arange(window, device=device)
        position = starts[:, None] + j  # within the sequence
        valid = j[None] < spans[:, None]
        flat = self.offsets[chosen][:, None] + torch.minimum(position, lengths[:, None] - 1)
        has_previous = valid & (position >= 1)
        previous = torch.where(has_previous[..., None], self.final[(flat - 1).clamp_min(0)].float(), 0.0)
        embedded = self.embed(self.ids[flat]) * valid[..., None]
        examples = valid & (j[None] >= 1) & (position < lengths[:, None] - 1)
        if self.answers_only:  # from the position whose next token is the answer's first
            examples &= position >= self.n_prompt[chosen][:, None] - 1
        return previous, embedded, flat, examples

    @torch.no_grad()
    def first_alpha(self, head: FeatureHead, student: Student, sequences: list[int]) -> float:
        """α at the first draft token over the output positions of `sequences` (teacher-forced:
        the drafter's first step sees exactly the committed states)."""
        was = head.training
        head.eval()
        right = total = 0
        for s in sequences:
            lo, n, p = int(self.offsets[s]), int(self.lengths[s]), int(self.n_prompt[s])
            if n - 1 <= p:
                continue
            previous = torch.cat([self.final.new_zeros(1, self.final.shape[1]), self.final[lo:lo + n - 1]]).float()
            predicted = head(previous[None], self.embed(self.ids[lo:lo + n])[None])[0, p:n - 1]
            drafted = student.token(student.logits(predicted))
            right += int((drafted == self.top_ids[lo + p:lo + n - 1, 0].long()).sum())
            total += n - 1 - p
        head.train(was)
        return right / max(1, total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", required=True, help="the Spec-Bench training questions (calibration_prompts.py)")
    parser.add_argument("--num-prompts", type=int, default=438, help="as calibrate's (the held-out split depends on it)")
    parser.add_argument("--holdout", type=float, default=0.1)
    parser.add_argument("--extra-prompts", help="more prompts, training only (synthetic_prompts.py)")
    parser.add_argument("--self-prompts", type=int, default=40000, help="at most this many self-written requests")
    parser.add_argument("--reuse", help="an earlier run's --out: its sequences (tokens-*.npy, sequences.json) are kept "
                        "and this run's generation goes to new requests only")
    parser.add_argument("--reuse-positions", type=int, default=0,
                        help="keep only this many of the reused training positions (held-out sequences all stay): "
                             "those of --reuse-long prompts first, then a random draw")
    parser.add_argument("--reuse-long", type=int, default=0,
                        help="with --reuse-positions: first keep every reused training sequence whose prompt has at "
                             "least this many tokens (summarization, RAG: the head's weak categories)")
    parser.add_argument("--answers-only", action="store_true",
                        help="train on answer positions only, each window ending at its sequence's end (the "
                             "default trains on every position, prompts included)")
    parser.add_argument("--teacher-cache", help="keep the teacher (h_L, top-k) in this file and reuse it when the "
                                                "sequences are the same (a CPU's teacher pass takes many minutes)")
    parser.add_argument("--shipped-vocab", action="store_true",
                        help="draft with the shipped head's token subset instead of ranking this data's tokens")
    parser.add_argument("--seeded-share", type=float, default=0.0,
                        help=f"share of self-written requests begun with a training prompt's first {OPENINGS} words")
    parser.add_argument("--document-share", type=float, default=0.0,
                        help="share of new requests that wrap an earlier answer in a reading task (summarize, "
                             "list the facts, ...): long contexts the answer copies from")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens of each answer, at most")
    parser.add_argument("--rows", type=int, default=1024, help="rows of one generate batch")
    parser.add_argument("--row-tokens", type=int, default=400_000, help="prompt + output tokens of one batch")
    parser.add_argument("--heads", default="all,spec,wide", help=f"which heads to train: {', '.join(HEADS)}")
    parser.add_argument("--sequences", type=int, default=64, help="windows a training step")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--regression", type=float, default=1.0)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=500, help="the whole run's budget; phases share it")
    parser.add_argument("--generate-share", type=float, default=0.5, help="share of --seconds spent generating")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="smollm2", help="a bundled model's name or a checkpoint (one with a chat template)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.heads.split(",") if n]
    if any(n not in HEADS for n in names):
        parser.error(f"--heads: choose among {', '.join(HEADS)}")
    end = T0 + args.seconds

    model = load(args.model, dtype=args.dtype, device=args.device, lean=False, progress=False)
    log(f"loaded {model.identity.slug()} on {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'})")
    spec = [p.text for p in load_prompts(args.prompts, 10**9)][:args.num_prompts]
    held = held_out_prompts(len(spec), args.holdout, args.seed).tolist()
    extra = [p.text for p in load_prompts(args.extra_prompts, 10**9)] if args.extra_prompts else []
    eos = sorted(model.eos_ids)
    generate_end = T0 + args.generate_share * args.seconds

    # Answers: the Spec-Bench questions (held out ones too, for α) and the extra prompts first (or
    # an earlier run's sequences), then self-written requests in rounds until the budget is spent.
    held_texts = [t for t, h in zip(spec, held) if h]
    if args.reuse:
        prompts, answers, sources = reused(Path(args.reuse))
        first = [model.encode(t).tolist() for t in held_texts]
        if prompts[:len(first)] != first or sources[:len(first)] != ["held"] * len(first):
            parser.error(f"--reuse {args.reuse}: its held-out questions are not this split's "
                         "(same --prompts, --num-prompts, --holdout and --seed needed)")
        if args.reuse_positions:
            keep = reuse_subset([len(p) for p in prompts], [len(p) + len(a) for p, a in zip(prompts, answers)],
                                sources, args.reuse_positions, args.reuse_long, args.seed)
            prompts, answers, sources = ([x[i] for i in keep] for x in (prompts, answers, sources))
        texts = [None] * len(prompts)  # not kept by the earlier run
        log(f"reused {len(prompts)} sequences, {sum(len(p) + len(a) for p, a in zip(prompts, answers))} positions")
    else:
        sources = ["held"] * len(held_texts) + ["spec"] * (len(spec) - len(held_texts)) + ["extra"] * len(extra)
        texts = held_texts + [t for t, h in zip(spec, held) if not h] + extra
        prompts = [model.encode(t).tolist() for t in texts]
        answers = generate(model.hf_model, prompts, pad=eos[0], eos=eos, rows=args.rows, row_tokens=args.row_tokens,
                           new_tokens=args.new_tokens, deadline=generate_end)
        log(f"answered {sum(a is not None for a in answers)} of {len(prompts)} Spec-Bench and extra prompts")
    frame = chat_frame(model.tokenizer)
    seen = {request_text(model.tokenizer, frame, p).lower() for p in prompts}
    openings = sorted({" ".join(t.split()[:OPENINGS]) for t, h in zip(spec, held) if not h} |
                      {" ".join(t.split()[:OPENINGS]) for t in extra})
    random = np.random.default_rng(args.seed + len(prompts))
    random.shuffle(openings)
    written = 0
    while time.perf_counter() < generate_end - 15 and written < args.self_prompts:
        n = min(args.rows, args.self_prompts - written)
        seeded = int(round(n * args.seeded_share))
        requests = self_prompts(model, n - seeded, rows=args.rows, deadline=generate_end,
                                seed=args.seed + len(prompts), seen=seen)
        if seeded:
            requests += self_prompts(model, seeded, rows=args.rows, deadline=generate_end,
                                     seed=args.seed + len(prompts) + 1, seen=seen, openings=openings)
        kinds = ["self"] * (n - seeded) + ["seeded"] * seeded
        documents = int(round(len(requests) * args.document_share))
        if documents:  # reading tasks over 1-3 earlier training answers of at least 32 tokens each
            long = [a for a, k in zip(answers, sources) if a and len(a) >= 32 and not k.endswith("held")]
            for i in range(documents if long else 0):
                parts = [long[j] for j in random.choice(len(long), size=min(len(long), 1 + i % 3), replace=False)]
                text = "\n\n".join(model.tokenizer.decode(a[:-1] if a[-1] in eos else a).strip() for a in parts)
                requests.append(DOCUMENT_TASKS[i % len(DOCUMENT_TASKS)].format(text=text))
                kinds.append("document")
        more = [model.encode(t).tolist() for t in requests]
        made = generate(model.hf_model, more, pad=eos[0], eos=eos, rows=args.rows, row_tokens=args.row_tokens,
                        new_tokens=args.new_tokens, deadline=generate_end)
        for text, kind, p, a in zip(requests, kinds, more, made):
            if a is not None:
                prompts.append(p)
                answers.append(a)
                texts.append(text)
                sources.append(kind + "-held" if len(texts) % 100 == 0 else kind)
        written += len(requests)
        log(f"new requests {written}, answered so far: " + ", ".join(
            f"{k} {sum(s.split('-')[0] == k for s in sources)}" for k in ("self", "seeded", "document")))
    keep = [i for i, a in enumerate(answers) if a]
    sequences = [prompts[i] + answers[i] for i in keep]
    prompt_lengths = [len(prompts[i]) for i in keep]
    sources = [sources[i] for i in keep]
    texts = [texts[i] for i in keep]
    positions = sum(map(len, sequences))
    log(f"{len(sequences)} sequences, {positions} positions ({sum(len(answers[i]) for i in keep)} generated)")

    flat = np.array([t for s in sequences for t in s], dtype=np.uint16)
    for i in range(0, len(flat), TOKENS_PER_FILE):
        np.save(out / f"tokens-{i // TOKENS_PER_FILE}.npy", flat[i:i + TOKENS_PER_FILE])
    (out / "sequences.json").write_text(json.dumps({"lengths": [len(s) for s in sequences],
                                                    "prompt_lengths": prompt_lengths, "sources": sources}))

    data = Data(model, sequences, prompt_lengths, args.row_tokens, answers_only=args.answers_only,
                cache=Path(args.teacher_cache) if args.teacher_cache else None)
    log(f"teacher-forced: h_L and top-{TOP} at {positions} positions")
    device = model.adapter.device
    kinds = ("held", "spec", "extra", "self", "self-held", "seeded", "seeded-held", "document", "document-held")
    by_source = {name: [i for i, s in enumerate(sources) if s == name] for name in kinds}
    trained = [i for i, s in enumerate(sources) if s in ("spec", "extra", "self", "seeded", "document")]
    subsets = {"all": trained, "spec": by_source["spec"], "wide": trained, "warm": trained}
    trained_on = [data.ids[int(data.offsets[i]):int(data.offsets[i] + data.lengths[i])].cpu() for i in subsets["all"]]
    draft_ids = draft_head.rank_tokens(draft_head.count_tokens(trained_on, model.adapter.lm_head.out_features))
    draft_ids = draft_ids[:args.draft_vocab]
    if args.shipped_vocab:
        draft_ids = load_feature_head(shipped_path(model.identity), model.identity)[1]
    student = Student(model.adapter, draft_ids)

    # The shipped head (CPU-scale data) through this script's own teacher: checks the pipeline
    # against its known held-out α (0.318 at the first token, measured by calibrate on the CPU).
    if shipped_path(model.identity).is_file():
        shipped_head, shipped_ids = load_feature_head(shipped_path(model.identity), model.identity)
        shipped = Student(model.adapter, shipped_ids)
        shipped_head = shipped_head.to(device)
        log(f"shipped head: α@1 held-out Spec-Bench {data.first_alpha(shipped_head, shipped, by_source['held']):.3f}, "
            f"self-written {data.first_alpha(shipped_head, shipped, by_source['self-held'][:200]):.3f}")

    torch.manual_seed(args.seed)
    runs = {}
    for name in names:
        head = FeatureHead(model.adapter.embed_tokens.embedding_dim, model.adapter.n_layers, **HEADS[name]).to(device)
        if name == "warm":
            head.load_state_dict(load_feature_head(shipped_path(model.identity), model.identity)[0].state_dict())
        optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.01)
        runs[name] = dict(head=head.train(), optimizer=optimizer, pool=torch.tensor(subsets[name], device=device),
                          steps=0, loss=None, generator=torch.Generator().manual_seed(args.seed + len(runs)))
    for name, run in runs.items():
        log(f"head {name}: {run['head'].n_params} parameters, {len(subsets[name])} training sequences, "
            f"{int(data.lengths[run['pool']].sum())} positions; α@1 before: held-out Spec-Bench "
            f"{data.first_alpha(run['head'], student, by_source['held']):.3f}")

    def save(name: str, run: dict, results: dict) -> None:
        summary = {"steps": run["steps"], "train_sequences": len(subsets[name]), **results,
                   "train_positions": int(data.lengths[run["pool"]].sum()), "recipe": "scripts/feature_at_scale.py",
                   "params": run["head"].n_params, "draft_vocab": int(draft_ids.numel())}
        save_feature_head(run["head"], out / f"{name}.feature.safetensors", model.identity, draft_ids, summary)

    train_start = time.perf_counter()
    train_end = end - 25
    last_report = last_save = train_start
    history = []
    while (now := time.perf_counter()) < train_end:
        progress = (now - train_start) / max(1.0, train_end - train_start)
        for name, run in runs.items():
            lr = args.lr * min(1.0, (run["steps"] + 1) / 100) * 0.5 * (1 + math.cos(math.pi * progress))
            for group in run["optimizer"].param_groups:
                group["lr"] = lr
            pool = run["pool"]
            chosen = pool[torch.randint(len(pool), (args.sequences,), generator=run["generator"]).to(device)]
            previous, embedded, flat, examples = data.window(chosen, args.window, run["generator"])
            predicted = run["head"](previous, embedded)[examples]
            at = flat[examples]
            loss = student.loss(predicted, data.top_ids[at].long(), data.top_logp[at], data.final[at].float(),
                                args.regression)
            run["optimizer"].zero_grad(set_to_none=True)
            loss.backward()
            run["optimizer"].step()
            run["steps"] += 1
            loss = loss.detach()  # a running mean kept on the device: no sync a step
            run["loss"] = loss if run["loss"] is None else 0.98 * run["loss"] + 0.02 * loss
        if now - last_report > 30:
            last_report = now
            row = {"seconds": round(now - train_start, 1)}
            for name, run in runs.items():
                row[name] = dict(steps=run["steps"], loss=round(float(run["loss"]), 4),
                                 held=round(data.first_alpha(run["head"], student, by_source["held"]), 4))
            history.append(row)
            log("  ".join(f"{n}: step {r['steps']} loss {r['loss']:.3f} α@1 held-out {r['held']:.3f}"
                          for n, r in row.items() if n != "seconds"))
        if now - last_save > 90:
            last_save = now
            for name, run in runs.items():
                save(name, run, {"checkpoint": True})
    results = {}
    for name, run in runs.items():
        results[name] = dict(steps=run["steps"], loss=None if run["loss"] is None else float(run["loss"]),
                             alpha1_held_spec=data.first_alpha(run["head"], student, by_source["held"]),
                             alpha1_held_self=data.first_alpha(run["head"], student, by_source["self-held"][:200]),
                             **{f"alpha1_held_{k}": data.first_alpha(run["head"], student, by_source[f"{k}-held"][:200])
                                for k in ("seeded", "document") if by_source[f"{k}-held"]},
                             alpha1_train=data.first_alpha(run["head"], student, subsets[name][:44]))
        save(name, run, {k: round(v, 4) if isinstance(v, float) else v for k, v in results[name].items()})
        log(f"head {name}: {results[name]}")
    summary = dict(device=args.device, gpu=torch.cuda.get_device_name() if args.device == "cuda" else None,
                   torch=torch.__version__, sequences=len(sequences), positions=positions,
                   by_source={k: len(v) for k, v in by_source.items()}, heads=results, history=history,
                   self_written=[t for t, s in zip(texts, sources) if s.startswith("self")][:40],
                   seeded=[t for t, s in zip(texts, sources) if s.startswith("seeded")][:40],
                   documents=[t[:300] for t, s in zip(texts, sources) if s.startswith("document")][:10],
                   seconds=round(time.perf_counter() - T0, 1), args=vars(args))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    log("done")


if __name__ == "__main__":
    main()
