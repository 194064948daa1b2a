"""StaticKVCache: writes land at their slots, commit gathers the accepted path (overlapping copies), limits."""

from __future__ import annotations

import pytest
import torch

from speculators.core.errors import SpeculatorsError
from speculators.runtime.forward.target_cache import StaticKVCache


def _cache(max_len: int = 16) -> StaticKVCache:
    return StaticKVCache(num_layers=2, num_kv_heads=1, head_dim=1, max_len=max_len, device="cpu",
                         dtype=torch.float32)


def _slots(values: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tensor(values).view(1, -1, 1)  # [Hkv=1, T, D=1]
    return t, -t


def test_commit_gathers_accepted_path_into_contiguous_slots() -> None:
    cache = _cache()
    for layer in range(2):
        cache.write(layer, *_slots([float(i) for i in range(10)]), start=0)
    cache.commit(list(range(10)))
    assert cache.length == 10
    # tree [root, a, b, c] at slots 10..13, parents [-1, 0, 0, 2]; accepted path root -> b -> c = nodes [0, 2, 3]
    for layer in range(2):
        cache.write(layer, *_slots([100.0, 101.0, 102.0, 103.0]), start=10)
    cache.commit([0, 2, 3])
    assert cache.length == 13
    keys, values = cache.keys_values(1, 13)
    assert keys.flatten().tolist() == [*range(10), 100.0, 102.0, 103.0]
    assert values.flatten().tolist() == [-float(i) for i in range(10)] + [-100.0, -102.0, -103.0]


def test_commit_with_overlapping_source_and_destination() -> None:
    cache = _cache()
    cache.write(0, *_slots([0.0, 1.0, 2.0, 3.0, 4.0, 5.0]), start=0)
    # a deep path whose sources [0, 2, 4, 5] overlap the destination slots [0, 4)
    cache.commit([0, 2, 4, 5])
    assert cache.keys_values(0, 4)[0].flatten().tolist() == [0.0, 2.0, 4.0, 5.0]


def test_prefix_commit_is_in_place_and_empty_commit_is_noop() -> None:
    cache = _cache()
    cache.write(0, *_slots([7.0, 8.0]), start=0)
    cache.commit([])
    assert cache.length == 0
    cache.commit([0, 1])
    assert cache.length == 2 and cache.keys_values(0, 2)[0].flatten().tolist() == [7.0, 8.0]


def test_overflow_and_reset() -> None:
    cache = _cache(max_len=4)
    with pytest.raises(SpeculatorsError, match="KV cache holds 4"):
        cache.write(0, *_slots([0.0] * 5), start=0)
    cache.write(0, *_slots([1.0, 2.0, 3.0]), start=0)
    cache.commit([0, 1, 2])
    assert cache.free == 1
    with pytest.raises(SpeculatorsError, match="overflow"):
        cache.commit([0, 1])
    cache.reset(1)
    assert cache.length == 1 and cache.free == 3
    with pytest.raises(ValueError):
        cache.reset(5)
