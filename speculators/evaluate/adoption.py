"""The adoption gate: does a candidate draft revision draft better than the running one on a held-back slice of
recent served traffic? (the last step of `speculators adapt`, before a server is told to swap.)

Both revisions are scored teacher-forced on the same recorded rows (runtime/recording.py: the served tokens with the
taps the server computed), exactly as evaluation predicts serving: each revision's draft chain at every cycle root
of the generated span (`drafts.draft_logits`), accepted at depth k when its argmax equals the token the target
served there (the target's greedy token at T = 0; at T > 0 its draw, which an argmax chain must equal), and the
cycles a server runs over the span walked by `replay.replay_chain` -> tau at cycle starts. The candidate is adopted
only when its tau beats the running revision's by more than `margin`.

Not here: recording, training, or the swap itself (the server's admin endpoint, serving/server.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from speculators.core.errors import SpeculatorsError
from speculators.core.pairing import read_pairing
from speculators.data.shards import FeatureStore
from speculators.evaluate.drafts import draft_logits
from speculators.evaluate.replay import CycleCounts, argmax_chain_weights, replay_chain
from speculators.models.io import load_speculator


def row_counts(spec: Any, store: FeatureStore, i: int, depth: int) -> CycleCounts:
    """The cycles a depth-`depth` chain of `spec` runs over recorded row i's generated span."""
    seq = store.sequence(i)
    ids = seq["input_ids"].tolist()
    total = len(ids)
    prompt = total - int(seq["loss_mask"].sum())
    counts = CycleCounts(depth)
    if total - prompt < 1:
        return counts
    steps = draft_logits(spec, ids, {"taps": seq["taps"][None]}, prompt, depth)  # K x [T, Vd]
    w = argmax_chain_weights(steps, ids, prompt, spec.draft_to_target.cpu(), int(store.manifest["vocab_size"]), depth)
    counts.merge(replay_chain(w, prompt, total, total - prompt, depth))
    return counts


def revision_tau(spec: Any, store: FeatureStore, rows: list[int], depth: int) -> CycleCounts:
    """Cycle counts of `spec` over the recorded `rows` (their sum)."""
    out = CycleCounts(depth)
    spec.eval()
    for i in rows:
        out.merge(row_counts(spec, store, i, depth))
    return out


def compare_revisions(running: str | Path, candidate: str | Path, rows: list[tuple[str, int]], depth: int,
                      target_weights: Any, margin: float = 0.0) -> dict:
    """Score both revisions on the recorded `rows` ((recording dir, row index) pairs); {"adopt": bool,
    "tau_running", "tau_candidate", ...}."""
    if not rows:
        raise SpeculatorsError("no held-back recorded rows to compare the revisions on (set data.traffic.held_back)")
    stores = {d: FeatureStore(d) for d in dict.fromkeys(str(d) for d, _ in rows)}
    pairings = [read_pairing(running), read_pairing(candidate)]
    want = pairings[0]["target"]["content_hash"]
    if pairings[1]["target"]["content_hash"] != want or \
            any(s.manifest["target"]["content_hash"] != want for s in stores.values()):
        raise SpeculatorsError(f"the revisions {running} and {candidate} and the recordings are not all of one target "
                               "revision; a swap would break the pairing")
    taus = []
    for directory in (running, candidate):
        spec = load_speculator(directory, target_weights)
        counts = CycleCounts(depth)
        for d, store in stores.items():
            counts.merge(revision_tau(spec, store, [i for rd, i in rows if str(rd) == d], depth))
        taus.append(counts)
    run_c, cand_c = taus
    adopt = cand_c.tau > run_c.tau + margin
    return {"adopt": adopt, "tau_running": round(run_c.tau, 4), "tau_candidate": round(cand_c.tau, 4),
            "per_position_running": [round(x, 4) for x in run_c.per_position()],
            "per_position_candidate": [round(x, 4) for x in cand_c.per_position()],
            "rows": len(rows), "cycles": round(run_c.calls, 1), "depth": depth, "margin": margin,
            "running": str(running), "candidate": str(candidate),
            "revision_running": pairings[0]["draft"]["revision"],
            "revision_candidate": pairings[1]["draft"]["revision"]}
