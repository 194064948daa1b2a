"""`speculators generate` on the house target: one prompt, one chat message, a workload file; and one clear
error (exit 2) for each kind of bad input."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.integration.cli_helpers import cli, cli_here, error_line
from tests.unit.runtime.runtime_helpers import hf_greedy, loaded_target, make_speculator_dir

pytestmark = pytest.mark.integration

PROMPT = "    def close(self):\n        self.file.close()\n\n    def flush(self):\n        self.file."


def test_prompt_json_matches_hf_greedy(house_target) -> None:
    proc = cli("generate", "--target", str(house_target), "--speculator", "ngram", "--prompt", PROMPT,
               "--max-new-tokens", "24", "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    from speculators.serving import Engine

    ids = Engine(loaded_target(str(house_target))).encode(PROMPT)
    assert record["token_ids"] == hf_greedy(house_target, ids, 24)
    assert record["stats"]["drafter"] == "ngram" and record["stats"]["target_calls"] >= 1
    assert record["stats"]["tau"] >= 1.0 and "adaptive" in record["stats"]


def test_chat_and_workload(house_target, tmp_path) -> None:
    proc = cli("generate", "--target", str(house_target), "--chat", "Which module defines `main`?",
               "--max-new-tokens", "8", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[none]" in proc.stderr and "tau 1.00" in proc.stderr
    rows = [json.loads(line) for name in ("code-completion", "short-output")
            for line in open(f"data/workloads/{name}.jsonl").read().splitlines()[:1]]
    workload = tmp_path / "two.jsonl"
    workload.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    proc = cli("generate", "--target", str(house_target), "--speculator", "ngram", "--workload", str(workload),
               "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert [line["id"] for line in lines[:2]] == [r["id"] for r in rows]
    assert set(lines[2]["summary"]) == {"code-completion", "short-output"}
    assert lines[1]["stats"]["generated_tokens"] <= rows[1]["max_new_tokens"]
    batched = cli("generate", "--target", str(house_target), "--speculator", "ngram", "--workload", str(workload),
                  "--device", "cpu", "--json", "--batch", "2")
    assert batched.returncode == 0, batched.stderr[-2000:]
    assert "batch of up to 2: 2 requests" in batched.stderr
    together = [json.loads(line) for line in batched.stdout.strip().splitlines()]
    assert [t["token_ids"] for t in together[:2]] == [line["token_ids"] for line in lines[:2]]


def test_bad_inputs_fail_with_one_line(house_target, tmp_path) -> None:
    base = ["generate", "--target", str(house_target), "--device", "cpu"]
    assert "max_new_tokens must be >= 1" in error_line(cli(*base, "--prompt", "x", "--max-new-tokens", "0"))
    # the rest through speculators.cli.main in this process (the console entry point is proven just above)
    assert "top_p must be in (0, 1]" in error_line(cli_here(*base, "--prompt", "x", "--top-p", "1.5"))
    assert "exactly one of" in error_line(cli_here(*base))
    assert "--batch must be >= 1" in error_line(cli_here(*base, "--prompt", "x", "--batch", "0"))
    assert "the prompt has" in error_line(cli_here(*base, "--prompt", "word " * 1500))
    # a speculator trained for another revision of the target (same shapes and tokenizer, other content)
    other = tmp_path / "other-target"
    shutil.copytree(house_target, other)
    config = json.loads((other / "config.json").read_text())
    config["note"] = "another revision"
    (other / "config.json").write_text(json.dumps(config))
    spec = make_speculator_dir(other, "medusa", tmp_path / "medusa")
    line = error_line(cli_here(*base, "--prompt", "x", "--speculator", str(spec)))
    record = json.loads((spec / "pairing.json").read_text())
    assert "target revision mismatch" in line and record["target"]["revision"] in line
    assert "--allow-revision-mismatch" in line
    ok = cli_here(*base, "--prompt", "x", "--max-new-tokens", "2", "--speculator", str(spec),
                  "--allow-revision-mismatch")
    assert ok.returncode == 0 and "warning: target revision mismatch" in ok.stderr
    (spec / "model.safetensors").unlink()
    assert "missing model.safetensors" in error_line(cli_here(*base, "--prompt", "x", "--speculator", str(spec)))
