#!/usr/bin/env bash
# The GPU path measured, in one prepared script (issue 16). On a CUDA machine (H200: < 10 minutes):
#   1. pytest tests/gpu: greedy parity with Hugging Face on held-out rows in float32 and bfloat16, and the
#      end-to-end sampling chi-square (plus a lossy control that must be rejected), on the device;
#   2. `speculators bench` on the house target (plain, n-gram, the house EAGLE-3 when given, HF generate);
#   3. `speculators profile` of the Llama-3.1-8B shape (random bf16 weights) at batch 1-64 with the house EAGLE-3
#      acceptance plugged in (a fixed a_k list when no speculator is given);
#   4. `speculators profile` of the house target with its EAGLE-3: predicted vs measured speedup (needs SPECULATOR);
#   5. `speculators profile` of the house target with a DFlash export (a block drafter: one forward drafts the whole
#      block, k = block size - 1): predicted vs measured speedup (needs DFLASH; `bench` then runs it too).
#   Random heads of every family, DFlash included, are timed on the Llama-3.1-8B shape in step 3 either way.
#   6. capture-vllm: both capture backends on the same house rows (scripts/capture_backends.py): tokens/s of HF
#      forwards and of vLLM's extract_hidden_states, and the per-tap difference (needs vLLM: VLLM_PYTHON, or a
#      $PYTHON that imports vllm on the GPU image).
# With --cpu the same steps run on the CPU with small shapes and budgets (a CI test runs it: it cannot rot).
#
# usage: scripts/gpu_check.sh [--cpu]
# env:   OUT        results folder (default runs/gpu-check-<mode>): summary.md, gpu-check.log and the JSON records
#                   (at most 8 files, flat: what the device tool brings back)
#        SPECULATOR a trained house EAGLE-3 export dir (its report.json gives the acceptance), e.g. carried as
#                   .gpu-carry/house-eagle3
#        DFLASH     a trained house DFlash export dir (`speculators export` of recipes/house-dflash.yaml; its
#                   report.json gives the acceptance), e.g. carried as .gpu-carry/house-dflash
#        VLLM_PYTHON the interpreter of a vLLM environment for step 6 (default on a GPU: $PYTHON when it imports vllm)
#        STEPS      comma-separated subset of: pytest,bench,profile-shape,profile-house,profile-dflash,capture-vllm
#                   (default: all)
#        PYTHON     the interpreter (default: .venv/bin/python when `make install` made it, else python3 — the
#                   device image's, which holds torch with CUDA; the repo goes on PYTHONPATH, nothing is installed
#                   except wheels carried in .whl/, as the device notes describe)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
OUT="${OUT:-runs/gpu-check-$MODE}"
STEPS="${STEPS:-pytest,bench,profile-shape,profile-house,profile-dflash,capture-vllm}"
SPECULATOR="${SPECULATOR:-}"
DFLASH="${DFLASH:-}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d)"
LOG="$OUT/gpu-check.log"
SUMMARY="$OUT/summary.md"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1

if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if ! "$PY" -c "import torch, transformers, typer, yaml, safetensors, scipy, pytest, rich, tqdm" 2>/dev/null; then
  echo "gpu_check: $PY lacks a package the checks need (torch transformers typer pyyaml safetensors scipy pytest" \
       "rich tqdm); install them, or carry wheels in .whl/" >&2
  exit 2
fi
CLI=("$PY" -m speculators.cli)

if [ "$MODE" = gpu ]; then
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to $PY (run with --cpu for the CPU mode)" >&2
    exit 2
  fi
  DEVICE=cuda; THREADS=0
  T_PYTEST=240; T_BENCH=100; T_SHAPE=180; T_HOUSE=60; T_DFLASH=60
  BENCH_ARGS=(--rows-per-cohort 4 --temperatures 0)
  SHAPE_ARGS=(--shape llama-3.1-8b --dtype bfloat16 --batch-sizes 1,2,4,8,16,32,64 --context-len 512
              --max-depth 6 --budget-s 120)
  HOUSE_ARGS=(--budget-s 20 --check-rows 2 --check-depths 3,5)
  SHAPE_NAME=llama-3.1-8b
else
  export SPECULATORS_GPU_CHECK_DEVICE=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  DEVICE=cpu; THREADS=1
  T_PYTEST=300; T_BENCH=120; T_SHAPE=120; T_HOUSE=300; T_DFLASH=300
  BENCH_ARGS=(--workloads data/workloads/short-output.jsonl --rows-per-cohort 1 --temperatures 0 --no-hf
              --ngram-graft 0)
  SHAPE_ARGS=(--shape tiny-llama --batch-sizes 1,2 --nodes 1,2,4,8 --context-len 64 --max-depth 3 --budget-s 10)
  HOUSE_ARGS=(--budget-s 20 --check-rows 1 --check-depths 3 --workloads 'data/workloads/[cs]*.jsonl')
  SHAPE_NAME=tiny-llama
fi
[ -n "$SPECULATOR" ] && export SPECULATORS_GPU_CHECK_SPECULATOR="$SPECULATOR"
ACCEPTANCE="${SPECULATOR:-0.8,0.7,0.6,0.5,0.4}"

FAILED=()
step() {  # step NAME SECONDS CMD...: run one step under a time limit; a failure is recorded, the rest still run
  local name=$1 limit=$2
  shift 2
  case ",$STEPS," in *",$name,"*) ;; *) echo "== $name: skipped (STEPS)"; return ;; esac
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=20 "$limit" "$@"
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || FAILED+=("$name (exit $rc)")
}

{
  echo "# gpu_check ($MODE) — $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo '```'
  "$PY" - <<'PY'
import platform, torch, transformers
print("python", platform.python_version(), "| torch", torch.__version__, "| transformers", transformers.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device:", torch.cuda.get_device_name(0), f"{p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
else:
    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print("device: CPU", model, "|", torch.get_num_threads(), "threads")
PY
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "speculator: ${SPECULATOR:-none (random heads; acceptance $ACCEPTANCE)}"
  echo "dflash: ${DFLASH:-none (random DFlash heads in the shape profile only)}"
  echo '```'
  echo
} > "$SUMMARY"
cat "$SUMMARY"

step pytest "$T_PYTEST" "$PY" -m pytest tests/gpu -q -p no:cacheprovider -o junit_family=xunit1 \
  --junitxml "$WORK/gpu-tests.xml"
step bench "$T_BENCH" "${CLI[@]}" bench --target data/targets/stdlib-lm ${SPECULATOR:+--speculator "$SPECULATOR"} \
  ${DFLASH:+--speculator "$DFLASH"} --device "$DEVICE" --threads "$THREADS" "${BENCH_ARGS[@]}" --out "$WORK/bench"
step profile-shape "$T_SHAPE" "${CLI[@]}" profile "${SHAPE_ARGS[@]}" --acceptance "$ACCEPTANCE" \
  --families eagle3,medusa,mtp,dflash --device "$DEVICE" --threads "$THREADS" --out "$WORK/profile-shape"
if [ -n "$SPECULATOR" ]; then
  step profile-house "$T_HOUSE" "${CLI[@]}" profile --target data/targets/stdlib-lm --speculator "$SPECULATOR" \
    --acceptance "$SPECULATOR" --device "$DEVICE" --threads "$THREADS" "${HOUSE_ARGS[@]}" --out "$WORK/profile-house"
else
  echo "== profile-house: skipped (no SPECULATOR: the check needs a trained speculator)"
fi
if [ -n "$DFLASH" ]; then
  step profile-dflash "$T_DFLASH" "${CLI[@]}" profile --target data/targets/stdlib-lm --speculator "$DFLASH" \
    --acceptance "$DFLASH" --device "$DEVICE" --threads "$THREADS" "${HOUSE_ARGS[@]}" --out "$WORK/profile-dflash"
else
  echo "== profile-dflash: skipped (no DFLASH: the check needs a trained DFlash export)"
fi
VLLM_PY="${VLLM_PYTHON:-}"
if [ -z "$VLLM_PY" ] && [ "$MODE" = gpu ] && "$PY" -c "import vllm" 2>/dev/null; then VLLM_PY="$PY"; fi
if [ -n "$VLLM_PY" ]; then
  export SPECULATORS_VLLM_PYTHON="$VLLM_PY"
  step capture-vllm 600 "$PY" scripts/capture_backends.py \
    recipes/house-eagle3.yaml "run_dir=$WORK/capture" data.regenerate.enabled=false data.sources.0.max_rows=256 \
    data.sources.1.max_rows=64 "target.device=$DEVICE" target.dtype=float32 capture.teacher=topk
else
  echo "== capture-vllm: skipped (no vLLM environment: set VLLM_PYTHON)"
fi

# the records: flat in $OUT (the device tool returns at most 8 files, two folders deep)
[ -f "$WORK/bench/bench.json" ] && cp "$WORK/bench/bench.json" "$OUT/bench.json"
[ -f "$WORK/profile-shape/profile.json" ] && cp "$WORK/profile-shape/profile.json" "$OUT/profile-$SHAPE_NAME.json"
[ -f "$WORK/profile-house/profile.json" ] && cp "$WORK/profile-house/profile.json" "$OUT/profile-house.json"
[ -f "$WORK/profile-dflash/profile.json" ] && cp "$WORK/profile-dflash/profile.json" "$OUT/profile-dflash.json"
[ -f "$WORK/capture/backends/report.json" ] && cp "$WORK/capture/backends/report.json" "$OUT/capture-backends.json"
{
  echo "## GPU tests (tests/gpu)"
  echo
  if [ -f "$WORK/gpu-tests.xml" ]; then
    "$PY" - "$WORK/gpu-tests.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
for case in root.iter("testcase"):
    outcome = "FAILED" if case.find("failure") is not None or case.find("error") is not None else (
        "skipped" if case.find("skipped") is not None else "passed")
    props = [p.get("value") for p in case.iter("property")]
    if outcome != "skipped":
        print(f"- {outcome}: {case.get('name')}" + (f" — {'; '.join(props)}" if props else ""))
PY
  else
    echo "(not run)"
  fi
  echo
  for md in "$WORK/bench/bench.md" "$WORK/profile-shape/profile.md" "$WORK/profile-house/profile.md" \
            "$WORK/profile-dflash/profile.md" "$WORK/capture/backends/report.md"; do
    [ -f "$md" ] && { cat "$md"; echo; }
  done
  echo "## Steps"
  echo
  if [ ${#FAILED[@]} -eq 0 ]; then echo "every step passed"; else printf -- '- failed: %s\n' "${FAILED[@]}"; fi
} >> "$SUMMARY"
rm -rf "$WORK"
echo "gpu_check ($MODE): results in $OUT ($(ls "$OUT" | tr '\n' ' '))"
if [ ${#FAILED[@]} -gt 0 ]; then
  printf 'gpu_check: failed: %s\n' "${FAILED[@]}" >&2
  exit 1
fi
