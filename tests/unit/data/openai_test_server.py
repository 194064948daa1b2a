"""A small real OpenAI-compatible HTTP server for the regenerate tests: it serves a transformers causal LM on
`/v1/chat/completions` and `/v1/completions` (greedy decoding, stops at any special token), lists it on
`/v1/models` (named by its directory, as vLLM names a model by the path it was given) and, like vLLM, answers
HTTP 400 when a prompt is longer than its context limit. `failures=N` makes the first N generation requests fail
with `failure_status` (a flaky server). Runs in a thread of the test process."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class ModelServer:
    def __init__(self, model_dir: str, max_prompt_tokens: int = 100_000, port: int = 0, failures: int = 0,
                 failure_status: int = 503) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.max_prompt_tokens = max_prompt_tokens
        self.stop = sorted(int(i) for i in self.tok.all_special_ids)
        self.lock = threading.Lock()
        self.requests = 0
        self.failures, self.failure_status = failures, failure_status
        self.model_name = str(model_dir)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server API
                if self.path == "/v1/models":
                    self._answer(200, {"object": "list", "data": [{"id": server.model_name, "object": "model"}]})
                else:
                    self._answer(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._answer(*server.handle(self.path, body))

            def _answer(self, status: int, out: dict) -> None:
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> ModelServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def handle(self, path: str, body: dict) -> tuple[int, dict]:
        with self.lock:
            self.requests += 1
            if self.failures > 0:
                self.failures -= 1
                return self.failure_status, {"error": {"message": "the server is overloaded (test failure)"}}
        if path == "/v1/chat/completions":
            kwargs = body.get("chat_template_kwargs") or {}
            ids = self.tok.apply_chat_template(body["messages"], tools=body.get("tools"), tokenize=True,
                                               add_generation_prompt=True, return_dict=True, **kwargs)["input_ids"]
        elif path == "/v1/completions":
            ids = self.tok(body["prompt"])["input_ids"]
        else:
            return 404, {"error": {"message": f"no route {path}"}}
        if len(ids) > self.max_prompt_tokens:
            return 400, {"error": {"message": f"prompt has {len(ids)} tokens, the limit is {self.max_prompt_tokens}"}}
        with self.lock, torch.no_grad():
            out = self.model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                      dtype=torch.long), max_new_tokens=int(body.get("max_tokens", 16)),
                                      do_sample=False, eos_token_id=self.stop, pad_token_id=self.stop[0])
        gen = out[0, len(ids):].tolist()
        stop_at = next((i for i, t in enumerate(gen) if t in self.stop), None)
        text = self.tok.decode(gen if stop_at is None else gen[:stop_at], skip_special_tokens=False)
        finish = "length" if stop_at is None else "stop"
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(gen)}
        if path == "/v1/completions":
            return 200, {"choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": usage}
        return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": finish}], "usage": usage}
