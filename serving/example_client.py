"""Talk to `speculators serve` (or vLLM) with the official `openai` client: one streamed chat answer, then the
server's speculative-decoding counters from /metrics.

    python serving/example_client.py --base-url http://127.0.0.1:8000/v1 --api-key "$SPEC_API_KEY"
"""

from __future__ import annotations

import argparse
import urllib.request


def main() -> None:
    from openai import OpenAI

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none", help="the server's key (any string when it has none)")
    parser.add_argument("--message", default="Write a Python function that reverses a list.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": args.message}],
                                            max_tokens=args.max_tokens, temperature=args.temperature, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    metrics_url = args.base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(("speculators_acceptance_length ", "speculators_per_position_acceptance{",
                                "speculators_target_calls_total ", "speculators_accepted_tokens_total ")):
                print(line)


if __name__ == "__main__":
    main()
