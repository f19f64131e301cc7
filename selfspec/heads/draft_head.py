"""A pruned draft head: the early-exit draft projects onto the N most frequent tokens only.

The LM head is a large share of a small model's draft cost c (SmolLM2-135M: 49152 × 576, as many
multiply-adds as eight of its 30 layers), and most of its rows are tokens the model hardly ever
emits. The draft may use head rows for a frequency-ranked subset S of N tokens; the verify always
uses the full head, so output is unchanged:

  greedy    the draft token is argmax over S, mapped back to its full-vocabulary id; the verify
            keeps it only where it is the full model's argmax, as for any draft.
  sampling  q = softmax over S, zero outside it (logits -inf there). Speculative sampling stays
            exact: a token outside S is never drafted, and at a rejection the recovered token is
            drawn from normalise(max(0, p - q)), which carries all of p's mass outside S.

The ranking comes from the model's own generations (`selfspec calibrate` counts the tokens of its
greedy outputs and of their prompts) and is saved with every token ranked, so any N can be taken
later: one safetensors file per model, tied to its identity as exit adapters are,
`profiles_dir()/<identity slug>.draft-head.safetensors`, found through the profile's "draft-head"
section.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file

from selfspec.heads import tagged_file
from selfspec.native.gemv import project
from selfspec.model.profiles import ModelIdentity, profiles_dir
from selfspec.model.quantize import float_weight, stored_weight

SECTION = "draft-head"  # the profile section naming this model's token ranking
FORMAT = "selfspec-draft-head/1"
COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)  # subset sizes whose coverage is reported


# id(token ids tensor) -> (a weak reference to it, its PrunedHead); the entry goes with the tensor.
_PRUNED: dict[int, tuple[weakref.ref, PrunedHead]] = {}


class PrunedHead:
    """The model's final norm, the lm_head rows of `token_ids` and its final soft-cap: hidden
    states -> logits over the subset, the same values adapter.head gives for those tokens.

    The rows are sliced once, a copy kept beside the full head (which the verify still uses): N ×
    hidden × the weights' bytes per value, plus 8 bytes per id. SmolLM2-135M in float32: 18.9 MB
    at N = 8192, 2.4 MB at N = 1024, beside the full head's 113 MB."""

    def __init__(self, adapter, token_ids: torch.Tensor):
        lm_head = adapter.lm_head
        self.vocab_size = lm_head.out_features
        ids = torch.as_tensor(token_ids, dtype=torch.long).view(-1).to(adapter.device)
        if not ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"a draft head needs token ids in 0..{self.vocab_size - 1}")
        if ids.unique().numel() != ids.numel():
            raise ValueError("a draft head's token ids must be distinct")
        self.ids = ids  # [N]: subset position -> full-vocabulary id
        self.weight = float_weight(lm_head, ids)  # [N, hidden], dequantized if the head is int8 or int4
        self.bias = None if lm_head.bias is None else lm_head.bias.detach()[ids].contiguous()
        self.norm = adapter.norm
        self.softcap = adapter.final_softcap
        self._source = stored_weight(lm_head)  # a reference, to tell whether the head still fits a model

    @classmethod
    def shared(cls, adapter, token_ids: torch.Tensor) -> PrunedHead:
        """The slice for these ids (one tensor, e.g. a shared head file's) on this model, taken once:
        every drafter of a server's requests reads the same rows instead of copying them."""
        entry = _PRUNED.get(id(token_ids))
        head = entry[1] if entry is not None and entry[0]() is token_ids else None
        if head is None or not head.built_for(adapter):
            head = cls(adapter, token_ids)
            _PRUNED[id(token_ids)] = (weakref.ref(token_ids), head)
            weakref.finalize(token_ids, _PRUNED.pop, id(token_ids), None)
        return head

    def built_for(self, adapter) -> bool:
        """Whether this slice was taken from `adapter`'s head as it is now (device and dtype)."""
        same_place = (self.weight.device, self.weight.dtype) == (adapter.device, adapter.dtype)
        return self._source is stored_weight(adapter.lm_head) and same_place

    def __len__(self) -> int:
        return self.ids.numel()

    @property
    def nbytes(self) -> int:
        """Memory the slice adds: its weight rows (and bias) and the id table."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias, self.ids) if t is not None)

    def subset_logits(self, h: torch.Tensor) -> torch.Tensor:
        """hidden states [1, n, hidden] -> logits [n, N] in float32 (column i is token ids[i])."""
        logits = project(self.norm(h), self.weight, self.bias)[0].float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def to_vocab(self, subset_logits: torch.Tensor) -> torch.Tensor:
        """[n, N] -> [n, vocab] with -inf outside the subset, so that logits_to_probs gives q = 0 there."""
        full = subset_logits.new_full((subset_logits.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.ids, subset_logits)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """hidden states [1, n, hidden] -> logits [n, vocab], -inf outside the subset."""
        return self.to_vocab(self.subset_logits(h))

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """hidden states [1, n, hidden] -> the draft's argmax tokens [n], full-vocabulary ids; no
        [n, vocab] tensor is made."""
        return self.ids[self.subset_logits(h).argmax(-1)]


# -- the ranking ----------------------------------------------------------------------------------


def count_tokens(sequences: Iterable[Sequence[int] | torch.Tensor], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in `sequences`: counts [vocab_size] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        ids = torch.as_tensor(seq, dtype=torch.long).view(-1).cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"token ids must be in 0..{vocab_size - 1}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def rank_tokens(counts: torch.Tensor) -> torch.Tensor:
    """Every token id, most frequent first; ties (unseen tokens among them) in id order."""
    return torch.sort(counts, descending=True, stable=True).indices


def coverage(counts: torch.Tensor, sizes: Iterable[int] = COVERAGE_SIZES) -> dict[int, float]:
    """Share of the counted tokens that the top N of the ranking covers, for each N in `sizes`
    (below the vocabulary size): what a pruned head of N tokens can still draft, on this data."""
    total = int(counts.sum())
    ranked = torch.sort(counts, descending=True).values.cumsum(0)
    return {n: float(ranked[n - 1]) / total for n in sizes if 0 < n < counts.numel() and total}


# -- on disk --------------------------------------------------------------------------------------


def default_path(identity: ModelIdentity, directory: str | Path | None = None) -> Path:
    directory = profiles_dir() if directory is None else Path(directory)
    return directory / f"{identity.slug()}.draft-head.safetensors"


def save_ranking(counts: torch.Tensor, path: str | Path, identity: ModelIdentity, source: dict | None = None) -> Path:
    """Write the counts and the ranking they give, atomically; `source` (prompts, tokens, ...) is
    kept in the header for whoever inspects the file."""
    counts = counts.to("cpu", torch.long).contiguous()
    header = dict(format=FORMAT, identity=asdict(identity), vocab_size=counts.numel(),
                  tokens=int(counts.sum()), source=source or {})
    return tagged_file.write(path, {"counts": counts, "ranking": rank_tokens(counts).contiguous()}, header)


def read_header(path: str | Path) -> dict:
    """The JSON header of a draft-head file, without loading its tensors."""
    missing = f"no draft-head ranking at {path}; run `selfspec calibrate`"
    return tagged_file.read_header(path, FORMAT, missing, "draft-head ranking")


def load_ranking(path: str | Path, identity: ModelIdentity) -> torch.Tensor:
    """The ranked token ids [vocab] in `path`, refused unless they were counted for this model."""
    tagged_file.check_identity(read_header(path), identity, path, "draft-head ranking")
    return load_file(str(path))["ranking"]


def ranking_for(profile: dict, identity: ModelIdentity | None) -> torch.Tensor:
    """The ranking the profile's draft-head section names; an error saying what to run if none."""
    section = profile.get(SECTION)
    name = identity.name if identity is not None else "this model"
    if not section:
        raise ValueError(f"a pruned draft head (draft_vocab, --draft-vocab) needs the token ranking "
                         f"`selfspec calibrate` saves, and {name} has none: run `selfspec calibrate` first")
    if identity is None:
        raise ValueError("loading a draft-head ranking needs the model's identity, to check the file belongs to it")
    return tagged_file.shared(load_ranking, section["path"], identity)
