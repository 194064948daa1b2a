"""The target's static KV cache: one pre-allocated tensor, written in place, compacted after verification.

Layout: `kv[layer, 0 | 1, kv_head, slot, head_dim]` (0 = keys, 1 = values), batch 1. Slots `[0, length)` hold
the committed context in order (slot s = sequence position s). A verification forward writes the draft tree's
keys/values at slots `[length, length + N)` (node i at slot `length + i`; its RoPE position is `length +
depth[i]`, not `length + i`). `commit(nodes)` then gathers the accepted nodes' entries into the contiguous
slots `[length, length + len(nodes))` — because an accepted node at depth d lands at slot `length + d` = its
position, no key ever needs re-rotation — and advances `length`. Everything past `length` is garbage that the
next forward overwrites.

Worked example: length = 10, tree nodes [root, a, b, c] at slots 10..13 with parents [-1, 0, 0, 2]; accepted
path root -> b -> c, i.e. nodes [0, 2, 3]: slots [10, 12, 13] are copied to [10, 11, 12] and length becomes 13.

Not here: paging, batching several requests, eviction / sliding-window reuse of slots, the attention itself.
"""

from __future__ import annotations

import torch

from speculators.core.errors import SpeculatorsError


class StaticKVCache:
    """A [layers, 2, kv_heads, max_len, head_dim] cache for one sequence."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        if max_len < 2:
            raise SpeculatorsError(f"KV cache max_len must be >= 2, got {max_len}")
        self.kv = torch.zeros(num_layers, 2, num_kv_heads, max_len, head_dim, device=device,
                              dtype=dtype)  # [L, 2, Hkv, S, D]
        self.max_len = max_len
        self.length = 0  # committed slots

    @property
    def free(self) -> int:
        return self.max_len - self.length

    def reset(self, length: int = 0) -> None:
        """Forget everything after `length` committed slots (prefix reuse keeps the first `length`)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"reset length {length} outside [0, {self.max_len}]")
        self.length = length

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Store keys/values [Hkv, T, D] of T new tokens at slots [start, start + T)."""
        end = start + keys.shape[1]
        if end > self.max_len:
            raise SpeculatorsError(f"the KV cache holds {self.max_len} tokens but {end} are needed; "
                                   f"shorten the prompt or max_new_tokens, or raise max_len")
        self.kv[layer, 0, :, start:end] = keys
        self.kv[layer, 1, :, start:end] = values

    def keys_values(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of slots [0, end): keys, values [Hkv, end, D]."""
        return self.kv[layer, 0, :, :end], self.kv[layer, 1, :, :end]

    def commit(self, nodes: list[int]) -> None:
        """Keep the verified tree nodes `nodes` (indices into the tree written at `length`; node order = path
        order) as the next committed slots and advance `length` by len(nodes)."""
        if not nodes:
            return
        n = len(nodes)
        if self.length + n > self.max_len:
            raise SpeculatorsError(f"KV cache overflow: {self.length} + {n} > {self.max_len}")
        if nodes != list(range(n)):  # a prefix of the tree is already in place
            src = torch.tensor(nodes, device=self.kv.device) + self.length  # [n]
            gathered = self.kv.index_select(3, src)  # [L, 2, Hkv, n, D] a copy: src and dst may overlap
            self.kv[:, :, :, self.length:self.length + n] = gathered
        self.length += n
