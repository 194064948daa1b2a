"""`train.init_from`: a new draft revision starts from a running one's weights (fresh optimizer and schedule), as
`speculators adapt` does when it learns from served traffic.

The revision (an export or checkpoint directory) must be of the recipe's family and settings (every tensor the
recipe's speculator has, with the same shape) and paired with the recipe's target (same content and tokenizer);
anything else is refused in one line. Not here: exact resume of an interrupted run (checkpoint.py, `train.resume`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from speculators.core.errors import SpeculatorsError
from speculators.core.pairing import read_pairing
from speculators.models.base import TargetWeights
from speculators.models.io import load_speculator


def load_init_weights(spec: Any, directory: str, fingerprint: dict, weights: TargetWeights) -> str:
    """Copy the weights of the revision in `directory` into the freshly built `spec`; returns its draft revision."""
    path = Path(directory)
    want = read_pairing(path)
    theirs_target = want["target"]
    if theirs_target["content_hash"] != fingerprint["content_hash"] or \
            theirs_target["tokenizer_hash"] != fingerprint["tokenizer_hash"]:
        raise SpeculatorsError(f"train.init_from {directory} was trained for {theirs_target['name_or_path']}@"
                               f"{theirs_target['revision']}, not the recipe's target {fingerprint['name_or_path']}@"
                               f"{fingerprint['revision']}")
    init = load_speculator(path, weights)
    if type(init) is not type(spec):
        raise SpeculatorsError(f"train.init_from {directory} is a {type(init).__name__}, but the recipe trains a "
                               f"{type(spec).__name__}")
    mine, theirs = spec.state_dict(), init.state_dict()
    for name, tensor in mine.items():
        other = theirs.get(name)
        if other is None or tuple(other.shape) != tuple(tensor.shape):
            shape = None if other is None else tuple(other.shape)
            raise SpeculatorsError(f"train.init_from {directory}: {name} is {shape} there but {tuple(tensor.shape)} in "
                                   "the recipe's speculator; set the speculator settings that revision was trained "
                                   "with")
    spec.load_state_dict({name: theirs[name].to(tensor.dtype) for name, tensor in mine.items()})
    return str(want["draft"]["revision"])
