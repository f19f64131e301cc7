"""The context head: an exit adapter that sees the context (Kangaroo-style), not one position.

Plain early exit at k drafts with head(h_k); the exit adapter (selfspec.heads.exit_adapter) with
head(A(h_k)), A seeing only the current position's state, which tops out near α = 0.3 on SmolLM2.
The context head C adds one small attention block over the exit states of every earlier position
(prompt and generated alike), then the adapter's MLP:

    x = h + O·attn(rmsnorm(h), over rmsnorm(h_k) of positions <= t)    causal, RoPE by position
    C(h) = x + W2·silu(W1·rmsnorm(x))

and the draft uses the model's own norm and head (or the pruned draft head) on C(h_k). O and W2
are zero-initialised: untrained, C is the identity and the draft is plain early exit. Its own
q/k/v/o projections have a few heads (default 4 × 64): 1.25M parameters for SmolLM2-135M (d =
576), 0.9% of the model; its keys and values are 512 values per position (2 KB in float32).

At draft time the head keeps its own position-indexed KV cache (`ContextState`), filled from the
exit states the model's cache keeps (KVCache.keep_exit_states: written by every forward that
computes layer k-1, prefill, draft and verify alike, so they are exactly the committed
positions' h_k). Only the draft changes: the verify runs the full model from the raw h_k, so
output stays exactly the full model's.

On disk: like the exit adapter, one safetensors file per (model, k) with a JSON header tying it
to the model's identity, `profiles_dir()/<identity slug>.context-k<k>.safetensors`, named by the
profile's "context-head" section.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from safetensors.torch import load_file

from selfspec.heads import tagged_file
from selfspec.native.gemv import project
from selfspec.model.cache import KVCache
from selfspec.model.profiles import ModelIdentity, profiles_dir

SECTION = "context-head"  # the profile section naming this model's context head
FORMAT = "selfspec-context-head/1"
# Double early exit (Kangaroo's η): a draft with the context head stops after a token whose draft
# top-1 probability is below this, unless a threshold is given.
DEFAULT_THRESHOLD = 0.6


class ContextHead(torch.nn.Module):
    """h_k [..., T, d] of a context -> the predicted final hidden states [..., T, d]."""

    def __init__(self, hidden_size: int, exit_layer: int, heads: int = 4, head_dim: int = 64,
                 width: int | None = None, eps: float = 1e-6, rope_theta: float = 10000.0):
        super().__init__()
        if exit_layer < 1:
            raise ValueError(f"exit layer k must be >= 1, got {exit_layer}")
        width = hidden_size if width is None else width
        if min(width, heads, head_dim) < 1 or head_dim % 2:
            raise ValueError(f"width and heads must be >= 1 and head_dim even, got {width}, {heads}, {head_dim}")
        self.exit_layer, self.hidden_size, self.width = exit_layer, hidden_size, width
        self.heads, self.head_dim, self.rope_theta = heads, head_dim, rope_theta
        self.attn_norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        self.qkv = torch.nn.Linear(hidden_size, 3 * heads * head_dim, bias=False)
        self.o = torch.nn.Linear(heads * head_dim, hidden_size, bias=False)
        self.mlp_norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        self.up = torch.nn.Linear(hidden_size, width, bias=False)
        self.down = torch.nn.Linear(width, hidden_size, bias=False)
        torch.nn.init.zeros_(self.o.weight)  # untrained = identity = plain early exit
        torch.nn.init.zeros_(self.down.weight)
        # RoPE's cos and sin by position, per (dtype, device), computed once, not per draft token.
        # A plain attribute, not a buffer: .to(bfloat16) must not round the angles (float32).
        self._tables: dict = {}

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced: h [B, T, d], the exit states of B contexts at positions 0 .. T-1 (padding
        after a context's end is harmless: causality keeps it from every real position). Returns
        C at `positions` [B, m] (long; default every position): [B, m, d]."""
        t = h.shape[1]
        q, k, v = self._qkv(h, 0)  # [B, heads, T, head_dim]
        if positions is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self._finish(h, out)
        index = positions[:, None, :, None].expand(-1, self.heads, -1, self.head_dim)
        mask = torch.arange(t, device=h.device).view(1, 1, 1, t) <= positions[:, None, :, None]  # [B, 1, m, T]
        out = F.scaled_dot_product_attention(q.gather(2, index), k, v, attn_mask=mask)
        return self._finish(h.gather(1, positions[..., None].expand(-1, -1, h.shape[-1])), out)

    def step(self, h: torch.Tensor, start: int, kv: KVCache) -> torch.Tensor:
        """Drafting: h [1, n, d] at positions start .. start+n-1, whose keys and values go into
        `kv` (the head's own cache, valid before `start`); each attends to the positions <= its own."""
        n = h.shape[1]
        q, k, v = self._qkv(h, start)
        kv.write(0, start, k, v)
        keys, values = kv.view(0, 0, start + n)
        mask = None
        if n > 1:
            mask = torch.arange(start + n, device=h.device).view(1, -1) <= torch.arange(start, start + n,
                                                                                        device=h.device).view(-1, 1)
        return self._finish(h, _attend(q, keys, values, mask))

    def extend(self, h: torch.Tensor, start: int, kv: KVCache) -> None:
        """Write the keys and values of exit states h [1, n, d] at start .. start+n-1 into `kv`
        (committed context: no output is needed)."""
        _, k, v = self._qkv(h, start, query=False)
        kv.write(0, start, k, v)

    def new_kv(self, capacity: int, *, dtype, device) -> KVCache:
        return KVCache(1, self.heads, self.head_dim, capacity, dtype=dtype, device=device)

    def _qkv(self, h: torch.Tensor, start: int, query: bool = True):
        """q, k, v [B, heads, T, head_dim] of h [B, T, d] at positions start .., q and k rotated by
        absolute position (q None unless query)."""
        b, t, _ = h.shape
        x = self.attn_norm(h)
        size = self.heads * self.head_dim
        if query:
            q, k, v = project(x, self.qkv.weight).split(size, dim=-1)
        else:  # the key and value rows of the fused weight only
            k, v = project(x, self.qkv.weight[size:]).split(size, dim=-1)
            q = None
        cos, sin = self._rope(start, t, h.dtype, h.device)

        def split(y):
            return y.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        k = _rotate(split(k), cos, sin)
        return (None if q is None else _rotate(split(q), cos, sin)), k, split(v)

    def _finish(self, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """h plus the attention output [B, heads, m, head_dim] through O, then the MLP."""
        b, _, m, _ = attended.shape
        x = h + project(attended.transpose(1, 2).reshape(b, m, self.heads * self.head_dim), self.o.weight)
        return x + project(F.silu(project(self.mlp_norm(x), self.up.weight)), self.down.weight)

    def _rope(self, start: int, n: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, head_dim] for positions start .. start+n-1 (the Llama layout: halves rotated
        together), sliced from tables kept per dtype and device, doubled when outgrown."""
        cos, sin = self._tables.get((dtype, device), (None, None))
        if cos is None or cos.shape[0] < start + n:
            size = max(256, 2 * (start + n))
            inv_freq = self.rope_theta ** -(torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim)
            angles = torch.arange(size, device=device).float()[:, None] * inv_freq[None, :]
            angles = torch.cat([angles, angles], dim=-1)
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            self._tables[(dtype, device)] = cos, sin
        return cos[start:start + n], sin[start:start + n]


# Backends for a drafting step's attention on CUDA: not cuDNN's, which builds a new plan for every
# new key length, and the head's cache grows by a position each draft token. On an H200 that was
# 2.6 ms of host time a call, 70-86% of the feature head's drafting (torch.profiler,
# results/gpu_h200/profile_feature.log; the head's c was 12-18 there). Only here: the model's own
# decode attention, also over a growing span outside exact mode, stepped 14.4 ms there against
# exact mode's fixed-span 13.5 ms (results/gpu_h200/default.md), so SDPA did not pick cuDNN for it.
_STEP_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention of a drafting step (see _STEP_BACKENDS)."""
    with sdpa_kernel(_STEP_BACKENDS) if q.device.type == "cuda" else nullcontext():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class ContextState:
    """One generation's drafting state for a context head: its own KV cache, indexed by position
    like the model's, whose `length` counts the positions filled from committed exit states.

    Per round: `at(start)` fills the head's keys and values of positions length .. start-1 from
    the model cache's exit states (the previous round's accepted tokens; the whole prompt at the
    first round) and rewinds the draft-time entries past `start`; the draft then calls the state
    as its transform, once per draft token, at start, start+1, ... (tentative entries, which the
    next round overwrites from the committed states)."""

    def __init__(self, head: ContextHead, cache: KVCache):
        if cache.exit_layer != head.exit_layer or cache.exit_states is None:
            raise ValueError(f"the cache keeps no exit states of k={head.exit_layer}")
        self.head, self.cache = head, cache
        self.kv = head.new_kv(cache.capacity, dtype=cache.exit_states.dtype, device=cache.exit_states.device)
        self.position = 0

    def at(self, start: int) -> ContextState:
        valid = min(self.kv.length, start)
        if valid < start:
            self.head.extend(self.cache.exit_states[None, valid:start], valid, self.kv)
        self.kv.rewind(start)
        self.position = start
        return self

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """C(h) for the draft's exit states h [1, n, d] at the next n positions."""
        out = self.head.step(h, self.position, self.kv)
        self.position += h.shape[1]
        return out


# -- on disk ------------------------------------------------------------------------------------


def default_path(identity: ModelIdentity, exit_layer: int, directory: str | Path | None = None) -> Path:
    directory = profiles_dir() if directory is None else Path(directory)
    return directory / f"{identity.slug()}.context-k{exit_layer}.safetensors"


def save_context_head(head: ContextHead, path: str | Path, identity: ModelIdentity,
                      training: dict | None = None) -> Path:
    """Write the head's weights (float32) and header atomically; `training`: a summary kept in the header."""
    header = dict(format=FORMAT, identity=asdict(identity), exit_layer=head.exit_layer,
                  hidden_size=head.hidden_size, width=head.width, heads=head.heads, head_dim=head.head_dim,
                  rope_theta=head.rope_theta, dtype="float32", training=training or {})
    return tagged_file.write_module(path, head, header)


def read_header(path: str | Path) -> dict:
    return tagged_file.read_header(path, FORMAT, f"no context head at {path}", "context head")


def load_context_head(path: str | Path, identity: ModelIdentity) -> ContextHead:
    """The head in `path`, refused unless it was trained for this model."""
    header = read_header(path)
    tagged_file.check_identity(header, identity, path, "context head", "`selfspec calibrate --head context`")
    head = ContextHead(header["hidden_size"], header["exit_layer"], header["heads"], header["head_dim"],
                       header["width"], rope_theta=header["rope_theta"])
    head.load_state_dict(load_file(str(path)))
    return head.eval().requires_grad_(False)
