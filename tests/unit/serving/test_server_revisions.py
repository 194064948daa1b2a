"""The server's admin endpoint over real HTTP: a draft revision swapped in while requests stream drops none and keeps
their T = 0 text, /metrics shows acceptance per revision, a rollback and the bad requests (another kind of drafter, a
malformed body) answer as they should, and `serve --record` rows appear as requests finish."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

from speculators.core.config import ServeConfig
from speculators.data.shards import FeatureStore
from speculators.runtime.recording import RecordingSpec
from speculators.serving import Engine, SamplingParams
from speculators.serving.server import create_app
from tests.unit.runtime.runtime_helpers import loaded_target, make_speculator_dir, single_thread  # noqa: F401
from tests.unit.serving.live_server import LiveServer

PROMPTS = ["def f(x):", "a b c a b c a b", "import os\nimport sys\n", "x = 1\ny = 2\nz ="]


def test_swap_and_rollback_under_streaming_requests(tiny_llama, tmp_path, monkeypatch) -> None:
    target = loaded_target(str(tiny_llama))
    a = make_speculator_dir(tiny_llama, "eagle3", tmp_path / "a", seed=3, num_steps=2)
    b = make_speculator_dir(tiny_llama, "eagle3", tmp_path / "b", seed=4, num_steps=2)
    medusa = make_speculator_dir(tiny_llama, "medusa", tmp_path / "m", seed=3)
    plain = Engine.from_pretrained(target, "none", max_len=128)
    want = [plain.generate(p, SamplingParams(max_new_tokens=24)).text for p in PROMPTS]
    engine = Engine.from_pretrained(target, str(a), max_len=128)
    engine.record_to(RecordingSpec(tmp_path / "rec"))
    release, reached, real = threading.Event(), threading.Event(), engine.request

    def held(*args, **kw):  # the first request waits inside its first cycle until the swap is staged
        gen = real(*args, **kw)
        first = next(gen)
        reached.set()
        release.wait(timeout=60)
        reply = yield first
        while True:
            try:
                reply = yield gen.send(reply)
            except StopIteration:
                return

    monkeypatch.setattr(engine, "request", held)
    with LiveServer(create_app(engine, ServeConfig(max_concurrent_requests=4, max_batch_size=4))) as srv:
        def call(i: int):
            return srv.client.post("/v1/completions", json={"prompt": PROMPTS[i], "max_tokens": 24,
                                                            "temperature": 0, "stream": i % 2 == 1})

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(call, i) for i in range(4)]
            srv.wait_until(lambda: srv.health()["in_flight"] == 4 and reached.is_set())
            swap = srv.client.post("/admin/draft-revision", json={"path": str(b)})
            release.set()
            answers = [f.result() for f in futures]
        report = srv.client.get("/admin/draft-revision").json()
        metrics = srv.client.get("/metrics").text
        wrong = srv.client.post("/admin/draft-revision", json={"path": str(medusa)})
        malformed = srv.client.post("/admin/draft-revision", content=b"{nope")
        back = srv.client.post("/admin/draft-revision", json={"rollback": True})
        srv.client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
        after = srv.client.get("/admin/draft-revision").json()
    name_a, name_b = (json.loads((d / "pairing.json").read_text())["draft"]["revision"] for d in (a, b))
    assert swap.status_code == 200 and swap.json()["staged"] == name_b
    for i, answer in enumerate(answers):
        assert answer.status_code == 200, answer.text
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in answer.text.strip().split("\n\n")
                       if line != "data: [DONE]") if i % 2 else answer.json()["choices"][0]["text"]
        assert text == want[i], f"request {i}"
    assert report["running"] == name_b and report["swaps"] == 1 and set(report["acceptance"]) == {name_a, name_b}
    assert f'speculators_revision_acceptance_length{{revision="{name_b}"}}' in metrics
    assert f'speculators_revision_target_calls{{revision="{name_a}"}}' in metrics
    assert wrong.status_code == 400 and "only a revision of the same kind" in wrong.json()["error"]["message"]
    assert malformed.status_code == 400
    assert back.status_code == 200 and back.json()["staged"] == name_a and after["running"] == name_a
    store = FeatureStore(tmp_path / "rec")
    assert len(store) == 5 and json.loads((tmp_path / "rec" / "manifest.json").read_text())["recording"][
        "draft_revisions"] == sorted({name_a, name_b})
