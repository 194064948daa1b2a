"""The `export` pipeline stage: `run` / `is_complete`, and `require_valid_export` (what every reader of an export
directory checks first).

`run` resolves the checkpoint the recipe names (evaluate's choice by default), checks its pairing with the target,
and lets the family's exporter (`Speculator.EXPORTER`: vllm.py for a vLLM-format directory, mtp_stitch.py for an MTP
module) write into a temp directory that replaces the export directory only when everything succeeded;
`pairing.json` is written last. It never branches on the family name and writes no format itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from speculators.core.atomic import atomic_dir
from speculators.core.config import Recipe
from speculators.core.errors import SpeculatorsError
from speculators.core.metrics import temperature_key
from speculators.core.pairing import check_pairing, draft_revision, read_pairing, write_pairing
from speculators.core.target import fingerprint_target, load_target
from speculators.export.mtp_stitch import export_mtp
from speculators.export.validate import validate_vllm_export
from speculators.export.vllm import REQUIRED_FILES, check_source, export_vllm, resolve_checkpoint
from speculators.models import SPECULATORS

# Speculator.EXPORTER -> fn(recipe, ckpt, family, target, fingerprint, out_dir) -> pairing record
EXPORTERS: dict[str, Callable[..., dict]] = {"vllm": export_vllm, "mtp": export_mtp}


def enabled(recipe: Recipe) -> bool:
    """Whether `speculators run` runs this stage: always."""
    return True


def run(recipe: Recipe, *, force: bool = False) -> dict:
    """Export the recipe's checkpoint (always rewrites; the pipeline skips a complete export) and summarize it."""
    ckpt = resolve_checkpoint(recipe)
    family = check_source(ckpt, recipe)
    target = load_target(recipe.target)
    fp = fingerprint_target(recipe.target, tokenizer=target.tokenizer, model_config=target.model.config).to_dict()
    check_pairing(read_pairing(ckpt), fp, allow_revision_mismatch=recipe.serve.allow_revision_mismatch)
    exporter = EXPORTERS[SPECULATORS[family].EXPORTER]
    out = recipe.paths.export
    with atomic_dir(out) as tmp:
        record = exporter(recipe, ckpt, family, target, fp, tmp)
        write_pairing(tmp, record)  # the manifest: last
    summary: dict[str, Any] = {"export": str(out), "source": str(ckpt), "family": family,
                               "format": record["export"]["kind"], "vllm_method": record["export"]["vllm_method"],
                               "k": record["export"]["launch_k"], "draft_revision": record["draft"]["revision"][:19],
                               "vllm": record["export"].get("vllm_served")}
    ev = record.get("evaluation")
    if ev:
        t = temperature_key(recipe.evaluate.select_temperature)
        summary[f"mean tau@T={t}"] = ev["temperatures"].get(t, {}).get("mean_tau")
    summary["launch"] = str(out / "launch.sh")
    return summary


def require_valid_export(directory: str | Path) -> None:
    """Raise one SpeculatorsError line when an export directory is incomplete or not vLLM-loadable."""
    d = Path(directory)
    if not d.is_dir():
        raise SpeculatorsError(f"export dir {d} does not exist; run `speculators export` first")
    missing = [f for f in REQUIRED_FILES if not (d / f).is_file()]
    if missing:
        raise SpeculatorsError(f"export dir {d} is missing {', '.join(missing)}; it is incomplete (re-run "
                               f"`speculators export`)")
    record = read_pairing(d)
    if record.get("export", {}).get("vllm_loadable", True):
        problems = validate_vllm_export(d)
        if problems:
            raise SpeculatorsError(f"export dir {d} is not vLLM-loadable: {'; '.join(problems[:3])}")
    if draft_revision(d) != record["draft"]["revision"]:
        raise SpeculatorsError(f"the weights in {d} changed since pairing.json was written; re-run "
                               f"`speculators export`")


def is_complete(recipe: Recipe) -> bool:
    """The export exists, is valid, and was made from the checkpoint the recipe now resolves to."""
    try:
        require_valid_export(recipe.paths.export)
        record = read_pairing(recipe.paths.export)
        ckpt = resolve_checkpoint(recipe)
    except SpeculatorsError:
        return False
    return record.get("export", {}).get("source_revision") == draft_revision(ckpt)
