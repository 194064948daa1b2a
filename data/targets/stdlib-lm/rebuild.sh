#!/usr/bin/env bash
# Rebuild the house target (tokenizer + model + report) and the held-out workloads / chat dataset from the
# Python standard library of the interpreter that runs it. About 75 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec "${PYTHON:-.venv/bin/python}" -m speculators.cli build-house --out data/targets/stdlib-lm \
  --workloads data/workloads --datasets data/datasets/stdlib-chat \
  --code-datasets data/datasets/stdlib-code "$@"
