"""One KV cache, shared by the draft and the verify, indexed by position.

The cache is preallocated for the whole generation. Layer l's keys and values for the token at
position t live in slot t. `length` counts the positions whose entries are valid in *every*
layer; slots past it may hold stale entries written by a draft or a verify of rejected tokens,
which later writes overwrite. Rewinding after a rejection is therefore setting `length`: O(1),
nothing cloned, and no second cache for the draft.
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
    ):
        # [layer, batch=1, kv_heads, capacity, head_dim]. Zeros, not empty: the lean step attends over
        # the whole capacity with a mask, and a masked slot holding NaN would still poison the
        # weighted sum (0 · NaN); every slot written later holds finite values.
        shape = (n_layers, 1, n_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

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

    def rewind(self, length: int) -> None:
        """Keep positions < length; everything after is free to overwrite."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"cannot rewind to {length}: capacity is {self.capacity}")
        self.length = length

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values together, over the whole preallocated capacity."""
        return self.keys.numel() * self.keys.element_size() * 2
