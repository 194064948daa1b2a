"""`speculators regenerate` against a real `vllm serve` of the house target (OpenAI endpoint): every regenerated
turn is exactly what the same server answers to a direct request at T = 0, for chat rows and raw completion rows.
The server is the session's `house_ngram_server` (tests/vllm/fixtures.py: the house target with vLLM's n-gram
drafter, shared with the n-gram baseline), so regenerate's concurrent requests are also verified speculatively."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import datasets
import pytest

from speculators.export.vllm_consumer import served_model
from tests.vllm.fixtures import REPO, cli, write_recipe

pytestmark = pytest.mark.vllm


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def test_regenerate_through_vllm_matches_direct_requests(house_ngram_server, tmp_path: Path) -> None:
    chat = (REPO / "data" / "datasets" / "stdlib-chat" / "train.jsonl").read_text().splitlines()[:5]
    code = (REPO / "data" / "datasets" / "stdlib-code" / "train.jsonl").read_text().splitlines()[:2]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(chat + code) + "\n")
    server = house_ngram_server
    model = served_model(server.url)
    recipe = write_recipe(tmp_path / "regen.yaml", tmp_path / "run",
                          data={"sources": [{"path": str(rows)}], "max_length": 512,
                                "regenerate": {"enabled": True, "backend": "openai", "endpoint": f"{server.url}/v1",
                                               "model": model, "max_new_tokens": 32, "temperature": 0.0,
                                               "concurrency": 4}})
    cli("run", str(recipe), "--only", "prepare,regenerate")  # both stages in one process
    regenerated = datasets.load_from_disk(str(tmp_path / "run" / "regenerated"))
    assert len(regenerated) == 7
    for row in regenerated:
        conv = json.loads(row["conversation"])
        if "messages" in conv:
            msgs = conv["messages"]
            direct = _post(f"{server.url}/v1/chat/completions", {"model": model, "messages": msgs[:-1],
                                                                "max_tokens": 32, "temperature": 0.0})
            assert msgs[-1]["content"] == direct["choices"][0]["message"]["content"], row["id"]
        else:
            direct = _post(f"{server.url}/v1/completions", {"model": model, "prompt": conv["prompt"],
                                                           "max_tokens": 32, "temperature": 0.0})
            assert conv["completion"] == direct["choices"][0]["text"], row["id"]
