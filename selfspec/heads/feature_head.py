"""The feature head: a draft with no layers of the model at all, from the last verify's final states.

Early exit drafts token t+1 from h_k(t), the state after the model's first k layers, so every
draft token pays for k layers. But the verify has already computed the full model's final state
h_L(t-1) at every committed position, and the pending token x_t is known. The feature head F
(EAGLE's idea, Li et al. 2024, in our own code; the context head of selfspec.heads.context_head at full
depth) predicts the final state of the next position from those two:

    s_t  = W_in · [rmsnorm(h_L(t-1)), rmsnorm(embed(x_t))]
    f_t  = C(s_t)          C: the context head's attention block (over s of positions <= t) and MLP
    draft token t+1 = argmax head(f_t)          the model's own norm and head, or the pruned one

and then drafts on from its own prediction: s_{t+1} = W_in · [rmsnorm(f_t), rmsnorm(embed(d_{t+1}))].
Per draft token it costs one small block and the head (the pruned draft head makes that a few MB),
against 30 layers and the head for a full step: c is a few hundredths on SmolLM2.

The model's cache keeps h_L of every position it computes (KVCache.keep_exit_states with k = L:
written by the prefill and by every verify, so the committed positions' states are exactly the
full model's); `FeatureState` fills the head's own small KV cache from them each round and
rewinds it with the model's. Only the draft changes: the verify runs the full model on the
drafted tokens, so output stays exactly the full model's.

Trained by `selfspec calibrate --head feature` (selfspec.tools.feature_calibrate) on the model's own
greedy outputs: KL to the model's next-token distribution plus a regression of f_t on h_L(t)
(after an RMS normalisation), so that a draft fed its own prediction stays close to what the
model computes. Untrained, it drafts nothing useful; no untrained head is ever shipped.

On disk: one safetensors file per model with a JSON header tying it to the model's identity,
`profiles_dir()/<identity slug>.feature.safetensors`, named by the profile's "feature-head"
section; or shipped in the package (selfspec/data/heads/).
"""

from __future__ import annotations

from dataclasses import asdict
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file

from selfspec.heads import tagged_file
from selfspec.model.cache import KVCache
from selfspec.heads.context_head import ContextHead
from selfspec.native.fused_feature import ROWS
from selfspec.native.gemv import project
from selfspec.model.profiles import ModelIdentity, profiles_dir

SECTION = "feature-head"  # the profile section naming this model's feature head
FORMAT = "selfspec-feature-head/1"
DRAFT_IDS = "draft_ids"  # the tensor holding the pruned draft head's token ids


class FeatureHead(torch.nn.Module):
    """(previous final states, token embeddings) of a context -> predicted final states."""

    def __init__(self, hidden_size: int, n_layers: int, heads: int = 4, head_dim: int = 64,
                 width: int | None = None, eps: float = 1e-6, rope_theta: float = 10000.0, parts: int = 1):
        super().__init__()
        self.hidden_size, self.n_layers, self.parts = hidden_size, n_layers, parts
        self.feature_norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        self.token_norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        self.fc = torch.nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = ContextHead(hidden_size, n_layers, heads, head_dim, width, eps, rope_theta)
        if parts > 1:
            # EAGLE-3's fused features (an experiment, training side only): a committed position's
            # previous state is `parts` layers' states [.., parts·d] (h_L last), each normalised, then
            # projected to d; started as "take h_L" and made last, so the other weights are the plain
            # head's for the same seed. Drafted positions still pass the head's own f.
            self.part_norms = torch.nn.ModuleList(torch.nn.RMSNorm(hidden_size, eps=eps) for _ in range(parts))
            self.fuse = torch.nn.Linear(parts * hidden_size, hidden_size, bias=False)
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, -hidden_size:] = torch.eye(hidden_size)

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def inputs(self, previous: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """s: previous [..., T, d] (h_L of the position before each; zeros before position 0) and
        embedded [..., T, d] (the model's embedding of each position's token) -> [..., T, d]."""
        if self.parts > 1 and previous.shape[-1] == self.parts * self.hidden_size:
            pieces = previous.split(self.hidden_size, dim=-1)
            previous = self.fuse(torch.cat([n(x) for n, x in zip(self.part_norms, pieces)], dim=-1))
        return project(torch.cat([self.feature_norm(previous), self.token_norm(embedded)], dim=-1), self.fc.weight)

    def forward(self, previous: torch.Tensor, embedded: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced over B contexts from position 0 ([B, T, d] each): the predicted final
        states at `positions` [B, m] (default every position), [B, m, d]."""
        return self.block(self.inputs(previous, embedded), positions)

    def new_kv(self, capacity: int, *, dtype, device) -> KVCache:
        return self.block.new_kv(capacity, dtype=dtype, device=device)


class FeatureState:
    """One generation's drafting state: the head's own KV cache, by position like the model's.

    `first(start, committed)` begins a round: in one call it writes the head's keys and values of
    the positions committed since the last round (their final states, which the verify wrote into
    the model's cache, and their tokens; the whole prompt at the first round) and of the pending
    token at `start`, and returns the head's prediction there. `step` then predicts one position
    at a time from the head's own last prediction: tentative entries, which the next round
    overwrites from the committed states."""

    def __init__(self, head: FeatureHead, cache: KVCache, embed, fused=None):
        """fused: the head's step as one kernel call (selfspec.native.fused_feature.FusedFeature), used for
        calls of at most its ROWS rows; None: the PyTorch modules throughout."""
        if cache.exit_layer != head.n_layers or cache.exit_states is None:
            raise ValueError(f"the cache keeps no final states (k = {head.n_layers})")
        self.head, self.cache, self.embed, self.fused = head, cache, embed, fused
        self.logits = None  # the fused step's draft-head logits [1, N] of its last prediction, or None
        self.kv = head.new_kv(cache.capacity, dtype=cache.exit_states.dtype, device=cache.exit_states.device)
        self.filled = 0  # positions whose head entries come from committed states
        self.position = 0

    def previous(self, start: int, end: int) -> torch.Tensor:
        """h_L of positions start-1 .. end-2 (zeros for position -1): [1, end - start, d]."""
        states = self.cache.exit_states
        if start > 0:
            return states[None, start - 1:end - 1]
        return torch.cat([states.new_zeros(1, 1, states.shape[1]), states[None, :end - 1]], dim=1)

    def first(self, start: int, committed: list[int]) -> torch.Tensor:
        """The predicted final state [1, 1, d] at the pending token's position `start`;
        committed[start] is the pending token."""
        valid = min(self.filled, start)
        ids = torch.tensor(committed[valid:start + 1], dtype=torch.long, device=self.cache.exit_states.device)
        self.kv.rewind(valid)
        out = self._run(self.previous(valid, start + 1), self.embed(ids), valid)
        self.filled = self.position = start + 1
        return out[:, -1:]

    def step(self, previous: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """The predicted final state [1, 1, d] at the next position, whose token is `token` [1] and
        whose preceding final state is `previous` [1, 1, d] (the head's last prediction)."""
        out = self._run(previous, self.embed(token), self.position)
        self.position += 1
        return out

    def _run(self, previous: torch.Tensor, embedded: torch.Tensor, start: int) -> torch.Tensor:
        """The head's predictions [1, n, d] at positions start .., their keys and values written."""
        if self.fused is not None and previous.shape[1] <= ROWS:
            out, self.logits = self.fused(previous, embedded, start, self.kv)
            return out
        self.logits = None
        return self.head.block.step(self.head.inputs(previous, embedded), start, self.kv)


# -- on disk ------------------------------------------------------------------------------------


def default_path(identity: ModelIdentity, directory: str | Path | None = None) -> Path:
    directory = profiles_dir() if directory is None else Path(directory)
    return directory / f"{identity.slug()}.feature.safetensors"


def save_feature_head(head: FeatureHead, path: str | Path, identity: ModelIdentity, draft_ids: torch.Tensor,
                      training: dict | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Write the head's weights (in `dtype`: float32, or bfloat16 for a model whose drafter runs
    it in bfloat16 anyway, half the file), the pruned draft head's token ids (most frequent first)
    and the header, atomically; `training`: a summary kept in the header."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"a feature head is stored in float32 or bfloat16, not {dtype}")
    if head.parts > 1:
        raise ValueError("a feature head with fused multi-layer inputs is an experiment: the drafter cannot run it")
    b = head.block
    header = dict(format=FORMAT, identity=asdict(identity), n_layers=head.n_layers, hidden_size=head.hidden_size,
                  width=b.width, heads=b.heads, head_dim=b.head_dim, rope_theta=b.rope_theta,
                  dtype=str(dtype).removeprefix("torch."), draft_vocab=int(draft_ids.numel()), training=training or {})
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in head.state_dict().items()}
    tensors[DRAFT_IDS] = draft_ids.to("cpu", torch.long).contiguous()
    return tagged_file.write(path, tensors, header)


def read_header(path: str | Path) -> dict:
    return tagged_file.read_header(path, FORMAT, f"no feature head at {path}", "feature head")


def load_feature_head(path: str | Path, identity: ModelIdentity) -> tuple[FeatureHead, torch.Tensor]:
    """The head in `path` and its draft token ids, refused unless it was trained for this model."""
    header = read_header(path)
    tagged_file.check_identity(header, identity, path, "feature head", "`selfspec calibrate --head feature`")
    with torch.device("meta"):  # no random init of weights the file replaces
        head = FeatureHead(header["hidden_size"], header["n_layers"], header["heads"], header["head_dim"],
                           header["width"], rope_theta=header["rope_theta"])
    tensors = load_file(str(path))
    draft_ids = tensors.pop(DRAFT_IDS)
    head.load_state_dict(tensors, assign=True)
    return head.float().eval().requires_grad_(False), draft_ids  # float32 whatever it was stored in


def shipped_path(identity: ModelIdentity) -> Path:
    """Where a feature head shipped in the package for this model would be."""
    return Path(str(resources.files("selfspec").joinpath(f"data/heads/{identity.slug()}.feature.safetensors")))


def feature_head_for(profile: dict, identity: ModelIdentity | None) -> tuple[FeatureHead, torch.Tensor, Path]:
    """The model's feature head: the one its profile names (`selfspec calibrate --head feature`),
    else the one shipped in the package; an error saying what to run if neither exists."""
    if identity is None:
        raise ValueError("loading a feature head needs the model's identity, to check the file belongs to it")
    section = profile.get(SECTION)
    if section:
        path = Path(section["path"])
        if not path.is_file():
            raise FileNotFoundError(f"the profile names feature head {path}, which is missing; run "
                                    f"`selfspec calibrate --head feature` again")
    else:
        path = shipped_path(identity)
        if not path.is_file():
            raise ValueError(f"{identity.name} has no feature head (none shipped, none calibrated): run "
                             f"`selfspec calibrate --head feature` first, or use another --method")
    head, draft_ids = tagged_file.shared(load_feature_head, path, identity)
    return head, draft_ids, path
