"""The server's admin routes for draft revisions (runtime/revisions.py), added to the app by `create_app`:

- `GET /admin/draft-revision`: the running revision, the previous one (rollback), a staged swap, and each
  revision's acceptance since start;
- `POST /admin/draft-revision` with {"path": "<speculator dir>"}: load that revision (paired with the served target,
  of the running drafter's kind) and swap it in at the next cycle boundary, no restart, no request dropped;
  {"rollback": true}: the previous revision. A refused revision is a 400 with one line; nothing is staged.

Which revision deserves a swap is decided before the call (`speculators adapt`: evaluate/adoption.py). These routes
sit behind the API key like /v1/* (serving/http_guard.py). Not here: the swap itself (the engine's serving thread).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import Request  # module level: FastAPI resolves handler annotations by name

from speculators.core.errors import SpeculatorsError
from speculators.runtime.engine import Engine
from speculators.serving.openai_api import APIError

REVISION_PATH = "/admin/draft-revision"


def add_revision_routes(app: Any, engine: Engine, count: Callable[[str, int], None]) -> None:
    @app.get(REVISION_PATH)
    async def revisions() -> dict:
        count(REVISION_PATH, 200)
        return engine.revisions.report()

    @app.post(REVISION_PATH)
    async def swap(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or not (isinstance(body.get("path"), str) or body.get("rollback") is True):
            raise APIError(400, 'send {"path": "<speculator dir>"} or {"rollback": true}', param="path")
        try:
            staged = await asyncio.to_thread(engine.stage_revision, None if body.get("rollback") else body["path"])
        except SpeculatorsError as exc:
            raise APIError(400, str(exc), param="path") from None
        count(REVISION_PATH, 200)
        return {"staged": staged, **engine.revisions.report()}
