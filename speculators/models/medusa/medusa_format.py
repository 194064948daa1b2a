"""Medusa in vLLM's own HF format (`model_type: "medusa"`): `num_heads` x `num_hidden_layers` ResBlocks
`blocks.{h}.layers.{l}.weight` [H, H] (+bias iff `medusa_fc_bias`) and `lm_heads.{h}.weight` [V, H].

`validate_medusa(config, tensors, target, problems)` appends one line per problem; `check_medusa_export` (registered
as the family's vLLM format) runs it with the checks every weight-file format shares (format_checks.py). It never
writes anything.
"""

from __future__ import annotations

from pathlib import Path

from speculators.models import register_format
from speculators.models.format_checks import Tensors, check_weight_dir, expect_shape, is_int


def validate_medusa(config: dict, t: Tensors, target: dict | None, problems: list[str]) -> None:
    for key in ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers"):
        if not is_int(config.get(key)) or config[key] < (0 if key == "num_hidden_layers" else 1):
            problems.append(f"medusa config.json needs an integer {key}, got {config.get(key)!r}")
    if problems:
        return
    if not isinstance(config.get("medusa_fc_bias", False), bool):
        problems.append("medusa_fc_bias must be true/false")
    h, vocab = config["hidden_size"], config["vocab_size"]
    rows = config.get("truncated_vocab_size") or vocab
    bias = bool(config.get("medusa_fc_bias", False))
    expected: dict[str, list[int]] = {}
    for head in range(config["num_heads"]):
        for layer in range(config["num_hidden_layers"]):
            expected[f"blocks.{head}.layers.{layer}.weight"] = [h, h]
            if bias:
                expected[f"blocks.{head}.layers.{layer}.bias"] = [h]
        expected[f"lm_heads.{head}.weight"] = [rows, h]
    if rows != vocab:
        expected["token_map"] = [rows]
    for name, shape in expected.items():
        expect_shape(t, name, shape, problems)
    unknown = sorted(k for k in t.info if k not in expected)
    if unknown:
        problems.append(f"unexpected tensors {unknown[:4]}{' ...' if len(unknown) > 4 else ''}; vLLM's Medusa "
                        f"loader fails on parameter names it does not know")
    if target:
        if int(target.get("vocab_size", vocab)) != vocab:
            problems.append(f"medusa vocab_size {vocab} differs from the target's {target.get('vocab_size')}")
        if int(target.get("hidden_size", h)) != h:
            problems.append(f"medusa hidden_size {h} differs from the target's {target.get('hidden_size')}")


@register_format("medusa")
def check_medusa_export(config: dict, directory: Path, problems: list[str], deep: bool) -> None:
    check_weight_dir(config, directory, problems, deep, validate_medusa)
