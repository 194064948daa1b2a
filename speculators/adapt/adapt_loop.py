"""`speculators adapt RECIPE`: the learn-from-traffic loop in one command.

The recipe is a traffic recipe: its `data.sources` are recordings of a server (`speculators serve --record DIR`),
`train.init_from` is the draft revision that server runs, `data.traffic.held_back` > 0 keeps the newest recorded rows
out of training. `adapt` then
1. runs the traffic stage (recorded rows + replay -> weighted features; data/traffic.py) and training (a new revision
   continuing the running one);
2. scores the running and the new revision on the held-back rows (tau at cycle starts, evaluate/adoption.py) and
   adopts the new one only when it drafts better by more than `margin`;
3. when adopted and a server URL is given, asks that server to swap it in (`POST /admin/draft-revision`: between
   cycles, no restart, no request dropped; the previous revision stays for rollback).
The verdict is written to `RUN_DIR/adapt-report.json`. Not here: recording (the server), the swap (runtime).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from speculators.core.atomic import write_json_atomic
from speculators.core.checkpoints import read_pointer
from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.target import load_target
from speculators.data import traffic
from speculators.data.artifacts import read_manifest
from speculators.evaluate.adoption import compare_revisions
from speculators.models.io import target_weights
from speculators.train import train as train_stage

REPORT = "adapt-report.json"


def run_adapt_loop(recipe: Recipe, *, server: str | None = None, margin: float = 0.0, depth: int | None = None,
          api_key_env: str | None = None, force: bool = False, log: Callable[[str], None] = print) -> dict:
    """Train a revision on the recipe's recorded traffic, gate it on the held-back rows, swap it in when it wins."""
    if not recipe.traffic_dirs:
        raise SpeculatorsError("speculators adapt needs a traffic recipe: data.sources: [{traffic: DIR}] (a recording "
                               "of speculators serve --record DIR)")
    running = recipe.train.init_from
    if not running:
        raise SpeculatorsError("speculators adapt continues the running revision: set train.init_from to it")
    if not 0.0 < recipe.data.traffic.held_back < 1.0:
        raise SpeculatorsError("speculators adapt compares revisions on held-back traffic: set data.traffic.held_back "
                               "in (0, 1), e.g. 0.2")
    t0 = time.time()
    log(f"[traffic] {recipe.traffic_dirs} -> {recipe.paths.features}")
    data = traffic.run(recipe, force=force)
    log(f"[train] from {running}")
    trained = train_stage.run(recipe, force=force)
    candidate = read_pointer(recipe.paths.checkpoints, "latest")
    if candidate is None:
        raise SpeculatorsError(f"training wrote no checkpoint in {recipe.paths.checkpoints}")
    held = read_manifest(recipe.paths.features, "speculators.features/v1", "features")["traffic"]["held_back_rows"]
    depth = int(depth or recipe.evaluate.depth)
    log(f"[gate] {running} vs {candidate} on {len(held)} held-back rows, chain of {depth}")
    weights = target_weights(load_target(recipe.target, device="cpu").model)
    verdict = compare_revisions(running, candidate, [(d, int(i)) for d, i in held], depth, weights, margin)
    verdict["swap"] = _swap(server, str(candidate), api_key_env) if verdict["adopt"] and server else None
    report = {"status": "adopted" if verdict["adopt"] else "kept the running revision", **verdict,
              "traffic": {k: v for k, v in data.items() if k != "held_back_rows"},
              "train_steps": trained.get("steps"), "seconds": round(time.time() - t0, 1)}
    write_json_atomic(recipe.paths.run_dir / REPORT, report)
    return report


def _swap(server: str, candidate: str, api_key_env: str | None) -> dict:
    """POST the candidate to the server's admin endpoint; its answer (or the error, in one line)."""
    headers = {"Content-Type": "application/json"}
    if api_key_env:
        headers["Authorization"] = f"Bearer {os.environ.get(api_key_env, '')}"
    req = urllib.request.Request(server.rstrip("/") + "/admin/draft-revision", method="POST", headers=headers,
                                 data=json.dumps({"path": candidate}).encode())
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise SpeculatorsError(f"the server at {server} refused the swap ({exc.code}): "
                               f"{exc.read().decode(errors='replace')[:300]}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise SpeculatorsError(f"cannot reach the server at {server} ({exc}); the new revision is {candidate}") \
            from None
