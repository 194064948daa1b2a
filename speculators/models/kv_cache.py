"""The draft layers' attention over a preallocated per-request cache (drafting, batch 1): `KVCache` holds the keys /
values of every draft layer, `attend_fn(start, mask)` is the `AttendFn` that `layers.run_layers` and
`fused.FusedStack` call per layer. Not here: training attention (layers.ttt_attention), the target's cache
(runtime/forward/target_cache.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# attend(layer_index, q [B, nh, S, hd], k [B, nkv, S, hd], v [B, nkv, S, hd]) -> [B, nh, S, hd]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class KVCache:
    """Preallocated keys/values of the draft layers for one request: [L, nkv, max_len, hd] each."""

    def __init__(self, num_layers: int, num_kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        self.k = torch.zeros(num_layers, num_kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.max_len = max_len

    def attend_fn(self, start: int, mask: torch.Tensor) -> AttendFn:
        """Write the S new keys/values at slots start..start+S-1, then attend over slots [0, mask.shape[1])
        with `mask` [S, L] bool (True = visible)."""

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            s = k.shape[2]
            self.k[i, :, start:start + s] = k[0]
            self.v[i, :, start:start + s] = v[0]
            length = mask.shape[1]
            return cached_attention(q, self.k[i, None, :, :length], self.v[i, None, :, :length], mask)

        return attend


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [1, nh, S, hd], k/v [1, nkv, L, hd], mask [S, L] bool -> [1, nh, S, hd] (SDPA, explicit mask, GQA)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
