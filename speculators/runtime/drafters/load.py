"""Drafters: what the engine asks for a draft tree each cycle, behind one protocol.

The protocol is the runtime half of `speculators.models.base.Speculator` (batch 1):
    state = d.new_state(max_len, device)
    d.absorb(state, features, next_tokens)   # committed positions p..p+n-1: the target's features there and
                                             # the token that follows each one
    tree = d.propose(state, root_token, tree_cfg, sampling, generator)   # a DraftTree rooted at root_token
    d.required_features() -> FeatureRequest
Model speculators (EAGLE-3, Medusa, MTP) ARE drafters: the engine calls their own methods; the model-free ones
(`NgramDrafter`, `NoDrafter`) live in model_free.py. This module has `load_drafter` (None | "none" | "ngram" | a
speculator directory, with the pairing check), the tree defaults and `prune_tree`.

Drafters that set `needs_token_ids = True` also get `features["input_ids"]` [n] (the tokens at the absorbed
positions); drafters that set `samples_drafts = True` propose sampled chains / trees (TreeConfig kinds "chain" /
"sampled", with draft_probs) that the engine may choose at T > 0 (model speculators do; n-gram drafts cannot). Not here: verification, the target forward, tree policies of model speculators (models/drafting.py).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from speculators.core.config import TargetConfig, TreeConfig
from speculators.core.errors import SpeculatorsError
from speculators.core.pairing import check_pairing, read_pairing
from speculators.core.target import base_model, file_stat_key, fingerprint_target
from speculators.core.trees import DraftTree, depths_of
from speculators.models.io import load_speculator, target_weights
from speculators.models.packed import pack_linears, packed_float16_available
from speculators.runtime.drafters.graft import NgramGraft
from speculators.runtime.drafters.model_free import NgramDrafter, NoDrafter

if TYPE_CHECKING:
    from speculators.core.target import LoadedTarget

REQUIRED_SPECULATOR_FILES = ("config.json", "model.safetensors", "pairing.json")


# On a CPU every verified node costs target time (a 17-node forward of the house target costs 1.5x a 1-node one),
# so narrow trees win there: depth 5, top-2, 10 nodes measured fastest among chains of 4-5 and top-2/3/4 trees of
# 8-16 nodes (README, runtime). On a GPU extra nodes are nearly free: the recipe default (top-4, 16 nodes).
CPU_TREE = {"kind": "dynamic", "depth": 5, "topk": 2, "budget": 10}


def default_tree(drafter: Any, device: torch.device | str = "cpu") -> TreeConfig:
    """The drafter's own tree settings (`default_tree()` when it has one), else the defaults for `device`."""
    own = getattr(drafter, "default_tree", None)
    tree = own() if callable(own) else None
    if tree is not None:
        return tree
    return TreeConfig(**CPU_TREE) if str(device).startswith("cpu") else TreeConfig()


def depth_tree(tree: TreeConfig, depth: int) -> TreeConfig:
    """The tree settings of a cycle drafting to `depth`: the node budget grows with the depth (top-k nodes per
    level, capped by the configured budget) so that shallow trees stay small."""
    budget = tree.budget if tree.kind == "chain" else min(tree.budget, max(1, tree.topk * depth))
    return dataclasses.replace(tree, depth=depth, budget=budget)


def prune_tree(tree: DraftTree, max_depth: int, max_nodes: int) -> DraftTree:
    """Keep nodes of depth <= max_depth among the first `max_nodes` nodes (root included). Dropping whole
    depths or trailing siblings (by index) never depends on the drafted values, so every verify mode stays
    lossless on the pruned tree."""
    if tree.size <= max_nodes and tree.max_depth <= max_depth:
        return tree
    depths = depths_of(tree.parents)  # [N]
    keep = (depths <= max_depth) & (torch.arange(tree.size) < max(1, max_nodes))  # [N]
    keep[0] = True
    # a node is kept only if its parent is (parents precede children, so one pass suffices)
    parents = tree.parents.tolist()
    for i in range(1, tree.size):
        if keep[i] and not keep[parents[i]]:
            keep[i] = False
    idx = torch.nonzero(keep).flatten()  # [M]
    remap = {int(old): new for new, old in enumerate(idx.tolist())}
    new_parents = torch.tensor([-1] + [remap[parents[int(i)]] for i in idx[1:].tolist()], dtype=torch.long)
    probs = tree.draft_probs[idx.to(tree.draft_probs.device)] if tree.draft_probs is not None else None
    return DraftTree(tokens=tree.tokens[idx.to(tree.tokens.device)], parents=new_parents, mode=tree.mode,
                     draft_probs=probs)


# ----------------------------------------------------------------------------------------------------------------
# loading


@dataclass
class DrafterInfo:
    name: str  # "none", "ngram" or the speculator directory
    family: str  # "none", "ngram", "eagle3", "medusa", "mtp"
    directory: str | None = None
    pairing_warnings: list[str] = field(default_factory=list)
    precision: str = ""  # how a model drafter computes (`prepare_for_drafting`)
    revision: str | None = None  # the draft revision (pairing.json), for a speculator directory


def resolve_speculator_dir(path: str | Path) -> Path:
    """A speculator directory; a training `checkpoints/` dir resolves through its `best` then `latest` file."""
    d = Path(path)
    if not d.exists():
        raise SpeculatorsError(f"speculator not found: {path} (pass a checkpoint/export directory, 'ngram' or "
                               f"'none')")
    if not d.is_dir():
        raise SpeculatorsError(f"speculator {path} is a file; pass its directory")
    if not (d / "config.json").exists():
        for pointer in ("best", "latest"):
            if (d / pointer).is_file():
                name = (d / pointer).read_text().strip()
                if name:
                    return resolve_speculator_dir(d / name)
    missing = [f for f in REQUIRED_SPECULATOR_FILES if not (d / f).is_file()]
    if missing:
        raise SpeculatorsError(f"speculator directory {d} is missing {', '.join(missing)}; re-export or re-save it "
                               f"(a speculator dir holds {', '.join(REQUIRED_SPECULATOR_FILES)})")
    return d


def _stat_key(path: str) -> tuple:
    """What changes whenever a file of the directory changes: size, mtime, and ctime + inode (which no user tool
    can set back: restoring the old mtime after a same-size edit still moves the ctime)."""
    p = Path(path)
    if not p.is_dir():
        return (path,)
    return tuple(sorted((f.name, *file_stat_key(f)) for f in p.iterdir() if f.is_file()))


_FINGERPRINTS: dict[tuple, dict] = {}


def target_fingerprint(target: LoadedTarget) -> dict:
    """`fingerprint_target(...).to_dict()` of a loaded target, cached in-process by the files' size, mtime, ctime
    and inode (file hashes are cached on disk by `speculators.core.target` under the same key)."""
    cfg = target.cfg
    key = (cfg.name_or_path, cfg.revision, cfg.adapter, cfg.adapter_revision, _stat_key(cfg.name_or_path),
           _stat_key(cfg.adapter) if cfg.adapter else ())
    if key not in _FINGERPRINTS:
        _FINGERPRINTS[key] = fingerprint_target(cfg, tokenizer=target.tokenizer,
                                                model_config=base_model(target.model).config).to_dict()
    return _FINGERPRINTS[key]


def draft_dtype_for(target: LoadedTarget, draft_dtype: str | torch.dtype | None = "auto") -> torch.dtype:
    """The dtype of a speculator's weights while drafting. "auto": float16 on a CPU serving a float32 target, else
    the target's dtype.

    Drafting precision never changes the output (every draft is verified by the target), only speed and the
    acceptance rate. On a CPU, float16 weights run as `packed.PackedLinear` products with float32 activations where
    the kernel exists (see `prepare_for_drafting`): at drafting sizes the draft's matrix products are 2-3x faster
    than in float32, and float16 attention (2.5x slower than float32 on CPU) is avoided. Rounding the draft's
    weights to float16 left tau on the code cohorts unchanged on the house target (2.91 vs 2.92 with float32)."""
    return draft_dtype_on(str(target.device), target.dtype, draft_dtype)


def draft_dtype_on(device: str, target_dtype: torch.dtype, draft_dtype: str | torch.dtype | None = "auto"
                   ) -> torch.dtype:
    """`draft_dtype_for` before anything is loaded: from the device and the target's dtype."""
    if isinstance(draft_dtype, torch.dtype):
        return draft_dtype
    if draft_dtype in (None, "", "auto"):
        return torch.float16 if device.startswith("cpu") and target_dtype == torch.float32 else target_dtype
    choices = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if draft_dtype not in choices:
        raise SpeculatorsError(f"draft dtype must be auto, {', '.join(choices)}; got {draft_dtype!r}")
    return choices[draft_dtype]


def prepare_for_drafting(spec: torch.nn.Module, device: torch.device | str, dtype: torch.dtype) -> str:
    """Move a loaded speculator to `device` for drafting with `dtype` weights; returns how it computes ("float16
    weights, float32 activations" on a CPU with the packed kernel, else the dtype's name). Inference only."""
    packed = dtype == torch.float16 and torch.device(device).type == "cpu" and packed_float16_available()
    spec.to(device=device, dtype=torch.float32 if packed else dtype)
    if packed:
        pack_linears(spec)
    spec.eval()
    return "float16 weights, float32 activations" if packed else str(dtype).removeprefix("torch.")


def paired_target(speculator: str | os.PathLike | None) -> TargetConfig:
    """The target a speculator directory's pairing.json names (its hub commit for hub targets, its adapter), or
    the house target when there is no such directory (plain decoding, n-gram)."""
    if speculator is None or str(speculator) in ("", "none", "ngram"):
        return TargetConfig()
    want = read_pairing(resolve_speculator_dir(speculator))["target"]
    hub = not str(want.get("revision", "")).startswith("local:")
    adapter_rev = want.get("adapter_revision")
    return TargetConfig(name_or_path=want["name_or_path"], revision=want["revision"] if hub else None,
                        adapter=want.get("adapter"),
                        adapter_revision=adapter_rev if adapter_rev and not adapter_rev.startswith("local:") else None)


def load_drafter(speculator: str | os.PathLike | None, target: LoadedTarget, *,
                 allow_revision_mismatch: bool = False, draft_dtype: str | torch.dtype | None = "auto",
                 ngram_graft: int = 0) -> tuple[Any, DrafterInfo]:
    """None / "none" -> NoDrafter, "ngram" -> NgramDrafter, a directory -> its speculator (pairing checked), in
    `draft_dtype_for(target, draft_dtype)`, with up to `ngram_graft` prompt-lookup nodes grafted onto its trees
    (`graft.NgramGraft`; 0 = the speculator alone)."""
    if ngram_graft < 0:
        raise SpeculatorsError(f"ngram_graft must be >= 0 (0 = off), got {ngram_graft}")
    if speculator is None or str(speculator) in ("", "none"):
        return NoDrafter(), DrafterInfo("none", "none")
    if str(speculator) == "ngram":
        return NgramDrafter(), DrafterInfo("ngram", "ngram")

    directory = resolve_speculator_dir(speculator)
    record = read_pairing(directory)
    warnings = check_pairing(record, target_fingerprint(target), allow_revision_mismatch=allow_revision_mismatch,
                             check_draft_dir=directory)
    spec = load_speculator(directory, target_weights(target.model))
    want = record.get("draft", {}).get("layer_ids")
    taps = spec.required_features().tap_layer_ids
    if want is not None and taps is not None and list(want) != list(taps):
        raise SpeculatorsError(f"speculator {directory}: pairing.json records layer ids {want} but the model taps "
                               f"{list(taps)}; the directory is inconsistent, re-export it")
    precision = prepare_for_drafting(spec, target.device, draft_dtype_for(target, draft_dtype))
    family = getattr(spec, "family", record.get("draft", {}).get("family", "?"))
    info = DrafterInfo(str(directory), family, str(directory), warnings, precision,
                       record.get("draft", {}).get("revision"))
    if ngram_graft:
        return NgramGraft(spec, max_new_nodes=ngram_graft), dataclasses.replace(info, name=f"{info.name}+ngram")
    return spec, info
