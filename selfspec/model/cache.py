"""One KV cache, shared by the draft and the verify, indexed by position.

The cache is preallocated for the whole generation. Layer l's keys and values for the token at
position t live in slot t. `length` counts the positions whose entries are valid in *every*
layer; slots past it may hold stale entries written by a draft or a verify of rejected tokens,
which later writes overwrite. Rewinding after a rejection is therefore setting `length`: O(1),
nothing cloned, and no second cache for the draft.

A drafter that reads the context's exit states (the context head, selfspec.heads.context_head) asks the
cache to keep h_k, the output of layer k-1, by position as well. Every forward that writes layer
k-1's keys and values for a position writes its h_k beside them (the adapter's layer loops do it),
so the exit states are valid exactly where the cache is, and rewind with it.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        storage: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        # [layer, batch=1, kv_heads, capacity, head_dim]. Zeros, not empty: the lean step attends over
        # the whole capacity with a mask, and a masked slot holding NaN would still poison the
        # weighted sum (0 · NaN); every slot written later holds finite values.
        # storage: an earlier cache's (keys, values) of this shape, zeroed and reused (CUDA graphs
        # replay fixed addresses: selfspec.model.cuda_graphs).
        shape = (n_layers, 1, n_kv_heads, capacity, head_dim)
        if storage is None:
            self.keys = torch.zeros(shape, dtype=dtype, device=device)
            self.values = torch.zeros(shape, dtype=dtype, device=device)
        else:
            self.keys, self.values = storage
            if self.keys.shape != shape or self.values.shape != shape:
                raise ValueError(f"cache storage of shape {tuple(self.keys.shape)} does not fit {shape}")
            self.keys.zero_()
            self.values.zero_()
        self.capacity = capacity
        self.length = 0
        self.exit_layer: int | None = None  # k whose exit states are kept, None: none
        self.exit_states: torch.Tensor | None = None  # [capacity, hidden]: h_k by position

    def keep_exit_states(self, k: int, hidden_size: int) -> None:
        """From now on keep h_k of every position a forward computes layer k-1 for."""
        if self.exit_layer != k or self.exit_states is None or self.exit_states.shape[1] != hidden_size:
            self.exit_states = self.keys.new_zeros(self.capacity, hidden_size)
        self.exit_layer = k

    def write_exit_states(self, positions: int | torch.Tensor, h: torch.Tensor) -> None:
        """Store h_k [..., n, hidden] of n positions: start .. start+n-1, or a [n] tensor of slots."""
        h = h.reshape(-1, h.shape[-1])
        if isinstance(positions, int):
            self.exit_states[positions:positions + h.shape[0]] = h
        else:
            self.exit_states.index_copy_(0, positions, h)

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values [1, kv_heads, n, head_dim] of positions start .. start+n-1."""
        end = start + keys.shape[2]
        if end > self.capacity:
            raise IndexError(f"KV cache holds {self.capacity} positions; a write up to {end} does not fit")
        self.keys[layer, :, :, start:end] = keys
        self.values[layer, :, :, start:end] = values

    def view(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions start .. end-1 of one layer, without a copy."""
        return self.keys[layer, :, :, start:end], self.values[layer, :, :, start:end]

    def move(self, source: int, target: int) -> None:
        """Copy slot `source`'s keys and values (every layer) and exit state to slot `target`: a
        sibling verify wrote its accepted alternative past the position it belongs at."""
        self.keys[:, :, :, target] = self.keys[:, :, :, source]
        self.values[:, :, :, target] = self.values[:, :, :, source]
        if self.exit_states is not None:
            self.exit_states[target] = self.exit_states[source]

    def rewind(self, length: int) -> None:
        """Keep positions < length; everything after is free to overwrite."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"cannot rewind to {length}: capacity is {self.capacity}")
        self.length = length

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values together, over the whole preallocated capacity."""
        return self.keys.numel() * self.keys.element_size() * 2
