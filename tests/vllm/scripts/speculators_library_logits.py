"""Run INSIDE the vLLM environment (.venv-vllm): load an EAGLE-3 export with vLLM's own `speculators` library
(0.9.0) and write its per-step draft logits on the given taps.

usage: python speculators_library_logits.py EXPORT_DIR INPUTS.safetensors OUTPUT.safetensors
INPUTS holds input_ids [1, T] and taps [1, T, 3H] (the residual stream entering the aux layers); step k's logits at
position t come from the library's training-time-test forward fed the tokens shifted by 1 + k (its convention).
"""

import sys

import torch
from safetensors.torch import load_file, save_file

from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

export, inputs, output = sys.argv[1:4]
data = load_file(inputs)
config = Eagle3SpeculatorConfig.from_pretrained(export)
config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a GPU-sized block mask
model = Eagle3DraftModel.from_pretrained(export, config=config, torch_dtype=torch.float32).float().eval()
caught = []
model.lm_head.register_forward_hook(lambda module, args, out: caught.append(out.detach()))
ids = data["input_ids"]
shifted = torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=1)
steps = int(data["steps"].item())
with torch.no_grad():
    model(hidden_states=data["taps"], input_ids=shifted, document_ids=torch.zeros_like(ids), ttt_steps=steps)
save_file({"embed_tokens": model.embed_tokens.weight.detach().float().contiguous(),
           **{f"logits.{i}": c[0].float().contiguous() for i, c in enumerate(caught)}}, output)
