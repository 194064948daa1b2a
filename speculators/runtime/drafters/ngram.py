"""N-gram (prompt lookup) drafting: propose what followed an earlier occurrence of the context's suffix.

`ngram_propose(context, k)` is the pure proposal rule (the evaluator scores it at the served drafter's n-gram
lengths, `NgramDrafter.lookup`, for the n-gram baseline): for n = max_ngram down to min_ngram, find the MOST RECENT
earlier occurrence of the last n tokens of `context` that is followed by at least one token, and return up to k
tokens that followed it. Longer suffixes win; [] when no suffix of length >= min_ngram recurs.

`ngram_continuations(context, k, max_ngram, min_ngram, num)` returns up to `num` such continuations with
distinct first tokens (most recent match first, at the longest matching n), from which a drafter builds a
small tree. No weights, no training, no probabilities: trees built from these are verified in "greedy"
(T = 0) or "deterministic" (T > 0) mode.

`TokenBuffer` holds a growing context as a numpy array (amortised appends), so a lookup per cycle does not convert
the whole context from a list each time.

Not here: the Drafter protocol adapter (model_free.py), suffix trees over past requests, match scoring.
"""

from __future__ import annotations

import numpy as np


def _match_starts(arr: np.ndarray, n: int) -> np.ndarray:
    """Start indices i < len - n with arr[i:i+n] == arr[-n:] (so at least one token follows), ascending."""
    length = arr.shape[0]
    if length <= n:
        return np.empty(0, dtype=np.int64)
    span = length - n  # candidate starts 0..span-1 (start span is the suffix itself)
    hit = np.ones(span, dtype=bool)
    suffix = arr[-n:]
    for j in range(n):
        hit &= arr[j:j + span] == suffix[j]
    return np.nonzero(hit)[0]


def ngram_continuations(context: list[int] | np.ndarray, k: int, max_ngram: int = 3, min_ngram: int = 1,
                        num: int = 1) -> list[list[int]]:
    """Up to `num` continuations (each <= k tokens, distinct first tokens) of the longest recurring suffix."""
    if k <= 0 or num <= 0:
        return []
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
    arr = np.asarray(context, dtype=np.int64)
    for n in range(min(max_ngram, arr.shape[0] - 1), min_ngram - 1, -1):
        starts = _match_starts(arr, n)
        if starts.size == 0:
            continue
        out: list[list[int]] = []
        firsts: set[int] = set()
        for i in starts[::-1]:  # most recent first
            cont = arr[i + n:i + n + k].tolist()
            if cont[0] in firsts:
                continue
            firsts.add(cont[0])
            out.append(cont)
            if len(out) == num:
                break
        return out
    return []


def ngram_propose(context: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k draft tokens following the most recent earlier occurrence of the longest recurring suffix
    (n from max_ngram down to min_ngram) of `context`; [] when nothing recurs."""
    found = ngram_continuations(context, k, max_ngram, min_ngram, num=1)
    return found[0] if found else []


class TokenBuffer:
    """A growing token context backed by a numpy array (doubling capacity); `view()` is the context so far."""

    def __init__(self, tokens: list[int]) -> None:
        self._data = np.zeros(max(64, 2 * len(tokens)), dtype=np.int64)
        self._size = 0
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        need = self._size + len(tokens)
        if need > self._data.shape[0]:
            grown = np.zeros(2 * need, dtype=np.int64)
            grown[:self._size] = self._data[:self._size]
            self._data = grown
        self._data[self._size:need] = tokens
        self._size = need

    def view(self) -> np.ndarray:
        return self._data[:self._size]

    def __len__(self) -> int:
        return self._size
