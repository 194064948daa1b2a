"""The attention of training-time-test steps k >= 1 computed at the live positions only.

Steps k >= 1 of `RecurrentSpeculator.forward_train` run on the positions where a later step counts (`live_rows`):
their queries are [1, nh, N, hd] at flat positions b*T+t. A query at (b, t) reads the step-0 keys of sequence b
allowed by the step-0 mask row t, plus the keys of steps 1..k at (b, t) itself (`layers.ttt_attention`). Until
issue 46 those queries were scattered back into [B, nh, T, hd] (zeros elsewhere) and the whole T x T attention was
computed, the dead rows then dropped. `live_attention` computes the same rows without the dead ones: the live
queries of each sequence are packed into [B, nh, m, hd] (m = the most live positions of one sequence), scored
against that sequence's step-0 keys with the mask rows of their own positions, and unpacked. Every live row sees
exactly the keys, mask and diagonal terms it saw before (the same softmax over the same scores), so the loss and
the gradients are today's up to float rounding (tests/unit/models/test_models_ttt_live.py).

What it does not do: step 0 (full attention over every position, `layers.ttt_attention`), drafting (KV cache,
`kv_cache.cached_attention`), or choose the live positions (`models.base.live_rows`).
"""

from __future__ import annotations

import math

import torch


def live_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, mask0: torch.Tensor,
                   diag_k: list[torch.Tensor], diag_v: list[torch.Tensor], live: torch.Tensor) -> torch.Tensor:
    """Step-k attention (k = len(diag_k) >= 1) of the live queries.

    q [1, nh, N, hd] at the sorted flat positions `live` [N] (b*T+t); k0/v0 [B, nkv, T, hd] the step-0 keys and
    values; mask0 [B, 1, T, T] additive (every row allows its own position: never empty); diag_k/diag_v: k tensors
    [1, nkv, N, hd], the keys/values of steps 1..k at the live positions. -> [1, nh, N, hd]"""
    b, nkv, t, hd = k0.shape
    nh, n = q.shape[1], q.shape[2]
    if n == 0:  # no position where a later step counts: nothing to attend
        return q * 0.0
    g = nh // nkv
    scale = 1.0 / math.sqrt(hd)
    bi, ti = live // t, live % t  # [N] sequence and position of each live query
    counts = torch.bincount(bi, minlength=b)  # [B]
    m = int(counts.max())
    slot = torch.arange(n, device=live.device) - (torch.cumsum(counts, 0) - counts)[bi]  # [N] rank in its sequence
    idx = torch.zeros(b, m, dtype=torch.long, device=live.device)  # [B, m] live query of each packed slot
    idx[bi, slot] = torch.arange(n, device=live.device)  # empty slots read query 0 (finite, dropped at the end)
    tpos = ti[idx]  # [B, m] the position whose mask row each slot uses

    def pack(x: torch.Tensor) -> torch.Tensor:  # [1, c, N, hd] -> [B, c, m, hd]
        c = x.shape[1]
        return x[0].index_select(1, idx.flatten()).view(c, b, m, hd).transpose(0, 1)

    qg = pack(q).reshape(b, nkv, g, m, hd)  # [B, nkv, g, m, hd]
    s0 = torch.matmul(qg, k0.unsqueeze(2).transpose(-1, -2)).float() * scale  # [B, nkv, g, m, T]
    rows = mask0[:, 0].gather(1, tpos[..., None].expand(b, m, t))  # [B, m, T] mask rows of the live positions
    s0 = s0 + rows[:, None, None]
    sd = [(qg * pack(kd).unsqueeze(2)).sum(-1, keepdim=True).float() * scale for kd in diag_k]  # [B, nkv, g, m, 1]
    p = torch.softmax(torch.cat([s0, *sd], dim=-1), dim=-1).to(q.dtype)  # [B, nkv, g, m, T + k]
    out = torch.matmul(p[..., :t], v0.unsqueeze(2))  # [B, nkv, g, m, hd]
    for i, vd in enumerate(diag_v):
        out = out + p[..., t + i: t + i + 1] * pack(vd).unsqueeze(2)
    out = out.reshape(b, nh, m, hd)
    return out[bi, :, slot].transpose(0, 1).unsqueeze(0)  # [N, nh, hd] -> [1, nh, N, hd]
