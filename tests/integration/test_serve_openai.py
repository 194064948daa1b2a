"""`speculators serve` as a real subprocess, driven by the `openai` Python client: a streaming chat request,
the API key, a bad request answered with a clear 400 while the server keeps serving, and /metrics. Its settings come
from a recipe's serve: section (one configuration: recipe = server limits = CLI flags, flags winning); settings that
contradict the model's context fail with one line."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.cli_helpers import cli, cli_here, error_line, serve_process

pytestmark = pytest.mark.integration

KEY = "test-key-123"


@pytest.fixture(scope="module")
def server(house_target, tmp_path_factory):
    recipe = tmp_path_factory.mktemp("serve-recipe") / "serve.yaml"
    recipe.write_text(f"target: {{name_or_path: {house_target}, device: cpu}}\n"
                      "serve: {max_new_tokens: 64, api_key_env: SPEC_TEST_KEY, port: 1, max_concurrent_requests: 2}\n")
    with serve_process("--recipe", str(recipe), "--speculator", "ngram", "--max-concurrent-requests", "4",
                       env={"SPEC_TEST_KEY": KEY}) as (base, _):
        yield base


def test_openai_client_streaming_chat(server: str) -> None:
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Write a Python function that returns the sum of a list."}]
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0,
                                            stream=True)
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    text = "".join(pieces)
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
    assert text and text == full.choices[0].message.content
    assert finish in ("stop", "length") and full.usage.completion_tokens <= 32

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="x", top_p=1.5)
    assert "top_p must be in (0, 1]" in str(err.value)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).completions.create(
            model=model, prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:  # the recipe's serve.max_new_tokens
        client.completions.create(model=model, prompt="x", max_tokens=65)
    assert "exceeds this server's limit of 64" in str(err.value)
    again = client.completions.create(model=model, prompt="def add(a, b):\n    return", max_tokens=4,
                                      temperature=0, logprobs=2)
    assert len(again.choices[0].logprobs.token_logprobs) == again.usage.completion_tokens
    assert again.choices[0].finish_reason in ("stop", "length")

    metrics = httpx.get(server + "/metrics").text
    assert "speculators_draft_tokens_total" in metrics and "speculators_per_position_acceptance" in metrics
    assert 'speculators_requests_total{endpoint="/v1/completions",status="400"} 2.0' in metrics
    assert httpx.get(server + "/health").json()["max_concurrent_requests"] == 4  # the flag wins over the recipe


def test_limits_that_contradict_the_context_fail_with_one_line(house_target) -> None:
    line = error_line(cli("serve", "--target", str(house_target), "--device", "cpu", "--max-prompt-tokens", "2048"))
    assert "max_prompt_tokens=2048 leaves no room to generate in the model's 1024-token context" in line
    line = error_line(cli_here("serve", "--target", str(house_target), "--max-batch-size", "0"))
    assert "serve.max_batch_size must be >= 1" in line
