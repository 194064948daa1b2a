"""An adversarial drafter for the runtime tests: it drafts with the target itself, behind decoys.

`OracleDrafter(model)` proposes, at every depth, the target's own best token (from a greedy continuation of the
committed context computed by the Hugging Face model) as the SECOND child of the previous right node, behind a decoy
first child (the target's runner-up there), and gives each decoy a child of its own (the third-ranked token):

    root ── decoy_1 ── leaf_1          node order: 0 root, 1 decoy_1, 2 right_1, 3 leaf_1, 4 decoy_2, 5 right_2, ...
        └── right_1 ── decoy_2 ── leaf_2
                   └── right_2 ── ...

So at T = 0 the accepted path skips every first child (tau near depth + 1) and the KV cache gathers a path with
gaps (2, 5, 8, ...); under sampling, rejections happen at every depth and the next token is drawn from residuals at
depth >= 2 (after a decoy is rejected, or below an accepted decoy). `CycleLog` (an Engine subclass) records what
each verification did, so tests can assert that these deep paths were really exercised.

`exact_prefix_law` gives the exact law of the first n generated tokens (direct forwards with the runtime's own
sampling operator) for chi-square tests; `chi_square_p` scores observed prefixes against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from speculators.core.sampling import SamplingParams, logits_to_probs
from speculators.core.trees import DraftTree, depths_of
from speculators.models.base import FeatureRequest
from speculators.runtime.engine import Engine


@dataclass
class OracleState:
    tokens: list[int] = field(default_factory=list)  # the committed context, ending with the next root


class OracleDrafter:
    """See the module docstring."""

    name = "oracle"
    family = "oracle"
    needs_token_ids = True

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache: dict[tuple, list[list[int]]] = {}  # (context, depth) -> per level the 3 best token ids

    def required_features(self) -> FeatureRequest:
        return FeatureRequest(tap_layer_ids=None, last_hidden=False)

    def new_state(self, max_len: int, device: torch.device | str) -> OracleState:
        return OracleState()

    def absorb(self, state: OracleState, features: dict[str, torch.Tensor], next_tokens: torch.Tensor) -> None:
        if not state.tokens:
            state.tokens.extend(int(t) for t in features["input_ids"][:1].tolist())
        state.tokens.extend(int(t) for t in next_tokens.reshape(-1).tolist())

    def levels(self, context: list[int], depth: int) -> list[list[int]]:
        """The target's 3 best tokens at each of `depth` levels along its own greedy continuation of `context`."""
        key = (tuple(context), depth)
        if key not in self.cache:
            ids = torch.tensor([context])
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                          max_new_tokens=depth, output_logits=True, return_dict_in_generate=True,
                                          pad_token_id=self.model.generation_config.pad_token_id)
            self.cache[key] = [torch.topk(step[0].double(), 3).indices.tolist() for step in out.logits]
        return self.cache[key]

    def propose(self, state: OracleState, root_token: int, tree, sampling: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        context = state.tokens or [int(root_token)]
        assert context[-1] == int(root_token), "the drafter's context must end with the root"
        tokens, parents, right = [int(root_token)], [-1], 0
        for best, second, third in self.levels(context, tree.depth):
            decoy = len(tokens)
            tokens += [second, best, third]
            parents += [right, right, decoy]
            right = decoy + 1
        return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents),
                         mode="greedy" if sampling.greedy else "deterministic")


class CycleLog(Engine):
    """An Engine that counts, per verification, what the walk did (behaviour unchanged):
    skipped_first_child: cycles whose accepted path went through a node that is not its parent's first child;
    gathered_with_gaps: cycles whose committed path [0, *accepted] is not 0, 1, 2, ...;
    residual_deep: sampled cycles whose next token was drawn after rejections at draft depth >= 2;
    deepest_accept: the longest accepted path."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen = dict.fromkeys(("cycles", "skipped_first_child", "gathered_with_gaps", "residual_deep",
                                   "deepest_accept"), 0)

    def _verify(self, tree, target_row, params, generator):
        accepted, next_token = super()._verify(tree, target_row, params, generator)
        parents = tree.parents.tolist()
        first: dict[int, int] = {}
        for i, p in enumerate(parents[1:], 1):
            first.setdefault(p, i)
        last = accepted[-1] if accepted else 0
        seen = self.seen
        seen["cycles"] += 1
        seen["skipped_first_child"] += any(first[parents[a]] != a for a in accepted)
        seen["gathered_with_gaps"] += [0, *accepted] != list(range(len(accepted) + 1))
        seen["residual_deep"] += not params.greedy and last in first and int(depths_of(tree.parents)[last]) >= 1
        seen["deepest_accept"] = max(seen["deepest_accept"], len(accepted))
        return accepted, next_token


def exact_prefix_law(model: torch.nn.Module, prompt: list[int], params: SamplingParams, length: int,
                     min_mass: float, eos: set[int]) -> tuple[dict[tuple, float], set[int]]:
    """Exact P(first `length` generated tokens) for every prefix with P >= min_mass (an EOS ends a prefix early),
    from direct forwards through `logits_to_probs`; and the support of the first token."""
    law: dict[tuple, float] = {(): 1.0}
    support: set[int] = set()
    for step in range(length):
        grown: dict[tuple, float] = {}
        for prefix, p in law.items():
            if len(prefix) < step or (prefix and prefix[-1] in eos):
                grown[prefix] = p
                continue
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1].double()
            row = logits_to_probs(logits, params)  # [V]
            if step == 0:
                support = set(torch.nonzero(row > 0).flatten().tolist())
            for t in torch.nonzero(p * row >= min_mass).flatten().tolist():
                grown[(*prefix, t)] = p * float(row[t])
        law = grown
    return law, support


def chi_square_p(law: dict[tuple, float], observed: list[tuple], samples: int) -> float:
    """Pearson chi-square p-value of observed prefixes against `law` (rare cells pooled into one 'other' bin with
    expectation >= 5)."""
    from scipy.stats import chi2

    counts: dict[tuple, int] = {}
    for key in observed:
        counts[key] = counts.get(key, 0) + 1
    expected = dict(law)
    other = max(0.0, 1.0 - sum(expected.values()))
    for key in sorted(expected, key=expected.get):
        if other * samples >= 5:
            break
        other += expected.pop(key)
    observed_other = samples - sum(counts.get(k, 0) for k in expected)
    stat = sum((counts.get(k, 0) - samples * p) ** 2 / (samples * p) for k, p in expected.items())
    stat += (observed_other - samples * other) ** 2 / (samples * other) if other > 0 else 0.0
    return float(chi2.sf(stat, len(expected) + (other > 0) - 1))
