"""vLLM's own `speculators` library (0.9.0, in the vLLM environment) loads our EAGLE-3 export and computes the same
draft logits as this toolkit, in float32 on real taps of the house target (it needs `embed_tokens.weight` in the
file: without it the library drafts with an all-zero embedding)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from speculators.core.config import TargetConfig
from speculators.core.target import forward_with_taps, load_target
from speculators.core.vllm_env import server_env
from speculators.models.io import load_speculator, target_weights
from tests.conftest import HOUSE_TARGET

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).resolve().parent / "scripts" / "speculators_library_logits.py"


def test_speculators_library_reproduces_our_logits(house_eagle3_run: Path, vllm_python: Path, tmp_path: Path) -> None:
    export = Path(yaml.safe_load(house_eagle3_run.read_text())["run_dir"]) / "export"
    target = load_target(TargetConfig(name_or_path=str(HOUSE_TARGET), device="cpu", dtype="float32"))
    spec = load_speculator(export, target_weights(target.model)).float().eval()
    text = (Path(HOUSE_TARGET).parents[1] / "workloads" / "code-completion.jsonl").read_text().splitlines()[0]
    prompt = yaml.safe_load(text)["prompt"]
    ids = torch.tensor([target.tokenizer(prompt).input_ids[:96]])  # [1, T]
    layers = list(spec.required_features().tap_layer_ids)
    taps = forward_with_taps(target.model, ids, torch.ones_like(ids), layers).taps.float()  # [1, T, 3H]
    with torch.no_grad():
        ours = [s[0].float() for s in spec.forward_train({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                                          "taps": taps})]  # K x [T, Vd]
    save_file({"input_ids": ids, "taps": taps.contiguous(), "steps": torch.tensor(len(ours))},
              str(tmp_path / "in.safetensors"))
    res = subprocess.run([str(vllm_python), str(SCRIPT), str(export), str(tmp_path / "in.safetensors"),
                          str(tmp_path / "out.safetensors")], capture_output=True, text=True, cwd=tmp_path,
                         env=server_env(vllm_python), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    theirs = load_file(str(tmp_path / "out.safetensors"))
    assert torch.equal(theirs["embed_tokens"], target_weights(target.model).embed_tokens.float().to(torch.bfloat16)
                       .float())
    t = ids.shape[1]
    for k, mine in enumerate(ours):
        valid = t - 1 - k  # positions whose shifted input token exists
        mine, lib = mine[:valid], theirs[f"logits.{k}"][:valid]  # [valid, Vd]
        # float32 sums in another order (the library's own modules, another BLAS path per CPU): 1e-4 of the logit
        # scale (a wrong key, norm or tap order moves logits by O(1)); the argmax must agree wherever our top two
        # are further apart than that.
        tol = 1e-4 * max(1.0, mine.abs().max().item())
        diff = (mine - lib).abs().max().item()
        assert diff <= tol, f"step {k}: max |logit difference| {diff} > {tol}"
        top2 = mine.topk(2, dim=-1).values  # [valid, 2]
        clear = (top2[:, 0] - top2[:, 1]) > 2 * tol  # [valid]
        assert torch.equal(mine[clear].argmax(-1), lib[clear].argmax(-1))
