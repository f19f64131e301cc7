import pytest
import torch

from selfspec.model.cache import KVCache


def make(capacity=8):
    return KVCache(n_layers=2, n_kv_heads=1, head_dim=4, capacity=capacity, dtype=torch.float32, device="cpu")


def test_write_view_and_rewind_overwrites_in_place():
    cache = make()
    keys = torch.arange(5 * 4, dtype=torch.float32).view(1, 1, 5, 4)
    cache.write(1, 0, keys, -keys)
    cache.rewind(5)
    storage = cache.keys.data_ptr()
    # A rejected suffix: rewind to 3, then a new token overwrites slot 3 without any copy.
    cache.rewind(3)
    new = torch.full((1, 1, 1, 4), 100.0)
    cache.write(1, 3, new, new)
    cache.rewind(4)
    k, v = cache.view(1, 0, cache.length)
    assert torch.equal(k[:, :, :3], keys[:, :, :3])
    assert torch.equal(k[:, :, 3], new[:, :, 0])
    assert torch.equal(v[:, :, 3], new[:, :, 0])
    assert cache.keys.data_ptr() == storage  # nothing reallocated or cloned
    assert k.untyped_storage().data_ptr() == storage  # a view into the cache, not a copy


def test_rewind_and_write_bounds():
    cache = make(capacity=4)
    with pytest.raises(ValueError):
        cache.rewind(5)
    with pytest.raises(ValueError):
        cache.rewind(-1)
    with pytest.raises(IndexError):
        cache.write(0, 3, torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))


def test_nbytes_counts_keys_and_values():
    assert make(capacity=8).nbytes == 2 * 2 * 1 * 8 * 4 * 4
