"""Prefix reuse: the keys and values of text the model has already read, for requests that start with it.

A chat client re-sends the whole conversation every turn, and an agent its system prompt and tool
schemas every request: most of a prompt's prefill recomputes keys and values the server computed
for an earlier request. The store keeps, per finished generation, its tokens (prompt and answer)
and their cache entries; a new prompt's longest stored prefix is copied into its cache and only
the rest is prefilled.

Exact by construction where the fused layer runs every forward (`PrefixStore.available`): there a
row's keys and values are a function of its token and the entries before it alone, the same bits
whatever rows ran beside it, in which call, at which cache capacity (selfspec/native/kernels/layer.h).
While a model keeps a store, its prefills run through the fused layer too, 16 rows a call
(`LeanStep.rowwise_prefill`), so a reused entry is the one the request's own prefill would have
written, and the output is the one a cold server gives. Elsewhere (PyTorch's kernels, a GPU) the
store is refused rather than made approximate.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from selfspec.model.cache import KVCache

MIN_TOKENS = 16  # a shorter common prefix is not worth a lookup's copy


@dataclass
class _Entry:
    tokens: torch.Tensor  # [L] long, on the CPU
    keys: torch.Tensor  # [layers, kv_heads, L, head_dim]
    values: torch.Tensor
    exit_layer: int | None  # whose exit states are kept beside them (KVCache.exit_layer)
    exit_states: torch.Tensor | None  # [L, hidden]
    tenant: object = None  # whose text it is: only the same tenant's prompts reuse it
    used: int = 0  # the store's clock at the last use (least recently used goes first)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.exit_states is None else self.exit_states.numel() * self.exit_states.element_size()
        return 2 * self.keys.numel() * self.keys.element_size() + extra


def _common(a: torch.Tensor, b: torch.Tensor) -> int:
    """The length of the common prefix of two token tensors."""
    m = min(a.numel(), b.numel())
    differ = (a[:m] != b[:m]).nonzero()
    return int(differ[0]) if differ.numel() else m


class PrefixStore:
    """Finished generations' tokens and cache entries, at most `budget_bytes` of them over every
    tenant (the least recently used dropped first); a tenant's prompts reuse only its own entries
    (`scoped`). Thread-safe."""

    def __init__(self, budget_bytes: int, min_tokens: int = MIN_TOKENS):
        if budget_bytes < 0:
            raise ValueError(f"a prefix store's budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes, self.min_tokens = budget_bytes, max(1, min_tokens)
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()
        self._clock = 0
        self.lookups = 0  # prompts looked up
        self.hits = 0  # of them, prompts that reused a prefix
        self.reused_tokens = 0  # prompt tokens not prefilled, over all hits

    @staticmethod
    def available(adapter) -> str | None:
        """Why this model cannot keep a prefix store (None: it can): reuse is exact only where the
        fused layer runs every forward."""
        step = adapter.step
        if step is None:
            return "the lean step does not run this model"
        if step.fused is None:
            return "the fused layer does not run here (it needs the native kernels on a CPU, eager)"
        return None

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def scoped(self, tenant) -> "Scoped":
        """This store as one tenant sees it: restore and add with that tenant."""
        return Scoped(self, tenant)

    def restore(self, ids: torch.Tensor, cache: KVCache, tenant=None) -> int:
        """Copy the longest stored prefix of the prompt `ids` [n] (at most n - 1 tokens: the last
        one's logits are the first new token's) of `tenant`'s entries into `cache`; returns its
        length (0: none)."""
        ids = ids.detach().view(-1).cpu()
        with self._lock:
            self.lookups += 1
            best, length = None, 0
            for entry in self._entries:
                if entry.tenant != tenant or not self._fits(entry, cache):
                    continue
                n = min(_common(entry.tokens, ids), ids.numel() - 1)
                if n > length:
                    best, length = entry, n
            if best is None or length < self.min_tokens:
                return 0
            self._clock += 1
            best.used = self._clock
            self.hits += 1
            self.reused_tokens += length
            device = cache.keys.device
            cache.keys[:, 0, :, :length] = best.keys[:, :, :length].to(device)
            cache.values[:, 0, :, :length] = best.values[:, :, :length].to(device)
            if cache.exit_layer is not None:
                cache.exit_states[:length] = best.exit_states[:length].to(device)
        return length

    def add(self, tokens: list[int], cache: KVCache, tenant=None) -> None:
        """Keep `tokens` (the first len(tokens) positions of `cache`, all valid) and their entries.
        An entry whose tokens the new ones extend is replaced; one that already holds them is kept."""
        n = min(len(tokens), cache.length)
        if n < self.min_tokens or self.budget_bytes == 0:
            return
        ids = torch.tensor(tokens[:n], dtype=torch.long)
        with self._lock:
            self._clock += 1
            for entry in self._entries:
                if (entry.tenant == tenant and entry.tokens.numel() >= n and _common(entry.tokens, ids) == n
                        and self._fits(entry, cache)):
                    entry.used = self._clock  # already held, as long or longer
                    return
            keys = cache.keys[:, 0, :, :n].to("cpu", copy=True)
            values = cache.values[:, 0, :, :n].to("cpu", copy=True)
            states = None if cache.exit_layer is None else cache.exit_states[:n].to("cpu", copy=True)
            entry = _Entry(ids, keys, values, cache.exit_layer, states, tenant, self._clock)
            if entry.nbytes > self.budget_bytes:
                return
            self._entries = [e for e in self._entries
                             if not (e.tenant == tenant and e.tokens.numel() <= n
                                     and _common(e.tokens, ids) == e.tokens.numel() and self._fits(e, cache))]
            self._entries.append(entry)
            self._entries.sort(key=lambda e: e.used)
            total = sum(e.nbytes for e in self._entries)
            while total > self.budget_bytes:
                total -= self._entries.pop(0).nbytes

    @staticmethod
    def _fits(entry: _Entry, cache: KVCache) -> bool:
        """Whether entry keeps what the cache keeps: the same layer's exit states, or the cache none
        (an entry without exit states, or with another layer's, does not stand in for them)."""
        return entry.exit_layer == cache.exit_layer or cache.exit_layer is None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


@dataclass
class Scoped:
    """A PrefixStore as one tenant sees it (what a generation is given: selfspec.core.engine)."""

    store: PrefixStore
    tenant: object = None

    def restore(self, ids: torch.Tensor, cache: KVCache) -> int:
        return self.store.restore(ids, cache, self.tenant)

    def add(self, tokens: list[int], cache: KVCache) -> None:
        self.store.add(tokens, cache, self.tenant)
