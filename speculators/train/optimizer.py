"""The training optimizer: AdamW over every trainable parameter, or Muon over the draft's weight matrices with AdamW
over the rest (`train.optimizer: adamw | muon`).

Muon (`MuonAdamW`): each 2-D weight matrix (not an embedding or output head) takes a Nesterov momentum step whose
direction is orthogonalised by five quintic Newton-Schulz iterations, run in float32 (in bf16 the iterations took
73 s a step on a CPU without bf16 units, issue 54), scaled by 0.2 * sqrt(max(rows, cols)) so its update has the RMS
an AdamW update has and one learning rate serves both groups; decoupled weight decay `MUON_WEIGHT_DECAY`. Norms,
biases, embeddings and heads take AdamW steps with the recipe's betas and weight decay. One optimizer object holds
both groups, so the schedule, gradient clipping, accelerate's wrapping and checkpoints see one optimizer.

What it does not do: shard the orthogonalisation across processes (each process orthogonalises the full gradient it
holds; under DeepSpeed ZeRO the recipe keeps AdamW), or tune the learning rate.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from speculators.core.config import TrainConfig
from speculators.core.errors import SpeculatorsError
from speculators.train.accelerator import deepspeed_launched

MUON_WEIGHT_DECAY = 0.1  # the Muon group's decoupled weight decay (vLLM's trainer's default)
MUON_MOMENTUM = 0.95
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic iteration's (a, b, c)
NS_STEPS = 5
ADAMW_NAME_HINTS = ("embed", "lm_head")  # 2-D matrices that still take AdamW steps


def orthogonalised(update: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """Approximately U V^T of `update` [A, B] (its singular values pushed towards 1), in float32."""
    x = update.float()  # [A, B]
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T  # [min, max]: the Gram matrix is the small one
    x = x / x.norm().clamp_min(eps)  # spectral norm <= 1
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.T  # [min, min]
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.T


def is_muon_matrix(name: str, param: torch.Tensor) -> bool:
    """A 2-D weight matrix (both dims > 1) that is not an embedding or an output head."""
    return param.ndim == 2 and min(param.shape) > 1 and not any(h in name for h in ADAMW_NAME_HINTS)


class MuonAdamW(torch.optim.Optimizer):
    """Muon steps for the groups with `muon=True`, AdamW steps for the others (see the module docstring)."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], weight_decay: float,
                 eps: float = 1e-8) -> None:
        super().__init__(groups, dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, muon=False))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch's signature)
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                (self._muon_step if group["muon"] else self._adamw_step)(p, group)
        return loss

    def _muon_step(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if "momentum" not in state:
            state["momentum"] = torch.zeros_like(p, dtype=torch.float32)
        m = state["momentum"]  # [A, B]
        g = p.grad.float()
        m.mul_(MUON_MOMENTUM).add_(g)
        direction = orthogonalised(g.add(m, alpha=MUON_MOMENTUM))  # Nesterov
        scale = 0.2 * math.sqrt(max(p.shape))  # AdamW's update RMS
        p.mul_(1.0 - group["lr"] * MUON_WEIGHT_DECAY)
        p.add_(direction.to(p.dtype), alpha=-group["lr"] * scale)

    def _adamw_step(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if "exp_avg" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = float(state["step"])
        g = p.grad.float()
        state["exp_avg"].lerp_(g, 1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (state["exp_avg_sq"] / (1.0 - beta2 ** step)).sqrt_().add_(group["eps"])
        p.mul_(1.0 - group["lr"] * group["weight_decay"])
        p.add_((state["exp_avg"] / (1.0 - beta1 ** step) / denom).to(p.dtype), alpha=-group["lr"])


def check_optimizer_options(t: TrainConfig, deepspeed: bool | None = None) -> None:
    """One error line for an optimizer setting this module cannot run (checked before a run writes anything).
    `deepspeed`: whether the run is (or will be launched) under DeepSpeed; None: as `accelerate launch` said in this
    process's environment (the launcher passes what the recipe's parsed accelerate config says)."""
    if t.optimizer not in ("adamw", "muon"):
        raise SpeculatorsError(f"train.optimizer must be adamw or muon, got {t.optimizer!r}")
    if deepspeed is None:
        deepspeed = deepspeed_launched()
    if t.optimizer == "muon" and deepspeed:
        raise SpeculatorsError("train.optimizer=muon is not supported with DeepSpeed (its ZeRO partitions the "
                               "matrices Muon orthogonalises); use train.optimizer=adamw")


def build_optimizer(module: nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer `t.optimizer` names over the module's trainable parameters."""
    check_optimizer_options(t)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise SpeculatorsError("the speculator has no trainable parameters")
    betas = (float(t.betas[0]), float(t.betas[1]))
    if t.optimizer == "adamw":
        return torch.optim.AdamW([p for _, p in named], lr=t.lr, betas=betas, weight_decay=t.weight_decay)
    matrices = [p for n, p in named if is_muon_matrix(n, p)]
    rest = [p for n, p in named if not is_muon_matrix(n, p)]
    groups = [g for g in ({"params": matrices, "muon": True}, {"params": rest, "muon": False}) if g["params"]]
    return MuonAdamW(groups, lr=t.lr, betas=betas, weight_decay=t.weight_decay)
